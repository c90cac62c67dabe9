//! The human-readable inventory table printed by `nvdra inventory`.

use std::fmt::Write;

use super::{Inventory, quantity};

/// One line per GPU and per MIG device, columns aligned.
pub fn render(inv: &Inventory) -> String {
    let mut rows: Vec<[String; 8]> = vec![[
        "DEVICE".into(),
        "UUID".into(),
        "MODEL / PROFILE".into(),
        "MEMORY".into(),
        "NUMA".into(),
        "NVLINK".into(),
        "MIG".into(),
        "HEALTH".into(),
    ]];
    for g in &inv.gpus {
        let mig = match (g.mig.capable, g.mig.enabled) {
            (false, _) => "-".to_string(),
            (true, false) => "off".to_string(),
            (true, true) => format!("on ({})", g.mig.devices.len()),
        };
        rows.push([
            format!("gpu-{}", g.minor),
            g.uuid.to_string(),
            g.product_name.clone(),
            quantity(g.memory_bytes),
            g.numa_node.map_or("-".into(), |n| n.to_string()),
            g.nvlink_domain.to_string(),
            mig,
            g.health.to_string(),
        ]);
        for m in &g.mig.devices {
            rows.push([
                format!("  └ mig {}/{}", m.gi_id, m.ci_id),
                m.uuid.to_string(),
                format!("{} @{}", m.profile, m.placement.start),
                quantity(m.memory_bytes),
                g.numa_node.map_or("-".into(), |n| n.to_string()),
                g.nvlink_domain.to_string(),
                String::new(),
                m.health.to_string(),
            ]);
        }
    }
    let mut widths = [0usize; 8];
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in &rows {
        let mut line = String::new();
        for (i, (c, w)) in r.iter().zip(widths).enumerate() {
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

    #[test]
    fn mig_devices_are_listed_under_their_parent() {
        let inv = load_profile("a100-mig-mixed", "n").unwrap();
        let text = render(&inv);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("DEVICE"));
        // 4 GPUs + 4 + 3 MIG devices + header.
        assert_eq!(lines.len(), 1 + 4 + 7, "{text}");
        let gpu1 = lines.iter().position(|l| l.starts_with("gpu-1 ")).unwrap();
        assert!(lines[gpu1].contains("on (4)"), "{text}");
        assert!(lines[gpu1 + 1].contains("3g.20gb @4"), "{text}");
        assert!(lines[gpu1 + 1].contains("19968Mi"), "{text}");
    }
}
