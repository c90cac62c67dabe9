//! Conversions between the kubelet's DRA protos (`v1`, `v1beta1`) and the plugin's domain types.
//! Proto structs are destructured exhaustively, so a new proto field breaks the build here
//! instead of being dropped silently.

use std::collections::HashMap;

use super::plugin::{ClaimError, ClaimRef};
use crate::ledger::{ClaimUid, DeviceRecord};
use crate::proto::dra::{v1, v1beta1};

pub type PrepareResults = Vec<(ClaimUid, Result<Vec<DeviceRecord>, ClaimError>)>;
pub type UnprepareResults = Vec<(ClaimUid, Result<(), ClaimError>)>;

pub fn claims_v1(claims: Vec<v1::Claim>) -> Vec<ClaimRef> {
    claims
        .into_iter()
        .map(|c| {
            let v1::Claim {
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

pub fn claims_v1beta1(claims: Vec<v1beta1::Claim>) -> Vec<ClaimRef> {
    claims
        .into_iter()
        .map(|c| {
            let v1beta1::Claim {
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

pub fn prepare_response_v1(results: PrepareResults) -> v1::NodePrepareResourcesResponse {
    let claims: HashMap<String, v1::NodePrepareResourceResponse> = results
        .into_iter()
        .map(|(uid, r)| {
            let entry = match r {
                Ok(devices) => v1::NodePrepareResourceResponse {
                    devices: devices.into_iter().map(device_v1).collect(),
                    error: String::new(),
                },
                Err(e) => v1::NodePrepareResourceResponse {
                    devices: Vec::new(),
                    error: e.to_string(),
                },
            };
            (uid.0, entry)
        })
        .collect();
    v1::NodePrepareResourcesResponse { claims }
}

pub fn prepare_response_v1beta1(results: PrepareResults) -> v1beta1::NodePrepareResourcesResponse {
    let claims = results
        .into_iter()
        .map(|(uid, r)| {
            let entry = match r {
                Ok(devices) => v1beta1::NodePrepareResourceResponse {
                    devices: devices.into_iter().map(device_v1beta1).collect(),
                    error: String::new(),
                },
                Err(e) => v1beta1::NodePrepareResourceResponse {
                    devices: Vec::new(),
                    error: e.to_string(),
                },
            };
            (uid.0, entry)
        })
        .collect();
    v1beta1::NodePrepareResourcesResponse { claims }
}

pub fn unprepare_response_v1(results: UnprepareResults) -> v1::NodeUnprepareResourcesResponse {
    let claims = results
        .into_iter()
        .map(|(uid, r)| {
            let error = r.err().map(|e| e.to_string()).unwrap_or_default();
            (uid.0, v1::NodeUnprepareResourceResponse { error })
        })
        .collect();
    v1::NodeUnprepareResourcesResponse { claims }
}

pub fn unprepare_response_v1beta1(
    results: UnprepareResults,
) -> v1beta1::NodeUnprepareResourcesResponse {
    let claims = results
        .into_iter()
        .map(|(uid, r)| {
            let error = r.err().map(|e| e.to_string()).unwrap_or_default();
            (uid.0, v1beta1::NodeUnprepareResourceResponse { error })
        })
        .collect();
    v1beta1::NodeUnprepareResourcesResponse { claims }
}

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
