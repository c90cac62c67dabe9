//! A reader that is not ours reads nvdra's YAML back as nvdra meant it: PyYAML, a YAML 1.1
//! reader like many tools that consume Kubernetes YAML, loads `nvdra inventory -o yaml` and
//! `-o slices` for every built-in profile, a claim's CDI spec, a ResourceSlice file of the
//! `--api-dir` directory and a table of hostile strings; each must equal nvdra's JSON (`-o json`,
//! or the value nvdra serialized). serde_yaml failed this: PyYAML read the PCI address
//! `0000:07:00.0` of the `a100-mig-mixed` profile as the base-60 number 420.0.
//!
//! Needs `python3` with PyYAML (`python3 -m pip install PyYAML==6.0.3`). Without it the tests say
//! why and pass — unless `NVDRA_REQUIRE_PYYAML` is set (CI sets it to 1), in which case a missing
//! PyYAML is a failure.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use k8s_openapi::api::resource::v1::{DeviceAttribute, ResourceSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use nvdra::api::SliceApi;
use nvdra::api::dir::DirApi;
use nvdra::cdi::{self, CdiOptions, PreparedDevice};
use nvdra::dra::slices::{self, SliceOptions};
use nvdra::inventory::topology::{load_profile, profile_names};
use nvdra::sharing::{MpsSettings, Sharing};
use serde_json::Value;

const NODE: &str = "node-a";

use crate::support::require;

fn required() -> bool {
    require::required("NVDRA_REQUIRE_PYYAML")
}

/// Loads YAML the way a Python tool would: `safe_load`, or `safe_load_all` for a stream. A value
/// JSON cannot hold (a date, a float key) comes out tagged with its Python type, so the
/// comparison names it.
const LOAD: &str = r#"
import json, sys, yaml
def show(o):
    return "<python %s: %r>" % (type(o).__name__, o)
text = sys.stdin.read()
data = list(yaml.safe_load_all(text)) if sys.argv[1] == "all" else yaml.safe_load(text)
print(json.dumps(data, default=show, allow_nan=False))
"#;

