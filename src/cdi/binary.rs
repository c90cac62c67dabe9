//! nvdra's own binary on the host, for the CDI hooks that run it (the per-container memory
//! limits, [`super::memlimit`], and the MPS start gate): the runtime runs a hook on the host, so
//! the plugin copies the binary it runs from into a host directory at start.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow};

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

/// What a hook reads of the runtime's OCI state on its stdin (the runtime spec's `State`).
#[derive(Debug, Default, PartialEq, Eq, serde::Deserialize)]
pub struct OciState {
    /// The container's init, once created; absent (or 0) at `poststop`.
    #[serde(default)]
    pub pid: Option<u32>,
    #[serde(default)]
    pub bundle: Option<PathBuf>,
}

impl OciState {
    /// The state the runtime writes on the hook's stdin.
    pub fn from_stdin() -> Result<Self> {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("reading the container's OCI state from stdin")?;
        Self::parse(&text)
    }

    pub fn parse(text: &str) -> Result<Self> {
        serde_json::from_str(text)
            .with_context(|| format!("the OCI state on stdin is not JSON: {}", text.trim()))
    }

    pub fn pid(&self) -> Result<u32> {
        self.pid.filter(|p| *p > 0).ok_or_else(|| {
            anyhow!("the OCI state on stdin has no pid: is this a createRuntime hook?")
        })
    }

    /// The user the container's process runs as: `process.user.uid` of the bundle's
    /// `config.json`; 0 when the config names none.
    pub fn process_uid(&self) -> Result<u32> {
        let bundle = self
            .bundle
            .as_ref()
            .ok_or_else(|| anyhow!("the OCI state on stdin names no bundle"))?;
        let path = bundle.join("config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading the container's config {}", path.display()))?;
        let config: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        match config.pointer("/process/user/uid") {
            None => Ok(0),
            Some(u) => u
                .as_u64()
                .and_then(|u| u32::try_from(u).ok())
                .ok_or_else(|| anyhow!("{}: process.user.uid {u} is not a uid", path.display())),
        }
    }
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

    #[test]
    fn the_uid_is_the_bundles_process_user() {
        let dir = tempfile::tempdir().unwrap();
        let state = |bundle: &Path| {
            format!(
                r#"{{"ociVersion":"1.2.0","id":"c1","status":"creating","pid":42,"bundle":"{}"}}"#,
                bundle.display()
            )
        };
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"process":{"user":{"uid":1000,"gid":1000},"args":["sh"]}}"#,
        )
        .unwrap();
        assert_eq!(
            OciState::parse(&state(dir.path()))
                .unwrap()
                .process_uid()
                .unwrap(),
            1000
        );
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"process":{"args":["sh"]}}"#,
        )
        .unwrap();
        assert_eq!(
            OciState::parse(&state(dir.path()))
                .unwrap()
                .process_uid()
                .unwrap(),
            0
        );
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"process":{"user":{"uid":-1}}}"#,
        )
        .unwrap();
        let e = OciState::parse(&state(dir.path()))
            .unwrap()
            .process_uid()
            .unwrap_err()
            .to_string();
        assert!(e.contains("is not a uid"), "{e}");
        let e = OciState::parse(r#"{"pid":1}"#)
            .unwrap()
            .process_uid()
            .unwrap_err()
            .to_string();
        assert!(e.contains("names no bundle"), "{e}");
        let e = OciState::parse(&state(&dir.path().join("gone")))
            .unwrap()
            .process_uid()
            .unwrap_err()
            .to_string();
        assert!(e.contains("reading the container's config"), "{e}");
    }
}
