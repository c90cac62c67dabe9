//! Node labels for the legacy world (`--node-labels`): the `nvidia.com/` labels
//! gpu-feature-discovery sets (reference §7), computed from the inventory and NVIDIA's config,
//! so nodeSelectors written for GFD keep working.
//!
//! nvdra owns exactly the keys of [`OWNED`]: every patch sets the ones [`labels`] computes and
//! removes (JSON merge patch `null`) the owned ones it no longer computes; no other label is ever
//! touched. [`run`] follows the inventory owner's publications and sends one patch per change —
//! none while nothing changed.
//!
//! Differences from GFD: no `gfd.timestamp` (it would make every pass a change), no
//! `gpu.machine`, `gpu.mode`, `gpu.clique`, vGPU or per-profile `mig-<profile>.*` labels.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::api::ClusterApi;
use crate::inventory::{Inventory, owner};

use crate::deviceplugin::{MigStrategy, Options, ShareKind};

/// How long after a failed API call the labels are tried again (GFD's `sleepInterval`).
pub const RETRY: Duration = Duration::from_secs(60);

/// Every label key nvdra sets and removes.
pub const OWNED: &[&str] = &[
    "nvidia.com/gpu.present",
    "nvidia.com/gpu.product",
    "nvidia.com/gpu.count",
    "nvidia.com/gpu.memory",
    "nvidia.com/gpu.family",
    "nvidia.com/gpu.compute.major",
    "nvidia.com/gpu.compute.minor",
    "nvidia.com/gpu.replicas",
    "nvidia.com/gpu.sharing-strategy",
    "nvidia.com/cuda.driver.major",
    "nvidia.com/cuda.driver.minor",
    "nvidia.com/cuda.driver.rev",
    "nvidia.com/cuda.driver-version.major",
    "nvidia.com/cuda.driver-version.minor",
    "nvidia.com/cuda.driver-version.revision",
    "nvidia.com/cuda.driver-version.full",
    "nvidia.com/cuda.runtime.major",
    "nvidia.com/cuda.runtime.minor",
    "nvidia.com/cuda.runtime-version.major",
    "nvidia.com/cuda.runtime-version.minor",
    "nvidia.com/cuda.runtime-version.full",
    "nvidia.com/mig.capable",
    "nvidia.com/mig.strategy",
    "nvidia.com/mps.capable",
];

const MIB: u64 = 1024 * 1024;

/// GFD's product sanitising: characters outside `[A-Za-z0-9-_. ]` dropped, spaces → `-`.
pub fn sanitise(product: &str) -> String {
    product
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// GFD's family from a compute capability.
pub fn family(major: u32, minor: u32) -> &'static str {
    match (major, minor) {
        (1, _) => "tesla",
        (2, _) => "fermi",
        (3, _) => "kepler",
        (5, _) => "maxwell",
        (6, _) => "pascal",
        (7, 0..=4) => "volta",
        (7, 5) => "turing",
        (8, 0..=8) => "ampere",
        (8, 9) => "ada-lovelace",
        (9, _) => "hopper",
        (10 | 12, _) => "blackwell",
        (13, _) => "rubin",
        _ => "undefined",
    }
}

