//! The CDI step of prepare, behind the few functions the plugin calls: one spec file per claim
//! (vendor `k8s.<driver>`, class `claim`, devices `<claimUID>-<device>`), written atomically,
//! removed at unprepare, listed at start-up to find orphans.
//!
//! This is a minimal stand-in until the full `cdi` module (driver libraries, control devices,
//! hooks) is merged; the plugin only depends on these signatures.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::inventory::{Gpu, MigDevice};
use crate::ledger::{ClaimUid, SharingRecord};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot write the CDI spec {path}: {source}; check --cdi-root is writable")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot remove the CDI spec {path}: {source}")]
    Remove {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot list the CDI directory {path}: {source}")]
    List {
        path: PathBuf,
        source: std::io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Where and under which vendor the specs go.
#[derive(Clone, Debug)]
pub struct CdiContext {
    pub root: PathBuf,
    pub driver: String,
    pub driver_root: PathBuf,
}

/// One device of a claim, as the spec needs it.
pub struct SpecDevice<'a> {
    pub name: &'a str,
    pub gpu: &'a Gpu,
    pub mig: Option<&'a MigDevice>,
    pub sharing: &'a SharingRecord,
    pub mps_pipe_dir: Option<&'a Path>,
}

impl CdiContext {
    fn vendor(&self) -> String {
        format!("k8s.{}", self.driver)
    }

    fn prefix(&self) -> String {
        format!("{}-claim_", self.vendor())
    }

    /// The spec file of a claim.
    pub fn spec_path(&self, uid: &ClaimUid) -> PathBuf {
        self.root.join(format!("{}{uid}.json", self.prefix()))
    }

    /// The fully qualified CDI id of a claim's device.
    pub fn device_id(&self, uid: &ClaimUid, device: &str) -> String {
        format!("{}/claim={uid}-{device}", self.vendor())
    }

    pub fn spec_exists(&self, uid: &ClaimUid) -> bool {
        self.spec_path(uid).exists()
    }

    /// Writes the claim's spec (temp file, fsync, rename).
    pub fn write_spec(&self, uid: &ClaimUid, devices: &[SpecDevice<'_>]) -> Result<()> {
        let devs: Vec<serde_json::Value> = devices
            .iter()
            .map(|d| {
                let mut env = vec![format!(
                    "NVIDIA_VISIBLE_DEVICES={}",
                    match d.mig {
                        Some(m) => m.uuid.as_str(),
                        None => d.gpu.uuid.as_str(),
                    }
                )];
                if let (
                    SharingRecord::Mps {
                        active_thread_percentage,
                        ..
                    },
                    Some(pipe),
                ) = (d.sharing, d.mps_pipe_dir)
                {
                    env.push(format!("CUDA_MPS_PIPE_DIRECTORY={}", pipe.display()));
                    if let Some(p) = active_thread_percentage {
                        env.push(format!("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={p}"));
                    }
                }
                serde_json::json!({
                    "name": format!("{uid}-{}", d.name),
                    "containerEdits": {
                        "env": env,
                        "deviceNodes": [{"path": format!("/dev/nvidia{}", d.gpu.minor)}],
                    },
                })
            })
            .collect();
        let spec = serde_json::json!({
            "cdiVersion": "0.5.0",
            "kind": format!("{}/claim", self.vendor()),
            "devices": devs,
            "containerEdits": {
                "deviceNodes": [{"path": "/dev/nvidiactl"}],
            },
        });
        let path = self.spec_path(uid);
        let werr = |source| Error::Write {
            path: path.clone(),
            source,
        };
        std::fs::create_dir_all(&self.root).map_err(werr)?;
        let tmp = self.root.join(format!(".{}{uid}.tmp", self.prefix()));
        let mut f = std::fs::File::create(&tmp).map_err(werr)?;
        f.write_all(spec.to_string().as_bytes()).map_err(werr)?;
        f.sync_all().map_err(werr)?;
        drop(f);
        std::fs::rename(&tmp, &path).map_err(werr)?;
        Ok(())
    }

    /// Removes the claim's spec; `false` when there was none.
    pub fn remove_spec(&self, uid: &ClaimUid) -> Result<bool> {
        let path = self.spec_path(uid);
        match std::fs::remove_file(&path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(source) => Err(Error::Remove { path, source }),
        }
    }

    /// Claims that have a spec of ours in the CDI root.
    pub fn list_claim_specs(&self) -> Result<Vec<ClaimUid>> {
        let rd = match std::fs::read_dir(&self.root) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(source) => {
                return Err(Error::List {
                    path: self.root.clone(),
                    source,
                });
            }
        };
        let prefix = self.prefix();
        let mut out = Vec::new();
        for e in rd.flatten() {
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            if let Some(uid) = name
                .strip_prefix(&prefix)
                .and_then(|rest| rest.strip_suffix(".json"))
            {
                out.push(ClaimUid(uid.to_string()));
            }
        }
        out.sort();
        Ok(out)
    }
}
