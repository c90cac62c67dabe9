//! [`ClusterApi`] over a directory of YAML files: the API for runs without a cluster.
//!
//! Layout: `DIR/resourceslices/<name>.yaml` (written here), `DIR/resourceclaims/<ns>/<name>.yaml`
//! (read), `DIR/nodes/<name>.yaml` (optional, read), `DIR/deviceclasses/<name>.yaml` (optional,
//! read; polled like the slices, for `--mode auto`'s `spec.extendedResourceName`). With
//! `--node-labels`, the node's labels are written into `DIR/nodes/<name>.yaml` (created if absent).
//!
//! Invariants:
//! - A slice file is replaced atomically (temp file in the same directory, fsync, rename, fsync
//!   the directory, through [`crate::durable`]), so a reader or a crash never sees half a file.
//! - Each write stores a new, increasing `metadata.resourceVersion` in the file; `replace_slice`
//!   fails with `Conflict` unless the caller's resourceVersion equals the stored one. The check and
//!   the write are atomic within this process (one lock); across processes they are not.
//! - The watch polls the directory every [`POLL_INTERVAL`] and reports any change of a slice
//!   file (written here or by anyone else, including hand edits that keep the resourceVersion).
//! - Files that are not valid YAML for their kind are errors naming the file.
//! - All file-system work runs on the blocking pool, never on the async runtime.

use futures::future::BoxFuture;
use futures::stream::{BoxStream, StreamExt};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceClaim, ResourceSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Preconditions, Time};
use rand::Rng;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{ClaimReader, ClaimSource, ClusterApi, Error, Failure, Result, SliceApi, SliceEvent};
use crate::lock::lock;

/// How often the watch looks at the directory.
pub const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// The characters the API server uses for generateName suffixes (no vowels, no look-alikes).
const NAME_ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
/// Longest generateName prefix the API server keeps (63 − 5 random characters).
const MAX_GENERATE_PREFIX: usize = 58;

/// The directory-backed API. Cheap to clone.
#[derive(Clone)]
pub struct DirApi {
    inner: Arc<Inner>,
}

struct Inner {
    root: PathBuf,
    /// Serialises read-check-write sequences on slice files within this process.
    write_lock: Mutex<()>,
    /// The last resourceVersion handed out (a nanosecond clock, forced to increase).
    last_rv: AtomicU64,
}

/// Where the directory API at `root` keeps the ResourceClaim `namespace/name`.
pub fn claim_path(root: &Path, namespace: &str, name: &str) -> PathBuf {
    root.join("resourceclaims")
        .join(namespace)
        .join(format!("{name}.yaml"))
}

