use super::allocate::{self, Context};
use super::nvconfig::parse;
use super::preferred::{Request, preferred};
use super::resources::{Error as ResError, Resource, mig_resource, resources};
use super::*;
use crate::inventory::sim::SimBackend;
use crate::inventory::{DeviceBackend, Health, Inventory};

fn inv(profile: &str) -> Inventory {
    SimBackend::from_profile(profile, "n")
        .unwrap()
        .snapshot()
        .unwrap()
}

fn opts(yaml: &str) -> Options {
    parse("test.yaml", yaml).unwrap()
}

fn by_name<'a>(res: &'a [Resource], name: &str) -> &'a Resource {
    res.iter()
        .find(|r| r.name.as_str() == name)
        .unwrap_or_else(|| {
            panic!(
                "no {name} in {:?}",
                res.iter().map(|r| r.name.as_str()).collect::<Vec<_>>()
            )
        })
}

fn ctx(options: Options) -> Context {
    Context {
        options,
        cdi_kind: "k8s.gpu.nvidia.com/gpu".into(),
        dev_root: "/nonexistent".into(),
        cdi_modes: Vec::new(),
    }
}

// ---------------------------------------------------------------------------------------------
// NVIDIA's config file

/// The full example of NVIDIA's config API (reference §2.1), every key set.
const NVIDIA_FULL_EXAMPLE: &str = r#"
version: v1
flags:
  migStrategy: none
  failOnInitError: true
  mpsRoot: /run/nvidia/mps
  nvidiaDriverRoot: /
  nvidiaDevRoot: /
  gdrcopyEnabled: false
  gdsEnabled: false
  mofedEnabled: false
  useNodeFeatureAPI: true
  deviceDiscoveryStrategy: auto
  plugin:
    passDeviceSpecs: false
    deviceListStrategy: envvar
    deviceIDStrategy: uuid
    cdiAnnotationPrefix: cdi.k8s.io/
    nvidiaCTKPath: /usr/bin/nvidia-ctk
    containerDriverRoot: /driver-root
    sharedDevicesAllocationPolicy: distributed
  gfd:
    oneshot: false
    noTimestamp: false
    sleepInterval: 60s
    outputFile: /etc/kubernetes/node-feature-discovery/features.d/gfd
    machineTypeFile: /sys/class/dmi/id/product_name
resources:
  gpus: [ {pattern: "*", name: gpu} ]
  mig:  [ {pattern: "1g.10gb", name: mig-1g.10gb} ]
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: false
    resources:
    - name: nvidia.com/gpu
      rename: nvidia.com/gpu.shared
      devices: all
      replicas: 4
imex:
  channelIDs: [0]
  required: false
"#;

#[test]
fn nvidias_full_example_parses_with_its_meaning() {
    let o = opts(NVIDIA_FULL_EXAMPLE);
    assert_eq!(o.mig_strategy, MigStrategy::None);
    assert_eq!(o.list_strategies, [ListStrategy::Envvar]);
    assert_eq!(o.id_strategy, IdStrategy::Uuid);
    let s = o.sharing.as_ref().unwrap();
    assert_eq!(s.kind, ShareKind::TimeSlicing);
    assert!(!s.fail_requests_greater_than_one);
    assert_eq!(s.resources[0].replicas, 4);
    assert_eq!(
        s.resources[0].rename.as_ref().map(ResourceName::as_str),
        Some("nvidia.com/gpu.shared")
    );
    // 8 GPUs x 4 replicas, all renamed.
    let res = resources(&inv("dgx-h100"), &o).unwrap();
    assert_eq!(res.len(), 1);
    assert_eq!(by_name(&res, "nvidia.com/gpu.shared").devices.len(), 32);
}

