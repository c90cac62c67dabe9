//! The bounded backtracking search for an allocation that satisfies every request and
//! constraint of a claim ([`super::MAX_SEARCH_STEPS`]).
//!
//! Within one claim, as in the allocator, a device taken whole is taken once, whoever asked
//! (admin access included); what admin access changes is only what *other* claims hold, and that
//! it draws no counters.

use std::collections::BTreeSet;

use super::*;

pub(super) enum Outcome {
    Found(Vec<Pick>),
    None,
    GaveUp,
}

pub(super) struct Search<'a> {
    pub(super) node: &'a Node,
    /// What other claims hold: the search starts from it.
    pub(super) held: &'a Held,
    pub(super) requests: &'a [Request],
    pub(super) constraints: &'a [DeviceConstraint],
}

/// The search's state: what is picked so far.
struct State {
    picks: Vec<Pick>,
    /// Devices in use (held by other claims, or picked) and, for shared ones, the capacity
    /// consumed (thousandths).
    consumed: BTreeMap<usize, Amounts>,
    /// Devices whose counters are drawn: those held, and those picked without admin access.
    counted: BTreeSet<usize>,
    /// What those devices draw from shared counters: (set, counter) → thousandths.
    counters: BTreeMap<(usize, String), i128>,
    steps: u64,
}

/// What [`Search::take`] changed, for [`Search::untake`].
struct Undo {
    /// The device was not in use before.
    fresh: bool,
    /// Its counters were drawn by this pick.
    counted: bool,
}

