//! What a DRA driver implements, in the library's own terms (no protos).

use std::collections::BTreeMap;
use std::future::Future;

use k8s_openapi::api::resource::v1::{
    DeviceAttribute, DeviceRequestAllocationResult, NetworkDeviceData, ResourceClaim,
};

/// Any error: what a driver's claim or batch fails with. `anyhow::Error`, a `String` and every
/// `std::error::Error + Send + Sync` convert into it with `?` or `.into()`. Its
/// [`source`](std::error::Error::source) chain is what the kubelet shows, each cause once.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A claim the kubelet names: its namespace, name and UID, as sent.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Claim {
    /// The ResourceClaim's namespace.
    pub namespace: String,
    /// The ResourceClaim's name.
    pub name: String,
    /// The ResourceClaim's UID as the kubelet sent it, unchecked: the driver decides what a
    /// valid UID is for it (it may, say, become part of a CDI device name).
    pub uid: String,
}

impl Claim {
    /// A claim reference, as the kubelet sends one.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        uid: impl Into<String>,
    ) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            uid: uid.into(),
        }
    }
}

/// A claim to prepare, read from the API server and checked before the driver sees it: it is
/// the claim the kubelet named (same UID: not deleted and re-created meanwhile), it is
/// allocated, and [`results`](Self::results) holds the allocation's results for this driver.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct PrepareClaim {
    /// The kubelet's reference; `uid` equals the ResourceClaim's.
    pub claim: Claim,
    /// The ResourceClaim as read (its allocation's config included).
    pub resource_claim: ResourceClaim,
    /// `status.allocation.devices.results` whose `driver` is this driver, in allocation order.
    /// Request names are as allocated (`request/subrequest` for a subrequest); see
    /// [`base_request`](crate::claims::base_request) for the name the kubelet expects back.
    pub results: Vec<DeviceRequestAllocationResult>,
}

/// One device prepared for a claim: what the kubelet passes on to the container runtime.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct PreparedDevice {
    /// The claim's request names this device satisfies. A `request/subrequest` name is sent as
    /// its base name, as the kubelet expects.
    pub requests: Vec<String>,
    /// The device's pool.
    pub pool: String,
    /// The device's name in its pool.
    pub device: String,
    /// Fully qualified CDI device names (`vendor/class=name`).
    pub cdi_ids: Vec<String>,
    /// The allocation's share ID, for a device allocated more than once (consumable capacity).
    /// Sent on `v1` only: `v1beta1` has no such field.
    pub share_id: Option<String>,
    /// What the device's metadata file tells the container, when the plugin writes them
    /// ([`Options::device_metadata`](crate::Options::device_metadata)); without it the file
    /// names the device only.
    pub metadata: Option<DeviceMetadata>,
}

impl PreparedDevice {
    /// `device` of `pool`, for `requests`, with its CDI device names.
    pub fn new(
        requests: Vec<String>,
        pool: impl Into<String>,
        device: impl Into<String>,
        cdi_ids: Vec<String>,
    ) -> Self {
        Self {
            requests,
            pool: pool.into(),
            device: device.into(),
            cdi_ids,
            share_id: None,
            metadata: None,
        }
    }

    /// The same device, with the metadata its container reads (KEP-5304, see
    /// [`crate::metadata`]).
    pub fn with_metadata(mut self, metadata: DeviceMetadata) -> Self {
        self.metadata = Some(metadata);
        self
    }

    /// The same device, as the allocation's share `share_id`.
    pub fn with_share_id(mut self, share_id: impl Into<String>) -> Self {
        self.share_id = Some(share_id.into());
        self
    }
}

/// What a driver tells about one prepared device in its metadata file (KEP-5304, see
/// [`crate::metadata`]; Go's `kubeletplugin.DeviceMetadata`). Best
/// practice, as Go's documentation puts it: every attribute the device's ResourceSlice
/// publishes, plus what only the node knows.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct DeviceMetadata {
    /// Attributes in a ResourceSlice's format, by qualified name (`model`,
    /// `resource.kubernetes.io/pciBusID`); each value sets exactly one field.
    pub attributes: BTreeMap<String, DeviceAttribute>,
    /// A network device's data (interface, addresses).
    pub network_data: Option<NetworkDeviceData>,
}

impl DeviceMetadata {
    /// Metadata made of `attributes`.
    pub fn new(attributes: BTreeMap<String, DeviceAttribute>) -> Self {
        Self {
            attributes,
            network_data: None,
        }
    }

    /// The same, with a network device's data.
    pub fn with_network_data(mut self, data: NetworkDeviceData) -> Self {
        self.network_data = Some(data);
        self
    }
}

/// Prepare's outcome per claim UID (as the kubelet sent it).
pub type PrepareResults = Vec<(String, Result<Vec<PreparedDevice>, BoxError>)>;
/// Unprepare's outcome per claim UID (as the kubelet sent it).
pub type UnprepareResults = Vec<(String, Result<(), BoxError>)>;

/// A DRA driver's node side. The kubelet sends claims in batches; the driver answers each claim
/// of a batch on its own (one claim's failure is that claim's error), or fails the whole batch
/// (`Err`: every claim of it gets that error). A claim the driver leaves out of its answer is
/// answered with an error by the library, so the kubelet always gets an entry for every claim it
/// named.
///
/// Calls reach the driver one at a time unless the plugin opts out
/// ([`Options::serialize`](crate::Options::serialize)), and a call runs to its end
/// once started, even when the kubelet stops waiting for it: its effect is there for the next.
///
/// Both operations must be idempotent: the kubelet retries, and re-prepares claims after it
/// restarts. Unprepare of a claim the driver does not know must succeed.
///
/// The desired ResourceSlices are not pulled through this trait: the driver pushes them to a
/// [`PublisherHandle`](crate::publisher::PublisherHandle) whenever they change (Go's
/// `PublishResources`).
pub trait Driver: Send + Sync + 'static {
    /// Prepares the devices allocated to each claim.
    fn prepare(
        &self,
        claims: Vec<PrepareClaim>,
    ) -> impl Future<Output = Result<PrepareResults, BoxError>> + Send;

    /// Undoes prepare for each claim.
    fn unprepare(
        &self,
        claims: Vec<Claim>,
    ) -> impl Future<Output = Result<UnprepareResults, BoxError>> + Send;
}
