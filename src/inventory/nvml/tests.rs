//! Tests of the NVML backend through its seam: hand-built [`RawNode`]s shaped like what NVML
//! returns on real node types, mapped with an in-memory sysfs.

use std::collections::BTreeMap;

use nvml_wrapper_sys::bindings as b;

use super::*;
use crate::inventory::{NODE_NVSWITCHES, NvLinkPeer};

/// An in-memory sysfs: symlink targets and `numa_node` contents by normalized bus id.
#[derive(Default)]
struct MapSysfs {
    links: BTreeMap<String, PathBuf>,
    numa: BTreeMap<String, String>,
}

impl MapSysfs {
    /// Places `bus` under root complex `root` (e.g. `pci0000:00`) on NUMA node `numa`.
    fn device(mut self, bus: &str, root: &str, numa: &str) -> Self {
        self.links.insert(
            bus.into(),
            format!("../../../devices/{root}/0000:00:01.0/{bus}").into(),
        );
        self.numa.insert(bus.into(), numa.into());
        self
    }
}

impl Sysfs for MapSysfs {
    fn pci_device_link(&self, bus: &PciBusId) -> Option<PathBuf> {
        self.links.get(bus.as_str()).cloned()
    }
    fn pci_numa_node(&self, bus: &PciBusId) -> Option<String> {
        self.numa.get(bus.as_str()).cloned()
    }
}

const MIB_: u64 = 1 << 20;

fn node(gpus: Vec<RawGpu>) -> RawNode {
    RawNode {
        driver_version: Ok("550.163.01".into()),
        cuda_driver_version: Ok(12040),
        gpus,
        unreadable: Vec::new(),
    }
}

/// An H100 80GB HBM3 as NVML describes it: no attributes on a full GPU, cores instead.
fn h100(index: u32, bus: &str) -> RawGpu {
    RawGpu {
        index,
        minor: Ok(index),
        uuid: Ok(format!("GPU-00000000-0000-0000-0000-00000000000{index}")),
        name: Ok("NVIDIA H100 80GB HBM3".into()),
        brand: Ok(Brand::Nvidia),
        architecture: Ok(DeviceArchitecture::Hopper),
        compute_capability: Ok(ComputeCapability { major: 9, minor: 0 }),
        memory_total_bytes: Ok(81559 * MIB_),
        attributes: Err(CallError::NotSupported),
        cuda_cores: Ok(16896),
        pci_bus_id: Ok(bus.into()),
        numa_node: Err(CallError::NotSupported),
        mig_mode: Ok(RawMigMode {
            current: false,
            pending: false,
        }),
        gi_profiles: Vec::new(),
        mig_devices: Vec::new(),
        nvlinks: Vec::new(),
        // What a single-node HGX reports: registered with the local fabric manager, no cluster.
        fabric: Ok(RawFabric {
            cluster_uuid: [0; 16],
            clique_id: 0,
            state: FabricState::Completed,
            status: Ok(()),
        }),
    }
}

fn l40s(index: u32, bus: &str) -> RawGpu {
    RawGpu {
        name: Ok("NVIDIA L40S".into()),
        architecture: Ok(DeviceArchitecture::Ada),
        compute_capability: Ok(ComputeCapability { major: 8, minor: 9 }),
        memory_total_bytes: Ok(46068 * MIB_),
        cuda_cores: Ok(18176),
        mig_mode: Err(CallError::NotSupported),
        fabric: Err(CallError::NotSupported),
        ..h100(index, bus)
    }
}

fn a100_40gb(index: u32, bus: &str) -> RawGpu {
    RawGpu {
        name: Ok("NVIDIA A100-SXM4-40GB".into()),
        architecture: Ok(DeviceArchitecture::Ampere),
        compute_capability: Ok(ComputeCapability { major: 8, minor: 0 }),
        memory_total_bytes: Ok(40960 * MIB_),
        cuda_cores: Ok(6912),
        gi_profiles: a100_40gb_profiles(),
        fabric: Err(CallError::NotSupported),
        ..h100(index, bus)
    }
}

#[allow(clippy::too_many_arguments)]
fn info(
    id: u32,
    slices: u32,
    instances: u32,
    mib: u64,
    sms: u32,
    ce: u32,
    dec: u32,
) -> ProfileInfo {
    ProfileInfo {
        copy_engine_count: ce,
        decoder_count: dec,
        encoder_count: 0,
        id,
        instance_count: instances,
        is_p2p_supported: false,
        jpeg_count: 0,
        memory_size_mb: mib,
        multiprocessor_count: sms,
        ofa_count: 0,
        slice_count: slices,
    }
}

fn placements(starts: &[u32], size: u32) -> RawResult<Vec<Placement>> {
    Ok(starts
        .iter()
        .map(|&start| Placement { start, size })
        .collect())
}

/// The GPU-instance profiles of an A100-SXM4-40GB: NVML profile index, `info`, placements.
fn a100_40gb_profiles() -> Vec<RawGiProfile> {
    let p = |profile, info, placements| RawGiProfile {
        profile,
        info,
        placements,
    };
    let mut me = info(20, 1, 1, 4864, 14, 1, 1);
    me.jpeg_count = 1;
    me.ofa_count = 1;
    vec![
        p(
            b::NVML_GPU_INSTANCE_PROFILE_1_SLICE,
            info(19, 1, 7, 4864, 14, 1, 0),
            placements(&[0, 1, 2, 3, 4, 5, 6], 1),
        ),
        p(
            b::NVML_GPU_INSTANCE_PROFILE_2_SLICE,
            info(14, 2, 3, 9856, 28, 2, 1),
            placements(&[0, 2, 4], 2),
        ),
        p(
            b::NVML_GPU_INSTANCE_PROFILE_3_SLICE,
            info(9, 3, 2, 19968, 42, 3, 2),
            placements(&[4, 0], 4),
        ),
        p(
            b::NVML_GPU_INSTANCE_PROFILE_4_SLICE,
            info(5, 4, 1, 19968, 56, 4, 2),
            placements(&[0], 4),
        ),
        p(
            b::NVML_GPU_INSTANCE_PROFILE_7_SLICE,
            info(0, 7, 1, 40192, 98, 7, 5),
            placements(&[0], 8),
        ),
        p(
            b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1,
            me,
            placements(&[0, 1, 2, 3, 4, 5, 6], 1),
        ),
        p(
            b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2,
            info(15, 1, 4, 9856, 14, 1, 1),
            placements(&[0, 2, 4, 6], 2),
        ),
    ]
}

fn attrs(
    sms: u32,
    ce: u32,
    dec: u32,
    gi_slices: u32,
    ci_slices: u32,
    mib: u64,
) -> DeviceAttributes {
    DeviceAttributes {
        multiprocessor_count: sms,
        shared_copy_engine_count: ce,
        shared_decoder_count: dec,
        shared_encoder_count: 0,
        shared_jpeg_count: 0,
        shared_ofa_count: 0,
        gpu_instance_slice_count: gi_slices,
        compute_instance_slice_count: ci_slices,
        memory_size_mb: mib,
    }
}

