//! The driver and node names, checked once where a plugin is configured: both are DNS
//! subdomains (lower-case letters, digits, `-` and `.`, starting and ending with a letter or
//! digit), a driver name at most 63 characters (the API server's limit for
//! `ResourceSlice.spec.driver`), a node name at most 253.

/// A driver or node name the API server would refuse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} name {name:?}: {why}")]
pub struct InvalidName {
    what: &'static str,
    name: String,
    why: &'static str,
}

/// Checks `name` as a `what` (`"driver"` or `"node"`) name.
pub(crate) fn check(what: &'static str, name: &str) -> Result<(), InvalidName> {
    let max = if what == "driver" { 63 } else { 253 };
    let fail = |why| {
        Err(InvalidName {
            what,
            name: name.to_string(),
            why,
        })
    };
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if name.is_empty() {
        return fail("it is empty");
    }
    if name.len() > max {
        return fail(if max == 63 {
            "it is longer than 63 characters"
        } else {
            "it is longer than 253 characters"
        });
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.')
    {
        return fail("only lower-case letters, digits, '-' and '.' are allowed");
    }
    if !edge(name.chars().next()) || !edge(name.chars().last()) {
        return fail("it must start and end with a lower-case letter or digit");
    }
    if name.split('.').any(str::is_empty) {
        return fail("it has an empty part between dots");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check;

    #[test]
    fn dns_subdomains_pass_and_the_rest_say_why() {
        check("driver", "fpga.example.com").unwrap();
        check("node", "ip-10-0-0-1.ec2.internal").unwrap();
        let e = check("driver", "FPGA.example.com").unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid driver name \"FPGA.example.com\": only lower-case letters, digits, '-' and \
             '.' are allowed"
        );
        assert!(check("node", "").unwrap_err().to_string().contains("empty"));
        assert!(check("node", "-a").is_err());
        assert!(check("node", "a..b").is_err());
        assert!(check("driver", &"a".repeat(64)).is_err());
        check("node", &"a".repeat(64)).unwrap();
    }
}
