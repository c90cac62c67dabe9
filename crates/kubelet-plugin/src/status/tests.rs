//! The writer against the crate's test API server, through the real `kube::Client`.

use std::sync::Arc;

use k8s_openapi::api::resource::v1::{AllocatedDeviceStatus, ResourceClaim};
use k8s_openapi::apimachinery::pkg::runtime::RawExtension;
use serde_json::json;

use super::*;
use crate::testing::{ApiServer, allocated_claim, allocated_device};

const GPU: &str = "gpu.example.com";
const NET: &str = "net.example.com";

/// A claim with two GPUs of `GPU` and a NIC of `NET`, all of pool `node-a`, and one share.
fn seeded(server: &ApiServer) -> Claim {
    let mut shared = allocated_device("s", GPU, "node-a", "gpu-2");
    shared.share_id = Some("6f1b2c3d-share".into());
    server.seed_claim(allocated_claim(
        "team-a",
        "claim-1",
        "uid-1",
        vec![
            allocated_device("gpus", GPU, "node-a", "gpu-0"),
            allocated_device("gpus", GPU, "node-a", "gpu-1"),
            shared,
            allocated_device("nic", NET, "node-a", "nic-0"),
        ],
    ));
    Claim::new("team-a", "claim-1", "uid-1")
}

fn writer(server: &ApiServer, driver: &str) -> StatusWriter {
    StatusWriter::new(Arc::new(server.client().unwrap()), driver)
}

fn ready_entry(w: &StatusWriter, device: &str, share: Option<&str>) -> AllocatedDeviceStatus {
    AllocatedDeviceStatus {
        conditions: Some(vec![ready("Prepared", "prepared")]),
        data: Some(RawExtension(json!({"uuid": format!("GPU-{device}")}))),
        ..w.entry("node-a", device, share)
    }
}

/// (driver, device) of each entry, in order.
fn entries(claim: &ResourceClaim) -> Vec<(String, String)> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.devices.as_ref())
        .into_iter()
        .flatten()
        .map(|d| (d.driver.clone(), d.device.clone()))
        .collect()
}

/// The devices each field manager applied, as `metadata.managedFields` says.
fn managers(claim: &ResourceClaim) -> Vec<(String, usize)> {
    claim
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .map(|m| {
            let devices = m.fields_v1.as_ref().unwrap().0["f:status"]["f:devices"]
                .as_object()
                .unwrap()
                .len();
            (m.manager.clone().unwrap(), devices)
        })
        .collect()
}

fn pair(driver: &str, device: &str) -> (String, String) {
    (driver.into(), device.into())
}

#[tokio::test]
async fn entries_are_applied_per_driver_and_other_drivers_entries_stay() {
    let server = ApiServer::start().await;
    let claim = seeded(&server);
    let (gpu, net) = (writer(&server, GPU), writer(&server, NET));
    assert_eq!(gpu.field_manager(), GPU);

    let nic = ready_entry(&net, "nic-0", None);
    assert_eq!(
        net.apply(&claim, vec![nic]).await.unwrap(),
        Applied::Written
    );
    let ours = vec![
        ready_entry(&gpu, "gpu-0", None),
        ready_entry(&gpu, "gpu-1", None),
        ready_entry(&gpu, "gpu-2", Some("6f1b2c3d-share")),
    ];
    assert_eq!(gpu.apply(&claim, ours).await.unwrap(), Applied::Written);
    let stored = server.claim("team-a", "claim-1").unwrap();
    assert_eq!(
        entries(&stored),
        [
            pair(NET, "nic-0"),
            pair(GPU, "gpu-0"),
            pair(GPU, "gpu-1"),
            pair(GPU, "gpu-2")
        ]
    );
    assert_eq!(
        managers(&stored),
        [(GPU.to_string(), 3), (NET.to_string(), 1)]
    );
    let devices = stored.status.unwrap().devices.unwrap();
    let gpu0 = &devices[1];
    assert_eq!(gpu0.data.as_ref().unwrap().0["uuid"], "GPU-gpu-0");
    let cond = &gpu0.conditions.as_ref().unwrap()[0];
    assert_eq!(
        (cond.type_.as_str(), cond.status.as_str()),
        ("Ready", "True")
    );
    assert_eq!(devices[3].share_id.as_deref(), Some("6f1b2c3d-share"));

    // One apply is the driver's whole set: what it leaves out goes, the NIC stays.
    gpu.apply(&claim, vec![ready_entry(&gpu, "gpu-0", None)])
        .await
        .unwrap();
    let stored = server.claim("team-a", "claim-1").unwrap();
    assert_eq!(entries(&stored), [pair(NET, "nic-0"), pair(GPU, "gpu-0")]);
    // And an empty set clears them.
    assert_eq!(gpu.apply(&claim, vec![]).await.unwrap(), Applied::Written);
    let stored = server.claim("team-a", "claim-1").unwrap();
    assert_eq!(entries(&stored), [pair(NET, "nic-0")]);
    assert_eq!(managers(&stored), [(NET.to_string(), 1)]);

    // Each write was one forced server-side apply of the status subresource, as its driver.
    let patches: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r.method == "PATCH")
        .collect();
    assert_eq!(patches.len(), 4);
    for p in &patches {
        assert_eq!(
            p.path,
            "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/claim-1/status"
        );
        assert!(p.query.contains("force=true"), "{}", p.query);
    }
    assert!(patches[1].query.contains(&format!("fieldManager={GPU}")));
}

