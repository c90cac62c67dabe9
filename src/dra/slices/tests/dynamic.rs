//! Dynamic MIG tests: a GPU that can switch MIG mode offered whole and in every placement on one
//! counter set; the allowlist; shares; GPUs that cannot switch (a passthrough H100 can); a
//! pending mode change; holders that block a switch, and a switch that met `IN_USE`.

use super::taints::tainted;
use super::*;
use crate::inventory::{
    Gpu, Holder, HolderKind, SwitchBlock, TaintEffect, TaintKey, Virtualization,
};

fn dynamic(layout: CounterLayout) -> SliceOptions {
    SliceOptions {
        dynamic_mig: true,
        ..opts(false, layout)
    }
}

fn allowing(list: &[&str]) -> SliceOptions {
    SliceOptions {
        mig_profiles: Some(list.iter().map(|s| s.to_string()).collect()),
        ..dynamic(CounterLayout::Separate)
    }
}

/// Devices of GPU `minor`: `gpu-<minor>` and its MIG devices.
fn of_gpu(specs: &[ResourceSliceSpec], minor: u32) -> Vec<&Device> {
    let whole = format!("gpu-{minor}");
    let mig = format!("gpu-{minor}-mig-");
    all_devices(specs)
        .into_iter()
        .filter(|d| d.name == whole || d.name.starts_with(&mig))
        .collect()
}

fn counter_sets(specs: &[ResourceSliceSpec]) -> Vec<&CounterSet> {
    specs
        .iter()
        .flat_map(|s| s.shared_counters.iter().flatten())
        .collect()
}

/// A MIG device of `gpu` at placement `index` of its profile `name`, as NVML would list it.
fn instance(gpu: &Gpu, name: &str, index: usize) -> MigDevice {
    let p = gpu.mig.profiles.iter().find(|p| p.name == name).unwrap();
    MigDevice {
        uuid: MigUuid(format!("MIG-{}-{name}-{index}", gpu.minor)),
        profile: p.name.clone(),
        gi_profile_id: p.gi_profile_id,
        gi_id: 1 + index as u32,
        ci_id: 0,
        placement: p.placements[index],
        memory_bytes: p.memory_bytes,
        multiprocessors: p.multiprocessors,
        engines: p.engines,
        health: Health::Healthy,
    }
}

#[test]
fn dgx_h100_publishes_each_gpu_whole_and_in_every_placement_on_one_counter_set() {
    let inv = profile("dgx-h100");
    assert!(inv.gpus.iter().all(|g| g.mig_toggle().is_ok()));
    let plain_specs = desired_slices(&inv, &plain()).unwrap();
    // The placements are the ones `--partitionable` publishes for the GPU in MIG mode.
    let partitioned =
        desired_slices(&in_mig_mode(inv.clone()), &opts(true, Default::default())).unwrap();
    for layout in [CounterLayout::Separate, CounterLayout::Together] {
        let specs = desired_slices(&inv, &dynamic(layout)).unwrap();
        let sets = counter_sets(&specs);
        assert_eq!(sets.len(), 8, "{layout:?}");
        for g in &inv.gpus {
            let per_gpu: usize = g.mig.profiles.iter().map(|p| p.placements.len()).sum();
            assert_eq!(per_gpu, 25);
            let mine = of_gpu(&specs, g.minor);
            assert_eq!(mine.len(), 1 + per_gpu, "{layout:?}");
            let mut placements: Vec<&str> = mine
                .iter()
                .map(|d| d.name.as_str())
                .filter(|n| n.contains("-mig-"))
                .collect();
            placements.sort_unstable();
            let mut want: Vec<&str> = of_gpu(&partitioned, g.minor)
                .iter()
                .map(|d| d.name.as_str())
                .collect();
            want.sort_unstable();
            assert_eq!(placements, want);

            let set_name = counter_set_name(g.minor);
            let set = sets.iter().find(|s| s.name == set_name).unwrap();
            for d in &mine {
                let c = d.consumes_counters.as_ref().unwrap();
                assert_eq!(c.len(), 1, "{}: one set", d.name);
                assert_eq!(c[0].counter_set, set_name);
            }
            // The whole GPU consumes every counter of its set, all of each, and is otherwise
            // the device published without the switch.
            let whole = device(&specs, &format!("gpu-{}", g.minor));
            assert_eq!(
                whole.consumes_counters.as_ref().unwrap()[0].counters,
                set.counters
            );
            let mut bare = whole.clone();
            bare.consumes_counters = None;
            assert_eq!(&bare, device(&plain_specs, &whole.name));
        }
    }
    // Together (1.34): one slice per GPU with its set and its 26 devices.
    let together = desired_slices(&inv, &dynamic(CounterLayout::Together)).unwrap();
    assert_eq!(together.len(), 8);
    assert!(
        together
            .iter()
            .all(|s| s.shared_counters.as_ref().unwrap().len() == 1
                && s.devices.as_ref().unwrap().len() == 26)
    );
}

