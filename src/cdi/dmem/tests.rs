//! The `dmem` side on a fake cgroup v2 tree: the files a kernel with the controller has, and a
//! fake `/proc/<pid>/cgroup` naming a Kubernetes container's cgroup. (`tests/cdi_podman.rs` runs
//! the hook under runc, on the host's real cgroup v2 hierarchy.)

use std::fs;

use super::*;

const REGION: &str = "nvidia/0000:3b:00.0/vidmem";
const CONTAINER: &str = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice/cri-containerd-abc.scope";

struct Tree {
    dir: tempfile::TempDir,
}

impl Tree {
    /// A cgroup v2 root with the `dmem` controller, the container's cgroup and its ancestors
    /// (`kubepods.slice` already delegating `dmem`, the others not), and process 4242 in it.
    fn new() -> Self {
        let t = Self {
            dir: tempfile::tempdir().unwrap(),
        };
        fs::create_dir_all(t.cgroups().join(CONTAINER)).unwrap();
        fs::write(
            t.cgroups().join("cgroup.controllers"),
            "cpuset cpu io memory pids dmem\n",
        )
        .unwrap();
        let mut dir = t.cgroups();
        for part in Path::new(CONTAINER).components() {
            fs::write(dir.join("cgroup.subtree_control"), "").unwrap();
            dir.push(part);
        }
        fs::write(
            t.cgroups().join("kubepods.slice/cgroup.subtree_control"),
            "cpu memory dmem\n",
        )
        .unwrap();
        fs::write(t.cgroups().join(CONTAINER).join("dmem.max"), "").unwrap();
        fs::create_dir_all(t.proc().join("4242")).unwrap();
        // As the kernel writes it on a hybrid host: v1 lines, then the v2 one.
        fs::write(
            t.proc().join("4242/cgroup"),
            format!("1:name=systemd:/{CONTAINER}\n0::/{CONTAINER}\n"),
        )
        .unwrap();
        t
    }

    fn cgroups(&self) -> PathBuf {
        self.dir.path().join("sys/fs/cgroup")
    }

    fn proc(&self) -> PathBuf {
        self.dir.path().join("proc")
    }

    fn read(&self, rel: &str) -> String {
        fs::read_to_string(self.cgroups().join(rel)).unwrap()
    }
}

fn limit(bytes: u64) -> Limit {
    Limit {
        region: REGION.into(),
        bytes,
    }
}

#[test]
fn gpu_regions_are_nvidia_vidmem_lines_by_pci_bus_id() {
    let dir = tempfile::tempdir().unwrap();
    assert!(
        gpu_regions(dir.path()).unwrap().is_empty(),
        "no file, no region"
    );
    fs::write(
        dir.path().join(CAPACITY_FILE),
        "drm/0000:03:00.0/vram0 8589934592\n\
         nvidia/0000:3B:00.0/vidmem 85520809984\n\
         nvidia/0000:3b:00.0/sysmem 1024\n\
         nvidia/not-a-bus/vidmem 1\n",
    )
    .unwrap();
    assert_eq!(
        gpu_regions(dir.path()).unwrap(),
        vec![(
            PciBusId::normalize("0000:3b:00.0").unwrap(),
            "nvidia/0000:3B:00.0/vidmem".to_string()
        )]
    );
}

#[test]
fn apply_enables_dmem_above_the_container_and_sets_its_limit() {
    let t = Tree::new();
    let dir = apply(&t.cgroups(), &t.proc(), 4242, &[limit(24 << 30)]).unwrap();
    assert_eq!(dir, t.cgroups().join(CONTAINER));
    assert_eq!(
        t.read(&format!("{CONTAINER}/dmem.max")),
        format!("{REGION} {}\n", 24u64 << 30)
    );
    // Every cgroup from the root to the container's parent delegates dmem: a write of
    // `+dmem` where it did not, nothing where it did.
    assert_eq!(t.read("cgroup.subtree_control"), "+dmem");
    assert_eq!(
        t.read("kubepods.slice/cgroup.subtree_control"),
        "cpu memory dmem\n"
    );
    let parent = Path::new(CONTAINER).parent().unwrap();
    assert_eq!(
        t.read(&format!("{}/cgroup.subtree_control", parent.display())),
        "+dmem"
    );
    assert!(
        !t.cgroups()
            .join(CONTAINER)
            .join("cgroup.subtree_control")
            .exists(),
        "the container's own cgroup is left alone"
    );
}

