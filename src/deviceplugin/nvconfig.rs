//! NVIDIA's device-plugin config file, `version: v1`, read as NVIDIA documents it (the
//! `flags`, `resources`, `sharing` and `imex` sections with NVIDIA's key names), into the
//! [`Options`] the device plugin runs with.
//!
//! Unlike NVIDIA's plugin (which parses with `sigs.k8s.io/yaml`, non-strict), an unknown key or a
//! bad value is an error naming the key path. Keys NVIDIA defines for its other binaries (GFD,
//! the MPS daemon) or for discovery nvdra does its own way are accepted and ignored, so one file
//! serves both; the ones that change what is advertised or allocated are applied. Also unlike
//! NVIDIA's plugin, `sharing.*.resources[].rename` and `devices` are honoured, so GPUs can be
//! shared one by one. The driver roots (`flags.nvidiaDriverRoot`, `flags.nvidiaDevRoot`,
//! `flags.plugin.containerDriverRoot`) become nvdra's `--driver-root`, `--dev-root` and
//! `--driver-root-ctr-path` where nvdra's own settings leave them unset ([`driver_roots`]).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::{DeviceSelector, DriverMode, ResourceName};
use super::{IdStrategy, ListStrategy, MigStrategy, Options, ShareKind, SharedResource, Sharing};

/// Where NVIDIA's MPS control daemon keeps its pipes when `flags.mpsRoot` is not set.
pub const DEFAULT_MPS_ROOT: &str = "/run/nvidia/mps";

