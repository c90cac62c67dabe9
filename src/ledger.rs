//! The allocation ledger: which claim holds which device, persisted as the DRA checkpoint.
//!
//! The file is `<plugin data dir>/checkpoint.json`, versioned JSON:
//! `{"version": 1, "bootId": …, "claims": {<uid>: {"state": "PrepareStarted"|"PrepareCompleted",
//! "namespace", "name", "devices": [...]}}}`.
//!
//! Versions: during a rolling update an old and a new pod share the file, and after a rollback
//! the old one reads what the new one wrote. So this build reads every version nvdra has written
//! ([`OLDEST_VERSION`]`..=`[`VERSION`]), writes the *oldest* version that holds the state
//! ([`version_for`]), and refuses a newer version than it knows — without touching the file —
//! instead of discarding another pod's claims.
//!
//! | version | written by | shape |
//! |---|---|---|
//! | 1 | since `9a33f72` | as above, plus an optional `"pods": [{"name", "uid"}]` per claim since per-pod metrics (read as none when absent; older builds ignore it); a device's `sharing` is `{"strategy": "TimeSlicing"\|"MPS", …}` up to `24aada3`, then `{"strategy": "timeSlicing"\|"mps", …}` (this build reads both and writes the latter, which the builds since `24aada3` read; an exclusive device has no `sharing` in either) |
//! | 2 | since `--shared-capacity` (`4a041ed`) | version 1, and a device (`gpu-<minor>-shared`) may carry `"consumedCapacity": {"memory": <bytes>, "compute": <percent>}` (a share of a GPU); written only while some claim holds a share |
//! | 3 | since one device per shareable GPU | version 1, and a device (`gpu-<minor>`) may carry `"consumedCapacity": {"memory": <bytes>, "multiprocessors"?: <count>}` (a share of a GPU; no `compute`, which version-2 readers require); written only while some claim holds a share. Version 2 reads as version 3 with `compute` dropped. Since `--consumable-shares`, `consumedCapacity` may also carry `"shares": {"count", "of"}` (integer mode: the share's part of the GPU), read as absent when missing; builds that predate it ignore it and drop it when they rewrite the file: they count such a share as a share, but a spec they rebuild for an `unlimited` or integer share that asked for no memory (`"memory": 0`) carries their container memory limit of 0 (they knew only `memory` shares). Since burstable shares, `consumedCapacity` may also carry `"burstLimit": <bytes>` (the share's hard limit, from its config's `defaultPinnedDeviceMemoryLimit`), read as absent when missing; builds that predate it ignore it and drop it when they rewrite the file: a spec they rebuild holds the share's container to its soft limit as its hard one (stricter, never looser), while its per-process limit, kept in the record's `sharing`, still carries the burst |
//!
//! Since dynamic MIG (`--dynamic-mig`) every version may also carry `"migEnabled": [<GPU UUID>,
//! …]` at the top: the GPUs whose MIG mode nvdra turned on (recorded durably *before* it turns
//! one on, dropped after it turned it off), so that start-up turns off a mode a crash left on
//! with no instance. Absent when empty and read as empty; builds that predate it ignore it and
//! drop it when they rewrite the file, which leaves such a GPU in MIG mode (never an instance
//! destroyed): the decision it changes is only whether nvdra turns the mode off again.
//!
//! A change to what the file holds gets a new version here, a reader for it, and a
//! [`version_for`] that picks it only for a state the older versions cannot hold.
//!
//! Invariants:
//! - Every write is atomic and durable ([`crate::durable`]): a temp file in the same directory,
//!   fsync, rename, fsync of the directory. A crash leaves either the old or the new file, never
//!   a mix, and a failed write leaves no temp file.
//! - A prepare is two-phase: the claim is recorded `PrepareStarted` (with the devices it is about
//!   to touch) *before* any hardware or CDI change, and `PrepareCompleted` after. A `Started`
//!   entry found at start-up is rolled back by the plugin.
//! - A file written before a reboot (different boot id) is stale: its entries are dropped.
//! - A corrupt file, or one of a version nvdra never wrote, is moved aside
//!   (`checkpoint.json.corrupt-<ts>`) with an error log, never silently overwritten. A file of a
//!   newer version is left in place and loading fails with [`Error::TooNew`].
//! - One writer: mutations go to the in-memory copy under a lock that is never held across an
//!   `.await`; [`Ledger::flush`] asks the single [`Writer`] task for a durable write, and the
//!   writer batches every flush request pending at that moment into one file write (group
//!   commit), so concurrent prepares share fsyncs.
//! - The ledger holds the checkpoint and nothing else. In `--mode both`, what containers hold
//!   through the device plugin lives with the device plugin, in memory, which hands the ledger a
//!   [`HeldElsewhere`]: a claim's reservation ([`Ledger::update_with_holds`]) consults it under
//!   the ledger's lock, and the device plugin checks the claims and records a hold under the same
//!   lock ([`Ledger::read`]), so one exclusive GPU never has two consumers. Lock order: the
//!   ledger's state, then the other path's holds.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use crate::ids::{ClaimUid, DeviceName};
use crate::inventory::{DeviceUuid, GpuUuid, MigUuid, Placement};
use crate::lock::lock;
use crate::sharing::Sharing;

