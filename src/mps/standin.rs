//! A stand-in for `nvidia-cuda-mps-control` and what talks to it, as real processes over real
//! unix sockets, for tests and the demo on nodes without NVIDIA's MPS (`nvdra mps-standin`,
//! hidden; a driver root gets a two-line `nvidia-cuda-mps-control` script that execs it).
//!
//! - `-f` (or `-d`, which starts `-f` in the background and returns): the control daemon. It
//!   listens on `$CUDA_MPS_PIPE_DIRECTORY/control` and answers, a line per command:
//!   `get_server_list` (the servers' pids, one a line), `start_server -uid N` (the server's
//!   pid), `quit` (exits; hangs instead with `STANDIN_QUIT_HANGS=1`), and `client -uid N`, the
//!   stand-in CUDA client's request for its server's socket. A server serves one UID; asking for
//!   another UID while it runs is refused unless the daemon runs with `-M` (multi-user). At start
//!   it writes `nvdra-standin-control.<pid>` into `/dev/shm`, so a test sees which `/dev/shm` it
//!   got, and its pid into `$CUDA_MPS_LOG_DIRECTORY/standin-daemons`, and with `STANDIN_LOG=FILE` it appends `start <CUDA_VISIBLE_DEVICES> <pipe dir>` and
//!   `quit <pipe dir>` lines there. With `STANDIN_START_FAILS_WHILE=FILE` it exits at once,
//!   failing, while FILE exists (a daemon that cannot come back, as on a GPU in a bad state).
//! - `server SOCKET` (started by the daemon): accepts clients and holds their connections; it
//!   exits when its daemon does, so its clients notice, as CUDA clients of a dead MPS do.
//! - `-h`: the usage text, which lists `-M` unless `STANDIN_NO_MULTI_USER=1`; with that set, a
//!   daemon asked for `-M` exits at once with "invalid option", as an MPS without it would.
//! - no mode: the command-line client. Sends stdin's lines to the daemon and prints the answers;
//!   exits 1 with "Cannot find MPS control daemon process" when nothing answers, and exits 1
//!   with `unknown command: <line>` on stderr when the daemon does not know a command.
//! - `cuda-client`: stands in for a CUDA process. Asks the daemon for a server, connects, prints
//!   one line (`connected server=<pid> pinned=<CUDA_MPS_PINNED_DEVICE_MEM_LIMIT>
//!   threads=<CUDA_MPS_ACTIVE_THREAD_PERCENTAGE> shm=<yes|no>`), stays connected, and exits 2
//!   when the server or the daemon goes away (CUDA's errors 805/806/810). When no daemon
//!   answers it does what CUDA does (nvidia-cuda-mps-control(1): "the program continues to run
//!   as it normally would without MPS"): it opens a plain context, unlimited, and prints
//!   `plain-context pid=<pid> pinned=<...>` — unless the GPU is in `EXCLUSIVE_PROCESS` and
//!   another context holds it, when it exits 4 (`cudaErrorDevicesUnavailable`).
//!
//! The GPU's compute mode is modelled with `STANDIN_GPU_DIR=DIR`: the GPU is then in
//! `EXCLUSIVE_PROCESS`, and a context is an exclusive `flock` on `DIR/context`, taken by each
//! MPS server for its life and by each plain context. So, as on a GPU: while a server runs, a
//! plain context is refused; while a plain context runs, no server starts (the daemon answers
//! `error` to its clients). Without it the GPU is in `DEFAULT` mode: any number of contexts.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const DEFAULT_PIPE: &str = "/tmp/nvidia-mps";
const NO_DAEMON: &str = "Cannot find MPS control daemon process";
/// How the daemon answers a command it does not know. NVIDIA documents the commands the control
/// client takes (nvidia-cuda-mps-control(1)), not its answer to others: the text is the
/// stand-in's own. What the stand-in promises is that such a command is refused (the client
/// exits non-zero with the line on stderr), never answered with an empty list.
const UNKNOWN_COMMAND: &str = "unknown command: ";

/// Runs the stand-in with `args` (those after `mps-standin`).
pub fn main(args: &[String]) -> ExitCode {
    let pipe = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY")
        .map(PathBuf::from)
        .unwrap_or_else(|| DEFAULT_PIPE.into());
    let has = |a: &str| args.iter().any(|x| x == a);
    let result = match args.first().map(String::as_str) {
        Some("server") => match args.get(1) {
            Some(socket) => server(Path::new(socket)),
            None => Err("server needs a socket path".into()),
        },
        Some("cuda-client") => return cuda_client(&pipe),
        Some("-h") => {
            println!("{}", usage());
            return ExitCode::SUCCESS;
        }
        _ if has("-M") && no_multi_user() => Err("invalid option -- 'M'".to_string()),
        _ if has("-d") => background(args),
        _ if has("-f") => daemon(&pipe, has("-M")),
        _ => return cli(&pipe),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{} (stand-in): {e}", super::control::CONTROL);
            ExitCode::FAILURE
        }
    }
}

