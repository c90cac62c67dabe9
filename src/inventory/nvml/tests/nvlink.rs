//! NVLink tests: domains from links, bridged pairs, and NVSwitches at the invalid PCI address.

use super::*;

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
