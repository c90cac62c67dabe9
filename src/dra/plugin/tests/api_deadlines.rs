//! The API reads inside a prepare (the claim, the pod of a single-user share, the namespace of a
//! share under `--share-trust-domain=label:<key>`) each wait at most
//! [`prepare::API_READ_DEADLINE`](crate::dra::plugin::prepare::API_READ_DEADLINE): a read the
//! API server never answers fails its claim with an error that says so, and the batch's other
//! claims are prepared. Paused time: the deadline passes without the test waiting for it.

use super::shares::{pod, share};
use super::*;
use crate::dra::plugin::prepare::API_READ_DEADLINE;
use crate::sharing::trust::TrustDomain;

#[tokio::test(start_paused = true)]
async fn a_read_never_answered_fails_its_claim_alone_at_the_deadline() {
    let e = env("dgx-h100").await;
    // A Pascal GPU: its MPS serves one user at a time, so a share's pod is read.
    e.sim
        .update(|inv| inv.gpus[1].cuda_compute_capability.major = 6);
    e.reread().await;
    e.add(claim("w", vec![result("gpu", "gpu-2")]));
    e.add(claim("h", vec![result("gpu", "gpu-3")]));
    e.add_share_for("s", "gpu-1", "8Gi", pod("nb-s", Some(1000), &[None]));
    lock(&e.api.silent).extend(["claim default/claim-h".into(), "pod default/nb-s".into()]);

    let start = tokio::time::Instant::now();
    // Bounded here too, so that a read without a deadline fails the test instead of hanging it.
    let got = tokio::time::timeout(
        API_READ_DEADLINE * 3,
        e.plugin.prepare(vec![cref("w"), cref("h"), cref("s")]),
    )
    .await
    .expect("the prepare ends");
    assert!(start.elapsed() >= API_READ_DEADLINE);
    let by_uid: BTreeMap<String, Result<Vec<DeviceRecord>, ClaimError>> = got
        .into_iter()
        .map(|(uid, r)| (uid.as_str().to_string(), r))
        .collect();
    assert_eq!(by_uid["w"].as_ref().unwrap().len(), 1);
    let error = |uid: &str| crate::report::chain(by_uid[uid].as_ref().unwrap_err()).to_string();
    assert_eq!(
        error("h"),
        "the API server did not answer the read of resource claim default/claim-h within 10s; \
         the kubelet retries the prepare"
    );
    let s = error("s");
    assert!(
        s.contains(
            "the API server did not answer the read of pod default/nb-s within 10s; the \
             kubelet retries the prepare"
        ),
        "{s}"
    );
    // Neither holds anything: both prepare once the server answers.
    assert_eq!(e.state("h"), None);
    assert_eq!(e.state("s"), None);
    lock(&e.api.silent).clear();
    e.prepare("h").await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_namespace_read_never_answered_refuses_the_share_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let api = Arc::new(FakeApi::default());
    let sim = SimBackend::from_profile("dgx-h100", NODE).unwrap();
    let (plugin, _, stop) = start_with(dir.path(), api.clone(), sim.clone(), |o| {
        o.share_trust_domain = TrustDomain::Label("example.com/team".into())
    })
    .await;
    let e = Env {
        plugin,
        api,
        sim,
        dir,
        _stop: stop,
    };
    e.add(claim("t", vec![share("nb", "gpu-0", "8Gi")]));
    lock(&e.api.silent).insert("namespace default".into());
    let got = tokio::time::timeout(API_READ_DEADLINE * 3, e.prepare("t"))
        .await
        .expect("the prepare ends");
    let err = crate::report::chain(&got.unwrap_err()).to_string();
    assert!(
        err.contains(
            "the API server did not answer the read of namespace default within 10s; the \
             kubelet retries the prepare"
        ),
        "{err}"
    );
    assert_eq!(e.state("t"), None);
}
