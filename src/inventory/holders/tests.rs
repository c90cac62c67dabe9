use std::os::unix::fs::symlink;
use std::process::{Child, Command, Stdio};

use super::*;

fn holder(pid: u32, name: &str, kind: HolderKind) -> Holder {
    Holder {
        pid,
        name: name.into(),
        kind,
    }
}

/// A proc tree: `<root>/<pid>/{comm,cmdline,fd/<n>}`, each fd a symlink to `target`.
struct ProcTree {
    root: PathBuf,
}

impl ProcTree {
    fn process(&self, pid: u32, comm: Option<&str>, fds: &[(u32, &Path)]) -> PathBuf {
        let dir = self.root.join(pid.to_string());
        fs::create_dir_all(dir.join("fd")).unwrap();
        if let Some(c) = comm {
            fs::write(dir.join("comm"), format!("{c}\n")).unwrap();
        }
        for (n, target) in fds {
            symlink(target, dir.join("fd").join(n.to_string())).unwrap();
        }
        dir
    }
}

#[test]
fn a_fake_proc_tree_is_sorted_by_gpu_and_kind_and_nvdra_is_left_out() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = tmp.path().join("dev");
    fs::create_dir_all(&dev).unwrap();
    for f in ["nvidia0", "nvidia1", "nvidia7", "nvidia-uvm", "nvidiactl"] {
        fs::write(dev.join(f), "").unwrap();
    }
    let tree = ProcTree {
        root: tmp.path().join("proc"),
    };
    let (gpu0, gpu1) = (dev.join("nvidia0"), dev.join("nvidia1"));
    fs::create_dir_all(tree.root.join("sys")).unwrap();
    symlink("100", tree.root.join("self")).unwrap();
    // nvdra itself, through its NVML handle.
    tree.process(100, Some("nvdra"), &[(3, &gpu0), (4, &gpu1)]);
    tree.process(200, Some("nv-hostengine"), &[(4, &gpu0), (5, &gpu1)]);
    let persistenced = tree.process(300, Some("nvidia-persiste"), &[(0, &gpu0)]);
    fs::write(
        persistenced.join("cmdline"),
        b"/usr/bin/nvidia-persistenced\0--verbose\0",
    )
    .unwrap();
    let mps = tree.process(400, Some("nvidia-cuda-mps"), &[(1, &gpu1)]);
    fs::write(mps.join("cmdline"), b"nvidia-cuda-mps-server\0").unwrap();
    // Other files only: the control node, UVM, a socket, a GPU not asked about.
    tree.process(
        500,
        Some("bash"),
        &[
            (0, &dev.join("nvidiactl")),
            (1, Path::new("socket:[1234]")),
            (2, &dev.join("nvidia-uvm")),
            (3, &dev.join("nvidia7")),
        ],
    );
    // Unreadable: no fd directory (another user's process), a name that cannot be read.
    fs::create_dir_all(tree.root.join("600")).unwrap();
    tree.process(700, None, &[(9, &gpu1)]);
    // A 15-byte name that is not cut from its program's: kept as the kernel has it.
    let long = tree.process(800, Some("nvidia-persiste"), &[(3, &gpu0)]);
    fs::write(long.join("cmdline"), b"/opt/other\0").unwrap();

    let scan = HolderScan::new(&tree.root).with_device_dir(&dev);
    let found = scan.scan(&[0, 1, 3]);
    assert_eq!(
        found[&0],
        [
            holder(200, "nv-hostengine", HolderKind::Foreign),
            holder(300, "nvidia-persistenced", HolderKind::Harmless),
            holder(800, "nvidia-persiste", HolderKind::Harmless),
        ]
    );
    assert_eq!(
        found[&1],
        [
            holder(200, "nv-hostengine", HolderKind::Foreign),
            holder(400, "nvidia-cuda-mps-server", HolderKind::OwnMps),
            holder(700, "", HolderKind::Foreign),
        ]
    );
    assert_eq!(found[&3], []);
    assert_eq!(found.len(), 3);

    // NVML's compute processes join the scan's, nvdra never.
    let merged = scan.with_processes(found[&1].clone(), &[700, 100, 250, 200]);
    assert_eq!(
        merged.iter().map(|h| h.pid).collect::<Vec<_>>(),
        [200, 250, 400, 700]
    );
    assert_eq!(merged[1], holder(250, "", HolderKind::Foreign));

    // Without the device directory, plain files are no GPU's: only device numbers count.
    assert_eq!(HolderScan::new(&tree.root).scan(&[0, 1])[&0], []);
    // A proc root that is not there finds nothing.
    assert_eq!(HolderScan::new(tmp.path().join("none")).scan(&[0])[&0], []);
}

