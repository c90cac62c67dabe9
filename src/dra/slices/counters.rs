//! Partitionable devices: a GPU's shared counters and what each MIG placement consumes of them.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Counter, CounterSet, Device, DeviceCounterConsumption};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::attributes::{MigShape, mig_device};
use super::names::extra_counter_set_name;
use super::{
    Error, MAX_CONSUMPTIONS_PER_DEVICE, MAX_COUNTERS_PER_SET, Result, counter_set_name,
    sort_devices,
};
use crate::inventory::{Engines, Gpu, MigDevice, quantity};

/// A GPU's shared counters in partitionable mode: the resources MIG devices draw on (memory,
/// multiprocessors, engines) and one counter per memory slice, so that overlapping placements
/// exclude each other. Counters that would be zero are left out.
pub(super) struct GpuCounters {
    pub(super) sets: Vec<CounterSet>,
    /// Counter name → index into `sets`.
    pub(super) set_of: BTreeMap<String, usize>,
    /// False when the GPU's SM count is unknown: it then offers no `multiprocessors` counter,
    /// and its MIG devices consume none (the memory slices still keep them apart).
    pub(super) has_multiprocessors: bool,
}

pub(super) fn resource_counters(
    memory_bytes: u64,
    multiprocessors: u32,
    e: &Engines,
) -> Vec<(String, String)> {
    let Engines {
        copy_engines,
        decoders,
        encoders,
        jpeg_engines,
        ofa_engines,
    } = *e;
    let mut out = Vec::new();
    if memory_bytes > 0 {
        out.push(("memory".to_string(), quantity(memory_bytes)));
    }
    for (name, n) in [
        ("multiprocessors", multiprocessors),
        ("copy-engines", copy_engines),
        ("decoders", decoders),
        ("encoders", encoders),
        ("jpeg-engines", jpeg_engines),
        ("ofa-engines", ofa_engines),
    ] {
        if n > 0 {
            out.push((name.to_string(), n.to_string()));
        }
    }
    out
}

pub(super) fn memory_slice_counter(i: u32) -> String {
    format!("memory-slice-{i}")
}

impl GpuCounters {
    /// Splits the counters over as few sets as the per-set limit allows: the resource counters
    /// and the first memory slices in `gpu-<minor>-counter-set`, further memory slices in
    /// `gpu-<minor>-counter-set-2`. Every GPU made so far needs one set (15 counters at most).
    fn new(gpu: &Gpu) -> Result<Self> {
        let mut all = resource_counters(
            gpu.memory_bytes,
            gpu.multiprocessors.unwrap_or(0),
            &gpu.engines,
        );
        all.extend((0..gpu.mig.memory_slices).map(|i| (memory_slice_counter(i), "1".to_string())));
        let needed = all.len();
        let max = MAX_CONSUMPTIONS_PER_DEVICE * MAX_COUNTERS_PER_SET;
        if needed > max {
            return Err(Error::TooManyCounters {
                minor: gpu.minor,
                memory_slices: gpu.mig.memory_slices,
                needed,
                max,
                sets: MAX_CONSUMPTIONS_PER_DEVICE,
                per_set: MAX_COUNTERS_PER_SET,
            });
        }
        let mut sets = Vec::new();
        let mut set_of = BTreeMap::new();
        for (n, chunk) in all.chunks(MAX_COUNTERS_PER_SET).enumerate() {
            let name = if n == 0 {
                counter_set_name(gpu.minor)
            } else {
                extra_counter_set_name(gpu.minor, n + 1)
            };
            let mut counters = BTreeMap::new();
            for (counter, value) in chunk {
                set_of.insert(counter.clone(), n);
                counters.insert(
                    counter.clone(),
                    Counter {
                        value: Quantity(value.clone()),
                    },
                );
            }
            sets.push(CounterSet { name, counters });
        }
        Ok(Self {
            sets,
            set_of,
            has_multiprocessors: gpu.multiprocessors.is_some(),
        })
    }

    /// Consumptions of the given counters, one per set touched, in set order.
    fn consume(&self, counters: Vec<(String, String)>) -> Vec<DeviceCounterConsumption> {
        let mut per_set: BTreeMap<usize, BTreeMap<String, Counter>> = BTreeMap::new();
        for (name, value) in counters {
            // A counter the GPU lacks (a profile using an engine the GPU reports none of) goes to
            // the first set, where `validate_pool` reports it instead of it silently vanishing.
            let set = self.set_of.get(&name).copied().unwrap_or(0);
            per_set.entry(set).or_default().insert(
                name,
                Counter {
                    value: Quantity(value),
                },
            );
        }
        per_set
            .into_iter()
            .map(|(set, counters)| DeviceCounterConsumption {
                counter_set: self.sets[set].name.clone(),
                counters,
            })
            .collect()
    }

    fn consume_mig(&self, m: &MigShape<'_>) -> Vec<DeviceCounterConsumption> {
        let sms = if self.has_multiprocessors {
            m.multiprocessors
        } else {
            0
        };
        let mut counters = resource_counters(m.memory_bytes, sms, &m.engines);
        counters.extend(
            m.placement
                .slices()
                .map(|i| (memory_slice_counter(i), "1".to_string())),
        );
        self.consume(counters)
    }
}

/// One MIG-capable GPU in partitionable mode: its counters and the devices drawing on them.
pub(super) struct Partitioned {
    pub(super) minor: u32,
    pub(super) counters: Vec<CounterSet>,
    pub(super) devices: Vec<Device>,
}

/// The devices of a GPU in MIG mode, in partitionable mode.
///
/// Existing MIG devices (created outside nvdra, or left over) are published as they are, and
/// placements overlapping one are not: the counters only know what the scheduler allocated, not
/// what already exists. Every other placement of every profile is published; the largest
/// (`7g.*` at 0) covers the whole GPU. The GPU itself is not: in MIG mode CUDA cannot use it
/// whole, and switching MIG mode at prepare time would need the GPU idle (and on some models a
/// reset), which a kubelet plugin must not impose on a node.
pub(super) fn partitioned(gpu: &Gpu) -> Result<Partitioned> {
    let counters = GpuCounters::new(gpu)?;
    let existing: &[MigDevice] = &gpu.mig.devices;
    let mut devices = Vec::new();
    for d in existing.iter().filter(|d| !d.health.is_withdrawn()) {
        let shape = MigShape::existing(d);
        let mut dev = mig_device(gpu, &shape);
        dev.consumes_counters = Some(counters.consume_mig(&shape));
        devices.push(dev);
    }
    for p in &gpu.mig.profiles {
        for pl in &p.placements {
            if existing.iter().any(|d| d.placement.overlaps(pl)) {
                continue;
            }
            let shape = MigShape::possible(p, *pl);
            let mut dev = mig_device(gpu, &shape);
            dev.consumes_counters = Some(counters.consume_mig(&shape));
            devices.push(dev);
        }
    }
    sort_devices(&mut devices);
    Ok(Partitioned {
        minor: gpu.minor,
        counters: counters.sets,
        devices,
    })
}
