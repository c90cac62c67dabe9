//! From the parsed file to an [`Inventory`]: models resolved, semantic checks, generated ids.

use std::collections::{BTreeMap, BTreeSet};

use super::format::*;
use super::locate::locate;
use super::{CATALOG, Error, VERSION, parse_yaml};
use crate::inventory::{
    ClusterUuid, ComputeCapability, Fabric, Gpu, GpuUuid, Health, Inventory, Mig, MigDevice,
    MigProfile, MigUuid, NvLinkPeer, PciBusId, Placement,
};

/// Parses topology text. `seed` (normally the node name) makes generated UUIDs differ between
/// nodes that use the same profile, and stay the same across restarts of one node.
pub fn parse(source_name: &str, text: &str, seed: &str) -> Result<Inventory, Error> {
    let file: TopologyFile = parse_yaml(source_name, text)?;
    let err = |key: String, message: String| Error {
        source_name: source_name.to_string(),
        line: locate(text, &key),
        column: None,
        key,
        message,
    };
    if file.version != VERSION {
        return Err(err(
            "version".into(),
            format!(
                "unsupported topology version {:?}; this nvdra reads {VERSION:?}",
                file.version
            ),
        ));
    }
    let _ = file.description;
    let catalog: BTreeMap<String, ModelSpec> = parse_yaml("built-in model catalog", CATALOG)?;
    let switches: BTreeSet<&str> = file.nvswitches.iter().map(String::as_str).collect();
    let bus_of_index: BTreeMap<u32, &str> = file
        .gpus
        .iter()
        .map(|g| (g.index, g.pci_bus_id.as_str()))
        .collect();

    let mut gpus = Vec::with_capacity(file.gpus.len());
    for (i, spec) in file.gpus.iter().enumerate() {
        let at = |key: &str| format!("gpus[{i}].{key}");
        let model = file
            .models
            .get(&spec.model)
            .or_else(|| catalog.get(&spec.model))
            .ok_or_else(|| {
                let mut known: Vec<&str> = catalog.keys().map(String::as_str).collect();
                known.extend(file.models.keys().map(String::as_str));
                err(
                    at("model"),
                    format!(
                        "unknown GPU model {:?}; known models: {}",
                        spec.model,
                        known.join(", ")
                    ),
                )
            })?;
        let model_key = if file.models.contains_key(&spec.model) {
            format!("models.{}", spec.model)
        } else {
            format!("model {}", spec.model)
        };
        let cc = parse_cc(&model.compute_capability).ok_or_else(|| {
            err(
                format!("{model_key}.computeCapability"),
                format!(
                    "invalid compute capability {:?}: expected MAJOR.MINOR such as 9.0",
                    model.compute_capability
                ),
            )
        })?;
        let pci_bus_id = PciBusId::normalize(&spec.pci_bus_id).ok_or_else(|| {
            err(
                at("pciBusId"),
                format!(
                    "invalid PCI bus id {:?}: expected dddd:bb:dd.f such as 0000:07:00.0",
                    spec.pci_bus_id
                ),
            )
        })?;
        let mut nvlink_peers = BTreeSet::new();
        for (j, peer) in spec.nvlink_peers.iter().enumerate() {
            let bus = bus_of_index.get(peer).ok_or_else(|| {
                err(
                    format!("gpus[{i}].nvlinkPeers[{j}]"),
                    format!("no GPU with index {peer} in this topology"),
                )
            })?;
            if *peer == spec.index {
                return Err(err(
                    format!("gpus[{i}].nvlinkPeers[{j}]"),
                    "a GPU cannot be its own NVLink peer".into(),
                ));
            }
            let bus = PciBusId::normalize(bus).unwrap_or_else(|| PciBusId(bus.to_string()));
            nvlink_peers.insert(NvLinkPeer::Gpu(bus));
        }
        for (j, sw) in spec.nvlink_switches.iter().enumerate() {
            if !switches.contains(sw.as_str()) {
                return Err(err(
                    format!("gpus[{i}].nvlinkSwitches[{j}]"),
                    format!("NVSwitch {sw:?} is not declared in the top-level nvswitches list"),
                ));
            }
            nvlink_peers.insert(NvLinkPeer::Switch(sw.clone()));
        }

        let uuid = match &spec.uuid {
            Some(u) if u.starts_with("GPU-") && u.len() <= 64 => GpuUuid(u.clone()),
            Some(u) => {
                return Err(err(
                    at("uuid"),
                    format!("invalid GPU UUID {u:?}: expected GPU-… (at most 64 characters)"),
                ));
            }
            None => GpuUuid(format!(
                "GPU-{}",
                uuid_from(&[seed, source_name, &spec.index.to_string()])
            )),
        };

        let profiles: Vec<MigProfile> = model
            .mig
            .iter()
            .flat_map(|m| &m.profiles)
            .map(|p| MigProfile {
                name: p.name.clone(),
                gi_profile_id: p.id,
                memory_bytes: p.memory.0,
                multiprocessors: p.multiprocessors,
                engines: p.engines,
                max_instances: p.max_instances,
                placements: p
                    .starts
                    .iter()
                    .map(|&start| Placement {
                        start,
                        size: p.size,
                    })
                    .collect(),
            })
            .collect();

        let fabric = match &spec.fabric {
            None => None,
            Some(f) => Some(Fabric {
                cluster_uuid: ClusterUuid::parse(&f.cluster_uuid).ok_or_else(|| {
                    err(
                        at("fabric.clusterUuid"),
                        format!(
                            "invalid fabric cluster UUID {:?}: expected 8-4-4-4-12 hex digits \
                             such as 6c1f3a52-8d2e-4b7a-9f10-0123456789ab",
                            f.cluster_uuid
                        ),
                    )
                })?,
                clique_id: match f.trays_per_clique {
                    None => f.clique_id,
                    Some(0) => {
                        return Err(err(
                            at("fabric.traysPerClique"),
                            "traysPerClique must be at least 1 (NVL72: 18)".into(),
                        ));
                    }
                    Some(n) => f.clique_id.saturating_add(tray_number(seed) / n),
                },
            }),
        };

        let mut mig = Mig {
            capable: model.mig.is_some(),
            mode_unknown: false,
            enabled: false,
            pending: None,
            memory_slices: model.mig.as_ref().map_or(0, |m| m.memory_slices),
            devices: Vec::new(),
            profiles,
            ..Mig::default()
        };
        if let Some(m) = &spec.mig {
            if m.enabled && !mig.capable {
                return Err(err(
                    at("mig.enabled"),
                    format!("model {} does not support MIG", spec.model),
                ));
            }
            if !m.enabled && !m.devices.is_empty() {
                return Err(err(
                    at("mig.devices"),
                    "MIG devices listed but MIG is not enabled on this GPU".into(),
                ));
            }
            mig.enabled = m.enabled;
            for (j, d) in m.devices.iter().enumerate() {
                let key = format!("gpus[{i}].mig.devices[{j}]");
                let profile = mig
                    .profiles
                    .iter()
                    .find(|p| p.name == d.profile)
                    .ok_or_else(|| {
                        let names: Vec<&str> =
                            mig.profiles.iter().map(|p| p.name.as_str()).collect();
                        err(
                            format!("{key}.profile"),
                            format!(
                                "model {} has no MIG profile {:?}; it has: {}",
                                spec.model,
                                d.profile,
                                names.join(", ")
                            ),
                        )
                    })?;
                let placement = profile
                    .placements
                    .iter()
                    .find(|p| p.start == d.placement)
                    .copied()
                    .ok_or_else(|| {
                        let starts: Vec<String> = profile
                            .placements
                            .iter()
                            .map(|p| p.start.to_string())
                            .collect();
                        err(
                            format!("{key}.placement"),
                            format!(
                                "{} cannot start at memory slice {}; valid starts: {}",
                                profile.name,
                                d.placement,
                                starts.join(", ")
                            ),
                        )
                    })?;
                if let Some(other) = mig
                    .devices
                    .iter()
                    .find(|o| o.placement.overlaps(&placement))
                {
                    return Err(err(
                        format!("{key}.placement"),
                        format!(
                            "{} at {} overlaps {} at {} on the same GPU",
                            profile.name, placement.start, other.profile, other.placement.start
                        ),
                    ));
                }
                let gi_id = mig.devices.len() as u32 + 1;
                let uuid = match &d.uuid {
                    Some(u) if u.starts_with("MIG-") && u.len() <= 64 => MigUuid(u.clone()),
                    Some(u) => {
                        return Err(err(
                            format!("{key}.uuid"),
                            format!("invalid MIG UUID {u:?}: expected MIG-…"),
                        ));
                    }
                    None => MigUuid(format!(
                        "MIG-{}",
                        uuid_from(&[uuid.as_str(), &profile.name, &placement.start.to_string()])
                    )),
                };
                mig.devices.push(MigDevice {
                    uuid,
                    profile: profile.name.clone(),
                    gi_profile_id: profile.gi_profile_id,
                    gi_id,
                    ci_id: 0,
                    placement,
                    memory_bytes: profile.memory_bytes,
                    multiprocessors: profile.multiprocessors,
                    engines: profile.engines,
                    health: match &d.unhealthy {
                        Some(reason) => Health::Unhealthy {
                            reason: reason.clone(),
                        },
                        None => Health::Healthy,
                    },
                });
            }
        }

        gpus.push(Gpu {
            index: spec.index,
            minor: spec.minor.unwrap_or(spec.index),
            uuid,
            product_name: model.product_name.clone(),
            brand: Some(model.brand.clone()),
            architecture: Some(model.architecture.clone()),
            cuda_compute_capability: cc,
            driver_version: file.driver_version.clone(),
            cuda_driver_version: file.cuda_driver_version.clone(),
            memory_bytes: model.memory.0,
            multiprocessors: Some(model.multiprocessors),
            engines: model.engines,
            pcie_root: Some(
                spec.pcie_root
                    .clone()
                    .unwrap_or_else(|| default_pcie_root(&pci_bus_id)),
            ),
            pci_bus_id,
            numa_node: spec.numa_node,
            mig,
            nvlink_peers,
            nvlink_domain: 0,
            fabric,
            // Simulated GPUs are bare metal; a test makes one a VM guest through
            // `SimBackend::update`.
            virtualization: Some(crate::inventory::Virtualization::BareMetal),
            health: match &spec.unhealthy {
                Some(reason) => Health::Unhealthy {
                    reason: reason.clone(),
                },
                None => Health::Healthy,
            },
        });
    }
    Inventory::new(gpus).map_err(|e| {
        err(
            "gpus".into(),
            e.to_string().replace("invalid inventory: ", ""),
        )
    })
}