/// Runs `check` with PyYAML, or skips (or fails, when required) without it. Probed once.
fn with_pyyaml(check: impl FnOnce()) {
    static PROBE: OnceLock<Result<String, String>> = OnceLock::new();
    let required = required();
    let probe = PROBE.get_or_init(|| {
        let out = Command::new("python3")
            .args(["-c", "import yaml; print(yaml.__version__)"])
            .output()
            .map_err(|e| format!("cannot run python3: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        } else {
            Err(format!(
                "python3 has no PyYAML: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    });
    match probe {
        Ok(_) => check(),
        Err(why) if required => panic!("NVDRA_REQUIRE_PYYAML is set but {why}"),
        Err(why) => eprintln!(
            "skipping the PyYAML test: {why} (set NVDRA_REQUIRE_PYYAML=1 to make this a failure)"
        ),
    }
}

/// What PyYAML makes of `text`, as JSON.
fn pyyaml(text: &str, stream: bool) -> Value {
    let mut child = Command::new("python3")
        .args(["-c", LOAD, if stream { "all" } else { "one" }])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python3");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "PyYAML cannot load nvdra's YAML: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The first place where `got` differs from `want`, as a path and both values.
fn difference(want: &Value, got: &Value, path: &str) -> Option<String> {
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            for (k, wv) in w {
                let p = format!("{path}.{k}");
                match g.get(k) {
                    Some(gv) => {
                        if let Some(d) = difference(wv, gv, &p) {
                            return Some(d);
                        }
                    }
                    None => return Some(format!("{p}: missing")),
                }
            }
            g.keys()
                .find(|k| !w.contains_key(*k))
                .map(|k| format!("{path}: unexpected key {k:?}"))
        }
        (Value::Array(w), Value::Array(g)) if w.len() == g.len() => w
            .iter()
            .zip(g)
            .enumerate()
            .find_map(|(i, (wv, gv))| difference(wv, gv, &format!("{path}[{i}]"))),
        _ if want == got => None,
        _ => Some(format!("{path}: nvdra meant {want}, PyYAML read {got}")),
    }
}

fn assert_reads_as(text: &str, stream: bool, want: &Value, what: &str) {
    let got = pyyaml(text, stream);
    if let Some(d) = difference(want, &got, "") {
        panic!("{what}: {d}\n{text}");
    }
}

fn nvdra(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_nvdra"))
        .args(args)
        .env_remove("NVDRA_CONFIG")
        .env("NVDRA_LOG", "error")
        .output()
        .expect("run nvdra");
    assert!(
        out.status.success(),
        "nvdra {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn hostile() -> Vec<String> {
    serde_json::from_str(include_str!("../data/yaml-hostile-strings.json")).unwrap()
}

#[test]
fn inventory_yaml_reads_as_its_json_for_every_profile() {
    with_pyyaml(|| {
        for profile in profile_names() {
            let args = ["inventory", "--profile", profile, "--node-name", NODE, "-o"];
            let json: Value =
                serde_json::from_str(&nvdra(&[&args[..], &["json"]].concat())).unwrap();
            let yaml = nvdra(&[&args[..], &["yaml"]].concat());
            assert_reads_as(
                &yaml,
                false,
                &json,
                &format!("inventory -o yaml, profile {profile}"),
            );
        }
    });
}

#[test]
fn slices_read_as_the_resource_slices_they_describe_for_every_profile() {
    with_pyyaml(|| {
        for profile in profile_names() {
            for extra in [&[][..], &["--partitionable"][..], &["--dynamic-mig"][..]] {
                let args = [
                    &["inventory", "--profile", profile, "--node-name", NODE][..],
                    extra,
                    &["-o", "slices"][..],
                ]
                .concat();
                let yaml = nvdra(&args);
                // What nvdra meant: the documents as ResourceSlices, as JSON.
                let typed: Vec<ResourceSlice> = serde_saphyr::from_str_multiple(&yaml).unwrap();
                assert!(!typed.is_empty(), "{args:?}");
                let want = serde_json::to_value(&typed).unwrap();
                assert_reads_as(&yaml, true, &want, &format!("{args:?}"));
            }
        }
    });
}

#[test]
fn a_claim_cdi_spec_reads_as_nvdra_wrote_it() {
    with_pyyaml(|| {
        let root = tempfile::tempdir().unwrap();
        let inventory = load_profile("a100-mig-mixed", NODE).unwrap();
        let parent = inventory
            .gpus
            .iter()
            .find(|g| !g.mig.devices.is_empty())
            .expect("the profile has a GPU with MIG devices");
        let mig = &parent.mig.devices[0];
        let mps = Sharing::Mps(MpsSettings {
            active_thread_percentage: Some(40),
            pinned_memory_limit: Some(2 << 30),
            per_device_pinned_memory_limit: [("0".to_string(), 1 << 30)].into(),
        });
        let pipe = root.path().join("run/mps/pipe");
        let devices = [
            PreparedDevice {
                name: format!(
                    "gpu-{}-mig-{}-{}-{}",
                    parent.minor,
                    mig.profile.replace('.', ""),
                    mig.gi_profile_id,
                    mig.placement.start
                ),
                gpu: parent.clone(),
                mig: Some(mig.clone()),
                sharing: mps.clone(),
                mps_pipe_dir: Some(pipe.clone()),
                mps_shm_dir: None,
                memory_limits: None,
            },
            PreparedDevice {
                name: "gpu-0".into(),
                gpu: inventory.gpus[0].clone(),
                mig: None,
                sharing: mps,
                mps_pipe_dir: Some(pipe),
                mps_shm_dir: None,
                memory_limits: None,
            },
        ];
        let opts = CdiOptions::resolve("gpu.nvidia.com", &nvdra::cdi::DriverRoot::at(root.path()))
            .unwrap();
        let files = cdi::DriverFiles::default();
        let spec = cdi::claim_spec(&opts, "0000-07-00", &devices, &files).unwrap();
        let want = serde_json::to_value(&spec).unwrap();
        assert_reads_as(&spec.to_yaml().unwrap(), false, &want, "CDI spec");
    });
}

#[tokio::test]
async fn an_api_dir_slice_file_reads_as_the_stored_slice() {
    if !pyyaml_usable() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let api = DirApi::new(dir.path()).unwrap();
    let inventory = load_profile("a100-mig-mixed", NODE).unwrap();
    let opts = SliceOptions {
        driver: "gpu.nvidia.com".into(),
        node_name: NODE.into(),
        partitionable: false,
        shared_capacity: slices::ConsumableShares::Disabled,
        dynamic_mig: false,
        mig_profiles: None,
        layout: Default::default(),
    };
    let mut spec = slices::desired_slices(&inventory, &opts).unwrap().remove(0);
    // Every hostile string as a string attribute of the first device.
    let attributes = spec.devices.as_mut().unwrap()[0]
        .attributes
        .get_or_insert_with(BTreeMap::new);
    for (i, s) in hostile().into_iter().enumerate() {
        attributes.insert(
            format!("h{i}"),
            DeviceAttribute {
                string: Some(s),
                ..Default::default()
            },
        );
    }
    let stored = api
        .create_slice(&ResourceSlice {
            metadata: ObjectMeta {
                generate_name: Some(format!("{NODE}-gpu.nvidia.com-")),
                ..Default::default()
            },
            spec,
        })
        .await
        .unwrap();
    let name = stored.metadata.name.clone().unwrap();
    let text =
        std::fs::read_to_string(Path::new(&api.slices_dir()).join(format!("{name}.yaml"))).unwrap();
    let want = serde_json::to_value(&stored).unwrap();
    assert!(
        want.to_string().contains("0000:07:00.0"),
        "the slice holds a base-60-looking PCI address"
    );
    assert_reads_as(&text, false, &want, "--api-dir slice file");
}

/// [`with_pyyaml`] for async tests, which cannot hand it their body.
fn pyyaml_usable() -> bool {
    let mut usable = false;
    with_pyyaml(|| usable = true);
    usable
}

#[test]
fn hostile_strings_read_back_as_strings() {
    with_pyyaml(|| {
        let values = hostile();
        let keys: BTreeMap<String, String> =
            values.iter().map(|s| (s.clone(), s.clone())).collect();
        let doc =
            serde_json::json!({ "values": values, "keys": keys, "nested": [{ "list": values }] });
        let text = nvdra::yaml::to_string(&doc).unwrap();
        assert_reads_as(&text, false, &doc, "hostile strings");
    });
}
