//! Assembling the pool: device order, chunking to the API's per-slice limits, and
//! [`desired_slices`].

use k8s_openapi::api::resource::v1::{
    CounterSet, Device, DeviceTaint, ResourcePool, ResourceSliceSpec,
};

use super::attributes::{
    MigShape, gpu_device, mig_device, shareable_gpu_device, shareable_mig_device,
};
use super::counters::{dynamic, dynamic_with, partitioned};
use super::{
    CounterLayout, Error, MAX_COUNTER_SETS_PER_SLICE, MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_COUNTERS_OR_TAINTS, Result, SliceOptions, TAINT_MIG_RESET_REQUIRED,
    TAINT_MIG_SWITCH_BLOCKED, Violations, sort_devices, validate, validate_pool,
};
use crate::ids::DeviceName;
use crate::inventory::{Gpu, HOPPER, Health, Holder, Inventory, SwitchBlock, TaintEffect};

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

/// The health a device of `gpu`'s counter group (partitionable or dynamic MIG) is published
/// with: the GPU's while it is not healthy; else an existing MIG device's own (the health
/// monitor's fault of its instance, or of an instance on the same memory slices:
/// `health::HealthState::apply`); else, for a placement or the whole GPU, that of an existing
/// MIG device the monitor tainted on any of its memory slices. The whole GPU of a dynamic-MIG GPU
/// takes every memory slice, so any tainted instance taints it, and a placement is tainted with
/// an instance it overlaps; MIG devices and placements on other slices stay clean. (Neither is
/// published beside an existing instance it overlaps today — `counters::dynamic`,
/// `counters::partitioned` — so the rule holds whatever those publish.)
pub(super) fn group_health<'a>(gpu: &'a Gpu, d: &Device) -> &'a Health {
    // Most publishes: nothing below the GPU is tainted, and no name is looked up.
    if !gpu.health.is_healthy() || gpu.mig.devices.iter().all(|m| m.health.is_healthy()) {
        return &gpu.health;
    }
    let name = |profile: &str, gi_profile_id, start| {
        DeviceName::mig(gpu.minor, profile, gi_profile_id, start)
    };
    if let Some(m) = gpu
        .mig
        .devices
        .iter()
        .find(|m| name(&m.profile, m.gi_profile_id, m.placement.start).as_str() == d.name)
    {
        return &m.health;
    }
    let placement = gpu.mig.profiles.iter().find_map(|p| {
        p.placements
            .iter()
            .find(|pl| name(&p.name, p.gi_profile_id, pl.start).as_str() == d.name)
    });
    match placement {
        Some(pl) => gpu
            .mig
            .devices
            .iter()
            .filter(|m| matches!(m.health, Health::Tainted { .. }))
            .find(|m| pl.overlaps(&m.placement))
            .map_or(&gpu.health, |m| &m.health),
        // Not a MIG device: the whole GPU.
        None => gpu.whole_health(),
    }
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

/// What a GPU that can switch MIG mode at run time (`--dynamic-mig`) offers now of its devices
/// that need a switch ([`needs_switch`]: its placements outside MIG mode, the whole GPU in MIG
/// mode without an instance). Its other devices are offered as ever.
enum Switch {
    /// Offered.
    Offered,
    /// Offered, tainted [`TAINT_MIG_SWITCH_BLOCKED`] with this value: a prepare met `IN_USE`
    /// ([`SwitchBlock::InUse`]), and the pod it was for is to be evicted and rescheduled.
    Tainted(Option<String>),
    /// Withdrawn: a holder blocks a switch ([`Holder::blocks_switch`]), so a claim allocated
    /// there could not be prepared; or a prepare met `IN_USE` and the server drops taints.
    /// A GPU outside MIG mode is then published whole only, as one that cannot switch.
    Withdrawn,
}

