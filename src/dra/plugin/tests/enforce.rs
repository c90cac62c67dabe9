//! What keeps a GPU's shares honest on the node: one pod per share claim, the GPU's compute
//! mode while it holds shares, and refusal while its share daemon does not answer.

use super::shares::share;
use super::*;
use k8s_openapi::api::resource::v1::ResourceClaimConsumerReference;

fn reserved_for(mut c: ResourceClaim, pods: &[&str]) -> ResourceClaim {
    c.status.get_or_insert_with(Default::default).reserved_for = Some(
        pods.iter()
            .map(|p| ResourceClaimConsumerReference {
                api_group: None,
                resource: "pods".into(),
                name: (*p).into(),
                uid: format!("uid-{p}"),
            })
            .collect(),
    );
    c
}

#[tokio::test]
async fn a_share_claim_reserved_for_two_pods_is_refused_with_what_to_do() {
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    let s = || claim("two", vec![share("nb", "gpu-0", "8Gi")]);
    e.add(reserved_for(s(), &["nb-a", "nb-b"]));
    let err = e.prepare("two").await.unwrap_err().to_string();
    for want in [
        "default/claim-two",
        "reserved for 2 pods (nb-a, nb-b)",
        "applies to each CUDA process",
        "ResourceClaimTemplate",
    ] {
        assert!(err.contains(want), "no {want:?} in {err}");
    }
    assert_eq!(e.state("two"), None, "nothing recorded");
    assert!(!e.spec("two").exists());

    // One pod: prepared. A whole GPU may serve several pods of one claim, as before.
    e.add(reserved_for(s(), &["nb-a"]));
    e.prepare("two").await.unwrap();
    // A second pod joins the prepared claim: refused as two pods at once were; the first pod's
    // share stays prepared.
    e.add(reserved_for(s(), &["nb-a", "nb-c"]));
    let err = e.prepare("two").await.unwrap_err().to_string();
    assert!(err.contains("reserved for 2 pods (nb-a, nb-c)"), "{err}");
    assert!(
        e.state("two").is_some(),
        "the first pod's share is still prepared"
    );
    assert!(e.spec("two").exists());
    e.add(reserved_for(s(), &["nb-a"]));
    e.prepare("two").await.unwrap();
    e.add(reserved_for(
        claim("whole", vec![result("gpu", "gpu-1")]),
        &["a", "b"],
    ));
    e.prepare("whole").await.unwrap();
}

#[tokio::test]
async fn a_gpu_with_shares_is_exclusive_process_until_its_last_share_goes() {
    use crate::inventory::ComputeMode;
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    let inv = e.sim.snapshot().unwrap();
    let (gpu, other) = (inv.gpus[0].uuid.clone(), inv.gpus[1].uuid.clone());
    for uid in ["s1", "s2"] {
        e.add(claim(uid, vec![share("nb", "gpu-0", "8Gi")]));
    }
    e.add(claim("w", vec![result("gpu", "gpu-1")]));
    e.prepare("s1").await.unwrap();
    e.prepare("s2").await.unwrap();
    e.prepare("w").await.unwrap();
    assert_eq!(
        e.sim.compute_mode(&gpu).unwrap(),
        ComputeMode::ExclusiveProcess
    );
    assert_eq!(
        e.sim.compute_mode(&other).unwrap(),
        ComputeMode::Default,
        "a whole GPU keeps its mode"
    );
    let record = e.dir.path().join("plugin/compute-mode.json");
    let text = std::fs::read_to_string(&record).unwrap();
    assert!(text.contains(&format!("\"{gpu}\": \"default\"")), "{text}");
    let set = |mode| SimAction::SetComputeMode {
        gpu: gpu.clone(),
        mode,
    };
    let sets = || {
        e.sim
            .actions()
            .into_iter()
            .filter(|a| matches!(a, SimAction::SetComputeMode { .. }))
            .collect::<Vec<_>>()
    };
    assert_eq!(sets(), vec![set(ComputeMode::ExclusiveProcess)], "set once");

    e.unprepare("s1").await.unwrap();
    assert_eq!(
        e.sim.compute_mode(&gpu).unwrap(),
        ComputeMode::ExclusiveProcess
    );
    e.unprepare("s2").await.unwrap();
    assert_eq!(e.sim.compute_mode(&gpu).unwrap(), ComputeMode::Default);
    assert!(!record.exists(), "no GPU is recorded");
    assert_eq!(
        sets(),
        vec![
            set(ComputeMode::ExclusiveProcess),
            set(ComputeMode::Default)
        ]
    );
}

