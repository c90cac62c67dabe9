//! Dynamic MIG (`--dynamic-mig`): the prepare and unprepare of a MIG placement that switches its
//! GPU's MIG mode, against one that does not, interleaved in one loop on one plugin so that both
//! see the same disk:
//!
//! - **switch**: a 1g.10gb placement of GPU 0, outside MIG mode: prepare records the GPU, turns
//!   MIG mode on, creates the instance and writes the spec; unprepare destroys it and turns the
//!   mode off (its last instance);
//! - **no switch**: a 1g.10gb placement of GPU 1, which another claim's instance keeps in MIG
//!   mode: prepare creates the instance and writes the spec; unprepare destroys it.
//!
//! Both take the slow path (their intent durable before the GPU changes), so the difference is
//! the mode switches and the lock and reads around them. No GPU here knows the real toggle time:
//! the simulated backend's toggle delay models it, run at 0 (what nvdra adds) and at
//! `NVDRA_BENCH_TOGGLE_MS` (default 100 ms; the fake NVML's `FAKE_NVML_MIG_TOGGLE_DELAY_MS`
//! models the same) to show that the switch's time is the toggle's. The plugin is driven in
//! process (no gRPC), claims read from the directory API, on a simulated DGX H100. Run with
//! `cargo bench --bench dynamic_mig`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nvdra::dra::plugin::{ClaimRef, Options, Plugin};
use nvdra::ids::ClaimUid;
use nvdra::inventory::DeviceBackend;
use nvdra::inventory::sim::SimBackend;
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "node-a";
const SWITCH: &str = "gpu-0-mig-1g10gb-19-0";
const NO_SWITCH: &str = "gpu-1-mig-1g10gb-19-0";
const HOLDER: &str = "gpu-1-mig-1g10gb-19-6";

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn report(label: &str, mut times: Vec<Duration>) -> Duration {
    times.sort();
    let (p50, p99) = (percentile(&times, 0.5), percentile(&times, 0.99));
    println!(
        "{label:<44} n={:<4} p50 {:>9.3} ms  p99 {:>9.3} ms",
        times.len(),
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3
    );
    p50
}

fn cref(uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: "default".into(),
        name: format!("claim-{uid}"),
        uid: ClaimUid::parse(uid).unwrap(),
    }
}

async fn prepare(p: &Plugin, uid: &str) -> Duration {
    let t = Instant::now();
    let r = p.prepare(vec![cref(uid)]).await;
    let took = t.elapsed();
    if let Err(e) = &r[0].1 {
        panic!("prepare {uid}: {e}");
    }
    took
}

async fn unprepare(p: &Plugin, uid: &str) -> Duration {
    let t = Instant::now();
    let r = p.unprepare(vec![cref(uid)]).await;
    let took = t.elapsed();
    if let Err(e) = &r[0].1 {
        panic!("unprepare {uid}: {e}");
    }
    took
}

/// One plugin with the toggle taking `delay`: `n` interleaved rounds of both workloads.
async fn run(delay: Duration, n: usize) {
    let dir = tempfile::tempdir().unwrap();
    let api_dir = dir.path().join("api");
    for (uid, device) in [("s", SWITCH), ("k", NO_SWITCH), ("h", HOLDER)] {
        let c = nvdra::api::allocated_claim(
            "default",
            &format!("claim-{uid}"),
            uid,
            vec![nvdra::api::allocated_device("mig", DRIVER, NODE, device)],
            vec![],
        );
        nvdra::api::dir::write_claim(&api_dir, &c).unwrap();
    }
    let api = Arc::new(nvdra::api::dir::DirApi::new(&api_dir).unwrap());
    let sim = SimBackend::from_profile("dgx-h100", NODE).unwrap();
    sim.set_mig_toggle_delay(delay);
    let opts = Options {
        driver: DRIVER.into(),
        pool: NODE.into(),
        plugin_dir: dir.path().join("plugin"),
        cdi_root: dir.path().join("cdi"),
        driver_root: nvdra::cdi::DriverRoot::at(&dir.path().join("driver")),
        boot_id: "bench".into(),
        partitionable: false,
        shared_capacity: nvdra::dra::slices::ConsumableShares::Disabled,
        mps_root: dir.path().join("mps"),
        dynamic_mig: true,
        keep_mig_on: false,
        share_trust_domain: Default::default(),
        proc_root: None,
        claim_status: false,
    };
    // As `nvdra run` wires it: the owner reads the hardware, the plugin writes through its
    // handle and waits for the read after each change.
    let stop = CancellationToken::new();
    let inventory = nvdra::testing::start_owner(
        Arc::new(sim.clone()),
        Duration::from_secs(3600),
        nvdra::testing::no_health(),
        stop.clone(),
    )
    .await
    .unwrap();
    let writes = nvdra::inventory::owner::Writes::new(Arc::new(sim.clone()), inventory);
    let (plugin, writer, _) =
        Plugin::new(opts, api, writes, nvdra::metrics::Metrics::new(), None).unwrap();
    tokio::spawn(writer.run(stop.clone()));
    plugin.recover().await.unwrap();
    // GPU 1 stays in MIG mode for its holder's instance.
    prepare(&plugin, "h").await;

    let (mut sp, mut su, mut kp, mut ku) = (vec![], vec![], vec![], vec![]);
    for _ in 0..n {
        sp.push(prepare(&plugin, "s").await);
        kp.push(prepare(&plugin, "k").await);
        su.push(unprepare(&plugin, "s").await);
        ku.push(unprepare(&plugin, "k").await);
    }
    let inv = sim.snapshot().unwrap();
    assert!(
        !inv.gpus[0].mig.enabled,
        "GPU 0 switched off after each round"
    );
    assert!(inv.gpus[1].mig.enabled, "GPU 1 kept on by its holder");
    let ms = delay.as_millis();
    let a = report(&format!("prepare, mode switch (toggle {ms} ms)"), sp);
    let b = report(&format!("prepare, no switch (toggle {ms} ms)"), kp);
    let c = report(&format!("unprepare, mode switch (toggle {ms} ms)"), su);
    let d = report(&format!("unprepare, no switch (toggle {ms} ms)"), ku);
    println!(
        "  switch adds: prepare {:+.3} ms, unprepare {:+.3} ms (p50s)",
        (a.as_secs_f64() - b.as_secs_f64()) * 1e3,
        (c.as_secs_f64() - d.as_secs_f64()) * 1e3
    );
    stop.cancel();
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let toggle_ms: u64 = std::env::var("NVDRA_BENCH_TOGGLE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    run(Duration::ZERO, 300).await;
    run(Duration::from_millis(toggle_ms), 20).await;
}
