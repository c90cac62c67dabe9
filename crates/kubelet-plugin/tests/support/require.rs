//! The one rule for a peer a test needs but may go without (python3's grpcio, podman, helm, a
//! tmpfs, ...): without it the test is skipped, saying why, unless its variable
//! (`NVDRA_REQUIRE_<PEER>`, `KUBELET_PLUGIN_REQUIRE_<PEER>`) requires it, as CI does. Every
//! probe of nvdra and of the kubelet-plugin library reads its variable through [`required`]
//! (nvdra's test support and unit tests include this file by path).
// Each test binary uses what it needs.
#![allow(dead_code)]

/// Whether the environment variable `var` requires its peer: `1`, `true` and `yes` (any case)
/// do; unset, empty, `0`, `false` and `no` do not. Any other value panics naming the variable:
/// a misspelt value must not turn a check CI means to run into a silent skip.
pub fn required(var: &str) -> bool {
    match std::env::var_os(var) {
        None => false,
        Some(v) => truth(var, v.to_str()),
    }
}

/// [`required`] for the value `value` of `var` (`None`: not UTF-8).
pub fn truth(var: &str, value: Option<&str>) -> bool {
    let known = value.map(|v| v.trim().to_ascii_lowercase());
    match known.as_deref() {
        Some("1" | "true" | "yes") => true,
        Some("" | "0" | "false" | "no") => false,
        _ => panic!(
            "{var}={:?} is not a truth value: set it to 1, true or yes to require the peer, \
             or to 0, false or no (or unset it) to let the test skip without it",
            value.unwrap_or("(not UTF-8)")
        ),
    }
}