pub mod shares;

pub use shares::{Consumed, Shares};

/// The newest checkpoint version this build reads.
pub const VERSION: u32 = 3;
/// The oldest checkpoint version nvdra ever wrote (and this build still reads).
pub const OLDEST_VERSION: u32 = 1;
/// The checkpoint's file name in the plugin data directory.
pub const FILE_NAME: &str = "checkpoint.json";
/// Where the boot id comes from.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read the checkpoint {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the checkpoint {path} has version {found}, newer than the versions \
         {OLDEST_VERSION}..={VERSION} this nvdra reads; it was written by a newer nvdra (a rolling \
         update or a rollback in progress?) and is left as it is: run that version, or move the \
         file away by hand to start without its claims"
    )]
    TooNew { path: PathBuf, found: u64 },
    #[error("cannot create the plugin data directory {path}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot move the unreadable checkpoint aside to {path}")]
    MoveAside {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot save the checkpoint (check that the plugin data directory is writable and not full)"
    )]
    Save(#[source] crate::durable::Error),
    #[error("cannot encode the checkpoint")]
    Encode(#[from] serde_json::Error),
    #[error("cannot read the boot id from {path}")]
    BootId {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the checkpoint writer has stopped (shutting down); retry after the restart")]
    WriterGone,
    #[error("the checkpoint writer panicked")]
    WriterPanicked(#[source] tokio::task::JoinError),
    /// The writer's failure, as every flush of its batch sees it.
    #[error(transparent)]
    Flush(Arc<Error>),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Consumers of devices that the checkpoint does not record: in `--mode both`, the containers of
/// the device-plugin path. Its owner changes what it reports only inside [`Ledger::read`], after
/// checking the claims there, so a reservation that consults it sees either the claim's check
/// and the hold, or neither.
pub trait HeldElsewhere: Send + Sync {
    /// What of the hardware `r` needs is held, and by whom, if any.
    fn holder_of(&self, r: &DeviceRecord) -> Option<HeldBy>;
}

/// A device held outside the checkpoint, as a refused claim names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldBy {
    /// The hardware held (a GPU, or a MIG device of one).
    pub held: String,
    pub holder: String,
}

/// Nothing is held elsewhere (every mode but `both`).
struct NothingElsewhere;

impl HeldElsewhere for NothingElsewhere {
    fn holder_of(&self, _: &DeviceRecord) -> Option<HeldBy> {
        None
    }
}

/// How far a claim's preparation got.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClaimState {
    PrepareStarted,
    PrepareCompleted,
}

fn is_exclusive(s: &Sharing) -> bool {
    matches!(s, Sharing::Exclusive)
}

/// A MIG device of a prepared claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MigRecord {
    /// The MIG device UUID; `None` while a device to be created at prepare does not exist yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<MigUuid>,
    pub profile: String,
    pub gi_profile_id: u32,
    pub placement: Placement,
    /// Created by this prepare (partitionable mode), so unprepare destroys it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub created: bool,
}

/// One device of a prepared claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceRecord {
    /// Base request names (no `/subrequest`).
    pub requests: Vec<String>,
    pub pool: String,
    pub device: DeviceName,
    pub cdi_ids: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub admin_access: bool,
    /// The physical GPU (the parent of a MIG device).
    pub gpu: GpuUuid,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigRecord>,
    /// What a consumable-capacity share of a GPU (`--shared-capacity`: an allocation of
    /// `gpu-<minor>` that consumes less than its whole memory) consumes of it; `None` for
    /// anything else, a whole GPU allocated with a `shareID` included. Such a record needs
    /// checkpoint version 3.
    #[serde(
        default,
        rename = "consumedCapacity",
        skip_serializing_if = "Option::is_none"
    )]
    pub consumed: Option<Consumed>,
    /// How the device is shared (enough to undo it and to rebuild the CDI spec).
    #[serde(
        default,
        skip_serializing_if = "is_exclusive",
        deserialize_with = "v1::sharing"
    )]
    pub sharing: Sharing,
}

