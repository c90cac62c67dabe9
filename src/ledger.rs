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
//! | 1 | since `9a33f72` | as above; a device's `sharing` is `{"strategy": "TimeSlicing"\|"MPS", …}` up to `24aada3`, then `{"strategy": "timeSlicing"\|"mps", …}` (this build reads both and writes the latter, which the builds since `24aada3` read; an exclusive device has no `sharing` in either) |
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

use std::collections::BTreeMap;
use std::fmt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::inventory::{GpuUuid, Placement};
use crate::lock::lock;
use crate::sharing::Sharing;

/// The newest checkpoint version this build reads.
pub const VERSION: u32 = 1;
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

/// A ResourceClaim UID.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ClaimUid(pub String);

impl fmt::Display for ClaimUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl ClaimUid {
    pub fn as_str(&self) -> &str {
        &self.0
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
    pub uuid: Option<GpuUuid>,
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
    pub device: String,
    pub cdi_ids: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_id: Option<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub admin_access: bool,
    /// The physical GPU (the parent of a MIG device).
    pub gpu: GpuUuid,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<MigRecord>,
    /// How the device is shared (enough to undo it and to rebuild the CDI spec).
    #[serde(
        default,
        skip_serializing_if = "is_exclusive",
        deserialize_with = "v1::sharing"
    )]
    pub sharing: Sharing,
}

/// One claim in the ledger.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimEntry {
    pub state: ClaimState,
    pub namespace: String,
    pub name: String,
    pub devices: Vec<DeviceRecord>,
}

/// The checkpoint's content. Its version is not part of it: that is a property of the file,
/// chosen when writing ([`version_for`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    pub boot_id: String,
    pub claims: BTreeMap<ClaimUid, ClaimEntry>,
}

impl Checkpoint {
    pub fn empty(boot_id: &str) -> Self {
        Self {
            boot_id: boot_id.to_string(),
            claims: BTreeMap::new(),
        }
    }
}

/// The oldest checkpoint version that holds `cp`, which is the version it is written as.
///
/// Every state fits version 1 today. A field that version 1 cannot hold raises this only for the
/// checkpoints that use it, so pods of older builds keep reading the rest.
pub fn version_for(_cp: &Checkpoint) -> u32 {
    OLDEST_VERSION
}

/// The file as written: the version, then the content.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct FileOut<'a> {
    version: u32,
    boot_id: &'a str,
    claims: &'a BTreeMap<ClaimUid, ClaimEntry>,
}

