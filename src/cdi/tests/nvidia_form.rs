//! nvdra's claim specs held to the form NVIDIA's DRA driver writes through nvcdi
//! (nvidia-container-toolkit, `pkg/nvcdi` and `internal/discover`), item by item, on one fake
//! host tree that has compute, graphics and display files. Each expected item names where
//! NVIDIA's code puts it.
//!
//! Fields that differ only in names nvdra chooses, and so are not compared:
//! - the CDI `kind` and device names: NVIDIA's DRA driver writes kind `k8s.gpu.nvidia.com/claim`
//!   and devices `<claimUID>-gpu-<minor>`; nvdra writes `k8s.<driver>/claim` and
//!   `<claimUID>-<published device name>`, because its driver name and device names are
//!   configurable (with the defaults they are the same);
//! - the hook binary's host path: wherever `nvidia-cdi-hook` is installed on the host.

use super::*;

const VERSION: &str = "550.163.01";
const LIB: &str = "usr/lib/x86_64-linux-gnu";

/// A driver installed as NVIDIA's packages lay it out, with graphics and display files, and the
/// GPUs' DRM nodes in sysfs and `/dev/dri`.
fn graphics_host(gpus: &[&Gpu]) -> Host {
    let host = Host::new();
    let lib = |name: &str, soname: Option<&str>| {
        host.file(&format!("{LIB}/{name}"));
        if let Some(s) = soname {
            symlink(name, host.root().join(LIB).join(s)).unwrap();
        }
    };
    lib(&format!("libcuda.so.{VERSION}"), Some("libcuda.so.1"));
    lib(
        &format!("libnvidia-ml.so.{VERSION}"),
        Some("libnvidia-ml.so.1"),
    );
    lib(
        &format!("libGLX_nvidia.so.{VERSION}"),
        Some("libGLX_nvidia.so.0"),
    );
    lib(
        &format!("libnvidia-opticalflow.so.{VERSION}"),
        Some("libnvidia-opticalflow.so.1"),
    );
    lib(
        &format!("libnvidia-allocator.so.{VERSION}"),
        Some("libnvidia-allocator.so.1"),
    );
    lib("libnvidia-egl-gbm.so.1.1.2", Some("libnvidia-egl-gbm.so.1"));
    lib("libnvidia-egl-wayland.so.1.1.17", None);
    host.file(&format!("{LIB}/nvidia/xorg/nvidia_drv.so"));
    host.file(&format!(
        "{LIB}/nvidia/xorg/libglxserver_nvidia.so.{VERSION}"
    ));
    host.file("usr/share/glvnd/egl_vendor.d/10_nvidia.json");
    host.file("usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json");
    host.file("usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json");
    host.file("etc/vulkan/icd.d/nvidia_icd.json");
    host.file("usr/share/vulkan/implicit_layer.d/nvidia_layers.json");
    host.file("usr/share/nvidia/nvoptix.bin");
    // Under /etc on this host; NVIDIA mounts it at /usr/share all the same.
    host.file("etc/X11/xorg.conf.d/10-nvidia.conf");
    host.file("usr/bin/nvidia-smi");
    host.hook("usr/bin/nvidia-cdi-hook", TOOLKIT);
    for n in [
        "nvidiactl",
        "nvidia-uvm",
        "nvidia-uvm-tools",
        "nvidia-modeset",
    ] {
        host.node(n);
    }
    for (i, g) in gpus.iter().enumerate() {
        host.node(&format!("nvidia{}", g.minor));
        let card = format!("card{}", i + 1);
        let render = format!("renderD{}", 128 + i);
        for n in [&card, &render] {
            fs::create_dir_all(
                host.root()
                    .join("sys/bus/pci/devices")
                    .join(&g.pci_bus_id.0)
                    .join("drm")
                    .join(n),
            )
            .unwrap();
            host.node(&format!("dri/{n}"));
        }
        let by_path = host.root().join("dev/dri/by-path");
        fs::create_dir_all(&by_path).unwrap();
        let bus = &g.pci_bus_id.0;
        symlink(
            format!("../{card}"),
            by_path.join(format!("pci-{bus}-card")),
        )
        .unwrap();
        symlink(
            format!("../{render}"),
            by_path.join(format!("pci-{bus}-render")),
        )
        .unwrap();
    }
    // The sysfs root follows the device root: re-resolve now that `sys/` exists.
    let opts = CdiOptions::resolve("gpu.nvidia.com", &host.opts.root).unwrap();
    Host { opts, ..host }
}

