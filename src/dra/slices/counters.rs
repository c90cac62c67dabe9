//! Partitionable devices: a GPU's shared counters and what each MIG placement consumes of them.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{Counter, CounterSet, Device, DeviceCounterConsumption};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::attributes::{MigShape, mig_device, shareable_mig_device};
use super::names::extra_counter_set_name;
use super::{
    Error, MAX_CONSUMPTIONS_PER_DEVICE, MAX_COUNTERS_PER_SET, Result, counter_set_name,
    sort_devices,
};
use crate::inventory::{Engines, Gpu, MigDevice, quantity};
use crate::ledger::shares::ConsumableShares;

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

/// The resource counter a GPU's memory is counted in; its value is a quantity of bytes.
const MEMORY: &str = "memory";

/// The resources a GPU or MIG device has, as counter name and amount, leaving out those it has
/// none of.
fn resource_amounts(
    memory_bytes: u64,
    multiprocessors: u32,
    e: &Engines,
) -> Vec<(&'static str, u64)> {
    let Engines {
        copy_engines,
        decoders,
        encoders,
        jpeg_engines,
        ofa_engines,
    } = *e;
    let mut out = vec![(MEMORY, memory_bytes)];
    for (name, n) in [
        ("multiprocessors", multiprocessors),
        ("copy-engines", copy_engines),
        ("decoders", decoders),
        ("encoders", encoders),
        ("jpeg-engines", jpeg_engines),
        ("ofa-engines", ofa_engines),
    ] {
        out.push((name, u64::from(n)));
    }
    out.retain(|(_, n)| *n > 0);
    out
}

/// The engines a GPU's counter set holds: of each kind, the most that the GPU, any of its
/// MIG profiles or any existing MIG device has, as NVIDIA's driver takes the maximum over every
/// profile. The GPU's own figures come from its largest profile (NVML gives no engine counts for
/// a whole GPU), and a smaller profile may have more of one kind (a `+me.all` profile takes
/// every media engine); a counter below what one of its devices consumes would keep that device
/// from ever being allocated.
fn engine_totals(gpu: &Gpu) -> Engines {
    let profiles = gpu.mig.profiles.iter().map(|p| &p.engines);
    let devices = gpu.mig.devices.iter().map(|d| &d.engines);
    profiles
        .chain(devices)
        .fold(gpu.engines, |most, e| Engines {
            copy_engines: most.copy_engines.max(e.copy_engines),
            decoders: most.decoders.max(e.decoders),
            encoders: most.encoders.max(e.encoders),
            jpeg_engines: most.jpeg_engines.max(e.jpeg_engines),
            ofa_engines: most.ofa_engines.max(e.ofa_engines),
        })
}

/// A counter's amount as its quantity: memory in bytes with a binary suffix, the rest as is.
fn amount(name: &str, n: u64) -> String {
    if name == MEMORY {
        quantity(n)
    } else {
        n.to_string()
    }
}

