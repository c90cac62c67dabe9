//! Writing a file so that a crash leaves either the old or the new content, never a mix: the one
//! way every nvdra writer (checkpoint, CDI specs, the directory API's slices) replaces a file.
//!
//! Protocol: a temporary file in the target's directory, named `.<file name>.<random>.tmp`
//! (hidden, and not ending in `.yaml` or `.json`, so directory scanners — CDI registries, the
//! directory API — skip it); write; fsync; rename over the target; fsync the directory, so the
//! rename itself survives a power loss.
//!
//! [`Durability::Atomic`] skips the two fsyncs, for files that start-up rebuilds from a durable
//! record (the claims' CDI specs, from the checkpoint): readers still see the old or the new
//! content, and so does this process after a crash of its own (the page cache keeps both), but a
//! power loss may leave the old content, an empty file, or none.
//!
//! Invariants:
//! - Nothing is left behind on failure: until the rename, the temporary file is owned by a
//!   [`tempfile::NamedTempFile`], which removes it when dropped.
//! - Errors name the target file (the temporary name is random and already gone) and keep the
//!   `io::Error` as their source, so a full disk reads
//!   "cannot write <path>: No space left on device (os error 28)".

use std::fs::Permissions;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// Mode of the files written here (before the umask), as `File::create` would give them.
pub const MODE: u32 = 0o644;

/// A step of [`write`] that failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot {step} {path}")]
pub struct Error {
    /// What was being done, e.g. `write` or `sync the directory of`.
    pub step: &'static str,
    /// The file being replaced.
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

impl Error {
    /// The I/O error underneath.
    pub fn io(&self) -> &io::Error {
        &self.source
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How far a replacement or removal goes before it returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// The file and its directory are fsync'd: the change survives a power loss.
    Durable,
    /// Atomic for readers and across a crash of the process, not across a power loss: for files
    /// the caller rebuilds at start-up from something durable.
    Atomic,
}

/// Replaces `path` with `bytes` durably. The directory must exist.
pub fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    write_with(path, |w| w.write_all(bytes))
}

/// Replaces `path` with `bytes` as `durability` says. The directory must exist.
pub fn write_as(path: &Path, bytes: &[u8], durability: Durability) -> Result<()> {
    replace(path, durability, |w| w.write_all(bytes))
}

/// Like [`write`], with the content produced by `fill` (which may fail; then nothing changes and
/// no temporary file remains).
pub fn write_with(path: &Path, fill: impl FnOnce(&mut dyn Write) -> io::Result<()>) -> Result<()> {
    replace(path, Durability::Durable, fill)
}

fn replace(
    path: &Path,
    durability: Durability,
    fill: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> Result<()> {
    let fail = |step: &'static str| {
        move |source| Error {
            step,
            path: path.to_path_buf(),
            source,
        }
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path.file_name().ok_or_else(|| {
        fail("write")(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the path names no file",
        ))
    })?;
    let mut prefix = std::ffi::OsString::from(".");
    prefix.push(name);
    prefix.push(".");
    let mut tmp = tempfile::Builder::new()
        .prefix(&prefix)
        .suffix(".tmp")
        .permissions(Permissions::from_mode(MODE))
        .tempfile_in(dir)
        .map_err(fail("create a temporary file for"))?;
    fill(tmp.as_file_mut()).map_err(fail("write"))?;
    if durability == Durability::Durable {
        tmp.as_file().sync_all().map_err(fail("sync"))?;
    }
    // On failure the returned temporary file is dropped here, which removes it.
    tmp.persist(path)
        .map_err(|e| fail("rename into place")(e.error))?;
    if durability == Durability::Durable {
        sync_dir(dir).map_err(fail("sync the directory of"))?;
    }
    Ok(())
}

/// Removes `path` durably; `Ok(false)` when there was nothing to remove.
pub fn remove(path: &Path) -> Result<bool> {
    remove_as(path, Durability::Durable)
}

/// Removes `path` as `durability` says; `Ok(false)` when there was nothing to remove.
pub fn remove_as(path: &Path, durability: Durability) -> Result<bool> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(source) => {
            return Err(Error {
                step: "remove",
                path: path.to_path_buf(),
                source,
            });
        }
    }
    if durability == Durability::Atomic {
        return Ok(true);
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    sync_after_remove(dir).map_err(|source| Error {
        step: "sync the directory of",
        path: path.to_path_buf(),
        source,
    })?;
    Ok(true)
}

