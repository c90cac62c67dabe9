//! What a share may use beyond what the scheduler packs it by, as `nvdra match` shows it.
//!
//! The scheduler counts a share of a GPU by the capacity it consumes (`memory`), and packs
//! shares by that alone. A share's config may ask for a burst limit above it (NVIDIA's
//! `mpsConfig.defaultPinnedDeviceMemoryLimit`, [`sharing::ShareConfig::burst_limit`]): the most
//! it may use, memory the GPU's other shares leave idle. Nothing published changes, so the
//! allocation search never sees it; this adds it to each share of a possible (or existing)
//! allocation, with the config the node would apply ([`sharing::config_for_device`], as
//! prepare picks it), and what prepare would refuse in that config.

use k8s_openapi::api::resource::v1::ResourceClaimSpec;

use super::report::{Allocated, ClaimReport};
use super::{ClaimInput, Class, Node, Pick, format_milli};
use crate::ledger::shares;
use crate::sharing::{self, ConfigEntry, ConfigSource, DeviceKind};

/// Adds to each share of `report`'s allocation (the `picks` it was built from, in order) its
/// burst limit, or what prepare would refuse in its config. `entries`: the configs of the
/// allocation (a claim's `status.allocation`), or `None` to take them from the claim and its
/// requests' classes, as the scheduler copies them into the allocation it makes.
pub(super) fn annotate(
    report: &mut ClaimReport,
    picks: &[Pick],
    claim: &ClaimInput,
    classes: &std::collections::BTreeMap<String, Class>,
    node: &Node,
    entries: Option<Vec<ConfigEntry>>,
) {
    let Some(allocated) = report.allocation.as_mut() else {
        return;
    };
    for (a, p) in allocated.iter_mut().zip(picks) {
        if p.admin {
            continue;
        }
        let Some(soft) = share_memory(node, p) else {
            continue;
        };
        let entries = entries.clone().unwrap_or_else(|| {
            let class = class_of(&claim.spec, &p.request).and_then(|c| classes.get(c));
            from_spec(&claim.spec, class)
        });
        burst(a, node, p, soft, &entries);
    }
}

/// What a share is held to, as prepare holds it ([`shares::held_memory`]): the memory it
/// consumes, else in integer mode its part of the GPU, else nothing (`Some(None)`: an
/// `unlimited` share that asked for no memory). `None` where `p` is no share: a device
/// allocated once, or all of a GPU's memory (the whole GPU, as `--shared-capacity` prepares it).
fn share_memory(node: &Node, p: &Pick) -> Option<Option<u64>> {
    let dev = &node.devices[p.device];
    if !dev.shared() {
        return None;
    }
    let total = dev.capacity("memory")?;
    let consumed = |name: &str| {
        p.consumed
            .iter()
            .find(|(k, _)| super::qualify(k, &dev.driver) == super::qualify(name, &dev.driver))
            .map(|(_, v)| *v)
    };
    let memory = consumed("memory")?;
    if memory >= total {
        return None;
    }
    let whole = |v: i128| u64::try_from(v / 1000).ok();
    let shares = match (consumed("shares"), dev.capacity("shares")) {
        (Some(count), Some(of)) => Some(shares::Shares {
            count: u32::try_from(count / 1000).ok()?,
            of: u32::try_from(of / 1000).ok()?,
        }),
        _ => None,
    };
    Some(shares::held_memory(whole(memory)?, shares, whole(total)?))
}

/// Sets `a`'s burst limit, or its config's problem, from the config that applies to it.
fn burst(a: &mut Allocated, node: &Node, p: &Pick, soft: Option<u64>, entries: &[ConfigEntry]) {
    let dev = &node.devices[p.device];
    let total = dev
        .capacity("memory")
        .and_then(|t| u64::try_from(t / 1000).ok())
        .unwrap_or(0);
    let kind = match dev.device.attributes.as_ref().and_then(|a| a.get("type")) {
        Some(t) if t.string.as_deref() == Some("mig") => DeviceKind::Mig,
        _ => DeviceKind::Gpu,
    };
    let name = &dev.device.name;
    let limit = sharing::config_for_device(entries, &dev.driver, &p.request, kind, name)
        .and_then(|c| sharing::sharing_for(c, kind, name))
        .and_then(|s| sharing::share_config(&s))
        .and_then(|c| c.hard_limit(soft, total));
    match limit {
        Ok(Some(hard)) if Some(hard) != soft => {
            a.burst_limit = Some(format_milli(i128::from(hard) * 1000));
        }
        Ok(_) => {}
        Err(e) => a.config_error = Some(crate::report::chain(&e).to_string()),
    }
}

/// The base request's or subrequest's device class in `spec` (`req` or `req/sub`).
fn class_of<'a>(spec: &'a ResourceClaimSpec, request: &str) -> Option<&'a str> {
    let (base, sub) = match request.split_once('/') {
        Some((b, s)) => (b, Some(s)),
        None => (request, None),
    };
    let r = spec
        .devices
        .as_ref()?
        .requests
        .iter()
        .flatten()
        .find(|r| r.name == base)?;
    match sub {
        None => r.exactly.as_ref().map(|e| e.device_class_name.as_str()),
        Some(s) => r
            .first_available
            .iter()
            .flatten()
            .find(|x| x.name == s)
            .map(|x| x.device_class_name.as_str()),
    }
}

/// The config entries an allocation made from `spec` would carry for a request of `class`:
/// the class's, then the claim's.
fn from_spec(spec: &ResourceClaimSpec, class: Option<&Class>) -> Vec<ConfigEntry> {
    let claim = spec
        .devices
        .iter()
        .flat_map(|d| d.config.iter().flatten())
        .filter_map(|c| {
            let o = c.opaque.as_ref()?;
            Some(ConfigEntry {
                source: ConfigSource::FromClaim,
                requests: c.requests.clone().unwrap_or_default(),
                driver: o.driver.clone(),
                parameters: o.parameters.0.clone(),
            })
        });
    class
        .map(|c| c.config.clone())
        .unwrap_or_default()
        .into_iter()
        .chain(claim)
        .collect()
}
