//! Leader election on a `coordination.k8s.io/v1` Lease, as client-go's `leaderelection` does it:
//! every write is an update with the resourceVersion last read, so of two candidates at most
//! one wins (the other gets 409 Conflict); a holder is taken over only after its record has not
//! changed for the lease's duration, measured on the candidate's own clock (no clock of another
//! machine is trusted); the leader renews every retry period and gives up, ending the process,
//! when it has not renewed for the renew deadline, before anyone may take over.
//!
//! Why not a crate: kube-lease-manager (the one that fits kube 5) takes the lease with a
//! server-side apply and relies on field-ownership conflicts to keep two candidates from both
//! winning, and clears an expired holder with a patch that has no precondition; a
//! resourceVersion precondition is the API server's own compare-and-swap, which every server
//! honours, with nothing more to it than this file.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Api;
use kube::api::PostParams;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The timings, NVIDIA's defaults (15 s, 10 s, 2 s).
#[derive(Clone, Copy, Debug)]
pub struct Timings {
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

/// Why leadership ended.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "lost the lease {lease}: not renewed for {deadline:?} (the API server did not answer, or \
         another candidate holds it); exiting so that one leader acts"
    )]
    Lost { lease: String, deadline: Duration },
}

/// A candidate for one Lease.
pub struct Elector {
    api: Api<Lease>,
    name: String,
    identity: String,
    timings: Timings,
    /// The holder record last seen and when this candidate first saw it.
    observed: Option<(Record, Instant)>,
}

/// What identifies a holder's term: a renewal changes it.
#[derive(Clone, Debug, PartialEq)]
struct Record {
    holder: String,
    renew: Option<MicroTime>,
    resource_version: Option<String>,
}

impl Elector {
    pub fn new(api: Api<Lease>, name: &str, identity: &str, timings: Timings) -> Self {
        Self {
            api,
            name: name.into(),
            identity: identity.into(),
            timings,
            observed: None,
        }
    }

    /// This candidate's identity.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Waits until this candidate holds the lease; `false` when `shutdown` came first.
    pub async fn acquire(&mut self, shutdown: &CancellationToken) -> bool {
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => return true,
                Ok(false) => {}
                Err(e) => tracing::debug!(lease = %self.name, error = %e, "lease not taken"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return false,
                _ = tokio::time::sleep(self.timings.retry_period) => {}
            }
        }
    }

    /// Renews the lease until `shutdown` (then releases it, so a successor need not wait out
    /// the duration) or until renewing fails for the renew deadline.
    pub async fn hold(&mut self, shutdown: &CancellationToken) -> Result<(), Error> {
        let mut renewed = Instant::now();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => {
                    self.release().await;
                    return Ok(());
                }
                _ = tokio::time::sleep(self.timings.retry_period) => {}
            }
            match self.try_acquire_or_renew().await {
                Ok(true) => renewed = Instant::now(),
                Ok(false) => {}
                Err(e) => tracing::warn!(lease = %self.name, error = %e, "lease not renewed"),
            }
            if renewed.elapsed() >= self.timings.renew_deadline {
                return Err(Error::Lost {
                    lease: self.name.clone(),
                    deadline: self.timings.renew_deadline,
                });
            }
        }
    }

    /// One attempt: `true` when this candidate holds the lease after it.
    async fn try_acquire_or_renew(&mut self) -> Result<bool, kube::Error> {
        let now = Timestamp::now();
        let seconds = i32::try_from(self.timings.lease_duration.as_secs()).unwrap_or(i32::MAX);
        let Some(mut lease) = self.api.get_opt(&self.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(seconds),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(_) => {
                    tracing::info!(lease = %self.name, identity = %self.identity, "became leader");
                    Ok(true)
                }
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().unwrap_or_default();
        let record = Record {
            holder: holder.clone(),
            renew: spec.renew_time.clone(),
            resource_version: lease.metadata.resource_version.clone(),
        };
        let seen_at = match &self.observed {
            Some((r, at)) if *r == record => *at,
            _ => Instant::now(),
        };
        self.observed = Some((record, seen_at));
        let held_for = Duration::from_secs(
            u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0),
        );
        let ours = holder == self.identity;
        if !ours && !holder.is_empty() && seen_at.elapsed() < held_for {
            return Ok(false);
        }
        let mut next = spec;
        if !ours {
            next.acquire_time = Some(MicroTime(now));
            next.lease_transitions = Some(next.lease_transitions.unwrap_or(0) + 1);
        }
        next.holder_identity = Some(self.identity.clone());
        next.renew_time = Some(MicroTime(now));
        next.lease_duration_seconds = Some(seconds);
        lease.spec = Some(next);
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => {
                if !ours {
                    tracing::info!(lease = %self.name, identity = %self.identity, previous = %holder, "became leader");
                }
                Ok(true)
            }
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Gives the lease up (holder cleared, duration 1 s), if this candidate still holds it.
    async fn release(&mut self) {
        let Ok(Some(mut lease)) = self.api.get_opt(&self.name).await else {
            return;
        };
        let Some(spec) = lease.spec.as_mut() else {
            return;
        };
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => tracing::info!(lease = %self.name, "released the lease"),
            Err(e) => tracing::warn!(lease = %self.name, error = %e, "could not release the lease"),
        }
    }
}
