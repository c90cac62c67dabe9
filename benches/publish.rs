//! How long the publisher takes to put a DGX A100-sized partitionable pool (8 slices of 64 MIG
//! placements each, plus one shared-counters slice) on an API server, from empty and after a
//! kubelet-style wipe; and what a no-change reconcile costs. KubeApi over HTTP against the test
//! API server on 127.0.0.1. Median of several runs.
//!
//! Run: `cargo bench --bench publish`

#[path = "../tests/support/apiserver.rs"]
mod apiserver;

use apiserver::TestApiServer;
use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceCounterConsumption,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use nvdra::api::kube::KubeApi;
use nvdra::dra::publisher::{Options, Publisher};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const DRIVER: &str = "gpu.nvidia.com";
const NODE: &str = "dgx-a100-0";
const GPUS: usize = 8;
const PLACEMENTS_PER_GPU: usize = 64;
const RUNS: usize = 9;

fn string(v: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(v.into()),
        ..Default::default()
    }
}

fn int(v: i64) -> DeviceAttribute {
    DeviceAttribute {
        int: Some(v),
        ..Default::default()
    }
}

fn version(v: &str) -> DeviceAttribute {
    DeviceAttribute {
        version: Some(v.into()),
        ..Default::default()
    }
}

fn quantity(v: &str) -> Quantity {
    Quantity(v.into())
}

/// One MIG placement of GPU `gpu`, in the style of a partitionable layout.
fn placement(gpu: usize, i: usize) -> Device {
    let profiles = [
        ("1g.10gb", 19, 1),
        ("2g.20gb", 14, 2),
        ("3g.40gb", 9, 3),
        ("4g.40gb", 5, 4),
    ];
    let (profile, gi, slices) = profiles[i % profiles.len()];
    let start = i % 7;
    let attributes = BTreeMap::from([
        ("type".to_string(), string("mig")),
        (
            "uuid".to_string(),
            string(&format!("MIG-{gpu:02}{i:03}-5f0e-4c4d-9d7b-0242ac120002")),
        ),
        (
            "parentUUID".to_string(),
            string(&format!("GPU-{gpu:02}6f3c2e-9b1a-4b2c-8d3e-1f2a3b4c5d6e")),
        ),
        ("profile".to_string(), string(profile)),
        ("parentIndex".to_string(), int(gpu as i64)),
        ("productName".to_string(), string("NVIDIA A100-SXM4-80GB")),
        ("brand".to_string(), string("Nvidia")),
        ("architecture".to_string(), string("Ampere")),
        ("cudaComputeCapability".to_string(), version("8.0.0")),
        ("driverVersion".to_string(), version("570.124.6")),
        ("cudaDriverVersion".to_string(), version("12.8.0")),
        (
            "resource.kubernetes.io/pcieRoot".to_string(),
            string(&format!("pci0000:{:02x}", gpu * 16)),
        ),
        ("numaNode".to_string(), int((gpu / 4) as i64)),
    ]);
    let capacity = BTreeMap::from([
        (
            "memory".to_string(),
            DeviceCapacity {
                value: quantity(&format!("{}Gi", 10 * slices)),
                request_policy: None,
            },
        ),
        (
            "multiprocessors".to_string(),
            DeviceCapacity {
                value: quantity(&format!("{}", 14 * slices)),
                request_policy: None,
            },
        ),
        (
            "copyEngines".to_string(),
            DeviceCapacity {
                value: quantity(&format!("{slices}")),
                request_policy: None,
            },
        ),
        (
            "decoders".to_string(),
            DeviceCapacity {
                value: quantity("0"),
                request_policy: None,
            },
        ),
    ]);
    let counters = BTreeMap::from([
        (
            "memory".to_string(),
            Counter {
                value: quantity(&format!("{}Gi", 10 * slices)),
            },
        ),
        (
            format!("memorySlice{start}"),
            Counter {
                value: quantity("1"),
            },
        ),
        (
            format!("computeSlice{start}"),
            Counter {
                value: quantity("1"),
            },
        ),
    ]);
    Device {
        name: format!(
            "gpu-{gpu}-mig-{}-{gi}-{start}-{i}",
            profile.replace('.', "")
        ),
        attributes: Some(attributes),
        capacity: Some(capacity),
        consumes_counters: Some(vec![DeviceCounterConsumption {
            counter_set: format!("gpu-{gpu}-counter-set"),
            counters,
        }]),
        ..Default::default()
    }
}

