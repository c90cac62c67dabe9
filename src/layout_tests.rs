//! The shape of the source tree: no file in `src/` over [`MAX_LINES`] lines (issue 8), so that a
//! module that grows is split by what it does before it becomes a second `plugin.rs`.

use std::path::{Path, PathBuf};

const MAX_LINES: usize = 700;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_source_file_is_over_the_line_limit() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    assert!(
        files.len() > 50,
        "found only {} files under {}",
        files.len(),
        src.display()
    );
    assert!(files.iter().any(|f| f.ends_with("src/daemon.rs")));
    let over: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(f).unwrap().lines().count();
            (n > MAX_LINES).then(|| format!("{} ({n} lines)", f.display()))
        })
        .collect();
    assert!(over.is_empty(), "over {MAX_LINES} lines: {over:?}");
}
