//! `--shared-capacity` and `--consumable-shares`: each GPU outside MIG mode is one device the
//! scheduler may allocate many times, by consumable `memory` (default: the whole GPU in `memory`
//! mode, 0 in NVIDIA's `unlimited` and integer modes), `shares` (integer mode) and
//! `multiprocessors` (default: 0).

use super::*;
use crate::inventory::{TaintEffect, TaintKey};

fn policy(d: &Device, name: &str) -> (String, String, String, String, String) {
    let c = &d.capacity.as_ref().unwrap()[name];
    let p = c.request_policy.as_ref().expect("a request policy");
    let r = p.valid_range.as_ref().expect("a range");
    (
        c.value.0.clone(),
        p.default.as_ref().unwrap().0.clone(),
        r.min.0.clone(),
        r.max.as_ref().unwrap().0.clone(),
        r.step.as_ref().unwrap().0.clone(),
    )
}

fn q(v: &str) -> String {
    v.to_string()
}

#[test]
fn every_whole_gpu_is_one_device_allocated_whole_or_in_shares() {
    let inv = profile("dgx-h100");
    let specs = desired_slices(&inv, &shared(false)).unwrap();
    let off = desired_slices(&inv, &plain()).unwrap();
    assert_eq!(names(&specs), names(&off), "no twins");
    assert_eq!(names(&specs).len(), 8);
    assert!(specs.iter().all(|s| s.shared_counters.is_none()));
    for g in &inv.gpus {
        let d = device(&specs, &format!("gpu-{}", g.minor));
        let whole = device(&off, &format!("gpu-{}", g.minor));
        assert_eq!(d.allow_multiple_allocations, Some(true));
        assert_eq!(d.consumes_counters, None);
        // The same attributes: `type == 'gpu'` selects it, whole or a share.
        assert_eq!(d.attributes, whole.attributes);
        assert_eq!(attr(d, "type"), &s("gpu"));
        // A claim that asks for no memory gets all of it; at most 48 shares fit.
        assert_eq!(
            policy(d, "memory"),
            (q("80Gi"), q("80Gi"), q("1672Mi"), q("80Gi"), q("1Mi"))
        );
        // Asked SMs are a cap; a share that asks none is charged none.
        assert_eq!(
            policy(d, "multiprocessors"),
            (q("132"), q("0"), q("0"), q("132"), q("1"))
        );
        // Everything else as without the switch, without a policy.
        let mut rest = d.capacity.clone().unwrap();
        rest.remove("memory");
        rest.remove("multiprocessors");
        let mut want = whole.capacity.clone().unwrap();
        want.remove("memory");
        want.remove("multiprocessors");
        assert_eq!(rest, want);
        assert!(rest.values().all(|c| c.request_policy.is_none()));
    }
}

#[test]
fn memory_is_published_in_whole_mib_so_the_policy_lies_on_its_steps() {
    let mut inv = profile("dgx-h100");
    // A GPU whose memory is not a whole number of MiB (NVML reports bytes).
    inv.gpus[3].memory_bytes = (81559 << 20) + 123_456;
    let specs = desired_slices(&inv, &shared(false)).unwrap();
    let d = device(&specs, "gpu-3");
    assert_eq!(
        policy(d, "memory"),
        (
            q("81559Mi"),
            q("81559Mi"),
            q("1665Mi"),
            q("81559Mi"),
            q("1Mi")
        )
    );
    assert!(validate(&specs[0]).is_empty());
    // Without the switch the byte count stays as it is.
    let off = desired_slices(&inv, &plain()).unwrap();
    assert_eq!(
        cap(device(&off, "gpu-3"), "memory"),
        format!("{}", (81559u64 << 20) + 123_456)
    );
}