impl Search<'_> {
    pub(super) fn run(&self, active: &[bool]) -> Outcome {
        let mut st = State {
            picks: Vec::new(),
            consumed: self
                .held
                .devices()
                .map(|d| (d, self.held.consumed(d)))
                .collect(),
            counted: self.held.devices().collect(),
            counters: self.held.counters(self.node),
            steps: 0,
        };
        match self.request(0, active, &mut st) {
            Some(true) => Outcome::Found(st.picks),
            Some(false) => Outcome::None,
            None => Outcome::GaveUp,
        }
    }

    /// `Some(true)` when requests `r..` can be satisfied on top of `st`; `None` when out of
    /// steps.
    fn request(&self, r: usize, active: &[bool], st: &mut State) -> Option<bool> {
        let Some(req) = self.requests.get(r) else {
            return Some(true);
        };
        for alt in &req.alternatives {
            let need = match alt.want {
                Want::Count(n) => n,
                Want::All => {
                    if alt.fits.is_empty() || alt.blocked.is_some() {
                        continue;
                    }
                    alt.fits.len()
                }
            };
            let before = st.picks.len();
            match self.pick(r, alt, need, 0, active, st)? {
                true => return Some(true),
                false => st.picks.truncate(before),
            }
        }
        Some(false)
    }

    /// Picks `need` more devices for `alt` from `alt.fits[from..]`, then the next requests.
    fn pick(
        &self,
        r: usize,
        alt: &Alternative,
        need: usize,
        from: usize,
        active: &[bool],
        st: &mut State,
    ) -> Option<bool> {
        st.steps += 1;
        if st.steps > MAX_SEARCH_STEPS {
            return None;
        }
        if need == 0 {
            return self.request(r + 1, active, st);
        }
        if alt.fits.len().saturating_sub(from) < need {
            return Some(false);
        }
        for k in from..alt.fits.len() {
            let d = alt.fits[k];
            if !self.can_take(alt, d, active, st) {
                continue;
            }
            let undo = self.take(alt, d, st);
            let consumed = alt.consumes.get(&d).cloned().unwrap_or_default();
            st.picks.push(Pick {
                request: alt.name.clone(),
                device: d,
                consumed,
                admin: alt.admin,
            });
            if self.pick(r, alt, need - 1, k + 1, active, st)? {
                return Some(true);
            }
            st.picks.pop();
            self.untake(alt, d, undo, st);
        }
        Some(false)
    }

    fn can_take(&self, alt: &Alternative, d: usize, active: &[bool], st: &State) -> bool {
        let dev = &self.node.devices[d];
        let want = alt.consumes.get(&d);
        if let Some(used) = st.consumed.get(&d) {
            if !dev.shared() {
                // Held by another claim: free to admin access alone. Picked in this claim:
                // taken, for every request.
                let picked_here = st.picks.iter().any(|p| p.device == d);
                if !alt.admin || picked_here {
                    return false;
                }
            }
            for (name, q) in want.into_iter().flatten() {
                let cap = dev.capacity(name).unwrap_or(0);
                if used.get(name).copied().unwrap_or(0) + q > cap {
                    return false;
                }
            }
        }
        if !alt.admin && !st.counted.contains(&d) {
            // The device's first allocation draws on its counter sets.
            for (set, counters) in &dev.consumes {
                let cs = &self.node.counter_sets[*set];
                for (name, q) in counters {
                    let total = cs.counters.get(name).copied().unwrap_or(0);
                    let used = st.counters.get(&(*set, name.clone())).copied().unwrap_or(0);
                    if used + q > total {
                        return false;
                    }
                }
            }
        }
        // Every active constraint over this request holds with `d` added.
        for (c, on) in self.constraints.iter().zip(active) {
            if !on || !covers(c, &alt.name) {
                continue;
            }
            let value = attribute(
                dev,
                c.match_attribute
                    .as_deref()
                    .or(c.distinct_attribute.as_deref()),
            );
            let others = st.picks.iter().filter(|p| covers(c, &p.request)).map(|p| {
                attribute(
                    &self.node.devices[p.device],
                    c.match_attribute
                        .as_deref()
                        .or(c.distinct_attribute.as_deref()),
                )
            });
            if c.match_attribute.is_some() {
                if value.is_none() {
                    return false;
                }
                if others.into_iter().any(|o| o != value) {
                    return false;
                }
            } else if c.distinct_attribute.is_some() {
                if value.is_none() {
                    return false;
                }
                if others.into_iter().any(|o| o == value) {
                    return false;
                }
            }
        }
        true
    }

    fn take(&self, alt: &Alternative, d: usize, st: &mut State) -> Undo {
        let fresh = !st.consumed.contains_key(&d);
        let counted = !alt.admin && st.counted.insert(d);
        if counted {
            self.count(d, 1, st);
        }
        let used = st.consumed.entry(d).or_default();
        for (name, q) in alt.consumes.get(&d).into_iter().flatten() {
            *used.entry(name.clone()).or_default() += q;
        }
        Undo { fresh, counted }
    }

    fn untake(&self, alt: &Alternative, d: usize, undo: Undo, st: &mut State) {
        if undo.counted {
            st.counted.remove(&d);
            self.count(d, -1, st);
        }
        if undo.fresh {
            st.consumed.remove(&d);
        } else if let Some(used) = st.consumed.get_mut(&d) {
            for (name, q) in alt.consumes.get(&d).into_iter().flatten() {
                *used.entry(name.clone()).or_default() -= q;
            }
        }
    }

    /// Adds (`sign` 1) or removes (-1) device `d`'s draw on its counter sets.
    fn count(&self, d: usize, sign: i128, st: &mut State) {
        for (set, counters) in &self.node.devices[d].consumes {
            for (name, q) in counters {
                *st.counters.entry((*set, name.clone())).or_default() += sign * q;
            }
        }
    }

    /// Why no allocation exists, in one sentence.
    pub(super) fn why_not(&self) -> String {
        for req in self.requests {
            let short: Vec<String> = req
                .alternatives
                .iter()
                .filter_map(|a| match (a.want, &a.blocked) {
                    (Want::All, Some(busy)) => Some(format!(
                        "request {} asks for all matching devices (allocationMode All), and one \
                         is in use ({busy})",
                        a.name
                    )),
                    (Want::All, None) => a.fits.is_empty().then(|| {
                        format!(
                            "request {} asks for all matching devices (allocationMode All), and \
                             none fits{}",
                            a.name,
                            withdrawn_note(a)
                        )
                    }),
                    (Want::Count(need), _) => (a.fits.len() < need).then(|| {
                        format!(
                            "request {} needs {} {}, {} {}{}",
                            a.name,
                            need,
                            if need == 1 { "device" } else { "devices" },
                            a.fits.len(),
                            if a.fits.len() == 1 { "fits" } else { "fit" },
                            withdrawn_note(a)
                        )
                    }),
                })
                .collect();
            if short.len() == req.alternatives.len() {
                return short.join("; ");
            }
        }
        // Each request alone is satisfiable: a constraint, or the requests compete.
        let all_on: Vec<bool> = self.constraints.iter().map(|_| true).collect();
        for (i, c) in self.constraints.iter().enumerate() {
            let mut active = all_on.clone();
            active[i] = false;
            if matches!(self.run(&active), Outcome::Found(_)) {
                return self.constraint_failure(c);
            }
        }
        "the requests compete for the same devices: not enough fit all of them at once".into()
    }

    fn constraint_failure(&self, c: &DeviceConstraint) -> String {
        let (kind, attr) = match (&c.match_attribute, &c.distinct_attribute) {
            (Some(a), _) => ("matchAttribute", a.as_str()),
            (_, Some(a)) => ("distinctAttribute", a.as_str()),
            _ => ("constraint", ""),
        };
        let mut values: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for req in self.requests {
            for alt in &req.alternatives {
                if !covers(c, &alt.name) {
                    continue;
                }
                for &d in &alt.fits {
                    let v = attribute(&self.node.devices[d], Some(attr))
                        .unwrap_or_else(|| "(none)".into());
                    let name = &self.node.devices[d].device.name;
                    let e = values.entry(v).or_default();
                    if !e.contains(name) {
                        e.push(name.clone());
                    }
                }
            }
        }
        let groups: Vec<String> = values
            .iter()
            .map(|(v, ds)| format!("{v}: {}", ds.join(", ")))
            .collect();
        format!(
            "{kind} {attr}: no choice of fitting devices agrees on it (fitting devices by value — {})",
            groups.join("; ")
        )
    }
}