fn at(host: &Host, rel: &str) -> String {
    host.root().join(rel).display().to_string()
}

fn node_paths(nodes: &[DeviceNode]) -> Vec<(&str, Option<&str>)> {
    nodes
        .iter()
        .map(|n| (n.path.as_str(), n.host_path.as_deref()))
        .collect()
}

fn hook_args(spec: &Spec) -> Vec<Vec<String>> {
    spec.container_edits
        .hooks
        .iter()
        .map(|h| h.args.clone())
        .collect()
}

/// A GPU device's own hook (dgpu `byPathHookDiscoverer`): the by-path links of its DRM nodes.
fn by_path_hook(gpu: &Gpu, card: &str, render: &str) -> Vec<Vec<String>> {
    let bus = &gpu.pci_bus_id.0;
    vec![vec![
        "nvidia-cdi-hook".to_string(),
        "create-symlinks".into(),
        "--link".into(),
        format!("../{card}::/dev/dri/by-path/pci-{bus}-card"),
        "--link".into(),
        format!("../{render}::/dev/dri/by-path/pci-{bus}-render"),
    ]]
}

fn device_hooks(d: &Device) -> Vec<Vec<String>> {
    d.container_edits
        .hooks
        .iter()
        .map(|h| h.args.clone())
        .collect()
}