#[test]
fn the_policies_pass_the_api_rules_and_the_rules_catch_a_broken_one() {
    for name in [
        "dgx-h100",
        "dgx-a100",
        "l40s-pcie",
        "pcie-pairs",
        "hgx-h200",
    ] {
        let inv = profile(name);
        let specs = desired_slices(&inv, &shared(false)).unwrap();
        for s in &specs {
            assert!(validate(s).is_empty(), "{name}: {:?}", validate(s));
        }
        assert!(validate_pool(&specs).is_empty(), "{name}");
    }
    let inv = profile("dgx-h100");
    let specs = desired_slices(&inv, &shared(false)).unwrap();
    let broken = |f: &dyn Fn(&mut CapacityRequestPolicy)| {
        let mut spec = specs[0].clone();
        let d = &mut spec.devices.as_mut().unwrap()[0];
        f(d.capacity
            .as_mut()
            .unwrap()
            .get_mut("memory")
            .unwrap()
            .request_policy
            .as_mut()
            .unwrap());
        validate(&spec)
            .into_iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join("; ")
    };
    assert!(broken(&|p| p.default = None).contains("a default is required"));
    assert!(
        broken(&|p| p.default = Some(Quantity("1Gi".into())))
            .contains("the default must lie within validRange")
    );
    assert!(
        broken(&|p| p.default = Some(Quantity("2147483649".into())))
            .contains("the default must be min plus a multiple of step")
    );
    assert!(
        broken(&|p| p.valid_range.as_mut().unwrap().min = Quantity("81Gi".into()))
            .contains("min <= max <= value")
    );
}

/// An existing MIG device as a share mode publishes it, against the same device without the
/// switch (`off`): shareable, the same attributes and counters, `memory` with the mode's policy
/// of the MIG device's memory, every other capacity as it was with a default-0 policy, so that
/// a claim that asks for none of it is charged none and a second claim fits.
fn assert_shared_mig(on: &Device, off: &Device, memory: (&str, &str, &str)) {
    let name = &on.name;
    assert_eq!(on.allow_multiple_allocations, Some(true), "{name}");
    assert_eq!(on.attributes, off.attributes, "{name}");
    assert_eq!(on.consumes_counters, off.consumes_counters, "{name}");
    let (value, default, min) = memory;
    assert_eq!(
        policy(on, "memory"),
        (q(value), q(default), q(min), q(value), q("1Mi")),
        "{name}"
    );
    assert_eq!(cap(off, "memory"), value, "{name}: the MIG device's memory");
    for (k, c) in off.capacity.as_ref().unwrap() {
        if k == "memory" {
            continue;
        }
        let p = on.capacity.as_ref().unwrap()[k].clone();
        assert_eq!(p.value, c.value, "{name} {k}");
        let p = p.request_policy.expect("a default-0 policy");
        let r = p.valid_range.unwrap();
        assert_eq!(p.default, Some(Quantity("0".into())), "{name} {k}");
        assert_eq!(
            (r.min.0.as_str(), r.max),
            ("0", Some(c.value.clone())),
            "{name} {k}"
        );
        let step = (c.value.0 != "0").then(|| Quantity("1".into()));
        assert_eq!(r.step, step, "{name} {k}");
    }
}

