//! Kubernetes quantities of bytes: formatting and parsing.

/// Formats bytes as a Kubernetes quantity in canonical binary-SI form (`80Gi`, `4864Mi`).
pub fn quantity(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["", "Ki", "Mi", "Gi", "Ti", "Pi"];
    let mut value = bytes;
    let mut unit = 0;
    while value != 0 && value.is_multiple_of(1024) && unit + 1 < UNITS.len() {
        value /= 1024;
        unit += 1;
    }
    format!("{value}{}", UNITS[unit])
}

/// Parses a Kubernetes quantity of bytes (`80Gi`, `4864Mi`, `1G`, `1024`) into bytes, as the
/// slice rules of the kubelet-plugin library read one.
pub fn parse_quantity(s: &str) -> Option<u64> {
    kubelet_plugin::validate::whole_quantity(s)
}
