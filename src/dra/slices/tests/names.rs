//! Naming tests: device names, profile labels and finding a device by name.

use super::*;

#[test]
fn profile_labels_are_rfc1123() {
    assert_eq!(profile_label("1G.10GB+ME"), "1g10gbme");
    assert_eq!(profile_label("1g.24gb-me"), "1g24gb-me");
    assert_eq!(profile_label("-2g.20gb gfx_x-"), "2g20gbgfxx");
    assert_eq!(counter_set_name(4), "gpu-4-counter-set");
}

#[test]
fn find_device_inverts_naming() {
    let inv = profile("a100-mig-mixed");
    for p in [plain(), opts(true, CounterLayout::Separate), shared(true)] {
        let specs = desired_slices(&inv, &p).unwrap();
        for d in all_devices(&specs) {
            let found =
                find_device(&inv, &d.name).unwrap_or_else(|| panic!("{} does not resolve", d.name));
            match found {
                PublishedDevice::Gpu(g) => {
                    assert_eq!(DeviceName::gpu(g.minor).as_str(), d.name);
                    assert_eq!(attr(d, "uuid"), &s(g.uuid.as_str()));
                }
                PublishedDevice::Mig {
                    parent,
                    existing,
                    profile,
                    placement,
                } => {
                    assert_eq!(attr(d, "parentUUID"), &s(parent.uuid.as_str()));
                    let pname = existing
                        .map(|e| e.profile.clone())
                        .or(profile.map(|p| p.name.clone()))
                        .unwrap();
                    assert_eq!(attr(d, "profile"), &s(&pname));
                    assert!(d.name.ends_with(&format!("-{}", placement.start)));
                    match existing {
                        Some(e) => assert_eq!(attr(d, "uuid"), &s(e.uuid.as_str())),
                        None => assert!(!d.attributes.as_ref().unwrap().contains_key("uuid")),
                    }
                }
            }
        }
    }
    assert!(find_device(&inv, "gpu-9").is_none());
    assert!(find_device(&inv, "gpu-01").is_none());
    assert!(find_device(&inv, "gpu-1-mig-9g99gb-1-0").is_none());
    assert!(find_device(&inv, "gpu-1-xyz").is_none());
    assert!(find_device(&inv, "nvidia0").is_none());
    // The shareable twins of earlier builds are no device of this one.
    assert!(find_device(&inv, "gpu-1-shared").is_none());
}