type Result<T, E = String> = std::result::Result<T, E>;

/// `STANDIN_NO_MULTI_USER=1`: an MPS without `-M` (it is not among every driver's flags).
fn no_multi_user() -> bool {
    std::env::var_os("STANDIN_NO_MULTI_USER").is_some_and(|v| v == "1")
}

/// The usage text, `-M` listed unless [`no_multi_user`].
fn usage() -> String {
    let m = if no_multi_user() { "" } else { " [-M]" };
    format!("Usage: {} [-d | -f]{m} [-h]", super::control::CONTROL)
}

fn exe() -> Result<PathBuf> {
    std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))
}

/// `-d`: the daemon in the background, this process gone at once.
fn background(args: &[String]) -> Result<()> {
    let args: Vec<&str> = args
        .iter()
        .map(|a| if a == "-d" { "-f" } else { a.as_str() })
        .collect();
    Command::new(exe()?)
        .arg("mps-standin")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start the daemon: {e}"))?;
    Ok(())
}

fn record(line: &str) {
    if let Some(path) = std::env::var_os("STANDIN_LOG")
        && let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
    {
        let _ = writeln!(f, "{line}");
    }
}

/// A file in this process's `/dev/shm`, named after `what` and the pid.
fn mark_shm(what: &str) {
    let path = format!("/dev/shm/nvdra-standin-{what}.{}", std::process::id());
    if let Err(e) = std::fs::write(&path, b"") {
        eprintln!("stand-in: cannot write {path}: {e}");
    }
}

struct Servers {
    pipe: PathBuf,
    multi_user: bool,
    by_uid: BTreeMap<u32, Child>,
}

impl Servers {
    fn reap(&mut self) {
        self.by_uid.retain(|_, c| matches!(c.try_wait(), Ok(None)));
    }

    fn socket(&self, uid: u32) -> PathBuf {
        self.pipe.join(format!("server-{uid}"))
    }

    /// The server of `uid`, started if needed: its pid.
    fn ensure(&mut self, uid: u32) -> Result<u32> {
        self.reap();
        if let Some(c) = self.by_uid.get(&uid) {
            return Ok(c.id());
        }
        if !self.multi_user
            && let Some(other) = self.by_uid.keys().next()
        {
            return Err(format!(
                "a server for uid {other} is running; uid {uid} waits until its clients exit (no -M)"
            ));
        }
        let socket = self.socket(uid);
        let _ = std::fs::remove_file(&socket);
        let mut child = Command::new(exe()?)
            .args(["mps-standin", "server"])
            .arg(&socket)
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start a server: {e}"))?;
        // Ready when it accepts a connection: the socket file appears at bind(), before
        // listen(), and a client connecting in between is refused. A server that cannot take
        // the GPU exits instead.
        let start = Instant::now();
        while UnixStream::connect(&socket).is_err() && start.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "the MPS server for uid {uid} exited at start ({status})"
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let pid = child.id();
        self.by_uid.insert(uid, child);
        Ok(pid)
    }

    fn stop_all(&mut self) {
        for (_, mut c) in std::mem::take(&mut self.by_uid) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn daemon(pipe: &Path, multi_user: bool) -> Result<()> {
    if let Some(block) = std::env::var_os("STANDIN_START_FAILS_WHILE").map(PathBuf::from)
        && block.exists()
    {
        return Err(format!("cannot start while {} exists", block.display()));
    }
    let socket = pipe.join("control");
    let _ = std::fs::remove_file(&socket);
    let listener = listen(&socket)?;
    mark_shm("control");
    // Which daemon processes served this directory, in start order: the host clears `/dev/shm`
    // at each start, so the log directory keeps the history.
    if let Some(log) = std::env::var_os("CUDA_MPS_LOG_DIRECTORY")
        && let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(Path::new(&log).join("standin-daemons"))
    {
        let _ = writeln!(f, "{}", std::process::id());
    }
    let devices = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default();
    record(&format!("start {devices} {}", pipe.display()));
    eprintln!(
        "stand-in MPS control daemon {} on {} for {devices}{}",
        std::process::id(),
        socket.display(),
        if multi_user { " (multi-user)" } else { "" }
    );
    let servers = Arc::new(Mutex::new(Servers {
        pipe: pipe.to_path_buf(),
        multi_user,
        by_uid: BTreeMap::new(),
    }));
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let servers = servers.clone();
        std::thread::spawn(move || {
            let _ = session(conn, &servers);
        });
    }
    Ok(())
}

/// A socket clients of any UID may connect to, as the pipe directory's are.
fn listen(socket: &Path) -> Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let listener = UnixListener::bind(socket)
        .map_err(|e| format!("cannot listen on {}: {e}", socket.display()))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o777))
        .map_err(|e| format!("cannot open {} to every UID: {e}", socket.display()))?;
    Ok(listener)
}

