//! Extra driver capabilities (gdrcopy, GDS, MOFED) and MPS client limits.

use super::*;

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
    let cdi_opts =
        cdi::options("gpu.nvidia.com", &crate::cdi::DriverRoot::at(root.path())).unwrap();
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
    let stale = crate::cdi::spec_path(cdi_root.path(), &mofed, &cdi::spec_name());
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
    let cdi_opts =
        cdi::options("gpu.nvidia.com", &crate::cdi::DriverRoot::at(root.path())).unwrap();
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
    // The limit is keyed by the container's index of the GPU (0), not its UUID: NVIDIA's device
    // plugin v0.15.0 moved to index keys because UUID-keyed limits were not applied.
    let (_, env) = mps_env(4, 16384);
    assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "25");
    assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=4096M");
    assert_eq!(env["CUDA_MPS_PIPE_DIRECTORY"], "/mps/nvidia.com/gpu/pipe");
    // Integer division, as the daemon's `100 / replicas` and `totalMiB / replicas`.
    let (_, env) = mps_env(3, 46068);
    assert_eq!(env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "33");
    assert_eq!(env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"], "0=15356M");
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
    // Replica 1 of GPU 2 and replica 0 of GPU 0, asked in that order: the container numbers
    // its GPUs in host order, so GPU 0 is index 0 and GPU 2 index 1.
    let a = allocate::allocate(
        gpu,
        &[gpu.devices[5].id.clone(), gpu.devices[0].id.clone()],
        &ctx(o),
    )
    .unwrap();
    assert_eq!(gpu.devices[5].gpu, inv.gpus[2].uuid);
    let share = |i: usize| (inv.gpus[i].memory_bytes >> 20) / 2;
    assert_eq!(
        a.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"],
        format!("0={}M,1={}M", share(0), share(2))
    );
    assert_eq!(a.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "50");
}

/// NVIDIA's `nvidiaDriverRoot`, `nvidiaDevRoot` and `plugin.containerDriverRoot` are nvdra's
/// `--driver-root`, `--dev-root` and `--driver-root-ctr-path`, below nvdra's own settings.
#[test]
fn nvidia_driver_roots_are_honoured_below_nvdras_own_settings() {
    use crate::cdi::DriverRoot;
    use crate::config::{self, BackendSettings, Settings};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(
        &path,
        "version: v1\nflags:\n  migStrategy: none\n  nvidiaDriverRoot: /run/nvidia/driver\n  \
         nvidiaDevRoot: \"\"\n  plugin:\n    containerDriverRoot: /driver-root\n",
    )
    .unwrap();
    let roots = nvconfig::driver_roots(&path);
    assert_eq!(
        roots,
        BackendSettings {
            driver_root: Some("/run/nvidia/driver".into()),
            dev_root: None,
            driver_root_ctr_path: Some("/driver-root".into()),
            ..Default::default()
        }
    );
    let below = || Settings {
        backend: roots.clone(),
        ..Settings::default()
    };
    let mut cli = Settings::default();
    cli.backend.node_name = Some("n".into());
    let c = config::resolve_over(cli.clone(), None, below()).unwrap();
    assert_eq!(
        c.driver_root,
        DriverRoot::new(
            "/run/nvidia/driver".into(),
            "/driver-root".into(),
            "/run/nvidia/driver".into()
        )
    );
    // nvdra's own flag wins.
    cli.backend.driver_root_ctr_path = Some("/host-driver".into());
    let c = config::resolve_over(cli, None, below()).unwrap();
    assert_eq!(c.driver_root.ctr(), std::path::Path::new("/host-driver"));
    // A file that is not NVIDIA's config names no roots (the device plugin reports it).
    std::fs::write(&path, "flags: [").unwrap();
    assert_eq!(nvconfig::driver_roots(&path), BackendSettings::default());
}
