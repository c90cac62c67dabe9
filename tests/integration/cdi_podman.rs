//! Proves nvdra's claim CDI specs with a real container engine: a spec for a simulated H100 on a
//! fake driver root (device nodes made with `mknod`, a fake `nvidia-smi` and NVML library) is
//! written where podman reads CDI specs, and a container started with the claim's CDI device id
//! must see the GPU's device node, the control node, `NVIDIA_VISIBLE_DEVICES=void`
//! and the driver files mounted read-only. A third test runs the daemon itself: the spec podman
//! reads is the one `nvdra run` wrote while preparing a claim over its DRA socket, with the driver
//! laid out as the GPU Operator lays it out (host and container paths of the driver root apart),
//! for a whole GPU and for a consumable-capacity share of one (its MPS limits and pipe directory).
//!
//! Needs root, `podman`, `runc` and `busybox-static` (see `.ci/run`). Without them the test says
//! why and passes — unless `NVDRA_REQUIRE_PODMAN` is set (CI sets it to 1), in which case an
//! engine that cannot run is a failure. A spec the engine rejects is always a failure. The
//! memory-limit hook's run also needs a cgroup v2 hierarchy, required likewise by
//! `NVDRA_REQUIRE_CGROUP2`.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, ensure};
use nvdra::cdi::{self, CdiOptions, DriverRoot, PreparedDevice};
use nvdra::inventory::MemoryLimits;
use nvdra::inventory::topology::load_profile;
use nvdra::sharing::{MpsSettings, Sharing};

use crate::support::fake_nvml as fake_nvml_lib;
use crate::support::podman as engine;
use crate::support::{daemon, mps};
use engine::*;

#[test]
fn podman_applies_a_full_gpu_claim_spec() {
    with_engine(check_full_gpu);
}

#[test]
fn podman_applies_a_mig_claim_spec_with_mps() {
    with_engine(check_mig_with_mps);
}

#[test]
fn podman_runs_the_memory_limit_hook_on_the_containers_own_cgroup() {
    with_engine(check_memory_limit_hook);
}

#[test]
fn podman_applies_the_device_plugin_spec() {
    with_engine(check_device_plugin_spec);
}

fn check_full_gpu(engine: &Engine) -> Result<()> {
    // The fake host.
    let host = tempfile::tempdir()?;
    let root = host.path();
    let gpu = load_profile("dgx-h100", "n")?.gpus[0].clone();
    mknod(&root.join(format!("dev/nvidia{}", gpu.minor)))?;
    mknod(&root.join("dev/nvidiactl"))?;
    mknod(&root.join("dev/nvidia-uvm"))?;
    let smi = root.join("usr/bin/nvidia-smi");
    std::fs::create_dir_all(smi.parent().context("parent")?)?;
    std::fs::write(&smi, "fake nvidia-smi for nvdra\n")?;
    let nvml = root.join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.163.01");
    std::fs::create_dir_all(nvml.parent().context("parent")?)?;
    std::fs::write(&nvml, "fake NVML\n")?;

    fake_graphics(root, &gpu)?;

    let opts = CdiOptions::resolve("gpu.nvidia.com", &DriverRoot::at(root))?;
    ensure!(
        opts.dev_root == root.join("dev"),
        "dev root {:?}",
        opts.dev_root
    );
    let files = cdi::discover_driver_files(&opts.root);
    ensure!(
        files.binaries == vec![smi.clone()],
        "binaries {:?}",
        files.binaries
    );
    ensure!(
        files.libraries == vec![nvml.clone()],
        "libraries {:?}",
        files.libraries
    );

    let device = PreparedDevice {
        name: format!("gpu-{}", gpu.minor),
        gpu: gpu.clone(),
        mig: None,
        sharing: Sharing::Exclusive,
        mps_pipe_dir: None,
        mps_shm_dir: None,
        memory_limits: None,
    };
    let script = format!(
        "ls -l /dev/nvidia{minor} /dev/nvidiactl /dev/nvidia-uvm; \
         echo VISIBLE=$NVIDIA_VISIBLE_DEVICES; \
         echo SMI=$(cat /usr/bin/nvidia-smi); \
         echo NVML=$(cat /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.163.01); \
         if (echo x > /usr/bin/nvidia-smi) 2>/dev/null; then echo SMI_WRITABLE; else echo SMI_READ_ONLY; fi; \
         {GRAPHICS_SCRIPT}",
        minor = gpu.minor
    );
    let out = run_claim(engine, &opts, &[device], &files, &script)?;
    for node in [
        format!("/dev/nvidia{}", gpu.minor),
        "/dev/nvidiactl".into(),
        "/dev/nvidia-uvm".into(),
    ] {
        assert_null_node(&out, &node)?;
    }
    assert_line(&out, "VISIBLE=void")?;
    assert_line(&out, "SMI=fake nvidia-smi for nvdra")?;
    assert_line(&out, "NVML=fake NVML")?;
    assert_line(&out, "SMI_READ_ONLY")?;
    assert_graphics(&out)?;
    Ok(())
}

