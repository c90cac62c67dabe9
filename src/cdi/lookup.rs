//! Where the driver's files are looked for on the host, and the small lookups the driver-file
//! and graphics discovery share: the library and binary directories, files in a directory by
//! name, the soname link of a library, and the links the `create-symlinks` hook makes.

use std::fs;
use std::path::{Path, PathBuf};

/// Library directories searched for `libcuda.so.<version>`, in order.
pub(super) const LIB_DIRS: [&str; 7] = [
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib64",
];
/// Binary directories searched, in order.
pub(super) const BIN_DIRS: [&str; 7] = [
    "usr/bin",
    "usr/sbin",
    "bin",
    "sbin",
    "usr/local/bin",
    "usr/local/sbin",
    "opt/bin",
];
/// A link the `create-symlinks` hook makes in the container: `link` (a container path) points
/// to `target` (a file name, relative to the link's directory).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Symlink {
    pub target: String,
    pub link: String,
}

impl Symlink {
    /// `target::link`, the hook's `--link` argument.
    pub fn arg(&self) -> String {
        format!("{}::{}", self.target, self.link)
    }
}

/// Regular files in `dir` (symlinks followed) whose name passes `wanted`, sorted.
pub(super) fn matching_in(dir: &Path, wanted: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(&wanted))
        .filter(|e| e.file_type().is_ok_and(|t| !t.is_symlink()))
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found
}

/// The name of the link in `dir` that points at `name` and is not a `.so` development link:
/// the soname ldconfig made (`libcuda.so.1` for `libcuda.so.550.163.01`).
pub(super) fn soname_link(dir: &Path, name: &str) -> Option<String> {
    let entries = fs::read_dir(dir).ok()?;
    let mut found: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n != name && !n.ends_with(".so"))
        .filter(|n| {
            fs::read_link(dir.join(n))
                .ok()
                .is_some_and(|t| t.file_name().is_some_and(|f| f == name))
        })
        .collect();
    found.sort();
    found.into_iter().next()
}
