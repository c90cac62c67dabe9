//! Per-cgroup GPU memory limits (MPS v3 memory partitioning) on the fake NVML: its
//! `nvmlDeviceSetMemoryLimits_v1` and `nvmlDeviceGetMemoryLimits_v1` through nvdra's raw calls,
//! the backend's probe, and `nvdra memory-limit-hook` run as the container runtime runs it (the
//! OCI state on stdin) on a fake cgroup tree, with the fake's limits kept in its state file.
//! `tests/integration/cdi_podman.rs` runs the same hook under podman and runc on the host's
//! cgroups.
//!
//! The hook runs as a child process with its own environment; in this process the fake serves
//! its default node with the default (working) limits.

mod support;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

use fake_nvml::state::CgroupLimits;
use nvdra::inventory::nvml::memory_limits::{memory_limits, set_memory_limits};
use nvdra::inventory::nvml::{LIBRARY, NvmlBackend};
use nvdra::inventory::{GpuUuid, MEMORY_LIMIT_MAX, MemoryLimits, Reconfigure};
use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;

const CONTAINER: &str = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-abc.scope";
const GIB: u64 = 1 << 30;

/// The fake's default node: GPU 1 is a whole A100 (MIG off), GPU 0 an A100 with MIG devices.
fn gpu(index: usize) -> String {
    fake_nvml::model::a100_l40s()[index].uuid.clone()
}

fn nvml() -> Nvml {
    Nvml::builder()
        .lib_path(support::fake_nvml::library().as_os_str())
        .init()
        .unwrap()
}

