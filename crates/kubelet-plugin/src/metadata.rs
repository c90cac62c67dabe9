//! Device metadata (KEP-5304, beta in Kubernetes 1.37): a JSON file per claim, request and
//! driver that a container reads at a well-known path, written and removed for a driver that
//! turns it on ([`Options::device_metadata`](crate::Options::device_metadata)) and hands each
//! prepared device's attributes ([`PreparedDevice::with_metadata`](crate::PreparedDevice::with_metadata)).
//!
//! How a file reaches the container, as Go's `kubeletplugin` does it (the kubelet itself mounts
//! nothing): per request, the library writes
//!
//! - the metadata file on the host, `<plugin data dir>/dra-device-metadata/<claim UID>/<request>/metadata.json`;
//! - a CDI spec `<cdi dir>/<driver>_metadata_<claim UID>_<request>.json` (kind
//!   `<driver>/metadata`, device `<claim UID>_<request>`) whose only edit bind-mounts that file
//!   read-only at the container path;
//!
//! and adds the CDI device ID `<driver>/metadata=<claim UID>_<request>` to the first device of
//! the request in prepare's answer, so the runtime applies the mount. The container path is the
//! consumer-facing API ([`container_path`]):
//!
//! - a claim the pod names (`resourceClaimName`):
//!   `/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json`;
//! - a claim made from a template (the ResourceClaim carries the annotation
//!   [`POD_CLAIM_NAME_ANNOTATION`]):
//!   `/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/<pod claim name>/<request>/<driver>-metadata.json`.
//!
//! The file is a stream of the same [`v1alpha1::DeviceMetadata`] once per API version the
//! library writes, newest first (today only `metadata.resource.k8s.io/v1alpha1`), each followed
//! by a newline: a reader takes the first object whose `apiVersion` it knows. A request with a
//! subrequest (`gpu/large`) is filed under its request (`gpu`) and named in full inside.
//!
//! One difference from Go: the host file is keyed by the claim's UID, not its namespace and
//! name, so the unprepare of a deleted claim never removes the files of a new claim of the same
//! name. The CDI spec names are Go's, so a rolling update from Go's helper to this one removes
//! Go's specs at unprepare too.
//!
//! Files are replaced atomically (a temporary file in the same directory, fsync, rename, fsync
//! of the directory), readable by any user (mode 0644, as Go writes them), and removed after a
//! successful unprepare. What a crash leaves — files of claims unprepared while the plugin was
//! down — goes at start-up with [`Files::retain`], which the driver calls before serving with
//! the claims it still has prepared: the driver, not the library, knows which those are (its
//! checkpoint); the library keeps no record of its own.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use k8s_openapi::api::resource::v1::{DeviceAttribute, NetworkDeviceData, ResourceClaim};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

use crate::claims::base_request;
pub use crate::driver::DeviceMetadata;
use crate::driver::{Claim, PreparedDevice};

/// Where the files are mounted in a container.
pub const CONTAINER_DIR: &str = "/var/run/kubernetes.io/dra-device-attributes";
/// The subdirectory of [`CONTAINER_DIR`] for claims the pod names, by claim name.
pub const RESOURCE_CLAIMS_SUBDIR: &str = "resourceclaims";
/// The subdirectory of [`CONTAINER_DIR`] for claims made from a template, by the pod's name for
/// the claim (`pod.spec.resourceClaims[].name`).
pub const RESOURCE_CLAIM_TEMPLATES_SUBDIR: &str = "resourceclaimtemplates";
/// Appended to the driver name to make a file's name in the container.
pub const FILE_SUFFIX: &str = "-metadata.json";
/// The annotation the ResourceClaim controller puts on a claim it made from a template: the
/// pod's name for the claim.
pub const POD_CLAIM_NAME_ANNOTATION: &str = "resource.kubernetes.io/pod-claim-name";
/// The subdirectory of the plugin's data directory the host files are written under.
pub const HOST_SUBDIR: &str = "dra-device-metadata";
/// Where CDI specs are written unless [`Options::cdi_dir`](crate::Options::cdi_dir) says.
pub const DEFAULT_CDI_DIR: &str = "/var/run/cdi";
/// The CDI version of the specs written (mounts need no later one).
pub const CDI_VERSION: &str = "0.5.0";
/// Mode of the files written.
const FILE_MODE: u32 = 0o644;