/// A config file problem; `key` is the key path (`sharing.timeSlicing.resources[0].replicas`).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("device-plugin config {file}: {key}: {message}")]
pub struct ConfigError {
    pub file: String,
    pub key: String,
    pub message: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct File {
    #[serde(default)]
    version: Option<String>,
    #[serde(default)]
    flags: Flags,
    #[serde(default)]
    resources: Option<Resources>,
    #[serde(default)]
    sharing: Option<SharingFile>,
    #[serde(default)]
    imex: Option<Imex>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
// Every key NVIDIA defines is read (so that none is unknown); some are for its other binaries.
#[allow(dead_code)]
struct Flags {
    mig_strategy: Option<MigStrategy>,
    fail_on_init_error: Option<bool>,
    mps_root: Option<String>,
    nvidia_driver_root: Option<String>,
    nvidia_dev_root: Option<String>,
    gdrcopy_enabled: Option<bool>,
    gds_enabled: Option<bool>,
    mofed_enabled: Option<bool>,
    #[serde(rename = "useNodeFeatureAPI")]
    use_node_feature_api: Option<bool>,
    device_discovery_strategy: Option<DiscoveryStrategy>,
    #[serde(default)]
    plugin: PluginFlags,
    gfd: Option<GfdFlags>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum DiscoveryStrategy {
    Auto,
    Nvml,
    Tegra,
    Vfio,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
// Every key NVIDIA defines is read (so that none is unknown); some are for its other binaries.
#[allow(dead_code)]
struct PluginFlags {
    pass_device_specs: Option<bool>,
    device_list_strategy: Option<OneOrMany<ListStrategy>>,
    #[serde(rename = "deviceIDStrategy")]
    device_id_strategy: Option<IdStrategy>,
    cdi_annotation_prefix: Option<String>,
    #[serde(rename = "nvidiaCTKPath")]
    nvidia_ctk_path: Option<String>,
    container_driver_root: Option<String>,
    shared_devices_allocation_policy: Option<AllocationPolicy>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "lowercase")]
enum AllocationPolicy {
    Distributed,
    Packed,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
// Every key NVIDIA defines is read (so that none is unknown); some are for its other binaries.
#[allow(dead_code)]
struct GfdFlags {
    oneshot: Option<bool>,
    no_timestamp: Option<bool>,
    sleep_interval: Option<String>,
    output_file: Option<String>,
    machine_type_file: Option<String>,
}

/// A string or a list of them (`deviceListStrategy: envvar` or `[envvar, cdi-cri]`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Resources {
    #[serde(default)]
    gpus: Vec<NamedPattern>,
    #[serde(default)]
    mig: Vec<NamedPattern>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NamedPattern {
    #[allow(dead_code)]
    pattern: String,
    #[allow(dead_code)]
    name: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SharingFile {
    time_slicing: Option<SharingSection>,
    mps: Option<SharingSection>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct SharingSection {
    #[serde(default)]
    rename_by_default: bool,
    fail_requests_greater_than_one: Option<bool>,
    #[serde(default)]
    resources: Vec<SharedResourceFile>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SharedResourceFile {
    name: String,
    rename: Option<String>,
    #[serde(default)]
    devices: Option<DevicesFile>,
    replicas: u32,
}

/// `devices: all`, `devices: 2` (the first two GPUs), or a list of indices and UUIDs.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum DevicesFile {
    Count(u32),
    Word(String),
    List(Vec<DeviceRef>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum DeviceRef {
    Index(u32),
    Name(String),
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
// Every key NVIDIA defines is read (so that none is unknown); some are for its other binaries.
#[allow(dead_code)]
struct Imex {
    #[serde(rename = "channelIDs", default)]
    channel_ids: Vec<u32>,
    #[serde(default)]
    required: bool,
}

/// The driver roots NVIDIA's file names, as nvdra's settings: `flags.nvidiaDriverRoot` is
/// `--driver-root`, `flags.nvidiaDevRoot` `--dev-root`, `flags.plugin.containerDriverRoot`
/// `--driver-root-ctr-path`. Read leniently (other keys ignored, an unreadable file gives none):
/// the whole file is checked, with errors naming its keys, when the device plugin starts.
pub fn driver_roots(path: &Path) -> crate::config::BackendSettings {
    #[derive(Default, Deserialize)]
    struct RootsFile {
        #[serde(default)]
        flags: RootFlags,
    }
    #[derive(Default, Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct RootFlags {
        nvidia_driver_root: Option<PathBuf>,
        nvidia_dev_root: Option<PathBuf>,
        #[serde(default)]
        plugin: RootPluginFlags,
    }
    #[derive(Default, Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct RootPluginFlags {
        container_driver_root: Option<PathBuf>,
    }
    let file: RootsFile = std::fs::read_to_string(path)
        .ok()
        .and_then(|text| crate::yaml::from_str(&text).ok())
        .unwrap_or_default();
    let RootFlags {
        nvidia_driver_root,
        nvidia_dev_root,
        plugin,
    } = file.flags;
    // NVIDIA's files leave unset keys empty.
    let set = |p: Option<PathBuf>| p.filter(|p| !p.as_os_str().is_empty());
    crate::config::BackendSettings {
        driver_root: set(nvidia_driver_root),
        dev_root: set(nvidia_dev_root),
        driver_root_ctr_path: set(plugin.container_driver_root),
        ..Default::default()
    }
}

/// Reads and applies the file at `path` over NVIDIA's defaults.
pub fn load(path: &Path) -> Result<Options, ConfigError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: file.clone(),
        key: ".".into(),
        message: format!("cannot read the file: {e}"),
    })?;
    parse(&file, &text)
}

/// Parses the text of a config file named `file` (for messages).
pub fn parse(file: &str, text: &str) -> Result<Options, ConfigError> {
    let err = |key: &str, message: String| ConfigError {
        file: file.to_string(),
        key: key.to_string(),
        message,
    };
    let parsed: File = if text.trim().is_empty() {
        File::default()
    } else {
        crate::yaml::from_str(text).map_err(|e| err(&e.path, e.to_string()))?
    };
    let File {
        version,
        flags,
        resources,
        sharing,
        imex,
    } = parsed;
    match version.as_deref() {
        None | Some("") | Some("v1") => {}
        Some(v) => return Err(err("version", format!("unknown version {v:?}; use v1"))),
    }
    let Flags {
        mig_strategy,
        fail_on_init_error: _,
        mps_root,
        nvidia_driver_root: _,
        nvidia_dev_root: _,
        gdrcopy_enabled,
        gds_enabled,
        mofed_enabled,
        use_node_feature_api: _,
        device_discovery_strategy,
        plugin,
        gfd: _,
    } = flags;
    if let Some(DiscoveryStrategy::Tegra | DiscoveryStrategy::Vfio) = device_discovery_strategy {
        return Err(err(
            "flags.deviceDiscoveryStrategy",
            "nvdra discovers GPUs through NVML; use auto or nvml".into(),
        ));
    }
    let PluginFlags {
        pass_device_specs,
        device_list_strategy,
        device_id_strategy,
        cdi_annotation_prefix,
        nvidia_ctk_path: _,
        container_driver_root: _,
        shared_devices_allocation_policy,
    } = plugin;
    let mut opts = Options::default();
    for (mode, on) in [
        (DriverMode::Gdrcopy, gdrcopy_enabled),
        (DriverMode::Gds, gds_enabled),
        (DriverMode::Mofed, mofed_enabled),
    ] {
        if on == Some(true) {
            opts.modes.push(mode);
        }
    }
    if let Some(m) = mig_strategy {
        opts.mig_strategy = m;
    }
    if let Some(p) = pass_device_specs {
        opts.pass_device_specs = p;
    }
    if let Some(s) = device_list_strategy {
        let list = match s {
            OneOrMany::One(s) => vec![s],
            OneOrMany::Many(l) => l,
        };
        if list.is_empty() {
            return Err(err(
                "flags.plugin.deviceListStrategy",
                "an empty list; give at least one of envvar, volume-mounts, cdi-annotations, cdi-cri".into(),
            ));
        }
        let mut dedup = Vec::new();
        for s in list {
            if !dedup.contains(&s) {
                dedup.push(s);
            }
        }
        opts.list_strategies = dedup;
    }
    if let Some(s) = device_id_strategy {
        opts.id_strategy = s;
    }
    if let Some(p) = cdi_annotation_prefix {
        opts.cdi_annotation_prefix = p;
    }
    if let Some(AllocationPolicy::Packed) = shared_devices_allocation_policy {
        opts.packed = true;
    }
    if let Some(Resources { gpus, mig }) = resources
        && !(gpus.is_empty() && mig.is_empty())
    {
        // NVIDIA ignores this section with a warning too; `sharing.*.rename` names resources.
        tracing::warn!(
            "device-plugin config: the resources section is not supported (as in NVIDIA's plugin); use sharing.*.resources[].rename"
        );
    }
    if let Some(Imex {
        channel_ids,
        required: _,
    }) = imex
        && !(channel_ids.is_empty() || channel_ids == [0])
    {
        return Err(err(
            "imex.channelIDs",
            format!("{channel_ids:?}: only [] or [0] are valid"),
        ));
    }
    if let Some(SharingFile { time_slicing, mps }) = sharing {
        // MPS wins when present at all, as in NVIDIA's plugin.
        let (kind, key, section) = match (mps, time_slicing) {
            (Some(m), _) => (ShareKind::Mps, "sharing.mps", m),
            (None, Some(t)) => (ShareKind::TimeSlicing, "sharing.timeSlicing", t),
            (None, None) => return Ok(opts),
        };
        opts.sharing = Some(sharing_from(kind, key, section, &err)?);
        if kind == ShareKind::Mps {
            if opts.mig_strategy == MigStrategy::Mixed {
                return Err(err(
                    "sharing.mps",
                    "MPS sharing is not supported with migStrategy mixed".into(),
                ));
            }
            // NVIDIA's plugin takes it from --mps-root (the Helm chart's default); nvdra has no
            // such flag, so the chart's default stands in.
            opts.mps_root = Some(
                mps_root
                    .filter(|r| !r.is_empty())
                    .unwrap_or_else(|| DEFAULT_MPS_ROOT.into()),
            );
        }
    }
    Ok(opts)
}

fn sharing_from(
    kind: ShareKind,
    key: &str,
    section: SharingSection,
    err: &dyn Fn(&str, String) -> ConfigError,
) -> Result<Sharing, ConfigError> {
    let SharingSection {
        rename_by_default,
        fail_requests_greater_than_one,
        resources,
    } = section;
    if resources.is_empty() {
        return Err(err(
            &format!("{key}.resources"),
            "no resources specified".into(),
        ));
    }
    let mut out = Vec::new();
    for (i, r) in resources.into_iter().enumerate() {
        let at = |field: &str| format!("{key}.resources[{i}].{field}");
        let SharedResourceFile {
            name,
            rename,
            devices,
            replicas,
        } = r;
        let name = ResourceName::parse(&name).map_err(|m| err(&at("name"), m))?;
        if replicas < 2 {
            return Err(err(
                &at("replicas"),
                format!("{replicas}: replicas must be at least 2"),
            ));
        }
        let rename = rename
            .map(|r| ResourceName::parse(&r).map_err(|m| err(&at("rename"), m)))
            .transpose()?;
        let devices = match devices {
            None => DeviceSelector::All,
            Some(DevicesFile::Word(w)) if w == "all" => DeviceSelector::All,
            Some(DevicesFile::Word(w)) => {
                return Err(err(
                    &at("devices"),
                    format!("{w:?}: use all, a count, or a list of GPU indices and UUIDs"),
                ));
            }
            Some(DevicesFile::Count(0)) => {
                return Err(err(&at("devices"), "0: a count must be positive".into()));
            }
            Some(DevicesFile::Count(n)) => DeviceSelector::First(n),
            Some(DevicesFile::List(l)) => DeviceSelector::List(
                l.into_iter()
                    .map(|d| match d {
                        DeviceRef::Index(i) => i.to_string(),
                        DeviceRef::Name(s) => s,
                    })
                    .collect(),
            ),
        };
        out.push(SharedResource {
            name,
            rename,
            devices,
            replicas,
        });
    }
    Ok(Sharing {
        kind,
        rename_by_default,
        fail_requests_greater_than_one: fail_requests_greater_than_one
            .unwrap_or(kind == ShareKind::Mps),
        resources: out,
    })
}