impl DeviceRecord {
    /// The device a share of this record is of, which its MPS daemon, its count and its memory
    /// are keyed by: the MIG device for a MIG device's share (an existing one: only those are
    /// published shareable), else the GPU.
    pub fn share_target(&self) -> DeviceUuid {
        match self.mig.as_ref().and_then(|m| m.uuid.clone()) {
            Some(mig) => DeviceUuid::Mig(mig),
            None => DeviceUuid::Gpu(self.gpu.clone()),
        }
    }
}

/// A pod a claim is reserved for (its `status.reservedFor`, in the claim's namespace).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PodRef {
    pub name: String,
    pub uid: String,
}

/// One claim in the ledger.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimEntry {
    pub state: ClaimState,
    pub namespace: String,
    pub name: String,
    pub devices: Vec<DeviceRecord>,
    /// The pods the claim was reserved for when it was prepared (for `/metrics`' attribution;
    /// nothing decides on it). Absent in files written before it existed, and ignored by those
    /// builds: an optional field that changes no decision needs no new version.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<PodRef>,
    /// The user the claim's pod runs as, recorded when it holds a share of a GPU whose MPS
    /// serves one user at a time (before Volta): a share for another user is refused. Absent
    /// otherwise, and in files written before it existed; a build that predates it ignores it
    /// (and with it the check, after a downgrade).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<ShareUser>,
    /// Under `--share-trust-domain=label:<key>`, the value of that label on the claim's
    /// namespace when its share was admitted: a later share of its GPU from another namespace
    /// must come with the same value. Absent otherwise (and for a namespace without the label),
    /// and in files written before it existed; a build that predates it ignores it (and with it
    /// the check, after a downgrade).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trust_label: Option<crate::sharing::trust::TrustLabel>,
}

/// The user a share's pod runs as, as far as the pod says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ShareUser {
    /// `runAsUser` of its containers (or of the pod).
    Uid(i64),
    /// No `runAsUser`: the image's user, which the node cannot see before the container runs.
    ImageDefault,
}

impl std::fmt::Display for ShareUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShareUser::Uid(u) => write!(f, "uid {u}"),
            ShareUser::ImageDefault => f.write_str("its image's user (no runAsUser)"),
        }
    }
}

/// The checkpoint's content. Its version is not part of it: that is a property of the file,
/// chosen when writing ([`version_for`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub boot_id: String,
    pub claims: BTreeMap<ClaimUid, ClaimEntry>,
    /// The GPUs whose MIG mode nvdra turned on (dynamic MIG): recorded before the mode changes,
    /// forgotten after nvdra turned it off again. Start-up turns off the mode of such a GPU that
    /// holds no instance (unless `--dynamic-mig=keep-on`).
    pub mig_enabled: BTreeSet<GpuUuid>,
}

