//! What other claims already hold on a node, as the scheduler's allocator counts it.
//!
//! An exclusive device is held whole by one claim. A device with `allowMultipleAllocations` is
//! held by any number of claims, each consuming part of its capacity (what its allocation
//! result's `consumedCapacity` says, or the policy's defaults where it says nothing), and their
//! sum never exceeds the device's capacity: a claim holding all of a GPU's memory leaves no
//! room for a share of it. A held device consumes its shared counters (`consumesCounters`) once,
//! however many claims share it.
//!
//! Admin access (`adminAccess: true`) is not holding, as the scheduler counts it
//! (`foreachAllocatedDevice` skips such results): an admin-access request may get a device
//! other claims hold, and its allocation holds nothing for the claims after it: no device, no
//! capacity, no counters. It is still checked against the capacity left on a shared device, as
//! the allocator checks every request there. The allocator of Kubernetes 1.36 also checks and
//! charges an admin-access request's counters (kubernetes#140729, open), so on a partitionable
//! node it may refuse an admin-access claim for a partition in use that `match` gives it: that is
//! the bug, and `match` says what the API promises.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::AllocationResult;

use super::{Amounts, Candidate, Node, Pick, format_milli, parse_milli, qualify};
use crate::sharing::trust::{Member, TrustDomain, TrustLabel};

/// Why a device cannot take one more allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Busy {
    /// In words, with the values that decided it.
    pub(super) reason: String,
    /// The device is in use (allocated whole, or its counters taken), rather than short of
    /// capacity left: a request for all matching devices (`allocationMode: All`) then fails, as
    /// the scheduler allocates every one of them or none. A shared device without enough
    /// capacity left is not one of "all" (the allocator leaves it out when it lists them).
    pub(super) in_use: bool,
}

/// The devices of a node that claims hold, and how much of each.
#[derive(Debug, Default, Clone)]
pub struct Held {
    /// Per device (index into [`Node::devices`]): each holding claim, its namespace and the
    /// capacity it consumes (by the capacity's name in the device, in thousandths; empty for an
    /// exclusive device).
    by_device: BTreeMap<usize, Vec<(String, String, Amounts)>>,
    /// The node's `--share-trust-domain`, which the scheduler does not know and prepare applies.
    trust: Trust,
}

/// `--share-trust-domain` as `nvdra match` applies it: the rule, and the namespaces' labels it
/// reads (from `kind: Namespace` objects given with `-f`; a namespace not given has none).
#[derive(Debug, Default, Clone)]
pub struct Trust {
    pub rule: TrustDomain,
    pub namespace_labels: BTreeMap<String, BTreeMap<String, String>>,
}

impl Trust {
    /// The label of `namespace` the rule compares, if it has it.
    fn label(&self, namespace: &str) -> Option<TrustLabel> {
        let key = self.rule.label_key()?;
        let value = self.namespace_labels.get(namespace)?.get(key)?;
        Some(TrustLabel {
            key: key.to_string(),
            value: value.clone(),
        })
    }
}

impl Held {
    /// Nothing held, on a node with `trust`.
    pub fn with_trust(trust: Trust) -> Self {
        Self {
            by_device: BTreeMap::new(),
            trust,
        }
    }

    /// Records that `claim` of `namespace` holds device `d`, consuming `consumed` of it.
    pub fn hold(&mut self, d: usize, claim: &str, namespace: &str, consumed: Amounts) {
        self.by_device.entry(d).or_default().push((
            claim.to_string(),
            namespace.to_string(),
            consumed,
        ));
    }