#[test]
fn nvidias_readme_sharing_examples_produce_their_resources() {
    // README "Shared Access to GPUs with CUDA Time-Slicing".
    let o = opts(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 10\n",
    );
    let res = resources(&inv("dgx-h100"), &o).unwrap();
    let gpu = by_name(&res, "nvidia.com/gpu");
    assert_eq!(gpu.devices.len(), 80);
    assert!(!gpu.fail_requests_greater_than_one, "time-slicing default");
    assert!(gpu.devices[9].id.ends_with("::9"));
    // renameByDefault: `.shared`.
    let o = opts(
        "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    - name: gpu\n      replicas: 2\n",
    );
    let res = resources(&inv("l40s-pcie"), &o).unwrap();
    assert_eq!(by_name(&res, "nvidia.com/gpu.shared").devices.len(), 8);
    // README "MPS": failRequestsGreaterThanOne defaults to true, the pipe root to the chart's.
    let o = opts(
        "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 10\n",
    );
    let s = o.sharing.as_ref().unwrap();
    assert_eq!(s.kind, ShareKind::Mps);
    assert!(s.fail_requests_greater_than_one);
    assert_eq!(o.mps_root.as_deref(), Some(nvconfig::DEFAULT_MPS_ROOT));
    // JSON is YAML.
    let o = opts(
        r#"{"version": "v1", "flags": {"migStrategy": "mixed", "plugin": {"deviceListStrategy": ["envvar", "cdi-cri", "envvar"]}}}"#,
    );
    assert_eq!(o.mig_strategy, MigStrategy::Mixed);
    assert_eq!(
        o.list_strategies,
        [ListStrategy::Envvar, ListStrategy::CdiCri]
    );
    // Empty file, no version: NVIDIA's defaults.
    assert_eq!(opts(""), Options::default());
    assert_eq!(opts("flags: {}"), Options::default());
}