/// Graphics and display files as a driver package installs them under `root`, and the DRM card
/// and render nodes of `gpu` in sysfs (by PCI bus ID) and `dev/dri`. The X config is under
/// `etc/`, where some distributions put it; NVIDIA mounts it at `/usr/share` all the same.
fn fake_graphics(root: &std::path::Path, gpu: &nvdra::inventory::Gpu) -> Result<()> {
    for (rel, content) in [
        ("usr/share/glvnd/egl_vendor.d/10_nvidia.json", "egl vendor"),
        ("etc/vulkan/icd.d/nvidia_icd.json", "vulkan icd"),
        ("etc/X11/xorg.conf.d/10-nvidia.conf", "xorg conf"),
        (
            "usr/lib/x86_64-linux-gnu/libnvidia-egl-gbm.so.1.1.2",
            "egl gbm",
        ),
    ] {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().context("parent")?)?;
        std::fs::write(&path, format!("{content}\n"))?;
    }
    let drm = root
        .join("sys/bus/pci/devices")
        .join(&gpu.pci_bus_id.0)
        .join("drm");
    for node in ["card1", "renderD128"] {
        std::fs::create_dir_all(drm.join(node))?;
        mknod(&root.join("dev/dri").join(node))?;
    }
    Ok(())
}

/// Prints what [`assert_graphics`] checks.
const GRAPHICS_SCRIPT: &str = "ls -l /dev/dri/card1 /dev/dri/renderD128; \
     echo EGL=$(cat /usr/share/glvnd/egl_vendor.d/10_nvidia.json); \
     echo VULKAN=$(cat /etc/vulkan/icd.d/nvidia_icd.json); \
     echo XORG=$(cat /usr/share/X11/xorg.conf.d/10-nvidia.conf); \
     echo GBM=$(cat /usr/lib/x86_64-linux-gnu/libnvidia-egl-gbm.so.1.1.2)";

/// The container got [`fake_graphics`]' files and the GPU's DRM nodes.
fn assert_graphics(out: &str) -> Result<()> {
    assert_null_node(out, "/dev/dri/card1")?;
    assert_null_node(out, "/dev/dri/renderD128")?;
    assert_line(out, "EGL=egl vendor")?;
    assert_line(out, "VULKAN=vulkan icd")?;
    assert_line(out, "XORG=xorg conf")?;
    assert_line(out, "GBM=egl gbm")
}

