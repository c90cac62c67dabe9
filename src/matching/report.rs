//! The result of `nvdra match` for one claim, as a table for people and JSON for machines.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use k8s_openapi::api::resource::v1::DeviceConstraint;
use serde::Serialize;

use super::{ClaimInput, Node, Pick, Request, Want, format_milli};

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimReport {
    pub kind: String,
    pub name: String,
    /// `metadata.namespace`, `default` where the object names none (as `kubectl apply` puts
    /// it): two claims of one name in two namespaces are two claims.
    pub namespace: String,
    pub file: String,
    /// The node, when several were explained (`--kubeconfig`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    pub satisfiable: bool,
    /// Already allocated (`status.allocation`): not matched again, it holds its devices.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub allocated: bool,
    pub requests: Vec<RequestReport>,
    pub constraints: Vec<String>,
    /// A possible allocation: (request, device) pairs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocation: Option<Vec<Allocated>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Allocated {
    pub request: String,
    pub driver: String,
    pub pool: String,
    pub device: String,
    /// What the allocation takes of a shared device, as `status.allocation` would record it.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub consumed_capacity: BTreeMap<String, String>,
    /// With admin access: the device may be in use by other claims, and this allocation holds
    /// it for none after it.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub admin_access: bool,
    /// A share whose config asks for a burst limit above what it consumes: the most memory it
    /// may use (its hard limit). The scheduler packs it by `consumedCapacity` alone.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst_limit: Option<String>,
    /// What prepare would refuse in a share's config (the field and why): the scheduler
    /// allocates it, and the node then does not prepare it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config_error: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestReport {
    /// `req` or `req/sub`.
    pub name: String,
    pub device_class_name: String,
    /// A number, or `All`.
    pub count: String,
    /// `adminAccess: true`: devices in use by other claims fit.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub admin_access: bool,
    pub fits: Vec<String>,
    pub rejected: Vec<Rejected>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Rejected {
    pub device: String,
    pub reason: String,
}

pub(super) fn build(
    claim: &ClaimInput,
    requests: &[Request],
    constraints: &[DeviceConstraint],
    node: &Node,
    allocation: Option<Vec<Pick>>,
    reason: Option<String>,
) -> ClaimReport {
    let name = |d: usize| node.devices[d].device.name.clone();
    ClaimReport {
        kind: claim.kind.to_string(),
        name: claim.name.clone(),
        namespace: claim.namespace().to_string(),
        file: claim.origin.file.display().to_string(),
        node: None,
        satisfiable: allocation.is_some(),
        allocated: false,
        requests: requests
            .iter()
            .flat_map(|r| r.alternatives.iter())
            .map(|a| RequestReport {
                name: a.name.clone(),
                device_class_name: a.class.clone(),
                count: match a.want {
                    Want::Count(n) => n.to_string(),
                    Want::All => "All".into(),
                },
                admin_access: a.admin,
                fits: a.fits.iter().map(|&d| name(d)).collect(),
                rejected: a
                    .rejected
                    .iter()
                    .map(|(d, why)| Rejected {
                        device: name(*d),
                        reason: why.clone(),
                    })
                    .chain(a.withdrawn.iter().map(|(device, why)| Rejected {
                        device: device.clone(),
                        reason: why.clone(),
                    }))
                    .collect(),
            })
            .collect(),
        constraints: constraints
            .iter()
            .map(|c| {
                let over = match c.requests.as_deref() {
                    None | Some([]) => "all requests".to_string(),
                    Some(rs) => rs.join(", "),
                };
                match (&c.match_attribute, &c.distinct_attribute) {
                    (Some(a), _) => format!("matchAttribute {a} over {over}"),
                    (_, Some(a)) => format!("distinctAttribute {a} over {over}"),
                    _ => format!("constraint over {over}"),
                }
            })
            .collect(),
        allocation: allocation.map(|picks| allocations(node, picks)),
        reason,
    }
}

fn allocations(node: &Node, picks: Vec<Pick>) -> Vec<Allocated> {
    picks
        .into_iter()
        .map(
            |Pick {
                 request,
                 device,
                 consumed,
                 admin,
             }| Allocated {
                request,
                driver: node.devices[device].driver.clone(),
                pool: node.devices[device].pool.clone(),
                device: node.devices[device].device.name.clone(),
                consumed_capacity: consumed
                    .into_iter()
                    .map(|(k, v)| (k, format_milli(v)))
                    .collect(),
                admin_access: admin,
                burst_limit: None,
                config_error: None,
            },
        )
        .collect()
}

/// The report of a claim that is already allocated: the devices it holds, or which of them the
/// node does not have.
pub(super) fn allocated(
    claim: &ClaimInput,
    node: &Node,
    found: Vec<Pick>,
    missing: Vec<String>,
) -> ClaimReport {
    ClaimReport {
        kind: claim.kind.to_string(),
        name: claim.name.clone(),
        namespace: claim.namespace().to_string(),
        file: claim.origin.file.display().to_string(),
        node: None,
        satisfiable: missing.is_empty(),
        allocated: true,
        requests: Vec::new(),
        constraints: Vec::new(),
        allocation: Some(allocations(node, found)),
        reason: (!missing.is_empty()).then(|| {
            format!(
                "allocated to devices the node does not have: {}",
                missing.join(", ")
            )
        }),
    }
}

/// The reports as text: per request the fitting devices and each other device's first failing
/// check, then the allocation or why there is none.
pub fn render_table(reports: &[ClaimReport]) -> String {
    let mut out = String::new();
    for (i, r) in reports.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let _ = write!(out, "{} {}/{} ({})", r.kind, r.namespace, r.name, r.file);
        match &r.node {
            Some(n) => {
                let _ = writeln!(out, " on node {n}");
            }
            None => out.push('\n'),
        }
        for q in &r.requests {
            let admin = if q.admin_access {
                " (admin access)"
            } else {
                ""
            };
            let _ = writeln!(
                out,
                "  request {}: {} × {}{admin}",
                q.name, q.count, q.device_class_name
            );
            let fits = if q.fits.is_empty() {
                "(none)".to_string()
            } else {
                q.fits.join(", ")
            };
            let _ = writeln!(out, "    fits: {fits}");
            let width = q.rejected.iter().map(|x| x.device.len()).max().unwrap_or(0);
            for x in &q.rejected {
                let _ = writeln!(out, "    {:<width$}  {}", x.device, x.reason);
            }
        }
        for c in &r.constraints {
            let _ = writeln!(out, "  constraint: {c}");
        }
        let picks = |a: &[Allocated]| -> String {
            a.iter()
                .map(|x| {
                    let mut notes: Vec<String> = x
                        .consumed_capacity
                        .iter()
                        .map(|(k, v)| format!("{k} {v}"))
                        .collect();
                    if x.admin_access {
                        notes.push("admin access".into());
                    }
                    if let Some(limit) = &x.burst_limit {
                        notes.push(format!("may burst to {limit}"));
                    }
                    if let Some(e) = &x.config_error {
                        notes.push(format!("refused at prepare: {e}"));
                    }
                    if notes.is_empty() {
                        format!("{} → {}", x.request, x.device)
                    } else {
                        format!("{} → {} ({})", x.request, x.device, notes.join(", "))
                    }
                })
                .collect::<Vec<_>>()
                .join(", ")
        };
        match (&r.allocation, &r.reason) {
            (Some(a), Some(why)) if r.allocated => {
                let _ = writeln!(out, "  allocated: {}; {why}", picks(a));
            }
            (Some(a), _) if r.allocated => {
                let _ = writeln!(out, "  allocated: {}", picks(a));
            }
            (Some(a), _) => {
                let _ = writeln!(out, "  satisfiable: {}", picks(a));
            }
            (None, Some(why)) => {
                let _ = writeln!(out, "  not satisfiable: {why}");
            }
            (None, None) => {
                let _ = writeln!(out, "  not satisfiable");
            }
        }
    }
    out
}
