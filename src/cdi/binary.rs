//! nvdra's own binary on the host, for the CDI hooks that run it (the per-container memory
//! limits, [`super::memlimit`], and the MPS start gate): the runtime runs a hook on the host, so
//! the plugin copies the binary it runs from into a host directory at start.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Copies the running binary to `dir/nvdra` (a host directory: the hooks run on the host) unless
/// an identical copy is there, atomically, so a container being created meanwhile runs either
/// the old or the new binary, never half of one. Returns the installed path.
pub fn install_hook(dir: &Path) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("finding nvdra's own binary")?;
    let binary = std::fs::read(&exe).with_context(|| format!("reading {}", exe.display()))?;
    let target = dir.join("nvdra");
    if std::fs::read(&target).is_ok_and(|old| old == binary) {
        return Ok(target);
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let tmp = dir.join(".nvdra.tmp");
    let write = || -> std::io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o755)
            .open(&tmp)?;
        f.write_all(&binary)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &target)
    };
    write().with_context(|| format!("installing nvdra's hook binary at {}", target.display()))?;
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn install_hook_copies_the_running_binary_once() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        let path = install_hook(&bin).unwrap();
        assert_eq!(path, bin.join("nvdra"));
        let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(
            std::fs::read(&path).unwrap() == exe,
            "the copy is the running binary"
        );
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o755
        );
        let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
        install_hook(&bin).unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().modified().unwrap(),
            modified,
            "not rewritten"
        );
        assert!(!bin.join(".nvdra.tmp").exists());
    }
}