    /// Records an allocated claim's results; the devices it names that the node does not have
    /// come back as `driver/pool/device`. Results with admin access are found but not held.
    pub(super) fn hold_allocation(
        &mut self,
        node: &Node,
        claim: &str,
        namespace: &str,
        allocation: &AllocationResult,
    ) -> (Vec<Pick>, Vec<String>) {
        let mut found = Vec::new();
        let mut missing = Vec::new();
        for r in allocation
            .devices
            .iter()
            .flat_map(|d| d.results.iter().flatten())
        {
            let Some(d) = node.find(&r.driver, &r.pool, &r.device) else {
                missing.push(format!("{}/{}/{}", r.driver, r.pool, r.device));
                continue;
            };
            let dev = &node.devices[d];
            let consumed: Amounts = if dev.shared() {
                let given: Amounts = r
                    .consumed_capacity
                    .iter()
                    .flatten()
                    .filter_map(|(k, q)| Some((qualify(k, &r.driver), parse_milli(&q.0)?)))
                    .collect();
                // A share without consumedCapacity (written by hand, or by an older
                // scheduler) is counted as the device's defaults would have it.
                dev.device
                    .capacity
                    .iter()
                    .flatten()
                    .filter_map(|(k, c)| {
                        let v = match given.get(&qualify(k, &r.driver)) {
                            Some(v) => *v,
                            None => {
                                match c.request_policy.as_ref().and_then(|p| p.default.as_ref()) {
                                    Some(q) => parse_milli(&q.0)?,
                                    None => parse_milli(&c.value.0)?,
                                }
                            }
                        };
                        Some((k.clone(), v))
                    })
                    .collect()
            } else {
                BTreeMap::new()
            };
            if r.admin_access == Some(true) {
                found.push(Pick {
                    request: r.request.clone(),
                    device: d,
                    consumed,
                    admin: true,
                });
                continue;
            }
            self.hold(d, claim, namespace, consumed.clone());
            found.push(Pick {
                request: r.request.clone(),
                device: d,
                consumed,
                admin: false,
            });
        }
        (found, missing)
    }

    /// Whether any claim holds device `d`.
    pub(super) fn is_held(&self, d: usize) -> bool {
        self.by_device.contains_key(&d)
    }

    /// The claims that hold device `d`, in the order they took it.
    pub(super) fn holders(&self, d: usize) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for (c, _, _) in self.by_device.get(&d).into_iter().flatten() {
            if !out.contains(&c.as_str()) {
                out.push(c);
            }
        }
        out
    }

    /// What the holders of device `d` consume together, by capacity name.
    pub(super) fn consumed(&self, d: usize) -> Amounts {
        let mut out = BTreeMap::new();
        for (_, _, c) in self.by_device.get(&d).into_iter().flatten() {
            for (k, v) in c {
                *out.entry(k.clone()).or_default() += v;
            }
        }
        out
    }

    /// Every held device, once.
    pub(super) fn devices(&self) -> impl Iterator<Item = usize> + '_ {
        self.by_device.keys().copied()
    }

    /// What the held devices draw from each counter set: (set index, counter) → thousandths.
    pub(super) fn counters(&self, node: &Node) -> BTreeMap<(usize, String), i128> {
        let mut out = BTreeMap::new();
        for d in self.devices() {
            for (set, counters) in &node.devices[d].consumes {
                for (name, v) in counters {
                    *out.entry((*set, name.clone())).or_default() += v;
                }
            }
        }
        out
    }

    /// Why device `d` cannot take one more allocation consuming `want` (by capacity name) for a
    /// claim of `namespace`; `None` when it can. With `admin` (an admin-access request), a
    /// device held whole is free and counters are neither needed nor drawn; a shared device's
    /// capacity left still counts.
    pub(super) fn why_not(
        &self,
        node: &Node,
        d: usize,
        want: &Amounts,
        admin: bool,
        namespace: &str,
    ) -> Option<Busy> {
        let dev = &node.devices[d];
        if self.is_held(d) {
            if !dev.shared() {
                if admin {
                    return None;
                }
                return Some(Busy {
                    reason: format!("allocated to {}", claims(&self.holders(d))),
                    in_use: true,
                });
            }
            if !admin && let Some(reason) = self.other_domain(d, namespace) {
                return Some(Busy {
                    reason,
                    in_use: false,
                });
            }
            let used = self.consumed(d);
            for (name, need) in want {
                let have = dev.capacity(name)?;
                let taken = used.get(name).copied().unwrap_or(0);
                if taken + need > have {
                    let reason = format!(
                        "{name} {} > {} left ({}: {} held by {})",
                        format_milli(*need),
                        format_milli(have - taken),
                        dev.device.name,
                        format_milli(taken),
                        claims(&self.holders(d))
                    );
                    return Some(Busy {
                        reason,
                        in_use: false,
                    });
                }
            }
            return None;
        }
        if admin {
            return None;
        }
        let used = self.counters(node);
        for (set, counters) in &dev.consumes {
            let cs = &node.counter_sets[*set];
            for (name, need) in counters {
                let total = cs.counters.get(name).copied().unwrap_or(0);
                let taken = used.get(&(*set, name.clone())).copied().unwrap_or(0);
                if taken + need <= total {
                    continue;
                }
                let by: Vec<String> = self
                    .devices()
                    .filter(|h| {
                        node.devices[*h]
                            .consumes
                            .iter()
                            .any(|(s, c)| s == set && c.get(name).is_some_and(|v| *v > 0))
                    })
                    .map(|h| {
                        format!(
                            "{} ({})",
                            node.devices[h].device.name,
                            claims(&self.holders(h))
                        )
                    })
                    .collect();
                let reason = if taken >= total {
                    format!(
                        "counter {name} of {} is taken by {}",
                        cs.name,
                        by.join(", ")
                    )
                } else {
                    format!(
                        "counter {name} of {}: {} > {} left (taken by {})",
                        cs.name,
                        format_milli(*need),
                        format_milli(total - taken),
                        by.join(", ")
                    )
                };
                return Some(Busy {
                    reason,
                    in_use: true,
                });
            }
        }
        None
    }
}

