//! Simulated topology files: a versioned YAML description of a node's GPUs, and the built-in
//! profiles (`dgx-a100`, `dgx-h100`, …) written in the same format.
//!
//! A topology names a GPU *model* from the catalog (`models.yaml`, real figures for each product)
//! or from its own `models:` section, and adds what differs per GPU: PCI address, NUMA node,
//! NVLink wiring, MIG mode and instances, health. Unknown fields are errors; every error names the
//! file, the line where the parser knows it, and the key.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Deserializer};

use super::{
    ClusterUuid, ComputeCapability, Engines, Fabric, Gpu, GpuUuid, Health, Inventory, Mig,
    MigDevice, MigProfile, MigUuid, NvLinkPeer, PciBusId, Placement,
};

/// The only topology file version this build reads.
pub const VERSION: &str = "v1";

const CATALOG: &str = include_str!("profiles/models.yaml");

/// Built-in profiles: name, one-line description, file contents.
pub const PROFILES: &[(&str, &str, &str)] = &[
    (
        "dgx-a100",
        "8x A100-SXM4-80GB, 6 NVSwitches, 2 NUMA nodes",
        include_str!("profiles/dgx-a100.yaml"),
    ),
    (
        "dgx-a100-mig",
        "dgx-a100 with every GPU in MIG mode and no instances, for --partitionable",
        include_str!("profiles/dgx-a100-mig.yaml"),
    ),
    (
        "dgx-h100",
        "8x H100-SXM5-80GB, 4 NVSwitches, 2 NUMA nodes",
        include_str!("profiles/dgx-h100.yaml"),
    ),
    (
        "hgx-h200",
        "8x H200 141GB, 4 NVSwitches, 2 NUMA nodes",
        include_str!("profiles/hgx-h200.yaml"),
    ),
    (
        "l40s-pcie",
        "4x L40S on PCIe, no NVLink, 2 NUMA nodes",
        include_str!("profiles/l40s-pcie.yaml"),
    ),
    (
        "a100-mig-mixed",
        "4x A100-SXM4-40GB, two in MIG mode with instances of several profiles",
        include_str!("profiles/a100-mig-mixed.yaml"),
    ),
    (
        "pcie-pairs",
        "4x A100-PCIE-40GB as two NVLink-bridged pairs",
        include_str!("profiles/pcie-pairs.yaml"),
    ),
];

/// A problem in a topology file.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub struct Error {
    /// The file (or `profile <name>` for built-ins).
    pub source_name: String,
    pub line: Option<usize>,
    pub column: Option<usize>,
    /// The key path, e.g. `gpus[2].mig.devices[0].placement`.
    pub key: String,
    pub message: String,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.source_name)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(col) = self.column {
                write!(f, ":{col}")?;
            }
        }
        if self.key.is_empty() || self.key == "." {
            write!(f, ": {}", self.message)
        } else {
            write!(f, ": {}: {}", self.key, self.message)
        }
    }
}