/// One client connection: its lines answered in turn.
fn session(conn: UnixStream, servers: &Mutex<Servers>) -> std::io::Result<()> {
    let mut out = conn.try_clone()?;
    for line in BufReader::new(conn).lines() {
        let line = line?;
        let words: Vec<&str> = line.split_whitespace().collect();
        let uid = || -> Option<u32> {
            match words.as_slice() {
                [_, "-uid", n] => n.parse().ok(),
                _ => None,
            }
        };
        let lock = || servers.lock().unwrap_or_else(|p| p.into_inner());
        let answer = match words.first().copied() {
            Some("get_server_list") => {
                let mut s = lock();
                s.reap();
                s.by_uid.values().map(|c| format!("{}\n", c.id())).collect()
            }
            Some("start_server") | Some("client") => match uid() {
                None => format!("usage: {} -uid N\n", words[0]),
                Some(uid) => {
                    let started = lock().ensure(uid);
                    match started {
                        // The socket's name in the pipe directory: a client in a container sees
                        // the directory at another path.
                        Ok(_) if words[0] == "client" => format!("server-{uid}\n"),
                        Ok(pid) => format!("{pid}\n"),
                        Err(e) => format!("error: {e}\n"),
                    }
                }
            },
            Some("quit") => {
                if std::env::var_os("STANDIN_QUIT_HANGS").is_some_and(|v| v == "1") {
                    eprintln!("stand-in: quit received; hanging (STANDIN_QUIT_HANGS=1)");
                    loop {
                        std::thread::sleep(Duration::from_secs(3600));
                    }
                }
                let mut s = lock();
                s.stop_all();
                let _ = std::fs::remove_file(s.pipe.join("control"));
                record(&format!("quit {}", s.pipe.display()));
                std::process::exit(0);
            }
            _ => format!("{UNKNOWN_COMMAND}{line}\n"),
        };
        out.write_all(answer.as_bytes())?;
        out.flush()?;
    }
    Ok(())
}

/// A server: holds its clients' connections until its daemon goes.
fn server(socket: &Path) -> Result<()> {
    // The GPU's one context under EXCLUSIVE_PROCESS, held for this server's life.
    let _context = match take_context() {
        Ok(held) => held,
        Err(e) => {
            return Err(format!(
                "cannot create the MPS server's context: {e} (a process outside MPS holds the \
                 GPU in EXCLUSIVE_PROCESS)"
            ));
        }
    };
    let listener = listen(socket)?;
    mark_shm("server");
    let parent = std::os::unix::process::parent_id();
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_millis(50));
            if std::os::unix::process::parent_id() != parent {
                // The daemon is gone: so is every client's server.
                std::process::exit(1);
            }
        }
    });
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        std::thread::spawn(move || {
            let mut out = match conn.try_clone() {
                Ok(o) => o,
                Err(_) => return,
            };
            let mut lines = BufReader::new(conn).lines();
            if let Some(Ok(_hello)) = lines.next() {
                let _ = writeln!(out, "ok {}", std::process::id());
            }
            // Held until the client or this server ends.
            for _ in lines {}
        });
    }
    Ok(())
}

/// The command-line client.
fn cli(pipe: &Path) -> ExitCode {
    let Ok(mut conn) = UnixStream::connect(pipe.join("control")) else {
        eprintln!("{NO_DAEMON}");
        return ExitCode::FAILURE;
    };
    let mut input = String::new();
    if std::io::stdin().read_to_string(&mut input).is_err()
        || conn.write_all(input.as_bytes()).is_err()
        || conn.shutdown(std::net::Shutdown::Write).is_err()
    {
        eprintln!("{NO_DAEMON}");
        return ExitCode::FAILURE;
    }
    let mut answer = String::new();
    if conn.read_to_string(&mut answer).is_err() {
        eprintln!("{NO_DAEMON}");
        return ExitCode::FAILURE;
    }
    // A command the daemon does not know is refused: its line goes to stderr and the client
    // fails, so a caller that misspells a command sees an error, never an empty answer.
    let (refused, answered): (Vec<&str>, Vec<&str>) =
        answer.lines().partition(|l| l.starts_with(UNKNOWN_COMMAND));
    for line in answered {
        println!("{line}");
    }
    let _ = std::io::stdout().flush();
    if refused.is_empty() {
        return ExitCode::SUCCESS;
    }
    for line in refused {
        eprintln!("{line}");
    }
    ExitCode::FAILURE
}

