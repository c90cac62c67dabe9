//! Device taints against a request's tolerations, as the scheduler's allocator decides them.
//!
//! A device is allocatable for a (sub)request only when each of its taints with effect
//! `NoSchedule` or `NoExecute` is tolerated by one of the request's tolerations. Effect `None`,
//! and effects this version does not know, never block (the API says consumers must treat an
//! unknown effect as no effect). `tolerationSeconds` only matters for eviction, not allocation,
//! and admin-access requests are not exempt.

use k8s_openapi::api::resource::v1::{DeviceTaint, DeviceToleration};

/// The effects that keep an untolerating request off a device.
fn blocks(effect: &str) -> bool {
    matches!(effect, "NoSchedule" | "NoExecute")
}

/// Whether `t` tolerates `taint`: Kubernetes' `ToleratesTaint`, the rule pod tolerations use.
/// An empty effect matches every effect and an empty key every key; then `Exists` matches any
/// value and `Equal` (the default) the same value, a missing one being `""`. Any other operator
/// tolerates nothing (`explain` refuses such a claim before it gets here).
fn tolerates(t: &DeviceToleration, taint: &DeviceTaint) -> bool {
    let effect = t.effect.as_deref().unwrap_or_default();
    if !effect.is_empty() && effect != taint.effect {
        return false;
    }
    let key = t.key.as_deref().unwrap_or_default();
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match t.operator.as_deref().unwrap_or("Equal") {
        "Exists" => true,
        "Equal" | "" => {
            t.value.as_deref().unwrap_or_default() == taint.value.as_deref().unwrap_or_default()
        }
        _ => false,
    }
}

/// Whether `op` is an operator a toleration may have (absent means `Equal`).
pub(super) fn valid_operator(op: Option<&str>) -> bool {
    matches!(op, None | Some("Exists" | "Equal"))
}

/// The device's taints that keep this request off it, in the device's order.
pub(super) fn untolerated<'a>(
    taints: &'a [DeviceTaint],
    tolerations: &[DeviceToleration],
) -> Vec<&'a DeviceTaint> {
    taints
        .iter()
        .filter(|taint| blocks(&taint.effect) && !tolerations.iter().any(|t| tolerates(t, taint)))
        .collect()
}

/// `key=value:Effect`, or `key:Effect` without a value: how kubectl writes a taint.
pub(super) fn describe(taint: &DeviceTaint) -> String {
    match taint.value.as_deref() {
        Some(v) if !v.is_empty() => format!("{}={v}:{}", taint.key, taint.effect),
        _ => format!("{}:{}", taint.key, taint.effect),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn taint(key: &str, value: Option<&str>, effect: &str) -> DeviceTaint {
        DeviceTaint {
            key: key.into(),
            value: value.map(Into::into),
            effect: effect.into(),
            time_added: None,
        }
    }

    fn tol(key: &str, op: Option<&str>, value: Option<&str>, effect: &str) -> DeviceToleration {
        let s = |v: &str| (!v.is_empty()).then(|| v.to_string());
        DeviceToleration {
            key: s(key),
            operator: op.map(Into::into),
            value: value.map(Into::into),
            effect: s(effect),
            toleration_seconds: None,
        }
    }

    const KEY: &str = "gpu.nvidia.com/xid";

    #[test]
    fn the_toleration_rule_is_kubernetes_tolerates_taint() {
        let xid = taint(KEY, Some("79"), "NoSchedule");
        let cases = [
            // Equal (explicit and default) needs the key and the value.
            (tol(KEY, Some("Equal"), Some("79"), ""), true),
            (tol(KEY, None, Some("79"), ""), true),
            (tol(KEY, None, Some("48"), ""), false),
            (tol(KEY, None, None, ""), false),
            (tol("gpu.nvidia.com/gpu-lost", None, Some("79"), ""), false),
            // Exists: any value of the key; without a key, every taint.
            (tol(KEY, Some("Exists"), None, ""), true),
            (tol("other", Some("Exists"), None, ""), false),
            (tol("", Some("Exists"), None, ""), true),
            // The effect, when given, must be the taint's.
            (tol(KEY, Some("Exists"), None, "NoSchedule"), true),
            (tol(KEY, Some("Exists"), None, "NoExecute"), false),
            (tol("", Some("Exists"), None, "NoExecute"), false),
            // An operator Kubernetes does not know tolerates nothing.
            (tol(KEY, Some("In"), Some("79"), ""), false),
        ];
        for (t, want) in cases {
            assert_eq!(tolerates(&t, &xid), want, "{t:?}");
        }
        // A taint without a value is tolerated by Equal with no (or an empty) value.
        let lost = taint("gpu.nvidia.com/gpu-lost", None, "NoExecute");
        assert!(tolerates(
            &tol("gpu.nvidia.com/gpu-lost", None, None, ""),
            &lost
        ));
        assert!(tolerates(
            &tol("gpu.nvidia.com/gpu-lost", None, Some(""), ""),
            &lost
        ));
    }

    #[test]
    fn only_no_schedule_and_no_execute_block() {
        let taints = [
            taint("a", None, "None"),
            taint("b", None, "PreferNoSchedule"),
            taint("c", Some("1"), "NoSchedule"),
            taint("d", None, "NoExecute"),
        ];
        let left: Vec<String> = untolerated(&taints, &[])
            .into_iter()
            .map(describe)
            .collect();
        assert_eq!(left, ["c=1:NoSchedule", "d:NoExecute"]);
        let left = untolerated(&taints, &[tol("d", Some("Exists"), None, "")]);
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].key, "c");
    }
}