pub(super) fn resource_counters(
    memory_bytes: u64,
    multiprocessors: u32,
    e: &Engines,
) -> Vec<(String, String)> {
    resource_amounts(memory_bytes, multiprocessors, e)
        .into_iter()
        .map(|(name, n)| (name.to_string(), amount(name, n)))
        .collect()
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
            &engine_totals(gpu),
        );
        all.extend((0..gpu.mig.memory_slices).map(|i| (memory_slice_counter(i), "1".to_string())));
        Self::with(gpu, all)
    }

    /// The sets holding exactly the counters `all`, in that order.
    fn with(gpu: &Gpu, all: Vec<(String, String)>) -> Result<Self> {
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
///
/// Only the placements of the profiles in `allowed` are published (`--mig-profiles`; all when
/// `None`); existing MIG devices are, whatever their profile.
pub(super) fn partitioned(
    gpu: &Gpu,
    allowed: Option<&[String]>,
    mode: ConsumableShares,
) -> Result<Partitioned> {
    let counters = GpuCounters::new(gpu)?;
    let existing: &[MigDevice] = &gpu.mig.devices;
    let mut devices = Vec::new();
    for d in existing.iter().filter(|d| !d.health.is_withdrawn()) {
        let shape = MigShape::existing(d);
        // In a share mode an existing MIG device is shareable (its counters are charged once,
        // whatever its shares: the scheduler skips the counter check of a shareable device
        // already in use); placements are not.
        let mut dev =
            shareable_mig_device(gpu, &shape, mode).unwrap_or_else(|| mig_device(gpu, &shape));
        dev.consumes_counters = Some(counters.consume_mig(&shape));
        devices.push(dev);
    }
    for p in gpu
        .mig
        .profiles
        .iter()
        .filter(|p| is_allowed(allowed, &p.name))
    {
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

/// Whether the placements of MIG profile `name` are published under the `--mig-profiles`
/// allowlist (`None`: every profile).
pub(super) fn is_allowed(allowed: Option<&[String]>, name: &str) -> bool {
    allowed.is_none_or(|list| list.iter().any(|p| p == name))
}

/// One device of a dynamic-MIG GPU, before its counter consumption is known.
struct Member {
    device: Device,
    /// The memory slices it takes.
    slices: std::ops::Range<u32>,
    /// What it takes of each resource counter (none left out as zero).
    amounts: Vec<(&'static str, u64)>,
}

/// The most of resource `name` that MIG devices on pairwise disjoint memory slices take
/// together: the heaviest set of non-overlapping intervals, by dynamic programming over the
/// slice boundaries (`best[b]`: the most using only slices below `b`).
fn most_at_once(members: &[Member], memory_slices: u32, name: &str) -> u64 {
    let end = members
        .iter()
        .map(|m| m.slices.end)
        .max()
        .unwrap_or(0)
        .max(memory_slices) as usize;
    let mut best = vec![0u64; end + 1];
    for b in 1..=end {
        best[b] = best[b - 1];
        for m in members.iter().filter(|m| m.slices.end as usize == b) {
            let n = m
                .amounts
                .iter()
                .find(|(c, _)| *c == name)
                .map_or(0, |(_, n)| *n);
            best[b] = best[b].max(best[m.slices.start as usize] + n);
        }
    }
    best[end]
}

/// A GPU under dynamic MIG (`--dynamic-mig`): the whole GPU and every free placement of every
/// allowed profile, at whichever MIG mode the GPU is in now, all drawing on one counter set, so
/// the scheduler hands out the GPU whole or in MIG devices, never both at once. Prepare switches
/// the mode the allocated device needs.
///
/// - Existing MIG devices are published as they are (whatever `allowed` says), and placements
///   overlapping one are not, as in [`partitioned`]. The whole GPU is published only while no
///   MIG device exists: it overlaps every one, and one nvdra did not create is not nvdra's to
///   destroy.
/// - `whole` is the GPU's device as it would be published without the switch (with
///   `--shared-capacity`, the shareable one); it consumes every counter of the set, all of
///   each. The scheduler charges a shareable device's counters once, at its first share: its
///   allocator skips the counter check for a shareable device already in use
///   (`skipCounterCheck`, after kubernetes#134100) and counts committed shares when it rebuilds
///   the counters (kubernetes#139040; releases without it forget them, kubernetes#139034). So
///   while any share runs no MIG placement fits, and while any MIG device is allocated no share
///   does.
/// - A placement consumes its memory slices and what its profile takes of the resources,
///   NVIDIA's way, but only of the counters that can run short (each device consuming fewer
///   counters is less work for the scheduler, at every node it looks at): a memory slice counts
///   where two devices share it and no other slice's devices include its devices (a slice only
///   the largest profiles reach adds nothing to the one beside it); a resource counts where
///   MIG devices on disjoint memory slices can take more of it than the GPU has. On an H100 that
///   leaves seven memory slices and the one OFA engine (two `+me` placements would want two):
///   memory, multiprocessors, copy engines, decoders and JPEG engines never run short before
///   the memory slices do.
/// - The memory and multiprocessor counters hold the GPU's own totals, where NVIDIA's driver
///   uses the maximum over its profiles (the largest profile's memory is a little below the
///   GPU's). Both exclude the same allocations: the whole GPU takes every memory slice, so it
///   never shares the set with a MIG device. The engine counters hold the maximum over the
///   GPU and every profile, as NVIDIA's do ([`engine_totals`]): the GPU's own engine figures are
///   its largest profile's, which a smaller profile may exceed. Of the counters kept, only the
///   OFA engine's value matters on the GPUs made so far, and it is 1 either way.
pub(super) fn dynamic(gpu: &Gpu, allowed: Option<&[String]>, whole: Device) -> Result<Partitioned> {
    dynamic_with(gpu, allowed, Some(whole))
}

/// [`dynamic`], with the whole GPU left out when `whole` is `None` (a GPU in MIG mode that a
/// process holds: turning the mode off for a whole-GPU claim would fail), its counters then
/// only those its MIG devices need.
pub(super) fn dynamic_with(
    gpu: &Gpu,
    allowed: Option<&[String]>,
    whole: Option<Device>,
) -> Result<Partitioned> {
    let sms = |n: u32| if gpu.multiprocessors.is_some() { n } else { 0 };
    let existing: &[MigDevice] = &gpu.mig.devices;
    let mut members = Vec::new();
    let mut add = |shape: MigShape<'_>| {
        members.push(Member {
            device: mig_device(gpu, &shape),
            slices: shape.placement.slices(),
            amounts: resource_amounts(
                shape.memory_bytes,
                sms(shape.multiprocessors),
                &shape.engines,
            ),
        });
    };
    for d in existing.iter().filter(|d| !d.health.is_withdrawn()) {
        add(MigShape::existing(d));
    }
    for p in gpu
        .mig
        .profiles
        .iter()
        .filter(|p| is_allowed(allowed, &p.name))
    {
        for pl in &p.placements {
            if !existing.iter().any(|d| d.placement.overlaps(pl)) {
                add(MigShape::possible(p, *pl));
            }
        }
    }
    let whole = whole.filter(|_| existing.is_empty());

    // Resource counters that MIG devices can exhaust. The whole GPU alone takes exactly what
    // the GPU has, so it never exhausts one.
    let totals = resource_amounts(
        gpu.memory_bytes,
        gpu.multiprocessors.unwrap_or(0),
        &engine_totals(gpu),
    );
    let total = |name: &str| {
        totals
            .iter()
            .find(|(c, _)| *c == name)
            .map_or(0, |(_, n)| *n)
    };
    let mut names: Vec<&'static str> = members
        .iter()
        .flat_map(|m| m.amounts.iter().map(|(c, _)| *c))
        .collect();
    names.sort_unstable();
    names.dedup();
    let resources: Vec<&'static str> = names
        .into_iter()
        .filter(|c| most_at_once(&members, gpu.mig.memory_slices, c) > total(c))
        .collect();

    // Memory-slice counters: who takes each slice (the whole GPU, last, takes all of them).
    let takers: Vec<BTreeSet<usize>> = (0..gpu.mig.memory_slices)
        .map(|i| {
            let mut s: BTreeSet<usize> = members
                .iter()
                .enumerate()
                .filter(|(_, m)| m.slices.contains(&i))
                .map(|(k, _)| k)
                .collect();
            if whole.is_some() {
                s.insert(members.len());
            }
            s
        })
        .collect();
    // Slice i's counter is needed when two devices take it, unless another slice's takers
    // include all of its own (then that slice's counter keeps them apart already; of equal
    // ones the first stays). The slice kept for a dropped one is itself kept, or dropped for a
    // larger one still: every overlap is kept apart by some counter.
    let slices: Vec<u32> = (0..gpu.mig.memory_slices)
        .filter(|&i| {
            let mine = &takers[i as usize];
            mine.len() >= 2
                && !takers.iter().enumerate().any(|(j, other)| {
                    j != i as usize
                        && mine.is_subset(other)
                        && (mine.len() < other.len() || j < i as usize)
                })
        })
        .collect();

    let mut all: Vec<(String, String)> = resources
        .iter()
        .filter(|c| total(c) > 0)
        .map(|c| (c.to_string(), amount(c, total(c))))
        .collect();
    all.extend(
        slices
            .iter()
            .map(|&i| (memory_slice_counter(i), "1".to_string())),
    );
    let counters = if all.is_empty() {
        None
    } else {
        Some(GpuCounters::with(gpu, all.clone())?)
    };
    let consumption = |c: Vec<(String, String)>| {
        counters
            .as_ref()
            .map(|set| set.consume(c))
            .filter(|c| !c.is_empty())
    };

    let mut devices = Vec::new();
    for m in members {
        let mut c: Vec<(String, String)> = m
            .amounts
            .iter()
            .filter(|(name, _)| resources.contains(name))
            .map(|(name, n)| (name.to_string(), amount(name, *n)))
            .collect();
        c.extend(
            slices
                .iter()
                .filter(|i| m.slices.contains(i))
                .map(|&i| (memory_slice_counter(i), "1".to_string())),
        );
        let mut dev = m.device;
        dev.consumes_counters = consumption(c);
        devices.push(dev);
    }
    if let Some(mut w) = whole {
        w.consumes_counters = consumption(all);
        devices.push(w);
    }
    sort_devices(&mut devices);
    Ok(Partitioned {
        minor: gpu.minor,
        counters: counters.map(|c| c.sets).unwrap_or_default(),
        devices,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::topology::load_profile;

    /// Every counter a device of `devices` consumes, against the value `sets` give it.
    fn over(sets: &[CounterSet], devices: &[Device]) -> Vec<String> {
        let value = |set: &str, counter: &str| {
            sets.iter()
                .find(|s| s.name == set)
                .and_then(|s| s.counters.get(counter))
                .map(|c| c.value.0.clone())
        };
        let mut out = Vec::new();
        for d in devices {
            for c in d.consumes_counters.iter().flatten() {
                for (name, want) in &c.counters {
                    let have = value(&c.counter_set, name);
                    let fits = have.as_ref().is_some_and(|have| {
                        crate::inventory::parse_quantity(&want.value.0)
                            <= crate::inventory::parse_quantity(have)
                    });
                    if !fits {
                        out.push(format!("{} {name}: {} of {have:?}", d.name, want.value.0));
                    }
                }
            }
        }
        out
    }

    /// An engine count NVIDIA takes as the maximum over every profile: an H100 whose `+me`
    /// profile has more OFA engines than its largest profile (the GPU's own figures) offers that
    /// many, so the `+me` placements fit, in dynamic and in partitionable mode; a GPU whose
    /// profiles have none above its own keeps its counters as they were.
    #[test]
    fn engine_counters_are_the_maximum_over_every_profile() {
        let inv = load_profile("dgx-h100", "n").unwrap();
        let plain = inv.gpus[0].clone();
        assert_eq!(
            engine_totals(&plain),
            plain.engines,
            "no profile above the GPU's"
        );

        let mut gpu = plain.clone();
        assert_eq!(gpu.engines.ofa_engines, 1);
        let me = gpu
            .mig
            .profiles
            .iter_mut()
            .find(|p| p.name == "1g.10gb+me")
            .unwrap();
        me.engines.ofa_engines = 2;
        me.engines.decoders = 9;
        let totals = engine_totals(&gpu);
        assert_eq!((totals.ofa_engines, totals.decoders), (2, 9));
        assert_eq!(
            (totals.copy_engines, totals.jpeg_engines),
            (gpu.engines.copy_engines, gpu.engines.jpeg_engines)
        );

        let whole = Device {
            name: "gpu-0".into(),
            ..Default::default()
        };
        let d = dynamic(&gpu, None, whole).unwrap();
        let ofa = d.counters[0].counters.get("ofa-engines").unwrap();
        assert_eq!(ofa.value.0, "2");
        assert_eq!(over(&d.counters, &d.devices), Vec::<String>::new());
        let me_placements = d
            .devices
            .iter()
            .filter(|d| d.name.contains("-1g10gbme-"))
            .count();
        assert_eq!(me_placements, 7);

        let mut in_mig = gpu.clone();
        in_mig.mig.enabled = true;
        let p = partitioned(&in_mig, None, ConsumableShares::Disabled).unwrap();
        assert_eq!(over(&p.counters, &p.devices), Vec::<String>::new());
        let decoders = p.counters[0].counters.get("decoders").unwrap();
        assert_eq!(decoders.value.0, "9");
    }
}