/// Simulated GPUs sit directly below a root port of their own bus's root complex.
pub(super) fn default_pcie_root(bus: &PciBusId) -> String {
    let (domain, bus) = bus.domain_and_bus();
    format!("pci{domain}:{bus}")
}

pub(super) fn parse_cc(s: &str) -> Option<ComputeCapability> {
    let (major, minor) = s.split_once('.')?;
    Some(ComputeCapability {
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
    })
}

/// FNV-1a, 64 bit: stable across Rust versions, unlike `DefaultHasher`.
pub(super) fn fnv1a(parts: &[&str], salt: u8) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ u64::from(salt);
    for p in parts {
        for b in p.bytes().chain(std::iter::once(0)) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    // splitmix64's finalizer, so that inputs differing in one character differ everywhere.
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The trailing number of a node name (`node-17` → 17, `gb200-rack1-tray03` → 3); 0 without one.
fn tray_number(seed: &str) -> u32 {
    let digits = seed.len() - seed.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    seed[seed.len() - digits..].parse().unwrap_or(0)
}

/// A deterministic UUID-shaped string from `parts`.
pub(crate) fn uuid_from(parts: &[&str]) -> String {
    let hex = format!("{:016x}{:016x}", fnv1a(parts, 1), fnv1a(parts, 2));
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}
