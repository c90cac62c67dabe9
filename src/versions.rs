//! Kubernetes versions, and the scheduler bugs of some of them that hit nvdra's switches.
//!
//! `nvdra run` reads the API server's version once at start-up (it decides the counter layout of
//! the slices, [`crate::dra::sync::layout_for`]); with it, [`warning`] says in one message which
//! known bugs of that version hit the switches that are on, and which release fixes them. Pure:
//! the table and the comparison, no I/O. The README's "Kubernetes versions" table says the same
//! for people; keep the two together.
//!
//! Only bugs that leave ordinary claims pending (or wrongly allocated) on a node that nvdra's
//! switches shape are here. kubernetes#139034 (a shareable device's counters forgotten in later
//! scheduling cycles, so a MIG placement could be allocated beside a running share) needs a
//! device both shareable and consuming counters, which nvdra publishes only with
//! `--dynamic-mig` and `--shared-capacity` together; its 1.36 fix (kubernetes#139211, merged
//! 2026-06-08) is not yet tied to a patch release here, so it is in the README only, as are bugs
//! of a rare kind of claim with no fix yet (kubernetes#140729, admin access charged counters
//! twice): a warning at every start that no upgrade can silence would teach people to skip
//! warnings.

use std::fmt;

/// A Kubernetes version as the API server reports it (`/version`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KubeVersion {
    pub major: u32,
    pub minor: u32,
    /// `None` when the server reports only `major` and `minor`.
    pub patch: Option<u32>,
}

impl KubeVersion {
    /// From a `/version` answer: its `gitVersion` (`v1.36.1`, also with a suffix as
    /// distributions write it: `v1.36.1-gke.1100`, `v1.36.2+k3s1`, `v1.36.0-rc.1`), or, when
    /// that does not parse, its `major` and `minor` (`"36"`, or `"36+"` as some distributions
    /// report), the patch then unknown. `None` when neither tells the minor version.
    pub fn from_version_info(git_version: &str, major: &str, minor: &str) -> Option<Self> {
        Self::parse_git(git_version).or_else(|| {
            Some(KubeVersion {
                major: leading_number(major)?,
                minor: leading_number(minor)?,
                patch: None,
            })
        })
    }

    fn parse_git(git: &str) -> Option<Self> {
        let core = git.strip_prefix('v').unwrap_or(git);
        let core = core.split(['-', '+']).next()?;
        let mut parts = core.split('.').map(|p| p.parse::<u32>().ok());
        let (major, minor, patch) = (parts.next()??, parts.next()??, parts.next()??);
        parts.next().is_none().then_some(KubeVersion {
            major,
            minor,
            patch: Some(patch),
        })
    }
}

/// The number a string starts with: `"36"` and `"36+"` are 36.
fn leading_number(s: &str) -> Option<u32> {
    let digits: String = s.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

impl fmt::Display for KubeVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.patch {
            Some(p) => write!(f, "{}.{}.{p}", self.major, self.minor),
            None => write!(f, "{}.{}", self.major, self.minor),
        }
    }
}

/// A switch of `nvdra run` that shapes the slices the scheduler allocates from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Switch {
    /// `--partitionable`: MIG placements that share counters (DRAPartitionableDevices).
    Partitionable,
    /// `--shared-capacity`: GPUs allocatable many times by memory (DRAConsumableCapacity).
    SharedCapacity,
    /// `--dynamic-mig`: GPUs offered whole and in MIG placements on shared counters.
    DynamicMig,
}

impl Switch {
    pub fn flag(self) -> &'static str {
        match self {
            Switch::Partitionable => "--partitionable",
            Switch::SharedCapacity => "--shared-capacity",
            Switch::DynamicMig => "--dynamic-mig",
        }
    }
}