#[tokio::test]
async fn start_up_sets_the_mode_again_for_shares_and_back_for_gpus_without() {
    use crate::inventory::ComputeMode;
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    let inv = e.sim.snapshot().unwrap();
    let (a, b) = (inv.gpus[0].uuid.clone(), inv.gpus[1].uuid.clone());
    e.add(claim("s", vec![share("nb", "gpu-0", "8Gi")]));
    e.prepare("s").await.unwrap();
    // A reboot reset the GPU; and a crash left gpu-1 recorded with no share of it.
    e.sim.set_compute_mode(&a, ComputeMode::Default).unwrap();
    e.sim
        .set_compute_mode(&b, ComputeMode::ExclusiveProcess)
        .unwrap();
    let record = e.dir.path().join("plugin/compute-mode.json");
    std::fs::write(
        &record,
        format!("{{\"{a}\": \"default\", \"{b}\": \"prohibited\"}}"),
    )
    .unwrap();
    let (_p, rec, _stop) = e.restart(e.sim.clone()).await;
    assert!(rec.failed.is_empty(), "{rec:?}");
    assert_eq!(
        e.sim.compute_mode(&a).unwrap(),
        ComputeMode::ExclusiveProcess
    );
    assert_eq!(e.sim.compute_mode(&b).unwrap(), ComputeMode::Prohibited);
    let text = std::fs::read_to_string(&record).unwrap();
    assert!(
        text.contains(a.as_str()) && !text.contains(b.as_str()),
        "{text}"
    );
}

#[tokio::test]
async fn a_share_whose_gpu_mode_cannot_be_set_is_refused_and_leaves_nothing() {
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    // The record cannot be written: its path is a directory.
    std::fs::create_dir_all(e.dir.path().join("plugin/compute-mode.json/x")).unwrap();
    e.add(claim("s", vec![share("nb", "gpu-0", "8Gi")]));
    let err = e.prepare("s").await.unwrap_err();
    let msg = crate::report::chain(&err).to_string();
    assert!(msg.contains("compute-mode"), "{msg}");
    assert_eq!(e.state("s"), None);
    assert!(!e.spec("s").exists());
}

type Round = (
    tokio::time::Instant,
    BTreeMap<crate::inventory::DeviceUuid, bool>,
    crate::health::DaemonsDown,
);

/// What the watch reported, round by round, with the (paused) time of each report; `rounds`
/// counts them, for a test to wait on. Each round is published to the plugin
/// ([`publish_round`]).
struct Reports(
    Mutex<Vec<Round>>,
    tokio::sync::watch::Sender<usize>,
    tokio::sync::watch::Sender<crate::inventory::health::HealthState>,
);

impl DaemonReport for Reports {
    fn report(
        &self,
        up: &BTreeMap<crate::inventory::DeviceUuid, bool>,
        down: &crate::health::DaemonsDown,
    ) {
        let mut r = lock(&self.0);
        r.push((tokio::time::Instant::now(), up.clone(), down.clone()));
        self.1.send_replace(r.len());
        publish_round(&self.2, up, down);
    }
}

impl Reports {
    /// Rounds of `e`'s plugin.
    fn of(e: &Env) -> Self {
        Self(
            Mutex::default(),
            tokio::sync::watch::Sender::new(0),
            e._stop.health.clone(),
        )
    }

    fn last(
        &self,
    ) -> (
        BTreeMap<crate::inventory::DeviceUuid, bool>,
        crate::health::DaemonsDown,
    ) {
        let r = lock(&self.0);
        let (_, up, down) = r.last().unwrap();
        (up.clone(), down.clone())
    }
}

#[tokio::test]
async fn a_daemon_that_stops_answering_is_reported_and_refuses_new_shares_until_it_answers() {
    let e = env("dgx-h100").await;
    let host = e.mps_host();
    let gpu = e.sim.snapshot().unwrap().gpus[0].uuid.clone();
    let key = crate::inventory::DeviceUuid::Gpu(gpu.clone());
    for uid in ["s1", "s2"] {
        e.add(claim(uid, vec![share("nb", "gpu-0", "8Gi")]));
    }
    let reports = Reports::of(&e);
    e.plugin.probe_share_daemons(&reports).await;
    e.settled().await;
    assert_eq!(
        reports.last(),
        (BTreeMap::new(), BTreeMap::new()),
        "no shares, no probes"
    );

    e.prepare("s1").await.unwrap();
    e.plugin.probe_share_daemons(&reports).await;
    e.settled().await;
    assert_eq!(reports.last().0, BTreeMap::from([(key.clone(), true)]));
    assert!(reports.last().1.is_empty());

    // The MPS host goes, and its daemon with it: the request stays, but nothing answers and
    // nothing starts it again.
    drop(host);
    let pipe = e.plugin.inner.mps.gpu_pipe_dir(&gpu);
    std::fs::remove_file(pipe.join("answering")).unwrap();
    assert!(e.plugin.inner.mps.gpu_requested(&gpu));
    e.plugin.probe_share_daemons(&reports).await;
    e.settled().await;
    let (up, down) = reports.last();
    assert_eq!(up, BTreeMap::from([(key.clone(), false)]));
    let since = down[&key];
    let err = e.prepare("s2").await.unwrap_err().to_string();
    for want in [
        format!("MPS control daemon of GPU {gpu} has not answered since"),
        "The MPS host restarts the daemon".to_string(),
        "retries".to_string(),
    ] {
        assert!(err.contains(&want), "no {want:?} in {err}");
    }
    assert_eq!(e.state("s2"), None);
    // Still down: the time it went down stays.
    e.plugin.probe_share_daemons(&reports).await;
    e.settled().await;
    assert_eq!(reports.last().1, BTreeMap::from([(key.clone(), since)]));
    // The MPS host is back and starts the daemon again.
    let _host = e.mps_host();
    mps::tests::eventually("the host starts the daemon again", || {
        pipe.join("answering").exists()
    });
    e.plugin.probe_share_daemons(&reports).await;
    e.settled().await;
    assert_eq!(
        reports.last(),
        (BTreeMap::from([(key.clone(), true)]), BTreeMap::new())
    );
    e.prepare("s2").await.unwrap();
}