fn mig_dev(
    slot: u32,
    uuid: &str,
    gi_id: u32,
    profile_id: u32,
    start: u32,
    size: u32,
    attributes: RawResult<DeviceAttributes>,
) -> RawMigDevice {
    RawMigDevice {
        slot,
        uuid: Ok(uuid.into()),
        attributes,
        gi_id: Ok(gi_id),
        ci_id: Ok(0),
        gpu_instance: Ok(RawGpuInstance {
            profile_id,
            placement: Placement { start, size },
        }),
    }
}

/// The PCI info NVML fills in for `bus_id`: the string, and the numbers parsed from it.
fn pci(bus_id: &str) -> RawPci {
    let mut parts = bus_id.split([':', '.']);
    let mut next = || u32::from_str_radix(parts.next().unwrap_or_default(), 16).unwrap_or(0);
    RawPci {
        bus_id: bus_id.into(),
        domain: next(),
        bus: next(),
        device: next(),
    }
}

fn link(n: u32, remote: &str, kind: RawResult<RemoteDevice>) -> RawNvLink {
    RawNvLink {
        link: n,
        remote_pci: Ok(pci(remote)),
        remote_type: kind,
    }
}

/// A link to an NVSwitch as DGX/HGX drivers report it: the invalid PCI address, type SWITCH.
fn sentinel_link(n: u32, bus_id: &str) -> RawNvLink {
    RawNvLink {
        link: n,
        remote_pci: Ok(RawPci {
            bus_id: bus_id.into(),
            domain: 0xFFFF_FFFF,
            bus: 0xFF,
            device: 0xFF,
        }),
        remote_type: Ok(RemoteDevice::Switch),
    }
}

fn switch(bus: &str) -> NvLinkPeer {
    NvLinkPeer::Switch(bus.into())
}

fn gpu_peer(bus: &str) -> NvLinkPeer {
    NvLinkPeer::Gpu(PciBusId(bus.into()))
}

const HGX_BUSES: [&str; 8] = [
    "00000000:1A:00.0",
    "00000000:1B:00.0",
    "00000000:4A:00.0",
    "00000000:4B:00.0",
    "00000000:8A:00.0",
    "00000000:8B:00.0",
    "00000000:CA:00.0",
    "00000000:CB:00.0",
];

/// An HGX H100: 8 GPUs, 18 NVLinks each spread over 4 NVSwitches, two sockets.
fn hgx_h100() -> (RawNode, MapSysfs) {
    let switches = [
        "00000000:05:00.0",
        "00000000:06:00.0",
        "00000000:07:00.0",
        "00000000:08:00.0",
    ];
    let mut sysfs = MapSysfs::default();
    let gpus = HGX_BUSES
        .iter()
        .enumerate()
        .map(|(i, bus)| {
            let mut g = h100(i as u32, bus);
            g.nvlinks = (0..18)
                .map(|l| link(l, switches[l as usize % 4], Ok(RemoteDevice::Switch)))
                .collect();
            let norm = PciBusId::normalize(bus).unwrap();
            let (root, numa) = if i < 4 {
                ("pci0000:00", "0\n")
            } else {
                ("pci0000:80", "1\n")
            };
            sysfs = std::mem::take(&mut sysfs).device(norm.as_str(), root, numa);
            g
        })
        .collect();
    (node(gpus), sysfs)
}

#[test]
fn hgx_h100_is_one_nvlink_domain_with_full_attributes() {
    let (raw, sysfs) = hgx_h100();
    let inv = map(raw, &sysfs).unwrap();
    assert_eq!(inv.gpus.len(), 8);
    assert!(inv.gpus.iter().all(|g| g.nvlink_domain == 0));
    let g = &inv.gpus[5];
    assert_eq!(g.index, 5);
    assert_eq!(g.minor, 5);
    assert_eq!(g.pci_bus_id.as_str(), "0000:8b:00.0");
    assert_eq!(g.product_name, "NVIDIA H100 80GB HBM3");
    assert_eq!(g.brand.as_deref(), Some("Nvidia"));
    assert_eq!(g.architecture.as_deref(), Some("Hopper"));
    assert_eq!(g.cuda_compute_capability.to_string(), "9.0");
    assert_eq!(g.driver_version, "550.163.01");
    assert_eq!(g.cuda_driver_version, "12.4");
    assert_eq!(g.memory_bytes, 81559 * MIB_);
    assert_eq!(
        g.multiprocessors,
        Some(132),
        "16896 cores / 128 per Hopper SM"
    );
    assert_eq!(
        g.fabric, None,
        "a zero cluster UUID is no multi-node fabric"
    );
    assert_eq!(g.pcie_root.as_deref(), Some("pci0000:80"));
    assert_eq!(g.numa_node, Some(1));
    assert_eq!(inv.gpus[0].pcie_root.as_deref(), Some("pci0000:00"));
    assert_eq!(inv.gpus[0].numa_node, Some(0));
    // 18 links, 4 distinct switches, identified by their normalized PCI bus ids.
    let peers: Vec<_> = g.nvlink_peers.iter().cloned().collect();
    assert_eq!(
        peers,
        vec![
            switch("0000:05:00.0"),
            switch("0000:06:00.0"),
            switch("0000:07:00.0"),
            switch("0000:08:00.0"),
        ]
    );
    assert!(g.mig.capable && !g.mig.enabled);
    assert!(g.health.is_healthy());
}

#[test]
fn nvswitch_links_without_a_remote_type_still_join_one_domain() {
    let (mut raw, sysfs) = hgx_h100();
    for g in &mut raw.gpus {
        for l in &mut g.nvlinks {
            l.remote_type = Err(CallError::Missing(
                "nvmlDeviceGetNvLinkRemoteDeviceType".into(),
            ));
        }
    }
    let inv = map(raw, &sysfs).unwrap();
    assert!(inv.gpus.iter().all(|g| g.nvlink_domain == 0));
    assert!(
        inv.gpus[3]
            .nvlink_peers
            .iter()
            .all(|p| matches!(p, NvLinkPeer::Switch(_))),
        "a remote that is not one of the node's GPUs is a switch"
    );
}