/// The spec-wide edits NVIDIA writes for any claim on this host.
fn assert_common_edits_are_nvidias(host: &Host, spec: &Spec) {
    let common = &spec.container_edits;
    let lib = |n: &str| format!("/{LIB}/{n}");
    // Env: `NVIDIA_VISIBLE_DEVICES=void` (the DRA driver's `GetCommonEdits`, see
    // reference/nvidia-dra-observed.md), `NVIDIA_CTK_LIBCUDA_DIR` (nvcdi
    // `NewDriverLibraryDiscoverer`).
    assert_eq!(
        common.env,
        vec![
            "NVIDIA_VISIBLE_DEVICES=void".to_string(),
            format!("NVIDIA_CTK_LIBCUDA_DIR=/{LIB}"),
        ]
    );
    // Control nodes: nvcdi `controlDeviceNodeDiscoverer` (those present; nvdra's order).
    assert_eq!(
        node_paths(&common.device_nodes),
        vec![
            ("/dev/nvidiactl", Some(at(host, "dev/nvidiactl").as_str())),
            ("/dev/nvidia-uvm", Some(at(host, "dev/nvidia-uvm").as_str())),
            (
                "/dev/nvidia-uvm-tools",
                Some(at(host, "dev/nvidia-uvm-tools").as_str())
            ),
            (
                "/dev/nvidia-modeset",
                Some(at(host, "dev/nvidia-modeset").as_str())
            ),
        ]
    );
    // Mounts, sorted by container path as nvcdi's sorter leaves them.
    let mut expected: Vec<(String, String)> = vec![
        // Graphics configs (graphics.go `newGraphicsConfigsDiscoverer`): at /usr/share whatever
        // directory the host has them in.
        (
            "/usr/share/glvnd/egl_vendor.d/10_nvidia.json".into(),
            at(host, "usr/share/glvnd/egl_vendor.d/10_nvidia.json"),
        ),
        (
            "/usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json".into(),
            at(
                host,
                "usr/share/egl/egl_external_platform.d/15_nvidia_gbm.json",
            ),
        ),
        (
            "/usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json".into(),
            at(
                host,
                "usr/share/egl/egl_external_platform.d/10_nvidia_wayland.json",
            ),
        ),
        (
            "/usr/share/nvidia/nvoptix.bin".into(),
            at(host, "usr/share/nvidia/nvoptix.bin"),
        ),
        (
            "/usr/share/X11/xorg.conf.d/10-nvidia.conf".into(),
            at(host, "etc/X11/xorg.conf.d/10-nvidia.conf"),
        ),
        // Vulkan (graphics.go `newVulkanConfigsDiscover`): at /etc.
        (
            "/etc/vulkan/icd.d/nvidia_icd.json".into(),
            at(host, "etc/vulkan/icd.d/nvidia_icd.json"),
        ),
        (
            "/etc/vulkan/implicit_layer.d/nvidia_layers.json".into(),
            at(host, "usr/share/vulkan/implicit_layer.d/nvidia_layers.json"),
        ),
        // EGL platform libraries and X modules (graphics.go `newGraphicsLibrariesDiscoverer`),
        // at their host paths.
        (
            lib("libnvidia-egl-gbm.so.1.1.2"),
            at(host, &format!("{LIB}/libnvidia-egl-gbm.so.1.1.2")),
        ),
        (
            lib("libnvidia-egl-wayland.so.1.1.17"),
            at(host, &format!("{LIB}/libnvidia-egl-wayland.so.1.1.17")),
        ),
        (
            lib("nvidia/xorg/nvidia_drv.so"),
            at(host, &format!("{LIB}/nvidia/xorg/nvidia_drv.so")),
        ),
        (
            lib(&format!("nvidia/xorg/libglxserver_nvidia.so.{VERSION}")),
            at(
                host,
                &format!("{LIB}/nvidia/xorg/libglxserver_nvidia.so.{VERSION}"),
            ),
        ),
        // Binaries (nvcdi `newDriverBinariesDiscoverer`).
        ("/usr/bin/nvidia-smi".into(), at(host, "usr/bin/nvidia-smi")),
    ];
    // Driver libraries, every `*.so.<version>` beside libcuda (nvcdi
    // `getVersionSuffixDriverLibraryMounts`).
    for name in [
        "libGLX_nvidia",
        "libcuda",
        "libnvidia-allocator",
        "libnvidia-ml",
        "libnvidia-opticalflow",
    ] {
        let file = format!("{name}.so.{VERSION}");
        expected.push((lib(&file), at(host, &format!("{LIB}/{file}"))));
    }
    expected.sort();
    let mounts: Vec<(String, String)> = common
        .mounts
        .iter()
        .map(|m| (m.container_path.clone(), m.host_path.clone()))
        .collect();
    assert_eq!(mounts, expected);
    assert!(
        common
            .mounts
            .iter()
            .all(|m| m.options == READ_ONLY_MOUNT.map(String::from)),
        "every file here is mounted read-only, as nvcdi's mounts are"
    );
    // Hooks (nvcdi `newCommonNVMLDiscoverer`: graphics before driver files).
    let link =
        |target: &str, name: &str| vec!["--link".to_string(), format!("{target}::{}", lib(name))];
    let mut graphics = vec!["nvidia-cdi-hook".to_string(), "create-symlinks".into()];
    // graphics.go `graphicsDriverLibraries.Hooks`: the GBM backend and the X GLX server links.
    graphics.extend(link("../libnvidia-allocator.so.1", "gbm/nvidia-drm_gbm.so"));
    graphics.extend(link(
        &format!("libglxserver_nvidia.so.{VERSION}"),
        "nvidia/xorg/libglxserver_nvidia.so",
    ));
    let mut driver = vec!["nvidia-cdi-hook".to_string(), "create-symlinks".into()];
    // symlinks.go `getLinksForMount` then `getDotSoSymlinks`, per library in mount order.
    driver.extend(link(
        &format!("libGLX_nvidia.so.{VERSION}"),
        "libGLX_indirect.so.0",
    ));
    driver.extend(link(
        &format!("libGLX_nvidia.so.{VERSION}"),
        "libGLX_nvidia.so.0",
    ));
    driver.extend(link("libcuda.so.1", "libcuda.so"));
    driver.extend(link(&format!("libcuda.so.{VERSION}"), "libcuda.so.1"));
    driver.extend(link(
        &format!("libnvidia-allocator.so.{VERSION}"),
        "libnvidia-allocator.so.1",
    ));
    driver.extend(link(
        &format!("libnvidia-ml.so.{VERSION}"),
        "libnvidia-ml.so.1",
    ));
    driver.extend(link(
        "libnvidia-opticalflow.so.1",
        "libnvidia-opticalflow.so",
    ));
    driver.extend(link(
        &format!("libnvidia-opticalflow.so.{VERSION}"),
        "libnvidia-opticalflow.so.1",
    ));
    assert_eq!(
        hook_args(spec),
        vec![
            graphics,
            driver,
            // nvcdi `NewCUDACompatHookDiscoverer`, `NewLDCacheUpdateHook`, then
            // `DisableDeviceNodeModificationHook`.
            vec![
                "nvidia-cdi-hook".to_string(),
                "enable-cuda-compat".into(),
                format!("--host-driver-version={VERSION}"),
            ],
            vec![
                "nvidia-cdi-hook".to_string(),
                "update-ldcache".into(),
                "--folder".into(),
                format!("/{LIB}"),
            ],
            vec![
                "nvidia-cdi-hook".to_string(),
                "disable-device-node-modification".into(),
            ],
        ]
    );
}

