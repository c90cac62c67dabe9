//! The node lock against Go's kind of lock, held by a process the library did not write: Go's
//! `kubeletplugin` helper locks `serialize.lock` with an open file description (OFD) `fcntl`
//! write lock on the whole file (`F_OFD_SETLKW`, through etcd's `fileutil.LockFile`), which a
//! `flock` alone never sees. The peer here is python3's `fcntl.fcntl` making those very calls
//! (`struct flock` of 64-bit Linux), so the crate and a Go instance of a driver must take turns.
//!
//! Each peer writes what it does to a log beside the lock; the tests check the order of the
//! entries, and that the side that must wait is refused while the other holds the lock.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use kubelet_plugin::nodelock::{self, NodeLock};

use crate::wait;

/// `hold LOCK LOG`: takes the lock (blocking, as Go does), says `locked`, waits for a line on
/// stdin, logs `peer released`, releases it. `take LOCK LOG`: says `busy` or `free` after one
/// non-blocking attempt, then takes it blocking, logs `peer acquired`, says `acquired`, exits.
const PEER: &str = r#"
import fcntl, os, struct, sys
mode, path, log = sys.argv[1:4]
F_OFD_SETLK, F_OFD_SETLKW = 37, 38  # <linux/fcntl.h>
def flock(kind):  # struct flock, 64-bit Linux: short, short, off_t, off_t, pid_t, padding
    return struct.pack("hhqqixxxx", kind, os.SEEK_SET, 0, 0, 0)
def note(line):
    with open(log, "a") as f:
        f.write(line + "\n")
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # as Go's helper opens it
if mode == "take":
    try:
        fcntl.fcntl(fd, F_OFD_SETLK, flock(fcntl.F_WRLCK))
        print("free", flush=True)
    except OSError:
        print("busy", flush=True)
fcntl.fcntl(fd, F_OFD_SETLKW, flock(fcntl.F_WRLCK))
if mode == "hold":
    print("locked", flush=True)
    sys.stdin.readline()
    note("peer released")
else:
    note("peer acquired")
    print("acquired", flush=True)
os.close(fd)
"#;

struct Peer {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Peer {
    fn start(mode: &str, dir: &Path) -> Self {
        let mut child = Command::new("python3")
            .args(["-c", PEER, mode])
            .arg(dir.join(nodelock::FILE_NAME))
            .arg(dir.join("log"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python3 plays Go's helper here; install python3");
        let out = BufReader::new(child.stdout.take().unwrap());
        Peer { child, out }
    }

    /// The peer's next line (blocking: the peer says each line at once, or exits).
    fn said(&mut self) -> String {
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        line.trim().to_string()
    }

    fn exited_ok(mut self) {
        let status = self.child.wait().unwrap();
        assert!(status.success(), "the python peer failed: {status}");
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn note(dir: &Path, line: &str) {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("log"))
        .unwrap();
    writeln!(f, "{line}").unwrap();
}

fn log(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("log"))
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

/// While Go's kind of lock is held, the crate's lock is refused; once the peer lets go, a
/// waiting operation gets it, after the release and not before.
#[tokio::test]
async fn the_crate_waits_for_a_go_instance() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    let mut peer = Peer::start("hold", &d);
    assert_eq!(peer.said(), "locked");

    let short = NodeLock::with_timeout(&d, Duration::from_millis(300));
    match short.enter(|| Ok::<(), nodelock::Error>(())).await {
        Err(nodelock::Error::Busy { .. }) => {}
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("took serialize.lock while a Go-style OFD lock held it"),
    }

    let waiting = tokio::spawn({
        let d = d.clone();
        async move {
            let lock = NodeLock::with_timeout(&d, wait::SOON);
            let guard = lock
                .enter(|| {
                    note(&d, "crate acquired");
                    Ok::<(), nodelock::Error>(())
                })
                .await;
            drop(guard.expect("the lock once the peer let go"));
        }
    });
    // Time for a lock that ignored the peer to be taken (and logged) before the release.
    tokio::time::sleep(Duration::from_millis(200)).await;
    writeln!(peer.child.stdin.as_mut().unwrap()).unwrap();
    tokio::time::timeout(wait::SOON, waiting)
        .await
        .expect("the crate's lock is taken once the peer released it")
        .unwrap();
    peer.exited_ok();
    assert_eq!(log(&d), ["peer released", "crate acquired"]);
}

/// The reverse: while the crate holds the lock, Go's kind of lock is refused, and a Go instance
/// blocked on it gets it once the crate releases it.
#[tokio::test]
async fn a_go_instance_waits_for_the_crate() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_path_buf();
    let lock = NodeLock::new(&d);
    let guard = lock.enter(|| Ok::<(), nodelock::Error>(())).await.unwrap();

    let mut peer = tokio::task::spawn_blocking({
        let d = d.clone();
        move || {
            let mut peer = Peer::start("take", &d);
            let first = peer.said();
            (peer, first)
        }
    })
    .await
    .unwrap();
    assert_eq!(
        peer.1, "busy",
        "Go's lock must not be free while the crate holds it"
    );
    // Time for a peer that ignored the crate's lock to take it (and log) before the release.
    tokio::time::sleep(Duration::from_millis(200)).await;
    note(&d, "crate released");
    drop(guard);
    let peer = tokio::task::spawn_blocking(move || {
        assert_eq!(peer.0.said(), "acquired");
        peer.0
    });
    tokio::time::timeout(wait::SOON, peer)
        .await
        .expect("the peer takes the lock once the crate released it")
        .unwrap()
        .exited_ok();
    assert_eq!(log(&d), ["crate released", "peer acquired"]);
}
