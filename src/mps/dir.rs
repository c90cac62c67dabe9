//! The directory protocol between the plugin (which asks for daemons) and the MPS host (which
//! runs them), under `--mps-root`:
//!
//! ```text
//! <root>/boot_id                the boot the host last ran in
//! <root>/host.json              what the host's control daemon can do: {"multiUser": bool|null}
//! <root>/<id>/daemon.json       {"devices": [uuid], "multiUser": bool, "owner": text, "bootId": id}
//! <root>/<id>/pipe/             CUDA_MPS_PIPE_DIRECTORY (1777: clients of any UID reach it)
//! <root>/<id>/shm/              the daemon's and its clients' /dev/shm (1777)
//! <root>/<id>/log/              CUDA_MPS_LOG_DIRECTORY (0700)
//! ```
//!
//! `<id>` is `g-<12 hex of sha256(GPU UUID)>` for the daemon of a GPU's shares,
//! `m-<12 hex of sha256(MIG UUID)>` for the daemon of a MIG device's shares and
//! `c-<12 hex of sha256(claim UID)>` for a claim's own MPS daemon. An MPS host older than the
//! `m-` prefix does not see a MIG device's directory: the plugin's wait for its daemon then
//! times out and the share is refused, naming the daemon's log.
//!
//! A directory appears whole: the plugin builds it under a hidden name and renames it into place,
//! so the host never sees an `<id>/` without its `daemon.json` other than one being released.
//! The host removes a released directory by renaming it away first, so a request that comes back
//! meanwhile finds either the old directory or none.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::ids::ClaimUid;
use crate::inventory::{DeviceUuid, GpuUuid, MigUuid};

pub const SPEC: &str = "daemon.json";
pub const BOOT_ID: &str = "boot_id";
/// What the host found its control daemon can do ([`HostCapabilities`]).
pub const CAPABILITIES: &str = "host.json";

/// What the MPS host found at start that the plugin must know: `<root>/host.json`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostCapabilities {
    /// Whether the driver's `nvidia-cuda-mps-control` takes `-M` (multi-user): `None` when the
    /// host could not tell (its daemons are then started with `-M` where asked).
    #[serde(default)]
    pub multi_user: Option<bool>,
}

/// Modes of a daemon's directories: any client UID reaches the pipe and shm, both sticky (as
/// `/tmp` and `/dev/shm` are), so that a tenant may make files of its own there but cannot
/// remove or replace the daemon's control socket or another tenant's files; only the daemon's
/// own user reads its logs.
const PIPE_MODE: u32 = 0o1777;
const SHM_MODE: u32 = 0o1777;
const LOG_MODE: u32 = 0o700;

/// A daemon's directory name.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DaemonId(String);

impl DaemonId {
    /// The daemon of a GPU's consumable-capacity shares.
    pub fn gpu(gpu: &GpuUuid) -> Self {
        Self(format!("g-{}", short_hash(gpu.as_str())))
    }

    /// The daemon of a MIG device's consumable-capacity shares.
    pub fn mig(mig: &MigUuid) -> Self {
        Self(format!("m-{}", short_hash(mig.as_str())))
    }

    /// The daemon of the shares of a GPU or of a MIG device.
    pub fn shares(device: &DeviceUuid) -> Self {
        match device {
            DeviceUuid::Gpu(g) => Self::gpu(g),
            DeviceUuid::Mig(m) => Self::mig(m),
        }
    }

    /// A claim's own daemon (`GpuConfig` sharing `MPS`).
    pub fn claim(claim: &ClaimUid) -> Self {
        Self(format!("c-{}", short_hash(claim.as_str())))
    }

