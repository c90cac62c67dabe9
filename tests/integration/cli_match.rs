//! `nvdra match` and `nvdra validate` end to end: the built binary on the example claims over
//! the built-in profiles, its exit codes (0 satisfiable, 1 not, 2 bad input), the JSON output,
//! ResourceSlices read from a file as `nvdra inventory -o slices` prints them, a health-tainted
//! GPU kept out unless the claim tolerates its taint, NVIDIA's consumable-shares demos as they
//! allocate on NVIDIA's driver, and validation errors with their object, field path and column.

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use support::apiserver::TestApiServer;

fn nvdra(args: &[&str]) -> Output {
    nvdra_with(args, &[])
}

/// [`nvdra`] with `env` set.
fn nvdra_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nvdra"));
    cmd.args(args).current_dir(env!("CARGO_MANIFEST_DIR"));
    for var in [
        "NVDRA_CONFIG",
        "NVDRA_BACKEND",
        "NVDRA_PROFILE",
        "NVDRA_TOPOLOGY",
        "NVDRA_SLICES",
        "NODE_NAME",
        "NVIDIA_DRIVER_ROOT",
        "NVDRA_DRIVER_NAME",
        "NVDRA_PARTITIONABLE",
        "NVDRA_SHARED_CAPACITY",
        "CONSUMABLE_SHARES",
        "NVDRA_DYNAMIC_MIG",
        "NVDRA_MIG_PROFILES",
        "NVDRA_SHARE_TRUST_DOMAIN",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("NODE_NAME", "node-a");
    cmd.envs(env.iter().copied());
    cmd.output().expect("run nvdra")
}

const TWO_GPUS: &str = "manifests/examples/two-gpus-one-nvlink-domain.yaml";
const MIG_1G: &str = "manifests/examples/mig-1g-a100.yaml";

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

/// Asserts that `out` exited 0 and that its stdout contains `text`; either failure prints the
/// stdout.
fn assert_succeeds_with(out: &Output, text: &str) {
    let printed = stdout(out);
    assert!(out.status.success(), "{printed}");
    assert!(printed.contains(text), "{printed}");
}

/// The claim named `name` in `nvdra match -o json` output `v`.
fn claim_named<'a>(v: &'a Value, name: &str) -> &'a Value {
    v.as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap()
}

