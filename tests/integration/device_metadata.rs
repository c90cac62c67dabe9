//! Device metadata (KEP-5304) end to end through `nvdra run` (simulated DGX H100, directory
//! API): prepare over the DRA socket answers each request's metadata CDI device ID beside the
//! claim's own, and a container podman starts with those IDs reads its file at the path
//! Kubernetes documents — under the claim's name for a claim the pod names, under the pod's name
//! for the claim for one made from a template — read-only, as any user, with the GPU's UUID,
//! product, memory, NUMA node and PCI bus ID. Unprepare removes the files; start-up repair
//! removes those of claims no longer prepared and keeps the rest.
//!
//! The podman test needs root, `podman`, `runc` and `busybox-static` (see `.ci/run`); it skips
//! without them unless `NVDRA_REQUIRE_PODMAN` is set. The repair test needs nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

use anyhow::{Context, Result, ensure};
use kubelet_plugin::metadata::{self, Files, v1alpha1};
use kubelet_plugin::proto::dra::v1;
use nvdra::inventory::Gpu;
use nvdra::inventory::topology::load_profile;

use crate::support::daemon;
use crate::support::podman::{self as engine, Engine, IMAGE, SYSTEM_CDI_DIR, mknod, ok, podman};

const NODE: &str = "node-a";
const NAMED: &str = "named";
const TEMPLATE: &str = "pod-accel-x7k2q";

/// A sandbox node: `nvdra run` over a directory API, its CDI specs in `cdi_root`.
struct Node {
    tmp: tempfile::TempDir,
    driver: &'static str,
    cdi_root: PathBuf,
    driver_root: PathBuf,
    daemon: Option<Child>,
}

impl Node {
    fn new(driver: &'static str, cdi_root: Option<PathBuf>) -> Result<Self> {
        let tmp = tempfile::tempdir()?;
        let driver_root = tmp.path().join("driver");
        std::fs::create_dir_all(&driver_root)?;
        Ok(Self {
            cdi_root: cdi_root.unwrap_or_else(|| tmp.path().join("cdi")),
            tmp,
            driver,
            driver_root,
            daemon: None,
        })
    }

    fn root(&self) -> &Path {
        self.tmp.path()
    }

    fn files(&self) -> Files {
        let plugin_dir = self.root().join("kubelet/plugins").join(self.driver);
        Files::new(self.driver, &plugin_dir, &self.cdi_root)
    }

    /// Adds an allocated claim of `gpu`'s device for request `gpu`; `pod_claim` makes it a claim
    /// made from a template.
    fn claim(&self, name: &str, uid: &str, gpu: &Gpu, pod_claim: Option<&str>) -> Result<()> {
        let device = format!("gpu-{}", gpu.minor);
        let result = nvdra::api::allocated_device("gpu", self.driver, NODE, &device);
        let mut claim = nvdra::api::allocated_claim("default", name, uid, vec![result], vec![]);
        if let Some(pod) = pod_claim {
            claim.metadata.annotations = Some(BTreeMap::from([(
                metadata::POD_CLAIM_NAME_ANNOTATION.to_string(),
                pod.to_string(),
            )]));
        }
        nvdra::api::dir::write_claim(&self.root().join("api"), &claim)?;
        Ok(())
    }

    fn start(&mut self) -> Result<()> {
        let child = daemon::nvdra_run(self.root(), "dra", NODE)
            .args(["--profile", "dgx-h100", "--driver-name", self.driver])
            .arg("--device-metadata")
            .arg("--cdi-root")
            .arg(&self.cdi_root)
            .arg("--driver-root")
            .arg(&self.driver_root)
            .env("NVDRA_LOG", "warn")
            .spawn()
            .context("cannot start nvdra run")?;
        self.daemon = Some(child);
        Ok(())
    }

    /// SIGTERM, and a clean exit.
    fn stop(&mut self) -> Result<()> {
        let Some(mut child) = self.daemon.take() else {
            return Ok(());
        };
        Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()?;
        let status = child.wait()?;
        ensure!(status.success(), "nvdra run did not exit cleanly: {status}");
        Ok(())
    }

    fn dra_socket(&self) -> PathBuf {
        self.root()
            .join("kubelet/plugins")
            .join(self.driver)
            .join("dra.sock")
    }

