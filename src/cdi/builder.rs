//! The CDI spec builder: one claim's prepared devices into a [`Spec`], reading (never writing) the
//! host.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use super::inputs::host_node;
use super::memlimit::{Enforcement, GpuLimit};
use super::spec::validate_claim_uid;
use super::{
    CDI_VERSION, CONTROL_NODES, CdiOptions, ContainerEdits, Device, DeviceNode, DriverFiles, Error,
    Hook, IPC_MOUNT, MPS_PIPE_CONTAINER_DIR, MPS_SHM_CONTAINER_DIR, Mount, NVIDIA_MAJOR,
    PreparedDevice, READ_ONLY_MOUNT, Result, Spec, VISIBLE_DEVICES_VOID, validate_class,
    validate_device_name, validate_vendor,
};
use crate::inventory::{Gpu, MigDevice};
use crate::sharing::{MpsSettings, Sharing};

/// `<vendor>/<class>=<claimUID>-<device>`, the id the kubelet passes to the runtime.
pub fn device_id(opts: &CdiOptions, claim_uid: &str, device: &str) -> String {
    format!(
        "{}/{}={}",
        opts.vendor,
        opts.class,
        device_name(claim_uid, device)
    )
}

pub(super) fn device_name(claim_uid: &str, device: &str) -> String {
    format!("{claim_uid}-{device}")
}

/// Builds the CDI spec of one prepared claim (see the module docs for what goes where).
///
/// Reads the host (device nodes under `dev_root`, the MIG capability table): blocking, so async
/// callers run it with `spawn_blocking`, like [`write_spec`](super::write_spec).
pub fn claim_spec(
    opts: &CdiOptions,
    claim_uid: &str,
    devices: &[PreparedDevice],
    driver_files: &DriverFiles,
) -> Result<Spec> {
    validate_vendor(&opts.vendor)?;
    validate_class(&opts.class)?;
    validate_claim_uid(claim_uid)?;
    if devices.is_empty() {
        return Err(Error::NoDevices {
            claim_uid: claim_uid.to_string(),
        });
    }

    let mut mig_minors: Option<Option<BTreeMap<String, u32>>> = None;
    let mut seen = BTreeSet::new();
    let mut cdi_devices = Vec::with_capacity(devices.len());
    for device in devices {
        let name = device_name(claim_uid, &device.name);
        validate_device_name(&name)?;
        if !seen.insert(name.clone()) {
            return Err(Error::DuplicateDevice {
                claim_uid: claim_uid.to_string(),
                device: device.name.clone(),
            });
        }
        // A MIG device gets its parent's nodes, DRM ones included, as NVIDIA's DRA driver
        // builds it (the parent's device spec plus the capability nodes).
        let mut nodes = vec![gpu_node(opts, &device.gpu)];
        let drm = drm_nodes(opts, &device.gpu);
        let hooks: Vec<_> =
            device_links_hook(driver_files, &drm_by_path_links(opts, &device.gpu, &drm))
                .into_iter()
                .collect();
        nodes.extend(drm);
        if let Some(mig) = &device.mig {
            let table = mig_minors
                .get_or_insert_with(|| read_mig_minors(&opts.root.read_path(opts.root.host())));
            nodes.extend(mig_cap_nodes(
                opts,
                table.as_ref(),
                &device.gpu,
                mig,
                &device.name,
            ));
        }
        cdi_devices.push(Device {
            name,
            container_edits: ContainerEdits {
                device_nodes: nodes,
                hooks,
                ..Default::default()
            },
        });
    }

    let mut common = ContainerEdits::default();
    common.env.push(VISIBLE_DEVICES_VOID.into());
    common.device_nodes = CONTROL_NODES
        .iter()
        .filter_map(|n| host_node(opts, &opts.dev_root.join(n), &format!("/dev/{n}")))
        .collect();
    driver_file_edits(opts, driver_files, &mut common);
    mps_edits(opts, claim_uid, devices, &mut common)?;

    Ok(Spec {
        cdi_version: CDI_VERSION.into(),
        kind: opts.kind(),
        devices: cdi_devices,
        container_edits: common,
    })
}

