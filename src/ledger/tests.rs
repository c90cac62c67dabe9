use super::*;
use proptest::prelude::*;

fn entry(state: ClaimState, devices: &[&str]) -> ClaimEntry {
    ClaimEntry {
        state,
        namespace: "ns".into(),
        name: "c".into(),
        devices: devices
            .iter()
            .map(|d| DeviceRecord {
                requests: vec!["gpu".into()],
                pool: "node".into(),
                device: DeviceName::parse(d).unwrap(),
                cdi_ids: vec![format!("k8s.gpu.nvidia.com/claim=u-{d}")],
                share_id: None,
                admin_access: false,
                gpu: GpuUuid("GPU-1".into()),
                mig: None,
                consumed: None,
                sharing: Sharing::Exclusive,
            })
            .collect(),
        pods: vec![],
        user: None,
        trust_label: None,
    }
}

fn open(dir: &Path, boot: &str) -> (Ledger, LoadOutcome, CancellationToken) {
    let (l, w, o) = Ledger::open(dir, boot, None).unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(w.run(stop.clone()));
    (l, o, stop)
}

#[tokio::test]
async fn flushed_state_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let (l, o, _s) = open(dir.path(), "boot-1");
    assert_eq!(o, LoadOutcome::Fresh);
    l.update(|c| {
        c.insert(
            ClaimUid::parse("a").unwrap(),
            entry(ClaimState::PrepareCompleted, &["gpu-0"]),
        )
    });
    l.flush().await.unwrap();
    let (l2, o2, _s2) = open(dir.path(), "boot-1");
    assert_eq!(o2, LoadOutcome::Loaded { claims: 1 });
    assert_eq!(l.read(|c| c.clone()), l2.read(|c| c.clone()));
    // No temp files remain.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names, vec![FILE_NAME.to_string()]);
}

#[tokio::test]
async fn reboot_drops_entries() {
    let dir = tempfile::tempdir().unwrap();
    let (l, _, _s) = open(dir.path(), "boot-1");
    l.update(|c| {
        c.insert(
            ClaimUid::parse("a").unwrap(),
            entry(ClaimState::PrepareCompleted, &["gpu-0"]),
        )
    });
    l.flush().await.unwrap();
    let (l2, o2, _s2) = open(dir.path(), "boot-2");
    assert_eq!(o2, LoadOutcome::BootChanged { dropped: 1 });
    assert!(l2.read(|c| c.claims.is_empty()));
    assert_eq!(l2.read(|c| c.boot_id.clone()), "boot-2");
}

#[tokio::test]
async fn corrupt_and_unknown_versions_are_moved_aside() {
    for (content, why) in [
        ("{\"version\": 1, \"bootId\": \"b\", \"cla", "not JSON"),
        (
            "{\"version\": 0, \"bootId\": \"b\", \"claims\": {}}",
            "version 0",
        ),
        (
            "{\"version\": 1, \"bootId\": \"b\", \"claims\": 3}",
            "invalid",
        ),
        ("[]", "no version"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FILE_NAME), content).unwrap();
        let (l, o, _s) = open(dir.path(), "b");
        let LoadOutcome::MovedAside { moved_to, reason } = o else {
            panic!("{content}: {o:?}")
        };
        assert!(reason.contains(why), "{reason}");
        assert_eq!(std::fs::read_to_string(&moved_to).unwrap(), content);
        assert!(
            moved_to
                .file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("checkpoint.json.corrupt-")
        );
        assert!(l.read(|c| c.claims.is_empty()));
        assert!(!dir.path().join(FILE_NAME).exists());
    }
}

/// Every checkpoint nvdra has written, as `(name, bytes)`: `tests/data/checkpoint-v*.json`.
fn fixtures() -> [(&'static str, &'static str); 2] {
    [
        (
            "v1 as written up to 24aada3",
            include_str!("../../tests/data/checkpoint-v1-9a33f72.json"),
        ),
        (
            "v1 as written since 24aada3",
            include_str!("../../tests/data/checkpoint-v1.json"),
        ),
    ]
}

