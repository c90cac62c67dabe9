//! Where cargo put the fake NVML library (`tests/fake-nvml`, a dev-dependency built as a cdylib)
//! for this test binary.
#![allow(dead_code)]

use std::path::PathBuf;

/// `libfake_nvml.so` in `target/<profile>/deps` or beside it.
pub fn library() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let deps = exe
        .parent()
        .expect("test binary lives in target/<profile>/deps");
    let candidates = [
        deps.join("libfake_nvml.so"),
        deps.parent()
            .map_or_else(PathBuf::new, |p| p.join("libfake_nvml.so")),
    ];
    candidates
        .iter()
        .find(|p| p.exists())
        .cloned()
        .unwrap_or_else(|| panic!("libfake_nvml.so is missing from {candidates:?}"))
}
