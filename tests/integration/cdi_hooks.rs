//! NVIDIA's CDI hooks in nvdra's claim specs, and the driver root laid out both ways.
//!
//! A fake driver install (libraries of one driver version with their soname links, a stale
//! library of another version, vdpau, GSP firmware, the persistenced socket, binaries and a
//! stand-in `nvidia-cdi-hook`) is built in a temporary directory, once as a host install and
//! once as the GPU Operator lays it out (the host sees the driver container's root at
//! `/run/nvidia/driver`; nvdra reads it at another path). Then:
//!
//! - the claim spec's hooks are compared, hook by hook, with the form NVIDIA's DRA driver writes
//!   for the same devices (`nvidia_hooks` below says where that form comes from and which fields
//!   differ);
//! - podman runs the spec from the host side, with a stand-in hook that records its arguments,
//!   so that every hook is really invoked, with the right arguments, and the container sees the
//!   driver's files at their container paths.
//!
//! The podman part needs root, `podman`, `runc` and `busybox-static` (see `.ci/run`); without
//! them it says why and passes, unless `NVDRA_REQUIRE_PODMAN` is set.

use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, ensure};
use nvdra::cdi::{self, CdiOptions, DriverRoot, Hook, PreparedDevice};
use nvdra::inventory::topology::load_profile;
use nvdra::sharing::Sharing;

use crate::support::podman as engine;
use engine::*;

const VERSION: &str = "550.163.01";
const LIB: &str = "usr/lib/x86_64-linux-gnu";

/// The toolkit version the stand-in hooks report unless a test says otherwise: the one NVIDIA's
/// DRA driver vendors.
const TOOLKIT: &str = "1.19.1";

/// What NVIDIA's hook binary `name` prints for `--version` (urfave/cli's
/// `<name> version <version>` over `internal/info`'s version and commit lines).
fn version_output(name: &str, version: &str) -> String {
    let app = if name == "nvidia-ctk" {
        "NVIDIA Container Toolkit CLI"
    } else {
        "NVIDIA CDI Hook"
    };
    format!("{app} version {version}\ncommit: 54af66f4ac1e3a6f3d7c0c1bc3d34a5e5c6d4f12\n")
}

/// Lays out a driver install under `root`, as the installer (or the Operator's driver container)
/// leaves it. `hook`: the stand-in hook's path under `root` and the file its script appends to;
/// it reports toolkit [`TOOLKIT`].
fn driver_tree(root: &Path, hook: Option<(&str, &Path)>) -> Result<()> {
    let name = |rel: &str| rel.rsplit('/').next().unwrap_or(rel).to_string();
    let answer = hook.map(|(rel, _)| version_output(&name(rel), TOOLKIT));
    driver_tree_answering(root, hook, answer.as_deref())
}