/// What every fixture holds.
fn fixture_state() -> Checkpoint {
    use crate::sharing::{MpsSettings, TimeSliceInterval};
    let uid = |c: char| ClaimUid::parse(format!("1d0e4b7a-0000-4000-8000-00000000000{c}")).unwrap();
    let device = |c: char, request: &str, device: &str, gpu: &str| DeviceRecord {
        requests: vec![request.into()],
        pool: "node-a".into(),
        device: DeviceName::parse(device).unwrap(),
        cdi_ids: vec![format!("k8s.gpu.nvidia.com/claim={}-{device}", uid(c))],
        share_id: None,
        admin_access: false,
        gpu: GpuUuid(format!("GPU-{gpu}-1111-2222-3333-444455556666")),
        mig: None,
        consumed: None,
        sharing: Sharing::Exclusive,
    };
    let entry = |state, namespace: &str, name: &str, d: DeviceRecord| ClaimEntry {
        state,
        namespace: namespace.into(),
        name: name.into(),
        devices: vec![d],
        pods: vec![],
        user: None,
        trust_label: None,
    };
    let mig = DeviceRecord {
        admin_access: true,
        mig: Some(MigRecord {
            uuid: None,
            profile: "1g.10gb".into(),
            gi_profile_id: 19,
            placement: Placement { start: 3, size: 1 },
            created: true,
        }),
        ..device('b', "small", "gpu-1-mig-1g10gb-19-3", "7a1b2c3d")
    };
    let time_sliced = DeviceRecord {
        share_id: Some("ts-1".into()),
        sharing: Sharing::TimeSlicing {
            interval: TimeSliceInterval::Long,
        },
        ..device('c', "shared", "gpu-2", "9e8d7c6b")
    };
    let mps = DeviceRecord {
        mig: Some(MigRecord {
            uuid: Some(MigUuid("MIG-5b4a3928-1111-2222-3333-444455556666".into())),
            profile: "3g.40gb".into(),
            gi_profile_id: 9,
            placement: Placement { start: 4, size: 4 },
            created: false,
        }),
        sharing: Sharing::Mps(MpsSettings {
            active_thread_percentage: Some(50),
            pinned_memory_limit: Some(1 << 30),
            per_device_pinned_memory_limit: BTreeMap::new(),
        }),
        ..device('d', "mps", "gpu-3", "0a0b0c0d")
    };
    use ClaimState::{PrepareCompleted, PrepareStarted};
    Checkpoint {
        boot_id: "6a3c1f0e-8d2b-4c57-9e61-0f4b2d7a9c13".into(),
        claims: BTreeMap::from([
            (
                uid('a'),
                entry(
                    PrepareCompleted,
                    "default",
                    "exclusive",
                    device('a', "gpu", "gpu-0", "2f6c0b3e"),
                ),
            ),
            (uid('b'), entry(PrepareStarted, "ml", "mig", mig)),
            (
                uid('c'),
                entry(PrepareCompleted, "default", "time-sliced", time_sliced),
            ),
            (uid('d'), entry(PrepareCompleted, "default", "mps", mps)),
        ]),
        mig_enabled: BTreeSet::new(),
    }
}

#[test]
fn every_version_ever_written_reads_back() {
    let want = fixture_state();
    for (name, bytes) in fixtures() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        std::fs::write(&path, bytes).unwrap();
        let (cp, outcome) = load_file(&path, &want.boot_id).unwrap();
        assert_eq!(outcome, LoadOutcome::Loaded { claims: 4 }, "{name}");
        assert_eq!(cp, want, "{name}");
    }
}