/// Why [`write_claim`] failed.
#[derive(Debug, thiserror::Error)]
pub enum WriteClaimError {
    #[error("a ResourceClaim needs metadata.namespace and metadata.name to be written")]
    Unnamed,
    #[error("cannot create the claims directory {path}")]
    Dir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Yaml(#[from] crate::yaml::WriteError),
    #[error(transparent)]
    Write(#[from] crate::durable::Error),
}

/// Writes `claim` where the directory API at `root` reads it (atomically, so a daemon watching
/// the directory never reads half a file). For `nvdra demo`, tests and benchmarks, which play
/// the API server's part.
pub fn write_claim(
    root: &Path,
    claim: &ResourceClaim,
) -> std::result::Result<PathBuf, WriteClaimError> {
    let (Some(namespace), Some(name)) = (&claim.metadata.namespace, &claim.metadata.name) else {
        return Err(WriteClaimError::Unnamed);
    };
    let path = claim_path(root, namespace, name);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| WriteClaimError::Dir {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    crate::durable::write(&path, crate::yaml::to_string(claim)?.as_bytes())?;
    Ok(path)
}

impl DirApi {
    /// Uses `root`, creating `root/resourceslices/` if needed.
    pub fn new(root: impl Into<PathBuf>) -> Result<Self> {
        let root = root.into();
        let slices = root.join("resourceslices");
        std::fs::create_dir_all(&slices).map_err(|e| {
            Error::Setup(Failure::caused(
                format!(
                    "cannot create {} (check --api-dir and its permissions)",
                    slices.display()
                ),
                e,
            ))
        })?;
        Ok(Self {
            inner: Arc::new(Inner {
                root,
                write_lock: Mutex::new(()),
                last_rv: AtomicU64::new(0),
            }),
        })
    }

    /// The directory's root.
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// Where slice files live.
    pub fn slices_dir(&self) -> PathBuf {
        self.inner.root.join("resourceslices")
    }

    /// Runs blocking file work on the blocking pool.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .map_err(|e| Error::Transient(Failure::caused("directory API task failed", e)))?
    }
}

impl Inner {
    fn slices_dir(&self) -> PathBuf {
        self.root.join("resourceslices")
    }

    fn slice_path(&self, name: &str) -> PathBuf {
        self.slices_dir().join(format!("{name}.yaml"))
    }

    fn next_rv(&self) -> String {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        let mut prev = self.last_rv.load(Ordering::Relaxed);
        loop {
            let next = now.max(prev + 1);
            match self
                .last_rv
                .compare_exchange(prev, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return next.to_string(),
                Err(actual) => prev = actual,
            }
        }
    }

    fn list_slices(&self, driver: &str, node: &str) -> Result<Vec<ResourceSlice>> {
        let mut out = Vec::new();
        for (_, path) in slice_files(&self.slices_dir())? {
            // A file deleted between listing and reading is simply gone.
            let Some(slice) = read_yaml_opt::<ResourceSlice>(&path)? else {
                continue;
            };
            if slice.spec.driver == driver && slice.spec.node_name.as_deref().unwrap_or("") == node
            {
                out.push(slice);
            }
        }
        Ok(out)
    }

    fn create_slice(&self, slice: &ResourceSlice) -> Result<ResourceSlice> {
        let _guard = lock(&self.write_lock);
        let mut stored = slice.clone();
        let name = match (&slice.metadata.name, &slice.metadata.generate_name) {
            (Some(name), _) => {
                check_slice_name(name)?;
                if self.slice_path(name).exists() {
                    return Err(Error::Conflict(
                        format!(
                            "resourceslice {name} already exists ({})",
                            self.slice_path(name).display()
                        )
                        .into(),
                    ));
                }
                name.clone()
            }
            (None, Some(prefix)) => self.generate_name(prefix)?,
            (None, None) => {
                return Err(Error::Invalid(
                    "create resourceslice: neither metadata.name nor metadata.generateName is set"
                        .into(),
                ));
            }
        };
        stored.metadata.name = Some(name.clone());
        stored.metadata.resource_version = Some(self.next_rv());
        stored.metadata.uid = Some(random_uid());
        stored.metadata.creation_timestamp = Some(now_seconds());
        stored.metadata.generation = Some(1);
        write_atomic(&self.slice_path(&name), &to_yaml(&stored)?)?;
        Ok(stored)
    }

    fn generate_name(&self, prefix: &str) -> Result<String> {
        let base: String = prefix.chars().take(MAX_GENERATE_PREFIX).collect();
        let mut rng = rand::rng();
        for _ in 0..16 {
            let suffix: String = (0..5)
                .map(|_| char::from(NAME_ALPHABET[rng.random_range(0..NAME_ALPHABET.len())]))
                .collect();
            let name = format!("{base}{suffix}");
            check_slice_name(&name)?;
            if !self.slice_path(&name).exists() {
                return Ok(name);
            }
        }
        Err(Error::Conflict(
            format!("no free name with generateName {prefix:?} after 16 tries").into(),
        ))
    }

    fn replace_slice(&self, slice: &ResourceSlice) -> Result<ResourceSlice> {
        let _guard = lock(&self.write_lock);
        let name = slice.metadata.name.as_deref().ok_or_else(|| {
            Error::Invalid("replace resourceslice: the slice has no metadata.name".into())
        })?;
        check_slice_name(name)?;
        let path = self.slice_path(name);
        let current = read_yaml_opt::<ResourceSlice>(&path)?.ok_or_else(|| {
            Error::NotFound(format!("resourceslice {name} ({})", path.display()).into())
        })?;
        let have = current.metadata.resource_version.as_deref().unwrap_or("");
        let want = slice.metadata.resource_version.as_deref().unwrap_or("");
        if have != want {
            return Err(Error::Conflict(
                format!(
                    "resourceslice {name} has resourceVersion {have:?}, the update was based on \
                 {want:?}; re-read and retry"
                )
                .into(),
            ));
        }
        let mut stored = slice.clone();
        stored.metadata.uid = current.metadata.uid.clone();
        stored.metadata.creation_timestamp = current.metadata.creation_timestamp.clone();
        stored.metadata.resource_version = Some(self.next_rv());
        let spec_changed =
            serde_json::to_value(&current.spec).ok() != serde_json::to_value(&stored.spec).ok();
        let generation = current.metadata.generation.unwrap_or(1);
        stored.metadata.generation = Some(generation + i64::from(spec_changed));
        write_atomic(&path, &to_yaml(&stored)?)?;
        Ok(stored)
    }

    fn delete_slice(&self, name: &str, pre: &Preconditions) -> Result<()> {
        let _guard = lock(&self.write_lock);
        check_slice_name(name)?;
        let path = self.slice_path(name);
        if pre.uid.is_some() || pre.resource_version.is_some() {
            // A slice gone already is NotFound below; one changed since is left in place.
            if let Some(have) = read_yaml_opt::<ResourceSlice>(&path)? {
                let held = |want: &Option<String>, have: &Option<String>| {
                    want.as_ref().is_none_or(|w| Some(w) == have.as_ref())
                };
                if !held(&pre.uid, &have.metadata.uid)
                    || !held(&pre.resource_version, &have.metadata.resource_version)
                {
                    return Err(Error::Conflict(
                        format!(
                            "delete resourceslice {name}: it changed since it was read (uid \
                             {:?}, resourceVersion {:?}); re-read and retry",
                            have.metadata.uid, have.metadata.resource_version
                        )
                        .into(),
                    ));
                }
            }
        }
        match std::fs::remove_file(&path) {
            Ok(()) => fsync_dir(&self.slices_dir()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::NotFound(
                format!("resourceslice {name} ({})", path.display()).into(),
            )),
            Err(e) => Err(io_error("remove", &path, e)),
        }
    }

    fn get<T: DeserializeOwned>(&self, what: &str, path: PathBuf) -> Result<T> {
        read_yaml_opt(&path)?.ok_or_else(|| {
            Error::NotFound(format!("{what} ({} does not exist)", path.display()).into())
        })
    }
}

/// Slice names become file names: insist on a DNS subdomain so no name escapes the directory.
fn check_slice_name(name: &str) -> Result<()> {
    if crate::dns::is_subdomain(name, 253) {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "resourceslice name {name:?} is not a DNS subdomain (lower-case letters, digits, '-', '.')"
        ).into()))
    }
}

