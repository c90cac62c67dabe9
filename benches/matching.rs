//! `nvdra match` over many claims: claims per second when each is matched against what the
//! claims before it hold (shares of consumable capacity), on a DGX H100 published with
//! `--shared-capacity` (8 GPUs, each allocatable many times). The claims ask gpu.nvidia.com for
//! 20Gi, so four fit each GPU: 32 fit, the rest are explained as not fitting, naming what is
//! held. This bounds how long `nvdra match` takes on a node full of
//! shares, where every claim's search starts from the holdings of all the claims before it.
//!
//! Run with `cargo bench --bench matching`; prints the median over the runs.

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::resource::v1::ResourceSlice;
use nvdra::cel::Environment;
use nvdra::dra::slices::{ConsumableShares, CounterLayout, SliceOptions, desired_slices};
use nvdra::inventory::topology::load_profile;
use nvdra::matching::{self, Node, Objects};

const RUNS: usize = 9;

fn claims(n: usize) -> String {
    (0..n)
        .map(|i| {
            format!(
                "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: share-{i}}}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: gpu.nvidia.com\n        capacity: {{requests: {{memory: 20Gi}}}}\n"
            )
        })
        .collect()
}

fn main() {
    let inv = load_profile("dgx-h100", "bench-node").expect("built-in profile");
    let opts = SliceOptions {
        driver: "gpu.nvidia.com".into(),
        node_name: "bench-node".into(),
        partitionable: false,
        shared_capacity: ConsumableShares::Memory,
        dynamic_mig: false,
        mig_profiles: None,
        layout: CounterLayout::Separate,
    };
    let slices: Vec<ResourceSlice> = desired_slices(&inv, &opts)
        .expect("valid slices")
        .into_iter()
        .map(|spec| ResourceSlice {
            metadata: Default::default(),
            spec,
        })
        .collect();
    let env = Environment::new();
    let node = Node::from_slices(&env, &slices).expect("converts");
    let classes = matching::compile_classes(&[]).expect("built-in classes compile");

    for n in [8, 32, 64] {
        let mut objects = Objects::default();
        matching::input::read_text(Path::new("claims.yaml"), &claims(n), &mut objects)
            .expect("claims parse");
        let mut times: Vec<Duration> = Vec::with_capacity(RUNS);
        let mut fit = 0;
        for _ in 0..RUNS {
            let start = Instant::now();
            let reports = matching::explain_all(&env, black_box(&objects.claims), &classes, &node)
                .expect("claims match");
            times.push(start.elapsed());
            fit = reports.iter().filter(|r| r.satisfiable).count();
        }
        assert_eq!(fit, n.min(32), "four 20Gi shares per GPU, eight GPUs");
        times.sort();
        let median = times[RUNS / 2];
        println!(
            "match {n:>3} share claims ({fit:>2} fit) on 8 devices  median {median:>9.3?}  {:>7.0} claims/s",
            n as f64 / median.as_secs_f64()
        );
    }
}