/// The oldest version that holds the state is written, in the spelling the builds since
/// `24aada3` read (the pods a rolling update replaces), whichever version was read.
#[test]
fn writes_the_oldest_version_the_previous_release_reads() {
    let current = include_str!("../../tests/data/checkpoint-v1.json").trim_end();
    assert_eq!(version_for(&fixture_state()), 1);
    for (name, bytes) in fixtures() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        std::fs::write(&path, bytes).unwrap();
        let (cp, _) = load_file(&path, &fixture_state().boot_id).unwrap();
        write_file(&path, &cp).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), current, "{name}");
    }
    // An exclusive-only state reads the same in both spellings: pods of every build read it.
    let mut exclusive = fixture_state();
    exclusive
        .claims
        .retain(|_, e| e.devices.iter().all(|d| d.sharing == Sharing::Exclusive));
    let text = String::from_utf8(encode(&exclusive).unwrap()).unwrap();
    assert!(!text.contains("strategy"), "{text}");
}

/// The pods a claim is reserved for are kept as an optional field of version 1: written only
/// when there are any (so a state without them is byte-for-byte what older builds write), read
/// back as written.
#[test]
fn the_pods_of_a_claim_round_trip_and_are_absent_when_none() {
    let mut cp = fixture_state();
    let without = String::from_utf8(encode(&cp).unwrap()).unwrap();
    assert!(!without.contains("\"pods\""), "{without}");
    let first = cp.claims.values_mut().next().unwrap();
    first.pods = vec![PodRef {
        name: "trainer".into(),
        uid: "0f5e2c1a-7b3d-4c2e-9a8b-1234567890ab".into(),
    }];
    let bytes = encode(&cp).unwrap();
    let text = String::from_utf8(bytes.clone()).unwrap();
    assert!(text.contains("\"pods\""), "{text}");
    assert_eq!(version_for(&cp), 1);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(FILE_NAME);
    std::fs::write(&path, &bytes).unwrap();
    let (read, _) = load_file(&path, &cp.boot_id).unwrap();
    assert_eq!(read, cp);
}

#[tokio::test]
async fn a_newer_version_is_refused_and_left_in_place() {
    let newer = "{\"version\": 4, \"bootId\": \"b\", \"claims\": {}, \"somethingNew\": 1}";
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(FILE_NAME);
    std::fs::write(&path, newer).unwrap();
    let Err(e) = Ledger::open(dir.path(), "b", None) else {
        panic!("a version 4 checkpoint was accepted");
    };
    assert!(matches!(e, Error::TooNew { found: 4, .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.contains(&path.display().to_string()), "{text}");
    assert!(
        text.contains("version 4") && text.contains("1..=3"),
        "{text}"
    );
    assert_eq!(std::fs::read_to_string(&path).unwrap(), newer);
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![FILE_NAME]);
}

/// A running instance that finds a newer pod's file refuses to go on from it, keeps its own
/// state and leaves the file alone.
#[tokio::test]
async fn a_newer_version_written_by_another_pod_is_refused_on_reload() {
    let dir = tempfile::tempdir().unwrap();
    let (l, _, _s) = open(dir.path(), "b");
    l.update(|c| {
        c.insert(
            ClaimUid::parse("a").unwrap(),
            entry(ClaimState::PrepareCompleted, &["gpu-0"]),
        )
    });
    l.flush().await.unwrap();
    let newer = "{\"version\": 4, \"bootId\": \"b\", \"claims\": {}}";
    std::fs::write(l.path(), newer).unwrap();
    let e = l.reload_if_changed().unwrap_err();
    assert!(matches!(e, Error::TooNew { found: 4, .. }), "{e:?}");
    assert!(l.read(|c| c.claims.contains_key(&ClaimUid::parse("a").unwrap())));
    assert_eq!(std::fs::read_to_string(l.path()).unwrap(), newer);
}

#[tokio::test]
async fn a_failed_write_names_the_file_and_reaches_every_flush() {
    let dir = tempfile::tempdir().unwrap();
    let (l, _, _s) = open(dir.path(), "b");
    // The checkpoint's name is taken by a directory: the rename fails.
    std::fs::create_dir(l.path()).unwrap();
    std::fs::write(l.path().join("x"), "").unwrap();
    let (a, b) = tokio::join!(l.flush(), l.flush());
    for e in [a.unwrap_err(), b.unwrap_err()] {
        let Error::Flush(inner) = &e else {
            panic!("{e:?}")
        };
        assert!(matches!(**inner, Error::Save(_)), "{inner:?}");
        let text = crate::report::chain(&e).to_string();
        assert!(
            text.starts_with("cannot save the checkpoint")
                && text.contains(&format!("cannot rename into place {}", l.path().display())),
            "{text}"
        );
    }
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![FILE_NAME], "no temp file is left");
}