/// [`driver_tree`], with a stand-in hook that prints `answer` for `--version` (and exits 0), or
/// records a `--version` call like any other when `answer` is `None`.
fn driver_tree_answering(
    root: &Path,
    hook: Option<(&str, &Path)>,
    answer: Option<&str>,
) -> Result<()> {
    let file = |rel: &str, text: &str| -> Result<()> {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().context("parent")?)?;
        std::fs::write(&path, text)?;
        Ok(())
    };
    let link = |target: &str, rel: &str| -> Result<()> {
        symlink(target, root.join(rel))?;
        Ok(())
    };
    for lib in [
        "libcuda",
        "libnvidia-ml",
        "libnvidia-ptxjitcompiler",
        "libnvidia-gpucomp",
        "vdpau/libvdpau_nvidia",
    ] {
        file(
            &format!("{LIB}/{lib}.so.{VERSION}"),
            &format!("fake {lib} {VERSION}\n"),
        )?;
    }
    // ldconfig's soname links, and the development links the installer makes.
    link(
        &format!("libcuda.so.{VERSION}"),
        &format!("{LIB}/libcuda.so.1"),
    )?;
    link("libcuda.so.1", &format!("{LIB}/libcuda.so"))?;
    link(
        &format!("libnvidia-ml.so.{VERSION}"),
        &format!("{LIB}/libnvidia-ml.so.1"),
    )?;
    link(
        &format!("libnvidia-ptxjitcompiler.so.{VERSION}"),
        &format!("{LIB}/libnvidia-ptxjitcompiler.so.1"),
    )?;
    // No soname link (its soname is the versioned name), only a development link.
    link(
        &format!("libnvidia-gpucomp.so.{VERSION}"),
        &format!("{LIB}/libnvidia-gpucomp.so"),
    )?;
    link(
        &format!("libvdpau_nvidia.so.{VERSION}"),
        &format!("{LIB}/vdpau/libvdpau_nvidia.so.1"),
    )?;
    // Not the driver's: another version's leftover and a CUDA runtime library.
    file(&format!("{LIB}/libnvidia-ml.so.535.104.05"), "stale\n")?;
    file(&format!("{LIB}/libcudart.so.12"), "runtime\n")?;
    file("usr/bin/nvidia-smi", "fake nvidia-smi\n")?;
    file("usr/bin/nvidia-cuda-mps-control", "fake mps control\n")?;
    file(
        &format!("lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"),
        "gsp\n",
    )?;
    let socket = root.join("run/nvidia-persistenced/socket");
    std::fs::create_dir_all(socket.parent().context("parent")?)?;
    std::os::unix::net::UnixListener::bind(&socket)?;
    if let Some((rel, log)) = hook {
        // Records its arguments (the first, the binary's name, is not visible to a script) and
        // its environment; the OCI state on stdin is read and dropped.
        let version = match answer {
            Some(text) => {
                format!("if [ \"$1\" = --version ]; then printf '%s' '{text}'; exit 0; fi\n")
            }
            None => String::new(),
        };
        let script = format!(
            "#!/bin/sh\n{version}cat >/dev/null\n{{ printf 'NVIDIA_CTK_DEBUG=%s' \
             \"$NVIDIA_CTK_DEBUG\"; for a in \"$@\"; do printf ' %s' \"$a\"; done; \
             printf '\\n'; }} >> {}\n",
            log.display()
        );
        file(rel, &script)?;
        std::fs::set_permissions(root.join(rel), std::fs::Permissions::from_mode(0o755))?;
    }
    Ok(())
}

/// The spec-wide hooks NVIDIA's DRA driver writes into a claim's spec for the tree above.
///
/// Restated from NVIDIA's source: k8s-dra-driver-gpu (`cmd/gpu-kubelet-plugin/cdi.go`) takes a
/// claim spec's spec-wide edits from nvcdi's `GetCommonEdits`, i.e. nvidia-container-toolkit
/// v1.19.0 as it vendors it: `pkg/nvcdi/driver-nvml.go` (`NewDriverLibraryDiscoverer`: the
/// symlink hook, then `enable-cuda-compat` with `--host-driver-version=<version>`, then
/// `update-ldcache` over the libraries' folders, then `disable-device-node-modification`),
/// `internal/discover/symlinks.go` (per library in lookup order: `libcuda.so` → `libcuda.so.1`,
/// the soname link if one exists beside it, the `.so` link if one exists; duplicates dropped),
/// `internal/discover/ldconfig.go` (unique library folders in mount order) and
/// `internal/discover/hooks.go` (every hook `createContainer`, args led by the binary's name
/// and `hook` for `nvidia-ctk`, env `NVIDIA_CTK_DEBUG=false`). The observed run
/// (`shared/reference/nvidia-dra-observed.md`) lists the same four hooks.
///
/// The one field that differs is the hook's `path`, a name each driver chooses: NVIDIA's DRA
/// driver copies its own `nvidia-cdi-hook` into its kubelet plugin directory (or takes
/// `--nvidia-cdi-hook-path`); nvdra names the binary installed under the driver root, as a host
/// path. So `path` is a parameter here; everything else is NVIDIA's.
fn nvidia_hooks(path: &str, binary: &str) -> Vec<Hook> {
    let dir = format!("/{LIB}");
    let hook = |args: Vec<String>| {
        let mut all = vec![binary.to_string()];
        if binary == "nvidia-ctk" {
            all.push("hook".into());
        }
        all.extend(args);
        Hook {
            hook_name: "createContainer".into(),
            path: path.into(),
            args: all,
            env: vec!["NVIDIA_CTK_DEBUG=false".into()],
        }
    };
    let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    vec![
        hook(args(&[
            "create-symlinks",
            "--link",
            &format!("libcuda.so.1::{dir}/libcuda.so"),
            "--link",
            &format!("libcuda.so.{VERSION}::{dir}/libcuda.so.1"),
            "--link",
            &format!("libnvidia-gpucomp.so.{VERSION}::{dir}/libnvidia-gpucomp.so"),
            "--link",
            &format!("libnvidia-ml.so.{VERSION}::{dir}/libnvidia-ml.so.1"),
            "--link",
            &format!("libnvidia-ptxjitcompiler.so.{VERSION}::{dir}/libnvidia-ptxjitcompiler.so.1"),
            "--link",
            &format!("libvdpau_nvidia.so.{VERSION}::{dir}/vdpau/libvdpau_nvidia.so.1"),
        ])),
        hook(args(&[
            "enable-cuda-compat",
            &format!("--host-driver-version={VERSION}"),
        ])),
        hook(args(&[
            "update-ldcache",
            "--folder",
            &dir,
            "--folder",
            &format!("{dir}/vdpau"),
        ])),
        hook(args(&["disable-device-node-modification"])),
    ]
}

