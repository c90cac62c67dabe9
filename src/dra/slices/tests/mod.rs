//! Slice tests: shared fixtures (options, profiles, lookups); the tests live in one file per area.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{NodeSelector, NodeSelectorTerm};
use k8s_openapi::api::resource::v1::{CapacityRequestPolicy, DeviceTaint};
use proptest::prelude::*;

use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCounterConsumption, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use super::attributes::{boolean, capacity, int, string, version};
use super::splitting::chunk_devices;
use super::*;
use crate::ids::{DeviceName, profile_label};
use crate::inventory::topology::load_profile;
use crate::inventory::{GpuUuid, Health, Inventory, MigDevice, MigUuid, PciBusId, Placement};

mod attributes;
mod dynamic;
mod mig;
mod names;
mod partitionable;
mod shared;
mod splitting;
mod taints;
mod validation;

const DRIVER: &str = "gpu.nvidia.com";

fn opts(partitionable: bool, layout: CounterLayout) -> SliceOptions {
    SliceOptions {
        driver: DRIVER.into(),
        node_name: "node-a".into(),
        partitionable,
        shared_capacity: ConsumableShares::Disabled,
        dynamic_mig: false,
        mig_profiles: None,
        layout,
    }
}

/// `--shared-capacity`, with or without `--partitionable`.
fn shared(partitionable: bool) -> SliceOptions {
    SliceOptions {
        shared_capacity: ConsumableShares::Memory,
        ..opts(partitionable, CounterLayout::Separate)
    }
}

fn plain() -> SliceOptions {
    opts(false, CounterLayout::Separate)
}

fn profile(name: &str) -> Inventory {
    load_profile(name, "node-a").unwrap()
}

/// A profile whose MIG-capable GPUs are in MIG mode with no instances yet: a node set up for
/// partitionable devices.
fn mig_ready(name: &str) -> Inventory {
    in_mig_mode(profile(name))
}

fn in_mig_mode(mut inv: Inventory) -> Inventory {
    for g in &mut inv.gpus {
        g.mig.enabled = g.mig.capable;
    }
    inv
}

fn all_devices(specs: &[ResourceSliceSpec]) -> Vec<&Device> {
    specs
        .iter()
        .flat_map(|s| s.devices.iter().flatten())
        .collect()
}

fn names(specs: &[ResourceSliceSpec]) -> Vec<String> {
    all_devices(specs).iter().map(|d| d.name.clone()).collect()
}

fn device<'a>(specs: &'a [ResourceSliceSpec], name: &str) -> &'a Device {
    all_devices(specs)
        .into_iter()
        .find(|d| d.name == name)
        .unwrap_or_else(|| panic!("no device {name} in {:?}", names(specs)))
}

fn attr<'a>(d: &'a Device, name: &str) -> &'a DeviceAttribute {
    d.attributes
        .as_ref()
        .unwrap()
        .get(name)
        .unwrap_or_else(|| panic!("{} has no attribute {name}", d.name))
}

fn cap(d: &Device, name: &str) -> String {
    d.capacity.as_ref().unwrap()[name].value.0.clone()
}

fn s(v: &str) -> DeviceAttribute {
    string(v)
}

/// `n` copies of GPU 0 of `profile_name` with distinct identities.
fn synthetic(profile_name: &str, n: u32) -> Inventory {
    let template = profile(profile_name).gpus[0].clone();
    let gpus = (0..n)
        .map(|i| {
            let mut g = template.clone();
            g.index = i;
            g.minor = i;
            g.uuid = GpuUuid(format!("GPU-{i:08}"));
            g.pci_bus_id = PciBusId(format!("{:04x}:{:02x}:00.0", i / 256, i % 256));
            g
        })
        .collect();
    Inventory::new(gpus).unwrap()
}

fn consumed(d: &Device) -> BTreeMap<(String, String), String> {
    d.consumes_counters
        .iter()
        .flatten()
        .flat_map(|c| {
            c.counters
                .iter()
                .map(|(k, v)| ((c.counter_set.clone(), k.clone()), v.value.0.clone()))
        })
        .collect()
}