/// Two MIG devices of one A100, shared with MPS: the parent node, each device's capability
/// nodes (from `mig-minors`), both UUIDs, and the MPS pipe directory and limits.
/// A share's spec on a node whose driver partitions GPU memory per cgroup carries nvdra's
/// `createRuntime` and `poststop` hooks. runc runs the real binary on the host with the
/// container's OCI state; the hook finds the container's own cgroup in the host's real cgroup v2
/// hierarchy and sets the share's soft and hard limit on it through the fake NVML (a real one
/// needs a GPU), which keeps them in its state file: the test reads there which cgroup got which
/// limits. A limit that cannot be set (the fake told to refuse) stops the container, with the
/// hook's reason in podman's error.
fn check_memory_limit_hook(engine: &Engine) -> Result<()> {
    let Some(cgroup2) = cgroup2_mount()? else {
        ensure!(
            !engine::require::required("NVDRA_REQUIRE_CGROUP2"),
            "NVDRA_REQUIRE_CGROUP2 requires a cgroup v2 hierarchy but /proc/self/mountinfo has no \
             cgroup2 mount: run on a host with cgroup v2 (unified or hybrid), or unset \
             NVDRA_REQUIRE_CGROUP2"
        );
        eprintln!(
            "skipping the memory-limit hook run: this host has no cgroup v2 hierarchy (set \
             NVDRA_REQUIRE_CGROUP2=1 to make this a failure)"
        );
        return Ok(());
    };
    let host = tempfile::tempdir()?;
    let root = host.path();
    // The fake NVML serves the same profile, seed and so UUIDs (FAKE_NVML_PROFILE below).
    let gpu = load_profile("dgx-h100", "n")?.gpus[0].clone();
    mknod(&root.join(format!("dev/nvidia{}", gpu.minor)))?;
    mknod(&root.join("dev/nvidiactl"))?;
    let pipe = root.join("run/mps/pipe");
    std::fs::create_dir_all(&pipe)?;
    let mut opts = CdiOptions::resolve("gpu.nvidia.com", &DriverRoot::at(root))?;
    opts.partitioning = Some(cdi::memlimit::Partitioning {
        binary: PathBuf::from(env!("CARGO_BIN_EXE_nvdra")),
        nvml: fake_nvml_lib::library(),
        gpus: [gpu.uuid.clone()].into(),
        dmem: false,
    });
    // Soft: what the scheduler counted; hard: a burst limit above it.
    let (soft, hard) = (8u64 << 30, 12u64 << 30);
    let share = PreparedDevice {
        name: format!("gpu-{}", gpu.minor),
        gpu: gpu.clone(),
        mig: None,
        sharing: Sharing::Mps(MpsSettings {
            active_thread_percentage: None,
            pinned_memory_limit: Some(soft),
            per_device_pinned_memory_limit: Default::default(),
        }),
        mps_pipe_dir: Some(pipe),
        mps_shm_dir: None,
        memory_limits: Some(MemoryLimits { soft, hard }),
    };
    let state = root.join("nvml-state");
    let run = |driver: &str| {
        let mut hooked = 0;
        let out = run_claim_with(
            engine,
            &opts,
            std::slice::from_ref(&share),
            &cdi::DriverFiles::default(),
            "cat /etc/hostname; echo; echo CONTAINER_RAN",
            |spec| {
                // The hooks are the spec's; only their cgroup root moves from the fake tree to
                // the host's real hierarchy, and the fake NVML gets its settings.
                for h in &mut spec.container_edits.hooks {
                    if h.args.get(1).map(String::as_str) != Some(cdi::memlimit::SUBCOMMAND) {
                        continue;
                    }
                    let at = h.args.iter().position(|a| a == "--cgroup-root").unwrap() + 1;
                    h.args[at] = cgroup2.display().to_string();
                    h.env = vec![
                        format!("FAKE_NVML_STATE={}", state.display()),
                        "FAKE_NVML_PROFILE=dgx-h100".into(),
                        "FAKE_NVML_SEED=n".into(),
                        format!("FAKE_NVML_MEMORY_LIMITS={driver}"),
                    ];
                    hooked += 1;
                }
            },
        );
        (out, hooked)
    };

    let (out, hooked) = run("");
    ensure!(
        hooked == 2,
        "the share's spec has {hooked} memory-limit hooks, not 2"
    );
    let out = out?;
    ensure!(
        out.contains("CONTAINER_RAN"),
        "the container did not run: {out}"
    );
    // podman names the container's cgroup after its ID, and its hostname is the ID's start.
    let hostname = out.lines().next().unwrap_or_default().trim().to_string();
    ensure!(hostname.len() >= 12, "no hostname in {out:?}");
    let set = fake_nvml::state::memory_limits(&state);
    ensure!(
        set.len() == 1,
        "the fake NVML holds {set:?}, not one cgroup's limits"
    );
    let l = &set[0];
    let leaf = PathBuf::from(&l.cgroup);
    ensure!(
        leaf.starts_with(&cgroup2) && leaf != cgroup2,
        "the limits were set on {}, not a cgroup below {}",
        leaf.display(),
        cgroup2.display()
    );
    ensure!(
        leaf.file_name()
            .is_some_and(|n| n.to_string_lossy().contains(&hostname)),
        "the limits were set on {}, not the container's own cgroup (its ID starts {hostname})",
        leaf.display()
    );
    ensure!(
        (l.gpu, l.soft, l.hard) == (0, soft, hard),
        "the fake NVML holds GPU {} soft {} hard {}, not GPU 0 soft {soft} hard {hard}",
        l.gpu,
        l.soft,
        l.hard
    );
    // runc removed the container's cgroup before its poststop hooks ran (libcontainer's
    // destroy): the poststop hook found nothing to clear, and the driver dropped the limits
    // with the cgroup. The fake, which does not know the cgroup is gone, still lists them.
    ensure!(!leaf.exists(), "{} outlived its container", leaf.display());

    // A limit that cannot be set: the container does not start.
    std::fs::remove_file(&state)?;
    let (out, _) = run("fail");
    let e = format!(
        "{:#}",
        out.err()
            .context("the container started although its memory limit could not be set")?
    );
    ensure!(!e.contains("CONTAINER_RAN"), "the container ran: {e}");
    ensure!(
        e.contains("nvdra memory-limit-hook:"),
        "podman's error does not show the hook's: {e}"
    );
    for want in [
        gpu.uuid.as_str(),
        &format!("cgroup {}/", cgroup2.display()),
        "does not have permission",
    ] {
        ensure!(
            e.contains(want),
            "the hook's error does not name {want:?}: {e}"
        );
    }
    let set = fake_nvml::state::memory_limits(&state);
    ensure!(
        set.is_empty(),
        "the fake NVML holds {set:?} after a refused set"
    );
    eprintln!("refused as expected: {e}");
    Ok(())
}