/// Now, at the one-second precision a `metav1.Time` keeps on the wire.
fn now_seconds() -> Time {
    use k8s_openapi::jiff::Timestamp;
    let now = Timestamp::now();
    Time(Timestamp::from_second(now.as_second()).unwrap_or(now))
}

fn random_uid() -> String {
    let b: [u8; 16] = rand::random();
    format!(
        "{:02x}{:02x}{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}-{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
        b[0],
        b[1],
        b[2],
        b[3],
        b[4],
        b[5],
        b[6],
        b[7],
        b[8],
        b[9],
        b[10],
        b[11],
        b[12],
        b[13],
        b[14],
        b[15]
    )
}

fn io_error(op: &str, path: &Path, e: std::io::Error) -> Error {
    Error::Transient(Failure::caused(
        format!("cannot {op} {}", path.display()),
        e,
    ))
}

fn to_yaml(slice: &ResourceSlice) -> Result<String> {
    crate::yaml::to_string(slice)
        .map_err(|e| Error::Invalid(Failure::caused("cannot encode resourceslice as YAML", e)))
}

/// Reads and parses a YAML file; `None` if it does not exist.
fn read_yaml_opt<T: DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error("read", path, e)),
    };
    crate::yaml::from_str(&text).map(Some).map_err(|e| {
        let what = format!(
            "{}: not a valid {} at {} (fix or remove the file)",
            path.display(),
            std::any::type_name::<T>()
                .rsplit("::")
                .next()
                .unwrap_or("object"),
            e.path,
        );
        Error::Invalid(Failure::caused(what, e))
    })
}

