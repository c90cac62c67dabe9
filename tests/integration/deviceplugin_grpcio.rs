//! The real `nvdra run --mode device-plugin` against a kubelet stand-in that nvdra did not write:
//! `crates/kubelet-plugin/tests/kubelet/standin.py device-plugin`, grpcio (C-core) serving `kubelet.sock` as the
//! kubelet's device manager does and dialing the plugin sockets with `:authority localhost`.
//! Each test asserts on the stand-in's JSON: registration, the first `ListAndWatch` list (IDs,
//! NUMA), Allocate per strategy, preferred allocation, replicas with
//! `failRequestsGreaterThanOne`, MIG strategies, and a kubelet restart → re-registration.
//! Expected IDs come from the same simulated inventory, read through nvdra's library.
//!
//! Needs python3 with grpcio, grpcio-tools, protobuf and hpack (as
//! tests/integration/kubelet_grpcio.rs). Without them the tests say why and pass — unless
//! `NVDRA_REQUIRE_GRPCIO` is set.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use support::grpcio::{STANDIN, have_grpcio};

use nvdra::inventory::{DeviceBackend, Inventory, sim::SimBackend};
use serde_json::Value;

const NODE: &str = "node-a";

fn inventory(profile: &str) -> Inventory {
    SimBackend::from_profile(profile, NODE)
        .unwrap()
        .snapshot()
        .unwrap()
}

/// A temporary kubelet root, with `nvdra run --mode device-plugin` killed when dropped.
struct Node {
    root: tempfile::TempDir,
    nvdra: Option<Child>,
    mode: &'static str,
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(c) = &mut self.nvdra {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Node {
    fn new() -> Node {
        Node {
            root: tempfile::tempdir().unwrap(),
            nvdra: None,
            mode: "device-plugin",
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.root.path().join(p)
    }

    fn dir(&self) -> PathBuf {
        self.path("kubelet/device-plugins")
    }

    /// Writes NVIDIA's config file and returns its path.
    fn config(&self, text: &str) -> PathBuf {
        let p = self.path("dp-config.yaml");
        std::fs::write(&p, text).unwrap();
        p
    }

    fn command(&self, backend: &[&str], config: Option<&Path>) -> Command {
        let mut cmd = support::daemon::nvdra_run(self.root.path(), self.mode, NODE);
        cmd.args(backend);
        if let Some(c) = config {
            cmd.arg("--device-plugin-config").arg(c);
        }
        cmd
    }

    /// Starts the stand-in (which serves kubelet.sock), then nvdra, and returns the stand-in's
    /// report once it exits.
    fn run(&mut self, backend: &[&str], config: Option<&Path>, standin: &[&str]) -> Report {
        let dir = self.dir();
        std::fs::create_dir_all(&dir).unwrap();
        let child = Command::new("python3")
            .arg(STANDIN)
            .arg("device-plugin")
            .arg("--proto-root")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/crates/kubelet-plugin/proto"
            ))
            .arg("--stubs-cache")
            .arg(concat!(env!("CARGO_TARGET_TMPDIR"), "/kubelet-standin"))
            .arg("--dir")
            .arg(&dir)
            .args(standin)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        self.nvdra = Some(
            self.command(backend, config)
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        );
        Report::parse(child.wait_with_output().unwrap())
    }
}

struct Report {
    out: Output,
    lines: Vec<Value>,
}

impl Report {
    fn parse(out: Output) -> Report {
        let lines = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect();
        Report { out, lines }
    }

    /// Every check passed and the stand-in exited 0.
    fn assert_ok(&self) {
        let failed: Vec<&Value> = self
            .lines
            .iter()
            .filter(|l| l.get("ok").is_some_and(|ok| ok != true))
            .collect();
        assert!(
            failed.is_empty() && self.out.status.success(),
            "stand-in failed ({}): {failed:#?}\nstderr: {}",
            self.out.status,
            String::from_utf8_lossy(&self.out.stderr)
        );
    }

