//! NVLink domains: GPUs that reach each other over NVLink or a shared NVSwitch share a domain.

use std::collections::BTreeMap;

use super::{Gpu, NvLinkPeer, PciBusId};

/// Sets every GPU's `nvlink_domain` to the lowest index among the GPUs it can reach over NVLink.
///
/// GPUs are connected when one lists the other as a peer (either direction counts, since a
/// backend may see only one side) or when both reach the same NVSwitch. Peers naming a GPU that is
/// not in the list (hidden by `CUDA_VISIBLE_DEVICES`, or fallen off the bus) are ignored.
pub fn assign_nvlink_domains(gpus: &mut [Gpu]) {
    let n = gpus.len();
    let mut parent: Vec<usize> = (0..n).collect();
    fn find(parent: &mut [usize], mut x: usize) -> usize {
        while parent[x] != x {
            parent[x] = parent[parent[x]];
            x = parent[x];
        }
        x
    }
    let union = |parent: &mut Vec<usize>, a: usize, b: usize| {
        let (ra, rb) = (find(parent, a), find(parent, b));
        if ra != rb {
            parent[ra.max(rb)] = ra.min(rb);
        }
    };
    let by_bus: BTreeMap<&PciBusId, usize> = gpus
        .iter()
        .enumerate()
        .map(|(i, g)| (&g.pci_bus_id, i))
        .collect();
    let mut switch_owner: BTreeMap<&str, usize> = BTreeMap::new();
    let mut edges = Vec::new();
    for (i, g) in gpus.iter().enumerate() {
        for peer in &g.nvlink_peers {
            match peer {
                NvLinkPeer::Gpu(bus) => {
                    if let Some(&j) = by_bus.get(bus) {
                        edges.push((i, j));
                    }
                }
                NvLinkPeer::Switch(id) => {
                    let first = *switch_owner.entry(id.as_str()).or_insert(i);
                    edges.push((i, first));
                }
            }
        }
    }
    for (a, b) in edges {
        union(&mut parent, a, b);
    }
    let roots: Vec<usize> = (0..n).map(|i| find(&mut parent, i)).collect();
    let mut domain_of_root: BTreeMap<usize, u32> = BTreeMap::new();
    for (g, &root) in gpus.iter().zip(&roots) {
        domain_of_root
            .entry(root)
            .and_modify(|d| *d = (*d).min(g.index))
            .or_insert(g.index);
    }
    for (g, root) in gpus.iter_mut().zip(&roots) {
        g.nvlink_domain = domain_of_root[root];
    }
}
