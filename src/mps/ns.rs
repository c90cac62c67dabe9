//! A daemon's own `/dev/shm`: `<id>/shm` is a tmpfs of its own ([`ensure_tmpfs`], sized, so
//! that no tenant can fill the node's `/run`, and gone with the daemon's release), and the child
//! gets a private mount namespace (so nothing it mounts reaches the host's), with `<id>/shm`
//! bound on `/dev/shm`, where MPS keeps the memory its server and clients share; every client
//! container mounts the same tmpfs there. The child
//! also dies with the host (`PR_SET_PDEATHSIG`), as it does when the host's container ends.
//!
//! Needs CAP_SYS_ADMIN (the host's DaemonSet grants it); without it the spawn fails with EPERM,
//! which the caller turns into an error that says so.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

/// Makes `cmd` run in a private mount namespace with `shm` on `/dev/shm`, killed when the
/// thread that spawns it ends (spawn from a thread that lives as long as the host).
pub fn private_shm(cmd: &mut Command, shm: &Path) -> io::Result<()> {
    let source = CString::new(shm.as_os_str().as_bytes())?;
    let target = c"/dev/shm";
    let root = c"/";
    // SAFETY: the closure runs in the child between fork and exec, where only async-signal-safe
    // functions may be called: it calls unshare, mount and prctl (system calls) with C strings
    // made before the fork, and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return Err(io::Error::last_os_error());
            }
            // Mounts below stay in this namespace, not the host's.
            if libc::mount(
                std::ptr::null(),
                root.as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            if libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            ) != 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(())
}

/// Only `PR_SET_PDEATHSIG`: for hosts told to share the host's `/dev/shm` (no CAP_SYS_ADMIN).
pub fn die_with_parent(cmd: &mut Command) {
    // SAFETY: as in `private_shm`: one system call between fork and exec, no allocation.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Mounts a tmpfs of `size` bytes (mode 1777, no devices, no setuid) on `dir` unless one is
/// mounted there already (a host restarted over its daemons' directories).
pub fn ensure_tmpfs(dir: &Path, size: u64) -> io::Result<()> {
    if is_mount_point(dir)? {
        return Ok(());
    }
    let target = CString::new(dir.as_os_str().as_bytes())?;
    let data = CString::new(format!("size={size},mode=1777"))?;
    // SAFETY: mount(2) with C strings that live across the call; no memory is shared.
    let r = unsafe {
        libc::mount(
            c"tmpfs".as_ptr(),
            target.as_ptr(),
            c"tmpfs".as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            data.as_ptr().cast(),
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Detaches whatever is mounted on `dir` (lazily: it goes once nothing holds it); nothing when
/// nothing is mounted there or `dir` is gone.
pub fn unmount(dir: &Path) -> io::Result<()> {
    match is_mount_point(dir) {
        Ok(true) => {}
        Ok(false) => return Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    }
    let target = CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: umount2(2) with a C string that lives across the call.
    if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether something is mounted on `dir`: it is on another device than its parent.
pub fn is_mount_point(dir: &Path) -> io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let here = std::fs::metadata(dir)?;
    let parent = std::fs::metadata(dir.join(".."))?;
    Ok(here.dev() != parent.dev())
}
