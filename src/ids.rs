//! The typed identifiers that the ledger, the CDI writer and the slices share: a claim's UID and
//! a device's name in the pool. Domain only: no I/O, and nothing from the modules that use them.
//!
//! Invariants:
//! - Each is parsed once, where it enters (the kubelet's request, the checkpoint, a spec file's
//!   name), and cannot hold an invalid value; code that holds one never checks it again.
//! - A [`DeviceName`] is made from stable hardware facts ([`DeviceName::gpu`],
//!   [`DeviceName::mig`]) or parsed by the same grammar, so a name read back from a checkpoint is
//!   one this driver makes; [`find_device`], the inverse of the naming, finds what a name stands
//!   for in an inventory.
//!
//! GPU and MIG UUIDs are not here: they are what the inventory reports, and every module above
//! reads them from [`crate::inventory`].

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::inventory::{Gpu, Inventory, MigDevice, MigProfile, Placement};

/// A ResourceClaim UID. It prefixes the claim's CDI device names and names its CDI spec file, so
/// it follows the CDI device-name grammar, `[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?` (which
/// also rules out `/`). [`ClaimUid::parse`] (where a request enters) and reading a checkpoint are
/// the only ways to make one.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ClaimUid(String);

/// A string that cannot be a claim UID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid CDI device name {0:?}: a device name starts and ends with a letter or digit and \
     contains only letters, digits, '_', '.', ':' and '-'"
)]
pub struct InvalidClaimUid(pub String);

impl ClaimUid {
    pub fn parse(uid: impl Into<String>) -> Result<Self, InvalidClaimUid> {
        let uid = uid.into();
        let middle = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-');
        let valid = match uid.as_bytes() {
            [] => false,
            [only] => only.is_ascii_alphanumeric(),
            [head, mid @ .., tail] => {
                head.is_ascii_alphanumeric()
                    && mid.iter().all(middle)
                    && tail.is_ascii_alphanumeric()
            }
        };
        if valid {
            Ok(Self(uid))
        } else {
            Err(InvalidClaimUid(uid))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ClaimUid {
    type Error = InvalidClaimUid;
    fn try_from(uid: String) -> Result<Self, InvalidClaimUid> {
        Self::parse(uid)
    }
}

impl From<ClaimUid> for String {
    fn from(uid: ClaimUid) -> String {
        uid.0
    }
}

impl PartialEq<String> for ClaimUid {
    fn eq(&self, other: &String) -> bool {
        self.0 == *other
    }
}

impl fmt::Display for ClaimUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A device name in the pool, derived from stable hardware facts only. Made by [`DeviceName::gpu`]
/// and [`DeviceName::mig`], or parsed (a checkpoint) by the same grammar.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct DeviceName(String);

/// A string that is not a device name of this driver.
#[derive(Debug, thiserror::Error)]
#[error(
    "{0:?} is not a device name of this driver (gpu-<minor> or \
     gpu-<minor>-mig-<profile>-<giProfileId>-<start>)"
)]
pub struct InvalidDeviceName(pub String);

impl DeviceName {
    /// A whole GPU: `gpu-<minor>` (the `N` of `/dev/nvidiaN`, as NVIDIA's driver names it).
    pub fn gpu(minor: u32) -> Self {
        Self(format!("gpu-{minor}"))
    }

    /// A MIG device: `gpu-<minor>-mig-<profile>-<giProfileId>-<placementStart>`, with the profile
    /// lower-cased and reduced to letters, digits and dashes (`1g.5gb+me` → `1g5gbme`).
    pub fn mig(parent_minor: u32, profile: &str, gi_profile_id: u32, start: u32) -> Self {
        Self(format!(
            "gpu-{parent_minor}-mig-{}-{gi_profile_id}-{start}",
            profile_label(profile)
        ))
    }

    /// Checks the grammar only; whether the device exists is the inventory's question
    /// ([`find_device`]).
    pub fn parse(name: &str) -> Result<Self, InvalidDeviceName> {
        let number = |s: &str| {
            !s.is_empty()
                && s.bytes().all(|b| b.is_ascii_digit())
                && (s.len() == 1 || !s.starts_with('0'))
        };
        let valid = || {
            let rest = name.strip_prefix("gpu-")?;
            let (minor, mig) = match rest.split_once('-') {
                // The shareable twin of a GPU that nvdra published before one device per
                // GPU (checkpoint version 2): never made any more, still read back.
                Some((minor, "shared")) => return number(minor).then_some(()),
                Some((minor, mig)) => (minor, Some(mig.strip_prefix("mig-")?)),
                None => (rest, None),
            };
            let ok = number(minor)
                && mig.is_none_or(|mig| {
                    let mut parts = mig.rsplitn(3, '-');
                    let (start, gi, label) = (parts.next(), parts.next(), parts.next());
                    matches!((start, gi, label), (Some(s), Some(g), Some(l))
                        if number(s) && number(g) && !l.is_empty() && profile_label(l) == l)
                });
            ok.then_some(())
        };
        match valid() {
            Some(()) => Ok(Self(name.to_string())),
            None => Err(InvalidDeviceName(name.to_string())),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for DeviceName {
    type Error = InvalidDeviceName;
    fn try_from(name: String) -> Result<Self, InvalidDeviceName> {
        Self::parse(&name)
    }
}

impl From<DeviceName> for String {
    fn from(name: DeviceName) -> String {
        name.0
    }
}

impl PartialEq<&str> for DeviceName {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl fmt::Display for DeviceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
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

/// A MIG profile name as it appears in device names: lower case, only `[a-z0-9-]`, no leading or
/// trailing dash (RFC 1123).
pub fn profile_label(profile: &str) -> String {
    let label: String = profile
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .filter(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
        .collect();
    label.trim_matches('-').to_string()
}

#[cfg(test)]
mod tests;