fn gpu0() -> Result<PreparedDevice> {
    let gpu = load_profile("dgx-h100", "n")?.gpus[0].clone();
    Ok(PreparedDevice {
        name: format!("gpu-{}", gpu.minor),
        gpu,
        mig: None,
        sharing: Sharing::Exclusive,
        mps_pipe_dir: None,
        mps_shm_dir: None,
        memory_limits: None,
    })
}

fn spec_for(root: &DriverRoot) -> Result<(CdiOptions, cdi::Spec)> {
    let opts = CdiOptions::resolve("gpu.nvidia.com", root)?;
    let files = cdi::discover_driver_files(root);
    let spec = cdi::claim_spec(&opts, "claim-uid", &[gpu0()?], &files)?;
    Ok((opts, spec))
}

/// `(host path, container path, options)` of every mount of the spec.
fn mounts(spec: &cdi::Spec) -> Vec<(String, String, String)> {
    spec.container_edits
        .mounts
        .iter()
        .map(|m| {
            (
                m.host_path.clone(),
                m.container_path.clone(),
                m.options.join(","),
            )
        })
        .collect()
}

/// The mounts NVIDIA's spec has for the tree, with host paths under `host_root`: the versioned
/// libraries, firmware and binaries read-only, the socket with NVIDIA's IPC options.
fn expected_mounts(host_root: &Path) -> Vec<(String, String, String)> {
    let ro = "ro,nosuid,nodev,rbind,rprivate";
    let mut m: Vec<(String, String, String)> = [
        format!("lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"),
        "usr/bin/nvidia-cuda-mps-control".into(),
        "usr/bin/nvidia-smi".into(),
        format!("{LIB}/libcuda.so.{VERSION}"),
        format!("{LIB}/libnvidia-gpucomp.so.{VERSION}"),
        format!("{LIB}/libnvidia-ml.so.{VERSION}"),
        format!("{LIB}/libnvidia-ptxjitcompiler.so.{VERSION}"),
        format!("{LIB}/vdpau/libvdpau_nvidia.so.{VERSION}"),
    ]
    .into_iter()
    .map(|rel| {
        (
            host_root.join(&rel).display().to_string(),
            format!("/{rel}"),
            ro.to_string(),
        )
    })
    .collect();
    m.push((
        host_root
            .join("run/nvidia-persistenced/socket")
            .display()
            .to_string(),
        "/run/nvidia-persistenced/socket".into(),
        "nosuid,nodev,rbind,rprivate,noexec".into(),
    ));
    m.sort_by(|a, b| a.1.cmp(&b.1));
    m
}