/// A known scheduler bug of one Kubernetes minor version.
#[derive(Debug)]
pub struct Bug {
    /// The kubernetes/kubernetes issue.
    pub issue: u32,
    /// What goes wrong, in the scheduler's terms.
    pub what: &'static str,
    /// The switches it hits, each with what nvdra's users see.
    pub hits: &'static [(Switch, &'static str)],
    /// The minor version it is in (1.`minor`).
    pub minor: u32,
    /// The first patch release of that minor version without it.
    pub fixed_patch: u32,
    /// The fix and the releases that carry it, in words.
    pub fixed_in: &'static str,
}

impl Bug {
    /// Whether a server of `version` has the bug. A server that does not say its patch release
    /// may have it.
    pub fn affects(&self, version: &KubeVersion) -> bool {
        version.major == 1
            && version.minor == self.minor
            && version.patch.is_none_or(|p| p < self.fixed_patch)
    }
}

/// The known bugs, by issue.
pub const BUGS: &[Bug] = &[Bug {
    issue: 140436,
    what: "the allocator does not give back what it reserved for a device it then rejects \
           (a candidate's counters on a failed constraint or taint, a claim constraint on too \
           little capacity left)",
    hits: &[
        (
            Switch::Partitionable,
            "a claim with matchAttribute over MIG placements stays pending though it fits",
        ),
        (
            Switch::SharedCapacity,
            "a claim for two GPUs on one NVLink domain (matchAttribute) stays pending though it \
             fits",
        ),
        (
            Switch::DynamicMig,
            "a claim with matchAttribute over GPUs or MIG placements stays pending though it fits",
        ),
    ],
    minor: 36,
    // The cherry-pick (kubernetes#140663) was opened on 2026-07-17, after 1.36.3 was released
    // (2026-07-14): 1.36.3 has the bug, 1.36.4 is the first patch that can have the fix.
    fixed_patch: 4,
    fixed_in: "kubernetes#140431 in 1.37, and its cherry-pick kubernetes#140663 in the first \
               1.36 patch after 1.36.3",
}];

/// The bugs of `version` that hit a switch that is on (`on`), each with the switches it hits.
pub fn hits(version: &KubeVersion, on: &[Switch]) -> Vec<(&'static Bug, Vec<Switch>)> {
    BUGS.iter()
        .filter(|b| b.affects(version))
        .filter_map(|b| {
            let switches: Vec<Switch> = b
                .hits
                .iter()
                .map(|(s, _)| *s)
                .filter(|s| on.contains(s))
                .collect();
            (!switches.is_empty()).then_some((b, switches))
        })
        .collect()
}