/// A real full disk (a 64 KiB tmpfs; see `durable::testing`): the error names the file and
/// says so, the last good checkpoint stays, and no temp file is left.
#[tokio::test]
async fn a_full_disk_reads_no_space_left_with_the_checkpoint_path() {
    let Some(fs) = crate::durable::testing::TinyTmpfs::mount() else {
        return;
    };
    let (l, _, _s) = open(fs.dir.path(), "b");
    l.update(|c| {
        c.insert(
            ClaimUid::parse("first").unwrap(),
            entry(ClaimState::PrepareCompleted, &["gpu-0"]),
        )
    });
    l.flush().await.unwrap();
    let good = std::fs::read(l.path()).unwrap();
    // About 300 bytes a claim: 1,000 claims do not fit in 64 KiB.
    l.update(|c| {
        for i in 0..1000 {
            c.insert(
                ClaimUid::parse(format!("c{i}")).unwrap(),
                entry(ClaimState::PrepareStarted, &["gpu-1"]),
            );
        }
    });
    let e = l.flush().await.unwrap_err();
    let text = crate::report::chain(&e).to_string();
    assert!(
        text.contains(&format!(
            "cannot write {}: No space left on device",
            l.path().display()
        )),
        "{text}"
    );
    assert_eq!(std::fs::read(l.path()).unwrap(), good);
    let names: Vec<_> = std::fs::read_dir(fs.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![FILE_NAME]);
}

#[tokio::test(flavor = "current_thread")]
async fn concurrent_flushes_share_writes() {
    let dir = tempfile::tempdir().unwrap();
    let (l, _, _s) = open(dir.path(), "b");
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let l = l.clone();
            tokio::spawn(async move {
                l.update(|c| {
                    c.insert(
                        ClaimUid::parse(format!("c{i}")).unwrap(),
                        entry(ClaimState::PrepareStarted, &["gpu-0"]),
                    )
                });
                l.flush().await
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert!(l.writes() < 32, "{} writes for 32 flushes", l.writes());
    let (cp, _) = load_file(&dir.path().join(FILE_NAME), "b").unwrap();
    assert_eq!(cp.claims.len(), 32);
}

#[tokio::test]
async fn flush_after_shutdown_fails_clearly_and_pending_work_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let (l, _, stop) = open(dir.path(), "b");
    l.update(|c| {
        c.insert(
            ClaimUid::parse("a").unwrap(),
            entry(ClaimState::PrepareStarted, &["gpu-0"]),
        )
    });
    stop.cancel();
    // The writer may take the request before or after it sees the cancellation; either way
    // the change is written or the caller is told.
    match l.flush().await {
        Ok(()) => {
            let (cp, _) = load_file(&dir.path().join(FILE_NAME), "b").unwrap();
            assert_eq!(cp.claims.len(), 1);
        }
        Err(e) => assert!(matches!(e, Error::WriterGone), "{e}"),
    }
    tokio::task::yield_now().await;
}

#[tokio::test]
async fn reload_sees_another_writer() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _, _s) = open(dir.path(), "b");
    let (b, _, _s2) = open(dir.path(), "b");
    assert!(!a.reload_if_changed().unwrap());
    b.update(|c| {
        c.insert(
            ClaimUid::parse("x").unwrap(),
            entry(ClaimState::PrepareCompleted, &["gpu-3"]),
        )
    });
    b.flush().await.unwrap();
    assert!(a.reload_if_changed().unwrap());
    assert!(a.read(|c| c.claims.contains_key(&ClaimUid::parse("x").unwrap())));
    assert!(!a.reload_if_changed().unwrap());
}

