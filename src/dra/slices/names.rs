//! Counter set names, and finding a published device by its name ([`DeviceName`] makes the names).

use crate::ids::DeviceName;
use crate::inventory::{Gpu, Inventory, MigDevice, MigProfile, Placement};

/// The name of a GPU's (first) counter set in partitionable mode: `gpu-<minor>-counter-set`.
pub fn counter_set_name(minor: u32) -> String {
    format!("gpu-{minor}-counter-set")
}

pub(super) fn extra_counter_set_name(minor: u32, n: usize) -> String {
    format!("gpu-{minor}-counter-set-{n}")
}

/// What a published device name stands for on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishedDevice<'a> {
    /// A whole GPU (with `--shared-capacity`, also what a share of it is allocated from).
    Gpu(&'a Gpu),
    /// A MIG device: one that exists, or (in partitionable mode) a placement that could be
    /// created.
    Mig {
        parent: &'a Gpu,
        /// Set when the MIG device exists.
        existing: Option<&'a MigDevice>,
        /// Set when the parent lists the profile.
        profile: Option<&'a MigProfile>,
        placement: Placement,
    },
}

/// Looks up what `name` stands for, the inverse of the naming in [`DeviceName`]. It does not say
/// whether the device is published (health, MIG mode and partitioning decide that).
pub fn find_device<'a>(inv: &'a Inventory, name: &str) -> Option<PublishedDevice<'a>> {
    let rest = name.strip_prefix("gpu-")?;
    let (minor, mig) = match rest.split_once('-') {
        Some((minor, mig)) => (minor, Some(mig.strip_prefix("mig-")?)),
        None => (rest, None),
    };
    if minor.len() > 1 && minor.starts_with('0') {
        return None;
    }
    let parent = inv.gpu_by_minor(minor.parse().ok()?)?;
    if mig.is_none() {
        return Some(PublishedDevice::Gpu(parent));
    }
    let minor = parent.minor;
    if let Some(d) =
        parent.mig.devices.iter().find(|d| {
            DeviceName::mig(minor, &d.profile, d.gi_profile_id, d.placement.start) == name
        })
    {
        return Some(PublishedDevice::Mig {
            parent,
            existing: Some(d),
            profile: parent
                .mig
                .profiles
                .iter()
                .find(|p| p.gi_profile_id == d.gi_profile_id),
            placement: d.placement,
        });
    }
    parent.mig.profiles.iter().find_map(|p| {
        p.placements
            .iter()
            .find(|pl| DeviceName::mig(minor, &p.name, p.gi_profile_id, pl.start) == name)
            .map(|pl| PublishedDevice::Mig {
                parent,
                existing: None,
                profile: Some(p),
                placement: *pl,
            })
    })
}
