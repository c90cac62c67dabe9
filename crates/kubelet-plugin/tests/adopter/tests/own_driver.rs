//! A driver written in this crate, as an adopter writes one: `Options` built with a
//! `kube::Client` (here pointed at the library's test API server), one slice published through
//! the publisher, the plugin served, and a claim the API server holds prepared over the
//! plugin's socket, all through the library's public API only.

use std::sync::Arc;

use kubelet_plugin::k8s_openapi::api::resource::v1::Device;
use kubelet_plugin::publisher::{Resources, Slice};
use kubelet_plugin::testing::{ApiServer, KubeletClient, allocated_claim, allocated_device};
use kubelet_plugin::{
    BoxError, CancellationToken, Claim, Driver, Options, PrepareClaim, PrepareResults,
    PreparedDevice, UnprepareResults,
};

const DRIVER: &str = "fpga.example.com";
const NODE: &str = "node-1";

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
                        let cdi = format!("{DRIVER}/fpga={}", r.device);
                        PreparedDevice::new(vec![r.request.clone()], &r.pool, &r.device, vec![cdi])
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

#[tokio::test(flavor = "multi_thread")]
async fn a_driver_of_its_own_publishes_and_prepares_through_a_kube_client() {
    let api = ApiServer::start().await;
    api.seed_node(NODE, "node-uid-1");
    api.seed_claim(allocated_claim(
        "default",
        "fpga-claim",
        "uid-1",
        vec![allocated_device("fpga", DRIVER, NODE, "fpga-0")],
    ));
    let client: kubelet_plugin::kube::Client = api.client().unwrap();
    let kubelet = tempfile::tempdir().unwrap();
    let opts = Options::new(DRIVER, NODE, client.clone())
        .unwrap()
        .kubelet_root(kubelet.path())
        .pod_uid("0f2d5a3c-1234-4bcd-9876-0123456789ab");
    let shutdown = CancellationToken::new();

    let (publisher, slices) = opts.publisher(Arc::new(client));
    let publishing = tokio::spawn(publisher.run(shutdown.clone()));
    let seq = slices
        .set_desired(Resources::node_local(
            NODE,
            vec![Slice {
                devices: vec![Device {
                    name: "fpga-0".into(),
                    ..Device::default()
                }],
                ..Slice::default()
            }],
        ))
        .unwrap();
    slices.wait_synced(seq).await;
    let published = api.slices();
    assert_eq!(published.len(), 1);
    let spec = &published[0].spec;
    assert_eq!(
        (
            spec.driver.as_str(),
            spec.node_name.as_deref(),
            spec.pool.name.as_str()
        ),
        (DRIVER, Some(NODE), NODE)
    );
    assert_eq!(spec.devices.as_ref().unwrap()[0].name, "fpga-0");

    let sockets = opts.sockets();
    let serving = kubelet_plugin::start(Arc::new(Fpgas), opts, shutdown.clone()).unwrap();
    let served = tokio::spawn(serving.wait());
    let mut kubelet_client = KubeletClient::connect(&sockets.dra).await.unwrap();
    let answers = kubelet_client
        .prepare(&[Claim::new("default", "fpga-claim", "uid-1")])
        .await
        .unwrap();
    assert_eq!(answers["uid-1"], Ok(vec![format!("{DRIVER}/fpga=fpga-0")]));

    drop(kubelet_client);
    shutdown.cancel();
    served.await.unwrap().unwrap();
    publishing.await.unwrap();
    assert!(!sockets.dra.exists() && !sockets.registration.exists());
}
