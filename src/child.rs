//! Child processes with a deadline: a driver tool (`nvidia-smi`) that hangs is killed when its
//! deadline passes, and its caller gets an error naming the command and the deadline instead of
//! a thread blocked for good. The MPS control client (`mps::control::ask`) runs through it too.
//!
//! What a child writes is kept up to [`OUTPUT_LIMIT`] bytes a stream: a child that writes more
//! (a tool gone wrong, or a binary under the driver root that is not the tool) is killed and
//! named, and its pipes are drained to their end meanwhile, so it never blocks on a full pipe.

use std::io::Read;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// The most a child may write to its stdout, and to its stderr: far more than any answer of
/// the tools nvdra runs (`nvidia-cuda-mps-control`'s `get_server_list`, `nvidia-smi`'s settings).
pub const OUTPUT_LIMIT: usize = 64 * 1024;

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
    #[error(
        "{command} wrote more than {limit} bytes to its {stream} and was killed (no answer of \
         the tool is that long)"
    )]
    TooMuchOutput {
        command: String,
        stream: &'static str,
        limit: usize,
    },
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
    output_limited(cmd, command, input, deadline, OUTPUT_LIMIT)
}

/// As [`output_fed`], with `limit` bytes a stream.
fn output_limited(
    cmd: &mut Command,
    command: &str,
    input: Option<&[u8]>,
    deadline: Duration,
    limit: usize,
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
    // Drained as the child writes (a full pipe would stall it), each by a thread of its own,
    // which keeps `limit` bytes and reads the rest to the end without keeping it, raising
    // `over` (its stream's name) for the loop below to kill the child.
    let over: Arc<[AtomicBool; 2]> = Arc::default();
    let drain = |pipe: Option<Box<dyn Read + Send>>, which: usize| {
        let over = over.clone();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                let _ = (&mut p).take(limit as u64 + 1).read_to_end(&mut buf);
                if buf.len() > limit {
                    buf.truncate(limit);
                    over[which].store(true, Ordering::Relaxed);
                    let _ = std::io::copy(&mut p, &mut std::io::sink());
                }
            }
            buf
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _), 0);
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _), 1);
    let too_much = |over: &[AtomicBool; 2]| {
        let stream = ["stdout", "stderr"]
            .into_iter()
            .zip(over)
            .find_map(|(name, o)| o.load(Ordering::Relaxed).then_some(name))?;
        Some(Error::TooMuchOutput {
            command: command.to_string(),
            stream,
            limit,
        })
    };
    if let (Some(bytes), Some(mut pipe)) = (input, child.stdin.take()) {
        // A child that exits before reading closes the pipe: its status says why.
        let _ = std::io::Write::write_all(&mut pipe, bytes);
    }
    let start = Instant::now();
    let mut pause = Duration::from_millis(1);
    let status = loop {
        if let Some(e) = too_much(&over) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
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
    let (stdout, stderr) = (
        stdout.join().unwrap_or_default(),
        stderr.join().unwrap_or_default(),
    );
    // A child that wrote too much and exited before the loop saw it.
    if let Some(e) = too_much(&over) {
        return Err(e);
    }
    Ok(Output {
        status,
        stdout,
        stderr,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

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
    fn a_child_that_floods_its_output_is_killed_named_and_reaped() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("pid");
        for (script, stream) in [("exec yes", "stdout"), ("exec yes >&2", "stderr")] {
            // Writes for ever: only the cap ends it, long before the minute's deadline.
            let mut cmd = Command::new("sh");
            cmd.arg("-c")
                .arg(format!("echo $$ > {}; {script}", pid_file.display()));
            let e = output(&mut cmd, "yes", Duration::from_secs(60)).unwrap_err();
            assert!(matches!(e, Error::TooMuchOutput { .. }), "{e:?}");
            assert_eq!(
                e.to_string(),
                format!(
                    "yes wrote more than 65536 bytes to its {stream} and was killed (no answer \
                     of the tool is that long)"
                )
            );
            // Reaped: no zombie left under its pid.
            let pid = std::fs::read_to_string(&pid_file).unwrap();
            assert!(
                !Path::new(&format!("/proc/{}", pid.trim())).exists(),
                "{stream}: {pid} is still there"
            );
        }
    }

    #[test]
    fn output_up_to_the_limit_is_kept_whole_and_one_byte_more_is_refused() {
        let run = |bytes: usize| {
            let mut cmd = Command::new("head");
            cmd.args(["-c", &bytes.to_string(), "/dev/zero"]);
            output_limited(&mut cmd, "head", None, Duration::from_secs(60), 1000)
        };
        let o = run(1000).unwrap();
        assert_eq!(o.stdout, vec![0; 1000]);
        // It exits at once: refused all the same, after it ended.
        let e = run(1001).unwrap_err();
        assert_eq!(
            e.to_string(),
            "head wrote more than 1000 bytes to its stdout and was killed (no answer of the \
             tool is that long)"
        );
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
