//! How a prepared device is shared, and the opaque claim configuration that says so.
//!
//! Users configure sharing through opaque DRA device configuration in NVIDIA's format
//! (`apiVersion: resource.nvidia.com/v1beta1`, kinds `GpuConfig` and `MigDeviceConfig`), either
//! in a DeviceClass or in the ResourceClaim. This module turns that JSON into a typed
//! [`DeviceConfig`] and picks, for one allocated request, the configuration that applies.
//!
//! Invariants:
//! - Decoding is strict: a wrong `apiVersion`, an unknown `kind`, an unknown field anywhere, a bad
//!   quantity or an out-of-range percentage is an error naming the offending key path
//!   (`sharing.mpsConfig.defaultActiveThreadPercentage: …`). User input is never silently dropped.
//! - Precedence follows Kubernetes and NVIDIA's driver: class configs before claim configs, later
//!   entries of one source win over earlier ones, and an entry applies to a request when its
//!   `requests` list is empty or names the request or its base request (`gpu` covers `gpu/sub`).
//! - Configs of other drivers are ignored, never decoded.
//! - The module is pure: no I/O, no kube client; [`from_allocation`] only converts a value.

pub mod trust;

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::resource::v1::{AllocationResult, DeviceAllocationConfiguration};
use serde::{Deserialize, Deserializer, Serialize};

/// The only opaque config API version this build understands.
pub const API_VERSION: &str = "resource.nvidia.com/v1beta1";
/// The config kind for full GPUs.
pub const KIND_GPU: &str = "GpuConfig";
/// The config kind for MIG devices.
pub const KIND_MIG: &str = "MigDeviceConfig";

/// A problem with a device configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("parameters must be a JSON object with apiVersion and kind, got {found}")]
    NotAnObject { found: String },
    #[error("apiVersion: missing; set apiVersion: {API_VERSION}")]
    MissingApiVersion,
    #[error("apiVersion: unsupported value {found:?}; set apiVersion: {API_VERSION}")]
    ApiVersion { found: String },
    #[error("kind: missing; set kind: {KIND_GPU} or {KIND_MIG}")]
    MissingKind,
    #[error("kind: unknown kind {found:?}; nvdra supports {KIND_GPU} and {KIND_MIG}")]
    UnknownKind { found: String },
    /// A field failed to decode or validate; `path` is the dotted key path from the object root.
    #[error("{path}: {message}")]
    Field { path: String, message: String },
    /// One entry of a claim's or class's config list is invalid.
    #[error("{origin} config #{index}")]
    Entry {
        origin: ConfigSource,
        /// 0-based position among the entries of that source (`spec.devices.config[index]` of the
        /// claim, or the class's `spec.config[index]`).
        index: usize,
        #[source]
        cause: Box<Error>,
    },
    /// A config kind was explicitly applied to a device of the other kind.
    #[error(
        "{config_kind} cannot configure {device_kind} device {device}: use kind {expected} for it, \
         or narrow the config's requests"
    )]
    KindMismatch {
        config_kind: &'static str,
        device_kind: DeviceKind,
        device: String,
        expected: &'static str,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Time-slice length for GPUs shared by time slicing (NVIDIA's `timeSlicingConfig.interval`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum TimeSliceInterval {
    #[default]
    Default,
    Short,
    Medium,
    Long,
}

/// MPS limits applied to the clients of a shared device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MpsSettings {
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, 1..=100.
    pub active_thread_percentage: Option<u32>,
    /// Default pinned device memory limit in bytes, for every device of the claim.
    pub pinned_memory_limit: Option<u64>,
    /// Per-device overrides in bytes, keyed by a device index within the claim (`"0"`) or a UUID.
    pub per_device_pinned_memory_limit: BTreeMap<String, u64>,
}

/// How a prepared device is shared among the containers that use it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "strategy", rename_all = "camelCase")]
pub enum Sharing {
    /// No sharing configured: the claim's containers use the device as they please.
    #[default]
    Exclusive,
    TimeSlicing {
        interval: TimeSliceInterval,
    },
    Mps(MpsSettings),
}

