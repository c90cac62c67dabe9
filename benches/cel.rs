//! Selector evaluation speed: selectors per second over 1,000 devices (the dgx-a100-mig profile's
//! partitionable devices, repeated), for the selectors users write — NVIDIA's DeviceClass, a
//! memory comparison, a regex on the product name, a semver comparison, a `cel.bind`. Also the
//! compile time of one selector. `nvdra match` evaluates every class and request selector
//! against every device, so this bounds how long it takes on a large node.
//!
//! Run with `cargo bench --bench cel`; prints the median over the runs.

use std::hint::black_box;
use std::time::{Duration, Instant};

use nvdra::cel::{Environment, Selector};
use nvdra::dra::slices::{ConsumableShares, CounterLayout, SliceOptions, desired_slices};
use nvdra::inventory::topology::load_profile;

const DEVICES: usize = 1000;
const RUNS: usize = 15;

const SELECTORS: &[(&str, &str)] = &[
    (
        "deviceclass",
        "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'",
    ),
    (
        "memory",
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('10Gi')) >= 0",
    ),
    (
        "regex",
        "device.attributes['gpu.nvidia.com'].productName.lowerAscii().matches('^.*a100.*$')",
    ),
    (
        "semver",
        "device.attributes['gpu.nvidia.com'].driverVersion.isGreaterThan(semver('550.0.0'))",
    ),
    (
        "bind",
        "cel.bind(g, device.attributes['gpu.nvidia.com'], g.type == 'mig' && g.profile.startsWith('1g.'))",
    ),
];

fn main() {
    let inv = load_profile("dgx-a100-mig", "bench-node").expect("built-in profile");
    let opts = SliceOptions {
        driver: "gpu.nvidia.com".into(),
        node_name: "bench-node".into(),
        partitionable: true,
        shared_capacity: ConsumableShares::Disabled,
        dynamic_mig: false,
        mig_profiles: None,
        layout: CounterLayout::Separate,
    };
    let published: Vec<_> = desired_slices(&inv, &opts)
        .expect("valid slices")
        .into_iter()
        .flat_map(|s| s.devices.unwrap_or_default())
        .collect();
    let env = Environment::new();
    let devices: Vec<_> = published
        .iter()
        .cycle()
        .take(DEVICES)
        .map(|d| env.device("gpu.nvidia.com", d).expect("converts"))
        .collect();

    for (label, expr) in SELECTORS {
        let sel = Selector::compile(expr).expect("compiles");
        let mut times: Vec<Duration> = Vec::with_capacity(RUNS);
        let mut matched = 0;
        for _ in 0..RUNS {
            let start = Instant::now();
            matched = 0;
            for d in &devices {
                if sel.evaluate(&env, black_box(d)) == Ok(true) {
                    matched += 1;
                }
            }
            times.push(start.elapsed());
        }
        times.sort();
        let median = times[RUNS / 2];
        println!(
            "cel {label:<12} {DEVICES} devices ({matched:>4} match)  median {median:>9.3?}  {:>9.0} selectors/s",
            DEVICES as f64 / median.as_secs_f64()
        );
    }

    let mut compile: Vec<Duration> = (0..50)
        .map(|_| {
            let start = Instant::now();
            black_box(Selector::compile(black_box(SELECTORS[1].1)).expect("compiles"));
            start.elapsed()
        })
        .collect();
    compile.sort();
    println!("cel compile one selector  median {:>9.3?}", compile[25]);
}