/// The GPU's context lock (`STANDIN_GPU_DIR/context`), taken without waiting: `Ok(None)` when
/// the GPU is in `DEFAULT` mode (no `STANDIN_GPU_DIR`: contexts do not exclude each other);
/// an error when another context holds it. Held while the returned file is open.
fn take_context() -> Result<Option<std::fs::File>> {
    use std::os::fd::AsRawFd;
    let Some(dir) = std::env::var_os("STANDIN_GPU_DIR").map(PathBuf::from) else {
        return Ok(None);
    };
    let path = dir.join("context");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    // SAFETY: flock on a descriptor this function owns; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err("another context holds the GPU".into());
    }
    Ok(Some(file))
}

/// How a client's attempt to reach MPS ended short of a server.
enum Missed {
    /// No daemon answers: CUDA runs without MPS.
    NoDaemon(String),
    /// The daemon answered but gave no server: CUDA fails.
    Refused(String),
}

/// A CUDA process's view of MPS.
fn cuda_client(pipe: &Path) -> ExitCode {
    match cuda_connect(pipe) {
        Ok(server) => {
            // Connected until the server goes.
            let mut rest = String::new();
            let _ = BufReader::new(server).read_to_string(&mut rest);
            eprintln!("MPS server went away (as CUDA's cudaErrorMpsRpcFailure, 806)");
            ExitCode::from(2)
        }
        Err(Missed::Refused(e)) => {
            eprintln!("{e}");
            ExitCode::from(3)
        }
        Err(Missed::NoDaemon(e)) => plain_context(&e),
    }
}

/// What CUDA does when no MPS daemon answers: a context of its own, outside MPS, with no MPS
/// limit — refused only where the GPU is in `EXCLUSIVE_PROCESS` and a context holds it.
fn plain_context(why: &str) -> ExitCode {
    match take_context() {
        Ok(held) => {
            println!(
                "plain-context pid={} pinned={} (outside MPS, unlimited: {why})",
                std::process::id(),
                client_env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
            );
            let _ = std::io::stdout().flush();
            let _held = held;
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        Err(e) => {
            eprintln!(
                "cudaErrorDevicesUnavailable (46): all CUDA-capable devices are busy or \
                 unavailable ({e}; {why})"
            );
            ExitCode::from(4)
        }
    }
}

fn client_env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| "unset".into())
}

fn cuda_connect(pipe: &Path) -> std::result::Result<UnixStream, Missed> {
    let uid = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .map_err(|e| Missed::Refused(format!("cannot read this process's uid: {e}")))?;
    let refused = |e: std::io::Error| Missed::Refused(e.to_string());
    let no_daemon =
        |e: std::io::Error| Missed::NoDaemon(format!("{NO_DAEMON} in {}: {e}", pipe.display()));
    let mut control = UnixStream::connect(pipe.join("control")).map_err(no_daemon)?;
    writeln!(control, "client -uid {uid}").map_err(no_daemon)?;
    let mut reply = String::new();
    BufReader::new(&control)
        .read_line(&mut reply)
        .map_err(no_daemon)?;
    let reply = reply.trim();
    if reply.is_empty() {
        return Err(Missed::NoDaemon(format!(
            "{NO_DAEMON}: the daemon in {} closed the connection",
            pipe.display()
        )));
    }
    if reply.starts_with("error") {
        return Err(Missed::Refused(format!(
            "the MPS daemon refused a server: {reply}"
        )));
    }
    let name = Path::new(reply).file_name().unwrap_or_default();
    let mut server = UnixStream::connect(pipe.join(name))
        .map_err(|e| Missed::Refused(format!("cannot reach the server {reply}: {e}")))?;
    let (pinned, threads) = (
        client_env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        client_env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
    );
    writeln!(server, "hello uid={uid}").map_err(refused)?;
    let mut ok = String::new();
    let mut reader = BufReader::new(server.try_clone().map_err(refused)?);
    reader.read_line(&mut ok).map_err(refused)?;
    let pid = ok
        .trim()
        .strip_prefix("ok ")
        .ok_or_else(|| Missed::Refused(format!("the server did not accept: {ok:?}")))?
        .to_string();
    let shm = Path::new(&format!("/dev/shm/nvdra-standin-server.{pid}")).exists();
    println!(
        "connected server={pid} pinned={pinned} threads={threads} shm={}",
        if shm { "yes" } else { "no" }
    );
    let _ = std::io::stdout().flush();
    Ok(server)
}