/// The `metadata.resource.k8s.io/v1alpha1` file format, field for field Go's
/// `k8s.io/dynamic-resource-allocation/api/metadata/v1alpha1` (serialize to write it, deserialize
/// to read one object of a file).
pub mod v1alpha1 {
    use super::*;

    /// `apiVersion` of this version.
    pub const API_VERSION: &str = "metadata.resource.k8s.io/v1alpha1";
    /// `kind` of its one type.
    pub const KIND: &str = "DeviceMetadata";

    /// The devices of one request of a claim. `metadata` holds the claim's name, namespace and
    /// UID, and `generation` (1 when prepare writes it).
    #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    #[non_exhaustive]
    pub struct DeviceMetadata {
        /// [`KIND`].
        pub kind: String,
        /// [`API_VERSION`].
        pub api_version: String,
        /// The claim's name, namespace, UID and the file's generation.
        #[serde(default)]
        pub metadata: ObjectMeta,
        /// The pod's name for a claim made from a template; absent for a claim the pod names.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub pod_claim_name: Option<String>,
        /// The request this file is for (one per file).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub requests: Vec<DeviceMetadataRequest>,
    }

    /// One request and its devices.
    #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    #[non_exhaustive]
    pub struct DeviceMetadataRequest {
        /// The request's name as allocated (`request/subrequest` for a subrequest).
        pub name: String,
        /// Its devices of this driver.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pub devices: Vec<Device>,
    }

    /// One device.
    #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    #[non_exhaustive]
    pub struct Device {
        /// The driver.
        pub driver: String,
        /// The device's pool.
        pub pool: String,
        /// The device's name in its pool.
        pub name: String,
        /// The driver's attributes, as in a ResourceSlice.
        #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
        pub attributes: BTreeMap<String, DeviceAttribute>,
        /// A network device's data.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub network_data: Option<NetworkDeviceData>,
    }
}

/// The pod's name for a claim made from a template (the annotation
/// [`POD_CLAIM_NAME_ANNOTATION`]); `None` for a claim the pod names.
pub fn pod_claim_name(claim: &ResourceClaim) -> Option<&str> {
    claim
        .metadata
        .annotations
        .as_ref()?
        .get(POD_CLAIM_NAME_ANNOTATION)
        .map(String::as_str)
        .filter(|n| !n.is_empty())
}

/// Where a container reads `driver`'s file for `request` of a claim: under the pod's name for
/// the claim when it was made from a template (`pod_claim_name`), else under the claim's name.
pub fn container_path(
    driver: &str,
    claim_name: &str,
    pod_claim_name: Option<&str>,
    request: &str,
) -> PathBuf {
    let (subdir, name) = match pod_claim_name {
        Some(pod) => (RESOURCE_CLAIM_TEMPLATES_SUBDIR, pod),
        None => (RESOURCE_CLAIMS_SUBDIR, claim_name),
    };
    [
        CONTAINER_DIR,
        subdir,
        name,
        request,
        &format!("{driver}{FILE_SUFFIX}"),
    ]
    .iter()
    .collect()
}

/// A file that could not be written, read or removed, or a name that cannot be part of one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file system step failed.
    #[error("cannot {step} {path}")]
    Io {
        /// What was being done (`write`, `remove`, `list`).
        step: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A claim UID or request name that is not safe in a file name or CDI device name.
    #[error(
        "cannot write device metadata for {what} {value:?}: only letters, digits and '-' may \
         appear in a file and CDI device name"
    )]
    BadName {
        /// `claim UID` or `request`.
        what: &'static str,
        /// The value.
        value: String,
    },
}

fn io_err<'a>(step: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Error + 'a {
    move |source| Error::Io {
        step,
        path: path.to_path_buf(),
        source,
    }
}

/// A UID (`8-4-4-4-12` hex) or request name (a DNS label) is made of letters, digits and `-`;
/// anything else would make a path of another directory or an invalid CDI name.
fn check_name(what: &'static str, value: &str) -> Result<(), Error> {
    if value.is_empty()
        || !value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
    {
        return Err(Error::BadName {
            what,
            value: value.to_string(),
        });
    }
    Ok(())
}

