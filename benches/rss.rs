//! The daemon's memory: the resident set of the real `nvdra run` binary (the one `cargo bench`
//! builds, release profile) on a simulated DGX H100 (8 GPUs) with the directory API, after
//! start-up and after 1,000 prepare/unprepare cycles of 8 claims (one per GPU, fresh claim UIDs
//! each cycle), read from `/proc/PID/status` (`VmRSS`, and the peak `VmHWM`). Goal: ≤ 10 MiB and
//! no growth between the early and the late cycles.
//!
//! Run: `cargo bench --bench rss` (`RSS_CYCLES=N` for another cycle count; `RSS_REUSE_CLAIMS=1`
//! prepares the same 8 claims every cycle, to tell growth per distinct claim from other growth;
//! `RSS_MODE=both` runs both paths, the device plugin beside DRA with their one ledger;
//! `RSS_BINS="old/nvdra new/nvdra"` measures each of those binaries in turn, in one run, instead
//! of the one the bench builds). The daemon runs with the DaemonSet's `GLIBC_TUNABLES`
//! ([`TUNABLES`]) unless the bench's environment sets its own (`GLIBC_TUNABLES=` for glibc's
//! defaults).

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use kubelet_plugin::proto::dra::v1;
use kubelet_plugin::proto::dra::v1::dra_plugin_client::DraPluginClient;

#[path = "../tests/support/daemon.rs"]
mod daemon;
#[path = "../crates/kubelet-plugin/tests/support/wait.rs"]
mod wait;

const PROFILE: &str = "dgx-h100";
const GPUS: usize = 8;
const NODE: &str = "rss-node";
const DRIVER: &str = "gpu.nvidia.com";
const NAMESPACE: &str = "rss";
/// What `manifests/base/daemonset.yaml` sets (no malloc thread caches, two arenas).
const TUNABLES: &str = "glibc.malloc.tcache_count=0:glibc.malloc.arena_max=2";
/// Cycles after which the "warm" figure is taken; growth is measured from there to the end.
const WARM: usize = 100;

/// Kills the daemon however the bench ends.
struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `… kB` field of `/proc/PID/status`, in KiB.
fn status_kib(pid: u32, name: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
}

/// `VmRSS` and `VmHWM` of `pid`, in KiB.
fn memory(pid: u32) -> (u64, u64) {
    (status_kib(pid, "VmRSS:"), status_kib(pid, "VmHWM:"))
}

/// The resident set split: anonymous (heap, stacks) and file-backed (the binary's pages).
fn split(pid: u32) -> String {
    format!(
        "(anonymous {}, file {})",
        mib(status_kib(pid, "RssAnon:")),
        mib(status_kib(pid, "RssFile:"))
    )
}