/// The labels for this inventory and config; empty without GPUs.
pub fn labels(inv: &Inventory, opts: &Options) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Some(first) = inv.gpus.first() else {
        return out;
    };
    let mut put = |k: &str, v: String| {
        out.insert(format!("nvidia.com/{k}"), v);
    };
    let model = sanitise(&first.product_name);
    let same_model = inv
        .gpus
        .iter()
        .filter(|g| g.product_name == first.product_name)
        .count();
    // The sharing entry of nvidia.com/gpu, if any.
    let shared = opts.sharing.as_ref().and_then(|s| {
        s.resources
            .iter()
            .find(|r| r.name.as_str() == "nvidia.com/gpu")
            .map(|r| (s, r))
    });
    let (replicas, strategy, renamed) = match shared {
        Some((s, r)) => (
            r.replicas,
            match s.kind {
                ShareKind::TimeSlicing => "time-slicing",
                ShareKind::Mps => "mps",
            },
            r.rename.is_some() || s.rename_by_default,
        ),
        None => (1, "none", false),
    };
    let single =
        opts.mig_strategy == MigStrategy::Single && inv.gpus.iter().any(|g| g.in_mig_mode());
    let (product, count, memory_mib) = if single {
        let migs: Vec<_> = inv.gpus.iter().flat_map(|g| &g.mig.devices).collect();
        match migs.first() {
            Some(m) => (
                format!("{model}-MIG-{}", m.profile),
                migs.len(),
                m.memory_bytes / MIB,
            ),
            None => (format!("{model}-MIG-INVALID"), 0, 0),
        }
    } else {
        (model, same_model, first.memory_bytes / MIB)
    };
    let product = if replicas > 1 && !renamed {
        format!("{product}-SHARED")
    } else {
        product
    };
    put("gpu.present", "true".into());
    put("gpu.product", product);
    put("gpu.count", count.to_string());
    put("gpu.memory", memory_mib.to_string());
    let cc = &first.cuda_compute_capability;
    put("gpu.family", family(cc.major, cc.minor).into());
    put("gpu.compute.major", cc.major.to_string());
    put("gpu.compute.minor", cc.minor.to_string());
    put("gpu.replicas", replicas.to_string());
    put("gpu.sharing-strategy", strategy.into());
    let mut driver = first.driver_version.split('.');
    let (dmaj, dmin, drev) = (
        driver.next().unwrap_or_default().to_string(),
        driver.next().unwrap_or_default().to_string(),
        driver.next().unwrap_or_default().to_string(),
    );
    put("cuda.driver.major", dmaj.clone());
    put("cuda.driver.minor", dmin.clone());
    put("cuda.driver.rev", drev.clone());
    put("cuda.driver-version.major", dmaj);
    put("cuda.driver-version.minor", dmin);
    put("cuda.driver-version.revision", drev);
    put("cuda.driver-version.full", first.driver_version.clone());
    let mut cuda = first.cuda_driver_version.split('.');
    let (cmaj, cmin) = (
        cuda.next().unwrap_or_default().to_string(),
        cuda.next().unwrap_or_default().to_string(),
    );
    put("cuda.runtime.major", cmaj.clone());
    put("cuda.runtime.minor", cmin.clone());
    put("cuda.runtime-version.major", cmaj);
    put("cuda.runtime-version.minor", cmin);
    put(
        "cuda.runtime-version.full",
        first.cuda_driver_version.clone(),
    );
    put(
        "mig.capable",
        inv.gpus.iter().any(|g| g.mig.capable).to_string(),
    );
    match opts.mig_strategy {
        MigStrategy::None => {}
        MigStrategy::Single => put("mig.strategy", "single".into()),
        MigStrategy::Mixed => put("mig.strategy", "mixed".into()),
    }
    put("mps.capable", (strategy == "mps").to_string());
    // Only what nvdra owns; a label value is at most 63 characters.
    out.retain(|k, v| OWNED.contains(&k.as_str()) && v.len() <= 63);
    out
}

/// The merge patch from `current` (what the Node has of our keys) to `want`: changed and new
/// keys set, owned keys no longer wanted removed. `None` when there is nothing to change.
pub fn patch(
    current: &BTreeMap<String, String>,
    want: &BTreeMap<String, String>,
) -> Option<BTreeMap<String, Option<String>>> {
    let mut out = BTreeMap::new();
    for (k, v) in want {
        if current.get(k) != Some(v) {
            out.insert(k.clone(), Some(v.clone()));
        }
    }
    for k in current.keys() {
        if OWNED.contains(&k.as_str()) && !want.contains_key(k) {
            out.insert(k.clone(), None);
        }
    }
    (!out.is_empty()).then_some(out)
}

/// Keeps the Node's labels current until `shutdown`, following the inventory owner's
/// publications (`node`): labels are computed from the first one and from every later one, and
/// a patch is sent only when they differ from what the Node has. The Node's own labels are read
/// once at start (and again after a failed patch), so a label left by an earlier run or by GFD
/// is corrected or removed; after that the last applied state is the reference. A failed API
/// call is tried again `retry` later ([`RETRY`] in the daemon) or on the next publication.
pub async fn run(
    api: Arc<dyn ClusterApi>,
    mut node: owner::Watch,
    options: Options,
    name: String,
    retry: Duration,
    shutdown: CancellationToken,
) {
    let mut current: Option<BTreeMap<String, String>> = None;
    loop {
        let published = node.borrow_and_update().node();
        let failed = match published {
            Ok(inv) => !apply(&*api, &name, &labels(&inv, &options), &mut current).await,
            Err(e) => {
                tracing::warn!(error = %crate::report::chain(&e), "node labels: cannot read the inventory");
                false
            }
        };
        tokio::select! {
            biased;
            () = shutdown.cancelled() => return,
            () = owner::changed(&mut node) => {}
            () = tokio::time::sleep(retry), if failed => {}
        }
    }
}

