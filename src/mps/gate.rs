//! `nvdra mps-gate --control <nvidia-cuda-mps-control> --pipe <dir>`: the MPS start gate, run
//! by the container runtime as a `createRuntime` hook at every start of a container of an MPS
//! claim ([`crate::cdi::gate`] writes it into the claim's spec).
//!
//! It lets the container start only when the daemon of `--pipe` answers and lists an MPS
//! server; when the daemon answers with none (a daemon just restarted), it asks the daemon to
//! start one for the container's user and checks again. Any other outcome exits 1 with a message
//! the runtime shows in the container's start error, and the container does not start: its
//! CUDA processes would otherwise run outside MPS, unlimited (nvidia-cuda-mps-control(1)), and
//! in `EXCLUSIVE_PROCESS` keep the GPU from every share's server. A server that is up is what
//! makes `EXCLUSIVE_PROCESS` refuse such a process for the whole GPU.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};

use super::control;

/// How long each question to the daemon may take (the runtime waits for the hook).
const ASK_DEADLINE: Duration = Duration::from_secs(5);

/// Runs the hook with its arguments (those after `mps-gate`) and the OCI state on stdin.
pub fn main(args: Vec<String>) -> Result<()> {
    let (mut control, mut pipe) = (None, None);
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            args.next()
                .map(PathBuf::from)
                .ok_or_else(|| anyhow!("{name} needs a path"))
        };
        match arg.as_str() {
            "--control" => control = Some(value("--control")?),
            "--pipe" => pipe = Some(value("--pipe")?),
            other => bail!(
                "unknown argument {other:?}: usage: nvdra mps-gate --control <nvidia-cuda-mps-control> --pipe <dir>"
            ),
        }
    }
    let (Some(control), Some(pipe)) = (control, pipe) else {
        bail!("usage: nvdra mps-gate --control <nvidia-cuda-mps-control> --pipe <dir>");
    };
    let mut state = String::new();
    std::io::stdin()
        .read_to_string(&mut state)
        .context("reading the container's OCI state from stdin")?;
    let uid = container_uid(&state)?;
    let servers = check(&control, &pipe, uid)?;
    eprintln!(
        "nvdra mps-gate: the MPS daemon of {} answers, server {}",
        pipe.display(),
        servers.join(",")
    );
    Ok(())
}

/// Whether the container may start: the daemon of `pipe` answers and has a server (started for
/// `uid` when it had none). The servers' pids.
pub fn check(control: &Path, pipe: &Path, uid: u32) -> Result<Vec<String>> {
    let not_answering = |e: control::Error| {
        anyhow!(
            "the MPS control daemon of this GPU share ({}) does not answer ({e}): the container is \
             not started, or its CUDA processes would run outside MPS with no memory limit; the \
             MPS host (DaemonSet nvdra-mps-host) restarts the daemon and the kubelet retries the \
             container",
            pipe.display()
        )
    };
    let servers = |out: String| -> Vec<String> {
        out.split_whitespace()
            .filter(|w| w.parse::<u32>().is_ok())
            .map(String::from)
            .collect()
    };
    let listed = servers(
        control::ask(control, pipe, "get_server_list", ASK_DEADLINE).map_err(not_answering)?,
    );
    if !listed.is_empty() {
        return Ok(listed);
    }
    let started = control::ask(
        control,
        pipe,
        &format!("start_server -uid {uid}"),
        ASK_DEADLINE,
    )
    .map_err(not_answering)?;
    let listed = servers(
        control::ask(control, pipe, "get_server_list", ASK_DEADLINE).map_err(not_answering)?,
    );
    if listed.is_empty() {
        bail!(
            "the MPS control daemon of this GPU share ({}) answers but cannot start an MPS server \
             for uid {uid} ({}): the container is not started; a process outside MPS may hold \
             the GPU, or a server of another user runs on a GPU without multi-user MPS",
            pipe.display(),
            started.trim()
        );
    }
    Ok(listed)
}

/// The user the container's process runs as: `process.user.uid` of the bundle's `config.json`
/// (the OCI state names the bundle); 0 when the config names none.
fn container_uid(state: &str) -> Result<u32> {
    let v: serde_json::Value =
        serde_json::from_str(state).context("the OCI state on stdin is not JSON")?;
    let bundle = v
        .get("bundle")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| anyhow!("the OCI state on stdin names no bundle: {}", state.trim()))?;
    let path = Path::new(bundle).join("config.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("reading the container's config {}", path.display()))?;
    let config: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let uid = config.pointer("/process/user/uid").cloned();
    match uid {
        None => Ok(0),
        Some(u) => u
            .as_u64()
            .and_then(|u| u32::try_from(u).ok())
            .ok_or_else(|| anyhow!("{}: process.user.uid {u} is not a uid", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(container_uid(&state(dir.path())).unwrap(), 1000);
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"process":{"args":["sh"]}}"#,
        )
        .unwrap();
        assert_eq!(container_uid(&state(dir.path())).unwrap(), 0);
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"process":{"user":{"uid":-1}}}"#,
        )
        .unwrap();
        let e = container_uid(&state(dir.path())).unwrap_err().to_string();
        assert!(e.contains("is not a uid"), "{e}");
        let e = container_uid(r#"{"pid":1}"#).unwrap_err().to_string();
        assert!(e.contains("names no bundle"), "{e}");
        let e = container_uid(&state(&dir.path().join("gone")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("reading the container's config"), "{e}");
    }
}
