//! nvidia.com/gpu-memory.

use super::*;
use std::collections::{BTreeMap, BTreeSet};

fn memory_opts() -> Options {
    Options {
        gpu_memory: true,
        ..Options::default()
    }
}

#[test]
fn gpu_memory_lists_one_unit_per_gib_of_each_whole_gpu() {
    let inv = inv("dgx-h100");
    assert!(
        resources(&inv, &Options::default())
            .unwrap()
            .iter()
            .all(|r| r.name.as_str() != resources::GPU_MEMORY),
        "off by default"
    );
    let res = resources(&inv, &memory_opts()).unwrap();
    assert_eq!(
        ResourceName::parse(resources::GPU_MEMORY).unwrap().as_str(),
        resources::GPU_MEMORY
    );
    assert!(
        res.iter().all(|r| r.name.as_str() != "nvidia.com/gpu"),
        "a GPU advertised as units is not also advertised whole"
    );
    let mem = by_name(&res, resources::GPU_MEMORY);
    assert!(mem.memory_units() && !mem.replicated());
    let expected: u64 = inv.gpus.iter().map(|g| g.memory_bytes >> 30).sum();
    assert_eq!(mem.devices.len() as u64, expected);
    let g0 = &inv.gpus[0];
    let first: Vec<&str> = mem.devices[..2].iter().map(|d| d.id.as_str()).collect();
    assert_eq!(
        first,
        [format!("{}::mem-0", g0.uuid), format!("{}::mem-1", g0.uuid)]
    );
    for d in &mem.devices {
        let g = &inv.gpus[d.gpu_index as usize];
        assert_eq!(d.numa_node, g.numa_node);
        assert!(d.id.len() <= resources::MAX_DEVICE_ID);
    }
    let last = (g0.memory_bytes >> 30) - 1;
    assert!(mem.device(&format!("{}::mem-{last}", g0.uuid)).is_some());
    assert!(
        mem.device(&format!("{}::mem-{}", g0.uuid, last + 1))
            .is_none()
    );
    // MIG: only GPUs advertised whole get units.
    let mig = self::inv("a100-mig-mixed");
    let o = Options {
        mig_strategy: MigStrategy::Mixed,
        ..memory_opts()
    };
    let res = resources(&mig, &o).unwrap();
    let gpus: std::collections::BTreeSet<u32> = by_name(&res, resources::GPU_MEMORY)
        .devices
        .iter()
        .map(|d| d.gpu_index)
        .collect();
    assert_eq!(gpus.into_iter().collect::<Vec<_>>(), [0, 3]);
    assert!(res.iter().all(|r| r.name.as_str() != "nvidia.com/gpu"));
    // Replicas under the name are refused while the units are on.
    let renamed = opts(
        "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, rename: gpu-memory, replicas: 2}\n",
    );
    assert!(resources(&inv, &renamed).is_ok());
    let o = Options {
        gpu_memory: true,
        ..opts(
            "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, rename: gpu-memory, replicas: 2}\n",
        )
    };
    assert_eq!(
        resources(&inv, &o).unwrap_err(),
        ResError::ReservedName {
            name: resources::GPU_MEMORY.into()
        }
    );
}

/// Every physical device (a GPU, or a MIG device) with the resource names it is advertised
/// under.
fn names_per_device(res: &[Resource]) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for r in res {
        for d in &r.devices {
            out.entry(d.uuid.to_string())
                .or_default()
                .insert(r.name.to_string());
        }
    }
    out
}

#[test]
fn with_gpu_memory_on_each_gpu_is_advertised_under_one_name_only() {
    // GPUs 0 and 1 time-sliced, the others as memory units: never a GPU both ways.
    let sliced = "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, devices: [0, 1], replicas: 4}\n";
    let o = Options {
        gpu_memory: true,
        ..opts(sliced)
    };
    let inv = inv("dgx-h100");
    let res = resources(&inv, &o).unwrap();
    let names = names_per_device(&res);
    assert_eq!(names.len(), 8, "every GPU is advertised");
    for (i, g) in inv.gpus.iter().enumerate() {
        let want = if i < 2 {
            "nvidia.com/gpu"
        } else {
            resources::GPU_MEMORY
        };
        assert_eq!(
            names[g.uuid.as_str()],
            BTreeSet::from([want.to_string()]),
            "GPU {i}"
        );
    }
    assert!(by_name(&res, "nvidia.com/gpu").replicated());
    assert_eq!(by_name(&res, "nvidia.com/gpu").devices.len(), 2 * 4);

    // Every profile and MIG strategy: one name per physical device.
    for profile in ["dgx-h100", "pcie-pairs", "a100-mig-mixed"] {
        for (strategy, sharing) in [
            (MigStrategy::None, ""),
            (MigStrategy::Mixed, ""),
            (MigStrategy::Mixed, sliced),
        ] {
            let o = Options {
                gpu_memory: true,
                mig_strategy: strategy,
                ..if sharing.is_empty() {
                    Options::default()
                } else {
                    opts(sharing)
                }
            };
            let res = resources(&self::inv(profile), &o).unwrap();
            for (device, names) in names_per_device(&res) {
                assert_eq!(
                    names.len(),
                    1,
                    "{profile} {strategy:?}: {device} under {names:?}"
                );
            }
        }
    }
}