/// `(name, path)` of each `*.yaml` in `dir`, skipping hidden (temporary) files.
fn slice_files(dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let entries = std::fs::read_dir(dir).map_err(|e| io_error("list", dir, e))?;
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| io_error("list", dir, e))?;
        let file_name = entry.file_name();
        let Some(file_name) = file_name.to_str() else {
            continue;
        };
        if file_name.starts_with('.') {
            continue;
        }
        if let Some(name) = file_name.strip_suffix(".yaml") {
            out.push((name.to_string(), entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Replaces `path` durably ([`crate::durable`]).
fn write_atomic(path: &Path, contents: &str) -> Result<()> {
    crate::durable::write(path, contents.as_bytes())
        .map_err(|e| Error::Transient(Failure::caused("write to the directory API failed", e)))
}

fn fsync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_error("fsync directory", dir, e))
}

/// What the watch remembers of one slice file to notice changes.
#[derive(Clone, Debug, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
    /// Whether the file belongs to the watched driver and node (unparseable files count as ours,
    /// so the caller's next list surfaces the error).
    ours: bool,
}

fn inode(meta: &std::fs::Metadata) -> u64 {
    #[cfg(unix)]
    {
        std::os::unix::fs::MetadataExt::ino(meta)
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        0
    }
}

/// One scan of the slice directory; reuses `prev`'s ownership verdict for unchanged files.
fn scan(
    dir: &Path,
    driver: &str,
    node: &str,
    prev: &BTreeMap<String, FileStamp>,
) -> Result<BTreeMap<String, FileStamp>> {
    let mut out = BTreeMap::new();
    for (name, path) in slice_files(dir)? {
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        let mut stamp = FileStamp {
            modified: meta.modified().ok(),
            len: meta.len(),
            inode: inode(&meta),
            ours: true,
        };
        stamp.ours = match prev.get(&name) {
            Some(old)
                if FileStamp {
                    ours: old.ours,
                    ..stamp.clone()
                } == *old =>
            {
                old.ours
            }
            _ => match read_yaml_opt::<ResourceSlice>(&path) {
                Ok(Some(s)) => {
                    s.spec.driver == driver && s.spec.node_name.as_deref().unwrap_or("") == node
                }
                Ok(None) => continue,
                Err(_) => true,
            },
        };
        out.insert(name, stamp);
    }
    Ok(out)
}

/// Events that turn `prev` into `next` (only for files of the watched driver and node).
fn diff(prev: &BTreeMap<String, FileStamp>, next: &BTreeMap<String, FileStamp>) -> Vec<SliceEvent> {
    let mut events = Vec::new();
    for (name, stamp) in next {
        if prev.get(name) != Some(stamp) && (stamp.ours || prev.get(name).is_some_and(|p| p.ours)) {
            events.push(SliceEvent::Applied(name.clone()));
        }
    }
    for (name, stamp) in prev {
        if stamp.ours && !next.contains_key(name) {
            events.push(SliceEvent::Deleted(name.clone()));
        }
    }
    events
}

struct WatchState {
    api: DirApi,
    driver: String,
    node: String,
    known: Option<BTreeMap<String, FileStamp>>,
    pending: std::collections::VecDeque<SliceEvent>,
}

impl ClaimSource for DirApi {
    fn get_claim<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<ResourceClaim>> {
        let (namespace, name) = (namespace.to_string(), name.to_string());
        Box::pin(self.blocking(move |i| {
            let path = claim_path(&i.root, &namespace, &name);
            i.get(&format!("resourceclaim {namespace}/{name}"), path)
        }))
    }
}

/// The directory holds no pods: a share of a GPU before Volta is refused, saying so.
impl ClaimReader for DirApi {}

