//! Builder tests: device nodes, MIG capability nodes, MPS and driver-file edits, determinism.

use super::*;

#[test]
fn full_gpu_spec_has_nodes_env_mounts_and_hook() {
    let host = Host::new();
    for n in ["nvidia0", "nvidiactl", "nvidia-uvm"] {
        host.node(n);
    }
    let nvml = host.file("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.163.01");
    let cuda = host.file("usr/lib/x86_64-linux-gnu/libcuda.so.550.163.01");
    let smi = host.file("usr/bin/nvidia-smi");
    let hook = host.hook("usr/bin/nvidia-cdi-hook", TOOLKIT);
    let files = discover_driver_files(&host.opts.root);
    assert_eq!(files.libraries, vec![cuda.clone(), nvml.clone()]);
    assert_eq!(files.binaries, vec![smi.clone()]);
    assert_eq!(files.hook, Some(hook.clone()));

    let dev = gpu_device(0, Sharing::Exclusive);
    let spec = claim_spec(&host.opts, UID, std::slice::from_ref(&dev), &files).unwrap();
    let (major, minor, mode) = null_numbers();

    assert_eq!(spec.cdi_version, "0.5.0");
    assert_eq!(spec.kind, "k8s.gpu.nvidia.com/claim");
    assert_eq!(spec.devices.len(), 1);
    let d = &spec.devices[0];
    assert_eq!(d.name, format!("{UID}-gpu-0"));
    assert_eq!(
        d.container_edits,
        ContainerEdits {
            device_nodes: vec![DeviceNode {
                path: "/dev/nvidia0".into(),
                host_path: Some(host.root().join("dev/nvidia0").display().to_string()),
                node_type: Some("c".into()),
                major: Some(major),
                minor: Some(minor),
                file_mode: Some(mode),
                permissions: Some("rwm".into()),
            }],
            ..Default::default()
        }
    );

    let common = &spec.container_edits;
    assert_eq!(
        common.env,
        vec![
            "NVIDIA_VISIBLE_DEVICES=void".to_string(),
            "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu".to_string(),
        ]
    );
    let paths: Vec<&str> = common
        .device_nodes
        .iter()
        .map(|n| n.path.as_str())
        .collect();
    // nvidia-uvm-tools and nvidia-modeset are absent on this host and skipped.
    assert_eq!(paths, vec!["/dev/nvidiactl", "/dev/nvidia-uvm"]);
    let mounts: Vec<(&str, &str)> = common
        .mounts
        .iter()
        .map(|m| (m.host_path.as_str(), m.container_path.as_str()))
        .collect();
    let s = |p: &Path| p.display().to_string();
    assert_eq!(
        mounts,
        vec![
            (s(&smi).as_str(), "/usr/bin/nvidia-smi"),
            (
                s(&cuda).as_str(),
                "/usr/lib/x86_64-linux-gnu/libcuda.so.550.163.01"
            ),
            (
                s(&nvml).as_str(),
                "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.163.01"
            ),
        ]
    );
    for m in &common.mounts {
        assert_eq!(m.options, ["ro", "nosuid", "nodev", "rbind", "rprivate"]);
    }
    // The hook binary is not mounted; its hooks (compared hook by hook with NVIDIA's form in
    // tests/hooks.rs) are there, named by its host path.
    let names: Vec<(&str, &str)> = common
        .hooks
        .iter()
        .map(|h| (h.path.as_str(), h.args[1].as_str()))
        .collect();
    let hook = s(&hook);
    assert_eq!(
        names,
        vec![
            // libcuda.so → libcuda.so.1, always made for libcuda.
            (hook.as_str(), "create-symlinks"),
            (hook.as_str(), "enable-cuda-compat"),
            (hook.as_str(), "update-ldcache"),
            (hook.as_str(), "disable-device-node-modification"),
        ]
    );
}

