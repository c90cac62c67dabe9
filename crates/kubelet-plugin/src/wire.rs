//! Conversions between the kubelet's DRA protos (`v1`, `v1beta1`) and the library's types.
//! Proto structs are destructured exhaustively, so a new proto field breaks the build here
//! instead of being dropped silently. Apart from `Device` (`v1` has `share_id`), the messages
//! are field for field the same in both versions; one definition serves both.

use std::collections::HashMap;

use crate::claims::base_request;
use crate::driver::{Claim, PreparedDevice};
use crate::proto::dra::{v1, v1beta1};

/// Each claim's outcome, its error already in words (the message and each cause once).
pub type Answers<T> = Vec<(String, Result<T, String>)>;

/// The kubelet wants base request names (`request`, not `request/subrequest`).
fn base_requests(requests: Vec<String>) -> Vec<String> {
    requests
        .into_iter()
        .map(|r| base_request(&r).to_string())
        .collect()
}

fn device_v1(d: PreparedDevice) -> v1::Device {
    let PreparedDevice {
        requests,
        pool,
        device,
        cdi_ids,
        share_id,
        // Written to files by the service before the answer is made.
        metadata: _,
    } = d;
    v1::Device {
        request_names: base_requests(requests),
        pool_name: pool,
        device_name: device,
        cdi_device_ids: cdi_ids,
        share_id,
    }
}

fn device_v1beta1(d: PreparedDevice) -> v1beta1::Device {
    let PreparedDevice {
        requests,
        pool,
        device,
        cdi_ids,
        // v1beta1 has no share id: kubelets that speak only v1beta1 do not allocate shares.
        share_id: _,
        metadata: _,
    } = d;
    v1beta1::Device {
        request_names: base_requests(requests),
        pool_name: pool,
        device_name: device,
        cdi_device_ids: cdi_ids,
    }
}

/// Why a claim has no answer: the driver left it out of its results.
#[derive(Debug, thiserror::Error)]
#[error("the driver returned no result for claim {0}")]
pub struct Missing(pub String);

macro_rules! same_in_both {
    ($ver:ident, $claims:ident, $prepare:ident, $unprepare:ident, $device:ident) => {
        pub fn $claims(claims: Vec<$ver::Claim>) -> Vec<Claim> {
            claims
                .into_iter()
                .map(|c| {
                    let $ver::Claim {
                        namespace,
                        uid,
                        name,
                    } = c;
                    Claim {
                        namespace,
                        name,
                        uid,
                    }
                })
                .collect()
        }

        /// One entry per claim UID in `asked`, whatever the driver returned.
        pub fn $prepare(
            asked: &[String],
            results: Answers<Vec<PreparedDevice>>,
        ) -> $ver::NodePrepareResourcesResponse {
            let mut claims: HashMap<String, $ver::NodePrepareResourceResponse> = results
                .into_iter()
                .map(|(uid, r)| {
                    let entry = match r {
                        Ok(devices) => $ver::NodePrepareResourceResponse {
                            devices: devices.into_iter().map($device).collect(),
                            error: String::new(),
                        },
                        Err(e) => $ver::NodePrepareResourceResponse {
                            devices: Vec::new(),
                            error: e,
                        },
                    };
                    (uid, entry)
                })
                .collect();
            for uid in asked {
                claims
                    .entry(uid.clone())
                    .or_insert_with(|| $ver::NodePrepareResourceResponse {
                        devices: Vec::new(),
                        error: Missing(uid.clone()).to_string(),
                    });
            }
            $ver::NodePrepareResourcesResponse { claims }
        }

        /// One entry per claim UID in `asked`, whatever the driver returned.
        pub fn $unprepare(
            asked: &[String],
            results: Answers<()>,
        ) -> $ver::NodeUnprepareResourcesResponse {
            let mut claims: HashMap<String, $ver::NodeUnprepareResourceResponse> = results
                .into_iter()
                .map(|(uid, r)| {
                    let error = r.err().unwrap_or_default();
                    (uid, $ver::NodeUnprepareResourceResponse { error })
                })
                .collect();
            for uid in asked {
                claims
                    .entry(uid.clone())
                    .or_insert_with(|| $ver::NodeUnprepareResourceResponse {
                        error: Missing(uid.clone()).to_string(),
                    });
            }
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

    fn device(share: Option<&str>) -> PreparedDevice {
        PreparedDevice {
            requests: vec!["gpu/small".into()],
            pool: "node".into(),
            device: "gpu-0".into(),
            cdi_ids: vec!["k8s.example.com/claim=u-gpu-0".into()],
            share_id: share.map(String::from),
            metadata: None,
        }
    }

    fn uids(uids: &[&str]) -> Vec<String> {
        uids.iter().map(|u| u.to_string()).collect()
    }

    #[test]
    fn share_id_only_on_v1_and_errors_become_entries() {
        let ok = || ("a".to_string(), Ok(vec![device(Some("s1"))]));
        let bad = || ("b".to_string(), Err("claim ns/b is not allocated".into()));
        let asked = uids(&["a", "b"]);
        let r1 = prepare_response_v1(&asked, vec![ok(), bad()]);
        assert_eq!(r1.claims["a"].devices[0].share_id.as_deref(), Some("s1"));
        assert_eq!(r1.claims["a"].devices[0].pool_name, "node");
        assert_eq!(
            r1.claims["a"].devices[0].request_names,
            vec!["gpu".to_string()]
        );
        assert!(r1.claims["b"].error.contains("ns/b is not allocated"));
        assert!(r1.claims["b"].devices.is_empty());
        let r2 = prepare_response_v1beta1(&asked, vec![ok(), bad()]);
        assert_eq!(
            r2.claims["a"].devices[0].cdi_device_ids,
            vec!["k8s.example.com/claim=u-gpu-0".to_string()]
        );
        assert_eq!(
            r2.claims["a"].devices[0].request_names,
            vec!["gpu".to_string()]
        );
        assert!(!r2.claims["b"].error.is_empty());
    }

    #[test]
    fn a_claim_the_driver_left_out_still_gets_an_entry() {
        let asked = uids(&["a", "forgotten"]);
        let done: Answers<Vec<PreparedDevice>> = vec![("a".into(), Ok(vec![device(None)]))];
        let r = prepare_response_v1(&asked, done);
        assert_eq!(r.claims.len(), 2);
        assert_eq!(r.claims["a"].error, "");
        assert_eq!(
            r.claims["forgotten"].error,
            "the driver returned no result for claim forgotten"
        );
        let r = unprepare_response_v1beta1(&asked, vec![("a".into(), Ok(()))]);
        assert_eq!(r.claims["a"].error, "");
        assert!(!r.claims["forgotten"].error.is_empty());
    }

    #[test]
    fn claims_keep_every_field() {
        let c = claims_v1(vec![v1::Claim {
            namespace: "ns".into(),
            uid: "u-1".into(),
            name: "c".into(),
        }]);
        assert_eq!(
            c,
            vec![Claim {
                namespace: "ns".into(),
                name: "c".into(),
                uid: "u-1".into(),
            }]
        );
    }
}