/// Bytes, written as a Kubernetes quantity (`40Gi`, `4864Mi`) or a plain integer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Bytes(u64);

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Int(u64),
            Str(String),
        }
        match Raw::deserialize(d)? {
            Raw::Int(n) => Ok(Bytes(n)),
            Raw::Str(s) => super::parse_quantity(&s).map(Bytes).ok_or_else(|| {
                serde::de::Error::custom(format!(
                    "invalid quantity {s:?}: expected bytes such as 40Gi, 4864Mi or 1073741824"
                ))
            }),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ModelSpec {
    product_name: String,
    #[serde(default = "default_brand")]
    brand: String,
    architecture: String,
    compute_capability: String,
    memory: Bytes,
    multiprocessors: u32,
    #[serde(default)]
    engines: Engines,
    #[serde(default)]
    mig: Option<ModelMig>,
}

fn default_brand() -> String {
    "Nvidia".into()
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ModelMig {
    memory_slices: u32,
    profiles: Vec<ModelMigProfile>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ModelMigProfile {
    name: String,
    id: u32,
    memory: Bytes,
    multiprocessors: u32,
    #[serde(default)]
    engines: Engines,
    max_instances: u32,
    size: u32,
    starts: Vec<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TopologyFile {
    version: String,
    #[serde(default)]
    description: Option<String>,
    driver_version: String,
    cuda_driver_version: String,
    #[serde(default)]
    models: BTreeMap<String, ModelSpec>,
    #[serde(default)]
    nvswitches: Vec<String>,
    gpus: Vec<GpuSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GpuSpec {
    index: u32,
    model: String,
    #[serde(default)]
    minor: Option<u32>,
    #[serde(default)]
    uuid: Option<String>,
    pci_bus_id: String,
    #[serde(default)]
    pcie_root: Option<String>,
    #[serde(default)]
    numa_node: Option<u32>,
    /// Indices of GPUs this one is bridged to.
    #[serde(default)]
    nvlink_peers: Vec<u32>,
    /// Ids of NVSwitches (from the top-level `nvswitches`) this GPU links to.
    #[serde(default)]
    nvlink_switches: Vec<String>,
    #[serde(default)]
    mig: Option<GpuMigSpec>,
    /// The NVLink fabric registration NVML would report as completed (multi-node NVLink).
    #[serde(default)]
    fabric: Option<FabricSpec>,
    /// When set, the GPU is unhealthy for this reason.
    #[serde(default)]
    unhealthy: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct FabricSpec {
    /// The fabric cluster's UUID, 8-4-4-4-12 hex digits.
    cluster_uuid: String,
    clique_id: u32,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GpuMigSpec {
    enabled: bool,
    #[serde(default)]
    devices: Vec<MigDeviceSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct MigDeviceSpec {
    profile: String,
    placement: u32,
    #[serde(default)]
    uuid: Option<String>,
    #[serde(default)]
    unhealthy: Option<String>,
}

/// Parses YAML into `T`, turning serde errors into [`Error`]s with line, column and key path.
fn parse_yaml<T: for<'de> Deserialize<'de>>(source_name: &str, text: &str) -> Result<T, Error> {
    crate::yaml::from_str(text).map_err(|e| {
        let crate::yaml::ParseError {
            path,
            line,
            column,
            message,
        } = e;
        Error {
            source_name: source_name.to_string(),
            line,
            column,
            key: path,
            message,
        }
    })
}

/// Returns the text of a built-in profile.
pub fn builtin(name: &str) -> Option<&'static str> {
    PROFILES
        .iter()
        .find(|(n, _, _)| *n == name)
        .map(|(_, _, text)| *text)
}

/// Names of the built-in profiles, for error messages and `--help`.
pub fn profile_names() -> Vec<&'static str> {
    PROFILES.iter().map(|(n, _, _)| *n).collect()
}

/// Reads and parses a topology file.
pub fn load_file(path: &Path, seed: &str) -> Result<Inventory, Error> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| Error {
        source_name: name.clone(),
        line: None,
        column: None,
        key: String::new(),
        message: format!("cannot read topology file: {e}"),
    })?;
    parse(&name, &text, seed)
}

/// Parses a built-in profile by name.
pub fn load_profile(name: &str, seed: &str) -> Result<Inventory, Error> {
    let text = builtin(name).ok_or_else(|| Error {
        source_name: format!("profile {name}"),
        line: None,
        column: None,
        key: String::new(),
        message: format!(
            "no built-in profile named {name:?}; choose one of: {}",
            profile_names().join(", ")
        ),
    })?;
    parse(&format!("profile {name}"), text, seed)
}

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
                clique_id: f.clique_id,
            }),
        };

        let mut mig = Mig {
            capable: model.mig.is_some(),
            mode_unknown: false,
            enabled: false,
            memory_slices: model.mig.as_ref().map_or(0, |m| m.memory_slices),
            devices: Vec::new(),
            profiles,
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

/// One step of a key path such as `gpus[2].mig.devices[0].placement`.
#[derive(Debug, PartialEq, Eq)]
enum Step<'a> {
    Key(&'a str),
    Index(usize),
}

fn steps(path: &str) -> Option<Vec<Step<'_>>> {
    let mut out = Vec::new();
    for part in path.split('.') {
        let (key, mut rest) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        if !key.is_empty() {
            out.push(Step::Key(key));
        }
        while let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']')?;
            out.push(Step::Index(r[..end].parse().ok()?));
            rest = &r[end + 1..];
        }
    }
    Some(out)
}