#[test]
fn hooks_match_nvidias_form_on_a_host_install() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    driver_tree(root, Some(("usr/bin/nvidia-cdi-hook", &root.join("log"))))?;
    let (_, spec) = spec_for(&DriverRoot::at(root))?;
    let hook = root.join("usr/bin/nvidia-cdi-hook").display().to_string();
    assert_eq!(
        spec.container_edits.hooks,
        nvidia_hooks(&hook, "nvidia-cdi-hook")
    );
    // NVIDIA's per-device edits of a full GPU carry its device node and no hook.
    assert!(spec.devices[0].container_edits.hooks.is_empty());
    assert_eq!(mounts(&spec), expected_mounts(root));
    assert!(
        spec.container_edits
            .env
            .contains(&format!("NVIDIA_CTK_LIBCUDA_DIR=/{LIB}"))
    );
    Ok(())
}

/// The GPU Operator's layout: the host sees the driver at `/run/nvidia/driver` (here a path that
/// nvdra never reads), nvdra reads it where its pod mounts it. Every host path in the spec is
/// under the host root, every container path and hook argument is as on a host install.
#[test]
fn hooks_match_nvidias_form_in_the_operator_layout() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let ctr = tmp.path().join("driver-root");
    driver_tree(
        &ctr,
        Some(("usr/bin/nvidia-cdi-hook", &tmp.path().join("log"))),
    )?;
    let host = Path::new("/run/nvidia/driver");
    let root = DriverRoot::new(host.into(), ctr.clone(), PathBuf::from("/"));
    let (opts, spec) = spec_for(&root)?;
    assert_eq!(
        spec.container_edits.hooks,
        nvidia_hooks(
            "/run/nvidia/driver/usr/bin/nvidia-cdi-hook",
            "nvidia-cdi-hook"
        )
    );
    assert_eq!(mounts(&spec), expected_mounts(host));
    // The device root is the host's: its nodes are named under /dev.
    assert_eq!(opts.dev_root, Path::new("/dev"));
    let text = spec.to_yaml()?;
    assert!(!text.contains(&ctr.display().to_string()), "{text}");
    Ok(())
}

#[test]
fn nvidia_ctk_runs_the_hooks_under_its_hook_subcommand() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    // The GPU Operator's toolkit directory; no nvidia-cdi-hook anywhere.
    driver_tree(
        root,
        Some(("usr/local/nvidia/toolkit/nvidia-ctk", &root.join("log"))),
    )?;
    let (_, spec) = spec_for(&DriverRoot::at(root))?;
    let ctk = root
        .join("usr/local/nvidia/toolkit/nvidia-ctk")
        .display()
        .to_string();
    assert_eq!(spec.container_edits.hooks, nvidia_hooks(&ctk, "nvidia-ctk"));
    Ok(())
}

/// Without a hook binary the spec has no hook, and the soname links the hook would have made
/// are mounted (they resolve to the versioned files), so `libcuda.so.1` still opens.
#[test]
fn without_a_hook_binary_the_soname_links_are_mounted_instead() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let root = tmp.path();
    driver_tree(root, None)?;
    let (_, spec) = spec_for(&DriverRoot::at(root))?;
    assert!(spec.container_edits.hooks.is_empty());
    let mut expected = expected_mounts(root);
    for rel in [
        "libcuda.so.1",
        "libnvidia-ml.so.1",
        "libnvidia-ptxjitcompiler.so.1",
        "vdpau/libvdpau_nvidia.so.1",
    ] {
        let rel = format!("{LIB}/{rel}");
        expected.push((
            root.join(&rel).display().to_string(),
            format!("/{rel}"),
            "ro,nosuid,nodev,rbind,rprivate".into(),
        ));
    }
    expected.sort_by(|a, b| a.1.cmp(&b.1));
    assert_eq!(mounts(&spec), expected);
    Ok(())
}