impl Switch {
    /// `None` for a GPU that cannot switch at run time ([`Gpu::mig_toggle`]). A GPU that
    /// answered `RESET_REQUIRED` ([`SwitchBlock::ResetRequired`]) is not switched again, but its
    /// devices that need a switch stay published, tainted [`RESET_REQUIRED_VALUE`], so that the
    /// claim allocated on one before the answer is evicted and allocated anew rather than left
    /// on a device that no longer exists.
    fn of(gpu: &Gpu, withdraw_blocked: bool) -> Option<Switch> {
        gpu.mig_toggle_by_hardware().ok()?;
        Some(match &gpu.mig.switch_block {
            Some(SwitchBlock::ResetRequired) if withdraw_blocked => Switch::Withdrawn,
            Some(SwitchBlock::ResetRequired) => {
                Switch::Tainted(Some(RESET_REQUIRED_VALUE.to_string()))
            }
            Some(SwitchBlock::InUse { .. }) if withdraw_blocked => Switch::Withdrawn,
            Some(SwitchBlock::InUse { holders }) => Switch::Tainted(
                holders
                    .iter()
                    .find(|h| h.blocks_switch())
                    .and_then(|h| label_value(&h.name)),
            ),
            _ if gpu.mig.holders.iter().any(Holder::blocks_switch) => Switch::Withdrawn,
            _ => Switch::Offered,
        })
    }
}

/// The value of the [`TAINT_MIG_SWITCH_BLOCKED`] taint on the devices that need a switch of a
/// GPU that answered `RESET_REQUIRED`.
const RESET_REQUIRED_VALUE: &str = "reset-required";

/// Whether `gpu` is an Ampere (or older) MIG GPU whose MIG mode change waits for a reset.
fn ampere_pending(gpu: &Gpu) -> bool {
    gpu.mig.pending.is_some() && gpu.mig.capable && gpu.cuda_compute_capability < HOPPER
}

/// Whether `d`, one of `gpu`'s devices, is a MIG placement without an instance (neither the
/// whole GPU nor an existing MIG device).
fn is_placement(gpu: &Gpu, d: &Device) -> bool {
    d.name != DeviceName::gpu(gpu.minor).as_str()
        && !gpu.mig.devices.iter().any(|m| {
            DeviceName::mig(gpu.minor, &m.profile, m.gi_profile_id, m.placement.start)
                == d.name.as_str()
        })
}

/// Whether `d`, one of a dynamic-MIG `gpu`'s devices, needs a MIG mode switch to be prepared:
/// a placement while the GPU is outside MIG mode, the whole GPU while it is in MIG mode (it is
/// published then only without an instance).
fn needs_switch(gpu: &Gpu, d: &Device) -> bool {
    let whole = d.name == DeviceName::gpu(gpu.minor).as_str();
    whole == gpu.in_mig_mode()
}

/// `d` with the [`TAINT_MIG_SWITCH_BLOCKED`] taint (`NoExecute`) added, after any other.
fn switch_blocked(mut d: Device, value: &Option<String>, driver: &str) -> Device {
    d.taints.get_or_insert_with(Vec::new).push(DeviceTaint {
        key: format!("{driver}/{TAINT_MIG_SWITCH_BLOCKED}"),
        value: value.clone(),
        effect: TaintEffect::NoExecute.as_str().to_string(),
        time_added: None,
    });
    d
}

/// The longest label value.
const MAX_LABEL_VALUE: usize = 63;

/// `name` (a process name) as a label value, which a taint's value must be: each character
/// outside `[A-Za-z0-9._-]` replaced by `-`, at most 63 characters, beginning and ending with a
/// letter or digit; `None` when nothing is left.
pub(super) fn label_value(name: &str) -> Option<String> {
    let mapped: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    let edge = |c: char| !c.is_ascii_alphanumeric();
    let start = mapped.trim_start_matches(edge);
    // ASCII only now: a byte is a character.
    let cut = &start[..start.len().min(MAX_LABEL_VALUE)];
    let value = cut.trim_end_matches(edge);
    (!value.is_empty()).then(|| value.to_string())
}

/// A device that a GPU able to switch MIG mode at run time would offer, withdrawn from the
/// slices because a process holding the GPU blocks the switch the device needs: what
/// `nvdra match` names for a claim that it would fit.
#[derive(Debug, Clone, PartialEq)]
pub struct Withdrawn {
    /// The device as it would be published, less its counter consumption (its GPU's counter
    /// set may not be published).
    pub device: Device,
    /// Why, naming the holders: `placements of gpu-0 withdrawn: held by pid 4242
    /// (nv-hostengine), which blocks a MIG mode switch`.
    pub reason: String,
}