/// One message for all the bugs of `version` that hit the switches that are on; `None` when
/// there are none.
pub fn warning(version: &KubeVersion, on: &[Switch]) -> Option<String> {
    let found = hits(version, on);
    if found.is_empty() {
        return None;
    }
    let bugs: Vec<String> = found
        .iter()
        .map(|(bug, switches)| {
            let seen: Vec<String> = bug
                .hits
                .iter()
                .filter(|(s, _)| switches.contains(s))
                .map(|(s, symptom)| format!("with {}, {symptom}", s.flag()))
                .collect();
            format!(
                "kubernetes#{}: {}; {}. Fixed by {}",
                bug.issue,
                bug.what,
                seen.join("; "),
                bug.fixed_in
            )
        })
        .collect();
    let flags: Vec<&str> = on
        .iter()
        .filter(|s| found.iter().any(|(_, hit)| hit.contains(s)))
        .map(|s| s.flag())
        .collect();
    Some(format!(
        "the scheduler of Kubernetes {version} has a known bug that hits {}: {}. Upgrade the \
         control plane to a fixed release, or turn {} off until then",
        flags.join(" and "),
        bugs.join(". Also "),
        flags.join(" and ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(minor: u32, patch: Option<u32>) -> KubeVersion {
        KubeVersion {
            major: 1,
            minor,
            patch,
        }
    }

    #[test]
    fn versions_parse_from_what_servers_report() {
        let parse = |git: &str, minor: &str| KubeVersion::from_version_info(git, "1", minor);
        assert_eq!(parse("v1.36.1", "36"), Some(v(36, Some(1))));
        assert_eq!(parse("v1.36.1-gke.1100", "36"), Some(v(36, Some(1))));
        assert_eq!(parse("v1.36.2+k3s1", "36"), Some(v(36, Some(2))));
        assert_eq!(parse("v1.36.0-rc.1", "36"), Some(v(36, Some(0))));
        // gitVersion unreadable: major and minor, patch unknown.
        assert_eq!(parse("", "35+"), Some(v(35, None)));
        assert_eq!(parse("v1.36", "36"), Some(v(36, None)));
        assert_eq!(parse("v1.36.1.4", "36"), Some(v(36, None)));
        assert_eq!(parse("", "x"), None);
        assert_eq!(v(36, Some(1)).to_string(), "1.36.1");
        assert_eq!(v(36, None).to_string(), "1.36");
    }

    #[test]
    fn the_leak_hits_both_switches_on_1_36_0_to_1_36_3_only() {
        let both = [Switch::Partitionable, Switch::SharedCapacity];
        for patch in 0..=3 {
            let found = hits(&v(36, Some(patch)), &both);
            assert_eq!(found.len(), 1, "1.36.{patch}");
            assert_eq!(found[0].0.issue, 140436);
            assert_eq!(found[0].1, both);
        }
        for version in [
            v(36, Some(4)),
            v(36, Some(9)),
            v(35, Some(2)),
            v(37, Some(0)),
        ] {
            assert!(hits(&version, &both).is_empty(), "{version}");
        }
        // A server that does not say its patch may have it.
        assert_eq!(hits(&v(36, None), &both).len(), 1);
        // Another major version is not Kubernetes 1.36.
        let two = KubeVersion {
            major: 2,
            ..v(36, Some(1))
        };
        assert!(hits(&two, &both).is_empty());
    }

    #[test]
    fn no_switch_on_no_warning() {
        assert_eq!(warning(&v(36, Some(1)), &[]), None);
        assert_eq!(warning(&v(37, Some(0)), &[Switch::Partitionable]), None);
    }

    #[test]
    fn the_warning_names_the_bug_the_switch_its_symptom_and_the_fix() {
        let text = warning(&v(36, Some(1)), &[Switch::Partitionable]).unwrap();
        assert!(text.starts_with("the scheduler of Kubernetes 1.36.1 has a known bug that hits --partitionable: kubernetes#140436: "), "{text}");
        assert!(
            text.contains("with --partitionable, a claim with matchAttribute over MIG placements stays pending"),
            "{text}"
        );
        assert!(!text.contains("--shared-capacity"), "{text}");
        assert!(text.contains("kubernetes#140663"), "{text}");
        assert!(
            text.ends_with("or turn --partitionable off until then"),
            "{text}"
        );
        let text = warning(
            &v(36, Some(2)),
            &[Switch::Partitionable, Switch::SharedCapacity],
        )
        .unwrap();
        assert!(
            text.contains("hits --partitionable and --shared-capacity"),
            "{text}"
        );
        assert!(
            text.contains("with --shared-capacity, a claim for two GPUs"),
            "{text}"
        );
        // One bug, named once.
        assert_eq!(text.matches("kubernetes#140436").count(), 1, "{text}");
        // Dynamic MIG's counters meet the same leak.
        let text = warning(&v(36, Some(3)), &[Switch::DynamicMig]).unwrap();
        assert!(
            text.contains("hits --dynamic-mig: kubernetes#140436"),
            "{text}"
        );
        assert!(
            text.contains("with --dynamic-mig, a claim with matchAttribute"),
            "{text}"
        );
        assert_eq!(warning(&v(36, Some(4)), &[Switch::DynamicMig]), None);
    }
}