impl Checkpoint {
    pub fn empty(boot_id: &str) -> Self {
        Self {
            boot_id: boot_id.to_string(),
            claims: BTreeMap::new(),
            mig_enabled: BTreeSet::new(),
        }
    }
}

/// The oldest checkpoint version that holds `cp`, which is the version it is written as.
///
/// A field that version 1 cannot hold raises this only for the checkpoints that use it, so pods
/// of older builds keep reading the rest: a device's `consumedCapacity` (a share of a GPU,
/// `--shared-capacity`) needs version 3, as a build that reads only version 1 would drop it and
/// count the GPU as free, and one that reads version 2 would find no `compute` and move the
/// file aside. Version 2 is never written again.
pub fn version_for(cp: &Checkpoint) -> u32 {
    let shares = cp
        .claims
        .values()
        .any(|e| e.devices.iter().any(|d| d.consumed.is_some()));
    if shares { 3 } else { OLDEST_VERSION }
}

/// The file as written: the version, then the content.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct FileOut<'a> {
    version: u32,
    boot_id: &'a str,
    claims: &'a BTreeMap<ClaimUid, ClaimEntry>,
    #[serde(skip_serializing_if = "BTreeSet::is_empty")]
    mig_enabled: &'a BTreeSet<GpuUuid>,
}

/// Version 1 as read.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct FileV1 {
    boot_id: String,
    claims: BTreeMap<ClaimUid, ClaimEntry>,
    /// Absent before dynamic MIG.
    #[serde(default)]
    mig_enabled: BTreeSet<GpuUuid>,
}

mod v1 {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer};

    use crate::sharing::{MpsSettings, Sharing, TimeSliceInterval};

    /// A device's `sharing` in either spelling of version 1 (see the module doc).
    #[derive(Deserialize)]
    #[serde(tag = "strategy", rename_all = "camelCase")]
    enum SharingV1 {
        #[serde(alias = "Exclusive")]
        Exclusive,
        #[serde(alias = "TimeSlicing")]
        TimeSlicing { interval: TimeSliceInterval },
        #[serde(alias = "MPS", rename_all = "camelCase")]
        Mps {
            #[serde(default)]
            active_thread_percentage: Option<u32>,
            #[serde(default)]
            pinned_memory_limit: Option<u64>,
            /// Absent before `24aada3`.
            #[serde(default)]
            per_device_pinned_memory_limit: BTreeMap<String, u64>,
        },
    }

    pub(super) fn sharing<'de, D: Deserializer<'de>>(d: D) -> Result<Sharing, D::Error> {
        Ok(match SharingV1::deserialize(d)? {
            SharingV1::Exclusive => Sharing::Exclusive,
            SharingV1::TimeSlicing { interval } => Sharing::TimeSlicing { interval },
            SharingV1::Mps {
                active_thread_percentage,
                pinned_memory_limit,
                per_device_pinned_memory_limit,
            } => Sharing::Mps(MpsSettings {
                active_thread_percentage,
                pinned_memory_limit,
                per_device_pinned_memory_limit,
            }),
        })
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Reads the kernel's boot id (or the file given, for tests).
pub fn read_boot_id(path: &Path) -> Result<String> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|source| Error::BootId {
            path: path.to_path_buf(),
            source,
        })
}

/// What loading found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadOutcome {
    /// No file: a fresh start.
    Fresh,
    /// The file was read; `claims` entries.
    Loaded { claims: usize },
    /// Written before the last reboot; its `dropped` entries were discarded.
    BootChanged { dropped: usize },
    /// Unreadable or of an unknown version; moved to `moved_to`.
    MovedAside { moved_to: PathBuf, reason: String },
}

/// The identity of the file as last written or read, to notice another process's writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileId {
    ino: u64,
    dev: u64,
    len: u64,
    mtime_ns: i64,
}