#[test]
fn l40s_node_without_nvlink_has_one_domain_per_gpu() {
    let buses = [
        "00000000:17:00.0",
        "00000000:31:00.0",
        "00000000:B1:00.0",
        "00000000:CA:00.0",
    ];
    let mut sysfs = MapSysfs::default();
    let gpus = buses
        .iter()
        .enumerate()
        .map(|(i, bus)| {
            let norm = PciBusId::normalize(bus).unwrap();
            let (root, numa) = if i < 2 {
                (format!("pci0000:{:02x}", 0x10 * i), "0")
            } else {
                (format!("pci0000:{:02x}", 0x80 + 0x10 * i), "1")
            };
            sysfs = std::mem::take(&mut sysfs).device(norm.as_str(), &root, numa);
            l40s(i as u32, bus)
        })
        .collect();
    let inv = map(node(gpus), &sysfs).unwrap();
    let domains: Vec<u32> = inv.gpus.iter().map(|g| g.nvlink_domain).collect();
    assert_eq!(domains, vec![0, 1, 2, 3]);
    let numa: Vec<_> = inv.gpus.iter().map(|g| g.numa_node).collect();
    assert_eq!(numa, vec![Some(0), Some(0), Some(1), Some(1)]);
    let roots: Vec<_> = inv.gpus.iter().map(|g| g.pcie_root.clone()).collect();
    assert_eq!(
        roots,
        vec![
            Some("pci0000:00".to_string()),
            Some("pci0000:10".to_string()),
            Some("pci0000:a0".to_string()),
            Some("pci0000:b0".to_string()),
        ]
    );
    for g in &inv.gpus {
        assert_eq!(g.architecture.as_deref(), Some("Ada Lovelace"));
        assert_eq!(g.multiprocessors, Some(142));
        assert!(g.nvlink_peers.is_empty());
        assert_eq!(g.mig, Mig::default(), "MIG NotSupported means not capable");
        assert_eq!(g.engines, Engines::default());
    }
}

#[test]
fn bridged_pairs_form_two_domains_with_gpu_peers() {
    let buses = [
        "00000000:17:00.0",
        "00000000:18:00.0",
        "00000000:B1:00.0",
        "00000000:B2:00.0",
    ];
    let mut gpus: Vec<RawGpu> = buses
        .iter()
        .enumerate()
        .map(|(i, bus)| a100_40gb(i as u32, bus))
        .collect();
    // NV4 bridges: four links per pair. GPU 0 knows its peer's type; GPU 2's driver cannot say,
    // and the peer is recognized by its bus id; GPU 3 reports nothing (one-sided link).
    gpus[0].nvlinks = (0..4)
        .map(|l| link(l, buses[1], Ok(RemoteDevice::Gpu)))
        .collect();
    gpus[1].nvlinks = (0..4)
        .map(|l| link(l, buses[0], Ok(RemoteDevice::Gpu)))
        .collect();
    gpus[2].nvlinks = (0..4)
        .map(|l| link(l, buses[3], Ok(RemoteDevice::Unknown)))
        .collect();
    let inv = map(node(gpus), &MapSysfs::default()).unwrap();
    let domains: Vec<u32> = inv.gpus.iter().map(|g| g.nvlink_domain).collect();
    assert_eq!(domains, vec![0, 0, 2, 2]);
    assert_eq!(
        inv.gpus[0].nvlink_peers.iter().cloned().collect::<Vec<_>>(),
        vec![gpu_peer("0000:18:00.0")]
    );
    assert_eq!(
        inv.gpus[2].nvlink_peers.iter().cloned().collect::<Vec<_>>(),
        vec![gpu_peer("0000:b2:00.0")]
    );
    assert!(inv.gpus[3].nvlink_peers.is_empty());
}

#[test]
fn links_to_ibm_npus_and_unreadable_remotes_are_ignored() {
    let mut g = h100(0, "0000:07:00.0");
    g.nvlinks = vec![
        link(0, "0000:09:00.0", Ok(RemoteDevice::IbmNpu)),
        RawNvLink {
            link: 1,
            remote_pci: Err(CallError::Failed("unknown error".into())),
            remote_type: Ok(RemoteDevice::Gpu),
        },
        link(2, "garbage", Ok(RemoteDevice::Gpu)),
        link(3, "0000:07:00.0", Ok(RemoteDevice::Gpu)),
    ];
    let inv = map(node(vec![g]), &MapSysfs::default()).unwrap();
    assert!(inv.gpus[0].nvlink_peers.is_empty());
}

// ------------------------------------------------------------------------------------------------
// NVSwitches at the invalid PCI address

/// An HGX H100 as its driver reports it: every one of each GPU's 18 links ends at an NVSwitch
/// whose PCI address is the invalid `FFFFFFFF:FF:FF.0`. The numeric fields carry the sentinel;
/// the bus-id strings vary the way drivers do.
fn hgx_h100_sentinel() -> RawNode {
    let strings = [
        "FFFFFFFF:FF:FF.0",
        "ffffffff:ff:ff.0",
        "",
        "00000000:00:00.0",
    ];
    let gpus = HGX_BUSES
        .iter()
        .enumerate()
        .map(|(i, bus)| {
            let mut g = h100(i as u32, bus);
            g.nvlinks = (0..18)
                .map(|l| sentinel_link(l, strings[i % strings.len()]))
                .collect();
            g
        })
        .collect();
    node(gpus)
}

#[test]
fn sentinel_switch_addresses_mean_the_nodes_nvswitches() {
    let (inv, omissions) = map_with_omissions(hgx_h100_sentinel(), &MapSysfs::default()).unwrap();
    assert_eq!(inv.gpus.len(), 8);
    let domains: Vec<u32> = inv.gpus.iter().map(|g| g.nvlink_domain).collect();
    assert_eq!(domains, [0; 8], "one NVLink domain, not one per GPU");
    for g in &inv.gpus {
        assert_eq!(
            g.nvlink_peers.iter().cloned().collect::<Vec<_>>(),
            [NvLinkPeer::Switch(NODE_NVSWITCHES.into())],
            "gpu {}",
            g.index
        );
    }
    assert!(
        !omissions.iter().any(|o| o.field == "nvlinkPeers"),
        "no link was ignored: {omissions:?}"
    );
}

#[test]
fn sentinel_is_read_from_the_numbers_or_the_string() {
    let numeric = |domain, bus, device, s: &str| RawPci {
        bus_id: s.into(),
        domain,
        bus,
        device,
    };
    assert!(numeric(0xFFFF_FFFF, 0xFF, 0xFF, "").is_sentinel());
    assert!(numeric(0xFFFF, 0xFF, 0xFF, "0000:00:00.0").is_sentinel());
    assert!(numeric(0, 0, 0, "FFFFFFFF:FF:FF.0").is_sentinel());
    assert!(numeric(0, 0, 0, " ffff:ff:ff.0\n").is_sentinel());
    assert!(numeric(0, 0, 0, "FFFFFFFF:FF:FF.7").is_sentinel());
    assert!(!pci("00000000:05:00.0").is_sentinel());
    assert!(
        !pci("0000:FF:FF.0").is_sentinel(),
        "domain 0 is a real address"
    );
    assert!(!pci("FFFFFFFF:FF:00.0").is_sentinel());
    assert!(!numeric(0xFFFF_FFFF, 0xFF, 0x00, "").is_sentinel());
    assert!(!numeric(0, 0, 0, "").is_sentinel());
    assert!(!numeric(0, 0, 0, "garbage").is_sentinel());
}