impl Sharing {
    /// The strategy as the checkpoint spells it (`exclusive`, `timeSlicing`, `mps`).
    pub fn strategy(&self) -> &'static str {
        match self {
            Sharing::Exclusive => "exclusive",
            Sharing::TimeSlicing { .. } => "timeSlicing",
            Sharing::Mps(_) => "mps",
        }
    }
}

/// A decoded opaque device configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind")]
pub enum DeviceConfig {
    /// Kind `GpuConfig`.
    Gpu { sharing: Sharing },
    /// Kind `MigDeviceConfig`.
    Mig { sharing: Sharing },
}

impl DeviceConfig {
    /// The API kind this config was decoded from.
    pub fn kind_name(&self) -> &'static str {
        match self {
            DeviceConfig::Gpu { .. } => KIND_GPU,
            DeviceConfig::Mig { .. } => KIND_MIG,
        }
    }

    /// The kind of device this config is written for.
    pub fn device_kind(&self) -> DeviceKind {
        match self {
            DeviceConfig::Gpu { .. } => DeviceKind::Gpu,
            DeviceConfig::Mig { .. } => DeviceKind::Mig,
        }
    }

    pub fn sharing(&self) -> &Sharing {
        match self {
            DeviceConfig::Gpu { sharing } | DeviceConfig::Mig { sharing } => sharing,
        }
    }

    pub fn into_sharing(self) -> Sharing {
        match self {
            DeviceConfig::Gpu { sharing } | DeviceConfig::Mig { sharing } => sharing,
        }
    }

    /// Checks that this config may be applied to `device` (a device name for the error message).
    pub fn check_fits(&self, kind: DeviceKind, device: &str) -> Result<()> {
        if self.device_kind() == kind {
            Ok(())
        } else {
            Err(self.mismatch(kind, device))
        }
    }

    fn mismatch(&self, kind: DeviceKind, device: &str) -> Error {
        Error::KindMismatch {
            config_kind: self.kind_name(),
            device_kind: kind,
            device: device.to_string(),
            expected: kind.config_kind(),
        }
    }
}

/// Whether a device is a full GPU or a MIG device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    Gpu,
    Mig,
}

impl DeviceKind {
    /// The config kind that configures devices of this kind.
    pub fn config_kind(self) -> &'static str {
        match self {
            DeviceKind::Gpu => KIND_GPU,
            DeviceKind::Mig => KIND_MIG,
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::Gpu => "GPU",
            DeviceKind::Mig => "MIG",
        })
    }
}

/// The sharing of a device given the config chosen for it (`None`: exclusive), checking the kind.
pub fn sharing_for(
    config: Option<DeviceConfig>,
    kind: DeviceKind,
    device: &str,
) -> Result<Sharing> {
    match config {
        None => Ok(Sharing::Exclusive),
        Some(c) => {
            c.check_fits(kind, device)?;
            Ok(c.into_sharing())
        }
    }
}

/// Where a share's config asks for its burst limit: NVIDIA's `defaultPinnedDeviceMemoryLimit`,
/// the most device memory each MPS client may allocate, which on a share is the most it may use.
pub const BURST_LIMIT_FIELD: &str = "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit";

/// What the config chosen for a share of a GPU (`--shared-capacity`, `--consumable-shares`)
/// sets ([`share_config`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShareConfig {
    /// `mpsConfig.defaultActiveThreadPercentage`: a cap on the share's SMs.
    pub active_thread_percentage: Option<u32>,
    /// `mpsConfig.defaultPinnedDeviceMemoryLimit` ([`BURST_LIMIT_FIELD`]), in bytes: the share's
    /// burst limit, the most memory it may use (its hard limit). What the scheduler counted
    /// (the memory it consumes) stays its soft limit, guaranteed; between the two it uses
    /// memory the GPU's other shares leave idle, which MPS may take back under pressure where
    /// the driver partitions memory. The scheduler packs shares by what they consume, never
    /// by this. Checked against both by [`ShareConfig::hard_limit`].
    pub burst_limit: Option<u64>,
}