fn file_id(path: &Path) -> Option<FileId> {
    let m = std::fs::metadata(path).ok()?;
    Some(FileId {
        ino: m.ino(),
        dev: m.dev(),
        len: m.len(),
        mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
    })
}

/// Why a checkpoint's bytes are not a checkpoint this build can use.
enum Undecodable {
    /// Written by a newer nvdra: leave it alone.
    TooNew(u64),
    /// Corrupt, or of a version nvdra never wrote: move it aside.
    Corrupt(String),
}

/// Decodes a checkpoint file of any version this build reads.
fn decode(bytes: &[u8]) -> Result<Checkpoint, Undecodable> {
    let value = serde_json::from_slice::<serde_json::Value>(bytes)
        .map_err(|e| Undecodable::Corrupt(format!("not JSON: {e}")))?;
    let Some(version) = value.get("version").and_then(|v| v.as_u64()) else {
        return Err(Undecodable::Corrupt("no version field".to_string()));
    };
    match version {
        // Versions 2 and 3 are version 1 plus `consumedCapacity`, which the record reads when
        // present (dropping version 2's `compute`).
        1..=3 => {
            let FileV1 {
                boot_id,
                claims,
                mig_enabled,
            } = serde_json::from_value(value)
                .map_err(|e| Undecodable::Corrupt(format!("invalid: {e}")))?;
            Ok(Checkpoint {
                boot_id,
                claims,
                mig_enabled,
            })
        }
        v if v > u64::from(VERSION) => Err(Undecodable::TooNew(v)),
        v => Err(Undecodable::Corrupt(format!(
            "version {v} was never written by nvdra (versions {OLDEST_VERSION}..={VERSION})"
        ))),
    }
}

/// Encodes `cp` as the oldest version that holds it ([`version_for`]).
pub fn encode(cp: &Checkpoint) -> Result<Vec<u8>> {
    let file = FileOut {
        version: version_for(cp),
        boot_id: &cp.boot_id,
        claims: &cp.claims,
        mig_enabled: &cp.mig_enabled,
    };
    Ok(serde_json::to_vec_pretty(&file)?)
}

