//! `--share-trust-domain`: shares of one GPU stay within one namespace (or one value of a
//! Namespace label), checked where the share is reserved; off, namespaces mix as before.

use super::shares::share;
use super::*;
use crate::sharing::trust::{TrustDomain, TrustLabel};

async fn env_with(rule: TrustDomain) -> Env {
    env_tweaked("dgx-h100", |o| o.share_trust_domain = rule).await
}

fn cref_in(namespace: &str, uid: &str) -> ClaimRef {
    ClaimRef {
        namespace: namespace.into(),
        name: format!("claim-{uid}"),
        uid: ClaimUid::parse(uid).unwrap(),
    }
}

impl Env {
    /// Adds claim `uid` of `namespace`: a share of `memory` of `device`.
    fn add_share_in(&self, namespace: &str, uid: &str, device: &str, memory: &str) {
        self.add(crate::api::allocated_claim(
            namespace,
            &format!("claim-{uid}"),
            uid,
            vec![share("nb", device, memory)],
            vec![],
        ));
    }

    /// Adds a Namespace with `labels`.
    fn add_namespace(&self, name: &str, labels: &[(&str, &str)]) {
        let ns = k8s_openapi::api::core::v1::Namespace {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some(name.into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            ..Default::default()
        };
        lock(&self.api.namespaces).insert(name.into(), ns);
    }

    async fn prepare_in(
        &self,
        namespace: &str,
        uid: &str,
    ) -> Result<Vec<DeviceRecord>, ClaimError> {
        let mut r = self.plugin.prepare(vec![cref_in(namespace, uid)]).await;
        r.pop().unwrap().1
    }

    async fn unprepare_in(&self, namespace: &str, uid: &str) {
        let mut r = self.plugin.unprepare(vec![cref_in(namespace, uid)]).await;
        r.pop().unwrap().1.unwrap();
    }
}

/// Under `namespace`, a share of a GPU that another namespace's share holds is refused, naming
/// the holder, both domains and the rule, and leaves nothing behind; a share of the same
/// namespace, or of another GPU, is prepared. Off (the default), the same share is prepared.
#[tokio::test]
async fn a_second_namespaces_share_is_refused_under_the_namespace_rule_and_allowed_without_it() {
    let e = env_with(TrustDomain::Namespace).await;
    let _host = e.mps_host();
    e.add_share_in("team-a", "a1", "gpu-0", "8Gi");
    e.add_share_in("team-a", "a2", "gpu-0", "8Gi");
    e.add_share_in("team-b", "b1", "gpu-0", "8Gi");
    e.add_share_in("team-b", "b2", "gpu-1", "8Gi");
    e.prepare_in("team-a", "a1").await.unwrap();
    // The same namespace shares the GPU.
    e.prepare_in("team-a", "a2").await.unwrap();
    let err = e.prepare_in("team-b", "b1").await.unwrap_err();
    assert!(
        matches!(err, ClaimError::ShareOfAnotherDomain { .. }),
        "{err}"
    );
    let err = err.to_string();
    for part in [
        "claim team-b/claim-b1 of namespace team-b cannot have a share of gpu-0",
        "claim team-a/claim-a1 (a1) of namespace team-a holds a share of it",
        "--share-trust-domain=namespace",
        "Delete the pod",
    ] {
        assert!(err.contains(part), "{part} missing: {err}");
    }
    // Refused before anything was reserved or written.
    assert_eq!(e.state("b1"), None);
    assert!(!e.spec("b1").exists());
    // Another GPU takes the other namespace.
    e.prepare_in("team-b", "b2").await.unwrap();
    // The rule holds after a restart, from the checkpoint.
    let (p, rec, _stop) = start_with(e.dir.path(), e.api.clone(), e.sim.clone(), |o| {
        o.share_trust_domain = TrustDomain::Namespace
    })
    .await;
    assert!(rec.failed.is_empty(), "{rec:?}");
    let r = p.prepare(vec![cref_in("team-b", "b1")]).await;
    assert!(
        matches!(r[0].1, Err(ClaimError::ShareOfAnotherDomain { .. })),
        "{:?}",
        r[0].1
    );
    drop((p, _stop));
    // Once team-a's shares end, the GPU takes team-b.
    e.unprepare_in("team-a", "a1").await;
    e.unprepare_in("team-a", "a2").await;
    e.prepare_in("team-b", "b1").await.unwrap();
    // No Namespace was read: the namespace rule needs none.
    assert_eq!(e.api.namespace_gets.load(Ordering::SeqCst), 0);

    // Without the rule (the default), the same two namespaces share one GPU.
    let e = env_with(TrustDomain::default()).await;
    let _host = e.mps_host();
    e.add_share_in("team-a", "a1", "gpu-0", "8Gi");
    e.add_share_in("team-b", "b1", "gpu-0", "8Gi");
    e.prepare_in("team-a", "a1").await.unwrap();
    e.prepare_in("team-b", "b1").await.unwrap();
}

/// Two prepares of different namespaces for one free GPU, at once: the check is made where the
/// share is reserved, under the ledger's lock, so exactly one of them gets it.
#[tokio::test]
async fn of_two_namespaces_racing_for_a_free_gpu_one_gets_it() {
    let e = env_with(TrustDomain::Namespace).await;
    let _host = e.mps_host();
    e.add_share_in("team-a", "a1", "gpu-2", "8Gi");
    e.add_share_in("team-b", "b1", "gpu-2", "8Gi");
    let (a, b) = tokio::join!(e.prepare_in("team-a", "a1"), e.prepare_in("team-b", "b1"));
    assert!(a.is_ok() != b.is_ok(), "a: {a:?}, b: {b:?}");
    let refused = a.err().or(b.err()).unwrap();
    assert!(
        matches!(refused, ClaimError::ShareOfAnotherDomain { .. }),
        "{refused}"
    );
}

/// Under `label:<key>`, namespaces with one value of the label share a GPU; another value, or
/// none, is refused, naming both values; the value is read from the Namespace (once per share,
/// never for a whole GPU) and recorded with the claim; a namespace that cannot be read refuses
/// the share.
#[tokio::test]
async fn under_a_label_rule_namespaces_of_one_label_value_share_and_others_are_refused() {
    let e = env_with(TrustDomain::Label("example.com/team".into())).await;
    let _host = e.mps_host();
    let key = "example.com/team";
    e.add_namespace("team-a", &[(key, "blue")]);
    e.add_namespace("team-b", &[(key, "blue"), ("other", "x")]);
    e.add_namespace("team-c", &[(key, "red")]);
    e.add_namespace("team-d", &[("other", "blue")]);
    e.add_share_in("team-a", "a1", "gpu-0", "8Gi");
    e.add_share_in("team-b", "b1", "gpu-0", "8Gi");
    e.add_share_in("team-c", "c1", "gpu-0", "8Gi");
    e.add_share_in("team-d", "d1", "gpu-0", "8Gi");
    e.add_share_in("team-x", "x1", "gpu-1", "8Gi");
    e.prepare_in("team-a", "a1").await.unwrap();
    e.prepare_in("team-b", "b1").await.unwrap();
    let recorded = e.plugin.ledger().read(|c| {
        c.claims
            .get(&ClaimUid::parse("a1").unwrap())
            .unwrap()
            .trust_label
            .clone()
    });
    assert_eq!(
        recorded,
        Some(TrustLabel {
            key: key.into(),
            value: "blue".into()
        })
    );
    let err = e.prepare_in("team-c", "c1").await.unwrap_err().to_string();
    for part in [
        "claim team-c/claim-c1 of example.com/team=red (namespace team-c)",
        "claim team-a/claim-a1 (a1) of example.com/team=blue (namespace team-a)",
        "--share-trust-domain=label:example.com/team",
    ] {
        assert!(err.contains(part), "{part} missing: {err}");
    }
    // A namespace without the label is a domain of its own.
    let err = e.prepare_in("team-d", "d1").await.unwrap_err().to_string();
    assert!(
        err.contains("of namespace team-d (no label example.com/team)"),
        "{err}"
    );
    // A namespace that cannot be read: refused, saying why and what the node needs.
    let err = e.prepare_in("team-x", "x1").await.unwrap_err();
    assert!(
        matches!(err, ClaimError::ShareDomainUnknown { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("reading namespace team-x")
            && err.to_string().contains("`get` on namespaces"),
        "{err}"
    );
    assert_eq!(e.state("x1"), None);
    let gets = e.api.namespace_gets.load(Ordering::SeqCst);
    assert_eq!(gets, 5, "one Namespace read per share prepared");
    // A whole GPU reads no Namespace.
    e.add(crate::api::allocated_claim(
        "team-c",
        "claim-w",
        "w",
        vec![result("gpu", "gpu-5")],
        vec![],
    ));
    e.prepare_in("team-c", "w").await.unwrap();
    assert_eq!(e.api.namespace_gets.load(Ordering::SeqCst), gets);
}
