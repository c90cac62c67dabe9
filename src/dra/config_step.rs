//! Opaque device configuration (`resource.nvidia.com/v1beta1` `GpuConfig`, `MigDeviceConfig`)
//! resolved for one allocated device: entries from the class come before entries from the claim,
//! a later entry overrides an earlier one, and entries naming requests apply only to those.
//! Decoding is strict: an unknown kind or field is an error naming where it is.
//!
//! A minimal stand-in until the full `sharing` module is merged; the plugin only depends on
//! [`resolve`].

use k8s_openapi::api::resource::v1::DeviceAllocationConfiguration;
use serde::Deserialize;

use crate::inventory::{TimeSlice, parse_quantity};
use crate::ledger::SharingRecord;

pub const API_VERSION: &str = "resource.nvidia.com/v1beta1";

/// A configuration entry that cannot be applied.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("bad device configuration at {key}: {message}")]
pub struct Error {
    pub key: String,
    pub message: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GpuConfig {
    #[allow(dead_code)]
    api_version: String,
    #[allow(dead_code)]
    kind: String,
    sharing: Option<Sharing>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Sharing {
    strategy: Strategy,
    time_slicing_config: Option<TimeSlicingConfig>,
    mps_config: Option<MpsConfig>,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
enum Strategy {
    TimeSlicing,
    #[serde(rename = "MPS")]
    Mps,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TimeSlicingConfig {
    interval: Option<TimeSlice>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct MpsConfig {
    default_active_thread_percentage: Option<u32>,
    default_pinned_device_memory_limit: Option<String>,
}

/// The device kind a config is resolved for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Gpu,
    Mig,
}

/// The sharing that applies to the device allocated for `request` (a base or `req/sub` name).
pub fn resolve(
    entries: &[DeviceAllocationConfiguration],
    driver: &str,
    request: &str,
    target: Target,
) -> Result<SharingRecord, Error> {
    let base = request.split('/').next().unwrap_or(request);
    let mut ordered: Vec<(usize, &DeviceAllocationConfiguration)> = Vec::new();
    for source in ["FromClass", "FromClaim"] {
        ordered.extend(
            entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.source == source),
        );
    }
    if let Some((i, e)) = entries
        .iter()
        .enumerate()
        .find(|(_, e)| e.source != "FromClass" && e.source != "FromClaim")
    {
        return Err(Error {
            key: format!("status.allocation.devices.config[{i}].source"),
            message: format!(
                "unknown source {:?}; expected FromClass or FromClaim",
                e.source
            ),
        });
    }
    let mut out = SharingRecord::Exclusive;
    for (i, entry) in ordered {
        let Some(opaque) = &entry.opaque else {
            continue;
        };
        if opaque.driver != driver {
            continue;
        }
        let applies = match &entry.requests {
            None => true,
            Some(r) if r.is_empty() => true,
            Some(r) => r.iter().any(|r| r == request || r == base),
        };
        let key = format!("status.allocation.devices.config[{i}].opaque.parameters");
        let sharing = decode(&opaque.parameters.0, &key, target)?;
        if applies {
            out = sharing;
        }
    }
    Ok(out)
}

fn decode(value: &serde_json::Value, key: &str, target: Target) -> Result<SharingRecord, Error> {
    let err = |k: &str, message: String| Error {
        key: if k.is_empty() {
            key.to_string()
        } else {
            format!("{key}.{k}")
        },
        message,
    };
    let api_version = value.get("apiVersion").and_then(|v| v.as_str());
    if api_version != Some(API_VERSION) {
        return Err(err(
            "apiVersion",
            format!("{api_version:?} is not supported; use {API_VERSION:?}"),
        ));
    }
    let kind = value.get("kind").and_then(|v| v.as_str()).unwrap_or("");
    let expected = match target {
        Target::Gpu => "GpuConfig",
        Target::Mig => "MigDeviceConfig",
    };
    if kind != "GpuConfig" && kind != "MigDeviceConfig" {
        return Err(err(
            "kind",
            format!("unknown kind {kind:?}; expected GpuConfig or MigDeviceConfig"),
        ));
    }
    if kind != expected {
        return Err(err(
            "kind",
            format!("{kind} cannot configure a {target:?} device; use {expected}"),
        ));
    }
    let cfg: GpuConfig = serde_path_to_error::deserialize(value.clone())
        .map_err(|e| err(&e.path().to_string(), e.into_inner().to_string()))?;
    let Some(sharing) = cfg.sharing else {
        return Ok(SharingRecord::Exclusive);
    };
    match sharing.strategy {
        Strategy::TimeSlicing => {
            if sharing.mps_config.is_some() {
                return Err(err(
                    "sharing.mpsConfig",
                    "set only with strategy MPS".into(),
                ));
            }
            if target == Target::Mig {
                return Err(err(
                    "sharing.strategy",
                    "MIG devices cannot be time-sliced by interval; use MPS or no sharing".into(),
                ));
            }
            Ok(SharingRecord::TimeSlicing {
                interval: sharing
                    .time_slicing_config
                    .and_then(|t| t.interval)
                    .unwrap_or_default(),
            })
        }
        Strategy::Mps => {
            if sharing.time_slicing_config.is_some() {
                return Err(err(
                    "sharing.timeSlicingConfig",
                    "set only with strategy TimeSlicing".into(),
                ));
            }
            let mps = sharing.mps_config;
            let pct = mps
                .as_ref()
                .and_then(|m| m.default_active_thread_percentage);
            if let Some(p) = pct
                && !(1..=100).contains(&p)
            {
                return Err(err(
                    "sharing.mpsConfig.defaultActiveThreadPercentage",
                    format!("{p} is not a percentage between 1 and 100"),
                ));
            }
            let limit = match mps.and_then(|m| m.default_pinned_device_memory_limit) {
                None => None,
                Some(q) => Some(parse_quantity(&q).ok_or_else(|| {
                    err(
                        "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit",
                        format!("{q:?} is not a quantity such as 10Gi"),
                    )
                })?),
            };
            Ok(SharingRecord::Mps {
                active_thread_percentage: pct,
                pinned_memory_limit: limit,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::resource::v1::OpaqueDeviceConfiguration;
    use k8s_openapi::apimachinery::pkg::runtime::RawExtension;

    fn entry(
        source: &str,
        requests: &[&str],
        params: serde_json::Value,
    ) -> DeviceAllocationConfiguration {
        DeviceAllocationConfiguration {
            source: source.into(),
            requests: Some(requests.iter().map(|s| s.to_string()).collect()),
            opaque: Some(OpaqueDeviceConfiguration {
                driver: "gpu.nvidia.com".into(),
                parameters: RawExtension(params),
            }),
        }
    }

    fn ts(interval: &str) -> serde_json::Value {
        serde_json::json!({"apiVersion": API_VERSION, "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}})
    }

    #[test]
    fn claim_overrides_class_and_requests_filter() {
        let entries = vec![
            entry("FromClaim", &["gpu"], ts("Long")),
            entry("FromClass", &[], ts("Short")),
            entry("FromClaim", &["other"], ts("Medium")),
        ];
        let r = |req| resolve(&entries, "gpu.nvidia.com", req, Target::Gpu).unwrap();
        assert_eq!(
            r("gpu"),
            SharingRecord::TimeSlicing {
                interval: TimeSlice::Long
            }
        );
        assert_eq!(
            r("gpu/sub"),
            SharingRecord::TimeSlicing {
                interval: TimeSlice::Long
            }
        );
        assert_eq!(
            r("x"),
            SharingRecord::TimeSlicing {
                interval: TimeSlice::Short
            }
        );
        assert_eq!(
            r("other"),
            SharingRecord::TimeSlicing {
                interval: TimeSlice::Medium
            }
        );
        assert_eq!(
            resolve(&[], "gpu.nvidia.com", "gpu", Target::Gpu).unwrap(),
            SharingRecord::Exclusive
        );
    }

    #[test]
    fn bad_configs_name_the_key() {
        let cases = [
            (
                serde_json::json!({"apiVersion": API_VERSION, "kind": "Nope"}),
                "parameters.kind",
            ),
            (
                serde_json::json!({"apiVersion": "v9", "kind": "GpuConfig"}),
                "parameters.apiVersion",
            ),
            (
                serde_json::json!({"apiVersion": API_VERSION, "kind": "GpuConfig", "sharng": {}}),
                "parameters",
            ),
            (
                serde_json::json!({"apiVersion": API_VERSION, "kind": "GpuConfig",
                    "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 150}}}),
                "defaultActiveThreadPercentage",
            ),
            (ts("Forever"), "sharing.timeSlicingConfig.interval"),
        ];
        for (params, key) in cases {
            let e = resolve(
                &[entry("FromClaim", &[], params.clone())],
                "gpu.nvidia.com",
                "gpu",
                Target::Gpu,
            )
            .unwrap_err();
            assert!(e.key.contains(key), "{params}: {e}");
            assert!(
                e.key.starts_with("status.allocation.devices.config[0]"),
                "{e}"
            );
        }
        // Another driver's config is not ours to judge.
        let mut other = entry("FromClaim", &[], serde_json::json!({"whatever": 1}));
        other.opaque.as_mut().unwrap().driver = "other.example.com".into();
        assert_eq!(
            resolve(&[other], "gpu.nvidia.com", "gpu", Target::Gpu).unwrap(),
            SharingRecord::Exclusive
        );
    }

    #[test]
    fn mps_and_mig() {
        let mps = serde_json::json!({"apiVersion": API_VERSION, "kind": "MigDeviceConfig",
            "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50,
            "defaultPinnedDeviceMemoryLimit": "10Gi"}}});
        let r = resolve(
            &[entry("FromClaim", &[], mps.clone())],
            "gpu.nvidia.com",
            "g",
            Target::Mig,
        )
        .unwrap();
        assert_eq!(
            r,
            SharingRecord::Mps {
                active_thread_percentage: Some(50),
                pinned_memory_limit: Some(10 << 30)
            }
        );
        let e = resolve(
            &[entry("FromClaim", &[], mps)],
            "gpu.nvidia.com",
            "g",
            Target::Gpu,
        )
        .unwrap_err();
        assert!(e.message.contains("use GpuConfig"), "{e}");
    }
}