/// Version 1 as read.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct FileV1 {
    boot_id: String,
    claims: BTreeMap<ClaimUid, ClaimEntry>,
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
        1 => {
            let FileV1 { boot_id, claims } = serde_json::from_value(value)
                .map_err(|e| Undecodable::Corrupt(format!("invalid: {e}")))?;
            Ok(Checkpoint { boot_id, claims })
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
    /// Loads (or starts) the checkpoint in `dir`, creating the directory.
    pub fn open(dir: &Path, boot_id: &str) -> Result<(Ledger, Writer, LoadOutcome)> {
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

    /// Reads the in-memory state.
    pub fn read<R>(&self, f: impl FnOnce(&Checkpoint) -> R) -> R {
        f(&lock(&self.shared.state))
    }

    /// Changes the in-memory state; [`Ledger::flush`] makes it durable.
    pub fn update<R>(&self, f: impl FnOnce(&mut BTreeMap<ClaimUid, ClaimEntry>) -> R) -> R {
        f(&mut lock(&self.shared.state).claims)
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
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry(state: ClaimState, devices: &[&str]) -> ClaimEntry {
        ClaimEntry {
            state,
            namespace: "ns".into(),
            name: "c".into(),
            devices: devices
                .iter()
                .map(|d| DeviceRecord {
                    requests: vec!["gpu".into()],
                    pool: "node".into(),
                    device: d.to_string(),
                    cdi_ids: vec![format!("k8s.gpu.nvidia.com/claim=u-{d}")],
                    share_id: None,
                    admin_access: false,
                    gpu: GpuUuid("GPU-1".into()),
                    mig: None,
                    sharing: Sharing::Exclusive,
                })
                .collect(),
        }
    }

    fn open(dir: &Path, boot: &str) -> (Ledger, LoadOutcome, CancellationToken) {
        let (l, w, o) = Ledger::open(dir, boot).unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(w.run(stop.clone()));
        (l, o, stop)
    }

    #[tokio::test]
    async fn flushed_state_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let (l, o, _s) = open(dir.path(), "boot-1");
        assert_eq!(o, LoadOutcome::Fresh);
        l.update(|c| {
            c.insert(
                ClaimUid("a".into()),
                entry(ClaimState::PrepareCompleted, &["gpu-0"]),
            )
        });
        l.flush().await.unwrap();
        let (l2, o2, _s2) = open(dir.path(), "boot-1");
        assert_eq!(o2, LoadOutcome::Loaded { claims: 1 });
        assert_eq!(l.read(|c| c.clone()), l2.read(|c| c.clone()));
        // No temp files remain.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, vec![FILE_NAME.to_string()]);
    }

    #[tokio::test]
    async fn reboot_drops_entries() {
        let dir = tempfile::tempdir().unwrap();
        let (l, _, _s) = open(dir.path(), "boot-1");
        l.update(|c| {
            c.insert(
                ClaimUid("a".into()),
                entry(ClaimState::PrepareCompleted, &["gpu-0"]),
            )
        });
        l.flush().await.unwrap();
        let (l2, o2, _s2) = open(dir.path(), "boot-2");
        assert_eq!(o2, LoadOutcome::BootChanged { dropped: 1 });
        assert!(l2.read(|c| c.claims.is_empty()));
        assert_eq!(l2.read(|c| c.boot_id.clone()), "boot-2");
    }

    #[tokio::test]
    async fn corrupt_and_unknown_versions_are_moved_aside() {
        for (content, why) in [
            ("{\"version\": 1, \"bootId\": \"b\", \"cla", "not JSON"),
            (
                "{\"version\": 0, \"bootId\": \"b\", \"claims\": {}}",
                "version 0",
            ),
            (
                "{\"version\": 1, \"bootId\": \"b\", \"claims\": 3}",
                "invalid",
            ),
            ("[]", "no version"),
        ] {
            let dir = tempfile::tempdir().unwrap();
            std::fs::write(dir.path().join(FILE_NAME), content).unwrap();
            let (l, o, _s) = open(dir.path(), "b");
            let LoadOutcome::MovedAside { moved_to, reason } = o else {
                panic!("{content}: {o:?}")
            };
            assert!(reason.contains(why), "{reason}");
            assert_eq!(std::fs::read_to_string(&moved_to).unwrap(), content);
            assert!(
                moved_to
                    .file_name()
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .starts_with("checkpoint.json.corrupt-")
            );
            assert!(l.read(|c| c.claims.is_empty()));
            assert!(!dir.path().join(FILE_NAME).exists());
        }
    }

    /// Every checkpoint nvdra has written, as `(name, bytes)`: `tests/data/checkpoint-v*.json`.
    fn fixtures() -> [(&'static str, &'static str); 2] {
        [
            (
                "v1 as written up to 24aada3",
                include_str!("../tests/data/checkpoint-v1-9a33f72.json"),
            ),
            (
                "v1 as written since 24aada3",
                include_str!("../tests/data/checkpoint-v1.json"),
            ),
        ]
    }

    /// What every fixture holds.
    fn fixture_state() -> Checkpoint {
        use crate::sharing::{MpsSettings, TimeSliceInterval};
        let uid = |c: char| ClaimUid(format!("1d0e4b7a-0000-4000-8000-00000000000{c}"));
        let device = |c: char, request: &str, device: &str, gpu: &str| DeviceRecord {
            requests: vec![request.into()],
            pool: "node-a".into(),
            device: device.into(),
            cdi_ids: vec![format!("k8s.gpu.nvidia.com/claim={}-{device}", uid(c))],
            share_id: None,
            admin_access: false,
            gpu: GpuUuid(format!("GPU-{gpu}-1111-2222-3333-444455556666")),
            mig: None,
            sharing: Sharing::Exclusive,
        };
        let entry = |state, namespace: &str, name: &str, d: DeviceRecord| ClaimEntry {
            state,
            namespace: namespace.into(),
            name: name.into(),
            devices: vec![d],
        };
        let mig = DeviceRecord {
            admin_access: true,
            mig: Some(MigRecord {
                uuid: None,
                profile: "1g.10gb".into(),
                gi_profile_id: 19,
                placement: Placement { start: 3, size: 1 },
                created: true,
            }),
            ..device('b', "small", "gpu-1-mig-1g10gb-19-3", "7a1b2c3d")
        };
        let time_sliced = DeviceRecord {
            share_id: Some("ts-1".into()),
            sharing: Sharing::TimeSlicing {
                interval: TimeSliceInterval::Long,
            },
            ..device('c', "shared", "gpu-2", "9e8d7c6b")
        };
        let mps = DeviceRecord {
            mig: Some(MigRecord {
                uuid: Some(GpuUuid("MIG-5b4a3928-1111-2222-3333-444455556666".into())),
                profile: "3g.40gb".into(),
                gi_profile_id: 9,
                placement: Placement { start: 4, size: 4 },
                created: false,
            }),
            sharing: Sharing::Mps(MpsSettings {
                active_thread_percentage: Some(50),
                pinned_memory_limit: Some(1 << 30),
                per_device_pinned_memory_limit: BTreeMap::new(),
            }),
            ..device('d', "mps", "gpu-3", "0a0b0c0d")
        };
        use ClaimState::{PrepareCompleted, PrepareStarted};
        Checkpoint {
            boot_id: "6a3c1f0e-8d2b-4c57-9e61-0f4b2d7a9c13".into(),
            claims: BTreeMap::from([
                (
                    uid('a'),
                    entry(
                        PrepareCompleted,
                        "default",
                        "exclusive",
                        device('a', "gpu", "gpu-0", "2f6c0b3e"),
                    ),
                ),
                (uid('b'), entry(PrepareStarted, "ml", "mig", mig)),
                (
                    uid('c'),
                    entry(PrepareCompleted, "default", "time-sliced", time_sliced),
                ),
                (uid('d'), entry(PrepareCompleted, "default", "mps", mps)),
            ]),
        }
    }

    #[test]
    fn every_version_ever_written_reads_back() {
        let want = fixture_state();
        for (name, bytes) in fixtures() {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join(FILE_NAME);
            std::fs::write(&path, bytes).unwrap();
            let (cp, outcome) = load_file(&path, &want.boot_id).unwrap();
            assert_eq!(outcome, LoadOutcome::Loaded { claims: 4 }, "{name}");
            assert_eq!(cp, want, "{name}");
        }
    }

    /// The oldest version that holds the state is written, in the spelling the builds since
    /// `24aada3` read (the pods a rolling update replaces), whichever version was read.
    #[test]
    fn writes_the_oldest_version_the_previous_release_reads() {
        let current = include_str!("../tests/data/checkpoint-v1.json").trim_end();
        assert_eq!(version_for(&fixture_state()), 1);
        for (name, bytes) in fixtures() {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join(FILE_NAME);
            std::fs::write(&path, bytes).unwrap();
            let (cp, _) = load_file(&path, &fixture_state().boot_id).unwrap();
            write_file(&path, &cp).unwrap();
            assert_eq!(std::fs::read_to_string(&path).unwrap(), current, "{name}");
        }
        // An exclusive-only state reads the same in both spellings: pods of every build read it.
        let mut exclusive = fixture_state();
        exclusive
            .claims
            .retain(|_, e| e.devices.iter().all(|d| d.sharing == Sharing::Exclusive));
        let text = String::from_utf8(encode(&exclusive).unwrap()).unwrap();
        assert!(!text.contains("strategy"), "{text}");
    }

    #[tokio::test]
    async fn a_newer_version_is_refused_and_left_in_place() {
        let newer = "{\"version\": 2, \"bootId\": \"b\", \"claims\": {}, \"somethingNew\": 1}";
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        std::fs::write(&path, newer).unwrap();
        let Err(e) = Ledger::open(dir.path(), "b") else {
            panic!("a version 2 checkpoint was accepted");
        };
        assert!(matches!(e, Error::TooNew { found: 2, .. }), "{e:?}");
        let text = e.to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(
            text.contains("version 2") && text.contains("1..=1"),
            "{text}"
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), newer);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![FILE_NAME]);
    }

    /// A running instance that finds a newer pod's file refuses to go on from it, keeps its own
    /// state and leaves the file alone.
    #[tokio::test]
    async fn a_newer_version_written_by_another_pod_is_refused_on_reload() {
        let dir = tempfile::tempdir().unwrap();
        let (l, _, _s) = open(dir.path(), "b");
        l.update(|c| {
            c.insert(
                ClaimUid("a".into()),
                entry(ClaimState::PrepareCompleted, &["gpu-0"]),
            )
        });
        l.flush().await.unwrap();
        let newer = "{\"version\": 3, \"bootId\": \"b\", \"claims\": {}}";
        std::fs::write(l.path(), newer).unwrap();
        let e = l.reload_if_changed().unwrap_err();
        assert!(matches!(e, Error::TooNew { found: 3, .. }), "{e:?}");
        assert!(l.read(|c| c.claims.contains_key(&ClaimUid("a".into()))));
        assert_eq!(std::fs::read_to_string(l.path()).unwrap(), newer);
    }

    #[tokio::test]
    async fn a_failed_write_names_the_file_and_reaches_every_flush() {
        let dir = tempfile::tempdir().unwrap();
        let (l, _, _s) = open(dir.path(), "b");
        // The checkpoint's name is taken by a directory: the rename fails.
        std::fs::create_dir(l.path()).unwrap();
        std::fs::write(l.path().join("x"), "").unwrap();
        let (a, b) = tokio::join!(l.flush(), l.flush());
        for e in [a.unwrap_err(), b.unwrap_err()] {
            let Error::Flush(inner) = &e else {
                panic!("{e:?}")
            };
            assert!(matches!(**inner, Error::Save(_)), "{inner:?}");
            let text = crate::report::chain(&e).to_string();
            assert!(
                text.starts_with("cannot save the checkpoint")
                    && text.contains(&format!("cannot rename into place {}", l.path().display())),
                "{text}"
            );
        }
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![FILE_NAME], "no temp file is left");
    }

    /// A real full disk (a 64 KiB tmpfs; see `durable::testing`): the error names the file and
    /// says so, the last good checkpoint stays, and no temp file is left.
    #[tokio::test]
    async fn a_full_disk_reads_no_space_left_with_the_checkpoint_path() {
        let Some(fs) = crate::durable::testing::TinyTmpfs::mount() else {
            return;
        };
        let (l, _, _s) = open(fs.dir.path(), "b");
        l.update(|c| {
            c.insert(
                ClaimUid("first".into()),
                entry(ClaimState::PrepareCompleted, &["gpu-0"]),
            )
        });
        l.flush().await.unwrap();
        let good = std::fs::read(l.path()).unwrap();
        // About 300 bytes a claim: 1,000 claims do not fit in 64 KiB.
        l.update(|c| {
            for i in 0..1000 {
                c.insert(
                    ClaimUid(format!("c{i}")),
                    entry(ClaimState::PrepareStarted, &["gpu-1"]),
                );
            }
        });
        let e = l.flush().await.unwrap_err();
        let text = crate::report::chain(&e).to_string();
        assert!(
            text.contains(&format!(
                "cannot write {}: No space left on device",
                l.path().display()
            )),
            "{text}"
        );
        assert_eq!(std::fs::read(l.path()).unwrap(), good);
        let names: Vec<_> = std::fs::read_dir(fs.dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![FILE_NAME]);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn concurrent_flushes_share_writes() {
        let dir = tempfile::tempdir().unwrap();
        let (l, _, _s) = open(dir.path(), "b");
        let tasks: Vec<_> = (0..32)
            .map(|i| {
                let l = l.clone();
                tokio::spawn(async move {
                    l.update(|c| {
                        c.insert(
                            ClaimUid(format!("c{i}")),
                            entry(ClaimState::PrepareStarted, &["gpu-0"]),
                        )
                    });
                    l.flush().await
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
        assert!(l.writes() < 32, "{} writes for 32 flushes", l.writes());
        let (cp, _) = load_file(&dir.path().join(FILE_NAME), "b").unwrap();
        assert_eq!(cp.claims.len(), 32);
    }

    #[tokio::test]
    async fn flush_after_shutdown_fails_clearly_and_pending_work_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let (l, _, stop) = open(dir.path(), "b");
        l.update(|c| {
            c.insert(
                ClaimUid("a".into()),
                entry(ClaimState::PrepareStarted, &["gpu-0"]),
            )
        });
        stop.cancel();
        // The writer may take the request before or after it sees the cancellation; either way
        // the change is written or the caller is told.
        match l.flush().await {
            Ok(()) => {
                let (cp, _) = load_file(&dir.path().join(FILE_NAME), "b").unwrap();
                assert_eq!(cp.claims.len(), 1);
            }
            Err(e) => assert!(matches!(e, Error::WriterGone), "{e}"),
        }
        tokio::task::yield_now().await;
    }

    #[tokio::test]
    async fn reload_sees_another_writer() {
        let dir = tempfile::tempdir().unwrap();
        let (a, _, _s) = open(dir.path(), "b");
        let (b, _, _s2) = open(dir.path(), "b");
        assert!(!a.reload_if_changed().unwrap());
        b.update(|c| {
            c.insert(
                ClaimUid("x".into()),
                entry(ClaimState::PrepareCompleted, &["gpu-3"]),
            )
        });
        b.flush().await.unwrap();
        assert!(a.reload_if_changed().unwrap());
        assert!(a.read(|c| c.claims.contains_key(&ClaimUid("x".into()))));
        assert!(!a.reload_if_changed().unwrap());
    }

    fn arb_sharing() -> impl Strategy<Value = Sharing> {
        use crate::sharing::{MpsSettings, TimeSliceInterval};
        prop_oneof![
            Just(Sharing::Exclusive),
            prop_oneof![
                Just(TimeSliceInterval::Default),
                Just(TimeSliceInterval::Short),
                Just(TimeSliceInterval::Medium),
                Just(TimeSliceInterval::Long)
            ]
            .prop_map(|interval| Sharing::TimeSlicing { interval }),
            (
                proptest::option::of(0u32..=100),
                proptest::option::of(any::<u64>()),
                proptest::collection::btree_map("[0-9]|GPU-[a-f0-9]{4}", any::<u64>(), 0..3),
            )
                .prop_map(|(a, p, per)| Sharing::Mps(MpsSettings {
                    active_thread_percentage: a,
                    pinned_memory_limit: p,
                    per_device_pinned_memory_limit: per,
                })),
        ]
    }

    fn arb_device() -> impl Strategy<Value = DeviceRecord> {
        (
            proptest::collection::vec("[a-z]{1,8}", 0..3),
            "[a-z0-9-]{1,20}",
            proptest::option::of("[a-z0-9]{1,8}"),
            any::<bool>(),
            proptest::option::of((
                proptest::option::of("MIG-[a-f0-9]{8}"),
                0u32..20,
                0u32..8,
                1u32..8,
                any::<bool>(),
            )),
            arb_sharing(),
        )
            .prop_map(
                |(requests, device, share_id, admin, mig, sharing)| DeviceRecord {
                    requests,
                    pool: "node-a".into(),
                    cdi_ids: vec![format!("k8s.gpu.nvidia.com/claim=u-{device}")],
                    device,
                    share_id,
                    admin_access: admin,
                    gpu: GpuUuid("GPU-0000".into()),
                    mig: mig.map(|(uuid, gi, start, size, created)| MigRecord {
                        uuid: uuid.map(GpuUuid),
                        profile: "1g.10gb".into(),
                        gi_profile_id: gi,
                        placement: Placement { start, size },
                        created,
                    }),
                    sharing,
                },
            )
    }

    proptest! {
        // Each case fsyncs twice; 64 cases keep the suite quick.
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn checkpoint_round_trips(
            claims in proptest::collection::btree_map(
                "[a-f0-9-]{1,36}",
                (any::<bool>(), "[a-z0-9-]{1,20}", proptest::collection::vec(arb_device(), 0..4)),
                0..6,
            ),
            boot in "[a-f0-9-]{1,36}",
        ) {
            let cp = Checkpoint {
                boot_id: boot.clone(),
                claims: claims
                    .into_iter()
                    .map(|(uid, (done, name, devices))| {
                        (ClaimUid(uid), ClaimEntry {
                            state: if done { ClaimState::PrepareCompleted } else { ClaimState::PrepareStarted },
                            namespace: "default".into(),
                            name,
                            devices,
                        })
                    })
                    .collect(),
            };
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join(FILE_NAME);
            write_file(&path, &cp).unwrap();
            let (back, outcome) = load_file(&path, &boot).unwrap();
            prop_assert_eq!(outcome, LoadOutcome::Loaded { claims: cp.claims.len() });
            prop_assert_eq!(&back, &cp);
            // Byte-stable: writing what was read gives the same file.
            let first = std::fs::read(&path).unwrap();
            write_file(&path, &back).unwrap();
            prop_assert_eq!(first, std::fs::read(&path).unwrap());
        }
    }
}