#[test]
fn gpus_in_mig_mode_share_their_existing_mig_devices_and_gpus_too_small_are_not_shared() {
    let inv = profile("a100-mig-mixed");
    for partitionable in [false, true] {
        let on = desired_slices(&inv, &shared(partitionable)).unwrap();
        let off = desired_slices(
            &inv,
            &SliceOptions {
                shared_capacity: ConsumableShares::Disabled,
                ..shared(partitionable)
            },
        )
        .unwrap();
        assert_eq!(names(&on), names(&off));
        for g in &inv.gpus {
            let whole = format!("gpu-{}", g.minor);
            let multiple = all_devices(&on)
                .into_iter()
                .filter(|d| d.allow_multiple_allocations == Some(true))
                .any(|d| d.name == whole);
            assert_eq!(multiple, !g.in_mig_mode(), "{whole}");
        }
        // Existing MIG devices are shared; placements (partitionable) are as without the
        // switch.
        let mut existing = 0;
        for d in all_devices(&off)
            .into_iter()
            .filter(|d| d.name.contains("-mig-"))
        {
            let on = device(&on, &d.name);
            if d.attributes.as_ref().unwrap().contains_key("uuid") {
                existing += 1;
                // Default: all of it; at most 48 shares fit (4864Mi / 49, rounded up).
                let value = cap(d, "memory");
                let min = crate::ledger::shares::min_share(
                    crate::inventory::parse_quantity(&value).unwrap(),
                );
                assert_shared_mig(on, d, (&value, &value, &crate::inventory::quantity(min)));
                if value == "4864Mi" {
                    assert_eq!(crate::inventory::quantity(min), "100Mi");
                }
            } else {
                assert_eq!(on, d);
            }
        }
        assert_eq!(existing, 7, "partitionable={partitionable}");
    }
    let mut small = profile("dgx-h100");
    small.gpus[0].memory_bytes = 2 << 30;
    let specs = desired_slices(&small, &shared(false)).unwrap();
    let d = device(&specs, "gpu-0");
    assert_eq!(d.allow_multiple_allocations, None);
    assert!(
        d.capacity.as_ref().unwrap()["memory"]
            .request_policy
            .is_none()
    );
}

#[test]
fn an_unhealthy_gpu_is_tainted_as_without_the_switch() {
    let mut inv = profile("dgx-h100");
    inv.gpus[2].health = super::taints::tainted(TaintKey::Xid(79), TaintEffect::NoSchedule);
    let plain_taint = device(&desired_slices(&inv, &plain()).unwrap(), "gpu-2")
        .taints
        .clone();
    let specs = desired_slices(&inv, &shared(false)).unwrap();
    assert!(plain_taint.is_some());
    assert_eq!(device(&specs, "gpu-2").taints, plain_taint);
}

/// `--consumable-shares`, any mode.
fn mode(m: &str) -> SliceOptions {
    SliceOptions {
        shared_capacity: m.parse().unwrap(),
        ..plain()
    }
}

/// NVIDIA's `unlimited` and integer modes, as its `consumable_shares.go` publishes them:
/// `memory` rounded down to a MiB with default 0, min 0, max all of it, steps of 1Mi, and in
/// integer mode `shares` of N with default 1, min 1, max N, step 1.
#[test]
fn unlimited_and_integer_modes_publish_nvidias_policies() {
    let inv = profile("dgx-h100");
    let off = desired_slices(&inv, &plain()).unwrap();
    for (m, shares) in [("unlimited", None), ("4", Some("4")), ("48", Some("48"))] {
        let specs = desired_slices(&inv, &mode(m)).unwrap();
        assert_eq!(names(&specs), names(&off), "{m}: no twins");
        for g in &inv.gpus {
            let d = device(&specs, &format!("gpu-{}", g.minor));
            let whole = device(&off, &format!("gpu-{}", g.minor));
            assert_eq!(d.allow_multiple_allocations, Some(true), "{m}");
            assert_eq!(d.attributes, whole.attributes, "{m}");
            assert_eq!(
                policy(d, "memory"),
                (q("80Gi"), q("0"), q("0"), q("80Gi"), q("1Mi")),
                "{m}"
            );
            assert_eq!(
                policy(d, "multiprocessors"),
                (q("132"), q("0"), q("0"), q("132"), q("1")),
                "{m}"
            );
            match shares {
                Some(n) => assert_eq!(
                    policy(d, "shares"),
                    (q(n), q("1"), q("1"), q(n), q("1")),
                    "{m}"
                ),
                None => assert!(!d.capacity.as_ref().unwrap().contains_key("shares"), "{m}"),
            }
            let extra = usize::from(shares.is_some());
            assert_eq!(
                d.capacity.as_ref().unwrap().len(),
                whole.capacity.as_ref().unwrap().len() + extra,
                "{m}: nothing else added"
            );
        }
    }
    // `memory` mode is --shared-capacity, field for field; `disabled` is no switch at all.
    assert_eq!(
        desired_slices(&inv, &mode("memory")).unwrap(),
        desired_slices(&inv, &shared(false)).unwrap()
    );
    assert_eq!(desired_slices(&inv, &mode("disabled")).unwrap(), off);
}

