//! `nvidia-cuda-mps-control` as a client: find it under the driver root, and send a daemon one
//! command (`get_server_list`, `quit`) through it, with a deadline.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub const CONTROL: &str = "nvidia-cuda-mps-control";

/// How long `alive` waits for a daemon's answer.
pub const ALIVE_DEADLINE: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "{CONTROL} is not under the driver root {driver_root} (looked in usr/bin, \
         usr/local/bin, bin); install the driver's MPS tools or use TimeSlicing"
    )]
    NotFound { driver_root: PathBuf },
    #[error("cannot run {}", control.display())]
    Spawn {
        control: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no answer to {command:?} within {deadline:?}")]
    Timeout { command: String, deadline: Duration },
    #[error("{command:?} failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: ExitStatus,
        stderr: String,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The control binary under `driver_root` (where this process reads the driver's files).
pub fn find(driver_root: &Path) -> Result<PathBuf> {
    ["usr/bin", "usr/local/bin", "bin"]
        .iter()
        .map(|d| driver_root.join(d).join(CONTROL))
        .find(|p| p.is_file())
        .ok_or_else(|| Error::NotFound {
            driver_root: driver_root.to_path_buf(),
        })
}

/// Sends `command` to the daemon whose pipe directory is `pipe` and returns its answer (stdout).
/// The client is killed when it has not finished by `deadline`: a daemon that does not answer in
/// time counts as not answering.
pub fn ask(control: &Path, pipe: &Path, command: &str, deadline: Duration) -> Result<String> {
    let mut child = Command::new(control)
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| Error::Spawn {
            control: control.to_path_buf(),
            source,
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        // A client that exits before reading (no daemon) closes the pipe: its status says why.
        let _ = stdin.write_all(format!("{command}\n").as_bytes());
    }
    let start = Instant::now();
    let mut pause = Duration::from_millis(1);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Timeout {
                    command: command.to_string(),
                    deadline,
                });
            }
            Ok(None) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(20));
            }
            Err(source) => {
                let _ = child.kill();
                return Err(Error::Spawn {
                    control: control.to_path_buf(),
                    source,
                });
            }
        }
    };
    let (mut out, mut err) = (String::new(), String::new());
    if let Some(mut s) = child.stdout.take() {
        let _ = s.read_to_string(&mut out);
    }
    if let Some(mut s) = child.stderr.take() {
        let _ = s.read_to_string(&mut err);
    }
    if status.success() {
        Ok(out)
    } else {
        Err(Error::Failed {
            command: command.to_string(),
            status,
            stderr: err.trim().to_string(),
        })
    }
}

/// Whether the daemon of `pipe` answers `get_server_list` within [`ALIVE_DEADLINE`].
pub fn alive(control: &Path, pipe: &Path) -> Result<()> {
    ask(control, pipe, "get_server_list", ALIVE_DEADLINE).map(|_| ())
}