/// The devices that [`desired_slices`] leaves out of `inv`'s slices because holders block the
/// switch they need, each with why. Empty without `dynamic_mig`.
pub fn withdrawn_devices(inv: &Inventory, opts: &SliceOptions) -> Result<Vec<Withdrawn>> {
    let mut out = Vec::new();
    if !opts.dynamic_mig {
        return Ok(out);
    }
    for gpu in inv.gpus.iter().filter(|g| !g.health.is_withdrawn()) {
        let Some(Switch::Withdrawn) = Switch::of(gpu, false) else {
            continue;
        };
        let holders: Vec<String> = gpu
            .mig
            .holders
            .iter()
            .filter(|h| h.blocks_switch())
            .map(ToString::to_string)
            .collect();
        let what = if gpu.in_mig_mode() {
            format!("gpu-{} withdrawn whole", gpu.minor)
        } else {
            format!("placements of gpu-{} withdrawn", gpu.minor)
        };
        let reason = format!(
            "{what}: held by {}, which {} a MIG mode switch",
            holders.join(", "),
            if holders.len() == 1 {
                "blocks"
            } else {
                "block"
            }
        );
        let whole =
            shareable_gpu_device(gpu, opts.shared_capacity).unwrap_or_else(|| gpu_device(gpu));
        for mut d in dynamic(gpu, opts.mig_profiles.as_deref(), whole)?.devices {
            if needs_switch(gpu, &d) {
                d.consumes_counters = None;
                out.push(Withdrawn {
                    device: tainted(d, &gpu.health, &opts.driver),
                    reason: reason.clone(),
                });
            }
        }
    }
    Ok(out)
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
    desired_slices_withdrawing(inv, opts, false)
}

/// [`desired_slices`] for a server that drops device taints (`withdraw_blocked`): the devices
/// of a GPU that would be tainted [`TAINT_MIG_SWITCH_BLOCKED`] are withdrawn instead, as those
/// of a GPU whose holders block a switch are.
pub fn desired_slices_withdrawing(
    inv: &Inventory,
    opts: &SliceOptions,
    withdraw_blocked: bool,
) -> Result<Vec<ResourceSliceSpec>> {
    let healthy = inv.gpus.iter().filter(|g| !g.health.is_withdrawn());
    let driver = opts.driver.as_str();
    // GPUs whose devices draw on shared counters, and devices that stand alone.
    let mut groups = Vec::new();
    let mut plain = Vec::new();
    let allowed = opts.mig_profiles.as_deref();
    for gpu in healthy {
        // With dynamic MIG: whether this GPU switches mode, and what it offers of the devices
        // that need a switch now.
        let switch = opts
            .dynamic_mig
            .then(|| Switch::of(gpu, withdraw_blocked))
            .flatten();
        // An Ampere GPU whose change waits for a reset: its placements are tainted.
        let reset = opts.dynamic_mig && ampere_pending(gpu);
        let whole =
            || shareable_gpu_device(gpu, opts.shared_capacity).unwrap_or_else(|| gpu_device(gpu));
        let group = if let Some(Switch::Offered | Switch::Tainted(_)) = switch {
            dynamic(gpu, allowed, whole())?
        } else if switch.is_some() && gpu.in_mig_mode() {
            // Withdrawn in MIG mode: the placements stay, the whole GPU goes.
            dynamic_with(gpu, allowed, None)?
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
                plain.push(tainted(dev, health, driver));
            }
            continue;
        } else {
            // Also a GPU outside MIG mode whose placements are withdrawn: whole only.
            plain.push(tainted(whole(), &gpu.health, driver));
            continue;
        };
        let blocked = match &switch {
            Some(Switch::Tainted(value)) => Some(value),
            _ => None,
        };
        let mut g = group;
        g.devices = g
            .devices
            .into_iter()
            .map(|d| {
                let health = group_health(gpu, &d);
                let placement = reset && is_placement(gpu, &d);
                let d = reset_required(tainted(d, health, driver), placement, driver);
                match blocked {
                    Some(value) if needs_switch(gpu, &d) => switch_blocked(d, value, driver),
                    _ => d,
                }
            })
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
