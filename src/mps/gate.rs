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

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Result, anyhow, bail};

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
    let uid = crate::cdi::OciState::from_stdin()?.process_uid()?;
    let servers = check(&control, &pipe, uid)?;
    eprintln!(
        "nvdra mps-gate: the MPS daemon of {} answers, server {servers:?}",
        pipe.display(),
    );
    Ok(())
}

/// Whether the container may start: the daemon of `pipe` answers and has a server (started for
/// `uid` when it had none). The servers' pids.
pub fn check(control: &Path, pipe: &Path, uid: u32) -> Result<Vec<u32>> {
    let not_answering = |e: control::Error| {
        anyhow!(
            "the MPS control daemon of this GPU share ({}) does not answer ({e}): the container is \
             not started, or its CUDA processes would run outside MPS with no memory limit; the \
             MPS host (DaemonSet nvdra-mps-host) restarts the daemon and the kubelet retries the \
             container",
            pipe.display()
        )
    };
    let listed = control::server_pids(
        &control::ask(control, pipe, "get_server_list", ASK_DEADLINE).map_err(not_answering)?,
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
    let listed = control::server_pids(
        &control::ask(control, pipe, "get_server_list", ASK_DEADLINE).map_err(not_answering)?,
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
