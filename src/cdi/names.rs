//! CDI names: the vendor, class and device-name grammar, and claim UIDs as file-name parts.

use super::{Error, Result};

pub(super) const VENDOR_RULE: &str = "a vendor starts with a letter, ends with a letter or digit, and \
                           contains only letters, digits, '_', '.' and '-'";
pub(super) const CLASS_RULE: &str = "a class starts with a letter, ends with a letter or digit, and contains \
                          only letters, digits, '_' and '-'";
pub(super) const NAME_RULE: &str = "a device name starts and ends with a letter or digit and contains only \
                         letters, digits, '_', '.', ':' and '-'";

/// Whether `value` is `first middle* last` (last a letter or digit); a single character passes
/// only when `single_ok` (device names allow it, vendors and classes do not).
pub(super) fn matches_grammar(
    value: &str,
    first: fn(u8) -> bool,
    middle: fn(u8) -> bool,
    single_ok: bool,
) -> bool {
    match value.as_bytes() {
        [] => false,
        [only] => single_ok && first(*only) && only.is_ascii_alphanumeric(),
        [head, mid @ .., tail] => {
            first(*head) && mid.iter().all(|&b| middle(b)) && tail.is_ascii_alphanumeric()
        }
    }
}

pub(super) fn invalid(what: &'static str, value: &str, rule: &'static str) -> Error {
    Error::InvalidName {
        what,
        value: value.to_string(),
        rule,
    }
}

/// Checks a CDI vendor: `[A-Za-z][A-Za-z0-9_.-]*[A-Za-z0-9]`.
pub fn validate_vendor(vendor: &str) -> Result<()> {
    let middle = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-');
    if matches_grammar(vendor, |b| b.is_ascii_alphabetic(), middle, false) {
        Ok(())
    } else {
        Err(invalid("vendor", vendor, VENDOR_RULE))
    }
}

/// Checks a CDI class: `[A-Za-z][A-Za-z0-9_-]*[A-Za-z0-9]`.
pub fn validate_class(class: &str) -> Result<()> {
    let middle = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-');
    if matches_grammar(class, |b| b.is_ascii_alphabetic(), middle, false) {
        Ok(())
    } else {
        Err(invalid("class", class, CLASS_RULE))
    }
}

pub(super) fn is_device_name(name: &str) -> bool {
    let middle = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-');
    matches_grammar(name, |b| b.is_ascii_alphanumeric(), middle, true)
}

/// Checks a CDI device name: `[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?`.
pub fn validate_device_name(name: &str) -> Result<()> {
    if is_device_name(name) {
        Ok(())
    } else {
        Err(invalid("device name", name, NAME_RULE))
    }
}

/// A claim UID becomes a device-name prefix and part of a file name, so it must be a valid CDI
/// device name itself (which also rules out `/`).
pub(super) fn validate_claim_uid(claim_uid: &str) -> Result<()> {
    if is_device_name(claim_uid) {
        Ok(())
    } else {
        Err(invalid(
            "claim UID",
            claim_uid,
            "a claim UID starts and ends with a letter or digit and contains only letters, \
             digits, '_', '.', ':' and '-'",
        ))
    }
}