#[test]
fn missing_gpu_node_is_described_by_number_and_optional_nodes_are_skipped() {
    let host = Host::new();
    let dev = gpu_device(3, Sharing::Exclusive);
    let spec = claim_spec(
        &host.opts,
        UID,
        std::slice::from_ref(&dev),
        &DriverFiles::default(),
    )
    .unwrap();
    assert_eq!(
        spec.devices[0].container_edits.device_nodes,
        vec![DeviceNode {
            path: format!("/dev/nvidia{}", dev.gpu.minor),
            host_path: None,
            node_type: Some("c".into()),
            major: Some(195),
            minor: Some(i64::from(dev.gpu.minor)),
            file_mode: Some(0o666),
            permissions: Some("rwm".into()),
        }]
    );
    assert!(spec.container_edits.device_nodes.is_empty());
    assert!(spec.container_edits.mounts.is_empty());
    assert!(spec.container_edits.hooks.is_empty());
    assert_eq!(
        spec.container_edits.env,
        vec!["NVIDIA_VISIBLE_DEVICES=void"]
    );
}

#[test]
fn non_device_files_are_not_device_nodes() {
    let host = Host::new();
    host.file("dev/nvidiactl");
    let spec = claim_spec(
        &host.opts,
        UID,
        &[gpu_device(0, Sharing::Exclusive)],
        &DriverFiles::default(),
    )
    .unwrap();
    assert!(spec.container_edits.device_nodes.is_empty());
}

#[test]
fn mig_device_gets_parent_and_capability_nodes() {
    let host = Host::new();
    let dev = mig_device(0);
    let mig = dev.mig.clone().unwrap();
    let m = dev.gpu.minor;
    host.node(&format!("nvidia{m}"));
    fs::create_dir_all(host.root().join("proc/driver/nvidia-caps")).unwrap();
    fs::write(
        host.root().join("proc/driver/nvidia-caps/mig-minors"),
        format!(
            "config 1\nmonitor 2\ngpu{m}/gi{g}/access 21\ngpu{m}/gi{g}/ci{c}/access 22\n\
             gpu{m}/gi99/access 30\n",
            g = mig.gi_id,
            c = mig.ci_id
        ),
    )
    .unwrap();
    host.node("nvidia-caps/nvidia-cap21");
    host.node("nvidia-caps/nvidia-cap22");
    host.node("nvidia-caps/nvidia-cap30");

    let spec = claim_spec(
        &host.opts,
        UID,
        std::slice::from_ref(&dev),
        &DriverFiles::default(),
    )
    .unwrap();
    assert_eq!(spec.devices[0].name, format!("{UID}-{}", dev.name));
    let nodes: Vec<(&str, Option<&str>)> = spec.devices[0]
        .container_edits
        .device_nodes
        .iter()
        .map(|n| (n.path.as_str(), n.host_path.as_deref()))
        .collect();
    let host_path = |rel: &str| host.root().join("dev").join(rel).display().to_string();
    assert_eq!(
        nodes,
        vec![
            (
                format!("/dev/nvidia{m}").as_str(),
                Some(host_path(&format!("nvidia{m}")).as_str())
            ),
            (
                "/dev/nvidia-caps/nvidia-cap21",
                Some(host_path("nvidia-caps/nvidia-cap21").as_str())
            ),
            (
                "/dev/nvidia-caps/nvidia-cap22",
                Some(host_path("nvidia-caps/nvidia-cap22").as_str())
            ),
        ]
    );
    assert_eq!(
        env_of(&spec.container_edits, "NVIDIA_VISIBLE_DEVICES"),
        vec!["void"]
    );

    // A capability node missing on the host is skipped; the rest stays.
    fs::remove_file(host.root().join("dev/nvidia-caps/nvidia-cap22")).unwrap();
    let spec = claim_spec(&host.opts, UID, &[dev], &DriverFiles::default()).unwrap();
    let paths: Vec<&str> = spec.devices[0]
        .container_edits
        .device_nodes
        .iter()
        .map(|n| n.path.as_str())
        .collect();
    assert_eq!(
        paths,
        vec![
            format!("/dev/nvidia{m}").as_str(),
            "/dev/nvidia-caps/nvidia-cap21"
        ]
    );
}

#[test]
fn mig_without_capability_table_gets_only_the_parent_node() {
    let host = Host::new();
    host.node("nvidia-caps/nvidia-cap21");
    let dev = mig_device(1);
    let spec = claim_spec(
        &host.opts,
        UID,
        std::slice::from_ref(&dev),
        &DriverFiles::default(),
    )
    .unwrap();
    let nodes = &spec.devices[0].container_edits.device_nodes;
    assert_eq!(nodes.len(), 1);
    assert_eq!(nodes[0].path, format!("/dev/nvidia{}", dev.gpu.minor));
}