/// Half the GPUs report their switches at the sentinel, half at real-looking addresses (today's
/// reading), one GPU pair also has a direct GPU link: the sentinel half and the real half are
/// separate fabrics until one GPU reaches both.
#[test]
fn sentinel_and_real_switch_addresses_mix() {
    let (mut raw, sysfs) = hgx_h100();
    for g in raw.gpus.iter_mut().take(4) {
        for l in &mut g.nvlinks {
            *l = sentinel_link(l.link, "FFFFFFFF:FF:FF.0");
        }
    }
    // GPU 0 also has a direct link to GPU 1, resolved by its PCI address.
    raw.gpus[0]
        .nvlinks
        .push(link(18, HGX_BUSES[1], Ok(RemoteDevice::Gpu)));
    let inv = map(raw.clone(), &sysfs).unwrap();
    let domains: Vec<u32> = inv.gpus.iter().map(|g| g.nvlink_domain).collect();
    assert_eq!(domains, [0, 0, 0, 0, 4, 4, 4, 4]);
    assert!(inv.gpus[0].nvlink_peers.contains(&gpu_peer("0000:1b:00.0")));
    assert!(inv.gpus[5].nvlink_peers.contains(&switch("0000:06:00.0")));

    // One GPU whose links reach a sentinel switch and a real one joins the two.
    raw.gpus[3].nvlinks[17] = link(17, "00000000:05:00.0", Ok(RemoteDevice::Switch));
    let inv = map(raw, &sysfs).unwrap();
    assert!(inv.gpus.iter().all(|g| g.nvlink_domain == 0));
}

#[test]
fn sentinel_links_of_unknown_type_say_nothing() {
    let mut raw = hgx_h100_sentinel();
    // GPU 2's driver cannot tell the remote type: its sentinel links reach "something".
    for l in &mut raw.gpus[2].nvlinks {
        l.remote_type = Err(CallError::Missing(
            "nvmlDeviceGetNvLinkRemoteDeviceType".into(),
        ));
    }
    // GPU 3: one link answers UNKNOWN, one GPU (unresolvable at the sentinel), one cannot read
    // its address but is a switch; the others are ordinary sentinel switch links.
    raw.gpus[3].nvlinks[0].remote_type = Ok(RemoteDevice::Unknown);
    raw.gpus[3].nvlinks[1].remote_type = Ok(RemoteDevice::Gpu);
    raw.gpus[3].nvlinks[2].remote_pci = Err(CallError::Failed("unknown error".into()));
    // GPU 7: nothing but unknown-type sentinel links.
    for l in &mut raw.gpus[7].nvlinks {
        l.remote_type = Ok(RemoteDevice::Unknown);
    }
    let (inv, omissions) = map_with_omissions(raw, &MapSysfs::default()).unwrap();
    let domains: Vec<u32> = inv.gpus.iter().map(|g| g.nvlink_domain).collect();
    assert_eq!(domains, [0, 0, 2, 0, 0, 0, 0, 7]);
    assert!(inv.gpus[2].nvlink_peers.is_empty());
    assert!(inv.gpus[7].nvlink_peers.is_empty());
    assert_eq!(
        inv.gpus[3].nvlink_peers.iter().cloned().collect::<Vec<_>>(),
        [NvLinkPeer::Switch(NODE_NVSWITCHES.into())]
    );
    // One note per GPU, at debug, however many links it ignored.
    let notes: Vec<(u32, Level, &str)> = omissions
        .iter()
        .filter(|o| o.field == "nvlinkPeers")
        .map(|o| (o.gpu_index, o.level, o.reason.as_str()))
        .collect();
    assert_eq!(notes.len(), 3, "{notes:?}");
    assert!(notes.iter().all(|(_, level, _)| *level == Level::DEBUG));
    assert_eq!(notes[0].0, 2);
    assert!(
        notes[0].2.contains("ignoring NVLink 0") && notes[0].2.ends_with("and 17 more"),
        "{}",
        notes[0].2
    );
    assert_eq!(notes[1].0, 3);
    assert!(
        notes[1].2.contains("type Unknown") && notes[1].2.ends_with("and 1 more"),
        "{}",
        notes[1].2
    );
    assert_eq!(notes[2].0, 7);
}

// ------------------------------------------------------------------------------------------------
// NVLink fabric registration

fn fabric_of(state: FabricState, status: RawResult<()>, uuid: [u8; 16]) -> RawResult<RawFabric> {
    Ok(RawFabric {
        cluster_uuid: uuid,
        clique_id: 32766,
        state,
        status,
    })
}

const CLUSTER: [u8; 16] = [
    0x6c, 0x1f, 0x3a, 0x52, 0x8d, 0x2e, 0x4b, 0x7a, 0x9f, 0x10, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
];

#[test]
fn only_completed_successful_fabric_registrations_are_kept() {
    let cases: Vec<(RawResult<RawFabric>, Option<Level>)> = vec![
        (fabric_of(FabricState::Completed, Ok(()), CLUSTER), None),
        (
            fabric_of(FabricState::InProgress, Ok(()), CLUSTER),
            Some(Level::INFO),
        ),
        (
            fabric_of(FabricState::NotStarted, Ok(()), [0; 16]),
            Some(Level::INFO),
        ),
        (
            fabric_of(FabricState::NotSupported, Ok(()), [0; 16]),
            Some(Level::DEBUG),
        ),
        (
            fabric_of(
                FabricState::Completed,
                Err(CallError::Failed("insufficient resources".into())),
                CLUSTER,
            ),
            Some(Level::WARN),
        ),
        (
            fabric_of(FabricState::Completed, Ok(()), [0; 16]),
            Some(Level::DEBUG),
        ),
        (
            fabric_of(FabricState::Other(9), Ok(()), CLUSTER),
            Some(Level::WARN),
        ),
        (Err(CallError::NotSupported), Some(Level::DEBUG)),
        (
            Err(CallError::Missing("nvmlDeviceGetGpuFabricInfo".into())),
            Some(Level::DEBUG),
        ),
        (
            Err(CallError::Failed("gpu is lost".into())),
            Some(Level::WARN),
        ),
    ];
    let gpus: Vec<RawGpu> = cases
        .iter()
        .enumerate()
        .map(|(i, (f, _))| {
            let mut g = h100(i as u32, &format!("0000:{:02x}:00.0", 0x10 + i));
            g.fabric = f.clone();
            g
        })
        .collect();
    let (inv, omissions) = map_with_omissions(node(gpus), &MapSysfs::default()).unwrap();
    let f = inv.gpus[0].fabric.as_ref().expect("completed registration");
    assert_eq!(
        f.cluster_uuid.as_str(),
        "6c1f3a52-8d2e-4b7a-9f10-0123456789ab"
    );
    assert_eq!(f.clique_id, 32766);
    for (i, (_, level)) in cases.iter().enumerate().skip(1) {
        assert_eq!(inv.gpus[i].fabric, None, "case {i}");
        let note = omissions
            .iter()
            .find(|o| o.gpu_index == i as u32 && o.field == "fabric");
        assert_eq!(note.map(|o| o.level), *level, "case {i}: {note:?}");
    }
    assert!(!omissions.iter().any(|o| o.gpu_index == 0));
    let failed = omissions
        .iter()
        .find(|o| o.gpu_index == 4 && o.field == "fabric")
        .unwrap();
    assert!(
        failed.reason.contains("insufficient resources"),
        "{}",
        failed.reason
    );
}