#[test]
fn apply_fails_closed_naming_what_is_missing() {
    let t = Tree::new();
    fs::write(t.cgroups().join("cgroup.controllers"), "cpu memory\n").unwrap();
    let e = format!(
        "{:#}",
        apply(&t.cgroups(), &t.proc(), 4242, &[limit(1 << 30)]).unwrap_err()
    );
    assert!(e.contains("does not list dmem"), "{e}");

    let t = Tree::new();
    let e = format!(
        "{:#}",
        apply(&t.cgroups(), &t.proc(), 7, &[limit(1 << 30)]).unwrap_err()
    );
    assert!(e.contains("proc/7/cgroup"), "{e}");

    let t = Tree::new();
    fs::write(t.proc().join("4242/cgroup"), "1:name=systemd:/x\n").unwrap();
    let e = format!(
        "{:#}",
        apply(&t.cgroups(), &t.proc(), 4242, &[limit(1 << 30)]).unwrap_err()
    );
    assert!(e.contains("no cgroup v2 entry"), "{e}");

    let t = Tree::new();
    fs::remove_dir_all(t.cgroups().join(CONTAINER)).unwrap();
    let e = format!(
        "{:#}",
        apply(&t.cgroups(), &t.proc(), 4242, &[limit(1 << 30)]).unwrap_err()
    );
    assert!(e.contains("is not a cgroup below"), "{e}");

    // A container cgroup without dmem.max (the controller not enabled for it).
    let t = Tree::new();
    let max = t.cgroups().join(CONTAINER).join("dmem.max");
    fs::remove_file(&max).unwrap();
    let e = format!(
        "{:#}",
        apply(&t.cgroups(), &t.proc(), 4242, &[limit(1 << 30)]).unwrap_err()
    );
    assert!(e.contains("dmem.max"), "{e}");
}

#[test]
fn the_hook_reads_its_limits_and_the_runtimes_state() {
    assert_eq!(Limit::parse_arg(&limit(5).arg()).unwrap(), limit(5));
    for bad in ["nvidia/x/vidmem", "=5", "nvidia/x/vidmem=lots", "a b=5"] {
        assert!(Limit::parse_arg(bad).is_err(), "{bad}");
    }
    // The state runc 1.1 gave a createRuntime hook under podman 4.3 (tests/cdi_podman.rs runs
    // the hook that way).
    let state = r#"{"ociVersion":"1.0.2-dev","id":"01c4f60a79c1","status":"creating","pid":16666,"bundle":"/var/lib/containers/storage/overlay-containers/01c4f60a79c1/userdata","annotations":{"io.container.manager":"libpod"}}"#;
    assert_eq!(oci_state_pid(state).unwrap(), 16666);
    assert!(oci_state_pid(r#"{"status":"creating"}"#).is_err());
    assert!(oci_state_pid("not json").is_err());
    let e = hook_main(vec!["--cgroup-root".into()]).unwrap_err();
    assert!(e.to_string().contains("--cgroup-root needs"), "{e}");
    let e = hook_main(vec![]).unwrap_err();
    assert!(e.to_string().contains("no limit given"), "{e}");
}

#[test]
fn install_hook_copies_the_running_binary_once() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    let path = install_hook(&bin).unwrap();
    assert_eq!(path, bin.join("nvdra"));
    let exe = fs::read(std::env::current_exe().unwrap()).unwrap();
    assert!(
        fs::read(&path).unwrap() == exe,
        "the copy is the running binary"
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        fs::metadata(&path).unwrap().permissions().mode() & 0o777,
        0o755
    );
    let modified = fs::metadata(&path).unwrap().modified().unwrap();
    install_hook(&bin).unwrap();
    assert_eq!(
        fs::metadata(&path).unwrap().modified().unwrap(),
        modified,
        "not rewritten"
    );
    assert!(!bin.join(".nvdra.tmp").exists());
}