fn spec() -> ResourceSliceSpec {
    ResourceSliceSpec {
        driver: DRIVER.into(),
        node_name: Some(NODE.into()),
        pool: ResourcePool {
            name: NODE.into(),
            generation: 0,
            resource_slice_count: 0,
        },
        ..Default::default()
    }
}

fn desired() -> Vec<ResourceSliceSpec> {
    let mut out: Vec<ResourceSliceSpec> = (0..GPUS)
        .map(|gpu| ResourceSliceSpec {
            devices: Some((0..PLACEMENTS_PER_GPU).map(|i| placement(gpu, i)).collect()),
            ..spec()
        })
        .collect();
    let sets = (0..GPUS)
        .map(|gpu| {
            let mut counters = BTreeMap::from([(
                "memory".to_string(),
                Counter {
                    value: quantity("80Gi"),
                },
            )]);
            for s in 0..7 {
                counters.insert(
                    format!("memorySlice{s}"),
                    Counter {
                        value: quantity("1"),
                    },
                );
                counters.insert(
                    format!("computeSlice{s}"),
                    Counter {
                        value: quantity("1"),
                    },
                );
            }
            CounterSet {
                name: format!("gpu-{gpu}-counter-set"),
                counters,
            }
        })
        .collect();
    out.push(ResourceSliceSpec {
        shared_counters: Some(sets),
        ..spec()
    });
    out
}

fn complete(slices: &[ResourceSlice], n: usize) -> bool {
    slices.len() == n
        && slices
            .iter()
            .all(|s| s.spec.pool.generation == slices[0].spec.pool.generation)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

#[tokio::main]
async fn main() {
    let desired = desired();
    let n = desired.len();
    let devices: usize = desired
        .iter()
        .map(|s| s.devices.as_ref().map_or(0, Vec::len))
        .sum();
    let bytes: usize = desired
        .iter()
        .map(|s| serde_json::to_vec(s).unwrap().len())
        .sum();
    println!(
        "publish: {n} slices, {devices} devices, {:.0} KiB of JSON; {RUNS} runs",
        bytes as f64 / 1024.0
    );

    let opts = Options {
        settle: Duration::ZERO,
        ..Options::default()
    };
    let (mut first, mut wipe, mut noop) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..RUNS {
        let server = TestApiServer::start().await;
        server.seed_node(NODE, "node-uid");
        let api = KubeApi::from_url(server.url()).expect("client");
        let (publisher, handle) =
            Publisher::with_options(Arc::new(api), DRIVER, NODE, opts.clone());
        let token = CancellationToken::new();
        let task = tokio::spawn(publisher.run(token.clone()));

        let t = Instant::now();
        let seq = handle.set_desired(desired.clone()).expect("our node");
        handle.wait_synced(seq).await;
        first.push(t.elapsed());
        assert!(complete(&server.slices(), n));

        // Let the echo of our own writes pass, then time a reconcile that writes nothing.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let before = handle.counters();
        let t = Instant::now();
        let seq = handle.set_desired(desired.clone()).expect("our node");
        handle.wait_synced(seq).await;
        noop.push(t.elapsed());
        assert_eq!(
            handle.counters().writes(),
            before.writes(),
            "no writes when nothing changed"
        );

        let t = Instant::now();
        for s in server.slices() {
            server.delete_slice(s.metadata.name.as_deref().unwrap());
        }
        server
            .wait_for(Duration::from_secs(10), |s| complete(s, n))
            .await;
        wipe.push(t.elapsed());

        token.cancel();
        task.await.expect("publisher task");
    }
    println!(
        "  first publish (empty → {n} slices): median {}",
        ms(median(first))
    );
    println!(
        "  no-change reconcile (list + compare): median {}",
        ms(median(noop))
    );
    println!(
        "  restore after a wipe of all slices:  median {}",
        ms(median(wipe))
    );
}
