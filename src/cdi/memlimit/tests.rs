//! The hook's arguments, the runtime's state, the container's cgroup on a fake cgroup v2 tree,
//! the spec's hooks and the enforcement level. The NVML side runs on the fake NVML in
//! `tests/memory_limits.rs`, and under podman and runc in `tests/integration/cdi_podman.rs`.

use std::fs;

use super::*;
use crate::inventory::topology::load_profile;
use crate::sharing::{MpsSettings, Sharing};

const CONTAINER: &str = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-abc.scope";

/// A cgroup v2 root holding the container's cgroup, and a `/proc` where process 4242 is in it.
struct Tree {
    dir: tempfile::TempDir,
}

impl Tree {
    fn new() -> Self {
        let t = Self {
            dir: tempfile::tempdir().unwrap(),
        };
        fs::create_dir_all(t.cgroups().join(CONTAINER)).unwrap();
        fs::create_dir_all(t.proc().join("4242")).unwrap();
        // As the kernel writes it on a hybrid host: v1 lines, then the v2 one.
        fs::write(
            t.proc().join("4242/cgroup"),
            format!("1:name=systemd:/{CONTAINER}\n0::/{CONTAINER}\n"),
        )
        .unwrap();
        t
    }

    fn cgroups(&self) -> PathBuf {
        self.dir.path().join("sys/fs/cgroup")
    }

    fn proc(&self) -> PathBuf {
        self.dir.path().join("proc")
    }
}

