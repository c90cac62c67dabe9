//! `nvdra run` as a process in a sandbox: the one launcher of the daemon for the tests and the
//! benches (which include this file by `#[path]`), so that every run keeps the host's kubelet,
//! CDI, driver and MPS directories out of reach the same way.
// Each test binary uses what it needs.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Stdio};

/// `nvdra run --mode <mode> --node-name <node>` with everything it touches under `root`: the
/// directory API `api/`, the kubelet's root `kubelet/`, CDI specs in `cdi/`, the driver root
/// `driver/`, the MPS root `mps/`, the boot id in `boot_id` (written as `boot-1` when missing),
/// and `/metrics` on a free port. It logs errors only, hits no crash point, and reads no stdin;
/// its stdout is dropped, its stderr is the test's.
///
/// The sandbox is given through the flags' environment names, which the command line overrides:
/// the caller adds a flag to replace one (`--cdi-root`, `--metrics-address`, ...), `.env` to
/// replace `NVDRA_LOG` or the boot id file, and `env_remove("NVDRA_API_DIR")` to talk to an API
/// server with `--kubeconfig` instead. The backend flags are the caller's.
pub fn nvdra_run(root: &Path, mode: &str, node: &str) -> Command {
    nvdra_run_of(Path::new(env!("CARGO_BIN_EXE_nvdra")), root, mode, node)
}

/// [`nvdra_run`] of another build of nvdra, `bin` (`benches/rss.rs` compares builds); a flag's
/// environment name that an older build does not know is ignored by it.
pub fn nvdra_run_of(bin: &Path, root: &Path, mode: &str, node: &str) -> Command {
    let boot_id = root.join("boot_id");
    if !boot_id.exists() {
        std::fs::write(&boot_id, "boot-1\n").expect("write the sandbox's boot id");
    }
    let mut cmd = Command::new(bin);
    cmd.args(["run", "--mode", mode, "--node-name", node])
        .env("NVDRA_API_DIR", root.join("api"))
        .env("NVDRA_KUBELET_ROOT", root.join("kubelet"))
        .env("NVDRA_CDI_ROOT", root.join("cdi"))
        .env("NVIDIA_DRIVER_ROOT", root.join("driver"))
        .env("NVDRA_MPS_ROOT", root.join("mps"))
        .env("NVDRA_METRICS_ADDRESS", "127.0.0.1:0")
        .env("NVDRA_BOOT_ID_FILE", boot_id)
        .env("NVDRA_LOG", "error")
        .env_remove("NVDRA_TEST_CRASH_AT")
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    cmd
}

/// The address process `pid` listens on over TCP (`/metrics`: the sandbox binds
/// `127.0.0.1:0`, so the kernel picks the port and no other test can take it between a pick and
/// the bind, as a port bound, released and passed on could be), read from `/proc`: the
/// listening socket among the process's descriptors. Waits up to a minute for the bind; panics
/// when the process exits first or never listens.
pub fn metrics_address(pid: u32) -> std::net::SocketAddr {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        if let Some(addr) = tcp_listener_of(pid) {
            return addr;
        }
        assert!(
            Path::new(&format!("/proc/{pid}/fd")).exists(),
            "process {pid} exited before it listened on /metrics"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "process {pid} did not listen on /metrics within a minute"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The first IPv4 TCP socket of process `pid` in state LISTEN (`0A` in `/proc/<pid>/net/tcp`),
/// or `None` when it has none yet.
fn tcp_listener_of(pid: u32) -> Option<std::net::SocketAddr> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_str()?.strip_prefix("socket:[")?.strip_suffix(']')?;
            Some(l.to_string())
        })
        .collect();
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).ok()?;
    // `sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...`; the
    // address is the raw `__be32` printed as a native u32 in hex, then `:` and the port in hex.
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.get(3) != Some(&"0A") || !inodes.iter().any(|i| Some(&i.as_str()) == f.get(9)) {
            return None;
        }
        let (ip, port) = f.get(1)?.split_once(':')?;
        let ip = u32::from_str_radix(ip, 16).ok()?.to_ne_bytes();
        let port = u16::from_str_radix(port, 16).ok()?;
        Some(std::net::SocketAddr::from((ip, port)))
    })
}
