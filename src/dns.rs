//! RFC 1123 names as Kubernetes checks them: the one validator for DNS labels and subdomains
//! (object names, driver names, pool and device names, label-key prefixes).

/// A lower-case DNS label: 1..=`max` characters of `[a-z0-9-]`, alphanumeric at both ends.
pub fn is_label(s: &str, max: usize) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= max
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// A lower-case DNS subdomain: 1..=`max` characters, dot-separated labels of at most 63.
pub fn is_subdomain(s: &str, max: usize) -> bool {
    !s.is_empty() && s.len() <= max && s.split('.').all(|l| is_label(l, 63))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        for ok in ["a", "gpu-0", "0", "a-b-c"] {
            assert!(is_label(ok, 63), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a.b", "a_b", "é"] {
            assert!(!is_label(bad, 63), "{bad}");
        }
        assert!(is_label(&"a".repeat(63), 63));
        assert!(!is_label(&"a".repeat(64), 63));
        assert!(!is_label("abcd", 3));
    }

    #[test]
    fn subdomains() {
        for ok in ["gpu.nvidia.com", "node-a", "a.b-c.d"] {
            assert!(is_subdomain(ok, 253), "{ok}");
        }
        for bad in ["", ".a", "a.", "a..b", "Gpu.nvidia.com", "a/b", "-a.b"] {
            assert!(!is_subdomain(bad, 253), "{bad}");
        }
        let long_label = format!("{}.com", "a".repeat(64));
        assert!(!is_subdomain(&long_label, 253));
        assert!(!is_subdomain("a.b.c", 4));
    }
}
