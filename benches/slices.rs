//! How long `desired_slices` takes for a DGX A100 in partitionable mode (`dgx-a100-mig`: 8 GPUs in
//! MIG mode, 200 devices, every placement of every MIG profile), the largest built-in case, and
//! for a DGX H100 with `--dynamic-mig` (208 devices, whose counters are pared down to the ones
//! that can run short). The publisher recomputes
//! slices on every inventory or health change, so this bounds its reaction time.
//!
//! Run with `cargo bench --bench slices`; prints median and p99 over the runs.

use std::hint::black_box;
use std::time::{Duration, Instant};

use nvdra::dra::slices::{ConsumableShares, CounterLayout, SliceOptions, desired_slices};
use nvdra::inventory::topology::load_profile;

const WARMUP: usize = 20;
const RUNS: usize = 500;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn bench(label: &str, profile: &str, layout: CounterLayout, partitionable: bool) {
    bench_with(label, profile, layout, partitionable, false);
}

fn bench_with(
    label: &str,
    profile: &str,
    layout: CounterLayout,
    partitionable: bool,
    dynamic_mig: bool,
) {
    let inv = load_profile(profile, "bench-node").expect("built-in profile");
    let opts = SliceOptions {
        driver: "gpu.nvidia.com".into(),
        node_name: "bench-node".into(),
        partitionable,
        shared_capacity: ConsumableShares::Disabled,
        dynamic_mig,
        mig_profiles: None,
        layout,
    };
    let mut devices = 0;
    for _ in 0..WARMUP {
        let specs = desired_slices(black_box(&inv), black_box(&opts)).expect("valid slices");
        devices = specs
            .iter()
            .map(|s| s.devices.as_ref().map_or(0, Vec::len))
            .sum();
    }
    let mut times = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        let start = Instant::now();
        let specs = desired_slices(black_box(&inv), black_box(&opts)).expect("valid slices");
        times.push(start.elapsed());
        black_box(specs);
    }
    times.sort();
    println!(
        "desired_slices {profile:<12} {label:<28} {devices:>4} devices  median {:>9.3?}  p99 {:>9.3?}  (n={RUNS})",
        percentile(&times, 0.5),
        percentile(&times, 0.99),
    );
}

fn main() {
    bench(
        "partitionable, separate",
        "dgx-a100-mig",
        CounterLayout::Separate,
        true,
    );
    bench(
        "partitionable, together",
        "dgx-a100-mig",
        CounterLayout::Together,
        true,
    );
    bench("plain", "dgx-a100", CounterLayout::Separate, false);
    bench_with(
        "dynamic MIG, separate",
        "dgx-h100",
        CounterLayout::Separate,
        false,
        true,
    );
}