/// The GPU's `/dev/nvidia<minor>`. Taken from the host node when it exists; otherwise (simulated
/// GPUs, or a node the driver has not created yet) described by the driver's fixed major and the
/// GPU's minor, so the runtime creates it in the container without a host node.
pub(super) fn gpu_node(opts: &CdiOptions, gpu: &Gpu) -> DeviceNode {
    let path = format!("/dev/nvidia{}", gpu.minor);
    let host = opts.dev_root.join(format!("nvidia{}", gpu.minor));
    host_node(opts, &host, &path).unwrap_or_else(|| {
        tracing::warn!(
            gpu.uuid = %gpu.uuid,
            host_path = %host.display(),
            "GPU device node not found; the container gets a node {NVIDIA_MAJOR}:{} created by the runtime",
            gpu.minor
        );
        DeviceNode {
            path,
            host_path: None,
            node_type: Some("c".into()),
            major: Some(NVIDIA_MAJOR),
            minor: Some(i64::from(gpu.minor)),
            file_mode: Some(0o666),
            permissions: Some("rwm".into()),
        }
    })
}

/// `<driver_root>/proc/driver/nvidia-caps/mig-minors`: lines `gpu0/gi1/access 12`, `config 1`, ….
pub(super) fn read_mig_minors(driver_root: &Path) -> Option<BTreeMap<String, u32>> {
    let path = driver_root.join("proc/driver/nvidia-caps/mig-minors");
    match fs::read_to_string(&path) {
        Ok(text) => Some(parse_mig_minors(&text)),
        Err(e) => {
            tracing::warn!(
                path = %path.display(),
                error = %e,
                "cannot read the MIG capability table; MIG devices get no capability nodes"
            );
            None
        }
    }
}

pub(super) fn parse_mig_minors(text: &str) -> BTreeMap<String, u32> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.split_whitespace();
            let key = parts.next()?;
            let minor = parts.next()?.parse().ok()?;
            Some((key.to_string(), minor))
        })
        .collect()
}

/// The GPU-instance and compute-instance access nodes of a MIG device that exist on the host.
pub(super) fn mig_cap_nodes(
    opts: &CdiOptions,
    table: Option<&BTreeMap<String, u32>>,
    parent: &Gpu,
    mig: &MigDevice,
    device: &str,
) -> Vec<DeviceNode> {
    let gi = format!("gpu{}/gi{}/access", parent.minor, mig.gi_id);
    let ci = format!("gpu{}/gi{}/ci{}/access", parent.minor, mig.gi_id, mig.ci_id);
    let from_proc: Option<Vec<DeviceNode>> = [&gi, &ci]
        .iter()
        .map(|key| cap_node_from_proc(&opts.proc_root, key))
        .collect();
    if let Some(nodes) = from_proc {
        return nodes;
    }
    let Some(table) = table else {
        return Vec::new();
    };
    let mut nodes = Vec::new();
    for key in [gi, ci] {
        let Some(n) = table.get(&key) else {
            tracing::warn!(device, capability = %key, "MIG capability missing from mig-minors; skipped");
            continue;
        };
        let host = opts.dev_root.join(format!("nvidia-caps/nvidia-cap{n}"));
        match host_node(opts, &host, &format!("/dev/nvidia-caps/nvidia-cap{n}")) {
            Some(node) => nodes.push(node),
            None => tracing::warn!(
                device,
                host_path = %host.display(),
                "MIG capability device node not found; skipped"
            ),
        }
    }
    nodes
}

/// The capability node of `key` (`gpu<N>/gi<G>[/ci<C>]/access`) as NVIDIA's DRA driver writes
/// it: described by number, for the runtime to create, with the minor and mode of
/// `<proc>/driver/nvidia/capabilities/gpu<N>/mig/gi<G>[/ci<C>]/access` (`DeviceFileMinor`,
/// `DeviceFileMode`) and the `nvidia-caps` major of `<proc>/devices`. `None` when either is
/// unreadable; the caller then looks the node up on the host through `mig-minors`.
pub(super) fn cap_node_from_proc(proc_root: &Path, key: &str) -> Option<DeviceNode> {
    let (gpu, rest) = key.split_once('/')?;
    let file = proc_root
        .join("driver/nvidia/capabilities")
        .join(gpu)
        .join("mig")
        .join(rest);
    let text = fs::read_to_string(&file).ok()?;
    let field = |name: &str| -> Option<u32> {
        text.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == name).then(|| v.trim().parse().ok())?
        })
    };
    let minor = field("DeviceFileMinor")?;
    let mode = field("DeviceFileMode")?;
    let devices = fs::read_to_string(proc_root.join("devices")).ok()?;
    let major = devices.lines().find_map(|l| {
        let mut parts = l.split_whitespace();
        let major = parts.next()?;
        (parts.next()? == "nvidia-caps" && parts.next().is_none())
            .then(|| major.parse::<i64>().ok())?
    })?;
    Some(DeviceNode {
        path: format!("/dev/nvidia-caps/nvidia-cap{minor}"),
        host_path: None,
        node_type: Some("c".into()),
        major: Some(major),
        minor: Some(i64::from(minor)),
        file_mode: Some(mode),
        permissions: None,
    })
}

