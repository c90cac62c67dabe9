//! A daemon's own `/dev/shm`: the child gets a private mount namespace (so nothing it mounts
//! reaches the host's), with `<id>/shm` bound on `/dev/shm`, where MPS keeps the memory its
//! server and clients share; every client container mounts the same directory there. The child
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