#[test]
fn device_numbers_name_gpu_nodes_only() {
    let dev = |major: u64, minor: u64| {
        ((major & 0xfff) << 8) | ((major & !0xfff) << 32) | (minor & 0xff) | ((minor & !0xff) << 12)
    };
    assert_eq!(gpu_minor(dev(195, 0)), Some(0));
    assert_eq!(gpu_minor(dev(195, 7)), Some(7));
    assert_eq!(gpu_minor(dev(195, 253)), Some(253));
    // nvidia-modeset and nvidiactl.
    assert_eq!(gpu_minor(dev(195, 254)), None);
    assert_eq!(gpu_minor(dev(195, 255)), None);
    // /dev/null; nvidia-uvm's dynamic major.
    assert_eq!(gpu_minor(dev(1, 3)), None);
    assert_eq!(gpu_minor(dev(510, 0)), None);
    let null = fs::metadata("/dev/null").unwrap();
    assert_eq!(gpu_minor(null.rdev()), None);
}

#[test]
fn kinds_by_name() {
    assert_eq!(kind_of("nvidia-persistenced"), HolderKind::Harmless);
    assert_eq!(kind_of("nvidia-persiste"), HolderKind::Harmless);
    assert_eq!(kind_of("nvidia-persist"), HolderKind::Foreign);
    assert_eq!(kind_of("nvidia-cuda-mps"), HolderKind::OwnMps);
    assert_eq!(kind_of("nvidia-cuda-mps-control"), HolderKind::OwnMps);
    assert_eq!(kind_of("nv-hostengine"), HolderKind::Foreign);
    assert_eq!(kind_of("dcgm-exporter"), HolderKind::Foreign);
    assert_eq!(kind_of(""), HolderKind::Foreign);
}

/// Real processes started through links that give them the names the kernel keeps, each with
/// a file that stands for a GPU's device node open as its stdin.
struct Running(Vec<Child>);

impl Drop for Running {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn real_processes_holding_a_stand_in_node_are_found_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let dev = tmp.path().join("dev");
    fs::create_dir_all(&dev).unwrap();
    let (gpu0, gpu1) = (dev.join("nvidia0"), dev.join("nvidia1"));
    fs::write(&gpu0, "").unwrap();
    fs::write(&gpu1, "").unwrap();
    let sleep = ["/usr/bin/sleep", "/bin/sleep"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("a sleep binary");
    let mut running = Running(Vec::new());
    let mut start = |name: &str, node: &Path| {
        let link = tmp.path().join(name);
        symlink(sleep, &link).unwrap();
        let child = Command::new(&link)
            .arg("600")
            .stdin(fs::File::open(node).unwrap())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        running.0.push(child);
        pid
    };
    let dcgm = start("nv-hostengine", &gpu0);
    let persistenced = start("nvidia-persistenced", &gpu0);
    let mps = start("nvidia-cuda-mps-server", &gpu1);
    // This process holds both open too, as nvdra holds them through NVML: left out.
    let _own = (
        fs::File::open(&gpu0).unwrap(),
        fs::File::open(&gpu1).unwrap(),
    );

    let found = HolderScan::new("/proc").with_device_dir(&dev).scan(&[0, 1]);
    let mut want0 = vec![
        holder(dcgm, "nv-hostengine", HolderKind::Foreign),
        holder(persistenced, "nvidia-persistenced", HolderKind::Harmless),
    ];
    want0.sort();
    assert_eq!(found[&0], want0);
    assert_eq!(
        found[&1],
        [holder(mps, "nvidia-cuda-mps-server", HolderKind::OwnMps)]
    );
    assert!(found[&0].iter().all(|h| h.pid != std::process::id()));

    // Once it exits, it holds nothing.
    let mut c = running.0.remove(0);
    c.kill().unwrap();
    c.wait().unwrap();
    let after = HolderScan::new("/proc").with_device_dir(&dev).scan(&[0]);
    assert_eq!(
        after[&0],
        [holder(
            persistenced,
            "nvidia-persistenced",
            HolderKind::Harmless
        )]
    );
}
