//! Inventory tests: invariants of [`Inventory::new`], NVLink domains and quantities.

use super::*;

pub(crate) fn gpu(index: u32, bus: &str, peers: &[NvLinkPeer]) -> Gpu {
    Gpu {
        index,
        minor: index,
        uuid: GpuUuid(format!("GPU-{index}")),
        product_name: "NVIDIA Test".into(),
        brand: Some("Nvidia".into()),
        architecture: Some("Hopper".into()),
        cuda_compute_capability: ComputeCapability { major: 9, minor: 0 },
        driver_version: "570.124.06".into(),
        cuda_driver_version: "12.8".into(),
        memory_bytes: 80 << 30,
        multiprocessors: Some(132),
        engines: Engines::default(),
        pci_bus_id: PciBusId(bus.into()),
        pcie_root: None,
        numa_node: None,
        mig: Mig::default(),
        nvlink_peers: peers.iter().cloned().collect(),
        nvlink_domain: u32::MAX,
        fabric: None,
        virtualization: Some(Virtualization::BareMetal),
        health: Health::Healthy,
    }
}

fn domains(gpus: Vec<Gpu>) -> Vec<u32> {
    Inventory::new(gpus)
        .unwrap()
        .gpus
        .iter()
        .map(|g| g.nvlink_domain)
        .collect()
}

fn bus(b: &str) -> NvLinkPeer {
    NvLinkPeer::Gpu(PciBusId(b.into()))
}

#[test]
fn gpus_without_nvlink_are_islands() {
    let d = domains(vec![gpu(0, "a", &[]), gpu(1, "b", &[]), gpu(2, "c", &[])]);
    assert_eq!(d, vec![0, 1, 2]);
}

#[test]
fn bridged_pairs_form_two_domains() {
    let d = domains(vec![
        gpu(0, "a", &[bus("b")]),
        gpu(1, "b", &[bus("a")]),
        gpu(2, "c", &[bus("d")]),
        gpu(3, "d", &[bus("c")]),
    ]);
    assert_eq!(d, vec![0, 0, 2, 2]);
}

#[test]
fn one_sided_links_still_connect() {
    let d = domains(vec![gpu(0, "a", &[]), gpu(1, "b", &[bus("a")])]);
    assert_eq!(d, vec![0, 0]);
}

#[test]
fn chains_are_transitive_and_use_lowest_index() {
    // 5 - 3 - 4, out of index order in the input.
    let d = domains(vec![
        gpu(4, "e", &[bus("d")]),
        gpu(3, "d", &[]),
        gpu(5, "f", &[bus("d")]),
    ]);
    assert_eq!(d, vec![3, 3, 3]);
}

#[test]
fn switches_join_everything_attached() {
    let sw = |s: &str| NvLinkPeer::Switch(s.into());
    let d = domains(vec![
        gpu(0, "a", &[sw("s0"), sw("s1")]),
        gpu(1, "b", &[sw("s1")]),
        gpu(2, "c", &[sw("s0")]),
        gpu(3, "d", &[]),
        gpu(4, "e", &[sw("other")]),
    ]);
    assert_eq!(d, vec![0, 0, 0, 3, 4]);
}

#[test]
fn peers_outside_the_inventory_are_ignored() {
    let d = domains(vec![gpu(0, "a", &[bus("zz")]), gpu(1, "b", &[])]);
    assert_eq!(d, vec![0, 1]);
}

#[test]
fn duplicate_identities_are_rejected() {
    let mut g = gpu(1, "b", &[]);
    g.uuid = GpuUuid("GPU-0".into());
    let err = Inventory::new(vec![gpu(0, "a", &[]), g]).unwrap_err();
    assert!(err.to_string().contains("share the uuid GPU-0"), "{err}");
    let err = Inventory::new(vec![gpu(0, "a", &[]), gpu(0, "b", &[])]).unwrap_err();
    assert!(err.to_string().contains("index"), "{err}");
}

#[test]
fn pci_bus_ids_normalize() {
    assert_eq!(
        PciBusId::normalize("00000000:0F:00.0").unwrap().0,
        "0000:0f:00.0"
    );
    assert_eq!(
        PciBusId::normalize("0000:b7:00.0").unwrap().0,
        "0000:b7:00.0"
    );
    assert!(PciBusId::normalize("garbage").is_none());
    assert!(PciBusId::normalize("0000:zz:00.0").is_none());
    let id = PciBusId::normalize("0001:87:00.0").unwrap();
    assert_eq!(id.domain_and_bus(), ("0001", "87"));
}

#[test]
fn cluster_uuids_are_canonical() {
    let bytes = [
        0x6c, 0x1f, 0x3a, 0x52, 0x8d, 0x2e, 0x4b, 0x7a, 0x9f, 0x10, 0x01, 0x23, 0x45, 0x67, 0x89,
        0xab,
    ];
    let u = ClusterUuid::from_bytes(bytes);
    assert_eq!(u.as_str(), "6c1f3a52-8d2e-4b7a-9f10-0123456789ab");
    assert_eq!(
        ClusterUuid::parse("6C1F3A52-8D2E-4B7A-9F10-0123456789AB"),
        Some(u.clone())
    );
    for bad in [
        "",
        "6c1f3a528d2e4b7a9f100123456789ab",
        "{6c1f3a52-8d2e-4b7a-9f10-0123456789ab}",
        "6c1f3a52-8d2e-4b7a-9f10-0123456789a",
        "6c1f3a52-8d2e-4b7a-9f10-0123456789ag",
        "6c1f3a5-28d2e-4b7a-9f10-0123456789ab",
    ] {
        assert_eq!(ClusterUuid::parse(bad), None, "{bad:?}");
    }
    let f = Fabric {
        cluster_uuid: u,
        clique_id: 7,
    };
    assert_eq!(f.to_string(), "6c1f3a52-8d2e-4b7a-9f10-0123456789ab.7");
}

#[test]
fn quantities_are_canonical_and_round_trip() {
    assert_eq!(quantity(80 << 30), "80Gi");
    assert_eq!(quantity(4864 << 20), "4864Mi");
    assert_eq!(quantity(1536), "1536");
    assert_eq!(quantity(0), "0");
    assert_eq!(quantity(3 << 40), "3Ti");
    for q in ["80Gi", "4864Mi", "1536", "141Gi"] {
        assert_eq!(quantity(parse_quantity(q).unwrap()), q);
    }
    assert_eq!(parse_quantity("1G"), Some(1_000_000_000));
    assert_eq!(parse_quantity("12Zi"), None);
    assert_eq!(parse_quantity("Gi"), None);
}

#[test]
fn placements_overlap() {
    let p = |start, size| Placement { start, size };
    assert!(p(0, 4).overlaps(&p(2, 2)));
    assert!(!p(0, 4).overlaps(&p(4, 4)));
    assert!(p(6, 1).overlaps(&p(0, 8)));
}