    /// A directory name that is a daemon's; `None` for anything else under the root.
    pub fn parse(name: &str) -> Option<Self> {
        let hex = name
            .strip_prefix("g-")
            .or_else(|| name.strip_prefix("m-"))
            .or_else(|| name.strip_prefix("c-"))?;
        (hex.len() == 12 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
            .then(|| Self(name.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for DaemonId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn short_hash(s: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, s.as_bytes());
    d.as_ref()[..6].iter().map(|b| format!("{b:02x}")).collect()
}

/// What the plugin asks of a daemon: `daemon.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
// Unknown keys are ignored: the host is updated OnDelete (a node drain), so an older host reads
// the requests of a newer plugin, and must still run the daemons they ask for.
#[serde(rename_all = "camelCase")]
pub struct DaemonSpec {
    /// `CUDA_VISIBLE_DEVICES`: GPU or MIG UUIDs.
    pub devices: Vec<String>,
    /// `-M`: one server for clients of every UID.
    #[serde(default)]
    pub multi_user: bool,
    /// Whom the daemon serves, for logs ("the shares of GPU …", "claim …").
    pub owner: String,
    /// The boot the request was written in: a directory of another boot is stale.
    #[serde(default)]
    pub boot_id: Option<String>,
}

/// The paths under one `--mps-root`.
#[derive(Clone, Debug)]
pub struct Layout {
    root: PathBuf,
}

impl Layout {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn dir(&self, id: &DaemonId) -> PathBuf {
        self.root.join(id.as_str())
    }

    pub fn spec(&self, id: &DaemonId) -> PathBuf {
        self.dir(id).join(SPEC)
    }

    /// `CUDA_MPS_PIPE_DIRECTORY`: the control socket is `<pipe>/control`.
    pub fn pipe(&self, id: &DaemonId) -> PathBuf {
        self.dir(id).join("pipe")
    }

    /// The daemon's and its clients' `/dev/shm`.
    pub fn shm(&self, id: &DaemonId) -> PathBuf {
        self.dir(id).join("shm")
    }

    /// `CUDA_MPS_LOG_DIRECTORY`.
    pub fn log(&self, id: &DaemonId) -> PathBuf {
        self.dir(id).join("log")
    }

    pub fn boot_id(&self) -> PathBuf {
        self.root.join(BOOT_ID)
    }

    pub fn capabilities(&self) -> PathBuf {
        self.root.join(CAPABILITIES)
    }

    /// What the host recorded of its control daemon; the default (nothing known) when it
    /// recorded nothing readable.
    pub fn read_capabilities(&self) -> HostCapabilities {
        std::fs::read(self.capabilities())
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    /// The daemons' directories under the root, by id.
    pub fn daemons(&self) -> io::Result<Vec<DaemonId>> {
        let mut out = Vec::new();
        let entries = match std::fs::read_dir(&self.root) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = entry?;
            if let Some(id) = entry.file_name().to_str().and_then(DaemonId::parse)
                && entry.file_type()?.is_dir()
            {
                out.push(id);
            }
        }
        out.sort();
        Ok(out)
    }

    /// The daemon's `daemon.json`; `Ok(None)` when it has none (released, or never asked for).
    /// Read only when it is a regular file of at most [`SPEC_LIMIT`] bytes: opened without
    /// blocking (a FIFO in its place would hold the reader for good) and read no further than
    /// the limit (a link to `/dev/zero` would never end).
    pub fn read_spec(&self, id: &DaemonId) -> Result<Option<DaemonSpec>, SpecError> {
        use std::io::Read;
        use std::os::unix::fs::OpenOptionsExt;
        let path = self.spec(id);
        let read_err = |path: &PathBuf, source| SpecError::Read {
            path: path.clone(),
            source,
        };
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(read_err(&path, source)),
        };
        let meta = file.metadata().map_err(|source| read_err(&path, source))?;
        if !meta.is_file() {
            return Err(SpecError::NotAFile { path });
        }
        let mut bytes = Vec::new();
        file.take(SPEC_LIMIT + 1)
            .read_to_end(&mut bytes)
            .map_err(|source| read_err(&path, source))?;
        if bytes.len() as u64 > SPEC_LIMIT {
            return Err(SpecError::TooLarge {
                path,
                limit: SPEC_LIMIT,
            });
        }
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| SpecError::Parse { path, source })
    }

    /// Creates (or repairs) the daemon's pipe, shm and log directories with their modes, as
    /// `chmod` sets them whatever the umask.
    pub fn make_subdirs(dir: &Path) -> io::Result<()> {
        for (name, mode) in [("pipe", PIPE_MODE), ("shm", SHM_MODE), ("log", LOG_MODE)] {
            let d = dir.join(name);
            match std::fs::create_dir(&d) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode))?;
        }
        Ok(())
    }
}

