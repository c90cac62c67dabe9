//! What a prepared device's metadata file (KEP-5304) tells its container: the attributes its
//! ResourceSlice publishes — UUID, product name, PCI bus ID, NUMA node, for a MIG device its
//! profile and parent — plus its memory in bytes, which the slice publishes as a capacity and
//! the file, holding attributes only, as the int attribute `memory`.

use super::attributes::{Attributes, MigShape, gpu_attributes, int, mig_device};
use crate::inventory::Inventory;
use crate::ledger::DeviceRecord;

/// The metadata attributes of prepared device `d`, read from `inv`; `None` when its GPU is not
/// in `inv` (gone since). A MIG device prepare created carries its UUID even when `inv` was
/// read before it existed.
pub fn device_metadata(inv: &Inventory, d: &DeviceRecord) -> Option<Attributes> {
    let gpu = inv.gpu_by_uuid(d.gpu.as_str())?;
    let (mut a, memory) = match &d.mig {
        None => (gpu_attributes(gpu), gpu.memory_bytes),
        Some(m) => {
            let existing = gpu
                .mig
                .devices
                .iter()
                .find(|x| m.uuid.as_ref() == Some(&x.uuid));
            let shape = match existing {
                Some(x) => MigShape::existing(x),
                None => {
                    let profile = gpu
                        .mig
                        .profiles
                        .iter()
                        .find(|p| p.gi_profile_id == m.gi_profile_id)?;
                    MigShape {
                        uuid: m.uuid.as_ref(),
                        ..MigShape::possible(profile, m.placement)
                    }
                }
            };
            let memory = shape.memory_bytes;
            (
                mig_device(gpu, &shape).attributes.unwrap_or_default(),
                memory,
            )
        }
    };
    a.insert(
        "memory".into(),
        int(i64::try_from(memory).unwrap_or(i64::MAX)),
    );
    Some(a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::DeviceName;
    use crate::inventory::topology::load_profile;
    use crate::inventory::{GpuUuid, MigUuid};
    use crate::ledger::MigRecord;
    use crate::sharing::Sharing;

    fn record(gpu: &GpuUuid, mig: Option<MigRecord>) -> DeviceRecord {
        DeviceRecord {
            requests: vec!["gpu".into()],
            pool: "n".into(),
            device: DeviceName::gpu(0),
            cdi_ids: vec![],
            share_id: None,
            admin_access: false,
            gpu: gpu.clone(),
            mig,
            consumed: None,
            sharing: Sharing::Exclusive,
        }
    }

    fn text(a: &Attributes, k: &str) -> Option<String> {
        let v = a.get(k)?;
        v.string
            .clone()
            .or(v.int.map(|i| i.to_string()))
            .or(v.version.clone())
    }

    #[test]
    fn a_gpu_tells_its_uuid_product_memory_numa_node_and_bus_id() {
        let inv = load_profile("dgx-h100", "n").unwrap();
        let gpu = &inv.gpus[0];
        let a = device_metadata(&inv, &record(&gpu.uuid, None)).unwrap();
        assert_eq!(text(&a, "uuid").as_deref(), Some(gpu.uuid.as_str()));
        assert_eq!(text(&a, "productName"), Some(gpu.product_name.clone()));
        assert_eq!(text(&a, "memory"), Some(gpu.memory_bytes.to_string()));
        assert_eq!(text(&a, "numaNode"), gpu.numa_node.map(|n| n.to_string()));
        assert!(gpu.numa_node.is_some(), "the profile places its GPUs");
        assert_eq!(
            text(&a, "resource.kubernetes.io/pciBusID").as_deref(),
            Some(gpu.pci_bus_id.as_str())
        );
        assert_eq!(text(&a, "type").as_deref(), Some("gpu"));
    }

    #[test]
    fn a_mig_device_tells_its_profile_parent_and_uuid_even_before_the_read_sees_it() {
        let inv = load_profile("dgx-h100", "n").unwrap();
        let gpu = &inv.gpus[0];
        let profile = &gpu.mig.profiles[0];
        let placement = profile.placements[0];
        let mig = MigRecord {
            uuid: Some(MigUuid("MIG-created-by-prepare".into())),
            profile: profile.name.clone(),
            gi_profile_id: profile.gi_profile_id,
            placement,
            created: true,
        };
        let a = device_metadata(&inv, &record(&gpu.uuid, Some(mig))).unwrap();
        assert_eq!(text(&a, "uuid").as_deref(), Some("MIG-created-by-prepare"));
        assert_eq!(text(&a, "parentUUID").as_deref(), Some(gpu.uuid.as_str()));
        assert_eq!(text(&a, "profile"), Some(profile.name.clone()));
        assert_eq!(text(&a, "memory"), Some(profile.memory_bytes.to_string()));
        assert_eq!(text(&a, "type").as_deref(), Some("mig"));
        assert_eq!(
            text(&a, "resource.kubernetes.io/pciBusID").as_deref(),
            Some(gpu.pci_bus_id.as_str())
        );
    }

    #[test]
    fn a_gpu_gone_from_the_inventory_has_none() {
        let inv = load_profile("dgx-h100", "n").unwrap();
        assert_eq!(
            device_metadata(&inv, &record(&GpuUuid("GPU-gone".into()), None)),
            None
        );
    }
}
