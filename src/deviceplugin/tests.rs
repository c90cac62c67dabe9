use super::allocate::{self, Context};
use super::nvconfig::parse;
use super::preferred::{Request, preferred};
use super::resources::{Error as ResError, Resource, mig_resource, resources};
use super::*;
use crate::inventory::sim::SimBackend;
use crate::inventory::{DeviceBackend, Health, Inventory};
use std::collections::{BTreeMap, BTreeSet};

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

// ---------------------------------------------------------------------------------------------
// Extra driver capabilities (gdrcopy, GDS, MOFED)

/// A driver root whose `dev/` holds stand-ins (symlinks to `/dev/null`, a character device) for
/// the nodes of the modes listed.
fn driver_root_with(nodes: &[&str]) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(root.path().join("dev/infiniband")).unwrap();
    for n in nodes {
        std::os::unix::fs::symlink("/dev/null", root.path().join("dev").join(n)).unwrap();
    }
    root
}

#[test]
fn driver_mode_flags_parse_as_nvidia_names_them() {
    let o = opts(
        "version: v1\nflags:\n  gdrcopyEnabled: true\n  gdsEnabled: true\n  mofedEnabled: false\n",
    );
    assert_eq!(o.modes, [DriverMode::Gdrcopy, DriverMode::Gds]);
    let o = opts("flags: {mofedEnabled: true, gdsEnabled: true}\n");
    assert_eq!(
        o.modes,
        [DriverMode::Gds, DriverMode::Mofed],
        "NVIDIA's order"
    );
    // NVIDIA's full example has all three off.
    assert!(opts(NVIDIA_FULL_EXAMPLE).modes.is_empty());
    let e = parse("f.yaml", "flags: {gdsEnabled: maybe}\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("flags.gdsEnabled"), "{e}");
}

#[test]
fn driver_modes_set_nvidias_env_in_every_strategy() {
    let inv = inv("pcie-pairs");
    let base = opts("flags: {gdrcopyEnabled: true, gdsEnabled: true, mofedEnabled: true}\n");
    let res = resources(&inv, &base).unwrap();
    let gpu = &res[0];
    let id = gpu.devices[1].id.clone();
    let modes = [
        ("NVIDIA_GDRCOPY", "enabled"),
        ("NVIDIA_GDS", "enabled"),
        ("NVIDIA_MOFED", "enabled"),
    ];
    let mode_names = [
        "k8s.gpu.nvidia.com/gdrcopy=all",
        "k8s.gpu.nvidia.com/gds=all",
        "k8s.gpu.nvidia.com/mofed=all",
    ];
    for strategy in [
        ListStrategy::Envvar,
        ListStrategy::VolumeMounts,
        ListStrategy::CdiAnnotations,
        ListStrategy::CdiCri,
    ] {
        let mut c = ctx(Options {
            list_strategies: vec![strategy],
            ..base.clone()
        });
        c.cdi_modes = mode_names.iter().map(|s| s.to_string()).collect();
        let a = allocate::allocate(gpu, std::slice::from_ref(&id), &c).unwrap();
        for (k, v) in modes {
            assert_eq!(a.envs.get(k).map(String::as_str), Some(v), "{strategy:?}");
        }
        let gpu_name = format!("k8s.gpu.nvidia.com/gpu={id}");
        let mut cdi = vec![gpu_name.as_str()];
        cdi.extend(mode_names);
        match strategy {
            ListStrategy::Envvar => {
                assert_eq!(a.envs["NVIDIA_VISIBLE_DEVICES"], id);
                assert!(a.cdi_devices.is_empty() && a.annotations.is_empty());
            }
            ListStrategy::VolumeMounts => {
                assert_eq!(a.envs["NVIDIA_VISIBLE_DEVICES"], allocate::VOLUME_MOUNT_DIR);
                assert_eq!(a.mounts.len(), 1);
            }
            ListStrategy::CdiAnnotations => {
                // All-CDI: the modes' variables are the only env, as in NVIDIA's plugin.
                assert_eq!(a.envs.len(), 3, "{:?}", a.envs);
                let v = a.annotations.values().next().unwrap();
                assert_eq!(v, &cdi.join(","));
            }
            ListStrategy::CdiCri => {
                assert_eq!(a.envs.len(), 3, "{:?}", a.envs);
                assert_eq!(a.cdi_devices, cdi);
            }
        }
    }
    // Off: none of it.
    let a = allocate::allocate(gpu, &[id], &ctx(Options::default())).unwrap();
    assert_eq!(
        a.envs.keys().collect::<Vec<_>>(),
        ["NVIDIA_VISIBLE_DEVICES"]
    );
}

#[test]
fn mode_specs_hold_the_hosts_nodes_and_only_present_modes_are_named() {
    let root = driver_root_with(&["gdrdrv", "nvidia-fs0", "nvidia-fs1", "nvidia0"]);
    std::fs::create_dir_all(root.path().join("etc")).unwrap();
    std::fs::write(root.path().join("etc/cufile.json"), "{}").unwrap();
    let cdi_opts = cdi::options("gpu.nvidia.com", root.path()).unwrap();
    let nodes = |m: DriverMode| -> Vec<String> {
        cdi::mode_spec(&cdi_opts, m)
            .map(|s| {
                assert_eq!(s.kind, format!("k8s.gpu.nvidia.com/{}", m.class()));
                assert_eq!(s.devices.len(), 1);
                assert_eq!(s.devices[0].name, "all");
                s.devices[0]
                    .container_edits
                    .device_nodes
                    .iter()
                    .map(|n| n.path.clone())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(nodes(DriverMode::Gdrcopy), ["/dev/gdrdrv"]);
    assert_eq!(
        nodes(DriverMode::Gds),
        ["/dev/nvidia-fs0", "/dev/nvidia-fs1"]
    );
    let gds = cdi::mode_spec(&cdi_opts, DriverMode::Gds).unwrap();
    let mounts: Vec<&str> = gds.devices[0]
        .container_edits
        .mounts
        .iter()
        .map(|m| m.container_path.as_str())
        .collect();
    assert_eq!(mounts, ["/etc/cufile.json"]);
    assert!(
        cdi::mode_spec(&cdi_opts, DriverMode::Mofed).is_none(),
        "no infiniband nodes"
    );

    // Allocate names only the modes that have a spec; the env is set for all enabled ones.
    let o = Options {
        list_strategies: vec![ListStrategy::CdiCri],
        modes: DriverMode::ALL.to_vec(),
        ..Options::default()
    };
    let c = Context::new(o.clone(), &cdi_opts);
    assert_eq!(
        c.cdi_modes,
        [
            "k8s.gpu.nvidia.com/gdrcopy=all",
            "k8s.gpu.nvidia.com/gds=all"
        ]
    );
    let inv = inv("pcie-pairs");
    let res = resources(&inv, &o).unwrap();
    let a = allocate::allocate(&res[0], &[res[0].devices[0].id.clone()], &c).unwrap();
    assert_eq!(a.cdi_devices.len(), 3);
    assert_eq!(a.envs["NVIDIA_MOFED"], "enabled");
    // Without a CDI strategy nothing on the host is read and no CDI device is named.
    let c = Context::new(
        Options {
            list_strategies: vec![ListStrategy::Envvar],
            ..o.clone()
        },
        &cdi_opts,
    );
    assert!(c.cdi_modes.is_empty());

    // The files: one per present mode; a stale spec of an absent mode is removed.
    let cdi_root = tempfile::tempdir().unwrap();
    let mofed = cdi::mode_options(&cdi_opts, DriverMode::Mofed).unwrap();
    let stale = crate::cdi::spec_path(cdi_root.path(), &mofed, cdi::SPEC_NAME);
    std::fs::write(&stale, "stale").unwrap();
    cdi::write_with_modes(cdi_root.path(), &cdi_opts, &inv, &o).unwrap();
    let mut files: Vec<String> = std::fs::read_dir(cdi_root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(
        files,
        [
            "k8s.gpu.nvidia.com-gdrcopy_device-plugin.yaml",
            "k8s.gpu.nvidia.com-gds_device-plugin.yaml",
            "k8s.gpu.nvidia.com-gpu_device-plugin.yaml",
        ]
    );
    let text = std::fs::read_to_string(cdi_root.path().join(&files[0])).unwrap();
    let v: serde_json::Value = crate::yaml::from_str(&text).unwrap();
    assert_eq!(v["kind"], "k8s.gpu.nvidia.com/gdrcopy");
    assert_eq!(
        v["devices"][0]["containerEdits"]["deviceNodes"][0]["path"],
        "/dev/gdrdrv"
    );
}

#[test]
fn mofed_spec_takes_uverbs_and_rdma_cm() {
    let root = driver_root_with(&[
        "infiniband/uverbs1",
        "infiniband/uverbs0",
        "infiniband/rdma_cm",
        "infiniband/umad0",
    ]);
    let cdi_opts = cdi::options("gpu.nvidia.com", root.path()).unwrap();
    let s = cdi::mode_spec(&cdi_opts, DriverMode::Mofed).unwrap();
    let paths: Vec<&str> = s.devices[0]
        .container_edits
        .device_nodes
        .iter()
        .map(|n| n.path.as_str())
        .collect();
    assert_eq!(
        paths,
        [
            "/dev/infiniband/uverbs0",
            "/dev/infiniband/uverbs1",
            "/dev/infiniband/rdma_cm"
        ]
    );
}

// ---------------------------------------------------------------------------------------------
// MPS client limits

fn mps_env(
    replicas: u32,
    memory_mib: u64,
) -> (Inventory, std::collections::BTreeMap<String, String>) {
    let mut inv = inv("l40s-pcie");
    for g in &mut inv.gpus {
        g.memory_bytes = memory_mib << 20;
    }
    let o = opts(&format!(
        "sharing:\n  mps:\n    resources:\n    - {{name: gpu, replicas: {replicas}}}\n"
    ));
    let res = resources(&inv, &o).unwrap();
    let gpu = &res[0];
    let a = allocate::allocate(gpu, &[gpu.devices[replicas as usize].id.clone()], &ctx(o)).unwrap();
    (inv, a.envs)
}

#[test]
fn mps_limits_are_the_shares_nvidias_control_daemon_sets() {
    // NVIDIA's daemon on a 16 GiB GPU with 4 replicas (its control log, reference §3.3):
    // `set_default_device_pinned_mem_limit <i> 4096M`, `set_default_active_thread_percentage 25`.
    let (inv, env) = mps_env(4, 16384);
    assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
    assert_eq!(
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"],
        format!("{}=4096M", inv.gpus[1].uuid)
    );
    assert_eq!(env["CUDA_MPS_PIPE_DIRECTORY"], "/mps/nvidia.com/gpu/pipe");
    // Integer division, as the daemon's `100 / replicas` and `totalMiB / replicas`.
    let (inv, env) = mps_env(3, 46068);
    assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "33");
    assert_eq!(
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"],
        format!("{}=15356M", inv.gpus[1].uuid)
    );
    // Time-slicing sets no MPS limits.
    let inv = self::inv("l40s-pcie");
    let o = opts("sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 4}\n");
    let res = resources(&inv, &o).unwrap();
    let a = allocate::allocate(&res[0], &[res[0].devices[0].id.clone()], &ctx(o)).unwrap();
    assert!(
        !a.envs.keys().any(|k| k.starts_with("CUDA_MPS")),
        "{:?}",
        a.envs
    );
}

#[test]
fn mps_limits_name_every_gpu_of_a_request() {
    let inv = inv("l40s-pcie");
    let o = opts(
        "sharing:\n  mps:\n    failRequestsGreaterThanOne: false\n    resources:\n    - {name: gpu, replicas: 2}\n",
    );
    let res = resources(&inv, &o).unwrap();
    let gpu = &res[0];
    // Replica 0 of GPU 0 and replica 1 of GPU 2.
    let a = allocate::allocate(
        gpu,
        &[gpu.devices[0].id.clone(), gpu.devices[5].id.clone()],
        &ctx(o),
    )
    .unwrap();
    let share = |i: usize| (inv.gpus[i].memory_bytes >> 20) / 2;
    assert_eq!(
        a.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"],
        format!(
            "{}={}M,{}={}M",
            inv.gpus[0].uuid,
            share(0),
            inv.gpus[2].uuid,
            share(2)
        )
    );
    assert_eq!(a.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "50");
}

// ---------------------------------------------------------------------------------------------
// nvidia.com/gpu-memory

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
    assert_eq!(
        a.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"],
        format!("{}=3G", inv.gpus[2].uuid)
    );
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
    assert_eq!(
        a.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"],
        format!("{}=2G", inv.gpus[1].uuid)
    );
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