/// The 1-based line of `path` in block-style YAML `text`, for errors found after parsing (serde
/// knows lines only while it parses). Follows keys and `- ` sequence items by indentation; a
/// step inside a flow collection (`{…}`, `[…]`) resolves to the line that holds it. `None` when
/// the text is laid out in a way this simple walk does not follow.
fn locate(text: &str, path: &str) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let content = |l: &str| {
        let t = l.trim();
        !t.is_empty() && !t.starts_with('#')
    };
    // The current node: lines [from, to) whose content is indented more than `parent`.
    let (mut from, mut to, mut parent) = (0usize, lines.len(), -1i64);
    let mut found: Option<usize> = None;
    for step in steps(path)? {
        if found
            .is_some_and(|l| lines[l].contains(['{', '[']) && !lines[l].trim_end().ends_with(':'))
        {
            // Inside a flow collection on this line: it is as precise as we get.
            break;
        }
        let hit = match step {
            Step::Key(k) => (from..to).find(|&i| {
                let l = lines[i];
                let t = l.trim_start().trim_start_matches("- ");
                content(l)
                    && indent(l) as i64 > parent
                    && (t.starts_with(&format!("{k}:")) || t.starts_with(&format!("{{{k}:")))
            }),
            Step::Index(n) => {
                let items: Vec<usize> = (from..to)
                    .filter(|&i| content(lines[i]) && lines[i].trim_start().starts_with("- "))
                    .collect();
                let first_indent = items.first().map(|&i| indent(lines[i]))?;
                items
                    .into_iter()
                    .filter(|&i| indent(lines[i]) == first_indent)
                    .nth(n)
            }
        };
        let line = match (hit, found) {
            (Some(l), _) => l,
            // A flow sequence (`key: [a, b]`) holds its items on the key's line.
            (None, Some(prev)) if matches!(step, Step::Index(_)) && lines[prev].contains('[') => {
                prev
            }
            _ => return None,
        };
        let own = indent(lines[line]);
        // The node ends at the next content line indented no deeper than this one (for a
        // sequence item, no deeper than its dash).
        let end = (line + 1..to)
            .find(|&i| content(lines[i]) && indent(lines[i]) <= own)
            .unwrap_or(to);
        from = line;
        to = end;
        parent = match step {
            Step::Index(_) => own as i64,
            // `- key:` starts a mapping whose keys sit deeper than the dash.
            Step::Key(_) => {
                let t = lines[line].trim_start();
                (own + t.len() - t.trim_start_matches("- ").len()) as i64
            }
        };
        found = Some(line);
    }
    found.map(|l| l + 1)
}

/// Simulated GPUs sit directly below a root port of their own bus's root complex.
fn default_pcie_root(bus: &PciBusId) -> String {
    let (domain, bus) = bus.domain_and_bus();
    format!("pci{domain}:{bus}")
}

fn parse_cc(s: &str) -> Option<ComputeCapability> {
    let (major, minor) = s.split_once('.')?;
    Some(ComputeCapability {
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
    })
}