#[test]
fn gpu_memory_allocate_sets_the_pinned_limit_of_one_gpu() {
    let inv = inv("pcie-pairs");
    let res = resources(&inv, &memory_opts()).unwrap();
    let mem = by_name(&res, resources::GPU_MEMORY);
    let unit = |g: usize, n: u32| format!("{}::mem-{n}", inv.gpus[g].uuid);
    let a = allocate::allocate(
        mem,
        &[unit(2, 0), unit(2, 7), unit(2, 3)],
        &ctx(memory_opts()),
    )
    .unwrap();
    assert_eq!(a.envs["NVIDIA_VISIBLE_DEVICES"], inv.gpus[2].uuid.as_str());
    // Keyed by the index the container sees (its one GPU: 0), not by UUID: NVIDIA's device
    // plugin v0.15.0 moved to index keys because UUID-keyed limits were not applied.
    assert_eq!(a.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=3G");
    // CDI: the GPU's CDI device, once.
    let c = ctx(Options {
        list_strategies: vec![ListStrategy::CdiCri],
        ..memory_opts()
    });
    let a = allocate::allocate(mem, &[unit(1, 0), unit(1, 1)], &c).unwrap();
    assert_eq!(
        a.cdi_devices,
        [format!("k8s.gpu.nvidia.com/gpu={}", inv.gpus[1].uuid)]
    );
    assert_eq!(a.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=2G");
    // Spanning GPUs: refused, naming the GPUs and the rule.
    let e = allocate::allocate(
        mem,
        &[unit(0, 0), unit(3, 0), unit(0, 1)],
        &ctx(memory_opts()),
    )
    .unwrap_err();
    assert_eq!(
        e,
        allocate::Error::MemorySpansGpus {
            resource: resources::GPU_MEMORY.into(),
            gpus: vec![inv.gpus[0].uuid.to_string(), inv.gpus[3].uuid.to_string()],
        }
    );
    let msg = e.to_string();
    assert!(
        msg.contains("must come from one GPU") && msg.contains(inv.gpus[3].uuid.as_str()),
        "{msg}"
    );
}

#[test]
fn gpu_memory_preferred_allocation_packs_units_on_one_gpu() {
    let mut inv = inv("pcie-pairs");
    inv.gpus[3].health = Health::Unhealthy {
        reason: "XID 48".into(),
    };
    let res = resources(&inv, &memory_opts()).unwrap();
    let mem = by_name(&res, resources::GPU_MEMORY);
    let units = |g: usize| -> Vec<String> {
        mem.devices
            .iter()
            .filter(|d| d.gpu_index == g as u32)
            .map(|d| d.id.clone())
            .collect()
    };
    let per_gpu = units(0).len();
    assert!(per_gpu > 8);
    // GPU 0 has 5 units free, GPU 1 all of its, GPU 2 six, GPU 3 is unhealthy.
    let mut available: Vec<String> = units(0)[..5].to_vec();
    available.extend(units(1));
    available.extend(units(2)[..6].to_vec());
    available.extend(units(3));
    let gpus_of = |ids: &[String]| -> Vec<u32> {
        let mut g: Vec<u32> = ids
            .iter()
            .map(|id| mem.device(id).unwrap().gpu_index)
            .collect();
        g.dedup();
        g
    };
    let avail: Vec<&str> = available.iter().map(String::as_str).collect();
    // 4 units: the tightest GPU that holds them (GPU 0, 5 free), not a fresh one.
    let got = preferred(mem, &req(&avail, &[], 4), false);
    assert_eq!((got.len(), gpus_of(&got)), (4, vec![0]));
    // 6 units: GPU 2 fits exactly.
    let got = preferred(mem, &req(&avail, &[], 6), false);
    assert_eq!((got.len(), gpus_of(&got)), (6, vec![2]));
    // 8 units: only GPU 1 holds them; the unhealthy GPU 3 never.
    let got = preferred(mem, &req(&avail, &[], 8), false);
    assert_eq!((got.len(), gpus_of(&got)), (8, vec![1]));
    // Must-include fixes the GPU.
    let must = units(2)[0].clone();
    let got = preferred(mem, &req(&avail, &[must.as_str()], 3), false);
    assert_eq!((got.len(), gpus_of(&got)), (3, vec![2]));
    assert_eq!(got[0], must);
}