impl SliceApi for DirApi {
    fn list_slices<'a>(
        &'a self,
        driver: &'a str,
        node: &'a str,
    ) -> BoxFuture<'a, Result<Vec<ResourceSlice>>> {
        let (driver, node) = (driver.to_string(), node.to_string());
        Box::pin(self.blocking(move |i| i.list_slices(&driver, &node)))
    }

    fn create_slice<'a>(
        &'a self,
        slice: &'a ResourceSlice,
    ) -> BoxFuture<'a, Result<ResourceSlice>> {
        let slice = slice.clone();
        Box::pin(self.blocking(move |i| i.create_slice(&slice)))
    }

    fn replace_slice<'a>(
        &'a self,
        slice: &'a ResourceSlice,
    ) -> BoxFuture<'a, Result<ResourceSlice>> {
        let slice = slice.clone();
        Box::pin(self.blocking(move |i| i.replace_slice(&slice)))
    }

    fn delete_slice<'a>(
        &'a self,
        name: &'a str,
        preconditions: &'a Preconditions,
    ) -> BoxFuture<'a, Result<()>> {
        let (name, pre) = (name.to_string(), preconditions.clone());
        Box::pin(self.blocking(move |i| i.delete_slice(&name, &pre)))
    }

    fn watch_slices<'a>(
        &'a self,
        driver: &'a str,
        node: &'a str,
    ) -> BoxStream<'a, Result<SliceEvent>> {
        let state = WatchState {
            api: self.clone(),
            driver: driver.to_string(),
            node: node.to_string(),
            known: None,
            pending: Default::default(),
        };
        futures::stream::unfold(state, |mut st| async move {
            loop {
                if let Some(ev) = st.pending.pop_front() {
                    return Some((Ok(ev), st));
                }
                let first = st.known.is_none();
                if !first {
                    tokio::time::sleep(POLL_INTERVAL).await;
                }
                let prev = st.known.clone().unwrap_or_default();
                let (driver, node) = (st.driver.clone(), st.node.clone());
                let scanned = st
                    .api
                    .blocking(move |i| scan(&i.slices_dir(), &driver, &node, &prev))
                    .await;
                match scanned {
                    Ok(next) => {
                        if first {
                            st.pending.push_back(SliceEvent::Restarted);
                        } else {
                            let prev = st.known.as_ref().map(|k| diff(k, &next));
                            st.pending.extend(prev.unwrap_or_default());
                        }
                        st.known = Some(next);
                    }
                    Err(e) => return Some((Err(e), st)),
                }
            }
        })
        .boxed()
    }

    fn get_node<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Node>> {
        let name = name.to_string();
        Box::pin(self.blocking(move |i| {
            let path = i.root.join("nodes").join(format!("{name}.yaml"));
            i.get(&format!("node {name}"), path)
        }))
    }
}

impl ClusterApi for DirApi {
    fn patch_node_labels<'a>(
        &'a self,
        name: &'a str,
        labels: &'a BTreeMap<String, Option<String>>,
    ) -> BoxFuture<'a, Result<()>> {
        let (name, labels) = (name.to_string(), labels.clone());
        Box::pin(self.blocking(move |i| {
            let _guard = lock(&i.write_lock);
            let dir = i.root.join("nodes");
            std::fs::create_dir_all(&dir).map_err(|e| io_error("create", &dir, e))?;
            let path = dir.join(format!("{name}.yaml"));
            let mut node = read_yaml_opt::<Node>(&path)?.unwrap_or_else(|| Node {
                metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                    name: Some(name.clone()),
                    ..Default::default()
                },
                ..Default::default()
            });
            let have = node.metadata.labels.get_or_insert_with(Default::default);
            for (k, v) in labels {
                match v {
                    Some(v) => have.insert(k, v),
                    None => have.remove(&k),
                };
            }
            let text = crate::yaml::to_string(&node).map_err(|e| {
                Error::Invalid(Failure::caused(format!("cannot encode node {name}"), e))
            })?;
            write_atomic(&path, &text)
        }))
    }

    fn watch_device_classes(&self) -> BoxStream<'_, Result<Vec<DeviceClass>>> {
        // (last list sent, first poll done)
        futures::stream::unfold(
            (None::<Vec<DeviceClass>>, self.clone()),
            |(last, api)| async move {
                loop {
                    if last.is_some() {
                        tokio::time::sleep(POLL_INTERVAL).await;
                    }
                    let listed = api.blocking(|i| i.device_classes()).await;
                    match listed {
                        Ok(now) if last.as_ref() == Some(&now) => continue,
                        Ok(now) => return Some((Ok(now.clone()), (Some(now), api))),
                        Err(e) => return Some((Err(e), (last, api))),
                    }
                }
            },
        )
        .boxed()
    }
}

impl Inner {
    /// `DIR/deviceclasses/*.yaml`, by file name; no directory is no classes.
    fn device_classes(&self) -> Result<Vec<DeviceClass>> {
        let dir = self.root.join("deviceclasses");
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => {
                return Err(Error::Transient(Failure::caused(
                    format!("cannot read {}", dir.display()),
                    e,
                )));
            }
        };
        let mut paths: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
            .collect();
        paths.sort();
        let mut out = Vec::new();
        for p in paths {
            if let Some(c) = read_yaml_opt::<DeviceClass>(&p)? {
                out.push(c);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