/// NVIDIA's hooks that a spec carries for a hook binary of toolkit `version` (`None`: its
/// version unreadable): `enable-cuda-compat` and `update-ldcache` from 1.17.8 (CVE-2025-23266,
/// CVE-2025-23267), `disable-device-node-modification` from 1.18.0 (older binaries lack it),
/// `create-symlinks` always. Stated here by version, not asked of nvdra.
fn hooks_for(path: &str, binary: &str, version: Option<&str>) -> Vec<Hook> {
    let allowed: &[&str] = match version {
        Some("1.18.0" | "1.19.0" | "1.19.1") => &[
            "create-symlinks",
            "enable-cuda-compat",
            "update-ldcache",
            "disable-device-node-modification",
        ],
        Some("1.17.8" | "1.17.9") => &["create-symlinks", "enable-cuda-compat", "update-ldcache"],
        Some("1.17.7") | None => &["create-symlinks"],
        Some(other) => panic!("no expectation for toolkit {other}"),
    };
    nvidia_hooks(path, binary)
        .into_iter()
        .filter(|h| {
            let skip = if binary == "nvidia-ctk" { 2 } else { 1 };
            allowed.contains(&h.args[skip].as_str())
        })
        .collect()
}

/// The spec-wide hooks of the claim spec and of the device-plugin spec (one builder, two
/// callers) for the driver root `root`.
fn both_paths_hooks(root: &DriverRoot) -> Result<[Vec<Hook>; 2]> {
    let (_, claim) = spec_for(root)?;
    let opts = nvdra::deviceplugin::cdi::options("gpu.nvidia.com", root)?;
    let files = cdi::discover_driver_files(root);
    let inv = load_profile("dgx-h100", "n")?;
    let plugin =
        nvdra::deviceplugin::cdi::spec(&opts, &inv, nvdra::deviceplugin::IdStrategy::Uuid, &files)?;
    Ok([claim.container_edits.hooks, plugin.container_edits.hooks])
}

/// Stand-in hook binaries reporting versions on both sides of the fix: from 1.17.8 both specs
/// carry `enable-cuda-compat` and `update-ldcache`, below it neither does (nor
/// `disable-device-node-modification`, from 1.18.0), and the hooks that stay are NVIDIA's,
/// unchanged.
#[test]
fn both_specs_carry_the_guarded_hooks_only_from_toolkit_1_17_8() -> Result<()> {
    for (binary, rel) in [
        ("nvidia-cdi-hook", "usr/bin/nvidia-cdi-hook"),
        ("nvidia-ctk", "usr/local/nvidia/toolkit/nvidia-ctk"),
    ] {
        for version in ["1.17.7", "1.17.8", "1.17.9", "1.18.0", "1.19.0", "1.19.1"] {
            let tmp = tempfile::tempdir()?;
            let root = tmp.path();
            let answer = version_output(binary, version);
            driver_tree_answering(root, Some((rel, &root.join("log"))), Some(&answer))?;
            let path = root.join(rel).display().to_string();
            let expected = hooks_for(&path, binary, Some(version));
            let [claim, plugin] = both_paths_hooks(&DriverRoot::at(root))?;
            assert_eq!(claim, expected, "claim spec, {binary} {version}");
            assert_eq!(plugin, expected, "device-plugin spec, {binary} {version}");
            // `--version` was answered, not run as a hook.
            ensure!(
                !root.join("log").exists(),
                "{binary} {version} logged a hook"
            );
        }
    }
    Ok(())
}

