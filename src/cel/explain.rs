//! Why a device fails a selector, in the user's terms: the first conjunct of the selector that
//! is false, shown as the comparison it makes with the device's own value
//! (`memory 40Gi < 80Gi`, `type "mig" != "gpu"`), or the conjunct's text with the device values it
//! reads when it is not a plain comparison.

use kube_cel::cel::Value;
use kube_cel::cel::common::ast::{Expr, IdedExpr, LiteralValue, operators};

use super::guard::{self, unwrap};
use super::{DeviceValue, Environment, EvalError, Selector};

pub(super) fn explain(sel: &Selector, env: &Environment, dev: &DeviceValue) -> Option<String> {
    let mut conjuncts = Vec::new();
    flatten_and(&sel.program, &mut conjuncts);
    for c in conjuncts {
        match sel.value_of(env, dev, c) {
            Ok(Value::Bool(true)) => continue,
            Ok(Value::Bool(false)) => return Some(describe_false(sel, env, dev, c)),
            Ok(other) => {
                return Some(
                    EvalError::NotBool {
                        found: super::type_name(&other).to_string(),
                    }
                    .to_string(),
                );
            }
            Err(e) => return Some(format!("error: {e}")),
        }
    }
    // Every conjunct holds; the whole may still fail (an error absorbed differently).
    match sel.evaluate(env, dev) {
        Ok(true) => None,
        Ok(false) => Some(format!("{} is false", sel.source)),
        Err(e) => Some(format!("error: {e}")),
    }
}

fn flatten_and<'a>(e: &'a IdedExpr, out: &mut Vec<&'a IdedExpr>) {
    let inner = unwrap(e);
    match &inner.expr {
        Expr::Call(c) if c.func_name == operators::LOGICAL_AND && c.args.len() == 2 => {
            flatten_and(&c.args[0], out);
            flatten_and(&c.args[1], out);
        }
        _ => out.push(e),
    }
}

/// The relation that holds when `op` does not.
fn negate(op: &str) -> Option<&'static str> {
    Some(match op {
        operators::GREATER_EQUALS => "<",
        operators::GREATER => "<=",
        operators::LESS => ">=",
        operators::LESS_EQUALS => ">",
        operators::EQUALS => "!=",
        operators::NOT_EQUALS => "==",
        _ => return None,
    })
}

fn describe_false(sel: &Selector, env: &Environment, dev: &DeviceValue, c: &IdedExpr) -> String {
    let inner = unwrap(c);
    if let Expr::Call(call) = &inner.expr {
        // a OP b, or a.compareTo(b) OP 0
        if let (Some(neg), [a, b]) = (negate(&call.func_name), call.args.as_slice()) {
            let (lhs, rhs) = match &unwrap(a).expr {
                Expr::Call(cmp)
                    if cmp.func_name == "compareTo"
                        && cmp.args.len() == 1
                        && cmp.target.is_some()
                        && is_zero(b) =>
                {
                    (cmp.target.as_deref().unwrap_or(a), &cmp.args[0])
                }
                _ => (a, b),
            };
            return relation(sel, env, dev, lhs, neg, rhs);
        }
        if let (Some(target), [arg]) = (call.target.as_deref(), call.args.as_slice()) {
            match call.func_name.as_str() {
                "isGreaterThan" => return relation(sel, env, dev, target, "<=", arg),
                "isLessThan" => return relation(sel, env, dev, target, ">=", arg),
                "matches" => {
                    let v = shown(sel, env, dev, target);
                    let re = shown(sel, env, dev, arg);
                    return format!("{} {v} does not match {re}", name_of(target, dev));
                }
                _ => {}
            }
        }
    }
    let mut refs = Vec::new();
    device_refs(c, &mut refs);
    let values: Vec<String> = refs
        .iter()
        .map(|r| format!("{} {}", name_of(r, dev), shown(sel, env, dev, r)))
        .collect();
    if values.is_empty() {
        format!("{} is false", sel.source)
    } else {
        format!("{} is false ({})", sel.source, values.join(", "))
    }
}

fn relation(
    sel: &Selector,
    env: &Environment,
    dev: &DeviceValue,
    lhs: &IdedExpr,
    op: &str,
    rhs: &IdedExpr,
) -> String {
    let l = shown(sel, env, dev, lhs);
    let r = shown(sel, env, dev, rhs);
    format!("{} {l} {op} {r}", name_of(lhs, dev))
}

fn is_zero(e: &IdedExpr) -> bool {
    matches!(&unwrap(e).expr, Expr::Literal(LiteralValue::Int(i)) if i.inner() == &0)
}

/// `e` evaluated for the device and shown as a user wrote it.
fn shown(sel: &Selector, env: &Environment, dev: &DeviceValue, e: &IdedExpr) -> String {
    match sel.value_of(env, dev, e) {
        Ok(v) => describe_value(&v),
        Err(err) => format!("<{err}>"),
    }
}

