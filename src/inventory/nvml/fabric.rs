//! NVLink wiring and NVLink fabric registration: the raw answers and their (pure) mapping.
//!
//! Two things real drivers report that a naive reading gets wrong:
//!
//! - On NVSwitch baseboards (DGX/HGX A100, H100, H200, B200) the switches are not PCI functions of
//!   the host, and `nvmlDeviceGetNvLinkRemotePciInfo_v2` answers the invalid address
//!   `FFFFFFFF:FF:FF.0` (domain `0xFFFFFFFF`, bus and device `0xFF`; drivers differ in how the
//!   bus-id string reads, so the numeric fields decide). Such a link, typed SWITCH, reaches one of
//!   the node's NVSwitches: all of them share the id [`NODE_NVSWITCHES`], so every GPU linked to
//!   them lands in one NVLink domain. A sentinel link whose remote type is unknown says nothing
//!   and is ignored.
//! - `nvmlDeviceGetGpuFabricInfoV` (Hopper and later) reports a registration with the fabric
//!   manager. Only a completed one with a successful status and a non-zero cluster UUID is a
//!   fabric to publish; single-node NVSwitch systems complete with a zero UUID.

use std::collections::BTreeSet;

use tracing::Level;

use super::{CallError, Omission, RawResult};
use crate::inventory::{ClusterUuid, Fabric, GpuUuid, NODE_NVSWITCHES, NvLinkPeer, PciBusId};

/// What NVML says is at the far end of a link.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteDevice {
    Gpu,
    Switch,
    IbmNpu,
    Unknown,
}

/// The remote end's PCI address as `nvmlDeviceGetNvLinkRemotePciInfo_v2` fills it in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawPci {
    /// As NVML formats it, e.g. `00000000:07:00.0` (or `FFFFFFFF:FF:FF.0`, or empty).
    pub bus_id: String,
    pub domain: u32,
    pub bus: u32,
    pub device: u32,
}

impl RawPci {
    /// True for the invalid address NVML reports for an NVSwitch that is not a host PCI device:
    /// all-ones domain (32 or 16 bits), bus and device `0xFF`, in the numeric fields or, where a
    /// driver leaves those zero, in the bus-id string.
    pub fn is_sentinel(&self) -> bool {
        let numeric =
            matches!(self.domain, 0xFFFF_FFFF | 0xFFFF) && self.bus == 0xFF && self.device == 0xFF;
        numeric || bus_id_is_sentinel(&self.bus_id)
    }
}

fn bus_id_is_sentinel(s: &str) -> bool {
    let mut parts = s.trim().splitn(3, ':');
    let (Some(domain), Some(bus), Some(devfn)) = (parts.next(), parts.next(), parts.next()) else {
        return false;
    };
    let dev = devfn.split('.').next().unwrap_or_default();
    let all_f = |p: &str| !p.is_empty() && p.bytes().all(|b| b.eq_ignore_ascii_case(&b'f'));
    all_f(domain)
        && domain.len() >= 4
        && bus.eq_ignore_ascii_case("ff")
        && dev.eq_ignore_ascii_case("ff")
}

/// One active NVLink.
#[derive(Clone, Debug)]
pub struct RawNvLink {
    pub link: u32,
    pub remote_pci: RawResult<RawPci>,
    pub remote_type: RawResult<RemoteDevice>,
}

/// `nvmlGpuFabricState_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FabricState {
    NotSupported,
    NotStarted,
    InProgress,
    Completed,
    /// A state this build does not know.
    Other(u8),
}

impl FabricState {
    pub fn from_raw(state: u8) -> Self {
        use nvml_wrapper_sys::bindings as b;
        match u32::from(state) {
            b::NVML_GPU_FABRIC_STATE_NOT_SUPPORTED => Self::NotSupported,
            b::NVML_GPU_FABRIC_STATE_NOT_STARTED => Self::NotStarted,
            b::NVML_GPU_FABRIC_STATE_IN_PROGRESS => Self::InProgress,
            b::NVML_GPU_FABRIC_STATE_COMPLETED => Self::Completed,
            _ => Self::Other(state),
        }
    }
}

/// A GPU's NVLink fabric registration, from `nvmlDeviceGetGpuFabricInfoV` (or the older
/// `nvmlDeviceGetGpuFabricInfo` where the driver lacks it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawFabric {
    pub cluster_uuid: [u8; 16],
    pub clique_id: u32,
    pub state: FabricState,
    /// The registration's own result; meaningful once `state` is completed.
    pub status: RawResult<()>,
}