/// The CDI spec of one request's file: just the mount.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CdiSpec {
    cdi_version: String,
    kind: String,
    devices: Vec<CdiDevice>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CdiDevice {
    name: String,
    container_edits: CdiEdits,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CdiEdits {
    #[serde(default)]
    mounts: Vec<CdiMount>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CdiMount {
    host_path: PathBuf,
    container_path: PathBuf,
    #[serde(default)]
    options: Vec<String>,
}

/// One driver's metadata files on this node: where they go and how they are named. Built by
/// [`Options::metadata_files`](crate::Options::metadata_files) from the plugin's options.
#[derive(Clone, Debug)]
pub struct Files {
    driver: String,
    host_dir: PathBuf,
    cdi_dir: PathBuf,
}

impl Files {
    /// The files of `driver`: host files under `<plugin_data_dir>/`[`HOST_SUBDIR`], CDI specs in
    /// `cdi_dir`.
    pub fn new(
        driver: impl Into<String>,
        plugin_data_dir: &Path,
        cdi_dir: impl Into<PathBuf>,
    ) -> Self {
        Self {
            driver: driver.into(),
            host_dir: plugin_data_dir.join(HOST_SUBDIR),
            cdi_dir: cdi_dir.into(),
        }
    }

    /// The directory of the host files.
    pub fn host_dir(&self) -> &Path {
        &self.host_dir
    }

    /// The directory of the CDI specs.
    pub fn cdi_dir(&self) -> &Path {
        &self.cdi_dir
    }

    /// The host file of `request` of claim `claim_uid`.
    pub fn host_path(&self, claim_uid: &str, request: &str) -> PathBuf {
        self.host_dir
            .join(claim_uid)
            .join(request)
            .join("metadata.json")
    }

    /// The CDI spec that mounts it.
    pub fn cdi_spec_path(&self, claim_uid: &str, request: &str) -> PathBuf {
        self.cdi_dir
            .join(format!("{}{claim_uid}_{request}.json", self.spec_prefix()))
    }

    /// The CDI device ID prepare adds for it.
    pub fn cdi_device_id(&self, claim_uid: &str, request: &str) -> String {
        format!("{}/metadata={claim_uid}_{request}", self.driver)
    }

    fn spec_prefix(&self) -> String {
        format!("{}_metadata_", self.driver)
    }

    /// Writes the files of every request of a prepared claim and adds each request's CDI
    /// device ID to the first of `devices` that serves it. `pod_claim_name` picks the container
    /// path ([`container_path`]). Nothing is written for a claim without devices.
    pub fn write(
        &self,
        claim: &Claim,
        pod_claim_name: Option<&str>,
        devices: &mut [PreparedDevice],
    ) -> Result<(), Error> {
        check_name("claim UID", &claim.uid)?;
        // Per base request: the name as allocated (the first device's) and its devices.
        let mut requests: BTreeMap<String, (String, Vec<v1alpha1::Device>)> = BTreeMap::new();
        for d in devices.iter() {
            for r in &d.requests {
                let base = base_request(r);
                check_name("request", base)?;
                let meta = d.metadata.clone().unwrap_or_default();
                requests
                    .entry(base.to_string())
                    .or_insert_with(|| (r.clone(), Vec::new()))
                    .1
                    .push(v1alpha1::Device {
                        driver: self.driver.clone(),
                        pool: d.pool.clone(),
                        name: d.device.clone(),
                        attributes: meta.attributes,
                        network_data: meta.network_data,
                    });
            }
        }
        for (base, (name, devs)) in &requests {
            let doc = v1alpha1::DeviceMetadata {
                kind: v1alpha1::KIND.into(),
                api_version: v1alpha1::API_VERSION.into(),
                metadata: ObjectMeta {
                    name: Some(claim.name.clone()),
                    namespace: Some(claim.namespace.clone()),
                    uid: Some(claim.uid.clone()),
                    generation: Some(1),
                    ..Default::default()
                },
                pod_claim_name: pod_claim_name.map(String::from),
                requests: vec![v1alpha1::DeviceMetadataRequest {
                    name: name.clone(),
                    devices: devs.clone(),
                }],
            };
            let host = self.host_path(&claim.uid, base);
            // One object per version written, newest first, each on its own line(s).
            let mut bytes = serde_json::to_vec_pretty(&doc).map_err(|e| Error::Io {
                step: "encode",
                path: host.clone(),
                source: e.into(),
            })?;
            bytes.push(b'\n');
            replace(&host, &bytes)?;
            let spec = CdiSpec {
                cdi_version: CDI_VERSION.into(),
                kind: format!("{}/metadata", self.driver),
                devices: vec![CdiDevice {
                    name: format!("{}_{base}", claim.uid),
                    container_edits: CdiEdits {
                        mounts: vec![CdiMount {
                            container_path: container_path(
                                &self.driver,
                                &claim.name,
                                pod_claim_name,
                                base,
                            ),
                            host_path: host,
                            options: vec!["ro".into(), "bind".into()],
                        }],
                    },
                }],
            };
            let path = self.cdi_spec_path(&claim.uid, base);
            let mut bytes = serde_json::to_vec_pretty(&spec).map_err(|e| Error::Io {
                step: "encode",
                path: path.clone(),
                source: e.into(),
            })?;
            bytes.push(b'\n');
            replace(&path, &bytes)?;
        }
        for base in requests.keys() {
            let first = devices
                .iter_mut()
                .find(|d| d.requests.iter().any(|r| base_request(r) == base));
            if let Some(d) = first {
                d.cdi_ids.push(self.cdi_device_id(&claim.uid, base));
            }
        }
        Ok(())
    }

    /// Removes the files of claim `claim_uid`: its CDI specs first (so no container is started
    /// with a mount of a missing file), then its host files. Nothing there is no error.
    pub fn remove(&self, claim_uid: &str) -> Result<(), Error> {
        if check_name("claim UID", claim_uid).is_err() {
            // No file was ever written under such a name.
            return Ok(());
        }
        let prefix = format!("{}{claim_uid}_", self.spec_prefix());
        for name in self.spec_names()? {
            if name.starts_with(&prefix) {
                remove_file(&self.cdi_dir.join(name))?;
            }
        }
        remove_dir(&self.host_dir.join(claim_uid))
    }

    /// Start-up repair: removes the files of every claim `keep` does not keep (given a claim
    /// UID), and host files no remaining spec mounts (a crash between the writes or removals of
    /// one claim, or a layout of an older version). Call it before serving, with the claims the
    /// driver still has prepared; while another instance of the driver may be serving (a
    /// rolling update), under the node lock. Returns the UIDs whose files were removed.
    pub fn retain(&self, keep: impl Fn(&str) -> bool) -> Result<Vec<String>, Error> {
        let prefix = self.spec_prefix();
        let mut removed = BTreeSet::new();
        let mut mounted: Vec<PathBuf> = Vec::new();
        for name in self.spec_names()? {
            let path = self.cdi_dir.join(&name);
            let Some(rest) = name.strip_prefix(&prefix) else {
                // A temporary file a crash left (`.<spec name>.<random>.tmp`).
                if name.starts_with(&format!(".{prefix}")) && name.ends_with(".tmp") {
                    remove_file(&path)?;
                }
                continue;
            };
            // `<uid>_<request>.json`: neither holds a '_'.
            let uid = rest.split('_').next().unwrap_or_default();
            if keep(uid) {
                match std::fs::read(&path) {
                    Ok(bytes) => {
                        if let Ok(spec) = serde_json::from_slice::<CdiSpec>(&bytes) {
                            mounted.extend(spec.devices.into_iter().flat_map(|d| {
                                d.container_edits.mounts.into_iter().map(|m| m.host_path)
                            }));
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io_err("read", &path)(e)),
                }
                continue;
            }
            remove_file(&path)?;
            removed.insert(uid.to_string());
        }
        let entries = match std::fs::read_dir(&self.host_dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Ok(removed.into_iter().collect());
            }
            Err(e) => return Err(io_err("list", &self.host_dir)(e)),
        };
        for entry in entries {
            let entry = entry.map_err(io_err("list", &self.host_dir))?;
            let dir = entry.path();
            if !mounted.iter().any(|m| m.starts_with(&dir)) {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    remove_dir(&dir)?;
                } else {
                    remove_file(&dir)?;
                }
                removed.insert(entry.file_name().to_string_lossy().into_owned());
            }
        }
        Ok(removed.into_iter().collect())
    }

    /// The names of the files of this driver's specs (and their temporary files) in the CDI
    /// directory; none when it does not exist.
    fn spec_names(&self) -> Result<Vec<String>, Error> {
        let entries = match std::fs::read_dir(&self.cdi_dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_err("list", &self.cdi_dir)(e)),
        };
        let prefix = self.spec_prefix();
        let mut names = Vec::new();
        for entry in entries {
            let entry = entry.map_err(io_err("list", &self.cdi_dir))?;
            if let Some(name) = entry.file_name().to_str()
                && name.trim_start_matches('.').starts_with(&prefix)
            {
                names.push(name.to_string());
            }
        }
        Ok(names)
    }
}

