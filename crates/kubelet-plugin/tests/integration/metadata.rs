//! Device metadata through `serve`, as a kubelet sees it: a driver that hands metadata gets its
//! files written after a successful prepare, the metadata's CDI device ID in the answer, and
//! the files removed after unprepare; a claim whose files cannot be written fails.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kubelet_plugin::k8s_openapi::api::resource::v1::DeviceAttribute;
use kubelet_plugin::metadata::{DeviceMetadata, POD_CLAIM_NAME_ANNOTATION, v1alpha1};
use kubelet_plugin::testing::{KubeletClient, MemoryClaims, allocated_claim, allocated_device};
use kubelet_plugin::{
    BoxError, CancellationToken, Claim, Driver, Options, PrepareClaim, PrepareResults,
    PreparedDevice, UnprepareResults,
};

const DRIVER: &str = "fpga.example.com";
const NODE: &str = "node-a";
const NAMED: &str = "11111111-1234-4bcd-9876-0123456789ab";
const TEMPLATE: &str = "22222222-1234-4bcd-9876-0123456789ab";

/// Prepares each device with its serial number as metadata.
struct Fpgas;

impl Driver for Fpgas {
    async fn prepare(&self, claims: Vec<PrepareClaim>) -> Result<PrepareResults, BoxError> {
        Ok(claims
            .into_iter()
            .map(|c| {
                let devices = c
                    .results
                    .iter()
                    .map(|r| {
                        let serial = DeviceAttribute {
                            string: Some(format!("SN-{}", r.device)),
                            ..Default::default()
                        };
                        PreparedDevice::new(
                            vec![r.request.clone()],
                            &r.pool,
                            &r.device,
                            vec![format!("{DRIVER}/fpga={}", r.device)],
                        )
                        .with_metadata(DeviceMetadata::new(
                            BTreeMap::from([("serial".to_string(), serial)]),
                        ))
                    })
                    .collect();
                (c.claim.uid, Ok(devices))
            })
            .collect())
    }

    async fn unprepare(&self, claims: Vec<Claim>) -> Result<UnprepareResults, BoxError> {
        Ok(claims.into_iter().map(|c| (c.uid, Ok(()))).collect())
    }
}

fn claims() -> MemoryClaims {
    let claims = MemoryClaims::default();
    claims.insert(allocated_claim(
        "ns",
        "named",
        NAMED,
        vec![allocated_device("fpga", DRIVER, NODE, "fpga-0")],
    ));
    let mut template = allocated_claim(
        "ns",
        "pod-accel-x7k2q",
        TEMPLATE,
        vec![allocated_device("fpga/big", DRIVER, NODE, "fpga-1")],
    );
    template.metadata.annotations = Some(BTreeMap::from([(
        POD_CLAIM_NAME_ANNOTATION.to_string(),
        "accel".to_string(),
    )]));
    claims.insert(template);
    claims
}

async fn start(opts: Options, stop: &CancellationToken) -> KubeletClient {
    let socket = opts.sockets().dra;
    tokio::spawn(kubelet_plugin::serve(Arc::new(Fpgas), opts, stop.clone()));
    for _ in 0..1000 {
        if let Ok(client) = KubeletClient::connect(&socket).await {
            return client;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{} never appeared", socket.display());
}

fn options(root: &Path) -> Options {
    Options::new(DRIVER, NODE, claims())
        .unwrap()
        .kubelet_root(root.join("kubelet"))
        .device_metadata(true)
        .cdi_dir(root.join("cdi"))
}

#[tokio::test]
async fn prepare_writes_the_files_and_unprepare_removes_them() {
    let root = tempfile::tempdir().unwrap();
    let opts = options(root.path());
    let files = opts.metadata_files().expect("metadata is on");
    let stop = CancellationToken::new();
    let mut kubelet = start(opts, &stop).await;
    let asked = [
        Claim::new("ns", "named", NAMED),
        Claim::new("ns", "pod-accel-x7k2q", TEMPLATE),
    ];
    let answers = kubelet.prepare(&asked).await.unwrap();
    assert_eq!(
        answers[NAMED],
        Ok(vec![
            format!("{DRIVER}/fpga=fpga-0"),
            format!("{DRIVER}/metadata={NAMED}_fpga")
        ])
    );
    assert_eq!(
        answers[TEMPLATE],
        Ok(vec![
            format!("{DRIVER}/fpga=fpga-1"),
            format!("{DRIVER}/metadata={TEMPLATE}_fpga")
        ])
    );

    let text = std::fs::read_to_string(files.host_path(TEMPLATE, "fpga")).unwrap();
    let doc: v1alpha1::DeviceMetadata = serde_json::from_str(&text).unwrap();
    assert_eq!(doc.api_version, "metadata.resource.k8s.io/v1alpha1");
    assert_eq!(doc.pod_claim_name.as_deref(), Some("accel"));
    assert_eq!(doc.requests[0].name, "fpga/big");
    assert_eq!(
        doc.requests[0].devices[0].attributes["serial"]
            .string
            .as_deref(),
        Some("SN-fpga-1")
    );
    let spec = std::fs::read_to_string(files.cdi_spec_path(NAMED, "fpga")).unwrap();
    assert!(
        spec.contains("/var/run/kubernetes.io/dra-device-attributes/resourceclaims/named/fpga/fpga.example.com-metadata.json"),
        "{spec}"
    );

    let done = kubelet.unprepare(&asked[..1]).await.unwrap();
    assert_eq!(done[NAMED], Ok(()));
    assert!(!files.cdi_spec_path(NAMED, "fpga").exists());
    assert!(!files.host_dir().join(NAMED).exists());
    assert!(files.host_path(TEMPLATE, "fpga").exists());
    stop.cancel();
}

#[tokio::test]
async fn without_the_option_nothing_is_written() {
    let root = tempfile::tempdir().unwrap();
    let opts = options(root.path()).device_metadata(false);
    assert!(opts.metadata_files().is_none());
    let stop = CancellationToken::new();
    let mut kubelet = start(opts, &stop).await;
    let answers = kubelet
        .prepare(&[Claim::new("ns", "named", NAMED)])
        .await
        .unwrap();
    assert_eq!(answers[NAMED], Ok(vec![format!("{DRIVER}/fpga=fpga-0")]));
    assert!(!root.path().join("cdi").exists());
    stop.cancel();
}

#[tokio::test]
async fn a_claim_whose_files_cannot_be_written_fails_with_the_path() {
    let root = tempfile::tempdir().unwrap();
    // A file where the CDI directory should be.
    std::fs::write(root.path().join("cdi"), "").unwrap();
    let stop = CancellationToken::new();
    let mut kubelet = start(options(root.path()), &stop).await;
    let answers = kubelet
        .prepare(&[Claim::new("ns", "named", NAMED)])
        .await
        .unwrap();
    let e = answers[NAMED].clone().unwrap_err();
    assert!(
        e.starts_with(&format!(
            "cannot create {}",
            root.path().join("cdi").display()
        )),
        "{e}"
    );
    stop.cancel();
}