#[test]
fn fabric_struct_versions_match_nvml_h() {
    // NVML_STRUCT_VERSION(GpuFabricInfo, v) = sizeof(nvmlGpuFabricInfo_v<v>_t) | v << 24.
    assert_eq!(ffi::FABRIC_INFO_V3, 40 | (3 << 24));
    assert_eq!(ffi::FABRIC_INFO_V2, 36 | (2 << 24));
}

#[test]
fn omissions_are_logged_once_per_gpu_and_field_while_they_last() {
    let log = OmissionLog::default();
    let o = |gpu: &str, field, reason: &str| Omission {
        gpu_index: 0,
        gpu: GpuUuid(gpu.into()),
        field,
        reason: reason.into(),
        level: Level::WARN,
    };
    let first = [
        o("GPU-a", "multiprocessors", "x"),
        o("GPU-b", "multiprocessors", "x"),
    ];
    assert_eq!(log.log_new(&first).len(), 2);
    assert_eq!(log.log_new(&first).len(), 0, "the same gaps again: silent");
    let changed = [
        o("GPU-a", "multiprocessors", "y"),
        o("GPU-b", "multiprocessors", "x"),
    ];
    let logged = log.log_new(&changed);
    assert_eq!(logged.len(), 1, "a new reason is news");
    assert_eq!(logged[0].gpu.as_str(), "GPU-a");
    // GPU-b's value appeared, then went missing again: logged again.
    assert_eq!(log.log_new(&changed[..1]).len(), 0);
    assert_eq!(log.log_new(&changed).len(), 1);
}

/// An A100-40GB in MIG mode with 3g.20gb@0, 2g.10gb@4 and 1g.5gb+me@6, listed by NVML in an
/// order other than by placement, next to a second A100 with MIG off.
#[test]
fn a100_in_mig_mode_maps_devices_and_profiles() {
    let mut g0 = a100_40gb(0, "0000:07:00.0");
    g0.mig_mode = Ok(RawMigMode {
        current: true,
        pending: true,
    });
    g0.mig_devices = vec![
        mig_dev(
            0,
            "MIG-aaaaaaaa-0000-5000-8000-000000000001",
            13,
            20,
            6,
            1,
            Ok(DeviceAttributes {
                shared_jpeg_count: 1,
                shared_ofa_count: 1,
                ..attrs(14, 1, 1, 1, 1, 4864)
            }),
        ),
        mig_dev(
            1,
            "MIG-aaaaaaaa-0000-5000-8000-000000000002",
            2,
            9,
            0,
            4,
            Ok(attrs(42, 3, 2, 3, 3, 19968)),
        ),
        mig_dev(
            2,
            "MIG-aaaaaaaa-0000-5000-8000-000000000003",
            5,
            14,
            4,
            2,
            // Attributes unreadable: figures come from the GPU-instance profile.
            Err(CallError::NotSupported),
        ),
    ];
    let g1 = a100_40gb(1, "0000:0F:00.0");
    let inv = map(node(vec![g0, g1]), &MapSysfs::default()).unwrap();

    let mig = &inv.gpus[0].mig;
    assert!(mig.capable && mig.enabled);
    assert!(inv.gpus[0].in_mig_mode());
    assert_eq!(mig.memory_slices, 8);
    let names: Vec<&str> = mig.profiles.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(
        names,
        [
            "1g.5gb",
            "2g.10gb",
            "3g.20gb",
            "4g.20gb",
            "7g.40gb",
            "1g.5gb+me",
            "1g.10gb"
        ]
    );
    let p3 = &mig.profiles[2];
    assert_eq!(p3.gi_profile_id, 9);
    assert_eq!(p3.memory_bytes, 19968 * MIB_);
    assert_eq!(p3.max_instances, 2);
    assert_eq!(
        p3.placements,
        vec![
            Placement { start: 0, size: 4 },
            Placement { start: 4, size: 4 }
        ],
        "placements sorted by start"
    );
    assert_eq!(
        inv.gpus[0].engines,
        Engines {
            copy_engines: 7,
            decoders: 5,
            ..Engines::default()
        },
        "a full GPU's engines are those of its largest profile"
    );

    let devs: Vec<_> = mig
        .devices
        .iter()
        .map(|d| {
            (
                d.profile.as_str(),
                d.placement.start,
                d.placement.size,
                d.gi_id,
            )
        })
        .collect();
    assert_eq!(
        devs,
        [
            ("3g.20gb", 0, 4, 2),
            ("2g.10gb", 4, 2, 5),
            ("1g.5gb+me", 6, 1, 13)
        ]
    );
    let big = &mig.devices[0];
    assert_eq!(
        big.uuid.as_str(),
        "MIG-aaaaaaaa-0000-5000-8000-000000000002"
    );
    assert_eq!(big.gi_profile_id, 9);
    assert_eq!(big.ci_id, 0);
    assert_eq!(big.memory_bytes, 19968 * MIB_);
    assert_eq!(big.multiprocessors, 42);
    assert_eq!(big.engines.copy_engines, 3);
    let mid = &mig.devices[1];
    assert_eq!(mid.multiprocessors, 28, "from the 2g.10gb profile");
    assert_eq!(mid.engines.decoders, 1);
    let me = &mig.devices[2];
    assert_eq!(me.engines.ofa_engines, 1);
    assert_eq!(me.memory_bytes, 4864 * MIB_);

    // The second GPU: MIG-capable, off, no devices, same profiles.
    let other = &inv.gpus[1].mig;
    assert!(other.capable && !other.enabled);
    assert!(other.devices.is_empty());
    assert_eq!(other.profiles.len(), 7);
}

#[test]
fn mig_device_with_a_smaller_compute_instance_is_named_with_c() {
    let mut g = a100_40gb(0, "0000:07:00.0");
    g.mig_mode = Ok(RawMigMode {
        current: true,
        pending: true,
    });
    let mut d = mig_dev(0, "MIG-1", 1, 9, 0, 4, Ok(attrs(14, 1, 0, 3, 1, 19968)));
    d.ci_id = Ok(2);
    g.mig_devices = vec![d];
    let inv = map(node(vec![g]), &MapSysfs::default()).unwrap();
    let d = &inv.gpus[0].mig.devices[0];
    assert_eq!(d.profile, "1c.3g.20gb");
    assert_eq!(d.ci_id, 2);
    assert_eq!(d.multiprocessors, 14, "the compute instance's SMs");
}