/// Threads of `pid` (`Threads:` of its status).
fn threads(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("Threads: in proc status")
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn write_claim(root: &Path, name: &str, uid: &str, device: &str) {
    let claim = nvdra::api::allocated_claim(
        NAMESPACE,
        name,
        uid,
        vec![nvdra::api::allocated_device("gpu", DRIVER, NODE, device)],
        Vec::new(),
    );
    nvdra::api::dir::write_claim(&root.join("api"), &claim).expect("write claim");
}

async fn wait_for(what: &str, daemon: &mut Daemon, cond: impl Fn() -> bool) {
    wait::until(what, Duration::from_secs(600), || {
        if let Some(status) = daemon.0.try_wait().expect("daemon status") {
            panic!("the daemon exited ({status}) before {what}");
        }
        std::future::ready(cond().then_some(()))
    })
    .await
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let cycles: usize = std::env::var("RSS_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let reuse = std::env::var_os("RSS_REUSE_CLAIMS").is_some_and(|v| v == "1");
    let mode = std::env::var("RSS_MODE").unwrap_or_else(|_| "dra".into());
    let bins: Vec<PathBuf> = match std::env::var("RSS_BINS") {
        Ok(list) => list.split_whitespace().map(PathBuf::from).collect(),
        Err(_) => vec![PathBuf::from(env!("CARGO_BIN_EXE_nvdra"))],
    };
    for bin in &bins {
        let size = std::fs::metadata(bin).map(|m| m.len()).unwrap_or_default();
        println!(
            "{} ({:.1} MiB on disk)",
            bin.display(),
            size as f64 / 1048576.0
        );
        measure(bin, cycles, reuse, &mode).await;
    }
}

async fn measure(bin: &Path, cycles: usize, reuse: bool, mode: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    let p = |s: &str| -> PathBuf { root.join(s) };
    let mut command = daemon::nvdra_run_of(bin, root, mode, NODE);
    if std::env::var_os("GLIBC_TUNABLES").is_none() {
        command.env("GLIBC_TUNABLES", TUNABLES);
    }
    let mut daemon = Daemon(
        command
            .args(["--profile", PROFILE])
            .env("NVDRA_LOG", "warn")
            .spawn()
            .expect("start nvdra"),
    );
    let pid = daemon.0.id();
    let dra_socket = p("kubelet/plugins").join(DRIVER).join("dra.sock");
    let slices = p("api/resourceslices");
    wait_for("the DRA socket", &mut daemon, || dra_socket.exists()).await;
    wait_for("the first publish", &mut daemon, || {
        std::fs::read_dir(&slices).is_ok_and(|mut d| d.next().is_some())
    })
    .await;
    // Let start-up finish its work (the echo of the first publish, the first health scan).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (start_rss, start_hwm) = memory(pid);
    let start_split = split(pid);
    let start_threads = threads(pid);

    let mut dra = DraPluginClient::new(
        kubelet_plugin::socket::connect(&dra_socket)
            .await
            .expect("connect to the DRA socket"),
    );
    let mut warm = None;
    let t = Instant::now();
    for cycle in 0..cycles {
        let claims: Vec<v1::Claim> = (0..GPUS)
            .map(|gpu| {
                let c = if reuse { 0 } else { cycle };
                let name = format!("c{c}-{gpu}");
                let uid = format!("00000000-0000-4000-8000-{c:08}{gpu:04}");
                write_claim(root, &name, &uid, &format!("gpu-{gpu}"));
                v1::Claim {
                    namespace: NAMESPACE.into(),
                    uid,
                    name,
                }
            })
            .collect();
        let prepared = dra
            .node_prepare_resources(v1::NodePrepareResourcesRequest {
                claims: claims.clone(),
            })
            .await
            .expect("NodePrepareResources")
            .into_inner();
        for (uid, r) in &prepared.claims {
            assert!(r.error.is_empty(), "prepare {uid}: {}", r.error);
            assert_eq!(r.devices.len(), 1, "prepare {uid}");
        }
        let unprepared = dra
            .node_unprepare_resources(v1::NodeUnprepareResourcesRequest {
                claims: claims.clone(),
            })
            .await
            .expect("NodeUnprepareResources")
            .into_inner();
        for (uid, r) in &unprepared.claims {
            assert!(r.error.is_empty(), "unprepare {uid}: {}", r.error);
        }
        for c in &claims {
            let _ = std::fs::remove_file(nvdra::api::dir::claim_path(
                &root.join("api"),
                NAMESPACE,
                &c.name,
            ));
        }
        if cycle + 1 == WARM.min(cycles) {
            warm = Some((memory(pid).0, split(pid), threads(pid)));
        }
        if (cycle + 1) % 500 == 0 && cycle + 1 != cycles {
            println!(
                "  after {} cycles: VmRSS {} {}",
                cycle + 1,
                mib(memory(pid).0),
                split(pid)
            );
        }
    }
    let elapsed = t.elapsed();
    let (end_rss, end_hwm) = memory(pid);
    let end_split = split(pid);
    let end_threads = threads(pid);
    let (warm, warm_split, warm_threads) =
        warm.unwrap_or((start_rss, start_split.clone(), start_threads));

    println!(
        "rss: nvdra run, {PROFILE} ({GPUS} simulated GPUs), directory API; {cycles} cycles of \
         prepare + unprepare of {GPUS} claims ({}) in {:.1} s",
        if reuse {
            "the same claims each cycle"
        } else {
            "fresh claim UIDs each cycle"
        },
        elapsed.as_secs_f64()
    );
    println!(
        "  after start-up:        VmRSS {} {start_split}  VmHWM {}  threads {start_threads}",
        mib(start_rss),
        mib(start_hwm)
    );
    println!(
        "  after {WARM} cycles:      VmRSS {} {warm_split}  threads {warm_threads}",
        mib(warm)
    );
    println!(
        "  after {cycles} cycles:     VmRSS {} {end_split}  VmHWM {}  threads {end_threads}",
        mib(end_rss),
        mib(end_hwm)
    );
    println!(
        "  growth {WARM} → {cycles} cycles: {:+.1} MiB; goal ≤ 10 MiB and no growth: {}",
        (end_rss as f64 - warm as f64) / 1024.0,
        if end_hwm <= 10 * 1024 && end_rss <= warm + 256 {
            "met"
        } else {
            "NOT met"
        }
    );
}