/// A hook binary whose version nvdra cannot read is treated as below 1.17.8: one that prints
/// garbage, one built without a version, one that hangs (killed at the 5 s deadline), one that
/// floods its output (killed at 64 KiB), one that is not executable.
#[test]
fn an_unreadable_toolkit_version_counts_as_below_the_fix() -> Result<()> {
    let garbage = "nvidia-cdi-hook: unknown flag --version\n".to_string();
    let unknown = version_output("nvidia-cdi-hook", "unknown");
    for (what, prelude) in [
        ("garbage", format!("printf '%s' '{garbage}'; exit 0")),
        ("no version", format!("printf '%s' '{unknown}'; exit 0")),
        ("hung", "exec sleep 600".to_string()),
        (
            "flood",
            "exec yes 'NVIDIA CDI Hook version 1.19.1'".to_string(),
        ),
        ("not executable", String::new()),
    ] {
        let tmp = tempfile::tempdir()?;
        let root = tmp.path();
        driver_tree_answering(root, None, None)?;
        let hook = root.join("usr/bin/nvidia-cdi-hook");
        std::fs::write(
            &hook,
            format!("#!/bin/sh\nif [ \"$1\" = --version ]; then {prelude}; fi\nexit 0\n"),
        )?;
        let mode = if what == "not executable" {
            0o644
        } else {
            0o755
        };
        std::fs::set_permissions(&hook, std::fs::Permissions::from_mode(mode))?;
        let path = hook.display().to_string();
        let [claim, plugin] = both_paths_hooks(&DriverRoot::at(root))?;
        assert_eq!(claim, hooks_for(&path, "nvidia-cdi-hook", None), "{what}");
        assert_eq!(plugin, hooks_for(&path, "nvidia-cdi-hook", None), "{what}");
    }
    Ok(())
}

/// The GPU Operator (toolkit 1.17.x to 1.19.x) installs `nvidia-cdi-hook` in the host's
/// `/usr/local/nvidia/toolkit` as a `/bin/sh` wrapper that runs `nvidia-cdi-hook.real`; nvdra
/// (whose image has no shell) reads the version from the `.real` binary, and the spec names the
/// wrapper, as NVIDIA's specs on those nodes do.
#[test]
fn the_operators_wrapper_is_read_through_its_real_binary() -> Result<()> {
    for version in ["1.17.7", "1.17.8", "1.19.1"] {
        let tmp = tempfile::tempdir()?;
        let root = tmp.path();
        driver_tree_answering(root, None, None)?;
        let dir = root.join("usr/local/nvidia/toolkit");
        std::fs::create_dir_all(&dir)?;
        // NVIDIA's wrapper (cmd/nvidia-ctk-installer/toolkit/installer/executables.go), its
        // host paths absent here: run itself, it would fail.
        let wrapper = dir.join("nvidia-cdi-hook");
        std::fs::write(
            &wrapper,
            "#! /bin/sh\nPATH=/usr/local/nvidia/toolkit:$PATH \\\n\t\
             /usr/local/nvidia/toolkit/nvidia-cdi-hook.real \\\n\t\t\"$@\"\n",
        )?;
        let real = dir.join("nvidia-cdi-hook.real");
        std::fs::write(
            &real,
            format!(
                "#!/bin/sh\nprintf '%s' '{}'\n",
                version_output("nvidia-cdi-hook", version)
            ),
        )?;
        for f in [&wrapper, &real] {
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o755))?;
        }
        let path = wrapper.display().to_string();
        let expected = hooks_for(&path, "nvidia-cdi-hook", Some(version));
        let [claim, plugin] = both_paths_hooks(&DriverRoot::at(root))?;
        assert_eq!(claim, expected, "{version}");
        assert_eq!(plugin, expected, "{version}");
    }
    Ok(())
}

/// podman runs a spec written for toolkit 1.17.7: only `create-symlinks` runs.
#[test]
fn podman_runs_only_the_floors_hooks_below_1_17_8() {
    with_engine(|engine| {
        let tmp = tempfile::tempdir()?;
        let root = tmp.path().join("host");
        check_hooks_run_on(engine, &root, &DriverRoot::at(&root), tmp.path(), "1.17.7")
    });
}

#[test]
fn podman_runs_every_hook_on_a_host_install() {
    with_engine(|engine| {
        let tmp = tempfile::tempdir()?;
        let root = tmp.path().join("host");
        check_hooks_run(engine, &root, &DriverRoot::at(&root), tmp.path())
    });
}