#[test]
fn mig_devices_with_unknown_identity_are_skipped_not_fatal() {
    let mut g = a100_40gb(0, "0000:07:00.0");
    g.mig_mode = Ok(RawMigMode {
        current: true,
        pending: true,
    });
    let ok = mig_dev(0, "MIG-ok", 1, 19, 0, 1, Ok(attrs(14, 1, 0, 1, 1, 4864)));
    let mut no_placement = mig_dev(
        1,
        "MIG-noplace",
        2,
        19,
        1,
        1,
        Ok(attrs(14, 1, 0, 1, 1, 4864)),
    );
    no_placement.gpu_instance = Err(CallError::Missing("nvmlGpuInstanceGetInfo".into()));
    let mut no_ci = mig_dev(2, "MIG-noci", 3, 19, 2, 1, Ok(attrs(14, 1, 0, 1, 1, 4864)));
    no_ci.ci_id = Err(CallError::Failed("insufficient permissions".into()));
    let mut no_uuid = mig_dev(3, "MIG-x", 4, 19, 3, 1, Ok(attrs(14, 1, 0, 1, 1, 4864)));
    no_uuid.uuid = Err(CallError::Failed("gpu lost".into()));
    // A profile id the GPU did not list and no attributes to name it from.
    let unknown_profile = mig_dev(4, "MIG-unknown", 5, 77, 4, 1, Err(CallError::NotSupported));
    // A profile id the GPU did not list, named from its attributes instead.
    let named = mig_dev(5, "MIG-named", 6, 78, 5, 1, Ok(attrs(14, 1, 0, 1, 1, 4864)));
    g.mig_devices = vec![ok, no_placement, no_ci, no_uuid, unknown_profile, named];
    let inv = map(node(vec![g]), &MapSysfs::default()).unwrap();
    let uuids: Vec<(&str, &str)> = inv.gpus[0]
        .mig
        .devices
        .iter()
        .map(|d| (d.uuid.as_str(), d.profile.as_str()))
        .collect();
    assert_eq!(uuids, [("MIG-ok", "1g.5gb"), ("MIG-named", "1g.5gb")]);
}

#[test]
fn mig_not_supported_leaves_the_gpu_whole() {
    let mut g = h100(0, "0000:07:00.0");
    g.mig_mode = Err(CallError::NotSupported);
    let mut h = h100(1, "0000:08:00.0");
    h.mig_mode = Err(CallError::Failed("unknown error".into()));
    let mut k = h100(2, "0000:09:00.0");
    k.mig_mode = Err(CallError::Missing("nvmlDeviceGetMigMode".into()));
    let (inv, omissions) = map_with_omissions(node(vec![g, h, k]), &MapSysfs::default()).unwrap();
    for g in &inv.gpus {
        assert!(!g.mig.capable && !g.in_mig_mode());
        assert!(g.mig.profiles.is_empty() && g.mig.devices.is_empty());
        assert_eq!(g.memory_bytes, 81559 * MIB_);
    }
    // Not supported, or a driver without the MIG API: known not capable. A failed query: unknown.
    let unknown: Vec<bool> = inv.gpus.iter().map(|g| g.mig.mode_unknown).collect();
    assert_eq!(unknown, [false, true, false]);
    let noted: Vec<(u32, &str)> = omissions
        .iter()
        .filter(|o| o.field == "migCapable")
        .map(|o| (o.gpu_index, o.field))
        .collect();
    assert_eq!(noted, [(1, "migCapable")]);
}

#[test]
fn devices_listed_while_mig_is_off_are_ignored() {
    let mut g = a100_40gb(0, "0000:07:00.0");
    g.mig_devices = vec![mig_dev(
        0,
        "MIG-stale",
        1,
        19,
        0,
        1,
        Ok(attrs(14, 1, 0, 1, 1, 4864)),
    )];
    let inv = map(node(vec![g]), &MapSysfs::default()).unwrap();
    assert!(inv.gpus[0].mig.devices.is_empty());
}

#[test]
fn missing_numa_and_pcie_root_are_none_not_errors() {
    let inv = map(node(vec![h100(0, "0000:07:00.0")]), &MapSysfs::default()).unwrap();
    assert_eq!(inv.gpus[0].numa_node, None);
    assert_eq!(inv.gpus[0].pcie_root, None);

    // No sysfs entry, but NVML knows the node (a coherent platform): use NVML's.
    let mut g = h100(0, "0000:07:00.0");
    g.numa_node = Ok(3);
    let inv = map(node(vec![g.clone()]), &MapSysfs::default()).unwrap();
    assert_eq!(inv.gpus[0].numa_node, Some(3));

    // Sysfs says -1 (no NUMA): that wins over NVML, and a link without a root gives no root.
    let mut sysfs = MapSysfs::default();
    sysfs.numa.insert("0000:07:00.0".into(), "-1\n".into());
    sysfs.links.insert(
        "0000:07:00.0".into(),
        "../../../devices/platform/0000:07:00.0".into(),
    );
    let inv = map(node(vec![g]), &sysfs).unwrap();
    assert_eq!(inv.gpus[0].numa_node, None);
    assert_eq!(inv.gpus[0].pcie_root, None);
}

#[test]
fn gpus_without_identity_are_skipped_others_kept() {
    let mut no_uuid = h100(1, "0000:08:00.0");
    no_uuid.uuid = Err(CallError::Failed("gpu is lost".into()));
    let mut bad_bus = h100(2, "0000:09:00.0");
    bad_bus.pci_bus_id = Ok("not-a-bus-id".into());
    let mut no_memory = h100(3, "0000:0a:00.0");
    no_memory.memory_total_bytes = Err(CallError::Failed("gpu is lost".into()));
    let mut raw = node(vec![h100(0, "0000:07:00.0"), no_uuid, bad_bus, no_memory]);
    raw.unreadable
        .push((4, CallError::Failed("insufficient permissions".into())));
    let inv = map(raw, &MapSysfs::default()).unwrap();
    let indices: Vec<u32> = inv.gpus.iter().map(|g| g.index).collect();
    assert_eq!(indices, [0]);
}