    /// The details of every check `rpc` on `socket`, in order.
    fn all(&self, socket: &str, rpc: &str) -> Vec<&Value> {
        self.lines
            .iter()
            .filter(|l| l["socket"] == socket && l["rpc"] == rpc)
            .map(|l| &l["detail"])
            .collect()
    }

    fn one(&self, socket: &str, rpc: &str) -> &Value {
        let all = self.all(socket, rpc);
        assert_eq!(all.len(), 1, "{socket} {rpc}: {:#?}", self.lines);
        all[0]
    }

    /// The IDs of the first list of `resource`.
    fn ids(&self, resource: &str) -> Vec<String> {
        self.one(resource, "ListAndWatch")["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["id"].as_str().unwrap().to_string())
            .collect()
    }
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn pcie_pairs_register_list_allocate_prefer_pairs_and_survive_a_kubelet_restart() {
    if !have_grpcio() {
        return;
    }
    let inv = inventory("pcie-pairs");
    let mut node = Node::new();
    let r = node.run(
        &["--profile", "pcie-pairs"],
        None,
        &[
            "--expect",
            "nvidia.com/gpu",
            "--refuse-first",
            "1",
            "--allocate",
            "nvidia.com/gpu=@2,@0",
            "--allocate",
            "nvidia.com/gpu=@1,GPU-not-here,bogus",
            "--preferred",
            "nvidia.com/gpu=2",
            "--preferred",
            "nvidia.com/gpu=2::@0,@2,@3",
            "--preferred",
            "nvidia.com/gpu=2:@1:@0,@1,@2,@3",
            "--restart",
        ],
    );
    r.assert_ok();
    let reg = r.one("kubelet", "Register");
    let gpu = &reg["resources"]["nvidia.com/gpu"];
    assert_eq!(gpu["version"], "v1beta1");
    assert_eq!(gpu["endpoint"], "nvidia-gpu.sock");
    assert_eq!(gpu["preferred"], true);
    assert_eq!(
        strings(&reg["refused"]),
        ["nvidia.com/gpu"],
        "the refused registration was retried"
    );

    // The first list: every GPU by UUID, with its NUMA node.
    let list = r.one("nvidia.com/gpu", "ListAndWatch")["devices"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(list.len(), inv.gpus.len());
    for (d, g) in list.iter().zip(&inv.gpus) {
        assert_eq!(d["id"], g.uuid.as_str());
        assert_eq!(d["health"], "Healthy");
        assert_eq!(d["numa"], serde_json::json!([g.numa_node.unwrap()]));
    }

    let allocs = r.all("nvidia.com/gpu", "Allocate");
    let uuid = |i: usize| inv.gpus[i].uuid.as_str().to_string();
    assert_eq!(allocs[0]["ok"], true, "{:#?}", allocs[0]);
    assert_eq!(
        allocs[0]["envs"],
        serde_json::json!({"NVIDIA_VISIBLE_DEVICES": format!("{},{}", uuid(2), uuid(0))}),
        "NVIDIA's envvar strategy: the UUIDs in request order, nothing else"
    );
    assert_eq!(allocs[0]["cdi_devices"], serde_json::json!([]));
    assert_eq!(allocs[1]["ok"], false);
    assert_eq!(allocs[1]["code"], "INVALID_ARGUMENT");
    let msg = allocs[1]["message"].as_str().unwrap();
    assert!(
        msg.contains("GPU-not-here, bogus") && !msg.contains(&uuid(1)),
        "{msg}"
    );

    // Two GPUs: an NVLink pair, whichever GPUs are free.
    let domain = |id: &str| {
        inv.gpus
            .iter()
            .find(|g| g.uuid.as_str() == id)
            .unwrap()
            .nvlink_domain
    };
    let prefs = r.all("nvidia.com/gpu", "GetPreferredAllocation");
    assert_eq!(strings(&prefs[0]["ids"]), [uuid(0), uuid(1)]);
    assert_eq!(
        strings(&prefs[1]["ids"]),
        [uuid(2), uuid(3)],
        "GPU 1 taken: the free pair, not a split one"
    );
    let with_must = strings(&prefs[2]["ids"]);
    assert_eq!(with_must[0], uuid(1), "must-include first");
    assert_eq!(domain(&with_must[0]), domain(&with_must[1]));

    // The kubelet restarted: registered again, serving the same list.
    let again = r.one("kubelet", "Register after restart");
    assert_eq!(
        again["resources"]["nvidia.com/gpu"]["endpoint"],
        "nvidia-gpu.sock"
    );
    let relisted = r.one("nvidia.com/gpu", "ListAndWatch after restart")["devices"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(relisted, inv.gpus.len());
}

#[test]
fn dgx_h100_prefers_one_numa_node_and_cdi_cri_names_the_per_node_spec() {
    if !have_grpcio() {
        return;
    }
    let inv = inventory("dgx-h100");
    let mut node = Node::new();
    let config = node.config(
        "version: v1\nflags:\n  migStrategy: none\n  plugin:\n    deviceListStrategy: cdi-cri\n",
    );
    let r = node.run(
        &["--profile", "dgx-h100"],
        Some(&config),
        &[
            "--expect",
            "nvidia.com/gpu",
            "--allocate",
            "nvidia.com/gpu=@5",
            "--preferred",
            "nvidia.com/gpu=2",
            "--preferred",
            "nvidia.com/gpu=4::@0,@4,@5,@6,@7,@1",
        ],
    );
    r.assert_ok();
    let numa = |id: &str| {
        inv.gpus
            .iter()
            .find(|g| g.uuid.as_str() == id)
            .unwrap()
            .numa_node
    };
    let prefs = r.all("nvidia.com/gpu", "GetPreferredAllocation");
    let two = strings(&prefs[0]["ids"]);
    assert_eq!(two.len(), 2);
    assert_eq!(numa(&two[0]), numa(&two[1]), "{two:?}");
    let four = strings(&prefs[1]["ids"]);
    assert_eq!(four.len(), 4);
    assert!(
        four.iter().all(|id| numa(id) == Some(1)),
        "GPUs 4-7 share NUMA node 1: {four:?}"
    );

    let a = r.one("nvidia.com/gpu", "Allocate");
    let uuid = inv.gpus[5].uuid.as_str();
    assert_eq!(
        a["cdi_devices"],
        serde_json::json!([format!("k8s.gpu.nvidia.com/gpu={uuid}")])
    );
    assert_eq!(
        a["envs"],
        serde_json::json!({}),
        "all strategies CDI: no env, as NVIDIA's plugin"
    );
    let spec: Value = serde_json::to_value(
        nvdra::yaml::from_str::<nvdra::cdi::Spec>(
            &std::fs::read_to_string(node.path("cdi/k8s.gpu.nvidia.com-gpu_device-plugin.yaml"))
                .unwrap(),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(spec["kind"], "k8s.gpu.nvidia.com/gpu");
    let names: Vec<&str> = spec["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), inv.gpus.len());
    assert!(names.contains(&uuid), "{names:?}");
}

#[test]
fn time_slicing_replicas_fail_requests_greater_than_one() {
    if !have_grpcio() {
        return;
    }
    let inv = inventory("pcie-pairs");
    let mut node = Node::new();
    let config = node.config(
        "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    failRequestsGreaterThanOne: true\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 4\n",
    );
    let r = node.run(
        &["--profile", "pcie-pairs"],
        Some(&config),
        &[
            "--expect",
            "nvidia.com/gpu.shared",
            "--allocate",
            "nvidia.com/gpu.shared=@5",
            "--allocate",
            "nvidia.com/gpu.shared=@0,@1",
            "--preferred",
            "nvidia.com/gpu.shared=2",
        ],
    );
    r.assert_ok();
    let reg = r.one("kubelet", "Register");
    assert_eq!(
        reg["resources"]["nvidia.com/gpu.shared"]["endpoint"],
        "nvidia-gpu.shared.sock"
    );
    assert_eq!(reg["unexpected"], serde_json::json!([]));
    let ids = r.ids("nvidia.com/gpu.shared");
    let want: Vec<String> = inv
        .gpus
        .iter()
        .flat_map(|g| (0..4).map(move |n| format!("{}::{n}", g.uuid)))
        .collect();
    assert_eq!(ids, want);

    let allocs = r.all("nvidia.com/gpu.shared", "Allocate");
    assert_eq!(
        allocs[0]["envs"]["NVIDIA_VISIBLE_DEVICES"],
        inv.gpus[1].uuid.as_str(),
        "the replica suffix is stripped"
    );
    assert_eq!(allocs[1]["ok"], false);
    let msg = allocs[1]["message"].as_str().unwrap();
    assert!(
        msg.contains("maximum request size for shared resources is 1; found 2"),
        "{msg}"
    );

    let spread = strings(&r.one("nvidia.com/gpu.shared", "GetPreferredAllocation")["ids"]);
    let gpus: std::collections::BTreeSet<&str> = spread
        .iter()
        .map(|id| id.split("::").next().unwrap())
        .collect();
    assert_eq!(gpus.len(), 2, "replicas spread over two GPUs: {spread:?}");
}

#[test]
fn mig_mixed_on_a100_mig_mixed_advertises_one_resource_per_profile() {
    if !have_grpcio() {
        return;
    }
    let inv = inventory("a100-mig-mixed");
    let mut node = Node::new();
    let config = node.config("version: v1\nflags:\n  migStrategy: mixed\n");
    let resources = [
        "nvidia.com/gpu",
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/mig-1g.5gb",
        "nvidia.com/mig-2g.10gb",
        "nvidia.com/mig-3g.20gb",
    ];
    let mut args: Vec<&str> = resources.iter().flat_map(|r| ["--expect", r]).collect();
    args.extend(["--allocate", "nvidia.com/mig-1g.10gb=@2"]);
    let r = node.run(&["--profile", "a100-mig-mixed"], Some(&config), &args);
    r.assert_ok();
    assert_eq!(
        r.one("kubelet", "Register")["unexpected"],
        serde_json::json!([])
    );
    // Whole GPUs: the two not in MIG mode.
    assert_eq!(
        r.ids("nvidia.com/gpu"),
        [inv.gpus[0].uuid.to_string(), inv.gpus[3].uuid.to_string()]
    );
    let migs_of = |gpu: usize, profile: &str| -> Vec<String> {
        inv.gpus[gpu]
            .mig
            .devices
            .iter()
            .filter(|m| m.profile == profile)
            .map(|m| m.uuid.to_string())
            .collect()
    };
    assert_eq!(r.ids("nvidia.com/mig-1g.10gb"), migs_of(2, "1g.10gb"));
    assert_eq!(r.ids("nvidia.com/mig-1g.5gb"), migs_of(1, "1g.5gb"));
    assert_eq!(r.ids("nvidia.com/mig-3g.20gb").len(), 1);
    let list = r.one("nvidia.com/mig-1g.10gb", "ListAndWatch");
    assert!(
        list["devices"]
            .as_array()
            .unwrap()
            .iter()
            .all(|d| d["numa"] == serde_json::json!([1])),
        "MIG devices carry the parent's NUMA node: {list}"
    );
    let a = r.one("nvidia.com/mig-1g.10gb", "Allocate");
    assert_eq!(
        a["envs"]["NVIDIA_VISIBLE_DEVICES"],
        migs_of(2, "1g.10gb")[2].as_str()
    );
}

#[test]
fn mig_single_refuses_mixed_modes_and_serves_mig_devices_as_gpus() {
    let mut node = Node::new();
    let config = node.config("version: v1\nflags:\n  migStrategy: single\n");
    let out = node
        .command(&["--profile", "a100-mig-mixed"], Some(&config))
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("all GPUs on the node must have the same MIG mode"),
        "{err}"
    );

    if !have_grpcio() {
        return;
    }
    let topology = node.path("single.yaml");
    std::fs::write(
        &topology,
        "version: v1\ndriverVersion: \"550.163.01\"\ncudaDriverVersion: \"12.4\"\ngpus:\n\
         - index: 0\n  model: A100-SXM4-40GB\n  pciBusId: \"0000:07:00.0\"\n  numaNode: 0\n  mig:\n    enabled: true\n    devices:\n    - {profile: 3g.20gb, placement: 0}\n    - {profile: 3g.20gb, placement: 4}\n\
         - index: 1\n  model: A100-SXM4-40GB\n  pciBusId: \"0000:0F:00.0\"\n  numaNode: 1\n  mig:\n    enabled: true\n    devices:\n    - {profile: 3g.20gb, placement: 0}\n",
    )
    .unwrap();
    let inv = SimBackend::from_file(&topology, NODE)
        .unwrap()
        .snapshot()
        .unwrap();
    let topo = topology.to_str().unwrap().to_string();
    let r = node.run(
        &["--topology", &topo],
        Some(&config),
        &["--expect", "nvidia.com/gpu"],
    );
    r.assert_ok();
    let want: Vec<String> = inv
        .gpus
        .iter()
        .flat_map(|g| g.mig.devices.iter().map(|m| m.uuid.to_string()))
        .collect();
    assert_eq!(want.len(), 3);
    assert_eq!(r.ids("nvidia.com/gpu"), want);
}

#[test]
fn volume_mounts_cdi_annotations_and_device_specs_reach_the_kubelet() {
    if !have_grpcio() {
        return;
    }
    let inv = inventory("l40s-pcie");
    let mut node = Node::new();
    // The driver root has /dev/nvidiactl: passDeviceSpecs passes it, the GPU node always.
    std::fs::create_dir_all(node.path("driver/dev")).unwrap();
    std::fs::write(node.path("driver/dev/nvidiactl"), "").unwrap();
    let config = node.config(
        "version: v1\nflags:\n  plugin:\n    passDeviceSpecs: true\n    deviceListStrategy: [volume-mounts, cdi-annotations]\n",
    );
    let r = node.run(
        &["--profile", "l40s-pcie"],
        Some(&config),
        &[
            "--expect",
            "nvidia.com/gpu",
            "--allocate",
            "nvidia.com/gpu=@1",
        ],
    );
    r.assert_ok();
    let a = r.one("nvidia.com/gpu", "Allocate");
    let uuid = inv.gpus[1].uuid.as_str();
    assert_eq!(
        a["envs"],
        serde_json::json!({"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"})
    );
    assert_eq!(
        a["mounts"],
        serde_json::json!([{"container_path": format!("/var/run/nvidia-container-devices/{uuid}"), "host_path": "/dev/null"}])
    );
    let annotations = a["annotations"].as_object().unwrap();
    assert_eq!(annotations.len(), 1);
    let (key, value) = annotations.iter().next().unwrap();
    assert!(key.starts_with("cdi.k8s.io/nvidia-device-plugin_"), "{key}");
    assert_eq!(value, &format!("k8s.gpu.nvidia.com/gpu={uuid}"));
    let dev = node.path("driver/dev");
    assert_eq!(
        a["devices"],
        serde_json::json!([
            {"container_path": "/dev/nvidiactl", "host_path": dev.join("nvidiactl").display().to_string()},
            {"container_path": format!("/dev/nvidia{}", inv.gpus[1].minor), "host_path": dev.join(format!("nvidia{}", inv.gpus[1].minor)).display().to_string()},
        ])
    );
}

#[test]
fn gpu_memory_units_mps_limits_and_gds_reach_the_kubelet() {
    if !have_grpcio() {
        return;
    }
    let inv = inventory("pcie-pairs");
    let mut node = Node::new();
    // GPU 2 shared through MPS, the others as memory units: a GPU is advertised one way only.
    let config = node.config(
        "version: v1\nflags:\n  gdsEnabled: true\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      devices: [2]\n      replicas: 2\n",
    );
    // GiB units per GPU; none on the MPS-shared GPU 2.
    let units: Vec<usize> = inv
        .gpus
        .iter()
        .map(|g| {
            if g.index == 2 {
                0
            } else {
                (g.memory_bytes >> 30) as usize
            }
        })
        .collect();
    // The first-list index of unit `n` of GPU `g`.
    let at = |g: usize, n: usize| format!("@{}", units[..g].iter().sum::<usize>() + n);
    let mem = "nvidia.com/gpu-memory";
    let one_gpu = format!("{mem}={},{},{}", at(1, 0), at(1, 1), at(1, 5));
    let two_gpus = format!("{mem}={},{}", at(0, 0), at(3, 0));
    let available: Vec<String> = [at(0, 0), at(0, 1)]
        .into_iter()
        .chain((0..5).map(|n| at(3, n)))
        .collect();
    let prefer = format!("{mem}=4::{}", available.join(","));
    let r = node.run(
        &["--profile", "pcie-pairs", "--device-plugin-gpu-memory"],
        Some(&config),
        &[
            "--expect",
            "nvidia.com/gpu",
            "--expect",
            mem,
            "--allocate",
            &one_gpu,
            "--allocate",
            &two_gpus,
            "--allocate",
            "nvidia.com/gpu=@1",
            "--preferred",
            &prefer,
        ],
    );
    r.assert_ok();
    assert_eq!(
        r.one("kubelet", "Register")["unexpected"],
        serde_json::json!([])
    );

    // One device per GiB of each GPU not shared otherwise, with the GPU's NUMA node.
    let listed = r.one(mem, "ListAndWatch")["devices"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(listed.len(), units.iter().sum::<usize>());
    for (g, gpu) in inv.gpus.iter().enumerate().filter(|(g, _)| units[*g] > 0) {
        for n in [0, units[g] - 1] {
            let i: usize = at(g, n)[1..].parse().unwrap();
            assert_eq!(listed[i]["id"], format!("{}::mem-{n}", gpu.uuid));
            assert_eq!(
                listed[i]["numa"],
                serde_json::json!([gpu.numa_node.unwrap()])
            );
            assert_eq!(listed[i]["health"], "Healthy");
        }
    }

    let allocs = r.all(mem, "Allocate");
    let uuid = |g: usize| inv.gpus[g].uuid.as_str();
    assert_eq!(
        allocs[0]["envs"],
        serde_json::json!({
            "NVIDIA_VISIBLE_DEVICES": uuid(1),
            // Index-keyed (the container's one GPU is 0): NVIDIA's device plugin v0.15.0
            // found UUID-keyed limits not applied.
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=3G",
            "NVIDIA_GDS": "enabled",
        })
    );
    assert_eq!(allocs[1]["ok"], false);
    let msg = allocs[1]["message"].as_str().unwrap();
    assert!(
        msg.contains("must come from one GPU") && msg.contains(uuid(0)) && msg.contains(uuid(3)),
        "{msg}"
    );
    // Packed on the GPU that holds all four.
    let got = strings(&r.one(mem, "GetPreferredAllocation")["ids"]);
    assert_eq!(got.len(), 4);
    assert!(got.iter().all(|id| id.starts_with(uuid(3))), "{got:?}");

    // MPS replicas of GPU 2, and only of it: the daemon's pipe and the per-client shares of
    // NVIDIA's daemon defaults.
    let gpu = strings(
        &r.one("nvidia.com/gpu", "ListAndWatch")["devices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["id"].clone())
            .collect::<serde_json::Value>(),
    );
    assert_eq!(gpu, [format!("{}::0", uuid(2)), format!("{}::1", uuid(2))]);
    let a = r.one("nvidia.com/gpu", "Allocate");
    assert_eq!(a["envs"]["NVIDIA_VISIBLE_DEVICES"], uuid(2));
    assert_eq!(
        a["envs"]["CUDA_MPS_PIPE_DIRECTORY"],
        "/mps/nvidia.com/gpu/pipe"
    );
    assert_eq!(a["envs"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"], "50");
    assert_eq!(
        a["envs"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"],
        format!("0={}M", (inv.gpus[2].memory_bytes >> 20) / 2)
    );
    assert_eq!(a["envs"]["NVIDIA_GDS"], "enabled");
}