/// Makes a removal from `dir` durable. Another process may remove the directory itself right
/// after the file (an MPS host clearing a released daemon's directory): the file is gone with
/// it, which is what was asked.
fn sync_after_remove(dir: &Path) -> io::Result<()> {
    match sync_dir(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    fn chain(e: &(dyn std::error::Error + 'static)) -> String {
        crate::report::chain(e).to_string()
    }

    #[test]
    fn replaces_the_file_and_leaves_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.json");
        write(&path, b"one").unwrap();
        write(&path, b"two").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(names(dir.path()), vec!["a.json"]);
    }

    #[test]
    fn an_atomic_replace_and_remove_behave_like_the_durable_ones_for_readers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spec.yaml");
        write_as(&path, b"one", Durability::Atomic).unwrap();
        write_as(&path, b"two", Durability::Atomic).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(names(dir.path()), vec!["spec.yaml"]);
        let err = replace(&path, Durability::Atomic, |w| {
            w.write_all(b"half")?;
            Err(io::Error::from_raw_os_error(28))
        })
        .unwrap_err();
        assert_eq!(err.step, "write");
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        assert_eq!(names(dir.path()), vec!["spec.yaml"]);
        assert!(remove_as(&path, Durability::Atomic).unwrap());
        assert!(!remove_as(&path, Durability::Atomic).unwrap());
        assert_eq!(names(dir.path()), Vec::<String>::new());
    }

    #[test]
    fn a_failed_write_keeps_the_old_file_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("checkpoint.json");
        write(&path, b"old").unwrap();
        let mut seen_tmp = None;
        let err = write_with(&path, |w| {
            w.write_all(b"half of the new")?;
            // The temporary file exists while the content is written, and is hidden.
            seen_tmp = Some(names(dir.path()));
            Err(io::Error::from_raw_os_error(28))
        })
        .unwrap_err();
        let during = seen_tmp.unwrap();
        assert_eq!(during.len(), 2, "{during:?}");
        assert!(
            during
                .iter()
                .any(|n| n.starts_with(".checkpoint.json.") && n.ends_with(".tmp")),
            "{during:?}"
        );
        assert_eq!(names(dir.path()), vec!["checkpoint.json"]);
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        assert_eq!(err.io().raw_os_error(), Some(28));
        assert_eq!(
            chain(&err),
            format!(
                "cannot write {}: No space left on device (os error 28)",
                path.display()
            )
        );
    }

    #[test]
    fn a_failed_rename_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        // A directory cannot be replaced by a file.
        let path = dir.path().join("taken");
        std::fs::create_dir(&path).unwrap();
        let err = write(&path, b"x").unwrap_err();
        assert_eq!(err.step, "rename into place");
        assert_eq!(err.path, path);
        assert_eq!(names(dir.path()), vec!["taken"]);
    }

    #[test]
    fn a_directory_removed_right_after_its_file_still_counts_as_removed() {
        let dir = tempfile::tempdir().unwrap();
        let gone = dir.path().join("released");
        std::fs::create_dir(&gone).unwrap();
        sync_after_remove(&gone).unwrap();
        std::fs::remove_dir(&gone).unwrap();
        sync_after_remove(&gone).unwrap();
        // Anything else still fails: a file where the directory should be.
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(sync_after_remove(&file.join("below")).is_err());
    }

    #[test]
    fn a_missing_directory_names_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gone/a.yaml");
        let err = write(&path, b"x").unwrap_err();
        assert_eq!(err.io().kind(), io::ErrorKind::NotFound);
        assert!(chain(&err).contains(&path.display().to_string()), "{err}");
    }

    /// A real full disk: a 64 KiB tmpfs. Needs `mount` (root); without it the test says why and
    /// passes, unless `NVDRA_REQUIRE_TMPFS` is set (CI sets it to 1).
    #[test]
    fn a_full_disk_reads_no_space_left_with_the_path() {
        let Some(fs) = super::testing::TinyTmpfs::mount() else {
            return;
        };
        let path = fs.dir.path().join("checkpoint.json");
        write(&path, b"small").unwrap();
        let big = vec![b'x'; 1 << 20];
        let err = write(&path, &big).unwrap_err();
        assert_eq!(err.io().raw_os_error(), Some(28), "{err:?}");
        let text = chain(&err);
        assert!(text.contains("No space left on device"), "{text}");
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert_eq!(names(fs.dir.path()), vec!["checkpoint.json"]);
        assert_eq!(std::fs::read(&path).unwrap(), b"small");
    }
}

/// The test peers' rule for `NVDRA_REQUIRE_TMPFS`, the one every probe of nvdra's tests uses.
#[cfg(test)]
#[path = "../crates/kubelet-plugin/tests/support/require.rs"]
mod require;

/// Test support: a real full disk.
#[cfg(test)]
pub(crate) mod testing {
    /// A tmpfs of 64 KiB on a temporary directory, unmounted when dropped.
    pub struct TinyTmpfs {
        pub dir: tempfile::TempDir,
    }

    impl TinyTmpfs {
        pub fn mount() -> Option<Self> {
            // Read first, so a misspelt value fails here too, not only without a tmpfs.
            let required = super::require::required("NVDRA_REQUIRE_TMPFS");
            let dir = tempfile::tempdir().unwrap();
            let out = std::process::Command::new("mount")
                .args(["-t", "tmpfs", "-o", "size=64k", "nvdra-test"])
                .arg(dir.path())
                .output();
            let why = match out {
                Ok(o) if o.status.success() => return Some(Self { dir }),
                Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
                Err(e) => e.to_string(),
            };
            if required {
                panic!("NVDRA_REQUIRE_TMPFS is set but a tmpfs cannot be mounted: {why}");
            }
            eprintln!("skipping the full-disk test: cannot mount a tmpfs: {why}");
            None
        }
    }

    impl Drop for TinyTmpfs {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg(self.dir.path())
                .status();
        }
    }
}