impl ShareConfig {
    /// The share's hard memory limit, in bytes, where its soft limit is `soft` (what the
    /// scheduler counted; `None` for a share held to nothing, such as an `unlimited` share
    /// that asked for no memory) on a GPU publishing `total`: its burst limit, else `soft`.
    /// A burst limit below `soft` (it would take back what the scheduler promised) or above
    /// the GPU is refused, naming the field.
    pub fn hard_limit(&self, soft: Option<u64>, total: u64) -> Result<Option<u64>> {
        let Some(burst) = self.burst_limit else {
            return Ok(soft);
        };
        let q = crate::inventory::quantity;
        if let Some(soft) = soft.filter(|s| burst < *s) {
            return Err(field_error(
                BURST_LIMIT_FIELD,
                format!(
                    "{} is below the {} of memory the share is guaranteed (what the scheduler \
                     counted for it: its capacity.requests.memory, or in integer mode its part \
                     of the GPU); on a share this field is its burst limit, the most it may \
                     use: set it to {} or more, or drop it",
                    q(burst),
                    q(soft),
                    q(soft)
                ),
            ));
        }
        if burst > total {
            return Err(field_error(
                BURST_LIMIT_FIELD,
                format!(
                    "{} is more than the GPU's {} of memory; on a share this field is its burst \
                     limit, the most it may use: set it to {} or less",
                    q(burst),
                    q(total),
                    q(total)
                ),
            ));
        }
        Ok(Some(burst))
    }
}