#[test]
fn the_fake_keeps_limits_per_gpu_and_cgroup_as_nvml_documents() {
    let nvml = nvml();
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let whole = nvml.device_by_uuid(gpu(1)).unwrap();
    let limits = MemoryLimits {
        soft: 8 * GIB,
        hard: 12 * GIB,
    };

    // No limit: soft 0, hard NVML_DEVICE_MEMORY_LIMIT_MAX.
    let (read, used) = memory_limits(&nvml, &whole, &a).unwrap();
    assert_eq!(read, MemoryLimits::NONE);
    assert_eq!((read.hard, used), (MEMORY_LIMIT_MAX, 0));

    set_memory_limits(&nvml, &whole, &a, limits).unwrap();
    assert_eq!(memory_limits(&nvml, &whole, &a).unwrap().0, limits);
    assert_eq!(
        memory_limits(&nvml, &whole, &b).unwrap().0,
        MemoryLimits::NONE,
        "per cgroup"
    );
    let other = nvml.device_by_uuid(gpu(2)).unwrap();
    assert_eq!(
        memory_limits(&nvml, &other, &a).unwrap().0,
        MemoryLimits::NONE,
        "per GPU"
    );
    // Cleared as NVML documents: soft 0, hard max.
    set_memory_limits(&nvml, &whole, &a, MemoryLimits::NONE).unwrap();
    assert_eq!(
        memory_limits(&nvml, &whole, &a).unwrap().0,
        MemoryLimits::NONE
    );

    // A cgroup that is not there.
    let gone = dir.path().join("gone");
    assert!(matches!(
        set_memory_limits(&nvml, &whole, &gone, limits),
        Err(NvmlError::NotFound)
    ));
    assert!(matches!(
        memory_limits(&nvml, &whole, &gone),
        Err(NvmlError::NotFound)
    ));
    // A soft limit above the hard one.
    let inverted = MemoryLimits {
        soft: 2 * GIB,
        hard: GIB,
    };
    assert!(matches!(
        set_memory_limits(&nvml, &whole, &a, inverted),
        Err(NvmlError::InvalidArg)
    ));
    // "MIG handles are not supported."
    let parent = nvml.device_by_uuid(gpu(0)).unwrap();
    let mig = parent.mig_device_by_index(0).unwrap();
    assert!(matches!(
        set_memory_limits(&nvml, &mig, &a, limits),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(
        memory_limits(&nvml, &mig, &a),
        Err(NvmlError::NotSupported)
    ));
}

/// The plugin's question, through the NVML backend: the fake's driver answers for a whole GPU.
#[test]
fn the_backend_asks_whether_a_gpu_is_partitioned() {
    let root = tempfile::tempdir().unwrap();
    let lib = root.path().join("usr/lib64");
    std::fs::create_dir_all(&lib).unwrap();
    std::os::unix::fs::symlink(support::fake_nvml::library(), lib.join(LIBRARY)).unwrap();
    let backend = NvmlBackend::open(root.path()).unwrap();
    let cgroup = tempfile::tempdir().unwrap();
    assert_eq!(
        backend
            .memory_limits(&GpuUuid(gpu(1)), cgroup.path())
            .unwrap(),
        MemoryLimits::NONE
    );
    let e = backend
        .memory_limits(&GpuUuid("GPU-nope".into()), cgroup.path())
        .unwrap_err();
    assert!(e.to_string().contains("GPU-nope"), "{e}");
}

/// A host as the hook sees it: a cgroup v2 root with the container's cgroup, a `/proc` where
/// process 4242 is in it, the container's bundle directory and the fake's state file.
struct Host {
    dir: tempfile::TempDir,
}

impl Host {
    fn new() -> Self {
        let h = Self {
            dir: tempfile::tempdir().unwrap(),
        };
        std::fs::create_dir_all(h.leaf()).unwrap();
        std::fs::create_dir_all(h.dir.path().join("proc/4242")).unwrap();
        std::fs::write(
            h.dir.path().join("proc/4242/cgroup"),
            format!("0::/{CONTAINER}\n"),
        )
        .unwrap();
        std::fs::create_dir_all(h.bundle()).unwrap();
        h
    }

    fn cgroups(&self) -> PathBuf {
        self.dir.path().join("sys/fs/cgroup")
    }

    fn leaf(&self) -> PathBuf {
        self.cgroups().join(CONTAINER)
    }

    fn bundle(&self) -> PathBuf {
        self.dir.path().join("bundle")
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("nvml-state")
    }

    fn limits(&self) -> Vec<CgroupLimits> {
        fake_nvml::state::memory_limits(&self.state())
    }

    /// Runs `nvdra memory-limit-hook [extra] <limits>` with the fake's `driver` setting
    /// (`FAKE_NVML_MEMORY_LIMITS`) and `state` on stdin, as runc runs a hook.
    fn hook(&self, extra: &[&str], limits: &[String], driver: &str, state: &str) -> Output {
        let mut child = Command::new(env!("CARGO_BIN_EXE_nvdra"))
            .args(["memory-limit-hook"])
            .args(extra)
            .arg("--nvml")
            .arg(support::fake_nvml::library())
            .arg("--cgroup-root")
            .arg(self.cgroups())
            .arg("--proc-root")
            .arg(self.dir.path().join("proc"))
            .args(limits)
            .env("FAKE_NVML_STATE", self.state())
            .env("FAKE_NVML_MEMORY_LIMITS", driver)
            .env_remove("FAKE_NVML_NODE")
            .env_remove("FAKE_NVML_PROFILE")
            .env_remove("FAKE_NVML_TOPOLOGY")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(state.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    }

    /// The createRuntime hook's run: runc's state with the container's init pid.
    fn create(&self, limits: &[String], driver: &str) -> Output {
        let state = format!(
            r#"{{"ociVersion":"1.0.2-dev","id":"abc","status":"creating","pid":4242,"bundle":"{}"}}"#,
            self.bundle().display()
        );
        self.hook(&[], limits, driver, &state)
    }

    /// The poststop hook's run: no pid.
    fn poststop(&self, limits: &[String]) -> Output {
        let state = format!(
            r#"{{"ociVersion":"1.0.2-dev","id":"abc","status":"stopped","bundle":"{}"}}"#,
            self.bundle().display()
        );
        self.hook(&["--release"], limits, "", &state)
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn the_hook_sets_both_limits_on_the_containers_own_cgroup_and_poststop_clears_them() {
    let host = Host::new();
    let limits = [format!("{}={}:{}", gpu(1), 8 * GIB, 12 * GIB)];
    let out = host.create(&limits, "");
    assert!(out.status.success(), "{}", stderr(&out));
    let leaf = host.leaf().display().to_string();
    assert_eq!(
        host.limits(),
        [CgroupLimits {
            gpu: 1,
            cgroup: leaf.clone(),
            soft: 8 * GIB,
            hard: 12 * GIB,
        }],
        "{}",
        stderr(&out)
    );
    assert!(
        stderr(&out).contains(&format!("{leaf} limited to")),
        "{}",
        stderr(&out)
    );
    // The record poststop finds the cgroup by (its state has no pid).
    assert_eq!(
        std::fs::read_to_string(host.bundle().join("nvdra-memory-limits")).unwrap(),
        leaf
    );

    let out = host.poststop(&limits);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(host.limits(), [], "cleared: {}", stderr(&out));
    assert!(!host.bundle().join("nvdra-memory-limits").exists());

    // Set again, then the runtime removes the cgroup before poststop (as runc and crun do):
    // nothing to clear, and no error.
    assert!(host.create(&limits, "").status.success());
    std::fs::remove_dir_all(host.leaf()).unwrap();
    let out = host.poststop(&limits);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("is gone"), "{}", stderr(&out));
}

#[test]
fn a_limit_that_cannot_be_set_fails_the_hook_naming_the_cgroup_gpu_and_nvml_error() {
    let limits = [format!("{}={}:{}", gpu(1), 8 * GIB, 8 * GIB)];
    for (driver, error) in [
        // Not root, as NVML requires.
        ("fail", "does not have permission"),
        // A driver without partitioning.
        ("unsupported", "not available on the target device"),
        // A library older than R615.
        ("missing", "a driver older than R615"),
        // Set answers success but nothing holds: the read-back sees it.
        (
            "ignore",
            "reads soft 0 hard max after nvmlDeviceSetMemoryLimits_v1 set",
        ),
    ] {
        let host = Host::new();
        let out = host.create(&limits, driver);
        let e = stderr(&out);
        assert!(!out.status.success(), "{driver}: the hook succeeded: {e}");
        assert!(e.starts_with("nvdra memory-limit-hook: "), "{driver}: {e}");
        assert!(
            e.contains(&host.leaf().display().to_string()),
            "{driver}: {e}"
        );
        assert!(e.contains(&gpu(1)), "{driver}: {e}");
        assert!(
            e.to_lowercase().contains(&error.to_lowercase()),
            "{driver}: {e}"
        );
        assert_eq!(host.limits(), [], "{driver}: nothing is set");
    }

    // A GPU the driver does not know, and a container whose cgroup is gone.
    let host = Host::new();
    let out = host.create(&[format!("GPU-nope={GIB}:{GIB}")], "");
    assert!(!out.status.success());
    assert!(stderr(&out).contains("GPU-nope"), "{}", stderr(&out));
    std::fs::remove_dir_all(host.leaf()).unwrap();
    let out = host.create(&limits, "");
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("is not a cgroup below"),
        "{}",
        stderr(&out)
    );
}

/// The hook given a spec's arguments by hand: it needs a library and limits.
#[test]
fn the_hook_refuses_bad_arguments_before_reading_stdin() {
    let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
        .args(["memory-limit-hook", "GPU-1=1:1"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("no NVML library given"),
        "{}",
        stderr(&out)
    );
    let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
        .args(["dmem-hook", "nvidia/0000:3b:00.0/vidmem=1"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).starts_with("nvdra dmem-hook: "),
        "{}",
        stderr(&out)
    );
}