#[test]
fn two_nvlinked_gpus_fit_a_dgx_h100() {
    let out = nvdra(&[
        "match",
        "-f",
        TWO_GPUS,
        "--profile",
        "dgx-h100",
        "-o",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let v = json(&out);
    let claim = &v[0];
    assert_eq!(claim["satisfiable"], true);
    assert_eq!(claim["requests"][0]["fits"].as_array().unwrap().len(), 8);
    let alloc = claim["allocation"].as_array().unwrap();
    assert_eq!(alloc.len(), 2);
    assert_ne!(alloc[0]["device"], alloc[1]["device"]);
    assert_eq!(alloc[0]["request"], "gpus");
    assert_eq!(alloc[0]["pool"], "node-a");
}

#[test]
fn two_nvlinked_gpus_do_not_fit_l40s_and_the_reason_is_the_constraint() {
    let out = nvdra(&["match", "-f", TWO_GPUS, "--profile", "l40s-pcie"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let text = stdout(&out);
    // All four have the memory; no two share an NVLink domain.
    assert!(text.contains("fits: gpu-0, gpu-1, gpu-2, gpu-3"), "{text}");
    assert!(
        text.contains("not satisfiable: matchAttribute gpu.nvidia.com/nvlinkDomain"),
        "{text}"
    );
    assert!(
        text.contains("0: gpu-0; 1: gpu-1; 2: gpu-2; 3: gpu-3"),
        "{text}"
    );
}

#[test]
fn a_mig_1g_device_on_an_a100_mig_mixed_node() {
    let out = nvdra(&[
        "match",
        "-f",
        MIG_1G,
        "--profile",
        "a100-mig-mixed",
        "-o",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let v = json(&out);
    let req = &v[0]["requests"][0];
    let fits: Vec<&str> = req["fits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap())
        .collect();
    assert_eq!(fits.len(), 5, "{fits:?}");
    assert!(fits.iter().all(|d| d.contains("-mig-1g")), "{fits:?}");
    // Each other device says which check it failed, with its value.
    let reasons: Vec<(String, String)> = req["rejected"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["device"].as_str().unwrap().to_string(),
                r["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let why = |d: &str| &reasons.iter().find(|(n, _)| n == d).unwrap().1;
    assert_eq!(
        why("gpu-0"),
        "class mig.nvidia.com selector[0]: type \"gpu\" != \"mig\""
    );
    assert!(why("gpu-1-mig-2g10gb-14-0").contains("profile \"2g.10gb\""));
    assert_eq!(
        v[0]["allocation"][0]["device"].as_str().unwrap(),
        fits[0],
        "the first fitting device is allocated"
    );
}

#[test]
fn a_memory_selector_reports_the_device_value() {
    let dir = tempfile::tempdir().unwrap();
    let claim = dir.path().join("big.yaml");
    std::fs::write(
        &claim,
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: big, namespace: default}
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        deviceClassName: gpu.nvidia.com
        selectors:
        - cel: {expression: "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0"}
"#,
    )
    .unwrap();
    let out = nvdra(&[
        "match",
        "-f",
        claim.to_str().unwrap(),
        "--profile",
        "l40s-pcie",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(
        text.contains("gpu-0  selectors[0]: memory 48Gi < 80Gi"),
        "{text}"
    );
    assert!(text.contains("request gpu needs 1 device, 0 fit"), "{text}");
}

#[test]
fn slices_from_a_file_as_inventory_prints_them() {
    let dir = tempfile::tempdir().unwrap();
    let slices = dir.path().join("slices.yaml");
    let inv = nvdra(&["inventory", "--profile", "dgx-h100", "-o", "slices"]);
    assert!(inv.status.success());
    std::fs::write(&slices, &inv.stdout).unwrap();
    let s = slices.to_str().unwrap();
    let out = nvdra(&["match", "-f", TWO_GPUS, "--slices", s, "-o", "json"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        json(&out)[0]["requests"][0]["fits"]
            .as_array()
            .unwrap()
            .len(),
        8
    );
    // The same slices among the -f files.
    let out = nvdra(&["match", "-f", TWO_GPUS, "-f", s]);
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn bad_input_exits_2_naming_the_file_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| -> PathBuf {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let missing_class = write(
        "c.yaml",
        "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: c}\nspec:\n  devices:\n    requests:\n    - name: r\n      exactly: {deviceClassName: nope}\n",
    );
    let bad_count = write(
        "n.yaml",
        "---\n# second document\n---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: n}\nspec:\n  devices:\n    requests:\n    - name: r\n      exactly: {deviceClassName: gpu.nvidia.com, count: many}\n",
    );
    let pod = write("p.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n");
    let not_object = write("f.yaml", "kind: Foo\nmetadata: {name: f}\n");
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "match",
                "-f",
                missing_class.to_str().unwrap(),
                "--profile",
                "dgx-h100",
            ],
            "spec.devices.requests[0].exactly.deviceClassName: no DeviceClass \"nope\"",
        ),
        (
            &[
                "match",
                "-f",
                bad_count.to_str().unwrap(),
                "--profile",
                "dgx-h100",
            ],
            "ResourceClaim n: field spec.devices.requests[0].exactly.count",
        ),
        (
            &[
                "match",
                "-f",
                pod.to_str().unwrap(),
                "--profile",
                "dgx-h100",
            ],
            // Beside claims a Pod is skipped; alone, there is nothing to match.
            "no ResourceClaim or ResourceClaimTemplate in",
        ),
        (
            &[
                "match",
                "-f",
                not_object.to_str().unwrap(),
                "--profile",
                "dgx-h100",
            ],
            "not a Kubernetes object (kind \"Foo\"",
        ),
        (
            &["match", "-f", "/nonexistent.yaml", "--profile", "dgx-h100"],
            "/nonexistent.yaml",
        ),
        (
            &["validate", "-f", "/nonexistent.yaml"],
            "/nonexistent.yaml",
        ),
    ];
    for (args, want) in cases {
        let out = nvdra(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err} lacks {want:?}");
    }
}

#[test]
fn validate_reports_object_field_path_and_column() {
    let ok = nvdra(&[
        "validate",
        "-f",
        TWO_GPUS,
        "-f",
        MIG_1G,
        "-f",
        "manifests/base/deviceclasses.yaml",
    ]);
    assert_eq!(ok.status.code(), Some(0), "{}", stdout(&ok));
    assert!(
        stdout(&ok).contains("6 objects, every CEL expression compiles"),
        "{}",
        stdout(&ok)
    );

    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        r#"apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: broken}
spec:
  selectors:
  - cel: {expression: "device.driver == 'x' &&"}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: t}
spec:
  spec:
    devices:
      requests:
      - name: a
        exactly:
          deviceClassName: gpu.nvidia.com
          selectors:
          - cel: {expression: "true"}
          - cel: {expression: "device.attributes['gpu.nvidia.com'].x ==== 1"}
      - name: b
        firstAvailable:
        - name: s
          deviceClassName: gpu.nvidia.com
          selectors:
          - cel: {expression: "1"}
"#,
    )
    .unwrap();
    let out = nvdra(&["validate", "-f", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[0].contains("DeviceClass broken: spec.selectors[0].cel.expression: column "),
        "{text}"
    );
    assert!(
        lines[1].contains(
            "ResourceClaimTemplate t: spec.spec.devices.requests[0].exactly.selectors[1].cel.expression: column 41"
        ),
        "{text}"
    );
    assert!(
        lines[2].contains(
            "spec.spec.devices.requests[1].firstAvailable[0].selectors[0].cel.expression"
        ) && lines[2].contains("must evaluate to bool"),
        "{text}"
    );
}

/// The node's slices as `nvdra inventory -o slices` prints them, named as the API server would.
fn published(profile: &str, node: &str) -> Vec<k8s_openapi::api::resource::v1::ResourceSlice> {
    let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
        .args([
            "inventory",
            "--profile",
            profile,
            "--node-name",
            node,
            "-o",
            "slices",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let mut objects = nvdra::matching::Objects::default();
    nvdra::matching::input::read_text(
        Path::new("slices.yaml"),
        &String::from_utf8(out.stdout).unwrap(),
        &mut objects,
    )
    .unwrap();
    objects
        .slices
        .into_iter()
        .enumerate()
        .map(|(i, mut s)| {
            s.metadata.name = Some(format!("{node}-{i}"));
            s
        })
        .collect()
}

#[tokio::test]
async fn a_live_cluster_is_explained_per_node() {
    let server = TestApiServer::start().await;
    for s in published("dgx-h100", "node-h100")
        .into_iter()
        .chain(published("l40s-pcie", "node-l40s"))
    {
        server.insert_slice(s);
    }
    let mut classes = nvdra::matching::Objects::default();
    nvdra::matching::input::read_text(
        Path::new("deviceclasses.yaml"),
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("manifests/base/deviceclasses.yaml"),
        )
        .unwrap(),
        &mut classes,
    )
    .unwrap();
    for (c, _) in classes.classes {
        server.seed_device_class(c);
    }
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, server.kubeconfig()).unwrap();
    let writes_before = server.counts().write_requests;
    let kc = kubeconfig.to_str().unwrap().to_string();
    let all = {
        let kc = kc.clone();
        tokio::task::spawn_blocking(move || {
            nvdra(&["match", "-f", TWO_GPUS, "--kubeconfig", &kc, "-o", "json"])
        })
        .await
        .unwrap()
    };
    assert_eq!(
        all.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&all.stderr)
    );
    let v = json(&all);
    let by_node: Vec<(String, bool)> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["node"].as_str().unwrap().to_string(),
                r["satisfiable"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        by_node,
        [
            ("node-h100".to_string(), true),
            ("node-l40s".to_string(), false)
        ]
    );
    // One node only: the L40S node cannot hold the claim.
    let one = tokio::task::spawn_blocking(move || {
        nvdra(&[
            "match",
            "-f",
            TWO_GPUS,
            "--kubeconfig",
            &kc,
            "--node",
            "node-l40s",
        ])
    })
    .await
    .unwrap();
    assert_eq!(one.status.code(), Some(1));
    let text = stdout(&one);
    assert!(text.contains("on node node-l40s"), "{text}");
    assert!(!text.contains("node-h100"), "{text}");
    // Read-only.
    assert_eq!(server.counts().write_requests, writes_before);
}

#[test]
fn a_tainted_gpu_is_reported_and_a_toleration_lets_the_claim_fit() {
    let dir = tempfile::tempdir().unwrap();
    let slices = dir.path().join("slices.yaml");
    // As `nvdra run` publishes a GPU after XID 79: still listed, with a taint.
    std::fs::write(
        &slices,
        r#"apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata: {name: node-a-gpu}
spec:
  driver: gpu.nvidia.com
  nodeName: node-a
  pool: {name: node-a, generation: 1, resourceSliceCount: 1}
  devices:
  - name: gpu-0
    attributes:
      type: {string: gpu}
    taints:
    - {key: gpu.nvidia.com/xid, value: "79", effect: NoSchedule}
  - name: gpu-1
    attributes:
      type: {string: gpu}
"#,
    )
    .unwrap();
    let claim = |tolerations: &str| {
        let p = dir.path().join(format!("claim-{}.yaml", tolerations.len()));
        std::fs::write(
            &p,
            format!(
                "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: two, namespace: default}}\nspec:\n  devices:\n    requests:\n    - name: gpus\n      exactly:\n        deviceClassName: gpu.nvidia.com\n        count: 2\n        tolerations: {tolerations}\n"
            ),
        )
        .unwrap();
        p
    };
    let s = slices.to_str().unwrap();
    let strict = claim("[]");
    let out = nvdra(&["match", "-f", strict.to_str().unwrap(), "--slices", s]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let text = stdout(&out);
    assert!(text.contains("fits: gpu-1\n"), "{text}");
    assert!(
        text.contains("gpu-0  tainted gpu.nvidia.com/xid=79:NoSchedule, not tolerated"),
        "{text}"
    );
    assert!(
        text.contains("not satisfiable: request gpus needs 2 devices, 1 fits"),
        "{text}"
    );
    let out = nvdra(&[
        "match",
        "-f",
        strict.to_str().unwrap(),
        "--slices",
        s,
        "-o",
        "json",
    ]);
    let v = json(&out);
    assert_eq!(
        v[0]["requests"][0]["rejected"][0],
        serde_json::json!({
            "device": "gpu-0",
            "reason": "tainted gpu.nvidia.com/xid=79:NoSchedule, not tolerated"
        })
    );
    let lenient = claim("[{key: gpu.nvidia.com/xid, operator: Exists, effect: NoSchedule}]");
    let out = nvdra(&[
        "match",
        "-f",
        lenient.to_str().unwrap(),
        "--slices",
        s,
        "-o",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let v = json(&out);
    let devices: Vec<&str> = v[0]["allocation"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["device"].as_str().unwrap())
        .collect();
    assert_eq!(devices, ["gpu-0", "gpu-1"]);
}

/// A ResourceClaim `name` for one device of `class` on the GPU of index 0, asking `capacity`
/// (a YAML flow mapping, or empty), with `status` (a status block, or empty).
fn on_gpu0(name: &str, class: &str, capacity: &str, status: &str) -> String {
    let capacity = match capacity {
        "" => String::new(),
        c => format!("        capacity: {{requests: {c}}}\n"),
    };
    format!(
        "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}}}\nspec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        deviceClassName: {class}\n        selectors:\n        - cel: {{expression: \"device.attributes['gpu.nvidia.com'].index == 0\"}}\n{capacity}{status}"
    )
}

#[test]
fn shares_of_a_gpu_add_up_and_exclude_the_whole_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let slices = dir.path().join("slices.yaml");
    let inv = nvdra(&[
        "inventory",
        "--profile",
        "dgx-h100",
        "-o",
        "slices",
        "--shared-capacity",
    ]);
    assert!(
        inv.status.success(),
        "{}",
        String::from_utf8_lossy(&inv.stderr)
    );
    std::fs::write(&slices, &inv.stdout).unwrap();
    let run = |claims: &str| -> (Option<i32>, Value, String) {
        let file = dir.path().join("claims.yaml");
        std::fs::write(&file, claims).unwrap();
        let (f, s) = (file.to_str().unwrap(), slices.to_str().unwrap());
        let out = nvdra(&["match", "-f", f, "--slices", s, "-o", "json"]);
        // Built in-process from the profile, the slices are the same.
        let same = nvdra(&[
            "match",
            "-f",
            f,
            "--profile",
            "dgx-h100",
            "--shared-capacity",
        ]);
        assert_eq!(same.status.code(), out.status.code(), "{}", stdout(&same));
        (out.status.code(), json(&out), stdout(&same))
    };
    let reason = |claim: &Value, device: &str| -> String {
        claim["requests"][0]["rejected"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["device"] == device)
            .unwrap_or_else(|| panic!("{device} fits: {claim}"))["reason"]
            .as_str()
            .unwrap()
            .to_string()
    };
    // NVIDIA's claim shape: the GPU class and a memory request.
    const GPU: &str = "gpu.nvidia.com";
    const SHARE_24: &str = "{memory: 24Gi}";

    // Three shares of 24Gi fit on gpu-0, a fourth does not: its memory is gone.
    let four: String = ["a", "b", "c", "d"]
        .iter()
        .map(|n| on_gpu0(n, GPU, SHARE_24, ""))
        .collect();
    let (code, v, _) = run(&four);
    assert_eq!(code, Some(1), "{v}");
    for share in &v.as_array().unwrap()[..3] {
        let a = &share["allocation"][0];
        assert_eq!(a["device"], "gpu-0", "{share}");
        assert_eq!(a["consumedCapacity"]["memory"], "24Gi", "{share}");
        assert_eq!(a["consumedCapacity"]["multiprocessors"], "0", "{share}");
        assert!(a["consumedCapacity"].get("compute").is_none(), "{share}");
    }
    assert_eq!(v[3]["satisfiable"], false);
    assert_eq!(
        reason(&v[3], "gpu-0"),
        "memory 24Gi > 8Gi left (gpu-0: 72Gi held by claims a, b, c)"
    );

    // A claim that asks for no memory gets all of gpu-0 (the policy's default): it does not fit
    // once a share of it is taken.
    let (code, v, _) = run(&format!(
        "{}{}",
        on_gpu0("share", GPU, SHARE_24, ""),
        on_gpu0("whole", GPU, "", "")
    ));
    assert_eq!(code, Some(1), "{v}");
    assert_eq!(v[0]["allocation"][0]["device"], "gpu-0");
    assert_eq!(
        reason(&v[1], "gpu-0"),
        "memory 80Gi > 56Gi left (gpu-0: 24Gi held by claim share)"
    );

    // Nor a share of a GPU allocated whole (status.allocation, as the scheduler wrote it).
    let status = "status:\n  allocation:\n    devices:\n      results:\n      - {request: gpu, driver: gpu.nvidia.com, pool: node-a, device: gpu-0, shareID: 1f0c7e2a-8a5b-4c41-9d4e-3b2f1a0c9d8e, consumedCapacity: {memory: 80Gi, multiprocessors: \"0\"}}\n";
    let (code, v, table) = run(&format!(
        "{}{}",
        on_gpu0("share", GPU, SHARE_24, ""),
        on_gpu0("whole", GPU, "", status)
    ));
    assert_eq!(code, Some(1), "{v}");
    assert_eq!(
        reason(&v[0], "gpu-0"),
        "memory 24Gi > 0 left (gpu-0: 80Gi held by claim whole)"
    );
    assert_eq!(v[1]["allocated"], true);
    assert!(
        table.contains("  allocated: gpu → gpu-0 (memory 80Gi, multiprocessors 0)\n"),
        "{table}"
    );
}

/// `nvdra match --dynamic-mig` on dgx-h100 allocates across the whole/MIG pool as the scheduler
/// would, by the counters: a whole-GPU claim, then a 3g and a 1g claim beside each other on
/// another GPU, never the one taken whole; the slices `nvdra inventory -o slices --dynamic-mig`
/// prints give the same answers.
#[test]
fn whole_and_mig_claims_share_the_dynamic_mig_pool_by_its_counters() {
    let dir = tempfile::tempdir().unwrap();
    let mig = |name: &str, profile: &str| {
        format!(
            "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: {name}}}\nspec:\n  devices:\n    requests:\n    - name: g\n      exactly:\n        deviceClassName: mig.nvidia.com\n        selectors:\n        - cel: {{expression: \"device.attributes['gpu.nvidia.com'].profile == '{profile}'\"}}\n"
        )
    };
    let whole = "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: whole}\nspec:\n  devices:\n    requests:\n    - name: g\n      exactly: {deviceClassName: gpu.nvidia.com, selectors: [{cel: {expression: \"device.attributes['gpu.nvidia.com'].index == 0\"}}]}\n";
    let claims = dir.path().join("claims.yaml");
    std::fs::write(
        &claims,
        format!(
            "{whole}{}{}{}",
            mig("three", "3g.40gb"),
            mig("one", "1g.10gb"),
            // Only GPU 0's placements: taken whole, so this one does not fit.
            mig("on-zero", "1g.10gb").replace(
                "== '1g.10gb'",
                "== '1g.10gb' && device.attributes['gpu.nvidia.com'].parentIndex == 0"
            )
        ),
    )
    .unwrap();
    let f = claims.to_str().unwrap();
    let inv = nvdra(&[
        "inventory",
        "--profile",
        "dgx-h100",
        "-o",
        "slices",
        "--dynamic-mig",
    ]);
    assert!(
        inv.status.success(),
        "{}",
        String::from_utf8_lossy(&inv.stderr)
    );
    let slices = dir.path().join("slices.yaml");
    std::fs::write(&slices, &inv.stdout).unwrap();
    let from_profile = nvdra(&[
        "match",
        "-f",
        f,
        "--profile",
        "dgx-h100",
        "--dynamic-mig",
        "-o",
        "json",
    ]);
    let from_file = nvdra(&[
        "match",
        "-f",
        f,
        "--slices",
        slices.to_str().unwrap(),
        "-o",
        "json",
    ]);
    assert_eq!(json(&from_profile), json(&from_file));
    assert_eq!(
        from_profile.status.code(),
        Some(1),
        "{}",
        stdout(&from_profile)
    );
    let v = json(&from_profile);
    let device = |i: usize| {
        v[i]["allocation"][0]["device"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(device(0), "gpu-0");
    let (three, one) = (device(1), device(2));
    assert!(three.starts_with("gpu-1-mig-3g40gb-9-"), "{three}");
    assert!(one.starts_with("gpu-1-mig-1g10gb-19-"), "{one}");
    assert_eq!(v[3]["satisfiable"], false);
    let rejected = v[3]["requests"][0]["rejected"].as_array().unwrap();
    let why = rejected
        .iter()
        .find(|r| r["device"] == "gpu-0-mig-1g10gb-19-0")
        .unwrap()["reason"]
        .as_str()
        .unwrap();
    assert!(why.contains("taken by gpu-0 (claim whole)"), "{why}");
}

/// NVIDIA's three consumable-shares demos, as NVIDIA ships them.
const NVIDIA_DEMOS: [&str; 3] = [
    "tests/data/nvidia-consumable-shares/integer-sharing.yaml",
    "tests/data/nvidia-consumable-shares/unlimited-sharing.yaml",
    "tests/data/nvidia-consumable-shares/memory-sharing.yaml",
];

/// The dgx-h100 profile's 8 GPUs (80Gi each) as NVIDIA's DRA driver publishes them with
/// `--consumable-shares=<mode>`: each `gpu-<minor>` of type `gpu` with one capacity, `memory`
/// (rounded down to 1Mi), and in integer mode `shares`, with the request policies of its
/// `cmd/gpu-kubelet-plugin/consumable_shares.go` (kubernetes-sigs/dra-driver-nvidia-gpu at
/// 95932046): `memory` default all of it and min 1Mi in `memory` mode, default and min 0
/// otherwise, max all of it, step 1Mi; `shares` N, default 1, min 1, max N, step 1.
fn nvidia_slices(mode: &str) -> Value {
    let (default, min) = match mode {
        "memory" => ("80Gi", "1Mi"),
        _ => ("0", "0"),
    };
    let devices: Vec<Value> = (0..8)
        .map(|minor| {
            let mut capacity = serde_json::json!({
                "memory": {
                    "value": "80Gi",
                    "requestPolicy": {
                        "default": default,
                        "validRange": {"min": min, "max": "80Gi", "step": "1Mi"},
                    },
                },
            });
            if let Ok(n) = mode.parse::<u32>() {
                capacity["shares"] = serde_json::json!({
                    "value": n.to_string(),
                    "requestPolicy": {
                        "default": "1",
                        "validRange": {"min": "1", "max": n.to_string(), "step": "1"},
                    },
                });
            }
            serde_json::json!({
                "name": format!("gpu-{minor}"),
                "allowMultipleAllocations": true,
                "attributes": {
                    "type": {"string": "gpu"},
                    "productName": {"string": "NVIDIA H100 80GB HBM3"},
                },
                "capacity": capacity,
            })
        })
        .collect();
    serde_json::json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-a-gpu.nvidia.com-nvidia"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "devices": devices,
        },
    })
}

/// A replica's expected GPU, and what it consumes of `memory` and `shares`.
type Replica = (&'static str, &'static str, Option<&'static str>);

/// Each claim `nvdra match` explained, with the device it got and what it consumed of the
/// capacities both drivers publish (`memory`, `shares`), in order.
fn allocations(out: &Output) -> Vec<(String, String, String, Option<String>)> {
    assert_eq!(out.status.code(), Some(0), "{}", stdout(out));
    json(out)
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let a = &c["allocation"][0];
            let consumed = &a["consumedCapacity"];
            (
                c["name"].as_str().unwrap().to_string(),
                a["device"].as_str().unwrap().to_string(),
                consumed["memory"].as_str().unwrap_or("?").to_string(),
                consumed["shares"].as_str().map(String::from),
            )
        })
        .collect()
}

/// NVIDIA's consumable-shares demos, unchanged (a Namespace, a ResourceClaimTemplate, and a
/// Deployment whose replicas each get a claim from it), allocate on nvdra's slices in each of
/// NVIDIA's modes as on slices of NVIDIA's shape: the same GPUs, consuming the same memory and
/// shares. And as NVIDIA's README says: in integer mode (`4`) the four replicas of
/// `integer-sharing.yaml` pack onto one GPU, one share each; in `unlimited` mode replicas that
/// ask for nothing consume no memory and share one GPU; in `memory` mode one that asks for no
/// memory takes a GPU whole, and `memory-sharing.yaml`'s 4Gi replicas share one.
#[test]
fn nvidias_consumable_shares_demos_allocate_as_on_nvidias_driver() {
    let dir = tempfile::tempdir().unwrap();
    // The claims Kubernetes makes from the template, one per replica.
    let pods = |template: &str, deployment: &str, n: usize| -> Vec<String> {
        (1..=n)
            .map(|i| format!("{template} (Deployment {deployment}, pod {i} of {n})"))
            .collect()
    };
    // Per mode and demo: the GPU of each replica, and what it consumes of memory and shares.
    let one = Some("1");
    let cases: [(&str, [Vec<Replica>; 3]); 3] = [
        (
            "4",
            [
                vec![("gpu-0", "0", one); 4],
                vec![("gpu-0", "0", one); 2],
                vec![("gpu-0", "4Gi", one); 2],
            ],
        ),
        (
            "unlimited",
            [
                vec![("gpu-0", "0", None); 4],
                vec![("gpu-0", "0", None); 2],
                vec![("gpu-0", "4Gi", None); 2],
            ],
        ),
        (
            "memory",
            [
                vec![
                    ("gpu-0", "80Gi", None),
                    ("gpu-1", "80Gi", None),
                    ("gpu-2", "80Gi", None),
                    ("gpu-3", "80Gi", None),
                ],
                vec![("gpu-0", "80Gi", None), ("gpu-1", "80Gi", None)],
                vec![("gpu-0", "4Gi", None); 2],
            ],
        ),
    ];
    for (mode, expected) in cases {
        let theirs = dir.path().join(format!("nvidia-{mode}.json"));
        std::fs::write(&theirs, nvidia_slices(mode).to_string()).unwrap();
        for (demo, want) in NVIDIA_DEMOS.iter().zip(expected) {
            let ours = allocations(&nvdra(&[
                "match",
                "-f",
                demo,
                "--profile",
                "dgx-h100",
                &format!("--consumable-shares={mode}"),
                "-o",
                "json",
            ]));
            let nvidia = allocations(&nvdra(&[
                "match",
                "-f",
                demo,
                "--slices",
                theirs.to_str().unwrap(),
                "-o",
                "json",
            ]));
            assert_eq!(ours, nvidia, "{demo} with --consumable-shares={mode}");
            let (template, deployment) = match *demo {
                d if d.contains("integer") => ("gpu-1share", "integer-sharing"),
                d if d.contains("unlimited") => ("gpu-unlimited", "unlimited-sharing"),
                _ => ("gpu-4gi", "memory-sharing"),
            };
            let names = pods(template, deployment, want.len());
            let want: Vec<(String, String, String, Option<String>)> = names
                .into_iter()
                .zip(want)
                .map(|(name, (gpu, memory, shares))| {
                    (name, gpu.into(), memory.into(), shares.map(String::from))
                })
                .collect();
            assert_eq!(ours, want, "{demo} with --consumable-shares={mode}");
        }
    }
}

/// Up to N claims share a GPU in integer mode, as NVIDIA's README says: a fifth replica of
/// `integer-sharing.yaml` with `--consumable-shares=4` goes to the next GPU, on nvdra's slices as
/// on NVIDIA's; with `--shared-capacity` (the `memory` mode) the replicas take a GPU each.
#[test]
fn a_fifth_integer_share_goes_to_the_next_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let demo = std::fs::read_to_string(NVIDIA_DEMOS[0]).unwrap();
    assert!(
        demo.contains("  replicas: 4\n"),
        "the demo as NVIDIA ships it"
    );
    let five = dir.path().join("five.yaml");
    std::fs::write(&five, demo.replace("  replicas: 4\n", "  replicas: 5\n")).unwrap();
    let theirs = dir.path().join("nvidia-4.json");
    std::fs::write(&theirs, nvidia_slices("4").to_string()).unwrap();
    let five = five.to_str().unwrap();
    let ours = allocations(&nvdra(&[
        "match",
        "-f",
        five,
        "--profile",
        "dgx-h100",
        "--consumable-shares=4",
        "-o",
        "json",
    ]));
    let gpus: Vec<&str> = ours.iter().map(|a| a.1.as_str()).collect();
    assert_eq!(gpus, ["gpu-0", "gpu-0", "gpu-0", "gpu-0", "gpu-1"]);
    let nvidia = allocations(&nvdra(&[
        "match",
        "-f",
        five,
        "--slices",
        theirs.to_str().unwrap(),
        "-o",
        "json",
    ]));
    assert_eq!(ours, nvidia);
    let memory = allocations(&nvdra(&[
        "match",
        "-f",
        five,
        "--profile",
        "dgx-h100",
        "--shared-capacity",
        "-o",
        "json",
    ]));
    let gpus: Vec<&str> = memory.iter().map(|a| a.1.as_str()).collect();
    assert_eq!(gpus, ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4"]);
    // The environment name NVIDIA's Helm chart sets works as the flag does.
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nvdra"));
    cmd.args(["match", "-f", five, "--profile", "dgx-h100", "-o", "json"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("NODE_NAME", "node-a")
        .env("CONSUMABLE_SHARES", "4");
    for var in ["NVDRA_CONFIG", "NVDRA_SHARED_CAPACITY"] {
        cmd.env_remove(var);
    }
    assert_eq!(allocations(&cmd.output().unwrap()), ours);
}

/// A burstable share (`manifests/examples/gpu-share-burst.yaml`: 20Gi that may burst to 40Gi)
/// is packed by its 20Gi: four replicas fit one 80Gi H100, and each shows its burst limit
/// beside what it consumed. A burst prepare would refuse is shown with its field.
#[test]
fn burstable_shares_are_packed_by_their_request_and_show_their_burst_limit() {
    let example = std::fs::read_to_string("manifests/examples/gpu-share-burst.yaml").unwrap();
    let template = example.split("\n---\n").next().unwrap();
    let deployment = "---\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: bursty}\nspec:\n  replicas: 4\n  selector: {matchLabels: {app: bursty}}\n  template:\n    metadata: {labels: {app: bursty}}\n    spec:\n      containers:\n      - {name: cuda, image: cuda, resources: {claims: [{name: gpu}]}}\n      resourceClaims:\n      - {name: gpu, resourceClaimTemplateName: gpu-share-burst}\n";
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bursty.yaml");
    std::fs::write(&file, format!("{template}\n{deployment}")).unwrap();
    let f = file.to_str().unwrap();
    let args = |o: &'static str| {
        [
            "match",
            "-f",
            f,
            "--profile",
            "dgx-h100",
            "--shared-capacity",
            "-o",
            o,
        ]
    };
    let out = nvdra(&args("json"));
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let v = json(&out);
    let claims = v.as_array().unwrap();
    assert_eq!(claims.len(), 4, "{v}");
    for c in claims {
        let a = &c["allocation"][0];
        assert_eq!(a["device"], "gpu-0", "{v}");
        assert_eq!(a["consumedCapacity"]["memory"], "20Gi", "{v}");
        assert_eq!(a["burstLimit"], "40Gi", "{v}");
        assert!(a.get("configError").is_none(), "{v}");
    }
    let table = stdout(&nvdra(&args("table")));
    assert_eq!(
        table
            .matches("gpu → gpu-0 (memory 20Gi, multiprocessors 0, may burst to 40Gi)")
            .count(),
        4,
        "{table}"
    );

    // Above the GPU: allocated by the scheduler, refused at prepare, said so.
    std::fs::write(&file, template.replace("40Gi", "96Gi")).unwrap();
    let out = nvdra(&args("table"));
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert!(
        stdout(&out).contains(
            "refused at prepare: sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: 96Gi is more \
             than the GPU's 80Gi of memory"
        ),
        "{}",
        stdout(&out)
    );
}

/// Shares of a MIG device, as NVIDIA's modes share them: replicas of a claim template for a
/// 3g.20gb MIG device share the one the a100-mig-mixed node has. In integer mode (`4`) four
/// replicas that ask for nothing take one share each of it, and a fifth does not fit (no other
/// 3g.20gb device); in `memory` mode two 8Gi replicas share it and a third does not fit
/// (19968Mi); without a share mode a second replica does not fit. `multiprocessors`, the
/// engines and the memory slices, which no replica asks for, are charged 0.
#[test]
fn replicas_share_a_mig_device_in_each_mode() {
    let dir = tempfile::tempdir().unwrap();
    let file = |replicas: usize, memory: Option<&str>| {
        let capacity = memory.map_or(String::new(), |m| {
            format!("\n          capacity:\n            requests:\n              memory: {m}")
        });
        let text = format!(
            "apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  namespace: default
  name: mig-share
spec:
  spec:
    devices:
      requests:
      - name: mig
        exactly:
          deviceClassName: mig.nvidia.com
          selectors:
          - cel:
              expression: device.attributes['gpu.nvidia.com'].profile == '3g.20gb'{capacity}
---
apiVersion: apps/v1
kind: Deployment
metadata:
  namespace: default
  name: mig-sharing
spec:
  replicas: {replicas}
  selector:
    matchLabels:
      app: mig-sharing
  template:
    metadata:
      labels:
        app: mig-sharing
    spec:
      resourceClaims:
      - name: mig
        resourceClaimTemplateName: mig-share
      containers:
      - name: ctr
        image: ubuntu:22.04
        resources:
          claims:
          - name: mig
"
        );
        let path = dir
            .path()
            .join(format!("mig-{replicas}-{}.yaml", memory.unwrap_or("none")));
        std::fs::write(&path, text).unwrap();
        path
    };
    let run = |path: &std::path::Path, mode: &str| {
        nvdra(&[
            "match",
            "-f",
            path.to_str().unwrap(),
            "--profile",
            "a100-mig-mixed",
            &format!("--consumable-shares={mode}"),
            "-o",
            "json",
        ])
    };
    let device = "gpu-1-mig-3g20gb-9-4";
    let four = allocations(&run(&file(4, None), "4"));
    assert_eq!(four.len(), 4);
    for (name, d, memory, shares) in &four {
        assert_eq!(
            (d.as_str(), memory.as_str(), shares.as_deref()),
            (device, "0", Some("1")),
            "{name}"
        );
    }
    let out = run(&file(4, None), "4");
    let first = &json(&out)[0]["allocation"][0]["consumedCapacity"];
    for k in [
        "multiprocessors",
        "copyEngines",
        "memorySlice4",
        "memorySlice7",
    ] {
        assert_eq!(first[k].as_str(), Some("0"), "{k}: {first}");
    }
    let fifth = stdout(&run(&file(5, None), "4"));
    assert!(fifth.contains("shares 1 > 0 left"), "a fifth: {fifth}");

    let two = allocations(&run(&file(2, Some("8Gi")), "memory"));
    assert_eq!(
        two.iter()
            .map(|a| (a.1.as_str(), a.2.as_str()))
            .collect::<Vec<_>>(),
        vec![(device, "8Gi"); 2]
    );
    assert_ne!(
        run(&file(3, Some("8Gi")), "memory").status.code(),
        Some(0),
        "24Gi is more than the device's 19968Mi"
    );
    let second = stdout(&run(&file(2, None), "disabled"));
    assert!(
        second.contains("allocated to claim mig-share (Deployment mig-sharing, pod 1 of 2)"),
        "without a share mode the device is allocated once: {second}"
    );
}

/// `nvdra match --dynamic-mig` on a dgx-h100 whose idle gpu-0 a DCGM-like holder holds (the
/// fault file's `holder` line, which the simulated backend lists in its inventory reads as the
/// NVML backend lists the processes holding a GPU): gpu-0's placements are withdrawn, so a
/// claim that only they would fit is not satisfiable and is explained naming the holder; gpu-0
/// whole still fits. `nvdra inventory` says why in MIG TOGGLE. Without the holder the same claim
/// fits gpu-0.
#[test]
fn a_withdrawn_placement_is_explained_naming_its_holder() {
    let dir = tempfile::tempdir().unwrap();
    let faults = dir.path().join("faults");
    std::fs::write(&faults, "holder 0 4242 nv-hostengine\n").unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        format!("version: v1\nfaultFile: {}\n", faults.display()),
    )
    .unwrap();
    let claims = dir.path().join("claims.yaml");
    std::fs::write(
        &claims,
        "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: on-zero}\nspec:\n  devices:\n    requests:\n    - name: m\n      exactly:\n        deviceClassName: mig.nvidia.com\n        selectors:\n        - cel: {expression: \"device.attributes['gpu.nvidia.com'].profile == '1g.10gb' && device.attributes['gpu.nvidia.com'].parentIndex == 0\"}\n",
    )
    .unwrap();
    let whole = dir.path().join("whole.yaml");
    std::fs::write(
        &whole,
        "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {name: whole}\nspec:\n  devices:\n    requests:\n    - name: g\n      exactly: {deviceClassName: gpu.nvidia.com, selectors: [{cel: {expression: \"device.attributes['gpu.nvidia.com'].index == 0\"}}]}\n",
    )
    .unwrap();
    let (config, claims, whole) = (
        config.to_str().unwrap(),
        claims.to_str().unwrap(),
        whole.to_str().unwrap(),
    );
    let why = "placements of gpu-0 withdrawn: held by pid 4242 (nv-hostengine), which blocks a \
               MIG mode switch";
    // `nvdra --config <config> match -f <file> --profile dgx-h100 --dynamic-mig <extra>`.
    let dynamic_mig = |file: &str, extra: &[&str]| {
        let base = [
            "--config",
            config,
            "match",
            "-f",
            file,
            "--profile",
            "dgx-h100",
            "--dynamic-mig",
        ];
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        nvdra(&args)
    };

    let held = dynamic_mig(claims, &[]);
    let table = stdout(&held);
    assert_eq!(
        held.status.code(),
        Some(1),
        "{table}{}",
        String::from_utf8_lossy(&held.stderr)
    );
    assert!(
        table.contains(&format!(
            "  not satisfiable: request m needs 1 device, 0 fit ({why})\n"
        )),
        "{table}"
    );
    for i in 0..7 {
        let device = format!("gpu-0-mig-1g10gb-19-{i} ");
        assert!(
            table
                .lines()
                .any(|l| l.trim_start().starts_with(&device) && l.ends_with(why)),
            "{device}: {table}"
        );
    }
    let v = json(&dynamic_mig(claims, &["-o", "json"]));
    let named = v[0]["requests"][0]["rejected"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|x| x["reason"] == why)
        .count();
    assert_eq!(named, 7, "{v}");

    assert_succeeds_with(&dynamic_mig(whole, &[]), "  satisfiable: g → gpu-0\n");

    let inv = nvdra(&[
        "--config",
        config,
        "inventory",
        "--profile",
        "dgx-h100",
        "--dynamic-mig",
    ]);
    let text = stdout(&inv);
    let gpu0 = text.lines().find(|l| l.starts_with("gpu-0 ")).unwrap();
    assert!(
        gpu0.ends_with("  yes, not now: held by pid 4242 (nv-hostengine)"),
        "{text}"
    );

    // Without the holder the claim fits gpu-0.
    std::fs::write(&faults, "").unwrap();
    assert_succeeds_with(
        &dynamic_mig(claims, &[]),
        "  satisfiable: m → gpu-0-mig-1g10gb-19-0\n",
    );
}

/// `--share-trust-domain`: a share on a GPU that a claim of another trust domain holds is
/// rejected, the reason naming the holder, both domains and the rule (the scheduler, which does
/// not know the rule, may still allocate it; prepare refuses it); the same namespace, or the
/// same value of the rule's Namespace label (Namespaces given with -f), fits; without the rule
/// namespaces share as before. The rule comes from the flag, its env name or the config file.
#[test]
fn a_share_beside_another_trust_domain_is_rejected_naming_the_holder_and_the_rule() {
    let dir = tempfile::tempdir().unwrap();
    let holder = "status:\n  allocation:\n    devices:\n      results:\n      - {request: gpu, driver: gpu.nvidia.com, pool: node-a, device: gpu-0, shareID: 1f0c7e2a-8a5b-4c41-9d4e-3b2f1a0c9d8e, consumedCapacity: {memory: 24Gi, multiprocessors: \"0\"}}\n";
    let in_ns = |name: &str, ns: &str, status: &str| {
        on_gpu0(name, "gpu.nvidia.com", "{memory: 16Gi}", status).replace(
            &format!("metadata: {{name: {name}}}"),
            &format!("metadata: {{name: {name}, namespace: {ns}}}"),
        )
    };
    let namespaces = "---\napiVersion: v1\nkind: Namespace\nmetadata: {name: team-a, labels: {team: blue}}\n---\napiVersion: v1\nkind: NamespaceList\nitems:\n- {apiVersion: v1, kind: Namespace, metadata: {name: team-b, labels: {team: blue}}}\n- {apiVersion: v1, kind: Namespace, metadata: {name: team-c, labels: {team: red}}}\n";
    let file = dir.path().join("claims.yaml");
    std::fs::write(
        &file,
        format!(
            "{namespaces}{}{}{}{}",
            in_ns("running", "team-a", holder),
            in_ns("mine", "team-a", ""),
            in_ns("blue", "team-b", ""),
            in_ns("red", "team-c", ""),
        ),
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let base = [
        "match",
        "-f",
        f,
        "--profile",
        "dgx-h100",
        "--shared-capacity",
        "-o",
        "json",
    ];
    let output = |extra: &[&str], env: &[(&str, &str)]| -> Output {
        let args: Vec<&str> = base.iter().chain(extra).copied().collect();
        nvdra_with(&args, env)
    };
    let run = |extra: &[&str], env: &[(&str, &str)]| -> Value { json(&output(extra, env)) };
    let fits = |v: &Value, claim: &str| -> bool {
        claim_named(v, claim)["satisfiable"].as_bool().unwrap()
    };
    let reason = |v: &Value, claim: &str| -> String {
        let c = claim_named(v, claim);
        c["requests"][0]["rejected"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["device"] == "gpu-0")
            .unwrap_or_else(|| panic!("gpu-0 fits {claim}: {c}"))["reason"]
            .as_str()
            .unwrap()
            .to_string()
    };

    // Off (the default): every namespace shares gpu-0.
    let v = run(&[], &[]);
    for claim in ["mine", "blue", "red"] {
        assert!(fits(&v, claim), "{claim}: {v}");
    }

    // namespace: only team-a's own claim fits beside team-a's share; the others say why.
    let v = run(&["--share-trust-domain=namespace"], &[]);
    assert!(fits(&v, "mine"), "{v}");
    assert!(!fits(&v, "blue"), "{v}");
    assert_eq!(
        reason(&v, "blue"),
        "refused at prepare: claim team-a/running of namespace team-a holds a share of it, and \
         the node keeps a GPU's shares within one trust domain (--share-trust-domain=namespace); \
         this claim is of namespace team-b"
    );

    // label:team (from the environment): team-b has team-a's value, team-c another.
    let v = run(&[], &[("NVDRA_SHARE_TRUST_DOMAIN", "label:team")]);
    assert!(fits(&v, "mine") && fits(&v, "blue"), "{v}");
    assert!(!fits(&v, "red"), "{v}");
    let why = reason(&v, "red");
    assert!(
        why.contains("claim team-a/running of team=blue (namespace team-a)")
            && why.contains("(--share-trust-domain=label:team)")
            && why.contains("this claim is of team=red (namespace team-c)"),
        "{why}"
    );

    // From the config file; and a bad rule there is bad input naming the key.
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, "version: v1\nshareTrustDomain: namespace\n").unwrap();
    let c = config.to_str().unwrap();
    let v = run(&[], &[("NVDRA_CONFIG", c)]);
    assert!(!fits(&v, "blue"), "{v}");
    std::fs::write(&config, "version: v1\nshareTrustDomain: tenants\n").unwrap();
    let out = output(&[], &[("NVDRA_CONFIG", c)]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("shareTrustDomain"), "{err}");
}

const GPUS_AND_NIC: &str = "manifests/examples/two-gpus-and-a-nic-one-numa-node.yaml";
const NICS: &str = "tests/data/dranet-nics.yaml";

/// The (request, driver, device) picks of the first claim in `nvdra match -o json` output.
fn picks(v: &Value) -> Vec<(String, String, String)> {
    v[0]["allocation"]
        .as_array()
        .unwrap_or_else(|| panic!("no allocation: {v}"))
        .iter()
        .map(|a| {
            (
                a["request"].as_str().unwrap().to_string(),
                a["driver"].as_str().unwrap().to_string(),
                a["device"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// Two GPUs and another driver's NIC, aligned by the standard `resource.kubernetes.io/numaNode`
/// that both publish: the NIC driver's slice given with -f joins the profile's GPUs, and only
/// the RDMA NIC (NUMA node 1) with two GPUs of NUMA node 1 satisfies the claim.
#[test]
fn a_gpu_and_another_drivers_nic_align_by_the_standard_numa_attribute() {
    let out = nvdra(&[
        "match",
        "-f",
        GPUS_AND_NIC,
        "-f",
        NICS,
        "--profile",
        "dgx-h100",
        "-o",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    let v = json(&out);
    let picks = picks(&v);
    assert_eq!(picks.len(), 3, "{picks:?}");
    // dgx-h100: gpu-0..3 on NUMA node 0, gpu-4..7 on 1; nic-1 is the RDMA NIC, on 1.
    for (request, driver, device) in &picks {
        match request.as_str() {
            "gpus" => {
                assert_eq!(driver, "gpu.nvidia.com");
                let minor: u32 = device.strip_prefix("gpu-").unwrap().parse().unwrap();
                assert!(minor >= 4, "{device} is not on NUMA node 1");
            }
            "nic" => assert_eq!((driver.as_str(), device.as_str()), ("dra.net", "nic-1")),
            other => panic!("request {other}"),
        }
    }
    // nic-0 is left out by the class (no RDMA), not by the constraint.
    let nic = v[0]["requests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "nic")
        .unwrap();
    assert_eq!(nic["fits"], serde_json::json!(["nic-1"]));

    // a100-mig-mixed: its two whole GPUs are on different NUMA nodes.
    let out = nvdra(&[
        "match",
        "-f",
        GPUS_AND_NIC,
        "-f",
        NICS,
        "--profile",
        "a100-mig-mixed",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("not satisfiable: matchAttribute resource.kubernetes.io/numaNode"),
        "{}",
        stdout(&out)
    );
}

/// NVIDIA's bare `numaNode` (`gpu.nvidia.com/numaNode`) cannot align a GPU with another
/// driver's device: the NIC has no attribute of that name. That is what the standard name is
/// for.
#[test]
fn the_bare_numa_attribute_cannot_align_another_drivers_device() {
    let dir = tempfile::tempdir().unwrap();
    let claim = dir.path().join("bare.yaml");
    let text = std::fs::read_to_string(GPUS_AND_NIC).unwrap().replace(
        "matchAttribute: resource.kubernetes.io/numaNode",
        "matchAttribute: gpu.nvidia.com/numaNode",
    );
    std::fs::write(&claim, text).unwrap();
    let out = nvdra(&[
        "match",
        "-f",
        claim.to_str().unwrap(),
        "-f",
        NICS,
        "--profile",
        "dgx-h100",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("not satisfiable: matchAttribute gpu.nvidia.com/numaNode"),
        "{}",
        stdout(&out)
    );
}

/// Another driver's slices given with -f join the backend's node only when they are that
/// node's (or for any node): a NIC of node-b is no device of node-a.
#[test]
fn another_drivers_slices_of_another_node_are_left_out() {
    let dir = tempfile::tempdir().unwrap();
    let nics = dir.path().join("nics-b.yaml");
    let text = std::fs::read_to_string(NICS)
        .unwrap()
        .replace("nodeName: node-a", "nodeName: node-b");
    std::fs::write(&nics, text).unwrap();
    let out = nvdra(&[
        "match",
        "-f",
        GPUS_AND_NIC,
        "-f",
        nics.to_str().unwrap(),
        "--profile",
        "dgx-h100",
        "--node-name",
        "node-a",
        "-o",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    let v = json(&out);
    let nic = v[0]["requests"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "nic")
        .unwrap();
    assert_eq!(nic["fits"], serde_json::json!([]), "{v}");
}

/// `-o json` names each claim's namespace (`default` where the object names none), so two
/// claims of one name in two namespaces are told apart, and one that does not fit is not
/// hidden by its namesake that does (exit 1).
#[test]
fn match_json_names_each_claims_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let claims = dir.path().join("claims.yaml");
    let claim = |ns: &str, memory: &str| {
        format!(
            "apiVersion: resource.k8s.io/v1\nkind: ResourceClaim\nmetadata: {{name: train{ns}}}\n\
             spec:\n  devices:\n    requests:\n    - name: gpu\n      exactly:\n        \
             deviceClassName: gpu.nvidia.com\n        selectors:\n        - cel: {{expression: \
             \"device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('{memory}')) >= 0\"}}\n"
        )
    };
    std::fs::write(
        &claims,
        [
            claim(", namespace: team-a", "40Gi"),
            claim(", namespace: team-b", "100Gi"),
            claim("", "40Gi"),
        ]
        .join("---\n"),
    )
    .unwrap();
    let out = nvdra(&[
        "match",
        "-f",
        claims.to_str().unwrap(),
        "--profile",
        "dgx-h100",
        "-o",
        "json",
    ]);
    let v = json(&out);
    let got: Vec<(&str, &str, bool)> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["namespace"].as_str().unwrap(),
                c["name"].as_str().unwrap(),
                c["satisfiable"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("team-a", "train", true),
            ("team-b", "train", false),
            ("default", "train", true)
        ]
    );
    assert_eq!(out.status.code(), Some(1), "team-b/train does not fit");
    // The table names them apart too.
    let out = nvdra(&[
        "match",
        "-f",
        claims.to_str().unwrap(),
        "--profile",
        "dgx-h100",
    ]);
    let text = stdout(&out);
    assert!(
        text.contains("ResourceClaim team-a/train (")
            && text.contains("ResourceClaim team-b/train ("),
        "{text}"
    );
}
