//! Assembling the pool: device order, chunking to the API's per-slice limits, and
//! [`desired_slices`].

use k8s_openapi::api::resource::v1::{
    CounterSet, Device, DeviceTaint, ResourcePool, ResourceSliceSpec,
};

use super::attributes::{
    MigShape, gpu_device, mig_device, shareable_gpu_device, shareable_mig_device,
};
use super::counters::{dynamic, partitioned};
use super::{
    CounterLayout, Error, MAX_COUNTER_SETS_PER_SLICE, MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS, Result, SliceOptions, TAINT_MIG_RESET_REQUIRED,
    Violations, sort_devices, validate, validate_pool,
};
use crate::inventory::{Health, Inventory, NoMigToggle, TaintEffect};

/// `d` with the taint a monitored failure puts on it (`<driver>/xid=79:NoSchedule`); the
/// server sets `timeAdded`. A device has at most one taint: the first failure's (the 1.34 limit
/// is 4).
fn tainted(mut d: Device, health: &Health, driver: &str) -> Device {
    if let Health::Tainted { taint, .. } = health {
        d.taints = Some(vec![DeviceTaint {
            key: format!("{driver}/{}", taint.key.name()),
            value: taint.key.value(),
            effect: taint.effect.as_str().to_string(),
            time_added: None,
        }]);
    }
    d
}

/// `d` with the [`TAINT_MIG_RESET_REQUIRED`] taint added when `reset` (after any health taint).
fn reset_required(mut d: Device, reset: bool, driver: &str) -> Device {
    if reset {
        d.taints.get_or_insert_with(Vec::new).push(DeviceTaint {
            key: format!("{driver}/{TAINT_MIG_RESET_REQUIRED}"),
            value: None,
            effect: TaintEffect::NoSchedule.as_str().to_string(),
            time_added: None,
        });
    }
    d
}

pub(super) use kubelet_plugin::validate::has_counters_or_taints as is_advanced;

/// Packs devices, in order, into as few chunks as the per-slice limits allow.
pub(super) fn chunk_devices(devices: Vec<Device>) -> Vec<Vec<Device>> {
    let mut chunks = Vec::new();
    let mut current: Vec<Device> = Vec::new();
    let mut advanced = false;
    for d in devices {
        let adv = advanced || is_advanced(&d);
        let limit = if adv {
            MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS
        } else {
            MAX_DEVICES_PER_SLICE
        };
        if current.len() + 1 > limit {
            chunks.push(std::mem::take(&mut current));
            advanced = is_advanced(&d);
        } else {
            advanced = adv;
        }
        current.push(d);
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

/// Slice contents before the pool bookkeeping is filled in.
#[derive(Default)]
pub(super) struct Draft {
    pub(super) counters: Option<Vec<CounterSet>>,
    pub(super) devices: Option<Vec<Device>>,
}

/// Computes the ResourceSlices that describe `inv` for `opts.node_name`.
///
/// The result is validated before it is returned; an error means this module (or the inventory)
/// is wrong, and nothing should be published.
pub fn desired_slices(inv: &Inventory, opts: &SliceOptions) -> Result<Vec<ResourceSliceSpec>> {
    let healthy = inv.gpus.iter().filter(|g| !g.health.is_withdrawn());
    let driver = opts.driver.as_str();
    // GPUs whose devices draw on shared counters, and devices that stand alone.
    let mut groups = Vec::new();
    let mut plain = Vec::new();
    let allowed = opts.mig_profiles.as_deref();
    for gpu in healthy {
        // With dynamic MIG: whether this GPU switches mode, and if not, whether a reset would
        // let it (its devices are then tainted).
        let toggle = opts.dynamic_mig.then(|| gpu.mig_toggle());
        let reset = matches!(toggle, Some(Err(NoMigToggle::Pending { .. })));
        let whole =
            || shareable_gpu_device(gpu, opts.shared_capacity).unwrap_or_else(|| gpu_device(gpu));
        let group = if let Some(Ok(())) = toggle {
            dynamic(gpu, allowed, whole())?
        } else if gpu.in_mig_mode() && opts.partitionable {
            partitioned(gpu, allowed, opts.shared_capacity)?
        } else if gpu.in_mig_mode() {
            for d in gpu.mig.devices.iter().filter(|d| !d.health.is_withdrawn()) {
                // A MIG device is as sick as its parent.
                let health = if gpu.health.is_healthy() {
                    &d.health
                } else {
                    &gpu.health
                };
                let shape = MigShape::existing(d);
                let dev = shareable_mig_device(gpu, &shape, opts.shared_capacity)
                    .unwrap_or_else(|| mig_device(gpu, &shape));
                plain.push(reset_required(tainted(dev, health, driver), reset, driver));
            }
            continue;
        } else {
            plain.push(reset_required(
                tainted(whole(), &gpu.health, driver),
                reset,
                driver,
            ));
            continue;
        };
        let mut g = group;
        g.devices = g
            .devices
            .into_iter()
            .map(|d| reset_required(tainted(d, &gpu.health, driver), reset, driver))
            .collect();
        groups.push(g);
    }
    let mut drafts = Vec::new();
    match opts.layout {
        CounterLayout::Together => {
            for g in groups {
                if g.devices.len() > MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS {
                    return Err(Error::TooManyDevicesTogether {
                        minor: g.minor,
                        devices: g.devices.len(),
                        max: MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS,
                    });
                }
                drafts.push(Draft {
                    counters: Some(g.counters).filter(|c| !c.is_empty()),
                    devices: Some(g.devices),
                });
            }
        }
        CounterLayout::Separate => {
            let all_sets: Vec<CounterSet> = groups
                .iter()
                .flat_map(|g| g.counters.iter().cloned())
                .collect();
            for chunk in all_sets.chunks(MAX_COUNTER_SETS_PER_SLICE) {
                drafts.push(Draft {
                    counters: Some(chunk.to_vec()),
                    devices: None,
                });
            }
            for g in groups {
                for chunk in chunk_devices(g.devices) {
                    drafts.push(Draft {
                        counters: None,
                        devices: Some(chunk),
                    });
                }
            }
        }
    }
    sort_devices(&mut plain);
    for chunk in chunk_devices(plain) {
        drafts.push(Draft {
            counters: None,
            devices: Some(chunk),
        });
    }
    if drafts.is_empty() {
        drafts.push(Draft {
            counters: None,
            devices: Some(Vec::new()),
        });
    }

    let count = drafts.len() as i64;
    let specs: Vec<ResourceSliceSpec> = drafts
        .into_iter()
        .map(|d| ResourceSliceSpec {
            driver: opts.driver.clone(),
            node_name: Some(opts.node_name.clone()),
            pool: ResourcePool {
                name: opts.node_name.clone(),
                generation: 0,
                resource_slice_count: count,
            },
            devices: d.devices,
            shared_counters: d.counters,
            ..Default::default()
        })
        .collect();

    for (i, spec) in specs.iter().enumerate() {
        let violations = validate(spec);
        if !violations.is_empty() {
            return Err(Error::Invalid {
                node: opts.node_name.clone(),
                slice: i.to_string(),
                violations: Violations(violations),
            });
        }
    }
    let violations = validate_pool(&specs);
    if !violations.is_empty() {
        return Err(Error::Invalid {
            node: opts.node_name.clone(),
            slice: "pool".into(),
            violations: Violations(violations),
        });
    }
    Ok(specs)
}