/// Replaces `path` with `bytes` so that a reader (or a crash) sees the old or the new content,
/// never a mix, and the new content survives a power loss: a temporary file beside it, fsync,
/// rename, fsync of the directory. Creates the directory.
fn replace(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let err = |step| io_err(step, path);
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io_err("create", dir))?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    // Hidden and not ending in `.json`: CDI registries skip it.
    let mut tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(err("write"))?;
    tmp.write_all(bytes).map_err(err("write"))?;
    // tempfile creates 0600; a container of any user reads the file.
    tmp.as_file()
        .set_permissions(std::fs::Permissions::from_mode(FILE_MODE))
        .map_err(err("write"))?;
    tmp.as_file().sync_all().map_err(err("sync"))?;
    tmp.persist(path).map_err(|e| err("replace")(e.error))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("sync the directory of", path))
}

fn remove_file(path: &Path) -> Result<(), Error> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("remove", path)(e)),
        _ => Ok(()),
    }
}

fn remove_dir(path: &Path) -> Result<(), Error> {
    match std::fs::remove_dir_all(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err("remove", path)(e)),
        _ => Ok(()),
    }
}

/// After the driver's prepare: writes the files of each claim it prepared (found in `claims`
/// with the pod's name for it) and adds their CDI device IDs. A claim whose files cannot be
/// written gets that error instead of its devices: its container could not start with a
/// mount of a missing file, and the kubelet retries the prepare.
pub(crate) async fn after_prepare(
    files: std::sync::Arc<Files>,
    claims: Vec<(Claim, Option<String>)>,
    results: crate::PrepareResults,
) -> Result<crate::PrepareResults, crate::BoxError> {
    let written = tokio::task::spawn_blocking(move || {
        results
            .into_iter()
            .map(|(uid, r)| {
                let Ok(mut devices) = r else {
                    return (uid, r);
                };
                let Some((claim, pod)) = claims.iter().find(|(c, _)| c.uid == uid) else {
                    return (uid, Ok(devices));
                };
                let r = files.write(claim, pod.as_deref(), &mut devices);
                (uid, r.map(|()| devices).map_err(crate::BoxError::from))
            })
            .collect()
    });
    // Only a panic of the writes fails here: the whole batch, with it.
    written
        .await
        .map_err(|e| format!("writing device metadata failed: {e}").into())
}

