//! Name tests: the CDI grammar, device ids and spec paths.

use super::*;

#[test]
fn cdi_names_follow_the_grammar() {
    for ok in ["k8s.gpu.nvidia.com", "nvidia.com", "a1", "x_y-z.w"] {
        validate_vendor(ok).unwrap();
    }
    for bad in ["", "k", "1k8s", "k8s.gpu.", "-x", "a/b", "k8s gpu"] {
        let e = validate_vendor(bad).unwrap_err().to_string();
        assert!(e.starts_with(&format!("invalid CDI vendor {bad:?}")), "{e}");
    }
    for ok in ["claim", "gpu", "mig_dev-1"] {
        validate_class(ok).unwrap();
    }
    for bad in ["", "c", "claim.x", "9claim", "claim-"] {
        assert!(validate_class(bad).is_err(), "{bad}");
    }
    for ok in ["0", "a", "uid-gpu-0", "x:y.z_1", "GPU-0"] {
        validate_device_name(ok).unwrap();
    }
    for bad in ["", "-a", "a-", "a/b", "a b", "a=b", ".a"] {
        assert!(validate_device_name(bad).is_err(), "{bad}");
    }

    let e = CdiOptions::resolve("gpu.nvidia.com.", &DriverRoot::at(Path::new("/"))).unwrap_err();
    assert!(e.to_string().contains("k8s.gpu.nvidia.com."), "{e}");

    let host = Host::new();
    let dev = gpu_device(0, Sharing::Exclusive);
    let e = claim_spec(
        &host.opts,
        "../etc",
        std::slice::from_ref(&dev),
        &DriverFiles::default(),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("invalid CDI claim UID \"../etc\""),
        "{e}"
    );
    let mut bad = dev.clone();
    bad.name = "gpu 0".into();
    let e = claim_spec(&host.opts, UID, &[bad], &DriverFiles::default()).unwrap_err();
    assert!(e.to_string().contains(&format!("{UID}-gpu 0")), "{e}");
    let mut opts = host.opts.clone();
    opts.class = "cl.aim".into();
    let e = claim_spec(&opts, UID, &[dev], &DriverFiles::default()).unwrap_err();
    assert!(
        e.to_string().starts_with("invalid CDI class \"cl.aim\""),
        "{e}"
    );
}

#[test]
fn ids_and_paths_follow_nvidia() {
    let opts = CdiOptions::resolve(
        "gpu.nvidia.com",
        &DriverRoot::at(Path::new("/nonexistent-root")),
    )
    .unwrap();
    assert_eq!(opts.dev_root, PathBuf::from("/dev"));
    assert_eq!(
        device_id(&opts, UID, "gpu-0"),
        format!("k8s.gpu.nvidia.com/claim={UID}-gpu-0")
    );
    assert_eq!(
        spec_path(
            Path::new("/var/run/cdi"),
            &opts,
            &crate::ids::ClaimUid::parse(UID).unwrap()
        ),
        PathBuf::from(format!("/var/run/cdi/k8s.gpu.nvidia.com-claim_{UID}.yaml"))
    );
    let host = Host::new();
    assert_eq!(host.opts.dev_root, host.root().join("dev"));
}