#[test]
fn config_errors_name_the_key() {
    let err = |yaml: &str| parse("f.yaml", yaml).unwrap_err().to_string();
    let e = err("version: v1\nflags:\n  migStrategyy: none\n");
    assert!(e.contains("migStrategyy") && e.contains("f.yaml"), "{e}");
    let e = err("version: v1\nflags:\n  migStrategy: some\n");
    assert!(e.contains("flags.migStrategy") && e.contains("some"), "{e}");
    let e = err("version: v1\nflags:\n  plugin:\n    deviceListStrategy: [envvar, tape]\n");
    assert!(e.contains("deviceListStrategy"), "{e}");
    let e = err("version: v2\n");
    assert!(e.contains("version: unknown version \"v2\""), "{e}");
    let e = err(
        "sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 1\n",
    );
    assert!(
        e.contains("sharing.timeSlicing.resources[0].replicas: 1"),
        "{e}"
    );
    let e = err("sharing:\n  timeSlicing:\n    resources: []\n");
    assert!(
        e.contains("sharing.timeSlicing.resources: no resources specified"),
        "{e}"
    );
    let e = err(
        "sharing:\n  timeSlicing:\n    resources:\n    - name: other.com/gpu\n      replicas: 2\n",
    );
    assert!(
        e.contains("resources[0].name") && e.contains("other.com/gpu"),
        "{e}"
    );
    let e = err(
        "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2, color: red}\n",
    );
    assert!(e.contains("color"), "{e}");
    let e = err(
        "flags: {migStrategy: mixed}\nsharing:\n  mps:\n    resources:\n    - {name: gpu, replicas: 2}\n",
    );
    assert!(e.contains("sharing.mps") && e.contains("mixed"), "{e}");
    let e = err("imex: {channelIDs: [1]}\n");
    assert!(e.contains("imex.channelIDs"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Resources and strategies

#[test]
fn resource_names_follow_nvidias_rules() {
    assert_eq!(
        ResourceName::parse("gpu").unwrap().as_str(),
        "nvidia.com/gpu"
    );
    assert_eq!(resources::MAX_DEVICE_ID, 63);
    assert!(ResourceName::parse("nvidia.com/GPU").is_err());
    assert!(
        ResourceName::parse(&"a".repeat(60)).is_err(),
        "over 63 characters"
    );
    assert_eq!(
        mig_resource("1g.5gb+me").unwrap().as_str(),
        "nvidia.com/mig-1g.5gb.me"
    );
    assert_eq!(
        ResourceName::parse("gpu").unwrap().socket_file(),
        "nvidia-gpu.sock"
    );
}

#[test]
fn mig_strategies_on_a100_mig_mixed() {
    let inv = inv("a100-mig-mixed");
    // none: every GPU whole, MIG mode ignored.
    let res = resources(&inv, &Options::default()).unwrap();
    let ids: Vec<&str> = res[0].devices.iter().map(|d| d.id.as_str()).collect();
    let uuids: Vec<&str> = inv.gpus.iter().map(|g| g.uuid.as_str()).collect();
    assert_eq!(ids, uuids);
    // mixed: one resource per profile.
    let mixed = Options {
        mig_strategy: MigStrategy::Mixed,
        ..Options::default()
    };
    let res = resources(&inv, &mixed).unwrap();
    let names: Vec<&str> = res.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "nvidia.com/gpu",
            "nvidia.com/mig-1g.10gb",
            "nvidia.com/mig-1g.5gb",
            "nvidia.com/mig-2g.10gb",
            "nvidia.com/mig-3g.20gb"
        ]
    );
    assert!(
        by_name(&res, "nvidia.com/mig-1g.5gb")
            .devices
            .iter()
            .all(|d| d.mig && d.gpu_index == 1)
    );
    // single: refuses mixed modes.
    let single = Options {
        mig_strategy: MigStrategy::Single,
        ..Options::default()
    };
    assert_eq!(
        resources(&inv, &single).unwrap_err(),
        ResError::MixedMigModes {
            enabled: vec![1, 2],
            disabled: vec![0, 3]
        }
    );
    // single on a node without MIG: as none.
    let plain = inv_without_mig();
    assert_eq!(resources(&plain, &single).unwrap()[0].devices.len(), 8);
}

fn inv_without_mig() -> Inventory {
    inv("dgx-h100")
}

#[test]
fn single_refuses_several_profiles_and_empty_mig_gpus() {
    let mut inv = inv("a100-mig-mixed");
    inv.gpus.retain(|g| g.in_mig_mode());
    let single = Options {
        mig_strategy: MigStrategy::Single,
        ..Options::default()
    };
    assert!(matches!(
        resources(&inv, &single).unwrap_err(),
        ResError::SeveralProfiles { .. }
    ));
    inv.gpus[0].mig.devices.clear();
    assert_eq!(
        resources(&inv, &single).unwrap_err(),
        ResError::NoMigDevices { gpu: 1 }
    );
}

#[test]
fn per_gpu_sharing_with_rename_splits_one_resource_in_two() {
    // The issue's example: GPUs 0-3 shared x4 as nvidia.com/gpu.shared, GPUs 4-7 whole.
    let o = opts(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      rename: nvidia.com/gpu.shared\n      devices: [0, 1, 2, 3]\n      replicas: 4\n",
    );
    let inv = inv("dgx-h100");
    let res = resources(&inv, &o).unwrap();
    let whole: Vec<u32> = by_name(&res, "nvidia.com/gpu")
        .devices
        .iter()
        .map(|d| d.gpu_index)
        .collect();
    assert_eq!(whole, [4, 5, 6, 7]);
    let shared = by_name(&res, "nvidia.com/gpu.shared");
    assert_eq!(shared.devices.len(), 16);
    assert_eq!(shared.devices[0].id, format!("{}::0", inv.gpus[0].uuid));
    // A UUID and a count select too.
    let o = opts(&format!(
        "sharing:\n  timeSlicing:\n    resources:\n    - {{name: gpu, devices: [\"{}\"], replicas: 2}}\n",
        inv.gpus[6].uuid
    ));
    let res = resources(&inv, &o).unwrap();
    assert_eq!(
        res[0]
            .devices
            .iter()
            .filter(|d| d.replica.is_some())
            .count(),
        2
    );
    assert!(
        res[0]
            .devices
            .iter()
            .all(|d| d.replica.is_none() || d.gpu_index == 6)
    );
    let o = opts(
        "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, devices: 2, replicas: 3}\n",
    );
    let res = resources(&inv, &o).unwrap();
    assert_eq!(res[0].devices.len(), 6 + 2 * 3);
}

#[test]
fn index_strategy_uses_gpu_and_mig_indices() {
    let o = Options {
        id_strategy: IdStrategy::Index,
        mig_strategy: MigStrategy::Mixed,
        ..Options::default()
    };
    let res = resources(&inv("a100-mig-mixed"), &o).unwrap();
    let ids: Vec<&str> = by_name(&res, "nvidia.com/gpu")
        .devices
        .iter()
        .map(|d| d.id.as_str())
        .collect();
    assert_eq!(ids, ["0", "3"]);
    let ids: Vec<&str> = by_name(&res, "nvidia.com/mig-1g.10gb")
        .devices
        .iter()
        .map(|d| d.id.as_str())
        .collect();
    assert_eq!(ids, ["2:0", "2:1", "2:2"]);
}

// ---------------------------------------------------------------------------------------------
// Allocate

#[test]
fn allocate_per_strategy() {
    let inv = inv("pcie-pairs");
    let o = Options::default();
    let res = resources(&inv, &o).unwrap();
    let gpu = &res[0];
    let id = |i: usize| gpu.devices[i].id.clone();
    // volume-mounts.
    let c = ctx(Options {
        list_strategies: vec![ListStrategy::VolumeMounts],
        ..Options::default()
    });
    let a = allocate::allocate(gpu, &[id(1)], &c).unwrap();
    assert_eq!(a.envs["NVIDIA_VISIBLE_DEVICES"], allocate::VOLUME_MOUNT_DIR);
    assert_eq!(
        a.mounts[0].container_path,
        format!("/var/run/nvidia-container-devices/{}", id(1))
    );
    assert_eq!(a.mounts[0].host_path, "/dev/null");
    // cdi-annotations: one key per response, the fully qualified names.
    let c = ctx(Options {
        list_strategies: vec![ListStrategy::CdiAnnotations],
        ..Options::default()
    });
    let a = allocate::allocate(gpu, &[id(0), id(3)], &c).unwrap();
    let (k, v) = a.annotations.iter().next().unwrap();
    assert!(
        k.starts_with("cdi.k8s.io/nvidia-device-plugin_") && k.len() - "cdi.k8s.io/".len() <= 63,
        "{k}"
    );
    assert_eq!(
        v,
        &format!(
            "k8s.gpu.nvidia.com/gpu={},k8s.gpu.nvidia.com/gpu={}",
            id(0),
            id(3)
        )
    );
    assert!(a.envs.is_empty() && a.cdi_devices.is_empty());
    // envvar + cdi-cri: both.
    let c = ctx(Options {
        list_strategies: vec![ListStrategy::Envvar, ListStrategy::CdiCri],
        ..Options::default()
    });
    let a = allocate::allocate(gpu, &[id(2)], &c).unwrap();
    assert_eq!(a.envs["NVIDIA_VISIBLE_DEVICES"], id(2));
    assert_eq!(a.cdi_devices, [format!("k8s.gpu.nvidia.com/gpu={}", id(2))]);
}

#[test]
fn allocate_refuses_unhealthy_ids_and_dedups_replicas() {
    let mut inv = inv("pcie-pairs");
    inv.gpus[2].health = Health::Unhealthy {
        reason: "XID 79".into(),
    };
    let o = opts("sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2}\n");
    let res = resources(&inv, &o).unwrap();
    let gpu = &res[0];
    let c = ctx(o);
    let e = allocate::allocate(
        gpu,
        &[gpu.devices[0].id.clone(), gpu.devices[4].id.clone()],
        &c,
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "unhealthy device IDs for nvidia.com/gpu: {}",
            gpu.devices[4].id
        )
    );
    // Two replicas of one GPU: one visible GPU (failRequestsGreaterThanOne is off).
    let a = allocate::allocate(
        gpu,
        &[gpu.devices[0].id.clone(), gpu.devices[1].id.clone()],
        &c,
    )
    .unwrap();
    assert_eq!(a.envs["NVIDIA_VISIBLE_DEVICES"], inv.gpus[0].uuid.as_str());
    assert!(matches!(
        allocate::allocate(gpu, &[], &c),
        Err(allocate::Error::Empty { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// Preferred allocation

fn req(available: &[&str], must: &[&str], size: usize) -> Request {
    Request {
        available: available.iter().map(|s| s.to_string()).collect(),
        must_include: must.iter().map(|s| s.to_string()).collect(),
        size,
    }
}

#[test]
fn one_gpu_fills_a_half_used_nvlink_pair_first() {
    let inv = inv("pcie-pairs");
    let res = resources(&inv, &Options::default()).unwrap();
    let id = |i: usize| inv.gpus[i].uuid.as_str();
    // GPU 0 is taken: GPU 1 is the one whose pair is already broken.
    let got = preferred(&res[0], &req(&[id(1), id(2), id(3)], &[], 1), false);
    assert_eq!(got, [id(1)]);
    // Three GPUs: the free pair plus one more.
    let got = preferred(&res[0], &req(&[id(0), id(1), id(2), id(3)], &[], 3), false);
    assert_eq!(&got[..2], [id(0), id(1)]);
}

#[test]
fn lost_and_unhealthy_gpus_never_fail_the_call() {
    let mut inv = inv("pcie-pairs");
    inv.gpus[1].health = Health::Unhealthy {
        reason: "fell off the bus".into(),
    };
    let res = resources(&inv, &Options::default()).unwrap();
    let id = |i: usize| inv.gpus[i].uuid.as_str();
    let got = preferred(
        &res[0],
        &req(&["GPU-gone", id(0), id(1), id(2), id(3)], &[], 2),
        false,
    );
    assert_eq!(got, [id(2), id(3)]);
    // Fewer usable than asked: what there is.
    let got = preferred(&res[0], &req(&["GPU-gone", id(1), id(3)], &[], 2), false);
    assert_eq!(got, [id(3)]);
    // Must-include is kept even when it is unknown to us.
    let got = preferred(&res[0], &req(&[id(0), id(2)], &["GPU-gone"], 2), false);
    assert_eq!(got, ["GPU-gone", id(0)]);
}

#[test]
fn replicas_spread_or_pack() {
    let inv = inv("pcie-pairs");
    let o = opts("sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 4}\n");
    let res = resources(&inv, &o).unwrap();
    let gpu = &res[0];
    // GPU 0 has two replicas in use (::0 and ::1 not available).
    let available: Vec<String> = gpu.devices.iter().skip(2).map(|d| d.id.clone()).collect();
    let available: Vec<&str> = available.iter().map(String::as_str).collect();
    let spread = preferred(gpu, &req(&available, &[], 3), false);
    let gpus: Vec<u32> = spread
        .iter()
        .map(|id| gpu.device(id).unwrap().gpu_index)
        .collect();
    assert_eq!(
        gpus,
        [1, 2, 3],
        "distributed: the least used GPUs, one each"
    );
    let packed = preferred(gpu, &req(&available, &[], 2), true);
    let gpus: Vec<u32> = packed
        .iter()
        .map(|id| gpu.device(id).unwrap().gpu_index)
        .collect();
    assert_eq!(gpus, [0, 0], "packed: the busiest GPU");
}

#[test]
fn mps_allocate_points_at_nvidias_control_daemon() {
    let inv = inv("l40s-pcie");
    let o = opts(
        "flags: {mpsRoot: /run/mps}\nsharing:\n  mps:\n    resources:\n    - {name: gpu, replicas: 2}\n",
    );
    let res = resources(&inv, &o).unwrap();
    let gpu = &res[0];
    assert!(gpu.fail_requests_greater_than_one, "MPS default");
    let a = allocate::allocate(gpu, &[gpu.devices[3].id.clone()], &ctx(o)).unwrap();
    assert_eq!(a.envs["NVIDIA_VISIBLE_DEVICES"], inv.gpus[1].uuid.as_str());
    assert_eq!(
        a.envs["CUDA_MPS_PIPE_DIRECTORY"],
        "/mps/nvidia.com/gpu/pipe"
    );
    let mounts: Vec<(&str, &str)> = a
        .mounts
        .iter()
        .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
        .collect();
    assert_eq!(
        mounts,
        [
            ("/run/mps/nvidia.com/gpu/pipe", "/mps/nvidia.com/gpu/pipe"),
            ("/run/mps/shm", "/dev/shm")
        ]
    );
}

mod driver_modes;
mod gpu_memory;

// ---------------------------------------------------------------------------------------------
// Dynamic MIG beside DRA (`--mode both --dynamic-mig`)

/// A MIG device of `gpu` at the first placement of its profile `name`, as NVML lists one.
fn instance(gpu: &crate::inventory::Gpu, name: &str) -> crate::inventory::MigDevice {
    let p = gpu.mig.profiles.iter().find(|p| p.name == name).unwrap();
    crate::inventory::MigDevice {
        uuid: crate::inventory::MigUuid(format!("MIG-{}-{name}", gpu.minor)),
        profile: p.name.clone(),
        gi_profile_id: p.gi_profile_id,
        gi_id: 1,
        ci_id: 0,
        placement: p.placements[0],
        memory_bytes: p.memory_bytes,
        multiprocessors: p.multiprocessors,
        engines: p.engines,
        health: Health::Healthy,
    }
}

fn with_dynamic_mig(strategy: MigStrategy) -> Options {
    Options {
        mig_strategy: strategy,
        dynamic_mig: true,
        ..Options::default()
    }
}

fn gpu_uuids(r: &Resource) -> Vec<String> {
    r.devices.iter().map(|d| d.uuid.to_string()).collect()
}

/// The issue's case: DRA switched H100s 0 (one 1g instance) and 1 (MIG mode, no instance yet)
/// to MIG mode. Under `single` that is a node of mixed MIG modes, which the strategy refuses,
/// so the lists could not be computed (and were frozen, health included). With dynamic MIG the
/// switched GPUs are left out, saying why, under every strategy, and the other GPUs are served
/// as before; no `nvidia.com/mig-*` resource appears for DRA's instances.
#[test]
fn gpus_dra_switched_to_mig_mode_are_left_out_and_single_still_computes() {
    use super::resources::{LeftOut, LeftOutWhy, lists};
    let mut inv = inv("dgx-h100");
    inv.gpus[0].mig.enabled = true;
    let one = instance(&inv.gpus[0], "1g.10gb");
    inv.gpus[0].mig.devices.push(one);
    inv.gpus[1].mig.enabled = true;
    let single = Options {
        mig_strategy: MigStrategy::Single,
        ..Options::default()
    };
    assert!(matches!(
        resources(&inv, &single).unwrap_err(),
        ResError::MixedMigModes { .. }
    ));
    let rest: Vec<String> = inv.gpus[2..].iter().map(|g| g.uuid.to_string()).collect();
    let switched_out: Vec<LeftOut> = inv.gpus[..2]
        .iter()
        .map(|g| LeftOut {
            uuid: g.uuid.clone(),
            index: g.index,
            why: LeftOutWhy::InMigMode,
        })
        .collect();
    for strategy in [MigStrategy::Single, MigStrategy::Mixed, MigStrategy::None] {
        let l = lists(&inv, &with_dynamic_mig(strategy), &Default::default()).unwrap();
        let names: Vec<&str> = l.resources.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["nvidia.com/gpu"], "{strategy:?}");
        assert_eq!(gpu_uuids(&l.resources[0]), rest, "{strategy:?}");
        assert_eq!(l.left_out, switched_out, "{strategy:?}");
        assert!(
            l.left_out[0].why.to_string().contains("dynamic MIG"),
            "{}",
            l.left_out[0].why
        );
    }

    // Back outside MIG mode (the last claim's unprepare), GPU 0 is served whole again.
    inv.gpus[0].mig.devices.clear();
    inv.gpus[0].mig.enabled = false;
    let l = lists(
        &inv,
        &with_dynamic_mig(MigStrategy::Single),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(
        l.resources[0].devices[0].uuid.to_string(),
        inv.gpus[0].uuid.to_string()
    );
    assert_eq!(l.left_out, switched_out[1..]);

    // A GPU DRA switched on that can no longer switch (a change pending) is still DRA's: the
    // ledger's record keeps it out, where the inventory alone would make `single` fail (the
    // node's one GPU that cannot switch is in MIG mode with no instance).
    inv.gpus[1].mig.pending = Some(false);
    let dynamic = with_dynamic_mig(MigStrategy::Single);
    assert_eq!(
        lists(&inv, &dynamic, &Default::default()).unwrap_err(),
        ResError::NoMigDevices { gpu: 1 }
    );
    let switched = [inv.gpus[1].uuid.clone()].into_iter().collect();
    let l = lists(&inv, &dynamic, &switched).unwrap();
    assert_eq!(l.left_out, switched_out[1..]);
    assert_eq!(l.resources[0].devices.len(), 7);
}

/// GPUs that cannot switch MIG mode keep the operator's shape, which `single` applies to: on
/// a node whose Ampere GPUs are in MIG mode, their MIG devices are `nvidia.com/gpu`, and the
/// H100s DRA switches are left out even whole (they would be a second shape under one name).
/// Where no GPU can switch, dynamic MIG changes nothing.
#[test]
fn single_applies_to_the_gpus_that_cannot_switch() {
    use super::resources::{LeftOutWhy, lists};
    let mut inv = inv("dgx-h100");
    for g in &mut inv.gpus[..2] {
        g.cuda_compute_capability = crate::inventory::ComputeCapability { major: 8, minor: 0 };
        g.mig.enabled = true;
        let one = instance(g, "1g.10gb");
        g.mig.devices.push(one);
    }
    let l = lists(
        &inv,
        &with_dynamic_mig(MigStrategy::Single),
        &Default::default(),
    )
    .unwrap();
    let gpu = by_name(&l.resources, "nvidia.com/gpu");
    assert!(gpu.devices.iter().all(|d| d.mig), "{gpu:?}");
    assert_eq!(gpu.devices.len(), 2);
    let out: Vec<(u32, LeftOutWhy)> = l.left_out.iter().map(|l| (l.index, l.why)).collect();
    assert_eq!(
        out,
        (2..8)
            .map(|i| (i, LeftOutWhy::WholeBesideMig))
            .collect::<Vec<_>>()
    );
    // Under mixed the same H100s are served whole beside the MIG devices.
    let l = lists(
        &inv,
        &with_dynamic_mig(MigStrategy::Mixed),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(by_name(&l.resources, "nvidia.com/gpu").devices.len(), 6);
    assert_eq!(
        by_name(&l.resources, "nvidia.com/mig-1g.10gb")
            .devices
            .len(),
        2
    );
    assert!(l.left_out.is_empty());

    // A100s only: nothing is DRA's, so the lists and the refusals are today's.
    let a100 = super::tests::inv("a100-mig-mixed");
    for strategy in [MigStrategy::Single, MigStrategy::Mixed, MigStrategy::None] {
        let plain = Options {
            mig_strategy: strategy,
            ..Options::default()
        };
        let dynamic = lists(&a100, &with_dynamic_mig(strategy), &Default::default());
        match resources(&a100, &plain) {
            Ok(res) => {
                let l = dynamic.unwrap();
                assert_eq!(l.resources, res, "{strategy:?}");
                assert!(l.left_out.is_empty());
            }
            Err(e) => assert_eq!(dynamic.unwrap_err(), e, "{strategy:?}"),
        }
    }
}