/// The distinct NVLink peers of GPU `index` (PCI bus id `own`), and at most one debug note for
/// the links that say nothing usable.
pub(super) fn map_nvlinks(
    gpu: (u32, &GpuUuid),
    own: &PciBusId,
    links: &[RawNvLink],
    node_buses: &BTreeSet<PciBusId>,
    notes: &mut Vec<Omission>,
) -> BTreeSet<NvLinkPeer> {
    enum Remote {
        Bus(PciBusId),
        Sentinel,
        Unreadable(String),
    }
    let mut peers = BTreeSet::new();
    let mut ignored = Vec::new();
    for l in links {
        let remote = match &l.remote_pci {
            Ok(p) if p.is_sentinel() => Remote::Sentinel,
            Ok(p) => match PciBusId::normalize(&p.bus_id) {
                Some(bus) => Remote::Bus(bus),
                None => Remote::Unreadable(format!("invalid PCI bus id {:?}", p.bus_id)),
            },
            Err(e) => Remote::Unreadable(e.to_string()),
        };
        let peer = match (remote, &l.remote_type) {
            (_, Ok(RemoteDevice::IbmNpu)) => continue,
            (Remote::Bus(bus), _) if bus == *own => continue,
            (Remote::Bus(bus), Ok(RemoteDevice::Gpu)) => NvLinkPeer::Gpu(bus),
            (Remote::Bus(bus), Ok(RemoteDevice::Switch)) => NvLinkPeer::Switch(bus.0),
            // Older drivers cannot say: a GPU of this node is a GPU, anything else a switch.
            (Remote::Bus(bus), Ok(RemoteDevice::Unknown) | Err(_)) if node_buses.contains(&bus) => {
                NvLinkPeer::Gpu(bus)
            }
            (Remote::Bus(bus), Ok(RemoteDevice::Unknown) | Err(_)) => NvLinkPeer::Switch(bus.0),
            // A switch without a usable address is still one of the switches this node's GPUs
            // reach, and those form one fabric.
            (Remote::Sentinel | Remote::Unreadable(_), Ok(RemoteDevice::Switch)) => {
                NvLinkPeer::Switch(NODE_NVSWITCHES.into())
            }
            (Remote::Sentinel, kind) => {
                let kind = match kind {
                    Ok(k) => format!("{k:?}"),
                    Err(e) => format!("unknown ({e})"),
                };
                ignored.push((
                    l.link,
                    format!("remote at the invalid PCI address FFFFFFFF:FF:FF.0, type {kind}"),
                ));
                continue;
            }
            (Remote::Unreadable(why), _) => {
                ignored.push((l.link, format!("remote address unknown: {why}")));
                continue;
            }
        };
        peers.insert(peer);
    }
    if let Some((link, why)) = ignored.first() {
        let others = ignored.len() - 1;
        notes.push(Omission {
            gpu_index: gpu.0,
            gpu: gpu.1.clone(),
            field: "nvlinkPeers",
            reason: format!(
                "ignoring NVLink {link} ({why}){}",
                match others {
                    0 => String::new(),
                    n => format!(" and {n} more"),
                }
            ),
            level: Level::DEBUG,
        });
    }
    peers
}

/// The note of a registration in transition: nothing is published, nothing fails; each read
/// asks again (NVIDIA's plugin crashed on these at start-up, its issue 1264).
const TRANSITION: &str = "registration in transition, no fabric published until the fabric \
                          manager completes it (asked again at the next rescan)";

/// The fabric to publish for one GPU, or `None` with a note saying why not.
pub(super) fn map_fabric(
    gpu: (u32, &GpuUuid),
    fabric: RawResult<RawFabric>,
    notes: &mut Vec<Omission>,
) -> Option<Fabric> {
    let mut note = |level, reason: String| {
        notes.push(Omission {
            gpu_index: gpu.0,
            gpu: gpu.1.clone(),
            field: "fabric",
            reason,
            level,
        });
    };
    let f = match fabric {
        Ok(f) => f,
        Err(CallError::NotSupported) => {
            note(Level::DEBUG, "the GPU has no NVLink fabric support".into());
            return None;
        }
        Err(CallError::NotReady) => {
            note(
                Level::INFO,
                format!("{TRANSITION} (NVML answers not ready)"),
            );
            return None;
        }
        Err(e @ CallError::Missing(_)) => {
            note(
                Level::DEBUG,
                format!("the driver is older than the fabric API: {e}"),
            );
            return None;
        }
        Err(e) => {
            note(
                Level::WARN,
                format!("nvmlDeviceGetGpuFabricInfoV failed: {e}"),
            );
            return None;
        }
    };
    match f.state {
        FabricState::Completed => {}
        FabricState::NotSupported => {
            note(Level::DEBUG, "the GPU has no NVLink fabric support".into());
            return None;
        }
        FabricState::NotStarted | FabricState::InProgress => {
            note(Level::INFO, format!("{TRANSITION} (state {:?})", f.state));
            return None;
        }
        FabricState::Other(n) => {
            note(Level::WARN, format!("unknown registration state {n}"));
            return None;
        }
    }
    match f.status {
        Ok(()) => {}
        Err(CallError::NotReady) => {
            note(
                Level::INFO,
                format!("{TRANSITION} (completed, status not ready)"),
            );
            return None;
        }
        Err(e) => {
            note(Level::WARN, format!("registration failed: {e}"));
            return None;
        }
    }
    if f.cluster_uuid == [0; 16] {
        note(
            Level::DEBUG,
            "registered, but not in a multi-node NVLink cluster (zero cluster UUID)".into(),
        );
        return None;
    }
    Some(Fabric {
        cluster_uuid: ClusterUuid::from_bytes(f.cluster_uuid),
        clique_id: f.clique_id,
    })
}