/// FNV-1a, 64 bit: stable across Rust versions, unlike `DefaultHasher`.
fn fnv1a(parts: &[&str], salt: u8) -> u64 {
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

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
version: v1
driverVersion: "570.124.06"
cudaDriverVersion: "12.8"
gpus:
  - index: 0
    model: H100-SXM5-80GB
    pciBusId: "0000:1A:00.0"
    numaNode: 0
"#;

    fn parse_err(text: &str) -> Error {
        parse("t.yaml", text, "node-a").unwrap_err()
    }

    #[test]
    fn catalog_mig_names_follow_nvidias_naming_rule() {
        // NVIDIA derives "<G>g.<GB>gb" from the profile's memory share; a catalog entry whose
        // figures contradict its name would publish a name a real GPU never has.
        let catalog: BTreeMap<String, ModelSpec> = parse_yaml("catalog", CATALOG).unwrap();
        let mut checked = 0;
        for (model, spec) in &catalog {
            for p in spec.mig.iter().flat_map(|m| &m.profiles) {
                let gb = crate::inventory::nvml::mig_memory_gb(spec.memory.0, p.memory.0 >> 20);
                let base = p.name.split('+').next().unwrap();
                let slices = base.split('g').next().unwrap();
                assert_eq!(base, format!("{slices}g.{gb}gb"), "{model} {}", p.name);
                assert!(p.memory.0 <= spec.memory.0, "{model} {}", p.name);
                checked += 1;
            }
        }
        assert!(checked >= 28, "{checked}");
    }

    #[test]
    fn every_builtin_profile_parses() {
        for (name, _, _) in PROFILES {
            let inv = load_profile(name, "node-a").unwrap_or_else(|e| panic!("{name}: {e}"));
            assert!(!inv.gpus.is_empty(), "{name}");
        }
    }

    #[test]
    fn minimal_file_fills_model_figures() {
        let inv = parse("t.yaml", MINIMAL, "node-a").unwrap();
        let g = &inv.gpus[0];
        assert_eq!(g.product_name, "NVIDIA H100 80GB HBM3");
        assert_eq!(g.memory_bytes, 80 << 30);
        assert_eq!(g.cuda_compute_capability.to_string(), "9.0");
        assert_eq!(g.pci_bus_id.as_str(), "0000:1a:00.0");
        assert_eq!(g.pcie_root.as_deref(), Some("pci0000:1a"));
        assert_eq!(g.minor, 0);
        assert!(g.mig.capable && !g.mig.enabled);
        assert!(g.uuid.as_str().starts_with("GPU-"));
    }

    #[test]
    fn uuids_are_stable_per_seed_and_differ_between_nodes() {
        let a1 = parse("t.yaml", MINIMAL, "node-a").unwrap();
        let a2 = parse("t.yaml", MINIMAL, "node-a").unwrap();
        let b = parse("t.yaml", MINIMAL, "node-b").unwrap();
        assert_eq!(a1.gpus[0].uuid, a2.gpus[0].uuid);
        assert_ne!(a1.gpus[0].uuid, b.gpus[0].uuid);
        assert_eq!(a1.gpus[0].uuid.as_str().len(), "GPU-".len() + 36);
    }

    #[test]
    fn unknown_field_names_line_and_key() {
        let text = MINIMAL.replace("numaNode: 0", "numaNode: 0\n    memry: 1Gi");
        let e = parse_err(&text);
        assert_eq!(e.source_name, "t.yaml");
        assert_eq!(e.line, Some(10), "{e}");
        assert!(e.key.starts_with("gpus[0]"), "{e}");
        assert!(e.message.contains("unknown field `memry`"), "{e}");
        assert!(e.to_string().starts_with("t.yaml:10:"), "{e}");
    }

    #[test]
    fn wrong_type_names_key() {
        let e = parse_err(&MINIMAL.replace("numaNode: 0", "numaNode: zero"));
        assert_eq!(e.key, "gpus[0].numaNode", "{e}");
        assert_eq!(e.line, Some(9), "{e}");
    }

    #[test]
    fn errors_found_after_parsing_still_name_the_line() {
        let e = parse_err(&MINIMAL.replace("H100-SXM5-80GB", "H900"));
        assert_eq!((e.key.as_str(), e.line), ("gpus[0].model", Some(7)), "{e}");
        assert!(e.to_string().starts_with("t.yaml:7: gpus[0].model:"), "{e}");
        let e = parse_err(&MINIMAL.replace("0000:1A:00.0", "1A:00"));
        assert_eq!(e.line, Some(8), "{e}");
        let e = parse_err(&MINIMAL.replace("version: v1", "version: v9"));
        assert_eq!(e.line, Some(2), "{e}");

        // Second GPU, inside a flow mapping of a MIG device list.
        let text = format!(
            "{MINIMAL}  - index: 1\n    model: H100-SXM5-80GB\n    pciBusId: \"0000:1B:00.0\"\n    mig:\n      enabled: true\n      devices:\n        - {{profile: 3g.40gb, placement: 0}}\n        - {{profile: 3g.40gb, placement: 2}}\n"
        );
        let e = parse_err(&text);
        assert_eq!(e.key, "gpus[1].mig.devices[1].placement", "{e}");
        assert_eq!(e.line, Some(17), "{e}");
        // A flow sequence item resolves to its key's line.
        let e = parse_err(&MINIMAL.replace("numaNode: 0", "nvlinkPeers: [3]"));
        assert_eq!(e.line, Some(9), "{e}");
    }

    #[test]
    fn key_paths_parse() {
        assert_eq!(
            steps("gpus[2].mig.devices[10].placement").unwrap(),
            vec![
                Step::Key("gpus"),
                Step::Index(2),
                Step::Key("mig"),
                Step::Key("devices"),
                Step::Index(10),
                Step::Key("placement")
            ]
        );
        assert!(steps("gpus[x]").is_none());
        assert_eq!(locate("a: 1\n", "b"), None);
    }

    #[test]
    fn missing_required_field() {
        let e = parse_err(&MINIMAL.replace("    pciBusId: \"0000:1A:00.0\"\n", ""));
        assert!(e.message.contains("missing field `pciBusId`"), "{e}");
    }

    #[test]
    fn malformed_yaml() {
        let e = parse_err("version: v1\ngpus: [\n");
        assert!(e.line.is_some(), "{e}");
    }

    #[test]
    fn wrong_version() {
        let e = parse_err(&MINIMAL.replace("version: v1", "version: v9"));
        assert_eq!(e.key, "version");
        assert!(e.message.contains("\"v9\""), "{e}");
    }

    #[test]
    fn unknown_model_lists_known_ones() {
        let e = parse_err(&MINIMAL.replace("H100-SXM5-80GB", "H900"));
        assert_eq!(e.key, "gpus[0].model");
        assert!(e.message.contains("A100-SXM4-40GB"), "{e}");
    }

    #[test]
    fn bad_pci_bus_id() {
        let e = parse_err(&MINIMAL.replace("0000:1A:00.0", "1A:00"));
        assert_eq!(e.key, "gpus[0].pciBusId");
    }

    #[test]
    fn bad_quantity_in_custom_model() {
        let text = format!(
            "{MINIMAL}models:\n  X:\n    productName: X\n    architecture: Hopper\n    computeCapability: \"9.0\"\n    memory: lots\n    multiprocessors: 1\n"
        );
        let e = parse_err(&text);
        assert_eq!(e.key, "models.X.memory", "{e}");
        assert!(e.message.contains("invalid quantity \"lots\""), "{e}");
    }

    #[test]
    fn custom_model_is_used() {
        let text = format!(
            "{}models:\n  X:\n    productName: NVIDIA X\n    architecture: Blackwell\n    computeCapability: \"10.0\"\n    memory: 180Gi\n    multiprocessors: 148\n",
            MINIMAL.replace("H100-SXM5-80GB", "X")
        );
        let inv = parse("t.yaml", &text, "n").unwrap();
        assert_eq!(inv.gpus[0].product_name, "NVIDIA X");
        assert_eq!(inv.gpus[0].cuda_compute_capability.major, 10);
        assert!(!inv.gpus[0].mig.capable);
    }

    #[test]
    fn duplicate_index_is_rejected() {
        let text = format!(
            "{MINIMAL}  - index: 0\n    model: H100-SXM5-80GB\n    pciBusId: \"0000:1B:00.0\"\n"
        );
        let e = parse_err(&text);
        assert!(e.message.contains("share the index 0"), "{e}");
    }

    #[test]
    fn nvlink_references_are_checked() {
        let e = parse_err(&MINIMAL.replace("numaNode: 0", "nvlinkPeers: [3]"));
        assert_eq!(e.key, "gpus[0].nvlinkPeers[0]");
        let e = parse_err(&MINIMAL.replace("numaNode: 0", "nvlinkSwitches: [sw9]"));
        assert_eq!(e.key, "gpus[0].nvlinkSwitches[0]");
        assert!(e.message.contains("sw9"), "{e}");
    }

    #[test]
    fn mig_devices_are_validated() {
        let with_mig = |devices: &str| {
            MINIMAL.replace(
                "numaNode: 0",
                &format!("mig:\n      enabled: true\n      devices:\n{devices}"),
            )
        };
        let e = parse_err(&with_mig("        - {profile: 9g.99gb, placement: 0}\n"));
        assert_eq!(e.key, "gpus[0].mig.devices[0].profile");
        assert!(e.message.contains("3g.40gb"), "{e}");
        let e = parse_err(&with_mig("        - {profile: 3g.40gb, placement: 2}\n"));
        assert_eq!(e.key, "gpus[0].mig.devices[0].placement");
        assert!(e.message.contains("valid starts: 0, 4"), "{e}");
        let e = parse_err(&with_mig(
            "        - {profile: 3g.40gb, placement: 4}\n        - {profile: 1g.10gb, placement: 5}\n",
        ));
        assert_eq!(e.key, "gpus[0].mig.devices[1].placement");
        assert!(e.message.contains("overlaps"), "{e}");

        let inv = parse(
            "t.yaml",
            &with_mig(
                "        - {profile: 3g.40gb, placement: 4}\n        - {profile: 1g.10gb, placement: 0}\n",
            ),
            "n",
        )
        .unwrap();
        let m = &inv.gpus[0].mig;
        assert!(m.enabled);
        assert_eq!(m.devices.len(), 2);
        assert_eq!(m.devices[0].gi_id, 1);
        assert_eq!(m.devices[1].placement, Placement { start: 0, size: 1 });
        assert!(m.devices[1].uuid.as_str().starts_with("MIG-"));
    }

    #[test]
    fn fabric_registration_is_optional_and_validated() {
        let inv = parse("t.yaml", MINIMAL, "n").unwrap();
        assert_eq!(inv.gpus[0].fabric, None);

        let text = MINIMAL.replace(
            "numaNode: 0",
            "numaNode: 0\n    fabric: {clusterUuid: 6C1F3A52-8D2E-4B7A-9F10-0123456789AB, cliqueId: 7}",
        );
        let inv = parse("t.yaml", &text, "n").unwrap();
        let f = inv.gpus[0].fabric.as_ref().unwrap();
        assert_eq!(
            f.cluster_uuid.as_str(),
            "6c1f3a52-8d2e-4b7a-9f10-0123456789ab",
            "normalized to lower case"
        );
        assert_eq!(f.clique_id, 7);

        let e = parse_err(&text.replace("6C1F3A52-8D2E", "6C1F3A52"));
        assert_eq!(e.key, "gpus[0].fabric.clusterUuid", "{e}");
        assert_eq!(e.line, Some(10), "{e}");
        assert!(e.message.contains("8-4-4-4-12"), "{e}");
        let e = parse_err(&text.replace("cliqueId: 7", "cliqueId: 7, state: done"));
        assert!(e.message.contains("unknown field `state`"), "{e}");
        let e = parse_err(&text.replace(", cliqueId: 7", ""));
        assert!(e.message.contains("missing field `cliqueId`"), "{e}");
    }

    #[test]
    fn mig_on_incapable_model_is_rejected() {
        let text = MINIMAL
            .replace("H100-SXM5-80GB", "L40S")
            .replace("numaNode: 0", "mig: {enabled: true}");
        let e = parse_err(&text);
        assert_eq!(e.key, "gpus[0].mig.enabled");
    }

    #[test]
    fn unknown_profile_name_lists_choices() {
        let e = load_profile("dgx-z", "n").unwrap_err();
        assert!(e.to_string().contains("dgx-h100"), "{e}");
    }

    #[test]
    fn missing_file_names_it() {
        let e = load_file(Path::new("/nonexistent/topo.yaml"), "n").unwrap_err();
        assert!(
            e.to_string()
                .starts_with("/nonexistent/topo.yaml: cannot read"),
            "{e}"
        );
    }
}
