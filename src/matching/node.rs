//! A node's devices as `nvdra match` sees them: each converted for CEL once, with the shared
//! counter sets of its pool resolved (`consumesCounters` names a set by name within the pool).

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{Device, ResourceSlice};

use super::{Amounts, InputError, parse_milli, slice_name};
use crate::cel::{DeviceValue, Environment};

/// One device of the node, ready for selectors.
pub struct Candidate {
    pub driver: String,
    pub pool: String,
    pub device: Device,
    pub value: DeviceValue,
    /// What it draws from shared counters while allocated: (index into
    /// [`Node::counter_sets`], counter → thousandths).
    pub(super) consumes: Vec<(usize, Amounts)>,
    /// Counter sets it names that no slice of its pool has.
    pub(super) unknown_sets: Vec<String>,
}

/// A pool's shared counter set.
pub struct CounterSet {
    pub driver: String,
    pub pool: String,
    pub name: String,
    /// Counter → value in thousandths.
    pub counters: Amounts,
}

/// A node's devices and the counter sets they draw on.
pub struct Node {
    pub devices: Vec<Candidate>,
    pub counter_sets: Vec<CounterSet>,
    /// Devices the node would offer but withdrew from its slices, and why (`--dynamic-mig`: a
    /// holder blocks the MIG mode switch they need): never allocated, named where a request
    /// would fit them ([`Node::with_withdrawn`]).
    pub withdrawn: Vec<WithdrawnCandidate>,
}

/// A withdrawn device, ready for selectors, and why it was withdrawn.
pub struct WithdrawnCandidate {
    pub candidate: Candidate,
    pub reason: String,
}

impl Node {
    /// The devices and counter sets of `slices`, converted for CEL.
    pub fn from_slices(env: &Environment, slices: &[ResourceSlice]) -> Result<Node, InputError> {
        let bad = |s: &ResourceSlice, what: String| {
            InputError::Other(format!("ResourceSlice {}: {what}", slice_name(s)))
        };
        let mut counter_sets = Vec::new();
        for s in slices {
            for cs in s.spec.shared_counters.iter().flatten() {
                let mut counters = BTreeMap::new();
                for (k, c) in &cs.counters {
                    let v = parse_milli(&c.value.0).ok_or_else(|| {
                        bad(
                            s,
                            format!(
                                "counter {k} of set {}: invalid quantity {:?}",
                                cs.name, c.value.0
                            ),
                        )
                    })?;
                    counters.insert(k.clone(), v);
                }
                counter_sets.push(CounterSet {
                    driver: s.spec.driver.clone(),
                    pool: s.spec.pool.name.clone(),
                    name: cs.name.clone(),
                    counters,
                });
            }
        }
        let mut devices = Vec::new();
        for s in slices {
            let (driver, pool) = (&s.spec.driver, &s.spec.pool.name);
            for d in s.spec.devices.iter().flatten() {
                let value = env.device(driver, d).map_err(|e| bad(s, e.to_string()))?;
                let mut consumes = Vec::new();
                let mut unknown_sets = Vec::new();
                for c in d.consumes_counters.iter().flatten() {
                    let Some(set) = counter_sets.iter().position(|cs| {
                        &cs.driver == driver && &cs.pool == pool && cs.name == c.counter_set
                    }) else {
                        unknown_sets.push(c.counter_set.clone());
                        continue;
                    };
                    let mut counters = BTreeMap::new();
                    for (k, v) in &c.counters {
                        let v = parse_milli(&v.value.0).ok_or_else(|| {
                            bad(
                                s,
                                format!(
                                    "device {}: counter {k}: invalid quantity {:?}",
                                    d.name, v.value.0
                                ),
                            )
                        })?;
                        counters.insert(k.clone(), v);
                    }
                    consumes.push((set, counters));
                }
                devices.push(Candidate {
                    driver: driver.clone(),
                    pool: pool.clone(),
                    device: d.clone(),
                    value,
                    consumes,
                    unknown_sets,
                });
            }
        }
        Ok(Node {
            devices,
            counter_sets,
            withdrawn: Vec::new(),
        })
    }

    /// Adds the devices of `driver`'s pool `pool` that the node withdrew, each with why (as
    /// [`withdrawn_devices`](crate::dra::slices::withdrawn_devices) gives them). Their counter
    /// consumption is left out: they are only checked against the requests, never allocated.
    pub fn with_withdrawn(
        mut self,
        env: &Environment,
        driver: &str,
        pool: &str,
        withdrawn: Vec<(Device, String)>,
    ) -> Result<Node, InputError> {
        for (mut device, reason) in withdrawn {
            device.consumes_counters = None;
            let value = env
                .device(driver, &device)
                .map_err(|e| InputError::Other(format!("withdrawn device {}: {e}", device.name)))?;
            self.withdrawn.push(WithdrawnCandidate {
                candidate: Candidate {
                    driver: driver.to_string(),
                    pool: pool.to_string(),
                    device,
                    value,
                    consumes: Vec::new(),
                    unknown_sets: Vec::new(),
                },
                reason,
            });
        }
        Ok(self)
    }

    /// The index of a device by its driver, pool and name.
    pub fn find(&self, driver: &str, pool: &str, device: &str) -> Option<usize> {
        self.devices
            .iter()
            .position(|c| c.driver == driver && c.pool == pool && c.device.name == device)
    }
}
