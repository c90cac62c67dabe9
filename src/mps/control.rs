//! `nvidia-cuda-mps-control` as a client: find it under the driver root, and send a daemon one
//! command (`get_server_list`, `quit`) through it, with a deadline.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

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
    #[error("the answer to {command:?} was longer than {limit} bytes; the client was killed")]
    TooLong { command: String, limit: usize },
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
/// time counts as not answering. An answer (or error text) longer than
/// [`crate::child::OUTPUT_LIMIT`] is refused and the client killed.
pub fn ask(control: &Path, pipe: &Path, command: &str, deadline: Duration) -> Result<String> {
    let mut cmd = Command::new(control);
    cmd.env("CUDA_MPS_PIPE_DIRECTORY", pipe);
    let input = format!("{command}\n");
    let out = crate::child::output_fed(&mut cmd, command, Some(input.as_bytes()), deadline)
        .map_err(|e| match e {
            crate::child::Error::Spawn { source, .. } => Error::Spawn {
                control: control.to_path_buf(),
                source,
            },
            crate::child::Error::Deadline { .. } => Error::Timeout {
                command: command.to_string(),
                deadline,
            },
            crate::child::Error::TooMuchOutput { limit, .. } => Error::TooLong {
                command: command.to_string(),
                limit,
            },
        })?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(Error::Failed {
            command: command.to_string(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// The MPS servers' pids in an answer to `get_server_list` (one a line).
pub fn server_pids(answer: &str) -> Vec<u32> {
    answer
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect()
}

/// Whether the daemon of `pipe` answers `get_server_list` within [`ALIVE_DEADLINE`].
pub fn alive(control: &Path, pipe: &Path) -> Result<()> {
    ask(control, pipe, "get_server_list", ALIVE_DEADLINE).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A driver root whose control client runs `script`.
    fn driver_root(script: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("usr/bin");
        std::fs::create_dir_all(&bin).unwrap();
        let control = bin.join(CONTROL);
        std::fs::write(&control, format!("#!/bin/sh\n{script}\n")).unwrap();
        std::fs::set_permissions(&control, std::fs::Permissions::from_mode(0o755)).unwrap();
        (dir, control)
    }

    #[test]
    fn a_client_that_floods_its_answer_is_refused_by_command() {
        // `yes` never ends: only the cap stops it, far inside the minute's deadline.
        let (dir, control) = driver_root("exec yes 4242");
        assert_eq!(find(dir.path()).unwrap(), control);
        let e = ask(
            &control,
            dir.path(),
            "get_server_list",
            Duration::from_secs(60),
        )
        .unwrap_err();
        assert!(matches!(e, Error::TooLong { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "the answer to \"get_server_list\" was longer than 65536 bytes; the client was killed"
        );
    }

    #[test]
    fn an_answer_under_the_cap_is_read_whole() {
        // 2000 servers' pids, some 10 KiB: under the cap.
        let (dir, control) = driver_root("cat >/dev/null; seq 100000 102000");
        let answer = ask(
            &control,
            dir.path(),
            "get_server_list",
            Duration::from_secs(60),
        )
        .unwrap();
        let pids = server_pids(&answer);
        assert_eq!(pids.len(), 2001);
        assert_eq!((pids[0], pids[2000]), (100000, 102000));
    }
}