#[test]
fn only_counters_that_can_run_short_are_kept() {
    let specs = desired_slices(&profile("dgx-h100"), &dynamic(CounterLayout::Separate)).unwrap();
    let set = counter_sets(&specs)
        .into_iter()
        .find(|s| s.name == "gpu-0-counter-set")
        .unwrap();
    let kept: Vec<&str> = set.counters.keys().map(String::as_str).collect();
    // Two `+me` placements would want two OFA engines; memory, SMs, copy engines, decoders and
    // JPEG engines never run short before the memory slices do; slice 7 is reached only by
    // devices that also take slice 6.
    assert_eq!(
        kept,
        [
            "memory-slice-0",
            "memory-slice-1",
            "memory-slice-2",
            "memory-slice-3",
            "memory-slice-4",
            "memory-slice-5",
            "memory-slice-6",
            "ofa-engines"
        ]
    );
    assert_eq!(set.counters["ofa-engines"].value.0, "1");
    let c = |n: &str| {
        consumed(device(&specs, n))
            .into_keys()
            .map(|(_, k)| k)
            .collect::<Vec<_>>()
    };
    assert_eq!(c("gpu-0-mig-1g10gb-19-3"), ["memory-slice-3"]);
    assert_eq!(
        c("gpu-0-mig-1g10gbme-20-3"),
        ["memory-slice-3", "ofa-engines"]
    );
    assert_eq!(c("gpu-0-mig-1g20gb-15-6"), ["memory-slice-6"]);
    assert_eq!(
        c("gpu-0-mig-3g40gb-9-4"),
        ["memory-slice-4", "memory-slice-5", "memory-slice-6"]
    );
}

/// Every set of devices the scheduler may allocate together: all sets that fit `model` (the
/// devices' consumption and the set's counters), found by adding devices in order.
fn fitting_sets(devices: &[Device], model: &dyn Fn(&[usize]) -> bool) -> Vec<Vec<usize>> {
    fn walk(
        i: usize,
        n: usize,
        chosen: &mut Vec<usize>,
        model: &dyn Fn(&[usize]) -> bool,
        out: &mut Vec<Vec<usize>>,
    ) {
        if i == n {
            out.push(chosen.clone());
            return;
        }
        walk(i + 1, n, chosen, model, out);
        chosen.push(i);
        if model(chosen) {
            walk(i + 1, n, chosen, model, out);
        }
        chosen.pop();
    }
    let mut out = Vec::new();
    walk(0, devices.len(), &mut Vec::new(), model, &mut out);
    out
}

/// Whether devices `chosen` fit the counters `sets`, each device consuming `consumes(d)`.
fn fits(
    chosen: &[usize],
    sets: &BTreeMap<String, u128>,
    consumes: &dyn Fn(usize) -> BTreeMap<String, u128>,
) -> bool {
    let mut used: BTreeMap<String, u128> = BTreeMap::new();
    for &d in chosen {
        for (k, v) in consumes(d) {
            *used.entry(k).or_default() += v;
        }
    }
    used.iter()
        .all(|(k, v)| *v <= sets.get(k).copied().unwrap_or(0))
}

fn bytes(q: &str) -> u128 {
    crate::inventory::parse_quantity(q).unwrap() as u128
}