#[test]
fn every_mode_passes_the_api_rules_on_every_profile() {
    for name in [
        "dgx-h100",
        "dgx-a100",
        "dgx-a100-mig",
        "a100-mig-mixed",
        "l40s-pcie",
        "pcie-pairs",
        "hgx-h200",
    ] {
        let inv = profile(name);
        for m in ["memory", "unlimited", "1", "7", "48"] {
            for partitionable in [false, true] {
                let specs = desired_slices(
                    &inv,
                    &SliceOptions {
                        partitionable,
                        ..mode(m)
                    },
                )
                .unwrap();
                for s in &specs {
                    assert!(validate(s).is_empty(), "{name} {m}: {:?}", validate(s));
                }
                assert!(validate_pool(&specs).is_empty(), "{name} {m}");
            }
        }
    }
    // One share per GPU: NVIDIA's step of 1 breaks the rule that min + step lie within the
    // value, so it has none (and 1 is the only value the range allows).
    let specs = desired_slices(&profile("dgx-h100"), &mode("1")).unwrap();
    let p = all_devices(&specs)[0].capacity.as_ref().unwrap()["shares"]
        .request_policy
        .clone()
        .unwrap();
    let r = p.valid_range.unwrap();
    assert_eq!((r.min.0.as_str(), r.step), ("1", None));
    assert_eq!(r.max.map(|m| m.0).as_deref(), Some("1"));
    // The rules catch a `shares` policy whose default is out of its range.
    let specs = desired_slices(&profile("dgx-h100"), &mode("4")).unwrap();
    let mut spec = specs[0].clone();
    let d = &mut spec.devices.as_mut().unwrap()[0];
    d.capacity
        .as_mut()
        .unwrap()
        .get_mut("shares")
        .unwrap()
        .request_policy = Some(CapacityRequestPolicy {
        default: Some(Quantity("5".into())),
        ..d.capacity.as_ref().unwrap()["shares"]
            .request_policy
            .clone()
            .unwrap()
    });
    let v: Vec<String> = validate(&spec).iter().map(|v| v.to_string()).collect();
    assert!(
        v.iter()
            .any(|v| v.contains("the default must lie within validRange")),
        "{v:?}"
    );
}

/// Every mode shares the existing MIG devices of GPUs in MIG mode with the mode's `memory`
/// policy (and `shares` in integer mode), as NVIDIA's driver does, leaves a MIG device too
/// small to share, and a GPU too small to share, plain.
#[test]
fn every_mode_shares_existing_mig_devices_and_leaves_small_devices_plain() {
    let mut inv = profile("a100-mig-mixed");
    let tiny = {
        let g = inv.gpus.iter_mut().find(|g| g.in_mig_mode()).unwrap();
        let m = g.mig.devices.last_mut().unwrap();
        m.memory_bytes = 2 << 30;
        DeviceName::mig(g.minor, &m.profile, m.gi_profile_id, m.placement.start).to_string()
    };
    let off = desired_slices(&inv, &plain()).unwrap();
    for m in ["memory", "unlimited", "4"] {
        let on = desired_slices(&inv, &mode(m)).unwrap();
        assert_eq!(names(&on), names(&off), "{m}");
        for d in all_devices(&off)
            .into_iter()
            .filter(|d| d.name.contains("-mig-"))
        {
            let shared = device(&on, &d.name);
            if d.name == tiny {
                assert_eq!(shared, d, "{m}: too small to share");
                continue;
            }
            let value = cap(d, "memory");
            let (default, min) = match m {
                "memory" => (value.clone(), policy(shared, "memory").2),
                _ => (q("0"), q("0")),
            };
            assert_shared_mig(shared, d, (&value, &default, &min));
            let shares = shared.capacity.as_ref().unwrap().get("shares");
            if m == "4" {
                assert_eq!(
                    policy(shared, "shares"),
                    (q("4"), q("1"), q("1"), q("4"), q("1")),
                    "{m}"
                );
            } else {
                assert!(shares.is_none(), "{m}");
            }
        }
        let mut small = profile("dgx-h100");
        small.gpus[0].memory_bytes = 2 << 30;
        let specs = desired_slices(&small, &mode(m)).unwrap();
        assert_eq!(
            device(&specs, "gpu-0").allow_multiple_allocations,
            None,
            "{m}"
        );
        assert_eq!(
            device(&specs, "gpu-1").allow_multiple_allocations,
            Some(true),
            "{m}"
        );
    }
}