impl Held {
    /// Why a share of shared device `d` for a claim of `namespace` would be refused at prepare
    /// under the node's trust-domain rule: the first holder of another domain, named with both
    /// domains and the rule. The scheduler, which does not know the rule, may still allocate it.
    fn other_domain(&self, d: usize, namespace: &str) -> Option<String> {
        let rule = &self.trust.rule;
        if !rule.enabled() {
            return None;
        }
        let mine = self.trust.label(namespace);
        let me = Member {
            namespace,
            label: mine.as_ref(),
        };
        self.by_device
            .get(&d)
            .into_iter()
            .flatten()
            .find_map(|(claim, ns, _)| {
                let theirs = self.trust.label(ns);
                let them = Member {
                    namespace: ns,
                    label: theirs.as_ref(),
                };
                (!rule.admits(me, them)).then(|| {
                    format!(
                        "refused at prepare: claim {ns}/{claim} of {} holds a share of it, and \
                         the node keeps a GPU's shares within one trust domain \
                         (--share-trust-domain={rule}); this claim is of {}",
                        rule.describe(them),
                        rule.describe(me)
                    )
                })
            })
    }
}

/// `claim a` or `claims a, b`.
fn claims(names: &[&str]) -> String {
    match names {
        [one] => format!("claim {one}"),
        many => format!("claims {}", many.join(", ")),
    }
}

impl Candidate {
    /// Whether several claims may share the device (`allowMultipleAllocations`).
    pub(super) fn shared(&self) -> bool {
        self.device.allow_multiple_allocations == Some(true)
    }

    /// The device's capacity `name` (as the device spells it, or qualified), in thousandths.
    pub(super) fn capacity(&self, name: &str) -> Option<i128> {
        let q = qualify(name, &self.driver);
        self.device
            .capacity
            .iter()
            .flatten()
            .find(|(k, _)| qualify(k, &self.driver) == q)
            .and_then(|(_, v)| parse_milli(&v.value.0))
    }
}
