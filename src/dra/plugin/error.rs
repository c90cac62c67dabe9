//! Why a claim could not be prepared or unprepared, and why a plugin could not start.

use crate::ids::{ClaimUid, InvalidClaimUid};
use crate::ledger;
use crate::{cdi, inventory, sharing};

use crate::dra::{compute_mode, mps};
use kubelet_plugin::nodelock;

/// Why one claim could not be prepared or unprepared. Reported in that claim's response entry.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// Refused as read (missing, unreadable, replaced, unallocated): the kubelet-plugin
    /// library's checks, which every claim passes before it is planned.
    #[error(transparent)]
    Claim(#[from] kubelet_plugin::claims::Error),
    #[error("device {device} of pool {pool} is not on this node (pool {ours}): {reason}")]
    UnknownDevice {
        pool: String,
        device: String,
        ours: String,
        reason: String,
    },
    #[error(
        "device {device} is already prepared for claim {namespace}/{name} ({uid}); it must be \
         unprepared first (was a pod force-deleted?)"
    )]
    DeviceInUse {
        device: String,
        namespace: String,
        name: String,
        uid: ClaimUid,
    },
    #[error(
        "device {device} ({held}) is held by {holder} through the device plugin \
         (nvidia.com/ resource limits); it is free again when that pod ends"
    )]
    HeldByContainer {
        device: String,
        held: String,
        holder: String,
    },
    #[error(
        "the scheduler placed this share on GPU {device}, which claim {namespace}/{name} ({uid}) \
         uses whole; the node refuses the share rather than run it beside a claim that owns \
         the GPU (the allocation was made against an older state): delete the pod so the \
         scheduler places it again, or wait until that claim ends"
    )]
    ShareOnWholeGpu {
        device: String,
        namespace: String,
        name: String,
        uid: ClaimUid,
    },
    #[error(
        "the scheduler placed a whole-GPU claim on {device}, which shares of {holders} hold; \
         the node refuses it rather than hand a GPU in use whole (the allocation was made \
         against an older state): delete the pod so the scheduler places it again, or wait \
         until those shares end"
    )]
    WholeGpuOnShares {
        device: String,
        /// `claim ns/name (uid)`, or `claims ns/a (uid), ns/b (uid)`.
        holders: String,
    },
    #[error(
        "the scheduler placed MIG device {device} on GPU {gpu}, which shares of {holders} hold; \
         the node refuses it rather than split a GPU in use into MIG devices (the allocation was \
         made against an older state): delete the pod so the scheduler places it again, or wait \
         until those shares end"
    )]
    MigOnShares {
        device: String,
        gpu: String,
        /// As [`ClaimError::WholeGpuOnShares`]'s.
        holders: String,
    },
    #[error(
        "the scheduler placed this share of {wanted} memory on GPU {gpu}, which has {total} in \
         all, and its other shares hold {held} ({holders}): more than the GPU has (the \
         allocation was made against an older state), so the node refuses it rather than \
         overcommit the GPU: delete the pod so the scheduler places it again, or wait for a \
         share to end"
    )]
    OverCapacity {
        gpu: String,
        /// Quantities (`24Gi`).
        wanted: String,
        total: String,
        held: String,
        holders: String,
    },
    #[error(
        "the scheduler placed this share on GPU {gpu}, which would then serve {shares} shares, \
         more than the {max} clients one MPS server serves per GPU (claims that ask for no \
         memory consume none in --consumable-shares=unlimited, so the scheduler does not bound \
         them); the node refuses it rather than start a client MPS would turn away: delete the \
         pod so the scheduler places it again, or wait for a share to end"
    )]
    TooManyShares {
        gpu: String,
        shares: usize,
        max: u64,
    },
    #[error(
        "resource claim {namespace}/{name} holds a GPU share ({device}) but is reserved for {} \
         pods ({pods}); a share's memory limit applies to each CUDA process, not to the claim, so \
         pods sharing one claim would together use more than the scheduler counted. Give each \
         pod its own claim (a ResourceClaimTemplate in the pod spec) instead of one \
         ResourceClaim named by several pods", pods.split(", ").count()
    )]
    ShareForManyPods {
        namespace: String,
        name: String,
        device: String,
        pods: String,
    },
    #[error(
        "resource claim {namespace}/{name} holds a share of {device}, whose GPU runs MPS for one \
         user at a time (before Volta, no multi-user mode), and the user its pod runs as cannot be \
         told: {reason}"
    )]
    ShareUserUnknown {
        namespace: String,
        name: String,
        device: String,
        reason: String,
    },
    #[error(
        "{device} cannot be prepared as a share for {user}: its GPU runs MPS for one user at a \
         time (before Volta, no multi-user mode), and its shares run as {holder_user} ({holders}). \
         A client of another user would wait until those shares end. Run the pods that share \
         this GPU as one user (runAsUser), or ask for the GPU whole"
    )]
    ShareOfAnotherUser {
        device: String,
        user: crate::ledger::ShareUser,
        holder_user: crate::ledger::ShareUser,
        holders: String,
    },
    #[error(
        "claim {claim} cannot have a share of {device}: claim {holder} holds a share of it, and this node keeps the shares of a GPU within one \
         trust domain (--share-trust-domain={rule}); the scheduler does not know the rule. \
         Delete the pod so that the scheduler places its claim again (on another GPU, if one \
         has room), or wait until the GPU's shares of that domain end; to keep tenants off each \
         other's GPUs ahead of time, give each its own nodes or GPUs (a DeviceClass selector)"
    )]
    ShareOfAnotherDomain {
        device: String,
        /// `ns/name of <its domain>`.
        claim: String,
        /// `ns/name (uid) of <its domain>`.
        holder: String,
        rule: String,
    },
    #[error(
        "claim {namespace}/{name} holds a share of {device}, and this node keeps the shares of \
         a GPU within one trust domain (--share-trust-domain={rule}), but the claim's domain \
         cannot be told: {reason}. The node's service account needs `get` on namespaces"
    )]
    ShareDomainUnknown {
        namespace: String,
        name: String,
        device: String,
        rule: String,
        reason: String,
    },
    #[error(
        "{device} cannot be prepared as a share: the MPS control daemon of {gpu} has not \
         answered since {since} ({ago} ago), so a share started now would get no limits. The MPS \
         host restarts the daemon; the kubelet retries this prepare (or retry it by recreating \
         the pod once the device's mps-daemon-down taint is gone)"
    )]
    ShareDaemonDown {
        device: String,
        gpu: String,
        since: String,
        ago: String,
    },
    #[error(
        "the scheduler placed a whole-GPU claim on {device}, whose MIG devices are held ({holders}); \
         the node refuses it rather than hand a GPU in use whole (the allocation was made \
         against an older state): delete the pod so the scheduler places it again, or wait \
         until those claims are unprepared, after which its MIG mode is turned off"
    )]
    WholeGpuOnMig {
        device: String,
        /// `<MIG device> by claim ns/name (uid)`, `; `-separated.
        holders: String,
    },
    #[error(
        "{device} cannot be handed out whole: its GPU is in MIG mode with MIG devices nvdra did \
         not create ({devices}), which it keeps; destroy them (nvidia-smi mig -dci, -dgi) for \
         the GPU to be handed out whole"
    )]
    MigDevicesLeft { device: String, devices: String },
    #[error(
        "cannot turn the MIG mode of GPU {gpu} {mode}: processes hold the GPU: {processes}. The \
         change was withdrawn, and until they are gone the node publishes the GPU's devices that \
         need a switch tainted NoExecute, so that the pod is evicted and a claim made from a \
         template is allocated elsewhere; meanwhile the kubelet retries this prepare, which \
         succeeds once they exit"
    )]
    MigModeInUse {
        gpu: String,
        mode: &'static str,
        processes: String,
    },
    #[error(
        "GPU {gpu} answered the switch of its MIG mode {pending} with RESET_REQUIRED: the driver \
         would apply it only at a GPU reset (as in some passthrough VMs), and nvdra never resets \
         a GPU. The change was withdrawn (the mode stays {current}), and nvdra no longer \
         switches this GPU's MIG mode until it restarts: the GPU's devices that need a switch are \
         published tainted NoExecute (mig-switch-blocked=reset-required), so that the pod is \
         evicted and a claim made from a template is allocated elsewhere; or delete the pod"
    )]
    MigResetRequired {
        gpu: String,
        current: &'static str,
        pending: &'static str,
    },
    #[error(
        "{device} needs GPU {gpu}'s MIG mode turned {mode}, and nvdra no longer switches that \
         GPU's MIG mode: the driver answered an earlier switch with RESET_REQUIRED (until nvdra \
         restarts, the GPU's devices that need a switch are published tainted NoExecute, \
         mig-switch-blocked=reset-required, so that the pod is evicted); or delete the pod so \
         the scheduler places it again"
    )]
    MigSwitchDisabled {
        device: String,
        gpu: String,
        mode: &'static str,
    },
    #[error(
        "GPU {gpu}: cannot {action}: nvdra's own MPS daemon or server is still there {waited:?} \
         after its release: {left}. The MPS host quits a released daemon (killing it after \
         10 s), then removes its directory; check the nvdra-mps-host DaemonSet and the daemon's \
         log under the MPS root. The kubelet retries"
    )]
    OwnMpsLeft {
        action: String,
        gpu: String,
        /// `daemon <id>, its directory not yet removed` or `pid <pid> (<name>)`, comma-separated.
        left: String,
        waited: std::time::Duration,
    },
    #[error(
        "{device} cannot be prepared with admin access: {why}; admin access does not create MIG \
         instances or switch MIG mode; ask for an existing device (a MIG device that exists, or \
         a GPU outside MIG mode)"
    )]
    AdminAccessNeedsChange { device: String, why: String },
    #[error("{device} of request {request} cannot be prepared as a share: {reason}")]
    BadShare {
        device: String,
        request: String,
        reason: String,
    },
    #[error("invalid device configuration of resource claim {claim}, request {request}")]
    Config {
        /// `namespace/name`.
        claim: String,
        request: String,
        source: sharing::Error,
    },
    #[error("claim UID {uid:?} cannot name a CDI device")]
    BadUid {
        uid: String,
        source: InvalidClaimUid,
    },
    #[error(transparent)]
    Backend(#[from] inventory::Error),
    #[error(transparent)]
    Mps(#[from] mps::Error),
    #[error(transparent)]
    ComputeMode(#[from] compute_mode::Error),
    #[error(transparent)]
    Cdi(#[from] cdi::Error),
    #[error(transparent)]
    Ledger(#[from] ledger::Error),
    #[error(transparent)]
    Lock(#[from] nodelock::Error),
    #[error("internal task failed")]
    Task(#[source] tokio::task::JoinError),
    /// The whole batch could not start (node lock, inventory); every claim of the batch carries
    /// the same cause, and the kubelet retries.
    #[error(transparent)]
    Unavailable(std::sync::Arc<ClaimError>),
}

/// Why a plugin could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Ledger(#[from] ledger::Error),
    #[error(transparent)]
    Cdi(#[from] cdi::Error),
}