/// Reads the checkpoint file at `path`, applying the boot-id, version and corruption rules.
pub fn load_file(path: &Path, boot_id: &str) -> Result<(Checkpoint, LoadOutcome)> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok((Checkpoint::empty(boot_id), LoadOutcome::Fresh));
        }
        Err(source) => {
            return Err(Error::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    match decode(&bytes) {
        Ok(cp) if cp.boot_id != boot_id => {
            let dropped = cp.claims.len();
            tracing::warn!(
                path = %path.display(), old_boot_id = %cp.boot_id, new_boot_id = %boot_id, dropped,
                "checkpoint predates the last reboot; its claims are dropped"
            );
            Ok((
                Checkpoint::empty(boot_id),
                LoadOutcome::BootChanged { dropped },
            ))
        }
        Ok(cp) => {
            let claims = cp.claims.len();
            Ok((cp, LoadOutcome::Loaded { claims }))
        }
        Err(Undecodable::TooNew(found)) => Err(Error::TooNew {
            path: path.to_path_buf(),
            found,
        }),
        Err(Undecodable::Corrupt(reason)) => {
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default();
            let mut moved_to = path.as_os_str().to_owned();
            moved_to.push(format!(".corrupt-{ts}"));
            let moved_to = PathBuf::from(moved_to);
            std::fs::rename(path, &moved_to).map_err(|source| Error::MoveAside {
                path: moved_to.clone(),
                source,
            })?;
            tracing::error!(
                path = %path.display(), moved_to = %moved_to.display(), %reason,
                "checkpoint is unreadable; moved aside, starting with no prepared claims \
                 (inspect the saved file; claims prepared before are not unprepared automatically)"
            );
            Ok((
                Checkpoint::empty(boot_id),
                LoadOutcome::MovedAside { moved_to, reason },
            ))
        }
    }
}

/// Writes `cp` to `path` atomically and durably, as the oldest version that holds it.
pub fn write_file(path: &Path, cp: &Checkpoint) -> Result<()> {
    let bytes = encode(cp)?;
    crate::durable::write(path, &bytes).map_err(Error::Save)
}

struct Shared {
    path: PathBuf,
    state: Mutex<Checkpoint>,
    /// The file as we last wrote or read it.
    last_id: Mutex<Option<FileId>>,
    writes: AtomicU64,
    /// What another path holds (`--mode both`), consulted under the `state` lock: lock order
    /// `state`, then whatever lock it takes; never across an `.await`.
    elsewhere: Arc<dyn HeldElsewhere>,
    /// Bumped on every change of the claims, for the device plugin.
    changes: watch::Sender<u64>,
}

type FlushReply = oneshot::Sender<Result<(), Arc<Error>>>;

/// The in-memory ledger; cheap to clone. See the module doc for the write protocol.
#[derive(Clone)]
pub struct Ledger {
    shared: Arc<Shared>,
    tx: mpsc::UnboundedSender<FlushReply>,
}

/// The single task that writes the checkpoint file.
pub struct Writer {
    shared: Arc<Shared>,
    rx: mpsc::UnboundedReceiver<FlushReply>,
}

impl Ledger {
    /// Loads (or starts) the checkpoint in `dir`, creating the directory. Every reservation
    /// ([`Ledger::update_with_holds`]) consults `elsewhere` (`--mode both`: what containers
    /// hold), or nothing.
    pub fn open(
        dir: &Path,
        boot_id: &str,
        elsewhere: Option<Arc<dyn HeldElsewhere>>,
    ) -> Result<(Ledger, Writer, LoadOutcome)> {
        std::fs::create_dir_all(dir).map_err(|source| Error::CreateDir {
            path: dir.to_path_buf(),
            source,
        })?;
        let path = dir.join(FILE_NAME);
        let (cp, outcome) = load_file(&path, boot_id)?;
        let shared = Arc::new(Shared {
            last_id: Mutex::new(file_id(&path)),
            path,
            state: Mutex::new(cp),
            writes: AtomicU64::new(0),
            elsewhere: elsewhere.unwrap_or_else(|| Arc::new(NothingElsewhere)),
            changes: watch::channel(0).0,
        });
        let (tx, rx) = mpsc::unbounded_channel();
        Ok((
            Ledger {
                shared: shared.clone(),
                tx,
            },
            Writer { shared, rx },
            outcome,
        ))
    }

    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// Reads the in-memory state. `f` runs under the ledger's lock, so a check of the claims
    /// and a change of what a [`HeldElsewhere`] reports, made together in `f`, are atomic with
    /// every reservation.
    pub fn read<R>(&self, f: impl FnOnce(&Checkpoint) -> R) -> R {
        f(&lock(&self.shared.state))
    }

    /// Changes the in-memory state; [`Ledger::flush`] makes it durable.
    pub fn update<R>(&self, f: impl FnOnce(&mut BTreeMap<ClaimUid, ClaimEntry>) -> R) -> R {
        let r = f(&mut lock(&self.shared.state).claims);
        self.changed();
        r
    }

    /// Changes the record of the GPUs whose MIG mode nvdra turned on
    /// ([`Checkpoint::mig_enabled`]); [`Ledger::flush`] makes it durable.
    pub fn update_mig_enabled<R>(&self, f: impl FnOnce(&mut BTreeSet<GpuUuid>) -> R) -> R {
        f(&mut lock(&self.shared.state).mig_enabled)
    }

    /// Undoes the reservation of `uid` whose first flush failed, before anything on the GPU
    /// changed: forgets the claim, and the GPUs it added to [`Checkpoint::mig_enabled`]
    /// (`recorded`) unless another claim records a MIG device on one (whose prepare may rely on
    /// the record to turn its mode on), in one critical section. So the record follows what the
    /// file would hold had the write not been tried, and a later flush never writes a GPU as
    /// turned on by nvdra when nothing turned it on.
    pub fn withdraw_reservation(&self, uid: &ClaimUid, recorded: &[GpuUuid]) {
        {
            let mut state = lock(&self.shared.state);
            state.claims.remove(uid);
            let Checkpoint {
                claims,
                mig_enabled,
                ..
            } = &mut *state;
            for gpu in recorded {
                let relied_on = claims
                    .values()
                    .any(|e| e.devices.iter().any(|d| d.gpu == *gpu && d.mig.is_some()));
                if !relied_on {
                    mig_enabled.remove(gpu);
                }
            }
        }
        self.changed();
    }

    /// Like [`Ledger::update`], with what another path holds ([`HeldElsewhere`]) consulted in
    /// the same critical section, so a claim's reservation and an Allocate cannot both take one
    /// device.
    pub fn update_with_holds<R>(
        &self,
        f: impl FnOnce(&mut BTreeMap<ClaimUid, ClaimEntry>, &dyn HeldElsewhere) -> R,
    ) -> R {
        let r = {
            let mut state = lock(&self.shared.state);
            f(&mut state.claims, &*self.shared.elsewhere)
        };
        self.changed();
        r
    }

    fn changed(&self) {
        self.shared.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Told after every change of the claims.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.shared.changes.subscribe()
    }

    /// Waits until every change made before this call is on disk.
    pub async fn flush(&self) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(tx).map_err(|_| Error::WriterGone)?;
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Error::Flush(e)),
            Err(_) => Err(Error::WriterGone),
        }
    }

    /// How many times the file was written (group commit makes this smaller than the number of
    /// flushes).
    pub fn writes(&self) -> u64 {
        self.shared.writes.load(Ordering::Relaxed)
    }

    /// Re-reads the file if another process (a second plugin instance during a rolling update)
    /// wrote it since we last did. Call only while no change of ours is unflushed.
    pub fn reload_if_changed(&self) -> Result<bool> {
        let now = file_id(&self.shared.path);
        if now == *lock(&self.shared.last_id) {
            return Ok(false);
        }
        let boot_id = lock(&self.shared.state).boot_id.clone();
        let (cp, outcome) = load_file(&self.shared.path, &boot_id)?;
        tracing::info!(
            ?outcome,
            "checkpoint changed on disk (another instance); reloaded"
        );
        *lock(&self.shared.state) = cp;
        *lock(&self.shared.last_id) = file_id(&self.shared.path);
        self.changed();
        Ok(true)
    }
}

