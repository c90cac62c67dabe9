//! What a SIGKILL cannot show: that a prepare's checkpoint reaches the disk before the kubelet
//! hears "prepared". A killed process leaves its writes in the page cache, so every crash test
//! passes with the fsyncs gone; a power loss would then lose a prepared claim (and hand its
//! device out twice). Here the daemon runs under `strace`, and one prepare must sync the
//! checkpoint's new content before the rename that puts it in place, and its directory after
//! it (`src/durable.rs`). Without strace the test says why and passes, unless
//! `NVDRA_REQUIRE_STRACE` is set (CI sets it to 1).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::{DRIVER, Dirs, prepare, wait_ready};
use crate::support::dra::wait_exit;

/// The calls traced: every way to sync a file, and the renames that order them.
const TRACED: &str = "fsync,fdatasync,sync_file_range,syncfs,rename,renameat,renameat2";

/// One traced call: the thread, the call's name and its arguments as strace prints them (`-y`:
/// a file descriptor with its path, `5</dir/file>`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Call {
    pid: u32,
    name: String,
    args: String,
}

impl Call {
    fn is_sync(&self) -> bool {
        ["fsync", "fdatasync", "sync_file_range", "syncfs"].contains(&self.name.as_str())
    }

    /// The path of the descriptor a sync call names (`-y`).
    fn fd_path(&self) -> Option<PathBuf> {
        let start = self.args.find('<')? + 1;
        let end = start + self.args[start..].find('>')?;
        Some(PathBuf::from(&self.args[start..end]))
    }
}

/// The completed calls of a trace written with `-f -y`: `<pid> <name>(<args>) = <result>`,
/// a call split by another thread's (`<unfinished ...>`, `<... name resumed>`) joined again.
fn calls(trace: &str) -> Vec<Call> {
    let mut pending: std::collections::HashMap<u32, String> = Default::default();
    let mut out = Vec::new();
    for line in trace.lines() {
        let Some((pid, rest)) = line.trim().split_once(char::is_whitespace) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else {
            continue;
        };
        let rest = rest.trim_start();
        let whole = if let Some(head) = rest.strip_suffix(" <unfinished ...>") {
            pending.insert(pid, head.to_string());
            continue;
        } else if rest.starts_with("<... ") {
            let Some((_, tail)) = rest.split_once(" resumed>") else {
                continue;
            };
            format!("{}{tail}", pending.remove(&pid).unwrap_or_default())
        } else {
            rest.to_string()
        };
        // Signals (`--- SIGTERM ...`) and exits (`+++ exited ...`) are no calls.
        let Some((name, args)) = whole.split_once('(') else {
            continue;
        };
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        out.push(Call {
            pid,
            name: name.to_string(),
            args: args.to_string(),
        });
    }
    out
}

/// strace, if this machine has it.
fn strace() -> Option<&'static str> {
    let required = crate::support::require::required("NVDRA_REQUIRE_STRACE");
    let why = match Command::new("strace").arg("-V").output() {
        Ok(o) if o.status.success() => return Some("strace"),
        Ok(o) => String::from_utf8_lossy(&o.stderr).trim().to_string(),
        Err(e) => e.to_string(),
    };
    if required {
        panic!("NVDRA_REQUIRE_STRACE is set but strace cannot run: {why}");
    }
    eprintln!("skipping the fsync test: strace cannot run: {why}");
    None
}

/// `cmd` (the one launcher's `nvdra run`) under `strace -f -y`, tracing [`TRACED`] into `out`.
fn under_strace(strace: &str, cmd: &Command, out: &Path) -> Command {
    let mut traced = Command::new(strace);
    traced
        .args(["-f", "-y", "-qq", "-e", &format!("trace={TRACED}"), "-o"])
        .arg(out)
        .arg("--")
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (k, v) in cmd.get_envs() {
        match v {
            Some(v) => traced.env(k, v),
            None => traced.env_remove(k),
        };
    }
    if let Some(dir) = cmd.get_current_dir() {
        traced.current_dir(dir);
    }
    traced.stdin(Stdio::null()).stdout(Stdio::null());
    traced
}

/// strace and the daemon it runs: the daemon is SIGKILLed first when dropped (a tracer that
/// dies first would leave it running, detached).
struct Traced {
    strace: std::process::Child,
    daemon: u32,
}

