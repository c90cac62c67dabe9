//! Conversions between the kubelet's DRA protos (`v1`, `v1beta1`) and the plugin's domain types.
//! Proto structs are destructured exhaustively, so a new proto field breaks the build here
//! instead of being dropped silently. Claim UIDs are parsed here, once: a claim whose UID is not
//! one gets its error entry (prepare) or its success (unprepare: it cannot have been prepared)
//! without reaching the plugin.

use std::collections::HashMap;

use super::plugin::{ClaimError, ClaimRef};
use crate::ids::ClaimUid;
use crate::ledger::DeviceRecord;
use crate::proto::dra::{v1, v1beta1};

pub type PrepareResults = Vec<(ClaimUid, Result<Vec<DeviceRecord>, ClaimError>)>;
pub type UnprepareResults = Vec<(ClaimUid, Result<(), ClaimError>)>;

/// The claims of a request: those the plugin works on, and those whose UID is invalid, under
/// the UID the kubelet sent.
#[derive(Debug, Default)]
pub struct Claims {
    pub valid: Vec<ClaimRef>,
    pub rejected: Vec<(String, ClaimError)>,
}

impl FromIterator<(String, String, String)> for Claims {
    /// From `(namespace, uid, name)`.
    fn from_iter<I: IntoIterator<Item = (String, String, String)>>(iter: I) -> Self {
        let mut claims = Claims::default();
        for (namespace, uid, name) in iter {
            match ClaimUid::parse(uid.as_str()) {
                Ok(uid) => claims.valid.push(ClaimRef {
                    namespace,
                    name,
                    uid,
                }),
                Err(source) => claims
                    .rejected
                    .push((uid.clone(), ClaimError::BadUid { uid, source })),
            }
        }
        claims
    }
}

fn device_v1(d: DeviceRecord) -> v1::Device {
    let DeviceRecord {
        requests,
        pool,
        device,
        cdi_ids,
        share_id,
        admin_access: _,
        gpu: _,
        mig: _,
        sharing: _,
    } = d;
    v1::Device {
        request_names: requests,
        pool_name: pool,
        device_name: device.into(),
        cdi_device_ids: cdi_ids,
        share_id,
    }
}

fn device_v1beta1(d: DeviceRecord) -> v1beta1::Device {
    let DeviceRecord {
        requests,
        pool,
        device,
        cdi_ids,
        // v1beta1 has no share id: kubelets that speak only v1beta1 do not allocate shares.
        share_id: _,
        admin_access: _,
        gpu: _,
        mig: _,
        sharing: _,
    } = d;
    v1beta1::Device {
        request_names: requests,
        pool_name: pool,
        device_name: device.into(),
        cdi_device_ids: cdi_ids,
    }
}

/// Apart from `Device` (v1 has `share_id`), the messages are field for field the same in v1 and
/// v1beta1; one definition serves both.
macro_rules! same_in_both {
    ($ver:ident, $claims:ident, $prepare:ident, $unprepare:ident, $device:ident) => {
        pub fn $claims(claims: Vec<$ver::Claim>) -> Claims {
            claims
                .into_iter()
                .map(|c| {
                    let $ver::Claim {
                        namespace,
                        uid,
                        name,
                    } = c;
                    (namespace, uid, name)
                })
                .collect()
        }

        pub fn $prepare(
            rejected: Vec<(String, ClaimError)>,
            results: PrepareResults,
        ) -> $ver::NodePrepareResourcesResponse {
            let results = results.into_iter().map(|(uid, r)| (String::from(uid), r));
            let rejected = rejected.into_iter().map(|(uid, e)| (uid, Err(e)));
            let claims: HashMap<String, $ver::NodePrepareResourceResponse> = rejected
                .chain(results)
                .map(|(uid, r)| {
                    let entry = match r {
                        Ok(devices) => $ver::NodePrepareResourceResponse {
                            devices: devices.into_iter().map($device).collect(),
                            error: String::new(),
                        },
                        Err(e) => $ver::NodePrepareResourceResponse {
                            devices: Vec::new(),
                            error: crate::report::chain(&e).to_string(),
                        },
                    };
                    (uid, entry)
                })
                .collect();
            $ver::NodePrepareResourcesResponse { claims }
        }

        /// `rejected` claims succeed: with an invalid UID, a claim was never prepared, and
        /// unprepare of an unknown claim succeeds.
        pub fn $unprepare(
            rejected: Vec<(String, ClaimError)>,
            results: UnprepareResults,
        ) -> $ver::NodeUnprepareResourcesResponse {
            let rejected = rejected.into_iter().map(|(uid, _)| (uid, Ok(())));
            let results = results.into_iter().map(|(uid, r)| (String::from(uid), r));
            let claims = rejected
                .chain(results)
                .map(|(uid, r): (String, Result<(), ClaimError>)| {
                    let error = r
                        .err()
                        .map(|e| crate::report::chain(&e).to_string())
                        .unwrap_or_default();
                    (uid, $ver::NodeUnprepareResourceResponse { error })
                })
                .collect();
            $ver::NodeUnprepareResourcesResponse { claims }
        }
    };
}