/// After the driver's unprepare: removes the files of each claim it unprepared. A claim whose
/// files cannot be removed gets that error: the kubelet retries the unprepare.
pub(crate) async fn after_unprepare(
    files: std::sync::Arc<Files>,
    results: crate::UnprepareResults,
) -> Result<crate::UnprepareResults, crate::BoxError> {
    let removed = tokio::task::spawn_blocking(move || {
        results
            .into_iter()
            .map(|(uid, r)| {
                let r = r.and_then(|()| files.remove(&uid).map_err(crate::BoxError::from));
                (uid, r)
            })
            .collect()
    });
    removed
        .await
        .map_err(|e| format!("removing device metadata failed: {e}").into())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DRIVER: &str = "gpu.example.com";
    const UID: &str = "0f2d5a3c-1234-4bcd-9876-0123456789ab";

    fn files(dir: &Path) -> Files {
        Files::new(DRIVER, &dir.join("plugin"), dir.join("cdi"))
    }

    fn attrs() -> BTreeMap<String, DeviceAttribute> {
        BTreeMap::from([
            (
                "uuid".to_string(),
                DeviceAttribute {
                    string: Some("GPU-1".into()),
                    ..Default::default()
                },
            ),
            (
                "resource.kubernetes.io/numaNode".to_string(),
                DeviceAttribute {
                    int: Some(1),
                    ..Default::default()
                },
            ),
        ])
    }

    /// `gpu-0` for request `gpu/large` (with metadata) and `gpu-1` and `nic-0` for `gpu` and
    /// `nic`.
    fn devices() -> Vec<PreparedDevice> {
        vec![
            PreparedDevice::new(
                vec!["gpu/large".into()],
                "node-a",
                "gpu-0",
                vec!["cdi/a=0".into()],
            )
            .with_metadata(DeviceMetadata::new(attrs())),
            PreparedDevice::new(
                vec!["gpu/large".into()],
                "node-a",
                "gpu-1",
                vec!["cdi/a=1".into()],
            ),
            PreparedDevice::new(vec!["nic".into()], "node-a", "nic-0", vec![]),
        ]
    }

    fn claim() -> Claim {
        Claim::new("ns", "my-claim", UID)
    }

    fn read(path: &Path) -> String {
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// The file's text, literally: Go's field names and nesting (`api/metadata/v1alpha1`), one
    /// object per version (only v1alpha1), newline-terminated.
    #[test]
    fn a_request_file_is_the_v1alpha1_object_go_reads() {
        let dir = tempfile::tempdir().unwrap();
        let f = files(dir.path());
        f.write(&claim(), None, &mut devices()).unwrap();
        let text = read(&f.host_path(UID, "gpu"));
        let expected = r#"{
  "kind": "DeviceMetadata",
  "apiVersion": "metadata.resource.k8s.io/v1alpha1",
  "metadata": {
    "generation": 1,
    "name": "my-claim",
    "namespace": "ns",
    "uid": "0f2d5a3c-1234-4bcd-9876-0123456789ab"
  },
  "requests": [
    {
      "name": "gpu/large",
      "devices": [
        {
          "driver": "gpu.example.com",
          "pool": "node-a",
          "name": "gpu-0",
          "attributes": {
            "resource.kubernetes.io/numaNode": {
              "int": 1
            },
            "uuid": {
              "string": "GPU-1"
            }
          }
        },
        {
          "driver": "gpu.example.com",
          "pool": "node-a",
          "name": "gpu-1"
        }
      ]
    }
  ]
}
"#;
        assert_eq!(text, expected);
        let back: v1alpha1::DeviceMetadata = serde_json::from_str(&text).unwrap();
        assert_eq!(back.requests[0].devices[0].attributes, attrs());
    }

    #[test]
    fn a_named_claim_is_mounted_under_its_name_and_a_template_claim_under_the_pods_name() {
        let dir = tempfile::tempdir().unwrap();
        let f = files(dir.path());
        let mut named = devices();
        f.write(&claim(), None, &mut named).unwrap();
        let spec: serde_json::Value =
            serde_json::from_str(&read(&f.cdi_spec_path(UID, "gpu"))).unwrap();
        assert_eq!(
            spec,
            serde_json::json!({
                "cdiVersion": "0.5.0",
                "kind": "gpu.example.com/metadata",
                "devices": [{
                    "name": format!("{UID}_gpu"),
                    "containerEdits": {"mounts": [{
                        "hostPath": f.host_path(UID, "gpu"),
                        "containerPath": "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/my-claim/gpu/gpu.example.com-metadata.json",
                        "options": ["ro", "bind"],
                    }]},
                }],
            })
        );
        // Each request's ID on its first device only, after the driver's own.
        let ids: Vec<Vec<String>> = named.iter().map(|d| d.cdi_ids.clone()).collect();
        assert_eq!(
            ids,
            vec![
                vec![
                    "cdi/a=0".to_string(),
                    format!("gpu.example.com/metadata={UID}_gpu")
                ],
                vec!["cdi/a=1".to_string()],
                vec![format!("gpu.example.com/metadata={UID}_nic")],
            ]
        );

        let uid2 = "1f2d5a3c-1234-4bcd-9876-0123456789ab";
        let template = Claim::new("ns", "pod-gpu-x7k2q", uid2);
        f.write(&template, Some("gpu"), &mut devices()).unwrap();
        let spec: CdiSpec = serde_json::from_str(&read(&f.cdi_spec_path(uid2, "nic"))).unwrap();
        assert_eq!(
            spec.devices[0].container_edits.mounts[0].container_path,
            Path::new(
                "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/nic/gpu.example.com-metadata.json"
            )
        );
        let doc: v1alpha1::DeviceMetadata =
            serde_json::from_str(&read(&f.host_path(uid2, "nic"))).unwrap();
        assert_eq!(doc.pod_claim_name.as_deref(), Some("gpu"));
        assert_eq!(doc.metadata.name.as_deref(), Some("pod-gpu-x7k2q"));
    }

    #[test]
    fn the_pod_claim_name_comes_from_the_controllers_annotation() {
        let mut rc = ResourceClaim::default();
        assert_eq!(pod_claim_name(&rc), None);
        rc.metadata.annotations = Some(BTreeMap::from([(
            POD_CLAIM_NAME_ANNOTATION.to_string(),
            "gpu".to_string(),
        )]));
        assert_eq!(pod_claim_name(&rc), Some("gpu"));
    }

    #[test]
    fn files_are_readable_by_any_user_and_no_temporary_file_stays() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let f = files(dir.path());
        // Twice: the second replaces the first.
        f.write(&claim(), None, &mut devices()).unwrap();
        f.write(&claim(), None, &mut devices()).unwrap();
        for path in [f.host_path(UID, "gpu"), f.cdi_spec_path(UID, "gpu")] {
            let mode = std::fs::metadata(&path).unwrap().mode() & 0o777;
            assert_eq!(mode, 0o644, "{}", path.display());
            let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
        }
    }

    #[test]
    fn a_name_that_could_leave_the_directory_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = files(dir.path());
        let e = f
            .write(&Claim::new("ns", "c", "../x"), None, &mut devices())
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "cannot write device metadata for claim UID \"../x\": only letters, digits and '-' may \
             appear in a file and CDI device name"
        );
        let mut bad = vec![PreparedDevice::new(vec!["a_b".into()], "p", "d", vec![])];
        assert!(matches!(
            f.write(&claim(), None, &mut bad),
            Err(Error::BadName {
                what: "request",
                ..
            })
        ));
        assert!(!f.host_dir().exists());
        // Nothing was written under such a name: its removal has nothing to do.
        f.remove("../x").unwrap();
    }

    #[test]
    fn remove_takes_one_claims_files_and_leaves_the_others() {
        let dir = tempfile::tempdir().unwrap();
        let f = files(dir.path());
        let other = "2f2d5a3c-1234-4bcd-9876-0123456789ab";
        f.write(&claim(), None, &mut devices()).unwrap();
        f.write(&Claim::new("ns", "other", other), None, &mut devices())
            .unwrap();
        f.remove(UID).unwrap();
        assert!(!f.cdi_spec_path(UID, "gpu").exists());
        assert!(!f.cdi_spec_path(UID, "nic").exists());
        assert!(!f.host_dir().join(UID).exists());
        assert!(f.cdi_spec_path(other, "gpu").exists());
        assert!(f.host_path(other, "nic").exists());
        // Again: nothing left is no error.
        f.remove(UID).unwrap();
    }

    #[test]
    fn start_up_repair_keeps_the_prepared_and_removes_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let f = files(dir.path());
        let stale = "3f2d5a3c-1234-4bcd-9876-0123456789ab";
        f.write(&claim(), None, &mut devices()).unwrap();
        f.write(&Claim::new("ns", "gone", stale), None, &mut devices())
            .unwrap();
        // What crashes leave: a host directory no spec mounts (Go's layout here), a temporary
        // spec; and another driver's spec, which is not ours to touch.
        let orphan = f.host_dir().join("ns_old-claim/gpu");
        std::fs::create_dir_all(&orphan).unwrap();
        std::fs::write(orphan.join("metadata.json"), "{}").unwrap();
        let tmp = f
            .cdi_dir()
            .join(format!(".{DRIVER}_metadata_{stale}_gpu.json.x1.tmp"));
        std::fs::write(&tmp, "{").unwrap();
        let foreign = f
            .cdi_dir()
            .join(format!("other.io_metadata_{stale}_gpu.json"));
        std::fs::write(&foreign, "{}").unwrap();

        let removed = f.retain(|uid| uid == UID).unwrap();
        assert_eq!(removed, vec![stale.to_string(), "ns_old-claim".to_string()]);
        assert!(f.host_path(UID, "gpu").exists() && f.cdi_spec_path(UID, "nic").exists());
        assert!(!f.cdi_spec_path(stale, "gpu").exists());
        assert!(!f.host_dir().join(stale).exists());
        assert!(!f.host_dir().join("ns_old-claim").exists());
        assert!(!tmp.exists());
        assert!(foreign.exists());
        // Nothing more to do the second time; no directories at all is no error either.
        assert_eq!(f.retain(|uid| uid == UID).unwrap(), Vec::<String>::new());
        let empty = files(&dir.path().join("none"));
        assert_eq!(empty.retain(|_| false).unwrap(), Vec::<String>::new());
    }
}