/// The widest MIG device, a 7g instance over all 8 memory slices of a GPU with a PCIe root, a
/// NUMA node and a fabric, stays within the API's 32 attributes and capacities when shared in
/// every mode, plain and partitionable: beside the standard `resource.kubernetes.io/numaNode`
/// it has no room for the fabric attributes (nvdra's, not NVIDIA's) in any mode, and in integer
/// mode `shares` takes the last place.
#[test]
fn the_widest_shared_mig_device_fits_the_attribute_limit() {
    let mut inv = mig_ready("dgx-a100");
    for g in &mut inv.gpus {
        g.fabric = Some(crate::inventory::Fabric {
            cluster_uuid: crate::inventory::ClusterUuid::parse(
                "6c1f3a52-8d2e-4b7a-9f10-0123456789ab",
            )
            .unwrap(),
            clique_id: 1,
        });
    }
    let g = &mut inv.gpus[0];
    let p = g
        .mig
        .profiles
        .iter()
        .find(|p| p.name.starts_with("7g"))
        .unwrap()
        .clone();
    assert_eq!(p.placements[0].size, 8, "all 8 memory slices");
    g.mig.devices.push(MigDevice {
        uuid: MigUuid("MIG-7g".into()),
        profile: p.name.clone(),
        gi_profile_id: p.gi_profile_id,
        gi_id: 0,
        ci_id: 0,
        placement: p.placements[0],
        memory_bytes: p.memory_bytes,
        multiprocessors: p.multiprocessors,
        engines: p.engines,
        health: Health::Healthy,
    });
    let name = DeviceName::mig(g.minor, &p.name, p.gi_profile_id, p.placements[0].start);
    for partitionable in [false, true] {
        for m in ["memory", "unlimited", "4"] {
            let opts = SliceOptions {
                partitionable,
                ..mode(m)
            };
            // Validated against the API's rules before it is returned.
            let specs = desired_slices(&inv, &opts)
                .unwrap_or_else(|e| panic!("partitionable={partitionable} {m}: {e}"));
            let d = device(&specs, name.as_str());
            assert_eq!(d.allow_multiple_allocations, Some(true));
            let attrs = d.attributes.as_ref().unwrap();
            let width = attrs.len() + d.capacity.as_ref().unwrap().len();
            // One under the limit; in integer mode at it (`shares` in). Both fabric attributes,
            // which go together, out.
            let want = MAX_ATTRIBUTES_AND_CAPACITIES - usize::from(m != "4");
            assert_eq!(width, want, "partitionable={partitionable} {m}");
            assert!(
                !attrs.contains_key(ATTR_FABRIC_CLIQUE_ID)
                    && !attrs.contains_key(ATTR_FABRIC_CLUSTER_UUID)
                    && attrs.contains_key(ATTR_NUMA_NODE),
                "partitionable={partitionable} {m}"
            );
            assert_eq!(
                d.capacity.as_ref().unwrap().contains_key("shares"),
                m == "4"
            );
        }
    }
}
