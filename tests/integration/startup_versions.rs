//! `nvdra run` against the test API server, which reports a Kubernetes version: with a switch on
//! that a known scheduler bug of that version hits, the process warns once, naming the bug and
//! the fix; on a fixed version it does not. Counted in the process's own stderr.

use crate::support;

use std::io::Read;
use std::process::{Child, Stdio};
use std::time::Duration;

use support::apiserver::TestApiServer;

const NODE: &str = "node-a";

/// `nvdra run --mode dra` with `flags` on the simulated `profile`, against `server`.
fn nvdra_run(server: &TestApiServer, dir: &std::path::Path, flags: &[&str]) -> Child {
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
    support::daemon::nvdra_run(dir, "dra", NODE)
        .args(["--profile", "dgx-a100-mig"])
        .args(flags)
        .env("NVDRA_LOG", "warn")
        .env_remove("NVDRA_API_DIR")
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Runs nvdra against a server reporting 1.36.`patch` until it has published its slices (the
/// version is read before), stops it, and returns what it wrote to stderr.
async fn stderr_of_a_start(patch: u32, flags: &[&str]) -> String {
    let server = TestApiServer::start().await;
    server.set_server_version(36, patch);
    server.seed_node(NODE, "uid-node-a");
    let dir = tempfile::tempdir().unwrap();
    let mut child = nvdra_run(&server, dir.path(), flags);
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text);
        text
    });
    let mut published = false;
    for _ in 0..3000 {
        if !server.slices().is_empty() {
            published = true;
            break;
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("nvdra exited with {status}: {}", reader.join().unwrap());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    let text = reader.join().unwrap();
    assert!(published, "no slices were published; stderr:\n{text}");
    text
}

fn warnings(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("has a known bug"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_1_36_1_partitionable_warns_once_naming_the_bug_and_the_fix() {
    let text = stderr_of_a_start(1, &["--partitionable"]).await;
    let found = warnings(&text);
    assert_eq!(found.len(), 1, "stderr:\n{text}");
    let line = found[0];
    assert!(line.contains("Kubernetes 1.36.1"), "{line}");
    assert!(line.contains("kubernetes#140436"), "{line}");
    assert!(line.contains("--partitionable"), "{line}");
    assert!(line.contains("kubernetes#140663"), "{line}");
    // Nothing else of the bug's anywhere in the log.
    assert_eq!(
        text.lines().filter(|l| l.contains("140436")).count(),
        1,
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_release_or_no_switch_on_gives_no_warning() {
    let fixed = stderr_of_a_start(4, &["--partitionable"]).await;
    assert!(warnings(&fixed).is_empty(), "stderr:\n{fixed}");
    let off = stderr_of_a_start(1, &[]).await;
    assert!(warnings(&off).is_empty(), "stderr:\n{off}");
}