/// The DRM device nodes of `gpu` that exist on the host (`/dev/dri/card<N>`, `renderD<N>`), found
/// as NVIDIA's toolkit finds them (`internal/discover/graphics.go`): the entries of the GPU's
/// `drm/` directory in sysfs (`<sysfs>/bus/pci/devices/<PCI bus ID>/drm/`), by PCI bus ID, in name
/// order, that exist as device nodes; a per-device `create-symlinks` hook makes their
/// `/dev/dri/by-path` links ([`drm_by_path_links`]).
pub(super) fn drm_nodes(opts: &CdiOptions, gpu: &Gpu) -> Vec<DeviceNode> {
    let dir = opts
        .sys_root
        .join("bus/pci/devices")
        .join(&gpu.pci_bus_id.0)
        .join("drm");
    let Ok(entries) = fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    names
        .iter()
        .filter_map(|n| {
            host_node(
                opts,
                &opts.dev_root.join("dri").join(n),
                &format!("/dev/dri/{n}"),
            )
        })
        .collect()
}

/// The `/dev/dri/by-path` links of `gpu` whose node is among `nodes` (its DRM nodes), as
/// `target::link` arguments of `create-symlinks`, as NVIDIA's toolkit adds them per GPU
/// (`byPathHookDiscoverer` in `internal/platform-support/dgpu`): `pci-<bus id>-card` and
/// `-render`, read on the host, kept when they resolve to a node the device is given.
pub(super) fn drm_by_path_links(opts: &CdiOptions, gpu: &Gpu, nodes: &[DeviceNode]) -> Vec<String> {
    let given: BTreeSet<&str> = nodes
        .iter()
        .filter_map(|n| n.host_path.as_deref())
        .collect();
    let mut links = Vec::new();
    for kind in ["card", "render"] {
        let name = format!("pci-{}-{kind}", gpu.pci_bus_id.0);
        let host = opts.dev_root.join("dri/by-path").join(&name);
        let Ok(target) = fs::read_link(opts.root.read_path(&host)) else {
            continue;
        };
        let resolved = match host.parent() {
            Some(dir) if target.is_relative() => clean(&dir.join(&target)),
            _ => target.clone(),
        };
        if given.contains(resolved.display().to_string().as_str()) {
            links.push(format!("{}::/dev/dri/by-path/{name}", target.display()));
        }
    }
    links
}

