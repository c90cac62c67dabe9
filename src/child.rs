//! Child processes with a deadline: a driver tool (`nvidia-smi`) that hangs is killed when its
//! deadline passes, and its caller gets an error naming the command and the deadline instead of
//! a thread blocked for good. The MPS control client (`mps::control::ask`) runs through it too.

use std::io::Read;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// What a finished child wrote, and how it ended.
#[derive(Debug)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Why a child gave no [`Output`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot run {command}")]
    Spawn {
        command: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{command} did not finish within {after:?} and was killed")]
    Deadline { command: String, after: Duration },
}

/// Runs `cmd` (named `command` in errors) with no input, collecting its output, and kills it
/// when it has not exited within `deadline`.
pub fn output(cmd: &mut Command, command: &str, deadline: Duration) -> Result<Output, Error> {
    output_fed(cmd, command, None, deadline)
}

/// As [`output`], writing `input` to the child's stdin first (then closing it) when given.
pub fn output_fed(
    cmd: &mut Command,
    command: &str,
    input: Option<&[u8]>,
    deadline: Duration,
) -> Result<Output, Error> {
    let spawn_err = |source| Error::Spawn {
        command: command.to_string(),
        source,
    };
    let stdin = if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    };
    let mut child = cmd
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    // Drained as the child writes (a full pipe would stall it), each by a thread of its own.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut buf);
            }
            buf
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    if let (Some(bytes), Some(mut pipe)) = (input, child.stdin.take()) {
        // A child that exits before reading closes the pipe: its status says why.
        let _ = std::io::Write::write_all(&mut pipe, bytes);
    }
    let start = Instant::now();
    let mut pause = Duration::from_millis(1);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if start.elapsed() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                // The drain threads end when the pipes close (with the child, or with any
                // process it left holding them); nobody waits for them.
                return Err(Error::Deadline {
                    command: command.to_string(),
                    after: deadline,
                });
            }
            Ok(None) => {
                std::thread::sleep(pause.min(deadline.saturating_sub(start.elapsed())));
                pause = (pause * 2).min(Duration::from_millis(20));
            }
            Err(source) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(spawn_err(source));
            }
        }
    };
    Ok(Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_that_hangs_is_killed_and_named() {
        // A minute's sleep against a tenth of a second: it is killed, however slow the machine.
        let mut cmd = Command::new("sleep");
        cmd.arg("60");
        let e = output(&mut cmd, "sleep 60", Duration::from_millis(100)).unwrap_err();
        assert!(matches!(e, Error::Deadline { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "sleep 60 did not finish within 100ms and was killed"
        );
    }

    #[test]
    fn a_child_within_its_deadline_gives_its_output() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo out; echo err >&2; exit 3"]);
        let o = output(&mut cmd, "sh", Duration::from_secs(60)).unwrap();
        assert_eq!(o.status.code(), Some(3));
        assert_eq!(o.stdout, b"out\n");
        assert_eq!(o.stderr, b"err\n");
        let e = output(
            &mut Command::new("/nonexistent/tool"),
            "tool",
            Duration::from_secs(60),
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "cannot run tool");
    }

    #[test]
    fn a_fed_child_reads_its_input() {
        let o = output_fed(
            &mut Command::new("cat"),
            "cat",
            Some(b"get_server_list\n"),
            Duration::from_secs(60),
        )
        .unwrap();
        assert!(o.status.success());
        assert_eq!(o.stdout, b"get_server_list\n");
    }
}