/// (a) A whole GPU: its node and its DRM card and render nodes (dgpu `newNvmlDGPUDiscoverer`:
/// `/dev/nvidia<minor>` then `drm.GetDeviceNodesByBusID`), the common edits above.
#[test]
fn a_whole_gpu_spec_is_nvidias() {
    let dev = gpu_device(0, Sharing::Exclusive);
    let host = graphics_host(&[&dev.gpu]);
    let files = discover_driver_files(&host.opts.root);
    let spec = claim_spec(&host.opts, UID, std::slice::from_ref(&dev), &files).unwrap();
    assert_eq!(spec.cdi_version, "0.5.0");
    assert_eq!(spec.devices.len(), 1);
    let m = dev.gpu.minor;
    assert_eq!(
        node_paths(&spec.devices[0].container_edits.device_nodes),
        vec![
            (
                format!("/dev/nvidia{m}").as_str(),
                Some(at(&host, &format!("dev/nvidia{m}")).as_str())
            ),
            ("/dev/dri/card1", Some(at(&host, "dev/dri/card1").as_str())),
            (
                "/dev/dri/renderD128",
                Some(at(&host, "dev/dri/renderD128").as_str())
            ),
        ]
    );
    assert_eq!(
        device_hooks(&spec.devices[0]),
        by_path_hook(&dev.gpu, "card1", "renderD128")
    );
    assert_common_edits_are_nvidias(&host, &spec);
}

/// (b) A claim of two GPUs in two requests, seen from a container that uses one request: the
/// runtime applies that device's edits and the spec-wide ones. Nothing of the other GPU may be
/// among them — not its nodes, not its UUID in the env (NVIDIA's `void`).
#[test]
fn a_container_using_one_request_of_two_gets_only_its_gpu() {
    let a = gpu_device(0, Sharing::Exclusive);
    let b = gpu_device(1, Sharing::Exclusive);
    let host = graphics_host(&[&a.gpu, &b.gpu]);
    let files = discover_driver_files(&host.opts.root);
    let spec = claim_spec(&host.opts, UID, &[a.clone(), b.clone()], &files).unwrap();
    let first = &spec.devices[0].container_edits;
    let (ma, mb) = (a.gpu.minor, b.gpu.minor);
    assert_eq!(
        node_paths(&first.device_nodes),
        vec![
            (
                format!("/dev/nvidia{ma}").as_str(),
                Some(at(&host, &format!("dev/nvidia{ma}")).as_str())
            ),
            ("/dev/dri/card1", Some(at(&host, "dev/dri/card1").as_str())),
            (
                "/dev/dri/renderD128",
                Some(at(&host, "dev/dri/renderD128").as_str())
            ),
        ]
    );
    assert_eq!(
        node_paths(&spec.devices[1].container_edits.device_nodes),
        vec![
            (
                format!("/dev/nvidia{mb}").as_str(),
                Some(at(&host, &format!("dev/nvidia{mb}")).as_str())
            ),
            ("/dev/dri/card2", Some(at(&host, "dev/dri/card2").as_str())),
            (
                "/dev/dri/renderD129",
                Some(at(&host, "dev/dri/renderD129").as_str())
            ),
        ]
    );
    assert_eq!(
        device_hooks(&spec.devices[0]),
        by_path_hook(&a.gpu, "card1", "renderD128")
    );
    assert_eq!(
        device_hooks(&spec.devices[1]),
        by_path_hook(&b.gpu, "card2", "renderD129")
    );
    let seen = format!("{first:?}{:?}", spec.container_edits);
    for other in [
        b.gpu.uuid.as_str(),
        &format!("/dev/nvidia{mb}\""),
        "card2",
        "renderD129",
        b.gpu.pci_bus_id.0.as_str(),
    ] {
        assert!(
            !seen.contains(other),
            "{other} leaks into request a: {seen}"
        );
    }
    assert_common_edits_are_nvidias(&host, &spec);
}