#[test]
fn optional_gpu_facts_degrade() {
    let mut g = h100(0, "0000:07:00.0");
    g.brand = Err(CallError::Failed("unexpected enum variant 99".into()));
    g.architecture = Ok(DeviceArchitecture::Unknown);
    g.compute_capability = Ok(ComputeCapability {
        major: 10,
        minor: 0,
    });
    g.cuda_cores = Err(CallError::NotSupported);
    let mut h = h100(1, "0000:08:00.0");
    h.architecture = Err(CallError::Missing("nvmlDeviceGetArchitecture".into()));
    h.attributes = Ok(attrs(132, 0, 0, 0, 0, 81559));
    h.cuda_cores = Err(CallError::NotSupported);
    let mut k = h100(2, "0000:09:00.0");
    k.brand = Ok(Brand::Unknown);
    k.architecture = Ok(DeviceArchitecture::Unknown);
    k.compute_capability = Ok(ComputeCapability { major: 2, minor: 0 });
    let (inv, omissions) = map_with_omissions(node(vec![g, h, k]), &MapSysfs::default()).unwrap();
    assert_eq!(inv.gpus[0].brand, None, "a failed call publishes no brand");
    assert_eq!(
        inv.gpus[0].architecture.as_deref(),
        Some("Blackwell"),
        "from compute capability 10.0"
    );
    assert_eq!(
        inv.gpus[0].multiprocessors, None,
        "no attributes, no cores: omitted, not 0"
    );
    assert_eq!(
        inv.gpus[1].architecture.as_deref(),
        Some("Hopper"),
        "from compute capability 9.0"
    );
    assert_eq!(
        inv.gpus[1].multiprocessors,
        Some(132),
        "from the GPU's attributes"
    );
    assert_eq!(inv.gpus[2].brand, None, "NVML's UNKNOWN brand is no brand");
    assert_eq!(inv.gpus[2].architecture, None, "nothing names it");
    assert_eq!(inv.gpus[2].multiprocessors, None, "no cores per SM for 2.0");
    let noted: Vec<(u32, &str, Level)> = omissions
        .iter()
        .filter(|o| o.field != "fabric")
        .map(|o| (o.gpu_index, o.field, o.level))
        .collect();
    assert_eq!(
        noted,
        [
            (0, "brand", Level::INFO),
            (0, "multiprocessors", Level::WARN),
            (2, "brand", Level::INFO),
            (2, "architecture", Level::INFO),
            (2, "multiprocessors", Level::WARN),
        ]
    );
    let why = &omissions
        .iter()
        .find(|o| o.gpu_index == 0 && o.field == "multiprocessors")
        .unwrap()
        .reason;
    assert!(
        why.contains("nvmlDeviceGetAttributes_v2: not supported")
            && why.contains("nvmlDeviceGetNumGpuCores: not supported"),
        "{why}"
    );
}

#[test]
fn node_versions_are_formatted_and_required() {
    let mut raw = node(vec![h100(0, "0000:07:00.0")]);
    raw.driver_version = Ok(" 570.124.06\n".into());
    raw.cuda_driver_version = Ok(12080);
    let inv = map(raw, &MapSysfs::default()).unwrap();
    assert_eq!(inv.gpus[0].driver_version, "570.124.06");
    assert_eq!(inv.gpus[0].cuda_driver_version, "12.8");

    let mut raw = node(vec![]);
    raw.cuda_driver_version = Err(CallError::Failed("uninitialized".into()));
    let err = map(raw, &MapSysfs::default()).unwrap_err();
    assert!(
        err.to_string().contains("nvmlSystemGetCudaDriverVersion"),
        "{err}"
    );
    let mut raw = node(vec![]);
    raw.cuda_driver_version = Ok(0);
    let err = map(raw, &MapSysfs::default()).unwrap_err();
    assert!(
        err.to_string().contains("invalid CUDA driver version 0"),
        "{err}"
    );
    let mut raw = node(vec![]);
    raw.driver_version = Err(CallError::NotSupported);
    let err = map(raw, &MapSysfs::default()).unwrap_err();
    assert!(
        err.to_string().contains("nvmlSystemGetDriverVersion"),
        "{err}"
    );
}

#[test]
fn cuda_versions_format_like_nvidia_smi() {
    assert_eq!(format_cuda_version(12040).as_deref(), Some("12.4"));
    assert_eq!(format_cuda_version(12080).as_deref(), Some("12.8"));
    assert_eq!(format_cuda_version(13000).as_deref(), Some("13.0"));
    assert_eq!(format_cuda_version(11020).as_deref(), Some("11.2"));
    assert_eq!(format_cuda_version(0), None);
    assert_eq!(format_cuda_version(-1), None);
}

#[test]
fn duplicate_gpus_from_nvml_are_an_error() {
    let a = h100(0, "0000:07:00.0");
    let mut b = h100(1, "0000:08:00.0");
    b.uuid = a.uuid.clone();
    let err = map(node(vec![a, b]), &MapSysfs::default()).unwrap_err();
    assert!(err.to_string().contains("share the uuid"), "{err}");
}

/// Totals in MiB as NVML reports them, profile sizes in MiB, and the names NVIDIA publishes.
/// The A100 figures are NVIDIA's; the H100/H200 profile sizes are plausible values not checked
/// against hardware.
#[test]
fn mig_memory_names_follow_nvidia() {
    // (GPU, total MiB, [(profile MiB, name GB)])
    type Case = (&'static str, u64, &'static [(u64, u64)]);
    let cases: &[Case] = &[
        (
            "A100-40GB",
            40960,
            &[(4864, 5), (9856, 10), (19968, 20), (40192, 40)],
        ),
        (
            "A100-80GB",
            81920,
            &[(9856, 10), (19968, 20), (40192, 40), (80384, 80)],
        ),
        (
            "H100-80GB",
            81559,
            &[(9984, 10), (19968, 20), (40448, 40), (80384, 80)],
        ),
        (
            "H200-141GB",
            143771,
            &[(16384, 18), (33280, 35), (66816, 71), (133888, 141)],
        ),
    ];
    for (gpu, total_mib, rows) in cases {
        for &(mib, gb) in *rows {
            assert_eq!(
                mig_memory_gb(total_mib * MIB_, mib),
                gb,
                "{gpu}: {mib} MiB of {total_mib} MiB"
            );
        }
    }
    assert_eq!(mig_memory_gb(0, 10240), 10, "unknown total: plain GiB");
}

#[test]
fn mig_profile_names_carry_variant_suffixes() {
    let total = 40960 * MIB_;
    let name = |profile, g, c, mib| mig_profile_name(profile, g, c, mib, total);
    assert_eq!(
        name(Some(b::NVML_GPU_INSTANCE_PROFILE_1_SLICE), 1, 0, 4864),
        "1g.5gb"
    );
    assert_eq!(
        name(Some(b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1), 1, 0, 4864),
        "1g.5gb+me"
    );
    assert_eq!(
        name(Some(b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2), 1, 0, 9856),
        "1g.10gb"
    );
    assert_eq!(
        name(Some(b::NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1), 2, 2, 9856),
        "2g.10gb+me"
    );
    assert_eq!(
        name(Some(b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_GFX), 1, 0, 4864),
        "1g.5gb+gfx"
    );
    assert_eq!(
        name(Some(b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_NO_ME), 1, 0, 4864),
        "1g.5gb-me"
    );
    assert_eq!(
        name(
            Some(b::NVML_GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME),
            1,
            0,
            4864
        ),
        "1g.5gb+me.all"
    );
    assert_eq!(
        name(Some(b::NVML_GPU_INSTANCE_PROFILE_3_SLICE), 3, 1, 19968),
        "1c.3g.20gb"
    );
    assert_eq!(name(None, 7, 7, 40192), "7g.40gb");
}

