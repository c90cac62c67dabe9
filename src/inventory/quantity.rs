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

/// Parses a Kubernetes quantity of bytes (`80Gi`, `4864Mi`, `1G`, `1024`) into bytes.
pub fn parse_quantity(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, suffix) = s.split_at(split);
    let value: u64 = digits.parse().ok()?;
    let mult: u64 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    };
    value.checked_mul(mult)
}
