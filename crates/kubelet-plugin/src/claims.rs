//! Reading the claims the kubelet names, and the checks every driver needs before preparing
//! one (Go's helper does the same): the claim read is the one named (its UID, so a claim deleted
//! and re-created under the same name is refused), it is allocated, and its results for this
//! driver are picked out. The reads go through [`ClaimSource`], implemented for `kube::Client`
//! (feature `kube`) and, for tests, by `testing::MemoryClaims` (feature `testing`).

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::resource::v1::ResourceClaim;

use crate::api;
use crate::driver::{Claim, PrepareClaim};

/// How long [`fetch`] waits for the API server's answer: well inside the 45 s the kubelet gives
/// a `NodePrepareResources` call, so that a server that never answers costs the claim its
/// prepare with an error that says so, not the kubelet's whole call with a bare timeout.
pub const READ_DEADLINE: Duration = Duration::from_secs(10);

/// Where the plugin reads the ResourceClaims the kubelet names.
pub trait ClaimSource: Send + Sync + 'static {
    /// Reads a ResourceClaim; a missing one is [`api::Error::NotFound`].
    fn get_claim<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, api::Result<ResourceClaim>>;
}

impl<T: ClaimSource + ?Sized> ClaimSource for Arc<T> {
    fn get_claim<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, api::Result<ResourceClaim>> {
        (**self).get_claim(namespace, name)
    }
}

#[cfg(feature = "kube")]
impl ClaimSource for kube::Client {
    fn get_claim<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, api::Result<ResourceClaim>> {
        Box::pin(async move {
            kube::Api::<ResourceClaim>::namespaced(self.clone(), namespace)
                .get(name)
                .await
                .map_err(|e| {
                    api::kube::classify(&format!("get resourceclaim {namespace}/{name}"), e)
                })
        })
    }
}

/// Why a claim was refused before the driver saw it. The messages are the kubelet's to show.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The API server has no such claim.
    #[error("resource claim {namespace}/{name} not found in the API server (deleted?)")]
    NotFound {
        /// The claim's namespace.
        namespace: String,
        /// The claim's name.
        name: String,
    },
    /// The claim could not be read.
    #[error("cannot read resource claim {namespace}/{name}")]
    Api {
        /// The claim's namespace.
        namespace: String,
        /// The claim's name.
        name: String,
        /// Why.
        source: api::Error,
    },
    /// The API server did not answer within [`READ_DEADLINE`].
    #[error(
        "the API server did not answer the read of resource claim {namespace}/{name} within \
         {after:?}; the kubelet retries the prepare"
    )]
    Deadline {
        /// The claim's namespace.
        namespace: String,
        /// The claim's name.
        name: String,
        /// How long it was waited for.
        after: Duration,
    },
    /// The claim under this name is another one than the kubelet means.
    #[error(
        "resource claim {namespace}/{name} now has UID {found}, not {expected}: it was deleted and \
         re-created; the kubelet retries with the new claim"
    )]
    UidChanged {
        /// The claim's namespace.
        namespace: String,
        /// The claim's name.
        name: String,
        /// The UID the kubelet sent.
        expected: String,
        /// The UID the API server has.
        found: String,
    },
    /// The claim has no device allocation.
    #[error(
        "resource claim {namespace}/{name} is not allocated; the scheduler has not placed it yet"
    )]
    NotAllocated {
        /// The claim's namespace.
        namespace: String,
        /// The claim's name.
        name: String,
    },
}

/// A request name as the kubelet expects it back: `request` of `request/subrequest`.
pub fn base_request(name: &str) -> &str {
    name.split_once('/').map_or(name, |(base, _)| base)
}

/// Checks that `rc` is the claim the kubelet named and is allocated, and picks out the results
/// for `driver`.
pub fn check(claim: Claim, rc: ResourceClaim, driver: &str) -> Result<PrepareClaim, Error> {
    let found = rc.metadata.uid.as_deref().unwrap_or_default();
    if found != claim.uid {
        return Err(Error::UidChanged {
            namespace: claim.namespace,
            name: claim.name,
            expected: claim.uid,
            found: found.to_string(),
        });
    }
    let results = rc
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .map(|d| d.results.as_deref().unwrap_or_default());
    let Some(results) = results else {
        return Err(Error::NotAllocated {
            namespace: claim.namespace,
            name: claim.name,
        });
    };
    let results = results
        .iter()
        .filter(|r| r.driver == driver)
        .cloned()
        .collect();
    Ok(PrepareClaim {
        claim,
        resource_claim: rc,
        results,
    })
}