/// Where the host's cgroup v2 hierarchy is mounted (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified`
/// on a hybrid host), from `/proc/self/mountinfo`.
fn cgroup2_mount() -> Result<Option<PathBuf>> {
    let text = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(text.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        if right.split_whitespace().next() != Some("cgroup2") {
            return None;
        }
        left.split_whitespace().nth(4).map(PathBuf::from)
    }))
}

fn check_mig_with_mps(engine: &Engine) -> Result<()> {
    let host = tempfile::tempdir()?;
    let root = host.path();
    let inventory = load_profile("a100-mig-mixed", "n")?;
    let parent = inventory
        .gpus
        .iter()
        .find(|g| g.mig.devices.len() >= 2)
        .context("the profile has a GPU with two MIG devices")?
        .clone();
    let m = parent.minor;
    mknod(&root.join(format!("dev/nvidia{m}")))?;
    mknod(&root.join("dev/nvidiactl"))?;
    let mut minors = String::from("config 1\nmonitor 2\n");
    let pipe = root.join("run/mps/pipe");
    std::fs::create_dir_all(&pipe)?;
    std::fs::write(pipe.join("control"), "mps pipe\n")?;
    let shm = root.join("run/mps/shm");
    std::fs::create_dir_all(&shm)?;
    std::fs::write(shm.join("mps-segment"), "shared with the daemon\n")?;
    let mut devices = Vec::new();
    for (i, mig) in parent.mig.devices.iter().take(2).enumerate() {
        let (gi_cap, ci_cap) = (10 + 2 * i, 11 + 2 * i);
        minors.push_str(&format!(
            "gpu{m}/gi{g}/access {gi_cap}\ngpu{m}/gi{g}/ci{c}/access {ci_cap}\n",
            g = mig.gi_id,
            c = mig.ci_id
        ));
        mknod(&root.join(format!("dev/nvidia-caps/nvidia-cap{gi_cap}")))?;
        mknod(&root.join(format!("dev/nvidia-caps/nvidia-cap{ci_cap}")))?;
        devices.push(PreparedDevice {
            name: format!(
                "gpu-{m}-mig-{}-{}-{}",
                mig.profile.replace('.', ""),
                mig.gi_profile_id,
                mig.placement.start
            ),
            gpu: parent.clone(),
            mig: Some(mig.clone()),
            sharing: Sharing::Mps(MpsSettings {
                active_thread_percentage: Some(40),
                pinned_memory_limit: Some(2 << 30),
                per_device_pinned_memory_limit: [("1".to_string(), 1 << 30)].into(),
            }),
            mps_pipe_dir: Some(pipe.clone()),
            mps_shm_dir: Some(shm.clone()),
            memory_limits: None,
        });
    }
    let caps = root.join("proc/driver/nvidia-caps");
    std::fs::create_dir_all(&caps)?;
    std::fs::write(caps.join("mig-minors"), minors)?;

    let opts = CdiOptions::resolve("gpu.nvidia.com", &DriverRoot::at(root))?;
    let script = format!(
        "ls -l /dev/nvidia{m} /dev/nvidia-caps/*; \
         echo VISIBLE=$NVIDIA_VISIBLE_DEVICES; \
         echo PIPE=$CUDA_MPS_PIPE_DIRECTORY; \
         echo PIPE_CONTENT=$(cat $CUDA_MPS_PIPE_DIRECTORY/control); \
         echo THREADS=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; \
         echo LIMITS=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; \
         echo SHM=$(cat /dev/shm/mps-segment)"
    );
    let out = run_claim(
        engine,
        &opts,
        &devices,
        &cdi::DriverFiles::default(),
        &script,
    )?;
    assert_null_node(&out, &format!("/dev/nvidia{m}"))?;
    for cap in 10..14 {
        assert_null_node(&out, &format!("/dev/nvidia-caps/nvidia-cap{cap}"))?;
    }
    assert_line(&out, "VISIBLE=void")?;
    assert_line(&out, &format!("PIPE={}", cdi::MPS_PIPE_CONTAINER_DIR))?;
    assert_line(&out, "PIPE_CONTENT=mps pipe")?;
    assert_line(&out, "THREADS=40")?;
    // By the index each device has in the container (NVIDIA's device plugin v0.15.0 found
    // UUID-keyed limits not applied); the daemon's shm directory is the container's /dev/shm.
    assert_line(&out, "LIMITS=0=2048M,1=1024M")?;
    assert_line(&out, "SHM=shared with the daemon")?;
    Ok(())
}