/// A value the way it would be written in a selector or a manifest: strings quoted, quantities
/// in canonical form (`80Gi`), versions as `1.2.3`.
pub fn describe_value(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        Value::Int(i) => i.to_string(),
        Value::UInt(u) => format!("{u}u"),
        Value::Float(f) => f.to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Null => "null".into(),
        Value::Opaque(o) => {
            let debug = format!("{:?}", o.as_debug());
            opaque_text(o.runtime_type_name(), &debug).unwrap_or(debug)
        }
        Value::List(l) => format!(
            "[{}]",
            l.iter().map(describe_value).collect::<Vec<_>>().join(", ")
        ),
        other => format!("{other:?}"),
    }
}

/// A quantity or semver from its Debug form (kube-cel keeps their types private).
fn opaque_text(type_name: &str, debug: &str) -> Option<String> {
    let field = |name: &str| -> Option<i128> {
        let at = debug.find(&format!("{name}: "))? + name.len() + 2;
        let rest = &debug[at..];
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '-'))
            .unwrap_or(rest.len());
        rest[..end].parse().ok()
    };
    match type_name {
        "kubernetes.Quantity" => {
            let mantissa = field("mantissa")?;
            let scale = field("scale")?;
            if (0..=30).contains(&scale) {
                let value = mantissa.checked_mul(10i128.checked_pow(scale as u32)?)?;
                if let Ok(bytes) = u64::try_from(value) {
                    return Some(crate::inventory::quantity(bytes));
                }
                return Some(value.to_string());
            }
            // A fraction: mantissa × 10^scale with a negative scale.
            let digits = mantissa.unsigned_abs().to_string();
            let places = usize::try_from(-scale).ok()?;
            let sign = if mantissa < 0 { "-" } else { "" };
            let padded = format!("{digits:0>width$}", width = places + 1);
            let (int, frac) = padded.split_at(padded.len() - places);
            Some(format!("{sign}{int}.{frac}"))
        }
        "kubernetes.Semver" => {
            let (major, minor, patch) = (field("major")?, field("minor")?, field("patch")?);
            Some(format!("{major}.{minor}.{patch}"))
        }
        _ => None,
    }
}

/// The name a user knows a device reference by: the attribute or capacity name (with its domain
/// when it is not the driver's), `driver`, or the expression's shape.
fn name_of(e: &IdedExpr, dev: &DeviceValue) -> String {
    if let Some((domain, name)) = device_ref(e) {
        return if domain.as_deref() == Some(dev.driver()) || domain.is_none() {
            name
        } else {
            format!("{}/{name}", domain.unwrap_or_default())
        };
    }
    // A method chain on a device reference (`productName.lowerAscii()`): name the reference.
    if let Expr::Call(c) = &unwrap(e).expr
        && let Some(t) = c.target.as_deref()
    {
        return name_of(t, dev);
    }
    "value".into()
}

/// `device.attributes[D].n`, `device.capacity[D]["n"]`, `device.driver`: (domain, name).
fn device_ref(e: &IdedExpr) -> Option<(Option<String>, String)> {
    let e = unwrap(e);
    match &e.expr {
        Expr::Select(s) if !s.test => {
            if matches!(&unwrap(&s.operand).expr, Expr::Ident(n) if n == "device") {
                return matches!(s.field.as_str(), "driver" | "allowMultipleAllocations")
                    .then(|| (None, s.field.clone()));
            }
            Some((domain_of(&s.operand)?, s.field.clone()))
        }
        Expr::Call(c) if c.func_name == operators::INDEX && c.args.len() == 2 => {
            let Expr::Literal(LiteralValue::String(name)) = &unwrap(&c.args[1]).expr else {
                return None;
            };
            Some((domain_of(&c.args[0])?, name.inner().to_string()))
        }
        _ => None,
    }
}

/// The domain of a rewritten `device.attributes[D]` lookup.
fn domain_of(e: &IdedExpr) -> Option<Option<String>> {
    match &unwrap(e).expr {
        Expr::Call(c) if c.func_name == guard::DOMAIN && c.args.len() == 2 => {
            match &unwrap(&c.args[1]).expr {
                Expr::Literal(LiteralValue::String(d)) => Some(Some(d.inner().to_string())),
                _ => Some(None),
            }
        }
        _ => None,
    }
}

fn device_refs<'a>(e: &'a IdedExpr, out: &mut Vec<&'a IdedExpr>) {
    if device_ref(e).is_some() {
        if !out.iter().any(|o| o == &e) {
            out.push(e);
        }
        return;
    }
    match &e.expr {
        Expr::Call(c) => {
            if let Some(t) = &c.target {
                device_refs(t, out);
            }
            for a in &c.args {
                device_refs(a, out);
            }
        }
        Expr::Select(s) => device_refs(&s.operand, out),
        Expr::List(l) => l.elements.iter().for_each(|x| device_refs(x, out)),
        Expr::Comprehension(c) => {
            device_refs(&c.iter_range, out);
            device_refs(&c.accu_init, out);
            device_refs(&c.loop_step, out);
            device_refs(&c.result, out);
        }
        _ => {}
    }
}