#[test]
fn brand_and_architecture_names_match_nvidia() {
    assert_eq!(brand_name(&Brand::Nvidia), "Nvidia");
    assert_eq!(brand_name(&Brand::GeForceRTX), "GeForceRTX");
    assert_eq!(brand_name(&Brand::Tesla), "Tesla");
    assert_eq!(
        architecture_name(&DeviceArchitecture::Ada),
        Some("Ada Lovelace")
    );
    assert_eq!(
        architecture_name(&DeviceArchitecture::Blackwell),
        Some("Blackwell")
    );
    assert_eq!(architecture_name(&DeviceArchitecture::Unknown), None);
    let cc = |major, minor| ComputeCapability { major, minor };
    assert_eq!(architecture_from_cc(cc(8, 0)), Some("Ampere"));
    assert_eq!(architecture_from_cc(cc(8, 6)), Some("Ampere"));
    assert_eq!(architecture_from_cc(cc(8, 9)), Some("Ada Lovelace"));
    assert_eq!(architecture_from_cc(cc(7, 5)), Some("Turing"));
    assert_eq!(architecture_from_cc(cc(7, 0)), Some("Volta"));
    assert_eq!(architecture_from_cc(cc(12, 0)), Some("Blackwell"));
    assert_eq!(architecture_from_cc(cc(2, 0)), None);
}

#[test]
fn pcie_roots_come_from_the_first_pci_component() {
    let root = |p: &str| pcie_root_of(Path::new(p));
    assert_eq!(
        root("../../../devices/pci0000:00/0000:00:01.0/0000:07:00.0").as_deref(),
        Some("pci0000:00")
    );
    // Behind a VMD domain the outer root complex is the one that matters.
    assert_eq!(
        root("/sys/devices/pci0000:64/0000:64:00.5/pci10000:00/10000:00:02.0/10000:01:00.0")
            .as_deref(),
        Some("pci0000:64")
    );
    assert_eq!(root("../../../devices/platform/0000:07:00.0"), None);
    assert_eq!(root("../../../devices/pcizz:00/0000:07:00.0"), None);
    assert_eq!(root("../../../devices/pci0000:0/0000:07:00.0"), None);
}

#[test]
fn numa_text_parses_and_minus_one_is_none() {
    assert_eq!(parse_numa("1\n"), Some(1));
    assert_eq!(parse_numa("-1\n"), None);
    assert_eq!(parse_numa(""), None);
}

#[test]
fn host_sysfs_reads_links_and_numa_from_a_real_tree() {
    let dir = tempfile::tempdir().unwrap();
    let dev = dir
        .path()
        .join("devices/pci0000:80/0000:80:01.0/0000:87:00.0");
    std::fs::create_dir_all(&dev).unwrap();
    std::fs::write(dev.join("numa_node"), "1\n").unwrap();
    let bus_dir = dir.path().join("bus/pci/devices");
    std::fs::create_dir_all(&bus_dir).unwrap();
    std::os::unix::fs::symlink(
        "../../../devices/pci0000:80/0000:80:01.0/0000:87:00.0",
        bus_dir.join("0000:87:00.0"),
    )
    .unwrap();
    let sysfs = HostSysfs::new(dir.path());
    let inv = map(node(vec![h100(0, "00000000:87:00.0")]), &sysfs).unwrap();
    assert_eq!(inv.gpus[0].pcie_root.as_deref(), Some("pci0000:80"));
    assert_eq!(inv.gpus[0].numa_node, Some(1));
    // A device sysfs does not know: None, not an error.
    let inv = map(node(vec![h100(0, "0000:99:00.0")]), &sysfs).unwrap();
    assert_eq!(
        (inv.gpus[0].pcie_root.clone(), inv.gpus[0].numa_node),
        (None, None)
    );
}

#[test]
fn nvml_errors_classify() {
    assert_eq!(
        CallError::from(NvmlError::NotSupported),
        CallError::NotSupported
    );
    assert_eq!(CallError::from(NvmlError::NotFound), CallError::NotFound);
    assert!(matches!(
        CallError::from(NvmlError::FailedToLoadSymbol("x".into())),
        CallError::Missing(_)
    ));
    assert!(matches!(
        CallError::from(NvmlError::GpuLost),
        CallError::Failed(s) if s.contains("lost") || s.contains("bus")
    ));
}

/// Whether this machine has an NVIDIA kernel driver, judged without NVML: the driver creates
/// `/dev/nvidiactl` (on the host and in a container given GPUs). The two `open_*` tests expect
/// exactly one outcome each way: no driver (CI, laptops) means `NvmlMissing`, a driver means a
/// backend that reads real GPUs.
fn has_nvidia_driver() -> bool {
    Path::new("/dev/nvidiactl").exists()
}

/// Opening NVML without a driver must say what is missing and what to do; with one, a real
/// snapshot must map.
#[test]
fn open_without_a_driver_names_the_library_and_the_way_out() {
    let opened = NvmlBackend::open(Path::new("/"));
    if has_nvidia_driver() {
        let backend = opened.expect("NVML opens on a machine with the NVIDIA driver");
        let inv = backend.snapshot().expect("snapshot on a machine with NVML");
        for g in &inv.gpus {
            assert!(g.uuid.as_str().starts_with("GPU-"), "{g:?}");
            assert!(!g.cuda_driver_version.is_empty());
        }
        return;
    }
    match opened {
        Err(e @ Error::NvmlMissing { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("libnvidia-ml.so.1"), "{msg}");
            assert!(msg.contains("--backend simulated"), "{msg}");
        }
        Err(other) => panic!("without a driver, expected NvmlMissing, got: {other}"),
        Ok(_) => panic!("NVML opened on a machine without /dev/nvidiactl"),
    }
}

#[test]
fn open_reports_each_library_it_tried_under_the_driver_root() {
    let root = tempfile::tempdir().unwrap();
    let lib_dir = root.path().join("usr/lib64");
    std::fs::create_dir_all(&lib_dir).unwrap();
    std::fs::write(lib_dir.join(LIBRARY), b"not an ELF file").unwrap();
    let opened = NvmlBackend::open(root.path());
    if has_nvidia_driver() {
        // The system library loads after the broken one under the driver root failed.
        assert!(opened.is_ok(), "{:?}", opened.err());
        return;
    }
    match opened {
        Err(e @ Error::NvmlMissing { .. }) => {
            let msg = e.to_string();
            assert!(
                msg.contains(&lib_dir.join(LIBRARY).display().to_string()),
                "{msg}"
            );
            assert!(msg.contains("--backend simulated"), "{msg}");
        }
        Err(other) => panic!("without a driver, expected NvmlMissing, got: {other}"),
        Ok(_) => panic!("NVML opened on a machine without /dev/nvidiactl"),
    }
}