impl Writer {
    /// Serves flush requests until shutdown; then writes once more for anything pending.
    pub async fn run(mut self, shutdown: CancellationToken) -> Result<()> {
        loop {
            let first = tokio::select! {
                biased;
                () = shutdown.cancelled() => {
                    let mut pending = Vec::new();
                    while let Ok(r) = self.rx.try_recv() {
                        pending.push(r);
                    }
                    self.write_batch(pending).await;
                    return Ok(());
                }
                r = self.rx.recv() => match r {
                    Some(r) => r,
                    None => return Ok(()),
                },
            };
            let mut batch = vec![first];
            while let Ok(r) = self.rx.try_recv() {
                batch.push(r);
            }
            self.write_batch(batch).await;
        }
    }

    async fn write_batch(&self, batch: Vec<FlushReply>) {
        if batch.is_empty() {
            return;
        }
        let shared = self.shared.clone();
        let result = tokio::task::spawn_blocking(move || {
            // Snapshot after every request in the batch was sent, so it covers their changes.
            let cp = lock(&shared.state).clone();
            write_file(&shared.path, &cp)?;
            *lock(&shared.last_id) = file_id(&shared.path);
            shared.writes.fetch_add(1, Ordering::Relaxed);
            Ok::<_, Error>(())
        })
        .await
        .unwrap_or_else(|e| Err(Error::WriterPanicked(e)))
        .map_err(|e| {
            tracing::error!(error = %crate::report::chain(&e), "checkpoint write failed");
            Arc::new(e)
        });
        for reply in batch {
            let _ = reply.send(result.clone());
        }
    }
}

#[cfg(test)]
mod tests;