/// A GPU reset, a driver reload or another agent can leave a GPU with shares in `DEFAULT`:
/// the watch notices in its next round, without a prepare, and puts it back, so a CUDA process
/// that misses MPS is refused again. One that cannot be read or put back is returned as
/// unguarded (the watch then reports it as it reports a daemon that does not answer).
#[tokio::test]
async fn the_watch_puts_a_gpu_with_shares_back_in_exclusive_process() {
    use crate::inventory::ComputeMode;
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    let gpu = e.sim.snapshot().unwrap().gpus[0].uuid.clone();
    let key = crate::inventory::DeviceUuid::Gpu(gpu.clone());
    e.add(claim("s", vec![share("nb", "gpu-0", "8Gi")]));
    e.prepare("s").await.unwrap();
    // Reset behind nvdra's back.
    e.sim.set_compute_mode(&gpu, ComputeMode::Default).unwrap();
    let reports = Reports::of(&e);
    e.plugin.probe_share_daemons(&reports).await;
    e.settled().await;
    assert_eq!(
        e.sim.compute_mode(&gpu).unwrap(),
        ComputeMode::ExclusiveProcess,
        "put back by the watch"
    );
    assert_eq!(
        reports.last(),
        (BTreeMap::from([(key.clone(), true)]), BTreeMap::new())
    );
    // A record naming a GPU the backend cannot read (gone from the bus): returned unguarded.
    let gone = crate::inventory::GpuUuid("GPU-00000000-0000-4000-8000-0000000000ff".into());
    let modes = crate::dra::compute_mode::ComputeModes::new(&e.dir.path().join("plugin"));
    modes.hold(&e.sim, &gpu).unwrap();
    let record = e.dir.path().join("plugin/compute-mode.json");
    let mut text: BTreeMap<String, String> =
        serde_json::from_str(&std::fs::read_to_string(&record).unwrap()).unwrap();
    text.insert(gone.to_string(), "default".into());
    std::fs::write(&record, serde_json::to_string(&text).unwrap()).unwrap();
    let modes = crate::dra::compute_mode::ComputeModes::new(&e.dir.path().join("plugin"));
    let (restored, failed) = modes.recheck(&e.sim);
    assert!(restored.is_empty(), "{restored:?}");
    assert!(
        matches!(failed.as_slice(), [crate::dra::compute_mode::Error::Hold { gpu: g, .. }] if *g == gone),
        "{failed:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_watch_probes_every_interval_from_one_interval_after_start_until_shutdown() {
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    let gpu = e.sim.snapshot().unwrap().gpus[0].uuid.clone();
    e.add(claim("s", vec![share("nb", "gpu-0", "8Gi")]));
    e.prepare("s").await.unwrap();
    let reports = Arc::new(Reports::of(&e));
    let stop = CancellationToken::new();
    let start = tokio::time::Instant::now();
    let every = std::time::Duration::from_secs(5);
    let task = tokio::spawn(e.plugin.clone().watch_share_daemons(
        every,
        reports.clone(),
        stop.clone(),
    ));
    // Each report is waited for; paused time moves only to the watch's next tick (and not
    // while a probe's process runs: blocking work holds the paused clock).
    let mut rounds = reports.1.subscribe();
    for n in 1..=3u32 {
        rounds.wait_for(|r| *r >= n as usize).await.unwrap();
        let at = lock(&reports.0)[n as usize - 1].0;
        assert_eq!(at - start, every * n, "round {n}");
    }
    let key = crate::inventory::DeviceUuid::Gpu(gpu);
    assert!(lock(&reports.0).iter().all(|(_, up, _)| up[&key]));
    stop.cancel();
    task.await.unwrap();
}

#[tokio::test]
async fn a_claims_own_mps_daemon_puts_its_whole_gpus_in_exclusive_process_too() {
    use crate::inventory::ComputeMode;
    let e = env("dgx-h100").await;
    let _host = e.mps_host();
    e.add(claim_with(
        "p",
        vec![result("gpu", "gpu-4"), result("gpu", "gpu-5")],
        vec![opaque(
            &[],
            serde_json::json!({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}),
        )],
    ));
    let inv = e.sim.snapshot().unwrap();
    let gpus = [inv.gpus[4].uuid.clone(), inv.gpus[5].uuid.clone()];
    e.prepare("p").await.unwrap();
    for g in &gpus {
        assert_eq!(
            e.sim.compute_mode(g).unwrap(),
            ComputeMode::ExclusiveProcess
        );
    }
    e.unprepare("p").await.unwrap();
    for g in &gpus {
        assert_eq!(e.sim.compute_mode(g).unwrap(), ComputeMode::Default);
    }
}