#[test]
fn parses_mig_minors() {
    let t = parse_mig_minors("config 1\nmonitor 2\ngpu0/gi1/access 12\n\ngarbage\nbad x\n");
    assert_eq!(
        t,
        BTreeMap::from([
            ("config".to_string(), 1),
            ("monitor".to_string(), 2),
            ("gpu0/gi1/access".to_string(), 12),
        ])
    );
}

fn mps(pct: Option<u32>, default: Option<u64>, per: &[(&str, u64)]) -> Sharing {
    Sharing::Mps(MpsSettings {
        active_thread_percentage: pct,
        pinned_memory_limit: default,
        per_device_pinned_memory_limit: per.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
    })
}

#[test]
fn mps_sets_client_environment_and_pipe_mount() {
    let host = Host::new();
    let pipe = host.root().join("mps/pipe");
    let sharing = mps(Some(50), Some(10 << 30), &[("1", 5 << 30)]);
    let mut a = gpu_device(0, sharing.clone());
    let mut b = gpu_device(1, sharing);
    let shm = host.root().join("mps/shm");
    a.mps_pipe_dir = Some(pipe.clone());
    b.mps_pipe_dir = Some(pipe.clone());
    a.mps_shm_dir = Some(shm.clone());
    b.mps_shm_dir = Some(shm.clone());
    let spec = claim_spec(
        &host.opts,
        UID,
        &[a.clone(), b.clone()],
        &DriverFiles::default(),
    )
    .unwrap();
    assert_eq!(
        spec.container_edits.env,
        vec![
            "NVIDIA_VISIBLE_DEVICES=void".to_string(),
            "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps".to_string(),
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50".to_string(),
            // Keyed by the index the container's CUDA sees, not by UUID: NVIDIA's device
            // plugin v0.15.0 found UUID-keyed limits not applied.
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M,1=5120M".to_string(),
        ]
    );
    assert_eq!(
        spec.container_edits.mounts,
        vec![
            Mount {
                host_path: pipe.display().to_string(),
                container_path: "/tmp/nvidia-mps".into(),
                options: ["rw", "nosuid", "nodev", "rbind", "rprivate"]
                    .map(String::from)
                    .to_vec(),
            },
            Mount {
                host_path: shm.display().to_string(),
                container_path: "/dev/shm".into(),
                options: ["rw", "nosuid", "nodev", "bind"].map(String::from).to_vec(),
            }
        ]
    );
    // Per-device env never conflicts: devices carry only nodes.
    for d in &spec.devices {
        assert!(d.container_edits.env.is_empty());
    }

    // A limit configured by UUID is still written by index; no percentage, no default: only
    // the named device gets a limit.
    let mut c = gpu_device(2, mps(None, None, &[]));
    c.sharing = mps(None, None, &[(c.gpu.uuid.as_str(), 3 << 30)]);
    c.mps_pipe_dir = Some(pipe);
    let spec = claim_spec(&host.opts, UID, &[c.clone()], &DriverFiles::default()).unwrap();
    assert_eq!(
        env_of(&spec.container_edits, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        vec!["0=3072M".to_string()]
    );
    assert!(env_of(&spec.container_edits, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").is_empty());
}

#[test]
fn mps_misconfigurations_are_errors() {
    let host = Host::new();
    let pipe = PathBuf::from("/run/nvdra/mps/x");
    let with_pipe = |mut d: PreparedDevice, dir: &str| {
        d.mps_pipe_dir = Some(PathBuf::from(dir));
        d
    };
    let build = |devs: &[PreparedDevice]| {
        claim_spec(&host.opts, UID, devs, &DriverFiles::default())
            .unwrap_err()
            .to_string()
    };

    let e = build(&[gpu_device(0, mps(None, None, &[]))]);
    assert!(e.contains("has no MPS pipe directory"), "{e}");

    let e = build(&[
        with_pipe(gpu_device(0, mps(None, None, &[])), "/a"),
        gpu_device(1, Sharing::Exclusive),
    ]);
    assert!(e.contains("device gpu-1 is not shared with MPS"), "{e}");

    let e = build(&[
        with_pipe(gpu_device(0, mps(Some(20), None, &[])), "/a"),
        with_pipe(gpu_device(1, mps(Some(30), None, &[])), "/a"),
    ]);
    assert!(e.contains("gpu-0 (20) and gpu-1 (30)"), "{e}");

    let e = build(&[
        with_pipe(gpu_device(0, mps(None, None, &[])), "/a"),
        with_pipe(gpu_device(1, mps(None, None, &[])), "/b"),
    ]);
    assert!(e.contains("different pipe directories /a and /b"), "{e}");

    let with_shm = |mut d: PreparedDevice, dir: &str| {
        d.mps_shm_dir = Some(PathBuf::from(dir));
        d
    };
    let e = build(&[
        with_shm(with_pipe(gpu_device(0, mps(None, None, &[])), "/a"), "/s1"),
        with_shm(with_pipe(gpu_device(1, mps(None, None, &[])), "/a"), "/s2"),
    ]);
    assert!(
        e.contains("different shared-memory directories /s1 and /s2"),
        "{e}"
    );

    let mut d = gpu_device(0, mps(None, None, &[("1", 1 << 30)]));
    d.mps_pipe_dir = Some(pipe.clone());
    let e = build(&[d]);
    assert!(e.contains("device \"1\" matches no device"), "{e}");
    let mut d = gpu_device(0, mps(None, None, &[("GPU-nope", 1 << 30)]));
    d.mps_pipe_dir = Some(pipe);
    let e = build(&[d]);
    assert!(e.contains("\"GPU-nope\" matches no device"), "{e}");
}

#[test]
fn time_slicing_adds_nothing() {
    let host = Host::new();
    let exclusive = claim_spec(
        &host.opts,
        UID,
        &[gpu_device(0, Sharing::Exclusive)],
        &DriverFiles::default(),
    )
    .unwrap();
    let sliced = claim_spec(
        &host.opts,
        UID,
        &[gpu_device(
            0,
            Sharing::TimeSlicing {
                interval: TimeSliceInterval::Long,
            },
        )],
        &DriverFiles::default(),
    )
    .unwrap();
    assert_eq!(exclusive, sliced);
}

#[test]
fn multiple_devices_keep_their_order_and_duplicates_fail() {
    let host = Host::new();
    host.node("nvidia2");
    host.node("nvidia5");
    let devs = [
        gpu_device(5, Sharing::Exclusive),
        gpu_device(2, Sharing::Exclusive),
    ];
    let spec = claim_spec(&host.opts, UID, &devs, &DriverFiles::default()).unwrap();
    let names: Vec<&str> = spec.devices.iter().map(|d| d.name.as_str()).collect();
    assert_eq!(
        names,
        vec![
            format!("{UID}-gpu-{}", devs[0].gpu.minor).as_str(),
            format!("{UID}-gpu-{}", devs[1].gpu.minor).as_str()
        ]
    );
    assert_eq!(
        spec.devices[1].container_edits.device_nodes[0].path,
        format!("/dev/nvidia{}", devs[1].gpu.minor)
    );
    // The container learns its GPUs from the device nodes, not from a UUID list.
    assert_eq!(
        env_of(&spec.container_edits, "NVIDIA_VISIBLE_DEVICES"),
        vec!["void"]
    );

    let e = claim_spec(
        &host.opts,
        UID,
        &[devs[0].clone(), devs[0].clone()],
        &DriverFiles::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("lists device gpu-"), "{e}");
    let e = claim_spec(&host.opts, UID, &[], &DriverFiles::default()).unwrap_err();
    assert!(e.to_string().contains("has no devices"), "{e}");
}

#[test]
fn output_is_deterministic_and_round_trips() {
    let host = Host::new();
    host.node("nvidia0");
    host.node("nvidiactl");
    host.file("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.163.01");
    host.file("usr/bin/nvidia-smi");
    let build = || {
        let files = discover_driver_files(&host.opts.root);
        claim_spec(
            &host.opts,
            UID,
            &[gpu_device(0, Sharing::Exclusive), mig_device(2)],
            &files,
        )
        .unwrap()
        .to_yaml()
        .unwrap()
    };
    let first = build();
    assert_eq!(first, build());
    let parsed: Spec = serde_saphyr::from_str(&first).unwrap();
    assert_eq!(parsed.to_yaml().unwrap(), first);
    // Quoted: the YAML 1.1 float syntax (`[0-9.]*` after the dot) covers `0.5.0`.
    assert!(
        first.starts_with("cdiVersion: \"0.5.0\"\nkind: k8s.gpu.nvidia.com/claim\n"),
        "{first}"
    );
    assert!(first.contains("containerEdits:"), "{first}");
    assert!(first.contains("hostPath:"), "{first}");
    assert!(first.contains("deviceNodes:"), "{first}");
}

#[test]
fn dev_numbers_decode_like_glibc() {
    fn makedev(major: u64, minor: u64) -> u64 {
        ((major & 0xffff_f000) << 32)
            | ((major & 0xfff) << 8)
            | ((minor & 0xffff_ff00) << 12)
            | (minor & 0xff)
    }
    for (ma, mi) in [
        (195, 255),
        (1, 3),
        (511, 0),
        (4095, 1 << 20),
        (0x12345, 0xabcdef),
    ] {
        assert_eq!(split_dev(makedev(ma, mi)), (ma as i64, mi as i64));
    }
    let (major, minor, _) = null_numbers();
    assert_eq!((major, minor), (1, 3));
}

#[test]
fn a_share_limits_its_whole_container_where_the_driver_partitions_memory() {
    let gpu = h100(0);
    let host = Host::new();
    let mut opts = host.opts.clone();
    let mut share = gpu_device(0, mps(None, Some(24 << 30), &[]));
    share.mps_pipe_dir = Some(host.root().join("mps/pipe"));
    // What the scheduler counted (24Gi) as soft, a burst limit as hard.
    let limits = crate::inventory::MemoryLimits {
        soft: 24 << 30,
        hard: 32 << 30,
    };
    share.memory_limits = Some(limits);

    // Without partitioning, the per-process limit only.
    let spec = claim_spec(&opts, UID, &[share.clone()], &DriverFiles::default()).unwrap();
    assert!(spec.container_edits.hooks.is_empty());
    assert_eq!(
        memlimit::spec_enforcement(&spec),
        memlimit::Enforcement::Process
    );

    let partitioning = memlimit::Partitioning {
        binary: host.root().join("plugins/gpu.nvidia.com/bin/nvdra"),
        nvml: host
            .root()
            .join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.615.10"),
        gpus: [gpu.uuid.clone()].into(),
        dmem: false,
    };
    opts.partitioning = Some(partitioning.clone());
    let spec = claim_spec(&opts, UID, &[share.clone()], &DriverFiles::default()).unwrap();
    let limit = memlimit::GpuLimit {
        gpu: gpu.uuid.clone(),
        limits,
    };
    assert_eq!(
        spec.container_edits.hooks,
        partitioning.hooks(&opts.cgroup_root, &[limit]).to_vec()
    );
    let [set, clear] = &spec.container_edits.hooks[..] else {
        panic!("{:?}", spec.container_edits.hooks)
    };
    assert_eq!(
        (set.hook_name.as_str(), clear.hook_name.as_str()),
        ("createRuntime", "poststop")
    );
    assert_eq!(
        set.args.last().unwrap(),
        &format!("{}={}:{}", gpu.uuid.as_str(), 24u64 << 30, 32u64 << 30)
    );
    assert_eq!(
        memlimit::spec_enforcement(&spec),
        memlimit::Enforcement::Container
    );
    // The per-process limit stays beside it.
    assert_eq!(
        env_of(&spec.container_edits, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        vec!["0=24576M"]
    );

    // A GPU whose driver did not answer: no hook.
    let other = PreparedDevice {
        mps_pipe_dir: share.mps_pipe_dir.clone(),
        memory_limits: Some(limits),
        ..gpu_device(1, mps(None, Some(24 << 30), &[]))
    };
    let spec = claim_spec(&opts, UID, &[other], &DriverFiles::default()).unwrap();
    assert!(spec.container_edits.hooks.is_empty());

    // An MPS claim that is not a share (its own daemon, a configured per-process limit): no hook.
    let claim = PreparedDevice {
        memory_limits: None,
        ..share.clone()
    };
    let spec = claim_spec(&opts, UID, &[claim], &DriverFiles::default()).unwrap();
    assert!(spec.container_edits.hooks.is_empty());

    // A whole GPU (no MPS) has no limit and so no hook.
    let spec = claim_spec(
        &opts,
        UID,
        &[gpu_device(0, Sharing::Exclusive)],
        &DriverFiles::default(),
    )
    .unwrap();
    assert!(spec.container_edits.hooks.is_empty());
}
