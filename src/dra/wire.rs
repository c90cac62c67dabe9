//! Conversions between the kubelet's DRA protos (`v1`, `v1beta1`) and the plugin's domain types.
//! Proto structs are destructured exhaustively, so a new proto field breaks the build here
//! instead of being dropped silently.

use std::collections::HashMap;

use super::plugin::{ClaimError, ClaimRef};
use crate::ledger::{ClaimUid, DeviceRecord};
use crate::proto::dra::{v1, v1beta1};

pub type PrepareResults = Vec<(ClaimUid, Result<Vec<DeviceRecord>, ClaimError>)>;
pub type UnprepareResults = Vec<(ClaimUid, Result<(), ClaimError>)>;

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
        device_name: device,
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
        device_name: device,
        cdi_device_ids: cdi_ids,
    }
}

/// Apart from `Device` (v1 has `share_id`), the messages are field for field the same in v1 and
/// v1beta1; one definition serves both.
macro_rules! same_in_both {
    ($ver:ident, $claims:ident, $prepare:ident, $unprepare:ident, $device:ident) => {
        pub fn $claims(claims: Vec<$ver::Claim>) -> Vec<ClaimRef> {
            claims
                .into_iter()
                .map(|c| {
                    let $ver::Claim {
                        namespace,
                        uid,
                        name,
                    } = c;
                    ClaimRef {
                        namespace,
                        name,
                        uid: ClaimUid(uid),
                    }
                })
                .collect()
        }

        pub fn $prepare(results: PrepareResults) -> $ver::NodePrepareResourcesResponse {
            let claims: HashMap<String, $ver::NodePrepareResourceResponse> = results
                .into_iter()
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
                    (uid.0, entry)
                })
                .collect();
            $ver::NodePrepareResourcesResponse { claims }
        }

        pub fn $unprepare(results: UnprepareResults) -> $ver::NodeUnprepareResourcesResponse {
            let claims = results
                .into_iter()
                .map(|(uid, r)| {
                    let error = r
                        .err()
                        .map(|e| crate::report::chain(&e).to_string())
                        .unwrap_or_default();
                    (uid.0, $ver::NodeUnprepareResourceResponse { error })
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
            device: "gpu-0".into(),
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
        let ok = || (ClaimUid("a".into()), Ok(vec![record(Some("s1"))]));
        let bad = || {
            (
                ClaimUid("b".into()),
                Err(ClaimError::NotAllocated {
                    namespace: "ns".into(),
                    name: "b".into(),
                }),
            )
        };
        let r1 = prepare_response_v1(vec![ok(), bad()]);
        assert_eq!(r1.claims["a"].devices[0].share_id.as_deref(), Some("s1"));
        assert_eq!(r1.claims["a"].devices[0].pool_name, "node");
        assert!(r1.claims["b"].error.contains("ns/b is not allocated"));
        assert!(r1.claims["b"].devices.is_empty());
        let r2 = prepare_response_v1beta1(vec![ok(), bad()]);
        assert_eq!(
            r2.claims["a"].devices[0].cdi_device_ids,
            vec!["k8s.gpu.nvidia.com/claim=u-gpu-0".to_string()]
        );
        assert!(!r2.claims["b"].error.is_empty());
    }
}
