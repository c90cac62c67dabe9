//! The human-readable inventory table printed by `nvdra inventory`.

use std::fmt::Write;

use super::{Inventory, on_off, quantity};

/// One line per GPU and per MIG device, columns aligned. The FABRIC column
/// (`<clusterUUID>.<cliqueID>`) appears only when some GPU completed an NVLink fabric
/// registration. MIG shows the current mode (with the MIG device count when on) and any change
/// pending a GPU reset; MIG TOGGLE whether nvdra may change the mode at run time
/// ([`Gpu::mig_toggle`](super::Gpu::mig_toggle)), or why not.
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
            Ok(()) => "yes".to_string(),
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
}