fn arb_sharing() -> impl Strategy<Value = Sharing> {
    use crate::sharing::{MpsSettings, TimeSliceInterval};
    prop_oneof![
        Just(Sharing::Exclusive),
        prop_oneof![
            Just(TimeSliceInterval::Default),
            Just(TimeSliceInterval::Short),
            Just(TimeSliceInterval::Medium),
            Just(TimeSliceInterval::Long)
        ]
        .prop_map(|interval| Sharing::TimeSlicing { interval }),
        (
            proptest::option::of(0u32..=100),
            proptest::option::of(any::<u64>()),
            proptest::collection::btree_map("[0-9]|GPU-[a-f0-9]{4}", any::<u64>(), 0..3),
        )
            .prop_map(|(a, p, per)| Sharing::Mps(MpsSettings {
                active_thread_percentage: a,
                pinned_memory_limit: p,
                per_device_pinned_memory_limit: per,
            })),
    ]
}

fn arb_device() -> impl Strategy<Value = DeviceRecord> {
    (
        proptest::collection::vec("[a-z]{1,8}", 0..3),
        (0u32..64).prop_map(DeviceName::gpu),
        proptest::option::of("[a-z0-9]{1,8}"),
        any::<bool>(),
        proptest::option::of((
            proptest::option::of("MIG-[a-f0-9]{8}"),
            0u32..20,
            0u32..8,
            1u32..8,
            any::<bool>(),
        )),
        arb_sharing(),
        proptest::option::of((
            any::<u64>(),
            proptest::option::of(any::<u32>()),
            proptest::option::of((any::<u32>(), any::<u32>())),
            proptest::option::of(any::<u64>()),
        )),
    )
        .prop_map(
            |(requests, device, share_id, admin, mig, sharing, consumed)| DeviceRecord {
                requests,
                pool: "node-a".into(),
                cdi_ids: vec![format!("k8s.gpu.nvidia.com/claim=u-{device}")],
                device,
                share_id,
                admin_access: admin,
                gpu: GpuUuid("GPU-0000".into()),
                mig: mig.map(|(uuid, gi, start, size, created)| MigRecord {
                    uuid: uuid.map(MigUuid),
                    profile: "1g.10gb".into(),
                    gi_profile_id: gi,
                    placement: Placement { start, size },
                    created,
                }),
                consumed: consumed.map(|(memory, multiprocessors, shares, burst_limit)| Consumed {
                    memory,
                    multiprocessors,
                    shares: shares.map(|(count, of)| Shares { count, of }),
                    burst_limit,
                }),
                sharing,
            },
        )
}