/// Brings the Node's owned labels to `want`, `current` being what it has of them (`None`:
/// read the Node first). `false` when an API call failed (`current` is then `None`).
async fn apply(
    api: &dyn ClusterApi,
    node: &str,
    want: &BTreeMap<String, String>,
    current: &mut Option<BTreeMap<String, String>>,
) -> bool {
    let have = match current.take() {
        Some(c) => c,
        None => match api.get_node(node).await {
            Ok(n) => n
                .metadata
                .labels
                .unwrap_or_default()
                .into_iter()
                .filter(|(k, _)| OWNED.contains(&k.as_str()))
                .collect(),
            Err(crate::api::Error::NotFound(_)) => BTreeMap::new(),
            Err(e) => {
                tracing::warn!(error = %crate::report::chain(&e), node, "node labels: cannot read the Node");
                return false;
            }
        },
    };
    let Some(p) = patch(&have, want) else {
        *current = Some(have);
        return true;
    };
    match api.patch_node_labels(node, &p).await {
        Ok(()) => {
            tracing::info!(node, changed = p.len(), "node labels updated");
            *current = Some(want.clone());
            true
        }
        Err(e) => {
            tracing::warn!(error = %crate::report::chain(&e), node, "node labels: patch failed; retrying");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::DeviceBackend;
    use crate::inventory::sim::SimBackend;

    fn inv(profile: &str) -> Inventory {
        SimBackend::from_profile(profile, "n")
            .unwrap()
            .snapshot()
            .unwrap()
    }

    #[test]
    fn dgx_h100_gets_gfds_labels() {
        let l = labels(&inv("dgx-h100"), &Options::default());
        let get = |k: &str| l.get(&format!("nvidia.com/{k}")).map(String::as_str);
        assert_eq!(get("gpu.product"), Some("NVIDIA-H100-80GB-HBM3"));
        assert_eq!(get("gpu.count"), Some("8"));
        assert_eq!(get("gpu.memory"), Some("81920"));
        assert_eq!(get("gpu.family"), Some("hopper"));
        assert_eq!(get("gpu.compute.major"), Some("9"));
        assert_eq!(get("gpu.compute.minor"), Some("0"));
        assert_eq!(get("cuda.driver.major"), Some("570"));
        assert_eq!(get("cuda.driver.minor"), Some("124"));
        assert_eq!(get("cuda.driver.rev"), Some("06"));
        assert_eq!(get("cuda.runtime-version.full"), Some("12.8"));
        assert_eq!(get("mig.capable"), Some("true"));
        assert_eq!(get("mig.strategy"), None);
        assert_eq!(get("gpu.replicas"), Some("1"));
        assert_eq!(get("gpu.sharing-strategy"), Some("none"));
        assert!(l.keys().all(|k| OWNED.contains(&k.as_str())));
    }

    #[test]
    fn time_slicing_replicas_mark_the_product_shared_unless_renamed() {
        let opts = crate::deviceplugin::nvconfig::parse(
            "config.yaml",
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n",
        )
        .unwrap();
        let l = labels(&inv("dgx-h100"), &opts);
        assert_eq!(l["nvidia.com/gpu.product"], "NVIDIA-H100-80GB-HBM3-SHARED");
        assert_eq!(l["nvidia.com/gpu.replicas"], "4");
        assert_eq!(l["nvidia.com/gpu.sharing-strategy"], "time-slicing");
    }

    #[test]
    fn a_patch_sets_changes_and_removes_only_owned_keys() {
        let cur = BTreeMap::from([
            ("nvidia.com/gpu.count".to_string(), "8".to_string()),
            ("nvidia.com/mig.strategy".to_string(), "mixed".to_string()),
        ]);
        let want = BTreeMap::from([
            ("nvidia.com/gpu.count".to_string(), "7".to_string()),
            ("nvidia.com/gpu.family".to_string(), "hopper".to_string()),
        ]);
        let p = patch(&cur, &want).unwrap();
        assert_eq!(
            p,
            BTreeMap::from([
                ("nvidia.com/gpu.count".to_string(), Some("7".to_string())),
                (
                    "nvidia.com/gpu.family".to_string(),
                    Some("hopper".to_string())
                ),
                ("nvidia.com/mig.strategy".to_string(), None),
            ])
        );
        assert_eq!(patch(&want, &want), None);
    }
}