same_in_both!(
    v1,
    claims_v1,
    prepare_response_v1,
    unprepare_response_v1,
    device_v1
);
same_in_both!(
    v1beta1,
    claims_v1beta1,
    prepare_response_v1beta1,
    unprepare_response_v1beta1,
    device_v1beta1
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::GpuUuid;
    use crate::sharing::Sharing;

    fn record(share: Option<&str>) -> DeviceRecord {
        DeviceRecord {
            requests: vec!["gpu".into()],
            pool: "node".into(),
            device: crate::ids::DeviceName::gpu(0),
            cdi_ids: vec!["k8s.gpu.nvidia.com/claim=u-gpu-0".into()],
            share_id: share.map(String::from),
            admin_access: false,
            gpu: GpuUuid("GPU-0".into()),
            mig: None,
            sharing: Sharing::Exclusive,
        }
    }

    #[test]
    fn share_id_only_on_v1_and_errors_become_entries() {
        let ok = || (ClaimUid::parse("a").unwrap(), Ok(vec![record(Some("s1"))]));
        let bad = || {
            (
                ClaimUid::parse("b").unwrap(),
                Err(ClaimError::NotAllocated {
                    namespace: "ns".into(),
                    name: "b".into(),
                }),
            )
        };
        let r1 = prepare_response_v1(vec![], vec![ok(), bad()]);
        assert_eq!(r1.claims["a"].devices[0].share_id.as_deref(), Some("s1"));
        assert_eq!(r1.claims["a"].devices[0].pool_name, "node");
        assert!(r1.claims["b"].error.contains("ns/b is not allocated"));
        assert!(r1.claims["b"].devices.is_empty());
        let r2 = prepare_response_v1beta1(vec![], vec![ok(), bad()]);
        assert_eq!(
            r2.claims["a"].devices[0].cdi_device_ids,
            vec!["k8s.gpu.nvidia.com/claim=u-gpu-0".to_string()]
        );
        assert!(!r2.claims["b"].error.is_empty());
    }

    #[test]
    fn a_bad_uid_is_that_claims_entry_and_never_reaches_the_plugin() {
        let claim = |uid: &str| v1::Claim {
            namespace: "ns".into(),
            uid: uid.into(),
            name: format!("c-{}", uid.len()),
        };
        let claims = claims_v1(vec![claim("good-1"), claim("a/b"), claim("")]);
        assert_eq!(
            claims.valid,
            vec![ClaimRef {
                namespace: "ns".into(),
                name: "c-6".into(),
                uid: ClaimUid::parse("good-1").unwrap(),
            }]
        );
        let rejected: Vec<&str> = claims.rejected.iter().map(|(u, _)| u.as_str()).collect();
        assert_eq!(rejected, vec!["a/b", ""]);

        let ok = (claims.valid[0].uid.clone(), Ok(vec![record(None)]));
        let r = prepare_response_v1(claims.rejected, vec![ok]);
        assert_eq!(r.claims.len(), 3);
        assert_eq!(r.claims["good-1"].error, "");
        let e = &r.claims["a/b"].error;
        assert!(
            e.starts_with("claim UID \"a/b\" cannot name a CDI device"),
            "{e}"
        );
        assert!(r.claims["a/b"].devices.is_empty());
        assert!(!r.claims[""].error.is_empty());

        // Unprepare: a claim that cannot have been prepared is unprepared.
        let claims = claims_v1beta1(vec![v1beta1::Claim {
            namespace: "ns".into(),
            uid: "a/b".into(),
            name: "c".into(),
        }]);
        assert!(claims.valid.is_empty());
        let r = unprepare_response_v1beta1(claims.rejected, vec![]);
        assert_eq!(r.claims["a/b"].error, "");
    }
}