proptest! {
    // Each case fsyncs twice; 64 cases keep the suite quick.
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn checkpoint_round_trips(
        claims in proptest::collection::btree_map(
            "[a-f0-9]([a-f0-9-]{0,34}[a-f0-9])?",
            (any::<bool>(), "[a-z0-9-]{1,20}", proptest::collection::vec(arb_device(), 0..4)),
            0..6,
        ),
        boot in "[a-f0-9-]{1,36}",
    ) {
        let cp = Checkpoint {
            boot_id: boot.clone(),
            claims: claims
                .into_iter()
                .map(|(uid, (done, name, devices))| {
                    (ClaimUid::parse(uid).unwrap(), ClaimEntry {
                        state: if done { ClaimState::PrepareCompleted } else { ClaimState::PrepareStarted },
                        namespace: "default".into(),
                        name,
                        devices,
                        pods: vec![],
                        user: None,
                        trust_label: None,
                    })
                })
                .collect(),
            mig_enabled: BTreeSet::new(),
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        write_file(&path, &cp).unwrap();
        let (back, outcome) = load_file(&path, &boot).unwrap();
        prop_assert_eq!(outcome, LoadOutcome::Loaded { claims: cp.claims.len() });
        prop_assert_eq!(&back, &cp);
        // Byte-stable: writing what was read gives the same file.
        let first = std::fs::read(&path).unwrap();
        write_file(&path, &back).unwrap();
        prop_assert_eq!(first, std::fs::read(&path).unwrap());
    }
}

/// A share of a GPU needs version 3 (a version-1 reader would drop what it consumes and count
/// the GPU free, a version-2 reader would miss its `compute`); without shares the file stays
/// version 1, which older pods read.
#[test]
fn shares_are_written_as_version_3_and_read_back() {
    let mut cp = fixture_state();
    assert_eq!(version_for(&cp), 1);
    let v1: serde_json::Value = serde_json::from_slice(&encode(&cp).unwrap()).unwrap();
    assert_eq!(v1["version"], 1);
    let entry = cp.claims.values_mut().next().unwrap();
    entry.devices[0].share_id = Some("6f1c2d3e-0000-4000-8000-000000000001".into());
    entry.devices[0].consumed = Some(Consumed {
        memory: 24 << 30,
        multiprocessors: None,
        shares: None,
        burst_limit: None,
    });
    assert_eq!(version_for(&cp), 3);
    let bytes = encode(&cp).unwrap();
    let v3: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v3["version"], 3);
    let device = &v3["claims"].as_object().unwrap().values().next().unwrap()["devices"][0];
    assert_eq!(
        device["consumedCapacity"],
        serde_json::json!({"memory": 24u64 << 30})
    );
    assert_eq!(decode(&bytes).ok(), Some(cp.clone()));
    // Asked multiprocessors are kept.
    cp.claims.values_mut().next().unwrap().devices[0].consumed = Some(Consumed {
        memory: 24 << 30,
        multiprocessors: Some(33),
        shares: None,
        burst_limit: None,
    });
    let bytes = encode(&cp).unwrap();
    let v3: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    let device = &v3["claims"].as_object().unwrap().values().next().unwrap()["devices"][0];
    assert_eq!(
        device["consumedCapacity"],
        serde_json::json!({"memory": 24u64 << 30, "multiprocessors": 33})
    );
    assert_eq!(decode(&bytes).ok(), Some(cp.clone()));
    // An integer-mode share keeps its part (`--consumable-shares=N`); a reader that predates it
    // reads the rest.
    cp.claims.values_mut().next().unwrap().devices[0].consumed = Some(Consumed {
        memory: 0,
        multiprocessors: None,
        shares: Some(Shares { count: 1, of: 4 }),
        burst_limit: None,
    });
    let bytes = encode(&cp).unwrap();
    let v3: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v3["version"], 3);
    let device = &v3["claims"].as_object().unwrap().values().next().unwrap()["devices"][0];
    assert_eq!(
        device["consumedCapacity"],
        serde_json::json!({"memory": 0, "shares": {"count": 1, "of": 4}})
    );
    assert_eq!(decode(&bytes).ok(), Some(cp.clone()));
    // A burstable share keeps its burst limit, which the spec rewritten at start needs; a
    // record without one (any build before it) reads as none.
    cp.claims.values_mut().next().unwrap().devices[0].consumed = Some(Consumed {
        memory: 24 << 30,
        multiprocessors: None,
        shares: None,
        burst_limit: Some(40 << 30),
    });
    let bytes = encode(&cp).unwrap();
    let v3: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(v3["version"], 3);
    let device = &v3["claims"].as_object().unwrap().values().next().unwrap()["devices"][0];
    assert_eq!(
        device["consumedCapacity"],
        serde_json::json!({"memory": 24u64 << 30, "burstLimit": 40u64 << 30})
    );
    assert_eq!(decode(&bytes).ok(), Some(cp.clone()));
    let mut older = v3.clone();
    let (_, entry) = older["claims"]
        .as_object_mut()
        .unwrap()
        .iter_mut()
        .next()
        .unwrap();
    entry["devices"][0]["consumedCapacity"]
        .as_object_mut()
        .unwrap()
        .remove("burstLimit");
    let older = serde_json::to_vec(&older).unwrap();
    let d = decode(&older)
        .unwrap_or_else(|_| panic!("a record without a burst limit does not read"))
        .claims
        .into_values()
        .next()
        .unwrap()
        .devices;
    assert_eq!(d[0].consumed.unwrap().burst_limit, None);
    assert_eq!(d[0].consumed.unwrap().memory, 24 << 30);
}

