//! The allocation ledger: which claim holds which device, persisted as the DRA checkpoint.
//!
//! The file is `<plugin data dir>/checkpoint.json`, versioned JSON:
//! `{"version": 1, "bootId": …, "claims": {<uid>: {"state": "PrepareStarted"|"PrepareCompleted",
//! "namespace", "name", "devices": [...]}}}`.
//!
//! Invariants:
//! - Every write is atomic and durable: a temp file in the same directory, fsync, rename, fsync
//!   of the directory. A crash leaves either the old or the new file, never a mix.
//! - A prepare is two-phase: the claim is recorded `PrepareStarted` (with the devices it is about
//!   to touch) *before* any hardware or CDI change, and `PrepareCompleted` after. A `Started`
//!   entry found at start-up is rolled back by the plugin.
//! - A file written before a reboot (different boot id) is stale: its entries are dropped.
//! - A corrupt file or one of an unknown version is moved aside (`checkpoint.json.corrupt-<ts>`)
//!   with an error log, never silently overwritten.
//! - One writer: mutations go to the in-memory copy under a lock that is never held across an
//!   `.await`; [`Ledger::flush`] asks the single [`Writer`] task for a durable write, and the
//!   writer batches every flush request pending at that moment into one file write (group
//!   commit), so concurrent prepares share fsyncs.

use std::collections::BTreeMap;
use std::fmt;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::dra::slices::DeviceName;
use crate::inventory::{GpuUuid, MigUuid, Placement};
use crate::sharing::Sharing;

/// The checkpoint format this build reads and writes.
pub const VERSION: u32 = 1;
/// The checkpoint's file name in the plugin data directory.
pub const FILE_NAME: &str = "checkpoint.json";
/// Where the boot id comes from.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read the checkpoint {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot write the checkpoint {path}: {source}; check the plugin data directory is writable and not full"
    )]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot encode the checkpoint: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("cannot read the boot id from {path}: {source}")]
    BootId {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the checkpoint writer has stopped (shutting down); retry after the restart")]
    WriterGone,
    #[error("checkpoint write task failed: {0}")]
    Task(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A ResourceClaim UID. It prefixes the claim's CDI device names, so it follows their grammar;
/// [`ClaimUid::parse`] (where a request enters) and reading a checkpoint are the only ways to
/// make one, so code that holds one never checks it again.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ClaimUid(String);

impl ClaimUid {
    pub fn parse(uid: impl Into<String>) -> std::result::Result<Self, crate::cdi::Error> {
        let uid = uid.into();
        crate::cdi::validate_device_name(&uid)?;
        Ok(Self(uid))
    }
}

impl TryFrom<String> for ClaimUid {
    type Error = crate::cdi::Error;
    fn try_from(uid: String) -> std::result::Result<Self, crate::cdi::Error> {
        Self::parse(uid)
    }
}

impl From<ClaimUid> for String {
    fn from(uid: ClaimUid) -> String {
        uid.0
    }
}

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
    /// How the device is shared (enough to undo it and to rebuild the CDI spec).
    #[serde(default, skip_serializing_if = "is_exclusive")]
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

/// The checkpoint file's content.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Checkpoint {
    pub version: u32,
    pub boot_id: String,
    pub claims: BTreeMap<ClaimUid, ClaimEntry>,
}

impl Checkpoint {
    pub fn empty(boot_id: &str) -> Self {
        Self {
            version: VERSION,
            boot_id: boot_id.to_string(),
            claims: BTreeMap::new(),
        }
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

/// Reads the checkpoint file at `path`, applying the boot-id and corruption rules.
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
    let parsed = serde_json::from_slice::<serde_json::Value>(&bytes)
        .map_err(|e| format!("not JSON: {e}"))
        .and_then(|v| match v.get("version").and_then(|v| v.as_u64()) {
            Some(v) if v == u64::from(VERSION) => Ok(()),
            Some(v) => Err(format!(
                "version {v} is not the version {VERSION} this nvdra reads"
            )),
            None => Err("no version field".to_string()),
        })
        .and_then(|()| {
            serde_json::from_slice::<Checkpoint>(&bytes).map_err(|e| format!("invalid: {e}"))
        });
    match parsed {
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
        Err(reason) => {
            let ts = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default();
            let mut moved_to = path.as_os_str().to_owned();
            moved_to.push(format!(".corrupt-{ts}"));
            let moved_to = PathBuf::from(moved_to);
            std::fs::rename(path, &moved_to).map_err(|source| Error::Write {
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

/// Writes `cp` to `path` atomically and durably.
pub fn write_file(path: &Path, cp: &Checkpoint) -> Result<()> {
    let bytes = serde_json::to_vec_pretty(cp)?;
    let werr = |source| Error::Write {
        path: path.to_path_buf(),
        source,
    };
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = PathBuf::from(tmp_name);
    let mut f = std::fs::File::create(&tmp).map_err(werr)?;
    f.write_all(&bytes).map_err(werr)?;
    f.sync_all().map_err(werr)?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(werr)?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(werr)?;
    Ok(())
}

struct Shared {
    path: PathBuf,
    state: Mutex<Checkpoint>,
    /// The file as we last wrote or read it.
    last_id: Mutex<Option<FileId>>,
    writes: AtomicU64,
}

type FlushReply = oneshot::Sender<Result<(), String>>;

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

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Mutations are single assignments to a map; a panic elsewhere cannot leave it half-done.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Ledger {
    /// Loads (or starts) the checkpoint in `dir`, creating the directory.
    pub fn open(dir: &Path, boot_id: &str) -> Result<(Ledger, Writer, LoadOutcome)> {
        std::fs::create_dir_all(dir).map_err(|source| Error::Write {
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
            Ok(Err(e)) => Err(Error::Task(e)),
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
        .map_err(|e| Error::Task(e.to_string()))
        .and_then(|r| r)
        .map_err(|e| {
            tracing::error!(error = %e, "checkpoint write failed");
            e.to_string()
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
                    device: DeviceName::parse(d).unwrap(),
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
                "{\"version\": 7, \"bootId\": \"b\", \"claims\": {}}",
                "version 7",
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
            (0u32..64).prop_map(DeviceName::gpu),
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
                        uuid: uuid.map(MigUuid),
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
                "[a-f0-9]([a-f0-9-]{0,34}[a-f0-9])?",
                (any::<bool>(), "[a-z0-9-]{1,20}", proptest::collection::vec(arb_device(), 0..4)),
                0..6,
            ),
            boot in "[a-f0-9-]{1,36}",
        ) {
            let cp = Checkpoint {
                version: VERSION,
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