/// What the config chosen for a share of a GPU sets, or why the config cannot apply to a share.
///
/// A share runs under its GPU's MPS daemon beside other claims' shares, held to the memory its
/// consumed capacity gives it. So of a `GpuConfig`'s sharing only MPS's settings apply:
/// `defaultActiveThreadPercentage` (a cap on the share's SMs) and `defaultPinnedDeviceMemoryLimit`
/// (its burst limit, [`ShareConfig::burst_limit`]). Time slicing, which the GPU's other shares
/// would not follow, and per-device pinned limits (one share, one limit: use the default one)
/// are refused with the field that sets them.
pub fn share_config(configured: &Sharing) -> Result<ShareConfig> {
    match configured {
        Sharing::Exclusive => Ok(ShareConfig::default()),
        Sharing::TimeSlicing { .. } => Err(field_error(
            "sharing.strategy",
            "TimeSlicing cannot apply to a share of a GPU: a share runs under the GPU's MPS \
             daemon, beside other claims' shares; use strategy MPS (to cap its SMs with \
             defaultActiveThreadPercentage, or let it burst with \
             defaultPinnedDeviceMemoryLimit), drop the config, or ask for the whole GPU (no \
             capacity.requests.memory)",
        )),
        Sharing::Mps(m) => {
            if !m.per_device_pinned_memory_limit.is_empty() {
                return Err(field_error(
                    "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit",
                    "a share's memory is what it consumes (capacity.requests.memory), which the \
                     scheduler counted; to let it use more (burst), set its limit with \
                     defaultPinnedDeviceMemoryLimit instead, or drop this field",
                ));
            }
            Ok(ShareConfig {
                active_thread_percentage: m.active_thread_percentage,
                burst_limit: m.pinned_memory_limit,
            })
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding

/// Decodes opaque parameters strictly (see the module docs).
pub fn decode(parameters: &serde_json::Value) -> Result<DeviceConfig> {
    let obj = parameters.as_object().ok_or_else(|| Error::NotAnObject {
        found: json_type(parameters).to_string(),
    })?;
    match obj.get("apiVersion") {
        None => return Err(Error::MissingApiVersion),
        Some(serde_json::Value::String(v)) if v == API_VERSION => {}
        Some(other) => {
            return Err(Error::ApiVersion {
                found: other
                    .as_str()
                    .map_or_else(|| other.to_string(), str::to_string),
            });
        }
    }
    let kind = match obj.get("kind") {
        None => return Err(Error::MissingKind),
        Some(serde_json::Value::String(k)) => k.as_str(),
        Some(other) => {
            return Err(Error::UnknownKind {
                found: other.to_string(),
            });
        }
    };
    match kind {
        KIND_GPU => {
            let wire: GpuConfigWire = strict(parameters)?;
            let sharing = match wire.sharing {
                None => Sharing::Exclusive,
                Some(s) => s.into_sharing()?,
            };
            Ok(DeviceConfig::Gpu { sharing })
        }
        KIND_MIG => {
            let wire: MigConfigWire = strict(parameters)?;
            let sharing = match wire.sharing {
                None => Sharing::Exclusive,
                Some(s) => s.into_sharing()?,
            };
            Ok(DeviceConfig::Mig { sharing })
        }
        other => Err(Error::UnknownKind {
            found: other.to_string(),
        }),
    }
}

fn json_type(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn strict<T: serde::de::DeserializeOwned>(v: &serde_json::Value) -> Result<T> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        Error::Field {
            path: if path == "." { "(root)".into() } else { path },
            message: e.into_inner().to_string(),
        }
    })
}

fn field_error(path: &str, message: impl Into<String>) -> Error {
    Error::Field {
        path: path.to_string(),
        message: message.into(),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GpuConfigWire {
    #[serde(rename = "apiVersion")]
    _api_version: String,
    #[serde(rename = "kind")]
    _kind: String,
    #[serde(default)]
    sharing: Option<GpuSharingWire>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct MigConfigWire {
    #[serde(rename = "apiVersion")]
    _api_version: String,
    #[serde(rename = "kind")]
    _kind: String,
    #[serde(default)]
    sharing: Option<MigSharingWire>,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
enum StrategyWire {
    TimeSlicing,
    #[serde(rename = "MPS")]
    Mps,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GpuSharingWire {
    strategy: StrategyWire,
    #[serde(default)]
    time_slicing_config: Option<TimeSlicingWire>,
    #[serde(default)]
    mps_config: Option<MpsConfigWire>,
}

/// MIG devices cannot set a time-slice interval: `timeSlicingConfig` is an unknown field here.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct MigSharingWire {
    strategy: StrategyWire,
    #[serde(default)]
    mps_config: Option<MpsConfigWire>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TimeSlicingWire {
    #[serde(default)]
    interval: Option<TimeSliceInterval>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct MpsConfigWire {
    #[serde(default)]
    default_active_thread_percentage: Option<Percentage>,
    #[serde(default)]
    default_pinned_device_memory_limit: Option<PinnedLimit>,
    #[serde(default)]
    default_per_device_pinned_memory_limit: Option<BTreeMap<String, PinnedLimit>>,
}

impl GpuSharingWire {
    fn into_sharing(self) -> Result<Sharing> {
        match self.strategy {
            StrategyWire::TimeSlicing => {
                if self.mps_config.is_some() {
                    return Err(field_error(
                        "sharing.mpsConfig",
                        "only valid with strategy MPS; remove it or set strategy: MPS",
                    ));
                }
                let interval = self
                    .time_slicing_config
                    .and_then(|t| t.interval)
                    .unwrap_or_default();
                Ok(Sharing::TimeSlicing { interval })
            }
            StrategyWire::Mps => {
                if self.time_slicing_config.is_some() {
                    return Err(field_error(
                        "sharing.timeSlicingConfig",
                        "only valid with strategy TimeSlicing; remove it or set strategy: TimeSlicing",
                    ));
                }
                mps(self.mps_config)
            }
        }
    }
}

impl MigSharingWire {
    fn into_sharing(self) -> Result<Sharing> {
        match self.strategy {
            StrategyWire::TimeSlicing => {
                if self.mps_config.is_some() {
                    return Err(field_error(
                        "sharing.mpsConfig",
                        "only valid with strategy MPS; remove it or set strategy: MPS",
                    ));
                }
                Ok(Sharing::TimeSlicing {
                    interval: TimeSliceInterval::Default,
                })
            }
            StrategyWire::Mps => mps(self.mps_config),
        }
    }
}

fn mps(config: Option<MpsConfigWire>) -> Result<Sharing> {
    let Some(c) = config else {
        return Ok(Sharing::Mps(MpsSettings::default()));
    };
    let mut per_device = BTreeMap::new();
    for (key, limit) in c.default_per_device_pinned_memory_limit.unwrap_or_default() {
        if !is_device_key(&key) {
            return Err(field_error(
                &format!("sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.{key}"),
                format!(
                    "invalid device key {key:?}: use a device index within the claim (\"0\") \
                     or a GPU/MIG UUID (\"GPU-…\", \"MIG-…\")"
                ),
            ));
        }
        per_device.insert(key, limit.0);
    }
    Ok(Sharing::Mps(MpsSettings {
        active_thread_percentage: c.default_active_thread_percentage.map(|p| p.0),
        pinned_memory_limit: c.default_pinned_device_memory_limit.map(|l| l.0),
        per_device_pinned_memory_limit: per_device,
    }))
}

fn is_device_key(key: &str) -> bool {
    let index = !key.is_empty() && key.len() <= 4 && key.bytes().all(|b| b.is_ascii_digit());
    let uuid = (key.starts_with("GPU-") || key.starts_with("MIG-"))
        && key.len() > 4
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'/');
    index || uuid
}

/// An MPS active-thread percentage, 1..=100.
struct Percentage(u32);

impl<'de> Deserialize<'de> for Percentage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let v = i64::deserialize(d)?;
        if (1..=100).contains(&v) {
            // In range 1..=100, so the cast cannot truncate.
            Ok(Percentage(v as u32))
        } else {
            Err(serde::de::Error::custom(format!(
                "must be between 1 and 100, got {v}"
            )))
        }
    }
}

/// A pinned device memory limit: a Kubernetes quantity of bytes, at least 1Mi (MPS takes MiB).
struct PinnedLimit(u64);

impl<'de> Deserialize<'de> for PinnedLimit {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = u64;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a quantity of bytes such as 10Gi or 512Mi")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<u64, E> {
                Ok(v)
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<u64, E> {
                u64::try_from(v)
                    .map_err(|_| E::custom(format!("invalid quantity {v}: must not be negative")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<u64, E> {
                crate::inventory::parse_quantity(v).ok_or_else(|| {
                    E::custom(format!(
                        "invalid quantity {v:?}: use a whole number with an optional suffix \
                         Ki, Mi, Gi, Ti, k, M, G or T, such as 10Gi or 512Mi"
                    ))
                })
            }
        }
        let bytes = d.deserialize_any(V)?;
        if bytes < 1 << 20 {
            return Err(serde::de::Error::custom(format!(
                "pinned memory limit {bytes} bytes is below the 1Mi minimum MPS can enforce"
            )));
        }
        Ok(PinnedLimit(bytes))
    }
}

// ---------------------------------------------------------------------------------------------
// Precedence

/// Where a config entry came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ConfigSource {
    FromClass,
    FromClaim,
}

impl fmt::Display for ConfigSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ConfigSource::FromClass => "class",
            ConfigSource::FromClaim => "claim",
        })
    }
}