/// (c) A MIG device, as NVIDIA's DRA driver builds it (`CreateClaimSpecFile`: the parent's
/// device spec from nvcdi, so the parent's node and DRM nodes, then `GetDevNodesForMigDevice`):
/// the GPU- and compute-instance access nodes, described by number — the `nvidia-caps` major
/// from `/proc/devices`, minor and mode from `/proc/driver/nvidia/capabilities/gpu<N>/mig/
/// gi<G>[/ci<C>]/access` — with no host path (the runtime creates them), on a fake procfs.
/// The same common edits.
#[test]
fn a_mig_device_spec_is_nvidias() {
    let dev = mig_device(1);
    let mig = dev.mig.clone().unwrap();
    let host = graphics_host(&[&dev.gpu]);
    let p = dev.gpu.minor;
    let proc = host.root().join("proc");
    let gi = proc.join(format!(
        "driver/nvidia/capabilities/gpu{p}/mig/gi{}",
        mig.gi_id
    ));
    let ci = gi.join(format!("ci{}", mig.ci_id));
    fs::create_dir_all(&ci).unwrap();
    fs::write(
        gi.join("access"),
        "DeviceFileMinor: 30\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
    )
    .unwrap();
    fs::write(
        ci.join("access"),
        "DeviceFileMinor: 31\nDeviceFileMode: 292\nDeviceFileModify: 1\n",
    )
    .unwrap();
    fs::write(
        proc.join("devices"),
        "Character devices:\n  1 mem\n195 nvidia\n237 nvidia-caps-imex-channels\n238 nvidia-caps\n",
    )
    .unwrap();
    // The proc root follows the device root: re-resolve now that it has the driver's entries.
    let opts = CdiOptions::resolve("gpu.nvidia.com", &host.opts.root).unwrap();
    assert_eq!(opts.proc_root, proc);
    let files = discover_driver_files(&opts.root);
    let spec = claim_spec(&opts, UID, std::slice::from_ref(&dev), &files).unwrap();
    let nodes = &spec.devices[0].container_edits.device_nodes;
    assert_eq!(
        node_paths(&nodes[..3]),
        vec![
            (
                format!("/dev/nvidia{p}").as_str(),
                Some(at(&host, &format!("dev/nvidia{p}")).as_str())
            ),
            ("/dev/dri/card1", Some(at(&host, "dev/dri/card1").as_str())),
            (
                "/dev/dri/renderD128",
                Some(at(&host, "dev/dri/renderD128").as_str())
            ),
        ]
    );
    let cap = |minor: i64| DeviceNode {
        path: format!("/dev/nvidia-caps/nvidia-cap{minor}"),
        host_path: None,
        node_type: Some("c".into()),
        major: Some(238),
        minor: Some(minor),
        file_mode: Some(0o444),
        permissions: None,
    };
    assert_eq!(nodes[3..], [cap(30), cap(31)]);
    assert_eq!(
        device_hooks(&spec.devices[0]),
        by_path_hook(&dev.gpu, "card1", "renderD128")
    );
    assert_common_edits_are_nvidias(&host, &spec);
}

/// A host without graphics files gets no graphics mounts, links or DRM nodes.
#[test]
fn nothing_graphical_is_added_when_absent() {
    let host = Host::new();
    host.node("nvidia0");
    host.file(&format!("{LIB}/libcuda.so.{VERSION}"));
    host.hook("usr/bin/nvidia-cdi-hook", TOOLKIT);
    let files = discover_driver_files(&host.opts.root);
    assert_eq!(files.graphics, vec![]);
    assert_eq!(files.graphics_symlinks, vec![]);
    let spec = claim_spec(
        &host.opts,
        UID,
        &[gpu_device(0, Sharing::Exclusive)],
        &files,
    )
    .unwrap();
    assert_eq!(spec.devices[0].container_edits.device_nodes.len(), 1);
    assert_eq!(spec.devices[0].container_edits.hooks, vec![]);
    let creates = hook_args(&spec)
        .iter()
        .filter(|a| a[1] == "create-symlinks")
        .count();
    assert_eq!(creates, 1, "only the driver's links");
}

/// GPU Operator layout: the driver root is `/run/nvidia/driver` on the host and read elsewhere;
/// graphics files are found at the read path and named by their host path.
#[test]
fn graphics_files_are_named_by_host_path_in_the_operator_layout() {
    let host = graphics_host(&[]);
    let operator = DriverRoot::new(
        "/run/nvidia/driver".into(),
        host.root().to_path_buf(),
        "/run/nvidia/driver".into(),
    );
    let files = discover_driver_files(&operator);
    let icd = files
        .graphics
        .iter()
        .find(|g| g.container == "/etc/vulkan/icd.d/nvidia_icd.json")
        .expect("the Vulkan ICD is found");
    assert_eq!(
        icd.host,
        Path::new("/run/nvidia/driver/etc/vulkan/icd.d/nvidia_icd.json")
    );
    let drv = files
        .graphics
        .iter()
        .find(|g| g.container.ends_with("/nvidia_drv.so"))
        .expect("the X driver is found");
    assert_eq!(
        drv.host,
        Path::new("/run/nvidia/driver")
            .join(LIB)
            .join("nvidia/xorg/nvidia_drv.so")
    );
    assert_eq!(files.graphics.len(), 11);
}
