//! The plugin's own checkpoint: the claims it prepared, with what it told the kubelet and the
//! CDI spec it wrote, in `<plugin dir>/nvdra-checkpoint.json` (NVIDIA's plugin keeps
//! `checkpoint.json` in the same directory, in its own format: the names differ so that a node
//! moving between the two plugins never reads the other's). Replaced atomically and durably
//! ([`crate::durable`]) on every change, so a prepared claim survives a restart of the plugin, and
//! its CDI spec (in `/var/run/cdi`, a tmpfs a reboot empties) is written again from here.

use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::cdi::Spec;

/// The file's name in the plugin's directory.
pub const FILE: &str = "nvdra-checkpoint.json";
/// The format's version; another one is refused rather than misread.
pub const VERSION: u32 = 1;

/// What the plugin did for one device of a claim: what the kubelet was told.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Device {
    pub requests: Vec<String>,
    pub pool: String,
    pub device: String,
    pub cdi_ids: Vec<String>,
}

/// One prepared claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Prepared {
    pub namespace: String,
    pub name: String,
    /// The ComputeDomain's UID the claim's config names.
    pub domain: String,
    /// Whether it is a workload's channel claim (else a daemon's).
    pub channel: bool,
    /// Whether prepare labelled the node for the domain (NVIDIA's shape: the node's own
    /// `channel-0`), so that unprepare removes the label once no claim of the domain is left.
    pub labelled: bool,
    pub devices: Vec<Device>,
    /// The claim's CDI spec, written again at start-up and on a repeated prepare.
    pub spec: Spec,
}

/// The checkpoint's content.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    pub version: u32,
    /// By claim UID.
    pub claims: BTreeMap<String, Prepared>,
}

/// Where the checkpoint lives.
#[derive(Clone, Debug)]
pub struct Store {
    path: PathBuf,
}

impl Store {
    /// The checkpoint in `dir` (created when missing).
    pub fn new(dir: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the plugin's directory {}", dir.display()))?;
        Ok(Self {
            path: dir.join(FILE),
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads it; an absent file is an empty checkpoint.
    pub fn load(&self) -> anyhow::Result<Checkpoint> {
        let text = match std::fs::read(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok(Checkpoint {
                    version: VERSION,
                    claims: BTreeMap::new(),
                });
            }
            Err(e) => {
                return Err(e).with_context(|| format!("cannot read {}", self.path.display()));
            }
        };
        let cp: Checkpoint = serde_json::from_slice(&text).with_context(|| {
            format!(
                "{} is not a checkpoint of this plugin; move it away to start empty (its claims \
                 are then prepared again by the kubelet)",
                self.path.display()
            )
        })?;
        anyhow::ensure!(
            cp.version == VERSION,
            "{} has version {}, this plugin reads version {VERSION}; run the version of nvdra \
             that wrote it, or move the file away",
            self.path.display(),
            cp.version
        );
        Ok(cp)
    }

    /// Replaces it, durably.
    pub fn save(&self, cp: &Checkpoint) -> anyhow::Result<()> {
        let bytes = serde_json::to_vec_pretty(cp).context("cannot serialize the checkpoint")?;
        crate::durable::write(&self.path, &bytes)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_checkpoint_reads_back_and_a_foreign_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::new(&dir.path().join("plugin")).unwrap();
        assert!(store.load().unwrap().claims.is_empty());
        let mut cp = store.load().unwrap();
        cp.claims.insert(
            "uid-1".into(),
            Prepared {
                namespace: "ns".into(),
                name: "c".into(),
                domain: "d".into(),
                channel: true,
                labelled: true,
                devices: vec![Device {
                    requests: vec!["channel".into()],
                    pool: "node-a".into(),
                    device: "channel-0".into(),
                    cdi_ids: vec!["k8s.compute-domain.nvidia.com/claim=uid-1-channel-0".into()],
                }],
                spec: Spec {
                    cdi_version: "0.5.0".into(),
                    kind: "k8s.compute-domain.nvidia.com/claim".into(),
                    devices: vec![],
                    container_edits: Default::default(),
                },
            },
        );
        store.save(&cp).unwrap();
        assert_eq!(store.load().unwrap(), cp);
        std::fs::write(store.path(), br#"{"v2":{"preparedClaims":{}}}"#).unwrap();
        let e = format!("{:#}", store.load().unwrap_err());
        assert!(e.contains("is not a checkpoint of this plugin"), "{e}");
    }
}