/// One opaque config entry of an allocation (`status.allocation.devices.config[]`).
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigEntry {
    pub source: ConfigSource,
    /// Requests the entry applies to; empty means every request.
    pub requests: Vec<String>,
    pub driver: String,
    pub parameters: serde_json::Value,
}

impl ConfigEntry {
    /// True when the entry names `request` (a result's request, `req` or `req/sub`) explicitly,
    /// by itself or by its base request.
    fn names(&self, request: &str) -> bool {
        let base = request.split_once('/').map_or(request, |(b, _)| b);
        self.requests.iter().any(|r| r == request || r == base)
    }
}

/// Our driver's entries in precedence order (lowest first), each with its index within its source.
fn ordered<'a>(
    entries: &'a [ConfigEntry],
    driver: &'a str,
) -> impl Iterator<Item = (usize, &'a ConfigEntry)> + 'a {
    let indexed = |source: ConfigSource| {
        entries
            .iter()
            .filter(move |e| e.source == source)
            .enumerate()
            .filter(move |(_, e)| e.driver == driver)
    };
    indexed(ConfigSource::FromClass).chain(indexed(ConfigSource::FromClaim))
}

fn decode_entry(index: usize, entry: &ConfigEntry) -> Result<DeviceConfig> {
    decode(&entry.parameters).map_err(|cause| Error::Entry {
        origin: entry.source,
        index,
        cause: Box::new(cause),
    })
}

/// The config that applies to `request` (a result's request name, `req` or `req/sub`) of
/// `driver`, whatever the device kind: the last applicable entry by precedence. Every applicable
/// entry is decoded, so a broken entry is reported even when a later one overrides it. Tests
/// only: prepare and `match` know the device's kind ([`config_for_device`]).
#[cfg(test)]
pub fn config_for(
    entries: &[ConfigEntry],
    driver: &str,
    request: &str,
) -> Result<Option<DeviceConfig>> {
    let mut chosen = None;
    for (index, entry) in ordered(entries, driver) {
        if entry.requests.is_empty() || entry.names(request) {
            chosen = Some(decode_entry(index, entry)?);
        }
    }
    Ok(chosen)
}

/// Like [`config_for`], for a device of a known kind, with NVIDIA's rules for mixed kinds: an
/// entry that names the request explicitly must fit the device (else [`Error::KindMismatch`]),
/// while an entry for all requests (`requests` empty) of the other kind is skipped, so one claim
/// can hold a `GpuConfig` and a `MigDeviceConfig` side by side.
pub fn config_for_device(
    entries: &[ConfigEntry],
    driver: &str,
    request: &str,
    kind: DeviceKind,
    device: &str,
) -> Result<Option<DeviceConfig>> {
    let mut chosen = None;
    for (index, entry) in ordered(entries, driver) {
        let explicit = entry.names(request);
        if !(explicit || entry.requests.is_empty()) {
            continue;
        }
        let config = decode_entry(index, entry)?;
        if config.device_kind() == kind {
            chosen = Some(config);
        } else if explicit {
            return Err(Error::Entry {
                origin: entry.source,
                index,
                cause: Box::new(config.mismatch(kind, device)),
            });
        }
    }
    Ok(chosen)
}

/// The opaque config entries of an allocation, in order. Entries without `opaque` (a config type
/// newer than this build knows) are skipped with a warning; unknown sources are treated as claim
/// configs, the more specific of the two.
pub fn from_allocation(status: &AllocationResult) -> Vec<ConfigEntry> {
    let configs = status
        .devices
        .as_ref()
        .and_then(|d| d.config.as_deref())
        .unwrap_or_default();
    configs
        .iter()
        .enumerate()
        .filter_map(|(i, c)| {
            let DeviceAllocationConfiguration {
                opaque,
                requests,
                source,
            } = c;
            let Some(opaque) = opaque else {
                tracing::warn!(
                    config.index = i,
                    "allocation config without opaque parameters ignored"
                );
                return None;
            };
            let source = match source.as_str() {
                "FromClass" => ConfigSource::FromClass,
                "FromClaim" => ConfigSource::FromClaim,
                other => {
                    tracing::warn!(
                        config.index = i,
                        source = other,
                        "unknown config source; treated as FromClaim"
                    );
                    ConfigSource::FromClaim
                }
            };
            Some(ConfigEntry {
                source,
                requests: requests.clone().unwrap_or_default(),
                driver: opaque.driver.clone(),
                parameters: opaque.parameters.0.clone(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;
