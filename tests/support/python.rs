//! Python peers of the tests (grpcio, `prometheus_client`): whether python3 can import one, with
//! the project's rule for a missing peer (skip, saying why, unless `NVDRA_REQUIRE_<X>` requires
//! it: [`super::require`]),
//! and running a script over text.
// Each test binary uses what it needs.
#![allow(dead_code)]

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// Whether python3 can `import_line` (probed once per test binary, in `probe`). When it cannot,
/// the calling test is skipped with a message, or fails when the environment variable
/// `require_var` is set (CI sets it); either way the message says what to install (`pip`).
pub fn have(
    probe: &'static OnceLock<Result<(), String>>,
    import_line: &str,
    peer: &str,
    require_var: &str,
    pip: &str,
) -> bool {
    let required = super::require::required(require_var);
    let probe = probe.get_or_init(|| {
        let out = Command::new("python3")
            .args(["-c", import_line])
            .output()
            .map_err(|e| format!("cannot run python3: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "python3 cannot `{import_line}`: {}",
                // The exception, not the traceback above it.
                String::from_utf8_lossy(&out.stderr)
                    .trim()
                    .lines()
                    .last()
                    .unwrap_or("")
            ))
        }
    });
    match probe {
        Ok(()) => true,
        Err(why) if required => panic!("{require_var} is set but {why}; run: {pip}"),
        Err(why) => {
            eprintln!(
                "skipped: {peer}: {why} (run: {pip}; set {require_var}=1 to make this a failure)"
            );
            false
        }
    }
}

/// Runs `python3 -c <script> <args>` with `input` on stdin and reads its stdout as JSON; fails
/// with the script's stderr (`what` says whose refusal it is) when it exits non-zero.
pub fn json_of(script: &str, args: &[&str], input: &str, what: &str) -> serde_json::Value {
    let mut child = Command::new("python3")
        .args(["-c", script])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python3");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{what}: {}\n{input}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}