#[test]
fn podman_runs_a_claim_prepared_by_the_daemon() {
    with_engine(|e| check_prepared_by_daemon(e, false));
}

/// As above for a share of the GPU (`--shared-capacity`, 24Gi and 33 of the 132 SMs of `gpu-0`):
/// the container also gets the share's MPS limits and the GPU's MPS pipe directory, in which it
/// sees the control socket of the daemon `nvdra mps-host` runs (the stand-in
/// `nvidia-cuda-mps-control`).
#[test]
fn podman_runs_a_share_prepared_by_the_daemon() {
    with_engine(|e| check_prepared_by_daemon(e, true));
}

/// The whole path a pod's GPU takes: `nvdra run` (simulated DGX H100, directory API, fake driver
/// root) prepares an allocated claim over its DRA socket, and podman runs a container with the
/// CDI id prepare returned, reading the spec prepare wrote. Unprepare then removes the spec. A
/// `share` is a consumable-capacity share of the GPU, served by the GPU's MPS daemon.
fn check_prepared_by_daemon(engine: &Engine, share: bool) -> Result<()> {
    use kubelet_plugin::proto::dra::v1;

    // Its own driver name, so that this daemon's orphan clean-up in a shared CDI directory never
    // touches the specs of the other tests.
    // A driver name of its own per test: podman 4.3 has no --cdi-spec-dir, so both tests write to
    // /var/run/cdi, and a daemon's start-up removes the specs of its driver it has no claim for.
    let driver = if share {
        "podman-share.nvdra.io"
    } else {
        "podman-test.nvdra.io"
    };
    const NODE: &str = "node-a";
    let claim_uid = format!("podman-{:016x}", rand::random::<u64>());

    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    // The GPU Operator's layout: the host sees the driver container's root at
    // `<tmp>/run/nvidia/driver`, nvdra reads it at `<tmp>/driver-root` (a link standing in for
    // its pod's mount). The spec must name host paths only.
    let driver_root = root.join("run/nvidia/driver");
    let ctr_path = root.join("driver-root");
    std::fs::create_dir_all(&driver_root)?;
    std::os::unix::fs::symlink(&driver_root, &ctr_path)?;
    let gpu = load_profile("dgx-h100", NODE)?.gpus[0].clone();
    mknod(&driver_root.join(format!("dev/nvidia{}", gpu.minor)))?;
    mknod(&driver_root.join("dev/nvidiactl"))?;
    mknod(&driver_root.join("dev/nvidia-uvm"))?;
    fake_graphics(&driver_root, &gpu)?;
    let lib = driver_root.join("usr/lib/x86_64-linux-gnu");
    std::fs::create_dir_all(&lib)?;
    std::fs::write(lib.join("libnvidia-ml.so.550.163.01"), "fake NVML\n")?;
    std::os::unix::fs::symlink("libnvidia-ml.so.550.163.01", lib.join("libnvidia-ml.so.1"))?;
    // A stand-in nvidia-cdi-hook that records which hook ran, of a toolkit with the fixes of
    // 1.17.8 (as NVIDIA's `--version` prints it), so that the spec carries all four hooks.
    let hook_log = root.join("hooks.log");
    let hook = driver_root.join("usr/bin/nvidia-cdi-hook");
    std::fs::create_dir_all(hook.parent().context("parent")?)?;
    std::fs::write(
        &hook,
        format!(
            "#!/bin/sh\nif [ \"$1\" = --version ]; then \
             printf 'NVIDIA CDI Hook version 1.19.1\\ncommit: 0000000\\n'; exit 0; fi\n\
             cat >/dev/null\necho \"$1\" >> {}\n",
            hook_log.display()
        ),
    )?;
    std::fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    let cdi_root = if engine.has_spec_dir_flag {
        root.join("cdi")
    } else {
        PathBuf::from(SYSTEM_CDI_DIR)
    };

    let device = format!("gpu-{}", gpu.minor);
    let result = if share {
        mps::install_standin(&driver_root);
        mps::share(
            "gpu",
            driver,
            NODE,
            &device,
            "5f0e0000-0000-4000-8000-000000000001",
            "24Gi",
            "33",
        )
    } else {
        nvdra::api::allocated_device("gpu", driver, NODE, &device)
    };
    let claim = nvdra::api::allocated_claim("default", "podman", &claim_uid, vec![result], vec![]);
    nvdra::api::dir::write_claim(&root.join("api"), &claim)?;

    let kubelet = root.join("kubelet");
    let mps_root = root.join("mps");
    let _host = share.then(|| {
        mps::Host::start(
            &mps_root,
            &driver_root,
            std::path::Path::new(nvdra::ledger::BOOT_ID_PATH),
            &[],
        )
    });
    let mut daemon = daemon::nvdra_run(root, "dra", NODE)
        .args(["--profile", "dgx-h100", "--driver-name", driver])
        .arg("--cdi-root")
        .arg(&cdi_root)
        .arg("--driver-root")
        .arg(&driver_root)
        .arg("--driver-root-ctr-path")
        .arg(&ctr_path)
        .args(share.then_some("--shared-capacity"))
        // The host's boot id, as the MPS host above reads it.
        .env("NVDRA_BOOT_ID_FILE", nvdra::ledger::BOOT_ID_PATH)
        .env("NVDRA_LOG", "warn")
        .spawn()
        .context("cannot start nvdra run")?;
    let pipe = mps::gpu_pipe_dir(&mps_root, gpu.uuid.as_str());
    let shm_dir = pipe.parent().unwrap().join("shm");
    let dra_socket = kubelet.join(format!("plugins/{driver}/dra.sock"));
    let spec_file = cdi_root.join(format!("k8s.{driver}-claim_{claim_uid}.yaml"));

    let result = (|| -> Result<()> {
        let rt = tokio::runtime::Runtime::new()?;
        let call = |prepare: bool| -> Result<(Vec<String>, String)> {
            rt.block_on(async {
                let channel = kubelet_plugin::socket::connect(&dra_socket).await?;
                let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
                let claims = vec![v1::Claim {
                    namespace: "default".into(),
                    uid: claim_uid.clone(),
                    name: "podman".into(),
                }];
                if prepare {
                    let mut r = client
                        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims })
                        .await?
                        .into_inner();
                    let entry = r
                        .claims
                        .remove(&claim_uid)
                        .context("no entry for the claim")?;
                    let ids = entry
                        .devices
                        .into_iter()
                        .flat_map(|d| d.cdi_device_ids)
                        .collect();
                    Ok((ids, entry.error))
                } else {
                    let mut r = client
                        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims })
                        .await?
                        .into_inner();
                    let entry = r
                        .claims
                        .remove(&claim_uid)
                        .context("no entry for the claim")?;
                    Ok((Vec::new(), entry.error))
                }
            })
        };
        // The DRA socket serves before registration; wait for it.
        let mut prepared = None;
        for _ in 0..300 {
            ensure!(daemon.try_wait()?.is_none(), "nvdra exited before serving");
            if dra_socket.exists()
                && let Ok(r) = call(true)
            {
                prepared = Some(r);
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let (ids, error) = prepared.context("nvdra did not serve its DRA socket within 30 s")?;
        ensure!(error.is_empty(), "prepare failed: {error}");
        ensure!(
            ids == vec![format!("k8s.{driver}/claim={claim_uid}-{device}")],
            "CDI ids {ids:?}"
        );
        let spec_text = std::fs::read_to_string(&spec_file)
            .with_context(|| format!("prepare wrote no spec at {}", spec_file.display()))?;
        ensure!(
            spec_text.contains(&format!(
                "{}/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.163.01",
                driver_root.display()
            )) && !spec_text.contains(&ctr_path.display().to_string()),
            "the spec does not name the driver's host paths only:\n{spec_text}"
        );

        let dir_arg = cdi_root.display().to_string();
        let global: Vec<&str> = if engine.has_spec_dir_flag {
            vec!["--cdi-spec-dir", &dir_arg]
        } else {
            vec![]
        };
        let mut script = format!(
            "ls -l /dev/nvidia{} /dev/nvidiactl; echo VISIBLE=$NVIDIA_VISIBLE_DEVICES; \
             {GRAPHICS_SCRIPT}",
            gpu.minor
        );
        if share {
            script.push_str(
                "; echo PIPE=$CUDA_MPS_PIPE_DIRECTORY; \
                 echo PIPE_FILES=$(ls $CUDA_MPS_PIPE_DIRECTORY); \
                 echo THREADS=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; \
                 echo LIMITS=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; \
                 echo SHM=$(stat -c %a /dev/shm)",
            );
        }
        let out = podman(
            &global,
            &[
                "run",
                "--rm",
                "--network",
                "none",
                "--device",
                &ids[0],
                IMAGE,
                "sh",
                "-c",
                &script,
            ],
        )?;
        let out = ok(&out, &format!("podman run --device {}", ids[0]))?;
        assert_null_node(&out, &format!("/dev/nvidia{}", gpu.minor))?;
        assert_null_node(&out, "/dev/nvidiactl")?;
        assert_line(&out, "VISIBLE=void")?;
        // The GPU Operator layout: graphics files and DRM nodes found under the driver root.
        assert_graphics(&out)?;
        if share {
            assert_line(&out, &format!("PIPE={}", cdi::MPS_PIPE_CONTAINER_DIR))?;
            // The control socket, and the server socket of the MPS server the start gate had
            // the daemon start for the container's user (root) before the container ran.
            assert_line(&out, "PIPE_FILES=control server-0")?;
            assert_line(&out, "THREADS=25")?;
            // Keyed by the index the container sees; 24Gi less its part of the MPS server's
            // reserve (24576 MiB × 79/80); 33 of 132 SMs.
            assert_line(&out, "LIMITS=0=24268M")?;
            // The GPU daemon's shm directory, usable by any client UID.
            assert_line(&out, "SHM=1777")?;
            ensure!(
                mps::log(&driver_root) == vec![format!("start {} {}", gpu.uuid, pipe.display())],
                "MPS daemon log {:?}",
                mps::log(&driver_root)
            );
        }
        let ran = std::fs::read_to_string(&hook_log).context("no hook ran")?;
        ensure!(
            ran.lines().collect::<Vec<_>>()
                == [
                    "create-symlinks",
                    "enable-cuda-compat",
                    "update-ldcache",
                    "disable-device-node-modification"
                ],
            "hooks that ran: {ran}"
        );
        if share {
            // An ordinary pod, as uid 1000: the daemon's control socket is one it may use, and
            // the shared /dev/shm one it may write, with the limit it needs in its environment.
            let out = podman(
                &global,
                &[
                    "run",
                    "--rm",
                    "--network",
                    "none",
                    "--user",
                    "1000:1000",
                    "--device",
                    &ids[0],
                    IMAGE,
                    "sh",
                    "-c",
                    "echo ID=$(id -u); \
                     [ -S $CUDA_MPS_PIPE_DIRECTORY/control ] && [ -w $CUDA_MPS_PIPE_DIRECTORY/control ] \
                       && echo CONTROL=usable; \
                     echo x > /dev/shm/client-1000 && echo SHM_WRITE=ok; \
                     echo LIMITS=$CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
                ],
            )?;
            let out = ok(&out, "podman run --user 1000:1000 (a share's container)")?;
            assert_line(&out, "ID=1000")?;
            assert_line(&out, "CONTROL=usable")?;
            assert_line(&out, "SHM_WRITE=ok")?;
            assert_line(&out, "LIMITS=0=24268M")?;
            ensure!(
                shm_dir.join("client-1000").is_file(),
                "the container's /dev/shm is not the daemon's {}",
                shm_dir.display()
            );
        }

        let (_, error) = call(false)?;
        ensure!(error.is_empty(), "unprepare failed: {error}");
        ensure!(
            !spec_file.exists(),
            "unprepare left {}",
            spec_file.display()
        );
        if share {
            // The host quits the released daemon and removes its directory.
            for _ in 0..500 {
                if !pipe.exists() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            ensure!(
                !pipe.exists() && mps::count(&driver_root, "quit") == 1,
                "the GPU's MPS daemon outlived its last share: {:?}",
                mps::log(&driver_root)
            );
        }
        Ok(())
    })();

    let _ = Command::new("kill")
        .args(["-TERM", &daemon.id().to_string()])
        .status();
    let status = daemon.wait()?;
    if spec_file.exists() {
        let _ = std::fs::remove_file(&spec_file);
    }
    result?;
    ensure!(
        status.success(),
        "nvdra run did not exit cleanly on SIGTERM: {status}"
    );
    Ok(())
}