    /// Prepare (or unprepare) of one claim over the DRA socket, once it serves: the CDI
    /// device IDs and the claim's error.
    fn call(&mut self, prepare: bool, name: &str, uid: &str) -> Result<(Vec<String>, String)> {
        let rt = tokio::runtime::Runtime::new()?;
        let socket = self.dra_socket();
        let claims = vec![v1::Claim {
            namespace: "default".into(),
            uid: uid.into(),
            name: name.into(),
        }];
        let once = |claims: Vec<v1::Claim>| {
            rt.block_on(async {
                let channel = kubelet_plugin::socket::connect(&socket).await?;
                let mut client = v1::dra_plugin_client::DraPluginClient::new(channel);
                if prepare {
                    let mut r = client
                        .node_prepare_resources(v1::NodePrepareResourcesRequest { claims })
                        .await?
                        .into_inner();
                    let entry = r.claims.remove(uid).context("no entry for the claim")?;
                    let ids = entry
                        .devices
                        .into_iter()
                        .flat_map(|d| d.cdi_device_ids)
                        .collect();
                    anyhow::Ok((ids, entry.error))
                } else {
                    let mut r = client
                        .node_unprepare_resources(v1::NodeUnprepareResourcesRequest { claims })
                        .await?
                        .into_inner();
                    let entry = r.claims.remove(uid).context("no entry for the claim")?;
                    Ok((Vec::new(), entry.error))
                }
            })
        };
        // The DRA socket serves before registration; wait for it.
        for _ in 0..300 {
            if let Some(d) = self.daemon.as_mut() {
                ensure!(d.try_wait()?.is_none(), "nvdra exited before serving");
            }
            if socket.exists()
                && let Ok(r) = once(claims.clone())
            {
                return Ok(r);
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        anyhow::bail!("nvdra did not serve its DRA socket within 30 s")
    }

    fn wait_for_socket(&mut self) -> Result<()> {
        for _ in 0..300 {
            if let Some(d) = self.daemon.as_mut() {
                ensure!(d.try_wait()?.is_none(), "nvdra exited before serving");
            }
            if self.dra_socket().exists() {
                return Ok(());
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        anyhow::bail!("nvdra did not bind its DRA socket within 30 s")
    }

    fn prepare(&mut self, name: &str, uid: &str) -> Result<Vec<String>> {
        let (ids, error) = self.call(true, name, uid)?;
        ensure!(error.is_empty(), "prepare of {name} failed: {error}");
        Ok(ids)
    }

    fn unprepare(&mut self, name: &str, uid: &str) -> Result<()> {
        let (_, error) = self.call(false, name, uid)?;
        ensure!(error.is_empty(), "unprepare of {name} failed: {error}");
        Ok(())
    }

    /// Whether claim `uid`'s metadata files (CDI spec and host file of request `gpu`) exist;
    /// an error when only one of them does.
    fn has_files(&self, uid: &str) -> Result<bool> {
        let f = self.files();
        let (spec, file) = (f.cdi_spec_path(uid, "gpu"), f.host_path(uid, "gpu"));
        ensure!(
            spec.exists() == file.exists(),
            "{} exists: {}, {} exists: {}",
            spec.display(),
            spec.exists(),
            file.display(),
            file.exists()
        );
        Ok(spec.exists())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut child) = self.daemon.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // In the system CDI directory, specs of this test's driver only.
        if let Ok(entries) = std::fs::read_dir(&self.cdi_root) {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.contains(self.driver) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
    }
}

fn uid() -> String {
    format!(
        "5f0e{:04x}-0000-4000-8000-{:012x}",
        rand::random::<u16>(),
        rand::random::<u64>() >> 16
    )
}

fn attribute(d: &v1alpha1::Device, name: &str) -> Option<String> {
    let v = d.attributes.get(name)?;
    v.string.clone().or(v.int.map(|i| i.to_string()))
}

/// Checks a metadata file's text as a container printed it: claim `name`, request `gpu`, the
/// one device `gpu`, with its facts.
fn check_file(
    text: &str,
    driver: &str,
    name: &str,
    pod_claim: Option<&str>,
    gpu: &Gpu,
) -> Result<()> {
    let doc: v1alpha1::DeviceMetadata =
        serde_json::from_str(text).with_context(|| format!("not a metadata object:\n{text}"))?;
    ensure!(
        doc.api_version == "metadata.resource.k8s.io/v1alpha1" && doc.kind == "DeviceMetadata",
        "{text}"
    );
    ensure!(doc.metadata.name.as_deref() == Some(name), "{text}");
    ensure!(doc.pod_claim_name.as_deref() == pod_claim, "{text}");
    let [request] = &doc.requests[..] else {
        anyhow::bail!("one request expected:\n{text}")
    };
    ensure!(request.name == "gpu", "{text}");
    let [d] = &request.devices[..] else {
        anyhow::bail!("one device expected:\n{text}")
    };
    ensure!(
        d.driver == driver && d.pool == NODE && d.name == format!("gpu-{}", gpu.minor),
        "{text}"
    );
    let expect = [
        ("uuid", Some(gpu.uuid.as_str().to_string())),
        ("productName", Some(gpu.product_name.clone())),
        ("memory", Some(gpu.memory_bytes.to_string())),
        ("numaNode", gpu.numa_node.map(|n| n.to_string())),
        (
            "resource.kubernetes.io/pciBusID",
            Some(gpu.pci_bus_id.as_str().to_string()),
        ),
    ];
    for (attr, want) in expect {
        ensure!(want.is_some(), "the profile's GPU has no {attr}");
        ensure!(
            attribute(d, attr) == want,
            "{attr}: want {want:?} in\n{text}"
        );
    }
    Ok(())
}

#[test]
fn a_container_reads_its_device_metadata_file() {
    engine::with_engine(check_podman);
}

fn check_podman(engine: &Engine) -> Result<()> {
    let driver = "podman-metadata.nvdra.io";
    // Podman 4.3 has no --cdi-spec-dir: specs go where it reads them.
    let cdi_root = (!engine.has_spec_dir_flag).then(|| PathBuf::from(SYSTEM_CDI_DIR));
    let mut node = Node::new(driver, cdi_root)?;
    let inv = load_profile("dgx-h100", NODE)?;
    let (a, b) = (&inv.gpus[0], &inv.gpus[1]);
    for gpu in [a, b] {
        mknod(&node.driver_root.join(format!("dev/nvidia{}", gpu.minor)))?;
    }
    mknod(&node.driver_root.join("dev/nvidiactl"))?;
    mknod(&node.driver_root.join("dev/nvidia-uvm"))?;
    let (named_uid, template_uid) = (uid(), uid());
    node.claim(NAMED, &named_uid, a, None)?;
    node.claim(TEMPLATE, &template_uid, b, Some("accel"))?;
    node.start()?;

    let dir = node.cdi_root.display().to_string();
    let global: Vec<&str> = if engine.has_spec_dir_flag {
        vec!["--cdi-spec-dir", &dir]
    } else {
        vec![]
    };
    let run = |ids: &[String], user: &str, path: &str| -> Result<String> {
        let mut args = vec!["run", "--rm", "--network", "none", "--user", user];
        for id in ids {
            args.extend(["--device", id.as_str()]);
        }
        let script = format!(
            "cat {path}; echo; (echo x > {path}) 2>/dev/null && echo WRITABLE || echo READ-ONLY"
        );
        args.extend([IMAGE, "sh", "-c", &script]);
        let out = podman(&global, &args)?;
        ok(
            &out,
            &format!("podman run --device {}", ids.join(" --device ")),
        )
    };
    let check = |out: &str, name: &str, pod: Option<&str>, gpu: &Gpu| -> Result<()> {
        let (text, last) = out.trim_end().rsplit_once('\n').context("no output")?;
        ensure!(
            last == "READ-ONLY",
            "the file is writable in the container:\n{out}"
        );
        check_file(text, driver, name, pod, gpu)
    };

    let ids = node.prepare(NAMED, &named_uid)?;
    let meta_id = format!("{driver}/metadata={named_uid}_gpu");
    ensure!(
        ids == vec![
            format!("k8s.{driver}/claim={named_uid}-gpu-{}", a.minor),
            meta_id
        ],
        "CDI ids {ids:?}"
    );
    let path = format!(
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/{NAMED}/gpu/{driver}-metadata.json"
    );
    check(&run(&ids, "0:0", &path)?, NAMED, None, a)?;

    // The template claim, read by an ordinary user.
    let ids = node.prepare(TEMPLATE, &template_uid)?;
    let path = format!(
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/accel/gpu/{driver}-metadata.json"
    );
    check(&run(&ids, "1000:1000", &path)?, TEMPLATE, Some("accel"), b)?;

    node.unprepare(NAMED, &named_uid)?;
    node.unprepare(TEMPLATE, &template_uid)?;
    ensure!(
        !node.has_files(&named_uid)? && !node.has_files(&template_uid)?,
        "unprepare left files"
    );
    node.stop()
}

/// A claim unprepared while its files could not go (a crash between the driver's unprepare and
/// the removal) leaves them; the next start removes them and keeps those of the claim still
/// prepared.
#[test]
fn start_up_repair_removes_the_files_of_claims_no_longer_prepared() {
    (|| -> Result<()> {
        let mut node = Node::new("metadata-repair.nvdra.io", None)?;
        let inv = load_profile("dgx-h100", NODE)?;
        let (kept, stale) = (uid(), uid());
        node.claim(NAMED, &kept, &inv.gpus[0], None)?;
        node.start()?;
        node.prepare(NAMED, &kept)?;
        ensure!(node.has_files(&kept)?, "prepare wrote no metadata files");
        node.stop()?;

        // What the crash left: the files of a claim nvdra no longer has.
        let mut devices = vec![kubelet_plugin::PreparedDevice::new(
            vec!["gpu".into()],
            NODE,
            "gpu-1",
            vec![],
        )];
        node.files().write(
            &kubelet_plugin::Claim::new("default", "gone", &stale),
            None,
            &mut devices,
        )?;
        ensure!(node.has_files(&stale)?);

        node.start()?;
        // The repair runs before the DRA socket is bound.
        node.wait_for_socket()?;
        ensure!(
            !node.has_files(&stale)?,
            "start-up left the stale claim's files"
        );
        ensure!(
            node.has_files(&kept)?,
            "start-up removed a prepared claim's files"
        );
        node.unprepare(NAMED, &kept)?;
        ensure!(!node.has_files(&kept)?, "unprepare left files");
        node.stop()
    })()
    .unwrap_or_else(|e| panic!("{e:#}"));
}