fn limit(gpu: &str, soft: u64, hard: u64) -> GpuLimit {
    GpuLimit {
        gpu: GpuUuid(gpu.into()),
        limits: MemoryLimits { soft, hard },
    }
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

#[test]
fn a_limit_is_a_gpu_and_its_soft_and_hard_bytes() {
    let l = limit("GPU-1a2b", 8 << 30, 12 << 30);
    assert_eq!(l.arg(), format!("GPU-1a2b={}:{}", 8u64 << 30, 12u64 << 30));
    assert_eq!(GpuLimit::parse_arg(&l.arg()).unwrap(), l);
    for bad in [
        "GPU-1",
        "GPU-1=5",
        "=5:5",
        "GPU-1=lots:5",
        "GPU-1=5:",
        "GPU 1=5:5",
        // The soft limit above the hard one: NVML would refuse it at container start.
        "GPU-1=6:5",
    ] {
        assert!(GpuLimit::parse_arg(bad).is_err(), "{bad}");
    }
}

#[test]
fn the_hook_reads_its_arguments() {
    let a = Args::parse(args(&[
        "--nvml",
        "/usr/lib/libnvidia-ml.so.615.1",
        "--cgroup-root",
        "/host/cgroup",
        "GPU-1=1:2",
        "GPU-2=3:3",
    ]))
    .unwrap();
    assert_eq!(
        a,
        Args {
            release: false,
            nvml: "/usr/lib/libnvidia-ml.so.615.1".into(),
            cgroup_root: "/host/cgroup".into(),
            proc_root: "/proc".into(),
            limits: vec![limit("GPU-1", 1, 2), limit("GPU-2", 3, 3)],
        }
    );
    let a = Args::parse(args(&["--release", "--nvml", "/l", "GPU-1=1:2"])).unwrap();
    assert!(a.release);
    assert_eq!(a.cgroup_root, Path::new("/sys/fs/cgroup"));
    for (bad, why) in [
        (args(&["GPU-1=1:2"]), "no NVML library"),
        (args(&["--nvml", "/l"]), "no limit given"),
        (args(&["--nvml"]), "--nvml needs a value"),
        (
            args(&["--nvml", "/l", "--cgroup-root"]),
            "--cgroup-root needs",
        ),
    ] {
        let e = format!("{:#}", Args::parse(bad).unwrap_err());
        assert!(e.contains(why), "{e}");
    }
}

#[test]
fn the_runtimes_state_gives_the_pid_at_create_and_none_at_poststop() {
    // What runc 1.1 gave a createRuntime hook under podman 4.3 (tests/integration/cdi_podman.rs
    // runs the hook that way), and what it gives a poststop hook: status stopped, no pid.
    let created = r#"{"ociVersion":"1.0.2-dev","id":"01c4f60a79c1","status":"creating","pid":16666,"bundle":"/var/lib/containers/storage/overlay-containers/01c4f60a79c1/userdata","annotations":{"io.container.manager":"libpod"}}"#;
    let s = OciState::parse(created).unwrap();
    assert_eq!(s.pid().unwrap(), 16666);
    assert_eq!(
        s.bundle.as_deref(),
        Some(Path::new(
            "/var/lib/containers/storage/overlay-containers/01c4f60a79c1/userdata"
        ))
    );
    let stopped = r#"{"ociVersion":"1.0.2","id":"01c4f60a79c1","status":"stopped","bundle":"/b"}"#;
    let s = OciState::parse(stopped).unwrap();
    assert!(s.pid().is_err());
    assert_eq!(s.bundle.as_deref(), Some(Path::new("/b")));
    assert!(OciState::parse(r#"{"pid":0}"#).unwrap().pid().is_err());
    assert!(OciState::parse("not json").is_err());
}

#[test]
fn the_containers_cgroup_is_its_own_leaf_under_the_root() {
    let t = Tree::new();
    assert_eq!(
        container_cgroup(&t.cgroups(), &t.proc(), 4242).unwrap(),
        t.cgroups().join(CONTAINER)
    );

    let e = format!(
        "{:#}",
        container_cgroup(&t.cgroups(), &t.proc(), 7).unwrap_err()
    );
    assert!(e.contains("proc/7/cgroup"), "{e}");

    fs::write(t.proc().join("4242/cgroup"), "1:name=systemd:/x\n").unwrap();
    let e = format!(
        "{:#}",
        container_cgroup(&t.cgroups(), &t.proc(), 4242).unwrap_err()
    );
    assert!(e.contains("no cgroup v2 entry"), "{e}");

    // The root cgroup is nobody's leaf (and NVML refuses limits on it).
    fs::write(t.proc().join("4242/cgroup"), "0::/\n").unwrap();
    let e = format!(
        "{:#}",
        container_cgroup(&t.cgroups(), &t.proc(), 4242).unwrap_err()
    );
    assert!(e.contains("is not a cgroup below"), "{e}");

    fs::write(t.proc().join("4242/cgroup"), format!("0::/{CONTAINER}\n")).unwrap();
    fs::remove_dir_all(t.cgroups().join(CONTAINER)).unwrap();
    let e = format!(
        "{:#}",
        container_cgroup(&t.cgroups(), &t.proc(), 4242).unwrap_err()
    );
    assert!(e.contains("is not a cgroup below"), "{e}");
}

fn partitioning(gpus: &[&str]) -> Partitioning {
    Partitioning {
        binary: "/var/lib/kubelet/plugins/gpu.nvidia.com/bin/nvdra".into(),
        nvml: "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.615.10".into(),
        gpus: gpus.iter().map(|g| GpuUuid(g.to_string())).collect(),
        dmem: false,
    }
}

/// On the driver's `dmem` backend a soft limit (`dmem.min`) that is not zeroed before the
/// container's cgroup goes stays reserved in every ancestor, and runc and crun remove the cgroup
/// before `poststop` hooks run: only the hard limit is set there.
#[test]
fn on_the_dmem_backend_only_the_hard_limit_is_set() {
    let mut p = partitioning(&["GPU-1"]);
    p.dmem = true;
    let [set, clear] = p.hooks(Path::new("/sys/fs/cgroup"), &[limit("GPU-1", 8, 12)]);
    for h in [&set, &clear] {
        assert_eq!(
            h.args.last().map(String::as_str),
            Some("GPU-1=0:12"),
            "{h:?}"
        );
    }
    p.dmem = false;
    let [set, _] = p.hooks(Path::new("/sys/fs/cgroup"), &[limit("GPU-1", 8, 12)]);
    assert_eq!(set.args.last().map(String::as_str), Some("GPU-1=8:12"));
}

#[test]
fn a_spec_sets_the_limits_at_create_and_clears_them_at_poststop() {
    let p = partitioning(&["GPU-1"]);
    let [set, clear] = p.hooks(Path::new("/sys/fs/cgroup"), &[limit("GPU-1", 8, 12)]);
    let common = [
        "--nvml",
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.615.10",
        "--cgroup-root",
        "/sys/fs/cgroup",
        "GPU-1=8:12",
    ];
    assert_eq!(set.hook_name, "createRuntime");
    assert_eq!(
        set.path,
        "/var/lib/kubelet/plugins/gpu.nvidia.com/bin/nvdra"
    );
    assert_eq!(set.args[..2], ["nvdra", SUBCOMMAND]);
    assert_eq!(set.args[2..], common);
    assert_eq!(clear.hook_name, "poststop");
    assert_eq!(clear.path, set.path);
    assert_eq!(clear.args[..3], ["nvdra", SUBCOMMAND, "--release"]);
    assert_eq!(clear.args[3..], common);
    // What the hook is given, it reads back.
    let a = Args::parse(set.args[2..].to_vec()).unwrap();
    assert_eq!(a.limits, [limit("GPU-1", 8, 12)]);
    assert!(Args::parse(clear.args[2..].to_vec()).unwrap().release);
}

#[test]
fn a_share_is_limited_per_container_only_on_a_gpu_that_partitions() {
    let inv = load_profile("a100-mig-mixed", "n").unwrap();
    let gpu = inv.gpus.iter().find(|g| !g.mig.devices.is_empty()).unwrap();
    let other = inv.gpus.iter().find(|g| g.uuid != gpu.uuid).unwrap();
    let device = |gpu: &crate::inventory::Gpu, share: bool| PreparedDevice {
        name: "gpu-0".into(),
        gpu: gpu.clone(),
        mig: None,
        sharing: Sharing::Mps(MpsSettings {
            active_thread_percentage: None,
            pinned_memory_limit: Some(8 << 30),
            per_device_pinned_memory_limit: Default::default(),
        }),
        mps_pipe_dir: Some("/run/mps".into()),
        mps_shm_dir: None,
        memory_limits: share.then(|| MemoryLimits::fixed(8 << 30)),
    };
    let mut opts = CdiOptions::resolve(
        "gpu.nvidia.com",
        &super::super::DriverRoot::at(Path::new("/")),
    )
    .unwrap();
    let share = device(gpu, true);
    assert_eq!(enforcement(&opts, &share), Some(Enforcement::Process));
    opts.partitioning = Some(partitioning(&[gpu.uuid.as_str()]));
    assert_eq!(enforcement(&opts, &share), Some(Enforcement::Container));
    assert_eq!(
        enforcement(&opts, &device(other, true)),
        Some(Enforcement::Process),
        "a GPU whose driver did not answer"
    );
    let mig = PreparedDevice {
        mig: Some(gpu.mig.devices[0].clone()),
        ..share.clone()
    };
    assert_eq!(
        enforcement(&opts, &mig),
        Some(Enforcement::Process),
        "MIG devices are not partitioned"
    );
    assert_eq!(enforcement(&opts, &device(gpu, false)), None, "not a share");
    assert_eq!(Enforcement::Container.as_str(), "container");
    assert_eq!(Enforcement::Process.to_string(), "process");
}

#[test]
fn poststop_does_nothing_where_nothing_was_set_or_the_cgroup_is_gone() {
    let t = Tree::new();
    let bundle = t.dir.path().join("bundle");
    fs::create_dir_all(&bundle).unwrap();
    // A library that cannot load: these paths never reach NVML.
    let args = Args {
        release: true,
        nvml: t.dir.path().join("no-such-libnvidia-ml.so"),
        cgroup_root: t.cgroups(),
        proc_root: t.proc(),
        limits: vec![limit("GPU-1", 1, 1)],
    };
    let state = OciState {
        pid: None,
        bundle: Some(bundle.clone()),
    };
    release(&args, &state).unwrap();
    release(&args, &OciState::default()).unwrap();

    // The runtime removed the container's cgroup before its poststop hooks (runc and crun do).
    let leaf = t.cgroups().join(CONTAINER);
    fs::write(bundle.join(RECORD), leaf.as_os_str().as_bytes()).unwrap();
    fs::remove_dir_all(&leaf).unwrap();
    release(&args, &state).unwrap();
    assert!(!bundle.join(RECORD).exists(), "the record goes too");

    // Where it is still there, the limits are cleared through NVML (here: it cannot load).
    fs::create_dir_all(&leaf).unwrap();
    fs::write(bundle.join(RECORD), leaf.as_os_str().as_bytes()).unwrap();
    let e = format!("{:#}", release(&args, &state).unwrap_err());
    assert!(e.contains("loading NVML from"), "{e}");

    // A record naming a cgroup elsewhere is refused, not cleared.
    fs::write(bundle.join(RECORD), b"/elsewhere").unwrap();
    let e = format!("{:#}", release(&args, &state).unwrap_err());
    assert!(e.contains("not a cgroup below"), "{e}");
}

#[test]
fn an_older_specs_dmem_hook_refuses_to_start_the_container() {
    let e = format!(
        "{:#}",
        legacy_main(args(&[
            "--cgroup-root",
            "/sys/fs/cgroup",
            "nvidia/x/vidmem=1"
        ]))
        .unwrap_err()
    );
    assert!(e.contains("rewrites the claim's spec"), "{e}");
}