/// `path` with `.` and `..` resolved lexically, as Go's `filepath.Join` leaves it.
fn clean(path: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// Mounts of the driver files at their path relative to the driver root (read-only; the IPC
/// sockets with NVIDIA's IPC options), `NVIDIA_CTK_LIBCUDA_DIR`, and NVIDIA's hooks when the
/// hook binary is installed. Without it the soname links are mounted too, so that
/// `libcuda.so.1` resolves without `create-symlinks`.
pub(super) fn driver_file_edits(
    opts: &CdiOptions,
    files: &DriverFiles,
    edits: &mut ContainerEdits,
) {
    let in_container = |host: &Path| -> Option<String> {
        match host.strip_prefix(opts.root.host()) {
            Ok(rel) => Some(Path::new("/").join(rel).display().to_string()),
            Err(_) => {
                tracing::warn!(path = %host.display(), "driver file outside the driver root; not mounted");
                None
            }
        }
    };
    let read_only = || READ_ONLY_MOUNT.iter().map(|s| s.to_string()).collect();
    let mut mounts: BTreeMap<String, (String, Vec<String>)> = BTreeMap::new();
    let mut lib_dirs: Vec<String> = Vec::new();
    let mut libcuda_dir = None;
    let soname_links = if files.hook.is_some() {
        &[][..]
    } else {
        &files.soname_links[..]
    };
    for host in files.libraries.iter().chain(soname_links) {
        let Some(target) = in_container(host) else {
            continue;
        };
        if let Some(dir) = Path::new(&target).parent() {
            let dir = dir.display().to_string();
            if host
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libcuda.so."))
            {
                libcuda_dir.get_or_insert_with(|| dir.clone());
            }
            if !lib_dirs.contains(&dir) {
                lib_dirs.push(dir);
            }
        }
        mounts.insert(target, (host.display().to_string(), read_only()));
    }
    for g in &files.graphics {
        if in_container(&g.host).is_some() {
            mounts.insert(
                g.container.clone(),
                (g.host.display().to_string(), read_only()),
            );
        }
    }
    for host in files.firmware.iter().chain(&files.binaries) {
        if let Some(target) = in_container(host) {
            mounts.insert(target, (host.display().to_string(), read_only()));
        }
    }
    for host in &files.ipc {
        if let Some(target) = in_container(host) {
            let options = IPC_MOUNT.iter().map(|s| s.to_string()).collect();
            mounts.insert(target, (host.display().to_string(), options));
        }
    }
    edits.mounts.extend(
        mounts
            .into_iter()
            .map(|(container_path, (host_path, options))| Mount {
                host_path,
                container_path,
                options,
            }),
    );
    if let Some(dir) = libcuda_dir {
        edits.env.push(format!("NVIDIA_CTK_LIBCUDA_DIR={dir}"));
    }
    edits.hooks.extend(driver_hooks(files, &lib_dirs));
}

/// The driver's MPS binaries, left out of MPS claims' containers.
const MPS_TOOLS: [&str; 2] = ["nvidia-cuda-mps-control", "nvidia-cuda-mps-server"];

/// The MPS client environment. MPS is per process, so these are claim-wide: all MPS devices of
/// a claim share one control daemon (one pipe directory, one `/dev/shm`) and one active-thread
/// percentage, and a claim cannot mix MPS and non-MPS devices (the client would route every
/// device through MPS).
///
/// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` is keyed by the device's index as the container's CUDA
/// sees it: the claim's devices in order, as the daemon's `CUDA_VISIBLE_DEVICES` lists them (a
/// share's container sees one GPU: index 0). NVIDIA's device plugin moved from UUID keys to
/// index keys in v0.15.0 because "these limits are not applied for devices if set by UUID".
///
/// A share of a GPU whose driver partitions memory per cgroup also gets NVIDIA's per-container
/// limits, soft (what the scheduler counted) and hard (its burst limit), set on the container's
/// own cgroup by nvdra's hooks ([`super::memlimit`]): then two processes of one container share
/// the limit instead of each having it.
pub(super) fn mps_edits(
    opts: &CdiOptions,
    claim_uid: &str,
    devices: &[PreparedDevice],
    edits: &mut ContainerEdits,
) -> Result<()> {
    let fail = |message: String| Error::Mps {
        claim_uid: claim_uid.to_string(),
        message,
    };
    let mps: Vec<(&PreparedDevice, &MpsSettings)> = devices
        .iter()
        .filter_map(|d| match &d.sharing {
            Sharing::Mps(s) => Some((d, s)),
            _ => None,
        })
        .collect();
    if mps.is_empty() {
        return Ok(());
    }
    if let Some(d) = devices
        .iter()
        .find(|d| !matches!(d.sharing, Sharing::Mps(_)))
    {
        return Err(fail(format!(
            "device {} is not shared with MPS while others are; configure MPS for all devices \
             of the claim or for none",
            d.name
        )));
    }

    let mut pipe_dir: Option<&Path> = None;
    let mut shm_dir: Option<&Path> = None;
    let mut percentage: Option<(u32, &str)> = None;
    let mut limits = Vec::new();
    let mut container_limits = Vec::new();
    for (d, settings) in &mps {
        let dir = d.mps_pipe_dir.as_deref().ok_or_else(|| {
            fail(format!(
                "device {} is shared with MPS but has no MPS pipe directory; start the claim's \
                 MPS control daemon before writing its CDI spec",
                d.name
            ))
        })?;
        match pipe_dir {
            Some(p) if p != dir => {
                return Err(fail(format!(
                    "MPS devices use different pipe directories {} and {}; one claim has one \
                     MPS control daemon",
                    p.display(),
                    dir.display()
                )));
            }
            _ => pipe_dir = Some(dir),
        }
        match (shm_dir, d.mps_shm_dir.as_deref()) {
            (Some(p), Some(dir)) if p != dir => {
                return Err(fail(format!(
                    "MPS devices use different shared-memory directories {} and {}; one claim \
                     has one MPS control daemon",
                    p.display(),
                    dir.display()
                )));
            }
            (None, dir) => shm_dir = dir,
            _ => {}
        }
        if let Some(p) = settings.active_thread_percentage {
            match percentage {
                Some((q, other)) if q != p => {
                    return Err(fail(format!(
                        "MPS active thread percentage differs between devices {other} ({q}) and \
                         {} ({p}); a container has one percentage, use one config for the claim",
                        d.name
                    )));
                }
                _ => percentage = Some((p, &d.name)),
            }
        }
        // Keys name devices of the claim by position (`"0"`) or UUID.
        for key in settings.per_device_pinned_memory_limit.keys() {
            let known = match key.parse::<usize>() {
                Ok(i) => i < devices.len(),
                Err(_) => devices.iter().any(|x| x.uuid() == key),
            };
            if !known {
                return Err(fail(format!(
                    "MPS pinned memory limit for device {key:?} matches no device of the claim \
                     (use an index below {} or one of the claim's UUIDs)",
                    devices.len()
                )));
            }
        }
    }
    for (index, d) in devices.iter().enumerate() {
        // Every device is MPS here (checked above); the settings that apply are its own.
        let Sharing::Mps(settings) = &d.sharing else {
            continue;
        };
        let limit = settings
            .per_device_pinned_memory_limit
            .get(d.uuid())
            .or_else(|| {
                settings
                    .per_device_pinned_memory_limit
                    .get(&index.to_string())
            })
            .or(settings.pinned_memory_limit.as_ref());
        if let Some(bytes) = limit {
            limits.push(format!("{index}={}M", bytes >> 20));
        }
        if let (Some(limits), Some(Enforcement::Container)) =
            (d.memory_limits, super::memlimit::enforcement(opts, d))
        {
            container_limits.push(GpuLimit {
                gpu: d.gpu.uuid.clone(),
                limits,
            });
        }
    }

    // A share's container gets no MPS control client or server binary (every other claim gets
    // them, as NVIDIA's specs give them): `echo quit | nvidia-cuda-mps-control` from one tenant
    // would end every share of the daemon. The MPS host, not the workload, drives the daemon.
    edits.mounts.retain(|m| {
        !MPS_TOOLS
            .iter()
            .any(|t| m.container_path.rsplit('/').next() == Some(*t))
    });
    if let Some(dir) = pipe_dir {
        // First of the share's hooks: nothing else is done for a container that must not start.
        if let Some(gate) = &opts.mps_gate {
            edits.hooks.push(gate.hook(dir));
        }
        edits
            .env
            .push(format!("CUDA_MPS_PIPE_DIRECTORY={MPS_PIPE_CONTAINER_DIR}"));
        edits.mounts.push(Mount {
            host_path: dir.display().to_string(),
            container_path: MPS_PIPE_CONTAINER_DIR.into(),
            options: ["rw", "nosuid", "nodev", "rbind", "rprivate"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        });
    }
    if let Some(dir) = shm_dir {
        edits.mounts.push(Mount {
            host_path: dir.display().to_string(),
            container_path: MPS_SHM_CONTAINER_DIR.into(),
            options: ["rw", "nosuid", "nodev", "bind"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        });
    }
    if let Some((p, _)) = percentage {
        edits
            .env
            .push(format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={p}"));
    }
    if !limits.is_empty() {
        edits.env.push(format!(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={}",
            limits.join(",")
        ));
    }
    if let (Some(partitioning), false) = (&opts.partitioning, container_limits.is_empty()) {
        edits
            .hooks
            .extend(partitioning.hooks(&opts.cgroup_root, &container_limits));
    }
    Ok(())
}

// NVIDIA's createContainer hooks: the driver files' (spec-wide) and a device's DRM links.

/// The OCI hook point of every NVIDIA hook.
const CREATE_CONTAINER: &str = "createContainer";
/// The hooks' environment (nvcdi's default: no debug logging).
const HOOK_ENV: &str = "NVIDIA_CTK_DEBUG=false";

/// The hooks for `files`, given the container directories of the mounted libraries (in mount
/// order); none without a hook binary.
///
///  NVIDIA's CDI hooks, in the form and order nvcdi (nvidia-container-toolkit v1.19, the version
///  NVIDIA's DRA driver vendors) writes them into a claim spec's spec-wide edits:
///
///  0. `create-symlinks` for the graphics links (`gbm/nvidia-drm_gbm.so`,
///     `libnvidia-vulkan-producer.so`, `libglxserver_nvidia.so`), nvcdi's graphics discoverer
///     coming before its driver one (only when there is a link to make);
///  1. `create-symlinks --link <target>::<link> …` — the driver's soname and `.so` links, and
///     `libcuda.so` (only when there is a link to make);
///  2. `enable-cuda-compat --host-driver-version=<version>` — lets a container whose CUDA is newer
///     than the driver use its forward-compatibility libraries (only when the version is known);
///  3. `update-ldcache --folder <dir> …` — the container's ld cache learns the mounted libraries'
///     directories (only when libraries are mounted);
///  4. `disable-device-node-modification` — keeps NVML and nvidia-smi from creating device nodes in
///     the container.
///
///  Below NVIDIA Container Toolkit 1.17.8, or when the hook binary's version cannot be read,
///  `enable-cuda-compat` and `update-ldcache` are left out (CVE-2025-23266, CVE-2025-23267), and
///  below 1.18.0 `disable-device-node-modification` (older binaries lack it); see
///  [`super::toolkit`]. `create-symlinks` stays.
///
///  Each is a `createContainer` hook whose path is the hook binary's host path, whose first
///  argument is the binary's name (then `hook` for `nvidia-ctk`, whose hooks are a subcommand),
///  and whose environment is `NVIDIA_CTK_DEBUG=false`.
pub(super) fn driver_hooks(files: &DriverFiles, lib_dirs: &[String]) -> Vec<Hook> {
    let Some(binary) = &files.hook else {
        return Vec::new();
    };
    let mut hooks = Vec::new();
    for symlinks in [&files.graphics_symlinks, &files.symlinks] {
        let links: Vec<String> = symlinks
            .iter()
            .flat_map(|l| ["--link".to_string(), l.arg()])
            .collect();
        if !links.is_empty() {
            hooks.push(hook(binary, "create-symlinks", links));
        }
    }
    let allowed = |name: &str| files.hook_check.allows(name);
    if let Some(version) = files
        .version
        .as_ref()
        .filter(|_| allowed("enable-cuda-compat"))
    {
        hooks.push(hook(
            binary,
            "enable-cuda-compat",
            vec![format!("--host-driver-version={version}")],
        ));
    }
    if !lib_dirs.is_empty() && allowed("update-ldcache") {
        let folders = lib_dirs
            .iter()
            .flat_map(|d| ["--folder".to_string(), d.clone()])
            .collect();
        hooks.push(hook(binary, "update-ldcache", folders));
    }
    if allowed("disable-device-node-modification") {
        hooks.push(hook(binary, "disable-device-node-modification", Vec::new()));
    }
    hooks
}

/// A device's own `create-symlinks` hook for `links` (`target::link`); none without a hook
/// binary or links.
pub(super) fn device_links_hook(files: &DriverFiles, links: &[String]) -> Option<Hook> {
    let binary = files.hook.as_ref()?;
    if links.is_empty() {
        return None;
    }
    let args = links
        .iter()
        .flat_map(|l| ["--link".to_string(), l.clone()])
        .collect();
    Some(hook(binary, "create-symlinks", args))
}

fn hook(binary: &Path, name: &str, args: Vec<String>) -> Hook {
    let base = binary
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut all = vec![base.clone()];
    if base == "nvidia-ctk" {
        all.push("hook".into());
    }
    all.push(name.into());
    all.extend(args);
    Hook {
        hook_name: CREATE_CONTAINER.into(),
        path: binary.display().to_string(),
        args: all,
        env: vec![HOOK_ENV.into()],
    }
}
