use super::*;

#[test]
fn device_names_follow_nvidia() {
    assert_eq!(DeviceName::gpu(0).as_str(), "gpu-0");
    assert_eq!(DeviceName::gpu(17).to_string(), "gpu-17");
    assert_eq!(
        DeviceName::mig(0, "1g.5gb", 19, 0).as_str(),
        "gpu-0-mig-1g5gb-19-0"
    );
    assert_eq!(
        DeviceName::mig(3, "1g.5gb+me", 20, 6).as_str(),
        "gpu-3-mig-1g5gbme-20-6"
    );
    assert_eq!(
        DeviceName::mig(1, "7g.141gb", 0, 0).as_str(),
        "gpu-1-mig-7g141gb-0-0"
    );
}

/// Checkpoints hold device names; they read back only as names this driver makes.
#[test]
fn device_names_parse_by_the_grammar_they_are_made_with() {
    for name in [
        DeviceName::gpu(0),
        DeviceName::gpu(17),
        DeviceName::mig(3, "1g.5gb+me", 20, 6),
        DeviceName::mig(1, "7g.141gb", 0, 0),
        // The shareable twins of checkpoint version 2.
        DeviceName::parse("gpu-0-shared").unwrap(),
        DeviceName::parse("gpu-12-shared").unwrap(),
    ] {
        assert_eq!(DeviceName::parse(name.as_str()).unwrap(), name);
        let json = serde_json::to_string(&name).unwrap();
        assert_eq!(serde_json::from_str::<DeviceName>(&json).unwrap(), name);
    }
    for bad in [
        "",
        "gpu-",
        "gpu-01",
        "gpu-x",
        "eth0",
        "gpu-0-mig-",
        "gpu-0-mig-1g5gb-19",
        "gpu-0-mig-1g.5gb-19-0",
        "gpu-0-nic-1",
        "gpu-0-mig--19-0",
        "gpu-01-shared",
        "gpu--shared",
        "gpu-0-shared-1",
        "gpu-shared",
    ] {
        let e = DeviceName::parse(bad).unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("{bad:?} is not a device name")),
            "{e}"
        );
        assert!(
            serde_json::from_str::<DeviceName>(&format!("{bad:?}")).is_err(),
            "{bad}"
        );
    }
}

/// A claim UID names a file and prefixes CDI device names: nothing else parses.
#[test]
fn claim_uids_follow_the_cdi_device_name_grammar() {
    for ok in ["0", "a", "1d0e4b7a-0000-4000-8000-000000000001", "x:y.z_1"] {
        assert_eq!(ClaimUid::parse(ok).unwrap().as_str(), ok);
    }
    for bad in ["", "-a", "a-", "a/b", "../etc", "a b", ".a"] {
        let e = ClaimUid::parse(bad).unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("invalid CDI device name {bad:?}")),
            "{e}"
        );
        assert!(serde_json::from_str::<ClaimUid>(&format!("{bad:?}")).is_err());
    }
}