/// Reads and checks one claim, waiting for the read at most [`READ_DEADLINE`].
pub async fn fetch(
    source: &dyn ClaimSource,
    claim: Claim,
    driver: &str,
) -> Result<PrepareClaim, Error> {
    let read = tokio::time::timeout(
        READ_DEADLINE,
        source.get_claim(&claim.namespace, &claim.name),
    );
    let Ok(read) = read.await else {
        return Err(Error::Deadline {
            namespace: claim.namespace,
            name: claim.name,
            after: READ_DEADLINE,
        });
    };
    match read {
        Ok(rc) => check(claim, rc, driver),
        Err(api::Error::NotFound(_)) => Err(Error::NotFound {
            namespace: claim.namespace,
            name: claim.name,
        }),
        Err(source) => Err(Error::Api {
            namespace: claim.namespace,
            name: claim.name,
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{MemoryClaims, allocated_claim, allocated_device};

    const DRIVER: &str = "fpga.example.com";

    #[test]
    fn a_subrequest_is_answered_under_its_request() {
        assert_eq!(base_request("fpga/small"), "fpga");
        assert_eq!(base_request("fpga"), "fpga");
    }

    #[tokio::test]
    async fn the_driver_gets_its_own_results_of_the_claim_it_named() {
        let claims = MemoryClaims::default();
        claims.insert(allocated_claim(
            "ns",
            "c",
            "u1",
            vec![
                allocated_device("fpga/small", DRIVER, "node-a", "fpga-0"),
                allocated_device("gpu", "gpu.example.com", "node-a", "gpu-0"),
            ],
        ));
        let got = fetch(&claims, Claim::new("ns", "c", "u1"), DRIVER)
            .await
            .unwrap();
        assert_eq!(got.claim, Claim::new("ns", "c", "u1"));
        let devices: Vec<(&str, &str)> = got
            .results
            .iter()
            .map(|r| (r.request.as_str(), r.device.as_str()))
            .collect();
        assert_eq!(devices, vec![("fpga/small", "fpga-0")]);
    }

    /// An API server that answers the reads of `answered` and never those of any other claim.
    struct Silent {
        answered: MemoryClaims,
        hang: &'static str,
    }

    impl ClaimSource for Silent {
        fn get_claim<'a>(
            &'a self,
            namespace: &'a str,
            name: &'a str,
        ) -> BoxFuture<'a, api::Result<ResourceClaim>> {
            if name == self.hang {
                return Box::pin(futures::future::pending());
            }
            self.answered.get_claim(namespace, name)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_never_answered_fails_its_claim_alone_at_the_deadline() {
        let answered = MemoryClaims::default();
        answered.insert(allocated_claim(
            "ns",
            "fine",
            "u1",
            vec![allocated_device("fpga", DRIVER, "node-a", "fpga-0")],
        ));
        let api = Silent {
            answered,
            hang: "silent",
        };
        let start = tokio::time::Instant::now();
        // Read together, as `serve` reads a call's claims.
        let (silent, fine) = futures::future::join(
            fetch(&api, Claim::new("ns", "silent", "u2"), DRIVER),
            fetch(&api, Claim::new("ns", "fine", "u1"), DRIVER),
        )
        .await;
        assert_eq!(start.elapsed(), READ_DEADLINE);
        assert_eq!(fine.unwrap().results.len(), 1);
        let e = silent.unwrap_err();
        assert!(matches!(e, Error::Deadline { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "the API server did not answer the read of resource claim ns/silent within 10s; the \
             kubelet retries the prepare"
        );
    }

    #[tokio::test]
    async fn a_replaced_unallocated_or_missing_claim_is_refused_by_name() {
        let claims = MemoryClaims::default();
        claims.insert(allocated_claim("ns", "replaced", "new-uid", vec![]));
        let mut unallocated = allocated_claim("ns", "pending", "u2", vec![]);
        unallocated.status = None;
        claims.insert(unallocated);

        let e = fetch(&claims, Claim::new("ns", "replaced", "old-uid"), DRIVER)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::UidChanged { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "resource claim ns/replaced now has UID new-uid, not old-uid: it was deleted and \
             re-created; the kubelet retries with the new claim"
        );
        let e = fetch(&claims, Claim::new("ns", "pending", "u2"), DRIVER)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::NotAllocated { .. }), "{e:?}");
        assert!(e.to_string().contains("ns/pending is not allocated"), "{e}");
        let e = fetch(&claims, Claim::new("ns", "gone", "u3"), DRIVER)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::NotFound { .. }), "{e:?}");
        assert!(e.to_string().contains("ns/gone not found"), "{e}");
    }
}