/// Whether constraint `c` covers request `name` (`req` or `req/sub`).
fn covers(c: &DeviceConstraint, name: &str) -> bool {
    match c.requests.as_deref() {
        None | Some([]) => true,
        Some(rs) => {
            let parent = name.split('/').next().unwrap_or(name);
            rs.iter().any(|r| r == name || r == parent)
        }
    }
}

/// A fully qualified attribute's value as text (type-tagged so `1` and `"1"` differ).
fn attribute(dev: &Candidate, qualified: Option<&str>) -> Option<String> {
    let qualified = qualified?;
    let a = dev
        .device
        .attributes
        .iter()
        .flatten()
        .find(|(k, _)| qualify(k, &dev.driver) == qualified)
        .map(|(_, v)| v)?;
    if let Some(i) = a.int {
        Some(i.to_string())
    } else if let Some(b) = a.bool {
        Some(b.to_string())
    } else if let Some(s) = &a.string {
        Some(format!("{s:?}"))
    } else {
        a.version.as_ref().map(|v| format!("v{v}"))
    }
}

/// Why the withdrawn devices that would fit `a` are not offered (each reason once), in
/// parentheses; empty when there are none.
fn withdrawn_note(a: &Alternative) -> String {
    let mut reasons: Vec<&str> = Vec::new();
    for (_, why) in &a.withdrawn {
        if !reasons.contains(&why.as_str()) {
            reasons.push(why);
        }
    }
    if reasons.is_empty() {
        String::new()
    } else {
        format!(" ({})", reasons.join("; "))
    }
}
