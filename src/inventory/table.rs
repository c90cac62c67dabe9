//! The human-readable inventory table printed by `nvdra inventory`.

use std::fmt::Write;

use super::{Gpu, Holder, Inventory, SwitchBlock, on_off, quantity};

/// One line per GPU and per MIG device, columns aligned. The FABRIC column
/// (`<clusterUUID>.<cliqueID>`) appears only when some GPU completed an NVLink fabric
/// registration. MIG shows the current mode (with the MIG device count when on) and any change
/// pending a GPU reset; MIG TOGGLE whether nvdra may change the mode at run time
/// ([`Gpu::mig_toggle`](super::Gpu::mig_toggle)), or why not, and for one that may, what keeps
/// it from switching now ([`toggle_now`]).
pub fn render(inv: &Inventory) -> String {
    let with_fabric = inv.gpus.iter().any(|g| g.fabric.is_some());
    let mut header: Vec<String> = [
        "DEVICE",
        "UUID",
        "MODEL / PROFILE",
        "MEMORY",
        "NUMA",
        "NVLINK",
        "MIG",
        "HEALTH",
        "MIG TOGGLE",
    ]
    .map(String::from)
    .into();
    if with_fabric {
        header.insert(6, "FABRIC".into());
    }
    let mut rows: Vec<Vec<String>> = vec![header];
    for g in &inv.gpus {
        let mut mig = match (g.mig.mode_unknown, g.mig.capable, g.mig.enabled) {
            (true, _, _) => "?".to_string(),
            (false, false, _) => "-".to_string(),
            (false, true, false) => "off".to_string(),
            (false, true, true) => format!("on ({})", g.mig.devices.len()),
        };
        if let Some(pending) = g.mig.pending {
            let _ = write!(mig, " → {} (pending)", on_off(pending));
        }
        let toggle = match g.mig_toggle() {
            Ok(()) => toggle_now(g),
            Err(why) => format!("no: {why}"),
        };
        let fabric = g.fabric.as_ref().map_or("-".into(), |f| f.to_string());
        let mut row = vec![
            format!("gpu-{}", g.minor),
            g.uuid.to_string(),
            g.product_name.clone(),
            quantity(g.memory_bytes),
            g.numa_node.map_or("-".into(), |n| n.to_string()),
            g.nvlink_domain.to_string(),
            mig,
            g.health.to_string(),
            toggle,
        ];
        if with_fabric {
            row.insert(6, fabric.clone());
        }
        rows.push(row);
        for m in &g.mig.devices {
            let mut row = vec![
                format!("  └ mig {}/{}", m.gi_id, m.ci_id),
                m.uuid.to_string(),
                format!("{} @{}", m.profile, m.placement.start),
                quantity(m.memory_bytes),
                g.numa_node.map_or("-".into(), |n| n.to_string()),
                g.nvlink_domain.to_string(),
                String::new(),
                m.health.to_string(),
                String::new(),
            ];
            if with_fabric {
                row.insert(6, fabric.clone());
            }
            rows.push(row);
        }
    }
    let mut widths = vec![0usize; rows[0].len()];
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in &rows {
        let mut line = String::new();
        for (i, (c, w)) in r.iter().zip(&widths).enumerate() {
            if i + 1 == r.len() {
                line.push_str(c);
            } else {
                let pad = w - c.chars().count();
                let _ = write!(line, "{c}{}  ", " ".repeat(pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// MIG TOGGLE of a GPU that may switch at run time: `yes`, or what keeps it from switching now
/// (with `--dynamic-mig` its devices that need a switch are then withdrawn or tainted): the
/// holders that block a switch, or those a prepare met (`IN_USE`).
fn toggle_now(g: &Gpu) -> String {
    let names = |holders: &mut dyn Iterator<Item = &Holder>| {
        holders
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(SwitchBlock::InUse { holders }) = &g.mig.switch_block {
        return format!(
            "yes, not now: a switch met IN_USE ({})",
            names(&mut holders.iter())
        );
    }
    let mut blocking = g
        .mig
        .holders
        .iter()
        .filter(|h| h.blocks_switch())
        .peekable();
    if blocking.peek().is_none() {
        return "yes".to_string();
    }
    format!("yes, not now: held by {}", names(&mut blocking))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::topology::load_profile;
    use crate::inventory::{ClusterUuid, Fabric};

    #[test]
    fn mig_devices_are_listed_under_their_parent() {
        let inv = load_profile("a100-mig-mixed", "n").unwrap();
        let text = render(&inv);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("DEVICE"));
        assert!(!lines[0].contains("FABRIC"), "no GPU has a fabric: {text}");
        // 4 GPUs + 4 + 3 MIG devices + header.
        assert_eq!(lines.len(), 1 + 4 + 7, "{text}");
        let gpu1 = lines.iter().position(|l| l.starts_with("gpu-1 ")).unwrap();
        assert!(lines[gpu1].contains("on (4)"), "{text}");
        assert!(lines[gpu1 + 1].contains("3g.20gb @4"), "{text}");
        assert!(lines[gpu1 + 1].contains("19968Mi"), "{text}");
    }

    #[test]
    fn fabric_column_appears_when_a_gpu_has_one() {
        let mut inv = load_profile("a100-mig-mixed", "n").unwrap();
        inv.gpus[1].fabric = Some(Fabric {
            cluster_uuid: ClusterUuid::parse("6c1f3a52-8d2e-4b7a-9f10-0123456789ab").unwrap(),
            clique_id: 7,
        });
        inv.gpus[2].mig.mode_unknown = true;
        inv.gpus[2].mig.capable = false;
        let text = render(&inv);
        let lines: Vec<&str> = text.lines().collect();
        let col = lines[0].find("FABRIC").expect("FABRIC header");
        // Columns are aligned by characters (MIG rows start with a multi-byte `└`).
        let at = |line: &str| line.chars().skip(col).collect::<String>();
        let gpu1 = lines.iter().position(|l| l.starts_with("gpu-1 ")).unwrap();
        assert!(
            at(lines[gpu1]).starts_with("6c1f3a52-8d2e-4b7a-9f10-0123456789ab.7 "),
            "{text}"
        );
        // Its MIG devices carry the parent's fabric; other GPUs show none.
        assert!(at(lines[gpu1 + 1]).starts_with("6c1f3a52-"), "{text}");
        let gpu0 = lines.iter().position(|l| l.starts_with("gpu-0 ")).unwrap();
        assert!(at(lines[gpu0]).starts_with("- "), "{text}");
        let gpu2 = lines.iter().position(|l| l.starts_with("gpu-2 ")).unwrap();
        assert!(lines[gpu2].contains(" ? "), "unknown MIG mode: {text}");
    }

    #[test]
    fn mig_toggle_column_says_yes_or_why_not_and_pending_changes_show() {
        let h100 = load_profile("dgx-h100", "n").unwrap();
        let text = render(&h100);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].ends_with("HEALTH   MIG TOGGLE"), "{text}");
        assert!(lines[1].ends_with("Healthy  yes"), "{text}");

        let mut a100 = load_profile("a100-mig-mixed", "n").unwrap();
        a100.gpus[3].mig.pending = Some(true);
        a100.gpus[1].mig.pending = Some(false);
        let text = render(&a100);
        let line = |minor: u32| {
            let prefix = format!("gpu-{minor} ");
            text.lines()
                .find(|l| l.starts_with(&prefix))
                .unwrap()
                .to_string()
        };
        assert!(
            line(0).ends_with("no: Ampere (8.0): MIG mode changes only through the operator"),
            "{text}"
        );
        assert!(line(3).contains(" off → on (pending) "), "{text}");
        assert!(line(1).contains(" on (4) → off (pending) "), "{text}");
        // MIG device rows leave the column empty.
        let gpu1 = text.lines().position(|l| l.starts_with("gpu-1 ")).unwrap();
        assert!(
            text.lines().nth(gpu1 + 1).unwrap().ends_with("Healthy"),
            "{text}"
        );
    }

    /// A GPU that may switch says what keeps it from switching now: a holder that blocks a
    /// switch (not one that does not), or a prepare that met IN_USE; one whose switch answered
    /// RESET_REQUIRED may not switch; a passthrough H100 may, a vGPU guest may not.
    #[test]
    fn mig_toggle_column_names_what_keeps_a_gpu_from_switching_now() {
        use crate::inventory::{Holder, HolderKind, SwitchBlock, Virtualization};
        let holder = |pid, name: &str, kind| Holder {
            pid,
            name: name.into(),
            kind,
        };
        let mut inv = load_profile("dgx-h100", "n").unwrap();
        inv.gpus[0].mig.holders = vec![
            holder(17, "nvidia-persistenced", HolderKind::Harmless),
            holder(4242, "nv-hostengine", HolderKind::Foreign),
        ];
        inv.gpus[1].mig.holders = vec![holder(17, "nvidia-persistenced", HolderKind::Harmless)];
        inv.gpus[2].mig.switch_block = Some(SwitchBlock::InUse {
            holders: vec![holder(99, "", HolderKind::Foreign)],
        });
        inv.gpus[3].mig.switch_block = Some(SwitchBlock::ResetRequired);
        inv.gpus[4].virtualization = Some(Virtualization::Passthrough);
        inv.gpus[5].virtualization = Some(Virtualization::VgpuGuest);
        let text = render(&inv);
        let line = |minor: u32| {
            let prefix = format!("gpu-{minor} ");
            text.lines()
                .find(|l| l.starts_with(&prefix))
                .unwrap()
                .to_string()
        };
        assert!(
            line(0).ends_with("  yes, not now: held by pid 4242 (nv-hostengine)"),
            "{text}"
        );
        assert!(line(1).ends_with("  yes"), "{text}");
        assert!(
            line(2).ends_with("  yes, not now: a switch met IN_USE (pid 99)"),
            "{text}"
        );
        assert!(
            line(3).ends_with(
                "  no: the driver answered a switch with RESET_REQUIRED: MIG mode left to the \
                 operator"
            ),
            "{text}"
        );
        assert!(line(4).ends_with("  yes"), "{text}");
        assert!(line(5).ends_with("  no: a vGPU guest"), "{text}");
    }
}
