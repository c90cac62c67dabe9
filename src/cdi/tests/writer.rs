//! Writer tests: atomic write, overwrite, listing, removal and bad claim UIDs.

use super::*;
use crate::durable::Durability;
use crate::ids::ClaimUid;

fn uid(s: &str) -> ClaimUid {
    ClaimUid::parse(s).unwrap()
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

fn sample_spec(host: &Host, uid: &str, device: usize) -> Spec {
    claim_spec(
        &host.opts,
        uid,
        &[gpu_device(device, Sharing::Exclusive)],
        &DriverFiles::default(),
    )
    .unwrap()
}

#[test]
fn writer_writes_overwrites_lists_and_removes() {
    let host = Host::new();
    let cdi_root = host.root().join("run/cdi");
    let other = "0b1c2d3e-0000-0000-0000-000000000000";

    assert_eq!(
        list_claim_specs(&cdi_root, &host.opts).unwrap(),
        Vec::<String>::new()
    );
    let first = sample_spec(&host, UID, 0);
    let path = write_spec(
        &cdi_root,
        &host.opts,
        &uid(UID),
        &first,
        Durability::Durable,
    )
    .unwrap();
    assert_eq!(path, spec_path(&cdi_root, &host.opts, &uid(UID)));
    let read: Spec = serde_saphyr::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(read, first);
    assert_eq!(fs::metadata(&path).unwrap().mode() & 0o777, 0o644);

    let second = sample_spec(&host, UID, 1);
    write_spec(
        &cdi_root,
        &host.opts,
        &uid(UID),
        &second,
        Durability::Atomic,
    )
    .unwrap();
    let read: Spec = serde_saphyr::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(read, second);
    write_spec(
        &cdi_root,
        &host.opts,
        &uid(other),
        &sample_spec(&host, other, 2),
        Durability::Durable,
    )
    .unwrap();

    // Files of other vendors, temp files and stray names are not claim specs.
    fs::write(cdi_root.join("nvidia.com-gpu.yaml"), "x").unwrap();
    fs::write(
        cdi_root.join(format!(".k8s.gpu.nvidia.com-claim_{UID}.1.2.tmp")),
        "x",
    )
    .unwrap();
    fs::write(cdi_root.join("k8s.gpu.nvidia.com-claim_abc.json"), "x").unwrap();
    fs::write(cdi_root.join("k8s.gpu.nvidia.com-claim_-bad.yaml"), "x").unwrap();
    let mut expected = vec![UID.to_string(), other.to_string()];
    expected.sort();
    assert_eq!(list_claim_specs(&cdi_root, &host.opts).unwrap(), expected);

    assert!(remove_spec(&cdi_root, &host.opts, &uid(UID), Durability::Durable).unwrap());
    assert!(!path.exists());
    assert!(!remove_spec(&cdi_root, &host.opts, &uid(UID), Durability::Durable).unwrap());
    assert_eq!(
        list_claim_specs(&cdi_root, &host.opts).unwrap(),
        vec![other.to_string()]
    );
}

#[test]
fn writer_leaves_no_temp_files() {
    let host = Host::new();
    let cdi_root = host.root().join("cdi");
    for device in 0..3 {
        write_spec(
            &cdi_root,
            &host.opts,
            &uid(UID),
            &sample_spec(&host, UID, device),
            Durability::Durable,
        )
        .unwrap();
    }
    assert_eq!(
        entries(&cdi_root),
        vec![format!("k8s.gpu.nvidia.com-claim_{UID}.yaml")]
    );
}

#[test]
fn writer_failure_leaves_old_spec_and_no_temp_file() {
    let host = Host::new();
    let cdi_root = host.root().join("cdi");
    let spec = sample_spec(&host, UID, 0);
    let path = write_spec(&cdi_root, &host.opts, &uid(UID), &spec, Durability::Durable).unwrap();
    // Replace the target with a non-empty directory: the rename fails.
    fs::remove_file(&path).unwrap();
    fs::create_dir_all(path.join("blocker")).unwrap();
    let e = write_spec(&cdi_root, &host.opts, &uid(UID), &spec, Durability::Durable).unwrap_err();
    assert!(e.to_string().starts_with("cannot rename into place"), "{e}");
    assert_eq!(
        entries(&cdi_root),
        vec![format!("k8s.gpu.nvidia.com-claim_{UID}.yaml")]
    );
    assert!(path.is_dir());
}

/// The writer takes a typed [`ClaimUid`], so a bad one never reaches it: these do not parse.
#[test]
fn writer_rejects_bad_claim_uids() {
    for bad in ["../x", "a/b", "", "-x"] {
        assert!(ClaimUid::parse(bad).is_err(), "{bad}");
    }
}