impl Traced {
    fn signal(&self, sig: &str) -> bool {
        Command::new("kill")
            .args([sig, &self.daemon.to_string()])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for Traced {
    fn drop(&mut self) {
        self.signal("-KILL");
        let _ = self.strace.wait();
    }
}

/// The process strace started: its one child.
fn traced_child(strace: u32) -> u32 {
    let children = std::fs::read_to_string(format!("/proc/{strace}/task/{strace}/children"))
        .unwrap_or_default();
    let mut pids = children
        .split_whitespace()
        .map(|p| p.parse::<u32>().unwrap());
    let pid = pids.next().expect("strace runs nvdra");
    assert_eq!(pids.next(), None, "{children}");
    pid
}

/// The sync calls of one prepare of a whole GPU: the checkpoint's temporary file is synced,
/// renamed over `checkpoint.json`, then the plugin directory is synced, by the same thread and
/// in that order, before the answer; nothing else asks for a sync.
#[tokio::test]
async fn a_prepare_syncs_the_checkpoint_and_its_directory_before_answering() {
    let Some(strace) = strace() else {
        return;
    };
    let d = Dirs::new();
    d.add_claim("a", "gpu-2");
    let trace = d.p("strace.log");
    let mut cmd = under_strace(strace, &d.command(None), &trace);
    let mut child = cmd.spawn().unwrap();
    // The daemon's start, as seen from strace: until it serves.
    wait_ready(&d, &mut child).await;
    let mut p = Traced {
        daemon: traced_child(child.id()),
        strace: child,
    };
    // strace writes each call as it returns: what is in the file now is the start-up's.
    let before = calls(&std::fs::read_to_string(&trace).unwrap()).len();

    let r = prepare(&d, "a").await.unwrap();
    assert_eq!(r.error, "");
    let all = calls(&std::fs::read_to_string(&trace).unwrap());
    let during: Vec<Call> = all[before..].to_vec();

    // strace names a descriptor by its resolved path; nvdra names the rename's as it was given.
    let plugin_dir = d
        .p(&format!("kubelet/plugins/{DRIVER}"))
        .canonicalize()
        .unwrap();
    let checkpoint = d.checkpoint().to_string_lossy().into_owned();
    let is_checkpoint_tmp = |p: &Path| {
        p.parent() == Some(&*plugin_dir)
            && p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(".checkpoint.json.") && n.ends_with(".tmp"))
    };
    let syncs: Vec<&Call> = during.iter().filter(|c| c.is_sync()).collect();
    eprintln!(
        "sync calls in one prepare: {} ({:?})",
        syncs.len(),
        syncs
            .iter()
            .map(|c| format!("{}({}", c.name, c.args))
            .collect::<Vec<_>>()
    );
    // The checkpoint's content: synced (fsync or fdatasync) before its rename into place.
    let synced = during
        .iter()
        .position(|c| {
            ["fsync", "fdatasync"].contains(&c.name.as_str())
                && c.fd_path().is_some_and(|p| is_checkpoint_tmp(&p))
        })
        .unwrap_or_else(|| panic!("the checkpoint's new content is never synced: {during:#?}"));
    let thread = during[synced].pid;
    let mine: Vec<&Call> = during[synced + 1..]
        .iter()
        .filter(|c| c.pid == thread)
        .collect();
    let renamed = mine
        .first()
        .filter(|c| c.name.starts_with("rename") && c.args.contains(&checkpoint))
        .unwrap_or_else(|| {
            panic!("the synced file is not renamed over the checkpoint next: {mine:#?}")
        });
    // ... then the directory that holds the rename.
    let dir_synced = mine
        .get(1)
        .is_some_and(|c| c.name == "fsync" && c.fd_path().as_deref() == Some(&*plugin_dir));
    assert!(
        dir_synced,
        "the checkpoint's directory is not synced after {renamed:?}: {mine:#?}"
    );
    // The answer came after both: one prepare, one durable checkpoint write (a whole GPU records
    // its completed claim once; its CDI spec is rebuilt from the checkpoint, so not synced).
    assert_eq!(syncs.len(), 2, "{syncs:#?}");

    assert!(p.signal("-TERM"));
    assert!(wait_exit(&mut p.strace).await.success());
}

#[test]
fn traces_are_read_with_their_split_calls_joined() {
    let trace = "\
101 fsync(7</k/.checkpoint.json.ab.tmp> <unfinished ...>
102 rename(\"/a\", \"/b\") = 0
101 <... fsync resumed>) = 0
101 --- SIGTERM {si_signo=SIGTERM} ---
101 +++ exited with 0 +++
";
    let c = calls(trace);
    assert_eq!(
        c.iter()
            .map(|c| (c.pid, c.name.as_str()))
            .collect::<Vec<_>>(),
        [(102, "rename"), (101, "fsync")]
    );
    assert_eq!(
        c[1].fd_path().as_deref(),
        Some(Path::new("/k/.checkpoint.json.ab.tmp"))
    );
    assert!(c[1].is_sync() && !c[0].is_sync());
}