#[tokio::test]
async fn an_entry_of_another_driver_or_too_much_data_is_refused_before_any_request() {
    let server = ApiServer::start().await;
    let claim = seeded(&server);
    let gpu = writer(&server, GPU);
    let nic = ready_entry(&writer(&server, NET), "nic-0", None);
    let e = gpu.apply(&claim, vec![nic]).await.unwrap_err();
    assert!(matches!(e, api::Error::Invalid(_)), "{e:?}");
    assert!(
        e.to_string().contains("names driver net.example.com"),
        "{e}"
    );
    let mut big = ready_entry(&gpu, "gpu-0", None);
    big.data = Some(RawExtension(json!({"x": "y".repeat(MAX_DATA)})));
    let e = gpu.apply(&claim, vec![big]).await.unwrap_err();
    assert!(e.to_string().contains("more than the 10240"), "{e}");
    assert!(server.requests().is_empty());
}

#[tokio::test]
async fn a_device_not_allocated_or_a_recreated_claim_is_not_written() {
    let server = ApiServer::start().await;
    let claim = seeded(&server);
    let gpu = writer(&server, GPU);
    let e = gpu
        .apply(&claim, vec![ready_entry(&gpu, "gpu-7", None)])
        .await
        .unwrap_err();
    assert!(matches!(e, api::Error::Invalid(_)), "{e:?}");
    let other = Claim::new("team-a", "claim-1", "uid-of-the-first");
    let e = gpu
        .apply(&other, vec![ready_entry(&gpu, "gpu-0", None)])
        .await
        .unwrap_err();
    assert!(matches!(e, api::Error::Conflict(_)), "{e:?}");
    let gone = Claim::new("team-a", "claim-9", "uid-9");
    let e = gpu.apply(&gone, vec![]).await.unwrap_err();
    assert!(matches!(e, api::Error::NotFound(_)), "{e:?}");
    assert_eq!(
        entries(&server.claim("team-a", "claim-1").unwrap()),
        Vec::<(String, String)>::new()
    );
}

/// What the writer logs, for one test (a thread's default subscriber: the test's runtime runs
/// on its thread).
#[derive(Clone, Default)]
struct Logs(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        crate::lock::lock(&self.0).extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_server_that_drops_the_field_is_told_apart_said_once_and_is_no_error() {
    let logs = Logs::default();
    let sink = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let server = ApiServer::start().await;
    let claim = seeded(&server);
    server.drop_claim_device_status();
    let gpu = writer(&server, GPU);
    for _ in 0..3 {
        let r = gpu
            .apply(&claim, vec![ready_entry(&gpu, "gpu-0", None)])
            .await;
        assert_eq!(r.unwrap(), Applied::Dropped);
    }
    assert!(entries(&server.claim("team-a", "claim-1").unwrap()).is_empty());
    let text = String::from_utf8(crate::lock::lock(&logs.0).clone()).unwrap();
    assert_eq!(
        text.matches("does not keep ResourceClaim status.devices")
            .count(),
        1,
        "{text}"
    );
    assert!(text.contains("WARN"), "{text}");
}

#[tokio::test]
async fn deallocation_drops_the_entries_as_the_api_server_does() {
    let server = ApiServer::start().await;
    let claim = seeded(&server);
    let gpu = writer(&server, GPU);
    gpu.apply(&claim, vec![ready_entry(&gpu, "gpu-0", None)])
        .await
        .unwrap();
    assert!(server.deallocate_claim("team-a", "claim-1"));
    let stored = server.claim("team-a", "claim-1").unwrap();
    assert!(entries(&stored).is_empty());
    assert!(stored.status.unwrap().allocation.is_none());
}

/// An API server that takes the write and never answers.
struct Silent;

impl ClaimStatusApi for Silent {
    fn apply_claim_status<'a>(
        &'a self,
        _: &'a str,
        _: &'a str,
        _: &'a str,
        _: &'a serde_json::Value,
    ) -> futures::future::BoxFuture<'a, api::Result<ResourceClaim>> {
        Box::pin(futures::future::pending())
    }
}

#[tokio::test(start_paused = true)]
async fn a_write_never_answered_is_transient_at_the_deadline() {
    let w = StatusWriter::new(Arc::new(Silent), GPU);
    let claim = Claim::new("ns", "c", "u-1");
    let start = tokio::time::Instant::now();
    // Bounded here too, so a writer without its deadline fails this test instead of hanging it.
    let write = w.apply(&claim, vec![ready_entry(&w, "gpu-0", None)]);
    let e = tokio::time::timeout(WRITE_DEADLINE * 2, write)
        .await
        .expect("the writer waits for ever without its deadline")
        .unwrap_err();
    assert!(matches!(e, api::Error::Transient(_)), "{e:?}");
    assert!(e.to_string().contains("ns/c: no answer within 10 s"), "{e}");
    assert_eq!(start.elapsed(), WRITE_DEADLINE);
}
