//! Trust domains for shares (`--share-trust-domain`): which claims may hold shares of one GPU
//! together. Every share of a GPU (of a MIG device, for its shares) runs behind that device's one
//! MPS daemon, whose limits are client settings and whose faults end every client, so shares
//! should go only to workloads that trust each other. The rule says who that is:
//!
//! - `off` (the default): anyone, as before the rule.
//! - `namespace`: claims of one namespace.
//! - `label:<key>`: claims of namespaces with the same value of label `<key>` on the Namespace
//!   object (read through the API: a pod's or claim's own labels are its author's to write, and
//!   no trust boundary). A namespace without the label is a domain of its own.
//!
//! Two claims of one namespace always share (a namespace has one value of any label). What a
//! claim was admitted under is recorded with it ([`TrustLabel`]), so a later claim is compared
//! with the value its holders were admitted with, not one read later. Pure: no I/O here.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The rule: who may hold shares of one GPU together.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TrustDomain {
    /// Claims of any namespace.
    #[default]
    Off,
    /// Claims of one namespace.
    Namespace,
    /// Claims of namespaces with one value of this label (a valid label key).
    Label(String),
}

/// The value of the rule's label on a claim's namespace when its share was admitted, recorded
/// with the claim in the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrustLabel {
    pub key: String,
    pub value: String,
}

/// A claim as the rule sees it: its namespace and, where recorded, its namespace's label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member<'a> {
    pub namespace: &'a str,
    pub label: Option<&'a TrustLabel>,
}

impl TrustDomain {
    pub fn enabled(&self) -> bool {
        *self != TrustDomain::Off
    }

    /// The label key whose value prepare must read from a share's Namespace.
    pub fn label_key(&self) -> Option<&str> {
        match self {
            TrustDomain::Label(key) => Some(key),
            _ => None,
        }
    }

    /// Whether `a` and `b` may hold shares of one GPU together.
    pub fn admits(&self, a: Member<'_>, b: Member<'_>) -> bool {
        if a.namespace == b.namespace {
            return true;
        }
        match self {
            TrustDomain::Off => true,
            TrustDomain::Namespace => false,
            TrustDomain::Label(_) => match (self.value_of(a), self.value_of(b)) {
                (Some(x), Some(y)) => x == y,
                // A namespace without the label is a domain of its own.
                _ => false,
            },
        }
    }

    /// `m`'s label value under this rule: recorded for this rule's key, else none.
    fn value_of<'a>(&self, m: Member<'a>) -> Option<&'a str> {
        let key = self.label_key()?;
        m.label.filter(|l| l.key == key).map(|l| l.value.as_str())
    }

    /// `m`'s domain in words, as an error names it: `namespace team-a`, `team=blue (namespace
    /// team-a)`, `namespace team-a (no label team)`.
    pub fn describe(&self, m: Member<'_>) -> String {
        match (self.label_key(), self.value_of(m)) {
            (Some(key), Some(value)) => format!("{key}={value} (namespace {})", m.namespace),
            (Some(key), None) => format!("namespace {} (no label {key})", m.namespace),
            (None, _) => format!("namespace {}", m.namespace),
        }
    }
}

impl fmt::Display for TrustDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TrustDomain::Off => f.write_str("off"),
            TrustDomain::Namespace => f.write_str("namespace"),
            TrustDomain::Label(key) => write!(f, "label:{key}"),
        }
    }
}

impl FromStr for TrustDomain {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "off" => Ok(TrustDomain::Off),
            "namespace" => Ok(TrustDomain::Namespace),
            other => match other.strip_prefix("label:") {
                Some(key) => {
                    check_label_key(key)?;
                    Ok(TrustDomain::Label(key.to_string()))
                }
                None => Err(format!(
                    "{other:?} is not a trust domain: give off, namespace, or label:<key> (a \
                     Namespace label, e.g. label:example.com/tenant)"
                )),
            },
        }
    }
}

/// A Kubernetes label key: `[prefix/]name`, the prefix a DNS subdomain of at most 253
/// characters, the name at most 63 of `[A-Za-z0-9._-]`, beginning and ending alphanumeric.
fn check_label_key(key: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("label:{key}: {why}"));
    let (prefix, name) = match key.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && !crate::dns::is_subdomain(p, 253)
    {
        return bad("its prefix is not a lower-case DNS subdomain of at most 253 characters");
    }
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if name.is_empty()
        || name.len() > 63
        || !alnum(name.chars().next())
        || !alnum(name.chars().last())
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    {
        return bad(
            "not a label key: a name of at most 63 letters, digits, '-', '_' or '.', beginning \
             and ending with a letter or digit, after an optional DNS prefix and '/'",
        );
    }
    Ok(())
}

impl Serialize for TrustDomain {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for TrustDomain {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn label(value: &str) -> TrustLabel {
        TrustLabel {
            key: "team".into(),
            value: value.into(),
        }
    }

    fn m<'a>(namespace: &'a str, label: Option<&'a TrustLabel>) -> Member<'a> {
        Member { namespace, label }
    }

    #[test]
    fn parses_and_prints_each_rule() {
        for s in ["off", "namespace", "label:team", "label:example.com/tenant"] {
            let rule: TrustDomain = s.parse().unwrap();
            assert_eq!(rule.to_string(), s);
        }
        assert_eq!(
            "label:example.com/tenant".parse::<TrustDomain>().unwrap(),
            TrustDomain::Label("example.com/tenant".into())
        );
        for (bad, says) in [
            ("tenant", "not a trust domain"),
            ("label:", "not a label key"),
            ("label:-team", "not a label key"),
            ("label:Example.com/team", "prefix"),
            ("label:a/b/c", "prefix"),
            (&format!("label:{}", "x".repeat(64)), "not a label key"),
        ] {
            let e = bad.parse::<TrustDomain>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn namespace_rule_admits_one_namespace_only() {
        let r = TrustDomain::Namespace;
        assert!(r.admits(m("a", None), m("a", None)));
        assert!(!r.admits(m("a", None), m("b", None)));
        // Off admits every pair.
        assert!(TrustDomain::Off.admits(m("a", None), m("b", None)));
    }

    #[test]
    fn label_rule_admits_one_value_and_keeps_unlabelled_namespaces_apart() {
        let r = TrustDomain::Label("team".into());
        let (blue, red) = (label("blue"), label("red"));
        assert!(r.admits(m("a", Some(&blue)), m("b", Some(&blue))));
        assert!(!r.admits(m("a", Some(&blue)), m("b", Some(&red))));
        // No label: its own namespace only.
        assert!(!r.admits(m("a", None), m("b", None)));
        assert!(!r.admits(m("a", Some(&blue)), m("b", None)));
        assert!(r.admits(m("a", None), m("a", Some(&blue))));
        // A value recorded for another key (the rule changed) counts as none.
        let other = TrustLabel {
            key: "tenant".into(),
            value: "blue".into(),
        };
        assert!(!r.admits(m("a", Some(&other)), m("b", Some(&blue))));
        assert_eq!(r.describe(m("a", Some(&blue))), "team=blue (namespace a)");
        assert_eq!(
            r.describe(m("a", Some(&other))),
            "namespace a (no label team)"
        );
        assert_eq!(TrustDomain::Namespace.describe(m("a", None)), "namespace a");
    }
}