/// The Operator's layout on the host side: the driver container's root at
/// `<tmp>/run/nvidia/driver`, which nvdra reads at `<tmp>/driver-root` (a link standing in for
/// its pod's mount), the device nodes under the driver root's `dev/`.
#[test]
fn podman_runs_every_hook_in_the_operator_layout() {
    with_engine(|engine| {
        let tmp = tempfile::tempdir()?;
        let host = tmp.path().join("run/nvidia/driver");
        let ctr = tmp.path().join("driver-root");
        std::fs::create_dir_all(&host)?;
        symlink(&host, &ctr)?;
        let root = DriverRoot::new(host.clone(), ctr.clone(), host.clone());
        check_hooks_run(engine, &host, &root, tmp.path())
    });
}

/// Builds the tree at `tree` (a host path), writes the claim spec for `root`, and runs a
/// container with it: every hook ran once, in NVIDIA's order, with NVIDIA's arguments, and the
/// container sees the GPU, the libraries, firmware, socket and binaries at their paths.
fn check_hooks_run(engine: &Engine, tree: &Path, root: &DriverRoot, tmp: &Path) -> Result<()> {
    check_hooks_run_on(engine, tree, root, tmp, TOOLKIT)
}

/// [`check_hooks_run`] with a hook binary of toolkit `toolkit`: only the hooks of
/// [`hooks_for`] run.
fn check_hooks_run_on(
    engine: &Engine,
    tree: &Path,
    root: &DriverRoot,
    tmp: &Path,
    toolkit: &str,
) -> Result<()> {
    let log = tmp.join("hook.log");
    let answer = version_output("nvidia-cdi-hook", toolkit);
    driver_tree_answering(tree, Some(("usr/bin/nvidia-cdi-hook", &log)), Some(&answer))?;
    let device = gpu0()?;
    let minor = device.gpu.minor;
    for node in [format!("dev/nvidia{minor}"), "dev/nvidiactl".into()] {
        mknod(&tree.join(node))?;
    }
    let opts = CdiOptions::resolve("gpu.nvidia.com", root)?;
    let files = cdi::discover_driver_files(root);
    let script = format!(
        "ls -l /dev/nvidia{minor} /dev/nvidiactl; \
         echo CUDA=$(cat /{LIB}/libcuda.so.{VERSION}); \
         echo VDPAU=$(cat /{LIB}/vdpau/libvdpau_nvidia.so.{VERSION}); \
         echo GSP=$(cat /lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin); \
         echo SMI=$(cat /usr/bin/nvidia-smi); \
         if test -S /run/nvidia-persistenced/socket; then echo SOCKET; fi; \
         if test -e /{LIB}/libnvidia-ml.so.535.104.05; then echo STALE; fi"
    );
    let out = run_claim(engine, &opts, &[device], &files, &script)?;
    assert_null_node(&out, &format!("/dev/nvidia{minor}"))?;
    assert_null_node(&out, "/dev/nvidiactl")?;
    assert_line(&out, "CUDA=fake libcuda 550.163.01")?;
    assert_line(&out, "VDPAU=fake vdpau/libvdpau_nvidia 550.163.01")?;
    assert_line(&out, "GSP=gsp")?;
    assert_line(&out, "SMI=fake nvidia-smi")?;
    assert_line(&out, "SOCKET")?;
    ensure!(
        !out.contains("STALE"),
        "another version's library was mounted:\n{out}"
    );

    let ran = std::fs::read_to_string(&log).context("the stand-in hook never ran")?;
    let hook_path = root
        .host()
        .join("usr/bin/nvidia-cdi-hook")
        .display()
        .to_string();
    let expected: Vec<String> = hooks_for(&hook_path, "nvidia-cdi-hook", Some(toolkit))
        .iter()
        .map(|h| format!("{} {}", h.env[0], h.args[1..].join(" ")))
        .collect();
    let ran: Vec<&str> = ran.lines().collect();
    ensure!(
        ran == expected,
        "the hooks that ran:\n{}\nexpected:\n{}",
        ran.join("\n"),
        expected.join("\n")
    );
    Ok(())
}