/// The most bytes a `daemon.json` may hold: the plugin's requests are some 200 bytes.
pub const SPEC_LIMIT: u64 = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("{path} is larger than {limit} bytes, which no daemon request is; it is not read")]
    TooLarge { path: PathBuf, limit: u64 },
    #[error("{path} is not a regular file; it is not read")]
    NotAFile { path: PathBuf },
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{path} is not a daemon request")]
    Parse {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_short_fixed_and_parse_back() {
        let g = DaemonId::gpu(&GpuUuid("GPU-4b7f3a1e-0000-4000-8000-000000000000".into()));
        let c = DaemonId::claim(&ClaimUid::parse("6d1e0f0a-1111-4222-8333-444455556666").unwrap());
        let mig = MigUuid("MIG-4b7f3a1e-0000-4000-8000-000000000000".into());
        let m = DaemonId::mig(&mig);
        for id in [&g, &c, &m] {
            assert_eq!(id.as_str().len(), 14, "{id}");
            assert_eq!(DaemonId::parse(id.as_str()).as_ref(), Some(id));
        }
        assert!(g.as_str().starts_with("g-") && c.as_str().starts_with("c-"));
        assert!(m.as_str().starts_with("m-"));
        assert_eq!(DaemonId::shares(&DeviceUuid::Mig(mig)), m);
        assert_eq!(
            DaemonId::shares(&DeviceUuid::Gpu(GpuUuid(
                "GPU-4b7f3a1e-0000-4000-8000-000000000000".into()
            ))),
            g
        );
        assert_ne!(
            DaemonId::gpu(&GpuUuid("GPU-a".into())),
            DaemonId::gpu(&GpuUuid("GPU-b".into()))
        );
        for other in [
            "boot_id",
            "g-xyz",
            ".g-0123456789ab.tmp",
            "g-0123456789AB",
            "c-0123456789abc",
            "m-0123456789a",
            "x-0123456789ab",
        ] {
            assert_eq!(DaemonId::parse(other), None, "{other}");
        }
    }

    /// The ids are an upgrade contract: the plugin and the MPS host run different versions during
    /// a rolling update (the host is updated OnDelete), and each computes the id of a daemon's
    /// directory on its own. Changing how an id is computed (prefix, hash, length, input) makes
    /// a new plugin look for directories an old host never serves (and the reverse): every
    /// share's wait for its daemon times out. Do not change these literals; they were worked
    /// out with Python's hashlib (`"g-" + sha256(uuid).hexdigest()[:12]`), not with this code.
    #[test]
    fn ids_of_fixed_inputs_are_fixed_across_versions() {
        assert_eq!(
            DaemonId::gpu(&GpuUuid("GPU-4b7f3a1e-0000-4000-8000-000000000000".into())).as_str(),
            "g-4b0f750335fd"
        );
        assert_eq!(
            DaemonId::mig(&MigUuid("MIG-4b7f3a1e-0000-4000-8000-000000000000".into())).as_str(),
            "m-6b5e6e75247f"
        );
        assert_eq!(
            DaemonId::claim(&ClaimUid::parse("6d1e0f0a-1111-4222-8333-444455556666").unwrap())
                .as_str(),
            "c-d6b5aa00e82e"
        );
    }

    #[test]
    fn the_control_socket_of_the_default_root_is_far_under_the_socket_limit() {
        // sockaddr_un.sun_path holds 108 bytes with the terminating NUL.
        let layout = Layout::new(crate::config::DEFAULT_MPS_ROOT);
        let id = DaemonId::gpu(&GpuUuid("GPU-4b7f3a1e-0000-4000-8000-000000000000".into()));
        let control = layout.pipe(&id).join("control");
        let len = control.as_os_str().len();
        assert_eq!(
            control.to_str(),
            Some(format!("/run/nvdra/mps/{id}/pipe/control").as_str())
        );
        assert!(len <= 107 - 60, "{} is {len} bytes", control.display());
    }

    #[test]
    fn an_oversized_or_odd_request_is_refused_by_name_without_blocking() {
        let root = tempfile::tempdir().unwrap();
        let layout = Layout::new(root.path());
        let id = DaemonId::gpu(&GpuUuid("GPU-a".into()));
        std::fs::create_dir_all(layout.dir(&id)).unwrap();
        let spec = layout.spec(&id);
        // A request padded past the limit with whitespace (valid JSON all the same).
        let body = r#"{"devices":["GPU-a"],"owner":"o"}"#;
        let padded = format!("{body}{}", " ".repeat(SPEC_LIMIT as usize));
        std::fs::write(&spec, &padded).unwrap();
        let e = layout.read_spec(&id).unwrap_err();
        assert!(matches!(e, SpecError::TooLarge { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            format!(
                "{} is larger than 65536 bytes, which no daemon request is; it is not read",
                spec.display()
            )
        );
        // One at the limit is read.
        std::fs::write(&spec, &padded[..SPEC_LIMIT as usize]).unwrap();
        assert_eq!(layout.read_spec(&id).unwrap().unwrap().owner, "o");
        // A link to an endless device: not a regular file, not read.
        std::fs::remove_file(&spec).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &spec).unwrap();
        let e = layout.read_spec(&id).unwrap_err();
        assert!(matches!(e, SpecError::NotAFile { .. }), "{e:?}");
        // A FIFO nobody writes: refused at once rather than waited on.
        std::fs::remove_file(&spec).unwrap();
        let c = std::ffi::CString::new(spec.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = layout.read_spec(&id).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("{} is not a regular file; it is not read", spec.display())
        );
    }

    #[test]
    fn a_spec_round_trips_and_a_newer_plugins_keys_are_ignored() {
        let spec = DaemonSpec {
            devices: vec!["GPU-a".into()],
            multi_user: true,
            owner: "the shares of GPU GPU-a".into(),
            boot_id: Some("b1".into()),
        };
        let text = serde_json::to_string(&spec).unwrap();
        assert_eq!(
            text,
            r#"{"devices":["GPU-a"],"multiUser":true,"owner":"the shares of GPU GPU-a","bootId":"b1"}"#
        );
        assert_eq!(serde_json::from_str::<DaemonSpec>(&text).unwrap(), spec);
        // A newer plugin's request: what this host knows of it is read, the rest ignored.
        let newer: DaemonSpec = serde_json::from_str(
            r#"{"devices":["GPU-a"],"multiUser":true,"owner":"o","bootId":"b1","shmSize":"1Gi","serverUid":1000}"#,
        )
        .unwrap();
        assert_eq!(
            newer,
            DaemonSpec {
                owner: "o".into(),
                ..spec
            }
        );
        // What it cannot do without is still required.
        assert!(serde_json::from_str::<DaemonSpec>(r#"{"owner":"x"}"#).is_err());
    }
}
