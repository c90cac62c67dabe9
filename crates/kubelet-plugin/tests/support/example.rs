//! Running the crate's examples from its tests: the binary cargo built beside the test, and a
//! child process killed however the test ends.
// Each test binary uses what it needs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Child;

/// The example `name` cargo built beside this test (`target/<profile>/examples/`).
pub fn path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    let path = profile_dir.join("examples").join(name);
    assert!(
        path.is_file(),
        "{} is not built: run `cargo test` (which builds examples) or `cargo build --examples`",
        path.display()
    );
    path
}

/// A child process, killed and reaped when dropped (a failed assertion included).
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
