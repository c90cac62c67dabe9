//! Input tests: driver file discovery under the driver root.

use super::*;

#[test]
fn discovery_finds_driver_files_once() {
    let host = Host::new();
    let versioned = host.file("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.163.01");
    let soname = host
        .root()
        .join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1");
    symlink("libnvidia-ml.so.550.163.01", &soname).unwrap();
    // The development link, libraries of other versions and dangling links are not driver
    // files.
    symlink(
        "libnvidia-ml.so.1",
        host.root().join("usr/lib/x86_64-linux-gnu/libnvidia-ml.so"),
    )
    .unwrap();
    host.file("usr/lib/x86_64-linux-gnu/libfoo.so.1");
    host.file("usr/lib/x86_64-linux-gnu/libcudart.so.12");
    symlink(
        "missing",
        host.root().join("usr/lib/x86_64-linux-gnu/libcuda.so.1"),
    )
    .unwrap();
    let smi = host.file("usr/bin/nvidia-smi");
    host.file("usr/bin/nvidia-smi-helper");
    // Merged /usr: /lib and /bin are links into /usr and must not yield duplicates.
    symlink("usr/lib", host.root().join("lib")).unwrap();
    symlink("usr/bin", host.root().join("bin")).unwrap();

    let files = discover_driver_files(&host.opts.root);
    assert_eq!(files.version.as_deref(), Some("550.163.01"));
    // The versioned file is the library; its soname link is kept for specs without hooks.
    assert_eq!(files.libraries, vec![versioned]);
    assert_eq!(files.soname_links, vec![soname]);
    assert_eq!(files.binaries, vec![smi]);
    assert_eq!(files.hook, None);
    assert_eq!(
        discover_driver_files(&DriverRoot::at(Path::new("/nonexistent-root"))),
        DriverFiles::default()
    );
}

#[test]
fn files_outside_the_driver_root_are_not_mounted() {
    let host = Host::new();
    let files = DriverFiles {
        libraries: vec![PathBuf::from("/elsewhere/libcuda.so.1")],
        ..Default::default()
    };
    let spec = claim_spec(
        &host.opts,
        UID,
        &[gpu_device(0, Sharing::Exclusive)],
        &files,
    )
    .unwrap();
    assert!(spec.container_edits.mounts.is_empty());
}

/// Host paths under the host driver root are read under the container path; others (a device
/// root outside the driver root) where the host has them; read paths map back to host paths.
#[test]
fn driver_root_maps_host_paths_to_read_paths_and_back() {
    let root = DriverRoot::new(
        "/run/nvidia/driver".into(),
        "/driver-root".into(),
        "/".into(),
    );
    let host = Path::new("/run/nvidia/driver/usr/bin/nvidia-smi");
    let read = Path::new("/driver-root/usr/bin/nvidia-smi");
    assert_eq!(root.read_path(host), read);
    assert_eq!(root.host_path(read), host);
    assert_eq!(
        root.read_path(Path::new("/dev/nvidia0")),
        Path::new("/dev/nvidia0")
    );
    // `/` has a `dev/`, so the device nodes are under /dev.
    assert_eq!(root.dev_dir(), Path::new("/dev"));
    // A device root without `dev/` falls back to /dev as well; one with it is used.
    let host = Host::new();
    let at = DriverRoot::new(
        "/nonexistent-host".into(),
        host.root().to_path_buf(),
        "/nonexistent-host".into(),
    );
    assert_eq!(at.dev_dir(), Path::new("/nonexistent-host/dev"));
    let none = DriverRoot::at(Path::new("/nonexistent-root"));
    assert_eq!(none.dev_dir(), Path::new("/dev"));
}

/// The host's MPS pipe directory is never a driver file (NVIDIA's lookup skips directories):
/// a container that does not use MPS must not become a client of the host's daemon. A claim
/// shared with MPS gets its own daemon's directory there instead.
#[test]
fn the_hosts_mps_directory_is_mounted_only_for_mps_claims() {
    let host = Host::new();
    host.file("tmp/nvidia-mps/control");
    let socket = host.file("run/nvidia-persistenced/socket");
    let files = discover_driver_files(&host.opts.root);
    assert_eq!(files.ipc, vec![socket.clone()]);

    let plain = claim_spec(
        &host.opts,
        UID,
        &[gpu_device(0, Sharing::Exclusive)],
        &files,
    )
    .unwrap();
    let targets = |spec: &Spec| -> Vec<(String, String)> {
        spec.container_edits
            .mounts
            .iter()
            .map(|m| (m.container_path.clone(), m.host_path.clone()))
            .collect()
    };
    assert_eq!(
        targets(&plain),
        vec![(
            "/run/nvidia-persistenced/socket".to_string(),
            socket.display().to_string()
        )]
    );

    let pipe = host.root().join("run/nvdra/mps/claim");
    let mut shared = gpu_device(0, Sharing::Mps(MpsSettings::default()));
    shared.mps_pipe_dir = Some(pipe.clone());
    let mps = claim_spec(&host.opts, UID, &[shared], &files).unwrap();
    let mps_mounts: Vec<(String, String)> = targets(&mps)
        .into_iter()
        .filter(|(c, _)| c == MPS_PIPE_CONTAINER_DIR)
        .collect();
    assert_eq!(
        mps_mounts,
        vec![(
            MPS_PIPE_CONTAINER_DIR.to_string(),
            pipe.display().to_string()
        )]
    );
}