/// The device-plugin path's per-node spec (`deviceplugin::cdi`), as the kubelet hands its CDI
/// names to the runtime under the `cdi-cri` strategy: the container gets the one GPU it names,
/// not its neighbours, and the driver's files.
fn check_device_plugin_spec(engine: &Engine) -> Result<()> {
    use nvdra::deviceplugin::{self, IdStrategy};
    let host = tempfile::tempdir()?;
    let root = host.path();
    let inv = load_profile("pcie-pairs", "n")?;
    for g in &inv.gpus {
        mknod(&root.join(format!("dev/nvidia{}", g.minor)))?;
    }
    mknod(&root.join("dev/nvidiactl"))?;
    mknod(&root.join("dev/nvidia-uvm"))?;
    let smi = root.join("usr/bin/nvidia-smi");
    std::fs::create_dir_all(smi.parent().context("parent")?)?;
    std::fs::write(&smi, "fake nvidia-smi for nvdra\n")?;

    let opts = deviceplugin::cdi::options("gpu.nvidia.com", &DriverRoot::at(root))?;
    let spec_dir = tempfile::tempdir()?;
    let cdi_root = if engine.has_spec_dir_flag {
        spec_dir.path().to_path_buf()
    } else {
        PathBuf::from(SYSTEM_CDI_DIR)
    };
    let _guard = SpecGuard {
        cdi_root: cdi_root.clone(),
        opts: opts.clone(),
        claim_uid: deviceplugin::cdi::spec_name(),
    };
    let path = deviceplugin::cdi::write(&cdi_root, &opts, &inv, IdStrategy::Uuid)?;

    let (chosen, other) = (&inv.gpus[1], &inv.gpus[0]);
    // What Allocate puts in `cdi_devices` for this GPU.
    let id = format!("{}/{}={}", opts.vendor, opts.class, chosen.uuid);
    let dir_arg = cdi_root.display().to_string();
    let global: Vec<&str> = if engine.has_spec_dir_flag {
        vec!["--cdi-spec-dir", &dir_arg]
    } else {
        vec![]
    };
    let script = format!(
        "ls -l /dev/nvidia{chosen} /dev/nvidiactl /dev/nvidia-uvm; \
         if [ -e /dev/nvidia{other} ]; then echo OTHER_PRESENT; else echo OTHER_ABSENT; fi; \
         echo SMI=$(cat /usr/bin/nvidia-smi)",
        chosen = chosen.minor,
        other = other.minor,
    );
    let out = podman(
        &global,
        &[
            "run",
            "--rm",
            "--network",
            "none",
            "--device",
            &id,
            IMAGE,
            "sh",
            "-c",
            &script,
        ],
    )?;
    let out = ok(&out, &format!("podman run --device {id}")).with_context(|| {
        format!(
            "the spec was:\n{}",
            std::fs::read_to_string(&path).unwrap_or_default()
        )
    })?;
    for node in [
        format!("/dev/nvidia{}", chosen.minor),
        "/dev/nvidiactl".into(),
        "/dev/nvidia-uvm".into(),
    ] {
        assert_null_node(&out, &node)?;
    }
    assert_line(&out, "OTHER_ABSENT")?;
    assert_line(&out, "SMI=fake nvidia-smi for nvdra")?;
    Ok(())
}
