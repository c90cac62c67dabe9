//! nvdra's [`Plugin`] as the library's [`Driver`]: where the kubelet's claims enter nvdra, read
//! and checked by the library (the claim named, allocated). Claim UIDs are parsed here, once: a
//! claim whose UID is not one gets its error (prepare) or its success (unprepare: it cannot have
//! been prepared) without reaching the plugin. Device records are destructured exhaustively,
//! so a new field must be decided on here.

use kubelet_plugin::metadata::DeviceMetadata;
use kubelet_plugin::{
    BoxError, Claim, Driver, PrepareClaim, PrepareResults, PreparedDevice, UnprepareResults,
};

use super::plugin::{ClaimError, ClaimRef, Plugin};
use crate::ids::ClaimUid;
use crate::inventory::Inventory;
use crate::ledger::DeviceRecord;

/// The claims of a request: those the plugin works on (with what was read of each), and those
/// whose UID is invalid, under the UID the kubelet sent.
#[derive(Debug)]
struct Claims<T> {
    valid: Vec<(ClaimRef, T)>,
    rejected: Vec<(String, ClaimError)>,
}

impl<T> Default for Claims<T> {
    fn default() -> Self {
        Self {
            valid: Vec::new(),
            rejected: Vec::new(),
        }
    }
}

impl<T> FromIterator<(Claim, T)> for Claims<T> {
    fn from_iter<I: IntoIterator<Item = (Claim, T)>>(iter: I) -> Self {
        let mut claims = Claims::default();
        for (claim, read) in iter {
            let Claim {
                namespace,
                name,
                uid,
                ..
            } = claim;
            match ClaimUid::parse(uid.as_str()) {
                Ok(uid) => claims.valid.push((
                    ClaimRef {
                        namespace,
                        name,
                        uid,
                    },
                    read,
                )),
                Err(source) => claims
                    .rejected
                    .push((uid.clone(), ClaimError::BadUid { uid, source })),
            }
        }
        claims
    }
}

/// What the kubelet is told of one prepared device, with the metadata its container reads
/// (KEP-5304) from `inv` when there is one.
fn prepared(d: DeviceRecord, inv: Option<&Inventory>) -> PreparedDevice {
    let metadata = inv
        .and_then(|inv| crate::dra::slices::device_metadata(inv, &d))
        .map(DeviceMetadata::new);
    let DeviceRecord {
        requests,
        pool,
        device,
        cdi_ids,
        share_id,
        admin_access: _,
        gpu: _,
        mig: _,
        consumed: _,
        sharing: _,
    } = d;
    let mut device = PreparedDevice::new(requests, pool, device, cdi_ids);
    if let Some(share) = share_id {
        device = device.with_share_id(share);
    }
    match metadata {
        Some(m) => device.with_metadata(m),
        None => device,
    }
}

impl Driver for Plugin {
    async fn prepare(&self, claims: Vec<PrepareClaim>) -> Result<PrepareResults, BoxError> {
        let read = claims.into_iter().map(|c| (c.claim.clone(), Some(c)));
        let Claims::<Option<PrepareClaim>> { valid, rejected } = read.collect();
        let results = Plugin::prepare_claims(self, valid).await;
        // Once per batch, after its prepares (a MIG device one of them created and this read
        // does not see yet is described from its record).
        let inv = if results.iter().any(|(_, r)| r.is_ok()) {
            self.metadata_inventory().await
        } else {
            None
        };
        let results = results.into_iter().map(|(uid, r)| {
            let devices = r
                .map(|records| {
                    let prepared = |d| prepared(d, inv.as_deref());
                    records.into_iter().map(prepared).collect()
                })
                .map_err(BoxError::from);
            (String::from(uid), devices)
        });
        Ok(rejected
            .into_iter()
            .map(|(uid, e)| (uid, Err(e.into())))
            .chain(results)
            .collect())
    }

    async fn unprepare(&self, claims: Vec<Claim>) -> Result<UnprepareResults, BoxError> {
        let Claims::<()> { valid, rejected } = claims.into_iter().map(|c| (c, ())).collect();
        let valid = valid.into_iter().map(|(c, ())| c).collect();
        let results = Plugin::unprepare(self, valid).await;
        // With an invalid UID, a claim was never prepared, and unprepare of an unknown claim
        // succeeds.
        Ok(rejected
            .into_iter()
            .map(|(uid, _)| (uid, Ok(())))
            .chain(
                results
                    .into_iter()
                    .map(|(uid, r)| (String::from(uid), r.map_err(BoxError::from))),
            )
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::GpuUuid;
    use crate::report::chain;
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
            consumed: None,
            sharing: Sharing::Exclusive,
        }
    }

    #[test]
    fn a_record_tells_the_kubelet_its_device_and_share() {
        let d = prepared(record(Some("s1")), None);
        assert_eq!(d.device, "gpu-0");
        assert_eq!(d.pool, "node");
        assert_eq!(d.requests, vec!["gpu".to_string()]);
        assert_eq!(d.share_id.as_deref(), Some("s1"));
        assert_eq!(
            d.cdi_ids,
            vec!["k8s.gpu.nvidia.com/claim=u-gpu-0".to_string()]
        );
    }

    #[test]
    fn a_bad_uid_is_that_claims_entry_and_never_reaches_the_plugin() {
        let claim = |uid: &str| (Claim::new("ns", format!("c-{}", uid.len()), uid), ());
        let claims: Claims<()> = vec![claim("good-1"), claim("a/b"), claim("")]
            .into_iter()
            .collect();
        assert_eq!(
            claims.valid,
            vec![(
                ClaimRef {
                    namespace: "ns".into(),
                    name: "c-6".into(),
                    uid: ClaimUid::parse("good-1").unwrap(),
                },
                ()
            )]
        );
        let rejected: Vec<&str> = claims.rejected.iter().map(|(u, _)| u.as_str()).collect();
        assert_eq!(rejected, vec!["a/b", ""]);
        let e = chain(&claims.rejected[0].1).to_string();
        assert!(
            e.starts_with("claim UID \"a/b\" cannot name a CDI device"),
            "{e}"
        );
        assert!(!chain(&claims.rejected[1].1).to_string().is_empty());
    }
}