/// The dynamic-MIG counters allow exactly the combinations NVIDIA's full counters allow (every
/// resource and every memory slice, the whole GPU consuming all of them): fewer counters, the
/// same exclusions. Checked on every set of devices one GPU offers, for H100 and H200, for an
/// A100 that could toggle (another profile table), with an allowlist and with a MIG device
/// already there.
#[test]
fn the_kept_counters_exclude_exactly_what_all_counters_exclude() {
    let mut a100 = profile("dgx-a100");
    for g in &mut a100.gpus {
        g.cuda_compute_capability = crate::inventory::HOPPER;
    }
    let mut occupied = profile("dgx-h100");
    let i = instance(&occupied.gpus[0], "2g.20gb", 1);
    occupied.gpus[0].mig.enabled = true;
    occupied.gpus[0].mig.devices.push(i);
    let cases: Vec<(&str, Inventory, SliceOptions)> = vec![
        (
            "h100",
            profile("dgx-h100"),
            dynamic(CounterLayout::Separate),
        ),
        (
            "h200",
            profile("hgx-h200"),
            dynamic(CounterLayout::Separate),
        ),
        ("a100 as if Hopper", a100, dynamic(CounterLayout::Separate)),
        (
            "h100 1g+3g",
            profile("dgx-h100"),
            allowing(&["1g.10gb", "3g.40gb"]),
        ),
        (
            "h100 with 2g at 2",
            occupied,
            dynamic(CounterLayout::Separate),
        ),
    ];
    for (what, inv, o) in cases {
        let g = &inv.gpus[0];
        let specs = desired_slices(&inv, &o).unwrap();
        let devices: Vec<Device> = of_gpu(&specs, 0).into_iter().cloned().collect();
        let set = counter_sets(&specs)
            .into_iter()
            .find(|s| s.name == "gpu-0-counter-set")
            .unwrap();
        let kept: BTreeMap<String, u128> = set
            .counters
            .iter()
            .map(|(k, v)| (k.clone(), bytes(&v.value.0)))
            .collect();
        let kept_use = |d: usize| -> BTreeMap<String, u128> {
            consumed(&devices[d])
                .into_iter()
                .map(|((_, k), v)| (k, bytes(&v)))
                .collect()
        };
        // All counters, NVIDIA's way: the GPU's resources and every memory slice; a MIG device
        // takes its capacities and its slices, the whole GPU everything.
        let mut all: BTreeMap<String, u128> = BTreeMap::new();
        all.insert("memory".into(), g.memory_bytes as u128);
        let e = &g.engines;
        for (k, v) in [
            ("multiprocessors", g.multiprocessors.unwrap()),
            ("copy-engines", e.copy_engines),
            ("decoders", e.decoders),
            ("encoders", e.encoders),
            ("jpeg-engines", e.jpeg_engines),
            ("ofa-engines", e.ofa_engines),
        ] {
            all.insert(k.into(), v as u128);
        }
        for s in 0..g.mig.memory_slices {
            all.insert(format!("memory-slice-{s}"), 1);
        }
        let all_use = |d: usize| -> BTreeMap<String, u128> {
            let dev = &devices[d];
            if !dev.name.contains("-mig-") {
                return all.clone();
            }
            let caps = dev.capacity.as_ref().unwrap();
            let cap = |n: &str| bytes(&caps[n].value.0);
            let mut u: BTreeMap<String, u128> = [
                ("memory", cap("memory")),
                ("multiprocessors", cap("multiprocessors")),
                ("copy-engines", cap("copyEngines")),
                ("decoders", cap("decoders")),
                ("encoders", cap("encoders")),
                ("jpeg-engines", cap("jpegEngines")),
                ("ofa-engines", cap("ofaEngines")),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            for k in caps.keys().filter_map(|k| k.strip_prefix("memorySlice")) {
                u.insert(format!("memory-slice-{k}"), 1);
            }
            u
        };
        let by_kept = fitting_sets(&devices, &|c| fits(c, &kept, &kept_use));
        let by_all = fitting_sets(&devices, &|c| fits(c, &all, &all_use));
        assert!(
            by_kept.len() > devices.len(),
            "{what}: more than singletons"
        );
        let named = |sets: &[Vec<usize>], other: &[Vec<usize>]| -> Vec<Vec<&str>> {
            sets.iter()
                .filter(|s| !other.contains(s))
                .take(3)
                .map(|s| s.iter().map(|&d| devices[d].name.as_str()).collect())
                .collect()
        };
        let (only_kept, only_all) = (named(&by_kept, &by_all), named(&by_all, &by_kept));
        assert!(
            only_kept.is_empty() && only_all.is_empty(),
            "{what}: allowed by the kept counters only: {only_kept:?}; by all only: {only_all:?}"
        );
        // And the kept counters are fewer.
        let entries = |u: &dyn Fn(usize) -> BTreeMap<String, u128>| -> usize {
            (0..devices.len()).map(|d| u(d).len()).sum()
        };
        assert!(entries(&kept_use) < entries(&all_use), "{what}");
    }
}

#[test]
fn the_allowlist_cuts_placements_but_never_existing_devices() {
    let inv = profile("dgx-h100");
    let specs = desired_slices(&inv, &allowing(&["1g.10gb", "3g.40gb"])).unwrap();
    for g in &inv.gpus {
        assert_eq!(of_gpu(&specs, g.minor).len(), 1 + 7 + 2);
    }
    assert!(
        names(&specs).iter().all(|n| !n.contains("-mig-")
            || n.contains("-mig-1g10gb-")
            || n.contains("-mig-3g40gb-"))
    );

    // A 2g.20gb instance (not on the list) on GPU 0: published, as are the allowed placements
    // beside it; those it overlaps and the whole GPU are not.
    let mut occupied = inv.clone();
    let i = instance(&occupied.gpus[0], "2g.20gb", 0);
    occupied.gpus[0].mig.enabled = true;
    occupied.gpus[0].mig.devices.push(i);
    let specs = desired_slices(&occupied, &allowing(&["1g.10gb", "3g.40gb"])).unwrap();
    let mut mine: Vec<String> = of_gpu(&specs, 0).iter().map(|d| d.name.clone()).collect();
    mine.sort();
    assert_eq!(
        mine,
        [
            "gpu-0-mig-1g10gb-19-2",
            "gpu-0-mig-1g10gb-19-3",
            "gpu-0-mig-1g10gb-19-4",
            "gpu-0-mig-1g10gb-19-5",
            "gpu-0-mig-1g10gb-19-6",
            "gpu-0-mig-2g20gb-14-0",
            "gpu-0-mig-3g40gb-9-4",
        ]
    );
    // Nothing published overlaps the instance or the 1g devices on slices 2 and 3, so they
    // consume nothing; the 3g placement keeps apart from the 1g devices on slices 4 to 6.
    for n in [
        "gpu-0-mig-2g20gb-14-0",
        "gpu-0-mig-1g10gb-19-2",
        "gpu-0-mig-1g10gb-19-3",
    ] {
        assert!(device(&specs, n).consumes_counters.is_none(), "{n}");
    }
    let slices_of = |n: &str| -> Vec<String> {
        consumed(device(&specs, n))
            .into_keys()
            .map(|(_, k)| k)
            .collect()
    };
    assert_eq!(
        slices_of("gpu-0-mig-3g40gb-9-4"),
        ["memory-slice-4", "memory-slice-5", "memory-slice-6"]
    );
    assert_eq!(slices_of("gpu-0-mig-1g10gb-19-5"), ["memory-slice-5"]);

    // `--partitionable` follows the list too.
    let part = SliceOptions {
        mig_profiles: Some(vec!["3g.40gb".into()]),
        ..opts(true, CounterLayout::Separate)
    };
    let specs = desired_slices(&mig_ready("dgx-a100"), &part).unwrap();
    assert_eq!(names(&specs).len(), 8 * 2);

    // Names no GPU has are no error: the GPU is then offered whole only, with nothing to count
    // (the daemon names them at start).
    let list = ["1g.10gb".to_string(), "9g.999gb".to_string()];
    assert_eq!(unlisted_profiles(&inv, &list), ["9g.999gb"]);
    let specs = desired_slices(&inv, &allowing(&["9g.999gb"])).unwrap();
    assert_eq!(
        names(&specs),
        (0..8).map(|i| format!("gpu-{i}")).collect::<Vec<_>>()
    );
    assert!(counter_sets(&specs).is_empty());
    assert!(
        all_devices(&specs)
            .iter()
            .all(|d| d.consumes_counters.is_none())
    );
}

/// With `--shared-capacity` the whole GPU is the shareable device and consumes the GPU's
/// counters (the scheduler charges them once, at the first share); the placements are the
/// same as without shares.
#[test]
fn with_shares_the_whole_gpu_is_the_shareable_device_and_consumes_the_counters() {
    let inv = profile("dgx-h100");
    let both = SliceOptions {
        shared_capacity: ConsumableShares::Memory,
        ..dynamic(CounterLayout::Separate)
    };
    let specs = desired_slices(&inv, &both).unwrap();
    let alone = desired_slices(&inv, &dynamic(CounterLayout::Separate)).unwrap();
    let shareable = desired_slices(&inv, &shared(false)).unwrap();
    assert_eq!(names(&specs), names(&alone));
    for g in &inv.gpus {
        let name = format!("gpu-{}", g.minor);
        let whole = device(&specs, &name);
        assert_eq!(whole.allow_multiple_allocations, Some(true));
        assert_eq!(
            whole.consumes_counters,
            device(&alone, &name).consumes_counters
        );
        let mut bare = whole.clone();
        bare.consumes_counters = None;
        assert_eq!(&bare, device(&shareable, &name));
        for d in of_gpu(&specs, g.minor).iter().filter(|d| d.name != name) {
            assert_eq!(*d, device(&alone, &d.name));
            assert_eq!(d.allow_multiple_allocations, None);
        }
    }
}

#[test]
fn gpus_that_cannot_switch_are_published_as_without_the_switch() {
    for (name, partitionable) in [
        ("dgx-a100", false),
        ("dgx-a100-mig", false),
        ("dgx-a100-mig", true),
        ("a100-mig-mixed", true),
        ("l40s-pcie", false),
        ("pcie-pairs", false),
    ] {
        let inv = profile(name);
        assert!(inv.gpus.iter().all(|g| g.mig_toggle().is_err()), "{name}");
        let without = desired_slices(&inv, &opts(partitionable, CounterLayout::Separate)).unwrap();
        let with = desired_slices(
            &inv,
            &SliceOptions {
                dynamic_mig: true,
                ..opts(partitionable, CounterLayout::Separate)
            },
        )
        .unwrap();
        assert_eq!(with, without, "{name} partitionable={partitionable}");
    }
    // A passthrough A100 (a cloud A100) neither: its switch waits for a reset.
    for name in ["dgx-a100", "dgx-a100-mig"] {
        let mut vm = profile(name);
        for g in &mut vm.gpus {
            g.virtualization = Some(Virtualization::Passthrough);
        }
        let specs = desired_slices(&vm, &dynamic(CounterLayout::Separate)).unwrap();
        assert_eq!(specs, desired_slices(&vm, &plain()).unwrap(), "{name}");
        assert!(all_devices(&specs).iter().all(|d| d.taints.is_none()));
    }
    // A Hopper GPU in a vGPU guest, or serving vGPUs, cannot either.
    for v in [
        Virtualization::VgpuGuest,
        Virtualization::VgpuHost,
        Virtualization::VsgaHost,
    ] {
        let mut vm = profile("dgx-h100");
        for g in &mut vm.gpus {
            g.virtualization = Some(v);
        }
        assert_eq!(
            desired_slices(&vm, &dynamic(CounterLayout::Separate)).unwrap(),
            desired_slices(&vm, &plain()).unwrap(),
            "{v}"
        );
    }
}

/// A cloud H100 is a passthrough VM, and switches as on bare metal: it is published whole and
/// in every placement, exactly as bare metal is, and nothing is tainted.
#[test]
fn a_passthrough_h100_is_published_as_on_bare_metal() {
    let bare = profile("dgx-h100");
    let mut vm = bare.clone();
    for g in &mut vm.gpus {
        g.virtualization = Some(Virtualization::Passthrough);
    }
    assert!(vm.gpus.iter().all(|g| g.mig_toggle().is_ok()));
    for layout in [CounterLayout::Separate, CounterLayout::Together] {
        let specs = desired_slices(&vm, &dynamic(layout)).unwrap();
        assert_eq!(specs, desired_slices(&bare, &dynamic(layout)).unwrap());
        assert_eq!(of_gpu(&specs, 0).len(), 26, "whole and 25 placements");
        assert!(all_devices(&specs).iter().all(|d| d.taints.is_none()));
    }
}

fn taint_triples(d: &Device) -> Vec<(String, Option<String>, String)> {
    d.taints
        .iter()
        .flatten()
        .map(|t| (t.key.clone(), t.value.clone(), t.effect.clone()))
        .collect()
}

/// A Hopper GPU whose MIG mode change is pending is published by its current mode, and nothing
/// of it is tainted `mig-reset-required` (the plugin withdraws the change, and the GPU is
/// offered both ways again at the next read); a health taint stays.
#[test]
fn a_pending_change_on_hopper_is_published_as_is_untainted() {
    let key = format!("{DRIVER}/{TAINT_MIG_RESET_REQUIRED}");
    let mut inv = profile("dgx-h100");
    inv.gpus[0].mig.pending = Some(true);
    inv.gpus[1].mig.pending = Some(true);
    inv.gpus[1].health = tainted(TaintKey::Xid(79), TaintEffect::NoExecute);
    // GPU 2 is in MIG mode with an instance, pending off.
    let i = instance(&inv.gpus[2], "3g.40gb", 0);
    inv.gpus[2].mig.enabled = true;
    inv.gpus[2].mig.pending = Some(false);
    inv.gpus[2].mig.devices.push(i);
    // GPU 3 is in a passthrough VM, pending on.
    inv.gpus[3].virtualization = Some(Virtualization::Passthrough);
    inv.gpus[3].mig.pending = Some(true);
    let specs = desired_slices(&inv, &dynamic(CounterLayout::Separate)).unwrap();
    for minor in [0, 3] {
        let mine = of_gpu(&specs, minor);
        assert_eq!(mine.len(), 1, "whole, as its mode offers");
        assert!(mine[0].taints.is_none());
        assert!(mine[0].consumes_counters.is_none());
    }
    assert_eq!(
        taint_triples(device(&specs, "gpu-1")),
        [(
            format!("{DRIVER}/xid"),
            Some("79".into()),
            "NoExecute".into()
        )]
    );
    let mig: Vec<&Device> = of_gpu(&specs, 2);
    assert_eq!(
        mig.iter().map(|d| d.name.as_str()).collect::<Vec<_>>(),
        ["gpu-2-mig-3g40gb-9-0"]
    );
    assert!(mig[0].taints.is_none());
    // `--partitionable` governs it as without the switch: the free placements too, untainted.
    let part = desired_slices(
        &inv,
        &SliceOptions {
            partitionable: true,
            ..dynamic(CounterLayout::Separate)
        },
    )
    .unwrap();
    let gpu2 = of_gpu(&part, 2);
    assert!(gpu2.len() > 1);
    assert!(gpu2.iter().all(|d| d.taints.is_none()));
    // The others are offered both ways, untainted.
    for minor in 4..8 {
        let mine = of_gpu(&specs, minor);
        assert_eq!(mine.len(), 26);
        assert!(mine.iter().all(|d| d.taints.is_none()));
    }
    for s in [&specs, &part] {
        assert!(
            all_devices(s)
                .iter()
                .flat_map(|d| d.taints.iter().flatten())
                .all(|t| t.key != key)
        );
    }
}

/// An Ampere GPU whose MIG mode change waits for a reset (on bare metal or passed through):
/// with `--dynamic-mig --partitionable` only its placements, which need an instance created,
/// are tainted `mig-reset-required:NoSchedule`; its whole device and existing MIG devices never
/// are. Without `--dynamic-mig` nothing is.
#[test]
fn a_pending_change_on_ampere_taints_only_its_placements() {
    let key = format!("{DRIVER}/{TAINT_MIG_RESET_REQUIRED}");
    let reset = (key.clone(), None, "NoSchedule".to_string());
    for passthrough in [false, true] {
        let mut inv = profile("a100-mig-mixed");
        for g in &mut inv.gpus {
            g.mig.pending = Some(!g.mig.enabled);
            if passthrough {
                g.virtualization = Some(Virtualization::Passthrough);
            }
        }
        let existing: BTreeSet<String> = inv
            .gpus
            .iter()
            .flat_map(|g| {
                g.mig.devices.iter().map(|m| {
                    DeviceName::mig(g.minor, &m.profile, m.gi_profile_id, m.placement.start)
                        .as_str()
                        .to_string()
                })
            })
            .collect();
        let both = SliceOptions {
            partitionable: true,
            ..dynamic(CounterLayout::Separate)
        };
        let specs = desired_slices(&inv, &both).unwrap();
        let (mut placements, mut others) = (0, 0);
        for d in all_devices(&specs) {
            if d.name.contains("-mig-") && !existing.contains(&d.name) {
                assert_eq!(taint_triples(d), std::slice::from_ref(&reset), "{}", d.name);
                placements += 1;
            } else {
                assert!(d.taints.is_none(), "{}", d.name);
                others += 1;
            }
        }
        assert!(placements > 0 && others > 0, "{placements} {others}");
        assert!(
            device(&specs, "gpu-0").taints.is_none(),
            "whole, never tainted"
        );
        // Only the taint differs from `--partitionable` alone, which taints nothing.
        let part = desired_slices(&inv, &opts(true, CounterLayout::Separate)).unwrap();
        assert_eq!(names(&part), names(&specs));
        assert!(all_devices(&part).iter().all(|d| d.taints.is_none()));
        // Without `--partitionable` there are no placements, so nothing is tainted.
        let no_part = desired_slices(&inv, &dynamic(CounterLayout::Separate)).unwrap();
        assert!(all_devices(&no_part).iter().all(|d| d.taints.is_none()));
    }
}

fn holder(pid: u32, name: &str, kind: HolderKind) -> Holder {
    Holder {
        pid,
        name: name.into(),
        kind,
    }
}

/// `inv` without holders or switch blocks.
fn unblocked(inv: &Inventory) -> Inventory {
    let mut inv = inv.clone();
    for g in &mut inv.gpus {
        g.mig.holders.clear();
        g.mig.switch_block = None;
    }
    inv
}

fn dcgm() -> Holder {
    holder(4242, "nv-hostengine", HolderKind::Foreign)
}

/// A holder that blocks a switch on a GPU that could switch withdraws the devices that need
/// one: outside MIG mode its placements (the GPU is then published whole only, as one that
/// cannot switch); in MIG mode without an instance, its whole device (the placements stay).
/// Holders that do not block one (persistenced, nvdra's own MPS, which it waits for) withdraw
/// nothing; [`withdrawn_devices`] names what went and why. Without `--dynamic-mig` holders
/// change nothing.
#[test]
fn a_holder_that_blocks_a_switch_withdraws_the_devices_that_need_one() {
    let base = profile("dgx-h100");
    let o = dynamic(CounterLayout::Separate);
    let before = desired_slices(&base, &o).unwrap();
    let mut inv = base.clone();
    let persistenced = holder(17, "nvidia-persistenced", HolderKind::Harmless);
    inv.gpus[0].mig.holders = vec![persistenced.clone(), dcgm()];
    let mps = holder(5000, "nvidia-cuda-mps-server", HolderKind::OwnMps);
    inv.gpus[1].mig.holders = vec![persistenced, mps];
    inv.gpus[2].mig.enabled = true;
    inv.gpus[2].mig.holders = vec![dcgm()];
    let specs = desired_slices(&inv, &o).unwrap();

    let gpu0 = of_gpu(&specs, 0);
    assert_eq!(gpu0.len(), 1, "whole only");
    let plain_specs = desired_slices(&base, &plain()).unwrap();
    assert_eq!(
        gpu0[0],
        device(&plain_specs, "gpu-0"),
        "as without the switch"
    );
    assert_eq!(of_gpu(&specs, 1), of_gpu(&before, 1), "not blocking");
    let gpu2: BTreeSet<&str> = of_gpu(&specs, 2).iter().map(|d| d.name.as_str()).collect();
    let mut want: BTreeSet<&str> = of_gpu(&before, 2).iter().map(|d| d.name.as_str()).collect();
    assert!(want.remove("gpu-2"));
    assert_eq!(gpu2, want, "the placements stay, the whole GPU goes");
    for minor in 3..8 {
        assert_eq!(of_gpu(&specs, minor), of_gpu(&before, minor));
    }
    assert!(all_devices(&specs).iter().all(|d| d.taints.is_none()));
    assert_eq!(counter_sets(&specs).len(), 7, "gpu-0's counter set is gone");

    let w = withdrawn_devices(&inv, &o).unwrap();
    let of = |minor: u32| -> Vec<&Withdrawn> {
        let prefix = format!("gpu-{minor}");
        w.iter()
            .filter(|x| x.device.name == prefix || x.device.name.starts_with(&format!("{prefix}-")))
            .collect()
    };
    let w0 = of(0);
    assert_eq!(w0.len(), 25);
    assert!(w0.iter().all(|x| x.device.name.contains("-mig-")
        && x.reason
            == "placements of gpu-0 withdrawn: held by pid 4242 (nv-hostengine), which blocks \
                a MIG mode switch"));
    let w2 = of(2);
    assert_eq!(w2.len(), 1);
    assert_eq!(w2[0].device.name, "gpu-2");
    assert_eq!(
        w2[0].reason,
        "gpu-2 withdrawn whole: held by pid 4242 (nv-hostengine), which blocks a MIG mode switch"
    );
    assert_eq!(w.len(), 26, "nothing of the other GPUs");
    assert!(w.iter().all(|x| x.device.consumes_counters.is_none()));

    assert_eq!(
        desired_slices(&inv, &plain()).unwrap(),
        desired_slices(&unblocked(&inv), &plain()).unwrap()
    );
    assert!(withdrawn_devices(&inv, &plain()).unwrap().is_empty());
}

/// After a prepare met `IN_USE` on a GPU that can switch, its devices that need a switch are
/// published tainted `mig-switch-blocked:NoExecute`, valued with the first holder that blocks a
/// switch, so that the pod allocated there is evicted (a withdrawn device could not be
/// tainted): this overrides withdrawal by holders. Where the server drops taints they are
/// withdrawn instead. A GPU whose switch answered `RESET_REQUIRED` is published as one that
/// cannot switch, untainted.
#[test]
fn a_switch_that_met_in_use_taints_the_devices_that_need_one_no_execute() {
    let key = format!("{DRIVER}/{TAINT_MIG_SWITCH_BLOCKED}");
    let o = dynamic(CounterLayout::Separate);
    let base = profile("dgx-h100");
    let before = desired_slices(&base, &o).unwrap();
    let mut inv = base.clone();
    let mps = holder(5000, "nvidia-cuda-mps-server", HolderKind::OwnMps);
    inv.gpus[0].mig.switch_block = Some(SwitchBlock::InUse {
        holders: vec![mps, dcgm()],
    });
    inv.gpus[0].mig.holders = vec![dcgm()];
    inv.gpus[1].mig.enabled = true;
    inv.gpus[1].mig.switch_block = Some(SwitchBlock::InUse {
        holders: vec![holder(77, "", HolderKind::Foreign)],
    });
    // GPU 2 has an instance: none of its devices needs a switch.
    let i = instance(&inv.gpus[2], "1g.10gb", 0);
    inv.gpus[2].mig.enabled = true;
    inv.gpus[2].mig.devices.push(i);
    inv.gpus[2].mig.switch_block = Some(SwitchBlock::InUse {
        holders: vec![dcgm()],
    });
    inv.gpus[3].mig.switch_block = Some(SwitchBlock::ResetRequired);
    let specs = desired_slices(&inv, &o).unwrap();

    let gpu0 = of_gpu(&specs, 0);
    assert_eq!(gpu0.len(), 26, "offered, not withdrawn");
    for d in gpu0 {
        if d.name == "gpu-0" {
            assert!(d.taints.is_none(), "the whole GPU needs no switch");
        } else {
            assert_eq!(
                taint_triples(d),
                [(
                    key.clone(),
                    Some("nv-hostengine".into()),
                    "NoExecute".into()
                )],
                "{}",
                d.name
            );
        }
    }
    let gpu1 = of_gpu(&specs, 1);
    assert_eq!(gpu1.len(), 26);
    for d in gpu1 {
        if d.name == "gpu-1" {
            assert_eq!(taint_triples(d), [(key.clone(), None, "NoExecute".into())]);
        } else {
            assert!(d.taints.is_none(), "{}", d.name);
        }
    }
    assert!(of_gpu(&specs, 2).iter().all(|d| d.taints.is_none()));
    let plain_specs = desired_slices(&base, &plain()).unwrap();
    // RESET_REQUIRED: not switched again, its placements tainted so that a claim allocated on
    // one is evicted; the GPU whole is offered untainted.
    let gpu3 = of_gpu(&specs, 3);
    assert_eq!(gpu3.len(), 26);
    for d in gpu3 {
        if d.name == "gpu-3" {
            assert!(d.taints.is_none(), "never tainted whole");
        } else {
            assert_eq!(
                taint_triples(d),
                [(
                    key.clone(),
                    Some("reset-required".into()),
                    "NoExecute".into()
                )],
                "{}",
                d.name
            );
        }
    }
    for minor in 4..8 {
        assert_eq!(of_gpu(&specs, minor), of_gpu(&before, minor));
    }

    // A server that drops taints: withdrawn instead.
    let w = desired_slices_withdrawing(&inv, &o, true).unwrap();
    assert_eq!(of_gpu(&w, 0), [device(&plain_specs, "gpu-0")]);
    assert_eq!(of_gpu(&w, 3), [device(&plain_specs, "gpu-3")]);
    let gpu1: Vec<&str> = of_gpu(&w, 1).iter().map(|d| d.name.as_str()).collect();
    assert_eq!(gpu1.len(), 25);
    assert!(!gpu1.contains(&"gpu-1"));
    assert!(
        all_devices(&w)
            .iter()
            .flat_map(|d| d.taints.iter().flatten())
            .all(|t| t.key != key)
    );
    // Without `--dynamic-mig` blocks change nothing.
    assert_eq!(
        desired_slices(&inv, &plain()).unwrap(),
        desired_slices(&unblocked(&inv), &plain()).unwrap()
    );
}

/// A holder's process name becomes a taint's label value: 63 characters at most of
/// `[A-Za-z0-9._-]`, starting and ending with a letter or digit, or none.
#[test]
fn a_holder_name_becomes_a_label_value() {
    use super::super::splitting::label_value;
    let some = |s: &str| Some(s.to_string());
    assert_eq!(label_value("nv-hostengine"), some("nv-hostengine"));
    assert_eq!(label_value("dcgm-exporter"), some("dcgm-exporter"));
    assert_eq!(label_value("kworker/0:1"), some("kworker-0-1"));
    assert_eq!(label_value("_x.y_"), some("x.y"));
    assert_eq!(label_value("prüfer"), some("pr-fer"));
    assert_eq!(label_value(""), None);
    assert_eq!(label_value("/:é"), None);
    assert_eq!(label_value(&"a".repeat(100)), Some("a".repeat(63)));
    let edge = format!("{}-b", "a".repeat(62));
    assert_eq!(label_value(&edge), Some("a".repeat(62)));
}

/// A GPU in MIG mode with no instance (MIG mode left on) is offered as one in MIG mode off:
/// whole and in every placement; one with an instance is not offered whole.
#[test]
fn either_mode_is_offered_both_ways_until_an_instance_exists() {
    let off = profile("dgx-h100");
    let on = in_mig_mode(off.clone());
    let o = dynamic(CounterLayout::Separate);
    assert_eq!(
        desired_slices(&on, &o).unwrap(),
        desired_slices(&off, &o).unwrap()
    );
    let mut one = on.clone();
    let i = instance(&one.gpus[3], "1g.10gb", 0);
    one.gpus[3].mig.devices.push(i);
    let specs = desired_slices(&one, &o).unwrap();
    let n: Vec<String> = of_gpu(&specs, 3).iter().map(|d| d.name.clone()).collect();
    assert!(!n.contains(&"gpu-3".to_string()), "{n:?}");
    assert!(n.contains(&"gpu-3-mig-1g10gb-19-0".to_string()));
    assert!(!n.contains(&"gpu-3-mig-7g80gb-0-0".to_string()));
    assert!(!n.contains(&"gpu-3-mig-1g10gbme-20-0".to_string()));
    assert!(n.contains(&"gpu-3-mig-1g10gbme-20-1".to_string()));
}