/// A version-2 checkpoint (a share of the twin `gpu-<minor>-shared`, its `compute` counted)
/// still reads: the share keeps its memory, `compute` is dropped, and it is written back as
/// version 3.
#[test]
fn a_version_2_share_reads_without_its_compute() {
    let v2 = r#"{
  "version": 2,
  "bootId": "b",
  "claims": {
    "6f1c2d3e-0000-4000-8000-0000000000aa": {
      "state": "PrepareCompleted",
      "namespace": "default",
      "name": "notebook",
      "devices": [
        {
          "requests": ["gpu"],
          "pool": "node-a",
          "device": "gpu-0-shared",
          "cdiIds": ["k8s.gpu.nvidia.com/claim=6f1c2d3e-0000-4000-8000-0000000000aa-gpu-0-shared"],
          "shareId": "5f0e0004-0000-4000-8000-000000000001",
          "gpu": "GPU-00000000-0000-0000-0000-000000000000",
          "consumedCapacity": {"memory": 25769803776, "compute": 25},
          "sharing": {"strategy": "mps", "activeThreadPercentage": 25, "pinnedMemoryLimit": 25769803776, "perDevicePinnedMemoryLimit": {}}
        }
      ]
    }
  }
}"#;
    let cp = decode(v2.as_bytes()).unwrap_or_else(|_| panic!("version 2 does not read"));
    let d = &cp.claims.values().next().unwrap().devices[0];
    assert_eq!(d.device, "gpu-0-shared");
    assert_eq!(
        d.consumed,
        Some(Consumed {
            memory: 24 << 30,
            multiprocessors: None,
            shares: None,
            burst_limit: None,
        })
    );
    let again: serde_json::Value = serde_json::from_slice(&encode(&cp).unwrap()).unwrap();
    assert_eq!(again["version"], 3);
    let device = &again["claims"]
        .as_object()
        .unwrap()
        .values()
        .next()
        .unwrap()["devices"][0];
    assert_eq!(
        device["consumedCapacity"],
        serde_json::json!({"memory": 24u64 << 30})
    );
}

/// The GPUs whose MIG mode nvdra turned on (dynamic MIG) are kept at the top of the file in
/// every version, absent while there are none (so the files of every version before read and
/// write as they did), and read back from a file that has them.
#[test]
fn gpus_whose_mig_mode_nvdra_turned_on_are_kept_without_a_new_version() {
    let mut cp = fixture_state();
    let before = encode(&cp).unwrap();
    assert!(
        !String::from_utf8_lossy(&before).contains("migEnabled"),
        "absent while empty"
    );
    cp.mig_enabled.insert(GpuUuid("GPU-1".into()));
    let bytes = encode(&cp).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(
        v["version"], 1,
        "no new version: older builds ignore the field"
    );
    assert_eq!(v["migEnabled"], serde_json::json!(["GPU-1"]));
    let back = decode(&bytes).unwrap_or_else(|_| panic!("does not read back"));
    assert_eq!(back, cp);
    // A file of a build before it reads as none.
    let old = decode(&before).unwrap_or_else(|_| panic!("does not read back"));
    assert!(old.mig_enabled.is_empty());
}
