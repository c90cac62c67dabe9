//! What a DRA driver implements, in the library's own terms (no protos).

use std::future::Future;

/// A claim the kubelet asks to prepare or unprepare: its namespace, name and UID, as sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    pub namespace: String,
    pub name: String,
    /// The ResourceClaim's UID as the kubelet sent it, unchecked: the driver decides what a
    /// valid UID is for it (it may, say, become part of a CDI device name).
    pub uid: String,
}

/// One device prepared for a claim: what the kubelet passes on to the container runtime.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PreparedDevice {
    /// The claim's request names this device satisfies (base names, without `/subrequest`).
    pub requests: Vec<String>,
    pub pool: String,
    pub device: String,
    /// Fully qualified CDI device names (`vendor/class=name`).
    pub cdi_ids: Vec<String>,
    /// The allocation's share ID, for a device allocated more than once (consumable capacity).
    /// Sent on `v1` only: `v1beta1` has no such field.
    pub share_id: Option<String>,
}

/// Prepare's outcome per claim UID (as the kubelet sent it).
pub type PrepareResults<E> = Vec<(String, Result<Vec<PreparedDevice>, E>)>;
/// Unprepare's outcome per claim UID (as the kubelet sent it).
pub type UnprepareResults<E> = Vec<(String, Result<(), E>)>;

/// A DRA driver's node side. The kubelet sends claims in batches; the driver answers each claim
/// of a batch on its own (one claim's failure is that claim's error). A claim the driver leaves
/// out of its answer is answered with an error by the library, so the kubelet always gets an
/// entry for every claim it named.
///
/// Both operations must be idempotent: the kubelet retries, and re-prepares claims after it
/// restarts. Unprepare of a claim the driver does not know must succeed.
///
/// The desired ResourceSlices are not pulled through this trait: the driver pushes them to a
/// [`crate::publisher::PublisherHandle`] whenever they change (Go's `PublishResources`).
pub trait Driver: Send + Sync + 'static {
    /// A claim's failure; its [`std::error::Error::source`] chain is sent to the kubelet.
    type Error: std::error::Error + Send + Sync + 'static;

    /// Prepares the devices allocated to each claim.
    fn prepare(
        &self,
        claims: Vec<Claim>,
    ) -> impl Future<Output = PrepareResults<Self::Error>> + Send;

    /// Undoes prepare for each claim.
    fn unprepare(
        &self,
        claims: Vec<Claim>,
    ) -> impl Future<Output = UnprepareResults<Self::Error>> + Send;
}
