use super::*;
use crate::computedomain::api::{CliqueDaemon, ComputeDomainSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::json;

fn domain(num_nodes: i64) -> ComputeDomain {
    let mut cd = ComputeDomain::new(
        "default",
        "d",
        ComputeDomainSpec {
            num_nodes,
            ..Default::default()
        },
    );
    cd.metadata.uid = Some("u1".into());
    cd
}

fn clique(name: &str, daemons: &[(&str, &str, i64, &str)]) -> ComputeDomainClique {
    let uid = name.split_once('.').unwrap().0;
    ComputeDomainClique {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([(
                DOMAIN_LABEL.to_string(),
                uid.to_string(),
            )])),
            ..Default::default()
        },
        daemons: daemons
            .iter()
            .map(|(node, clique, index, status)| CliqueDaemon {
                node_name: node.to_string(),
                ip_address: format!("10.0.0.{index}"),
                clique_id: clique.to_string(),
                index: *index,
                status: status.to_string(),
            })
            .collect(),
        ..Default::default()
    }
}

fn pod(node: &str, annotations: &[(&str, &str)], status: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": format!("computedomain-daemon-u1-{node}"),
                     "annotations": annotations.iter().map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect::<BTreeMap<_, _>>()},
        "spec": {"nodeName": node, "containers": []},
        "status": status,
    }))
    .unwrap()
}

fn none() -> BTreeMap<String, String> {
    BTreeMap::new()
}

fn ready(s: &ComputeDomainStatus) -> Condition {
    let cd = ComputeDomain {
        status: Some(s.clone()),
        ..Default::default()
    };
    conditions_of(&cd)
        .into_iter()
        .find(|c| c.type_ == READY)
        .unwrap()
}

#[test]
fn nodes_come_from_the_domains_cliques_only() {
    let cliques = [
        clique("u1.c.2", &[("n3", "c.2", 0, "Ready")]),
        clique("u1.c.1", &[("n2", "c.1", 1, "Ready"), ("n1", "c.1", 0, "")]),
        // Another domain's clique, whose UID shares a prefix.
        clique("u10.c.1", &[("n9", "c.1", 0, "Ready")]),
        // A per-clique daemon's object, no domain's.
        ComputeDomainClique {
            metadata: ObjectMeta {
                name: Some("fabric.c.1".into()),
                ..Default::default()
            },
            daemons: clique("x.c.1", &[("n8", "c.1", 0, "Ready")]).daemons,
            ..Default::default()
        },
    ];
    let nodes = nodes_from_cliques("u1", &cliques);
    let names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["n1", "n2", "n3"]);
    // An entry without a status is NotReady, the CRD's default.
    assert_eq!(nodes[0].status, STATUS_NOT_READY);
    assert_eq!(nodes[1].ip_address, "10.0.0.1");
    assert_eq!(nodes[1].index, 1);
}

#[test]
fn ready_follows_nvidias_rule() {
    let node = |status: &str| DomainNode {
        status: status.into(),
        ..Default::default()
    };
    assert_eq!(overall(2, &[node("Ready")]), STATUS_NOT_READY);
    assert_eq!(overall(2, &[node("Ready"), node("Ready")]), STATUS_READY);
    assert_eq!(
        overall(1, &[node("Ready"), node("NotReady")]),
        STATUS_NOT_READY
    );
    // numNodes 0: no number to wait for.
    assert_eq!(overall(0, &[]), STATUS_READY);
}

#[test]
fn a_daemon_that_is_not_ready_names_its_node_and_reason() {
    let now = Timestamp::now();
    let cd = domain(2);
    let cliques = [clique(
        "u1.c.1",
        &[("n1", "c.1", 0, "Ready"), ("n2", "c.1", 1, "NotReady")],
    )];
    let pods = [report(&pod(
        "n2",
        &[(
            DAEMON_REASON_ANNOTATION,
            "IMEX daemon: [ERROR] connection to 10.0.0.0 refused",
        )],
        json!({"phase": "Running"}),
    ))];
    let s = per_node(&cd, &cliques, &pods, &none(), now);
    assert_eq!(s.status, STATUS_NOT_READY);
    assert_eq!(s.nodes.len(), 2);
    let c = ready(&s);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "DaemonNotReady")
    );
    assert_eq!(
        c.message,
        "n2: IMEX daemon: [ERROR] connection to 10.0.0.0 refused"
    );

    // Without a line from the daemon, the pod's own state says why.
    let crashing = pod(
        "n2",
        &[],
        json!({"phase": "Running", "containerStatuses": [{
            "name": "compute-domain-daemon", "image": "i", "imageID": "", "ready": false,
            "restartCount": 4,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
            "lastState": {"terminated": {"exitCode": 1,
                "message": "starting\nnvidia-imex: cannot open /etc/nvidia-imex/nodes.cfg\n"}},
        }]}),
    );
    let s = per_node(&cd, &cliques, &[report(&crashing)], &none(), now);
    assert_eq!(
        ready(&s).message,
        "n2: CrashLoopBackOff: back-off 40s; last exit 1: nvidia-imex: cannot open \
         /etc/nvidia-imex/nodes.cfg"
    );
}

#[test]
fn waiting_for_nodes_names_the_pods_that_have_not_registered() {
    let now = Timestamp::now();
    let cd = domain(3);
    let cliques = [clique("u1.c.1", &[("n1", "c.1", 0, "Ready")])];
    let pending = pod(
        "",
        &[],
        json!({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
               "message": "0/4 nodes are available: 4 Insufficient memory."}]}),
    );
    let s = per_node(&cd, &cliques, &[report(&pending)], &none(), now);
    let c = ready(&s);
    assert_eq!(c.reason, "WaitingForNodes");
    assert!(
        c.message.starts_with("1 of 3 nodes have registered"),
        "{}",
        c.message
    );
    assert!(
        c.message.ends_with(
            "pod computedomain-daemon-u1-: Pending: 0/4 nodes are available: 4 Insufficient memory."
        ),
        "{}",
        c.message
    );
}

#[test]
fn the_peer_matrix_names_who_does_not_see_whom() {
    let now = Timestamp::now();
    let cd = domain(3);
    let cliques = [
        clique(
            "u1.c.1",
            &[
                ("n1", "c.1", 0, "Ready"),
                ("n2", "c.1", 1, "Ready"),
                ("n3", "c.1", 2, "NotReady"),
            ],
        ),
        clique("u1.c.2", &[("m1", "c.2", 0, "Ready")]),
    ];
    let peers =
        |node: &str, seen: &str| report(&pod(node, &[(DAEMON_PEERS_ANNOTATION, seen)], json!({})));
    // n3 sees nobody, n1 misses n3; n2 reports nothing; m1 is alone in its clique.
    let pods = [peers("n1", "n2"), peers("n3", ""), peers("m1", "")];
    let s = per_node(&cd, &cliques, &pods, &none(), now);
    let cd2 = ComputeDomain {
        status: Some(s),
        ..Default::default()
    };
    let c = conditions_of(&cd2)
        .into_iter()
        .find(|c| c.type_ == PEERS)
        .unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "PeersMissing")
    );
    assert!(
        c.message
            .starts_with("n1 does not see n3; n3 does not see n1, n2 (check the IMEX port"),
        "{}",
        c.message
    );
    // All connected.
    let pods = [
        peers("n1", "n2,n3"),
        peers("n2", "n1, n3"),
        peers("n3", "n1,n2"),
    ];
    let cd3 = ComputeDomain {
        status: Some(per_node(&cd, &cliques, &pods, &none(), now)),
        ..Default::default()
    };
    let c = conditions_of(&cd3)
        .into_iter()
        .find(|c| c.type_ == PEERS)
        .unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "AllPeersConnected")
    );
    // No daemon said: no condition.
    let s = per_node(&cd, &cliques, &[], &none(), now);
    assert!(!serde_json::to_string(&s).unwrap().contains(PEERS));
}

#[test]
fn a_condition_keeps_its_transition_time_while_its_status_holds() {
    let t0 = Timestamp::from_second(1_000).unwrap();
    let t1 = Timestamp::from_second(2_000).unwrap();
    let mut cd = domain(2);
    let one = [clique("u1.c.1", &[("n1", "c.1", 0, "Ready")])];
    let two = [clique(
        "u1.c.1",
        &[("n1", "c.1", 0, "Ready"), ("n2", "c.1", 1, "NotReady")],
    )];
    cd.status = Some(per_node(&cd, &one, &[], &none(), t0));
    // Still NotReady (another reason): the time stays.
    let s = per_node(&cd, &two, &[], &none(), t1);
    assert_eq!(ready(&s).reason, "DaemonNotReady");
    assert_eq!(ready(&s).last_transition_time, Time(t0));
    // Ready: the time moves.
    let all = [clique(
        "u1.c.1",
        &[("n1", "c.1", 0, "Ready"), ("n2", "c.1", 1, "Ready")],
    )];
    cd.status = Some(s);
    let s = per_node(&cd, &all, &[], &none(), t1);
    assert_eq!(s.status, STATUS_READY);
    assert_eq!(ready(&s).last_transition_time, Time(t1));
    // Unchanged input, unchanged status: nothing to write.
    cd.status = Some(s.clone());
    assert_eq!(per_node(&cd, &all, &[], &none(), Timestamp::now()), s);
}

#[test]
fn a_clique_domain_says_where_its_channel_is() {
    let now = Timestamp::now();
    let cd = domain(4);
    let none = CliqueDaemons::default();
    let s = clique_mode(&cd, "ch", &ClaimState::Missing, &none, now);
    assert_eq!(s.status, STATUS_NOT_READY);
    let s = clique_mode(&cd, "ch", &ClaimState::Pending, &none, now);
    assert_eq!(
        (s.status.as_str(), ready(&s).reason.as_str()),
        (STATUS_READY, "ChannelNotAllocated")
    );
    // Allocated, and no per-clique daemon has registered in the clique.
    let s = clique_mode(&cd, "ch", &allocated(), &none, now);
    assert_eq!(
        (s.status.as_str(), ready(&s).reason.as_str()),
        (STATUS_NOT_READY, "WaitingForNodes")
    );
    let message = ready(&s).message;
    assert!(
        message.starts_with("channel-7 of pool clique-abc.1: 0 of the 4 nodes"),
        "{message}"
    );
    assert!(
        message.contains("DaemonSet computedomain-daemon-fabric.abc.1"),
        "{message}"
    );
}

fn allocated() -> ClaimState {
    ClaimState::Allocated {
        pool: "clique-abc.1".into(),
        device: "channel-7".into(),
    }
}

/// The clique's per-clique daemons: n1 and n3 Ready, n2 NotReady with its IMEX line (an event
/// on `fabric.abc.1`), n4's pod pending.
fn fabric_daemons() -> CliqueDaemons {
    let mut object = clique(
        "fabric.abc.1",
        &[
            ("n2", "abc.1", 1, "NotReady"),
            ("n1", "abc.1", 0, "Ready"),
            ("n3", "abc.1", 2, "Ready"),
        ],
    );
    object.metadata.labels = None;
    let mut pending = pod("n4", &[], json!({"phase": "Pending"}));
    pending.metadata.name = Some("computedomain-daemon-fabric.abc.1-x4".into());
    CliqueDaemons {
        object: Some(object),
        pods: vec![
            report(&pod("n1", &[], json!({}))),
            report(&pod("n2", &[], json!({}))),
            report(&pending),
        ],
        reasons: BTreeMap::from([(
            "n2".to_string(),
            "IMEX answered UNAVAILABLE; last error: bind failed".to_string(),
        )]),
    }
}

#[test]
fn an_allocated_clique_domain_follows_its_cliques_daemons() {
    let now = Timestamp::now();
    let daemons = fabric_daemons();
    // Two ready daemons are enough for a domain of two nodes; the one that is not is named.
    let s = clique_mode(&domain(2), "ch", &allocated(), &daemons, now);
    assert_eq!(
        (s.status.as_str(), ready(&s).reason.as_str()),
        (STATUS_READY, "CliqueReady")
    );
    assert_eq!(
        ready(&s).message,
        "channel-7 of pool clique-abc.1: 2 of the 3 nodes of clique abc.1 have a ready IMEX \
         daemon (the domain needs 2); not ready: n2: IMEX answered UNAVAILABLE; last error: bind \
         failed"
    );
    let names: Vec<_> = s.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["n1", "n2", "n3"]);
    // Three are not.
    let s = clique_mode(&domain(3), "ch", &allocated(), &daemons, now);
    assert_eq!(
        (s.status.as_str(), ready(&s).reason.as_str()),
        (STATUS_NOT_READY, "DaemonNotReady")
    );
    assert!(
        ready(&s)
            .message
            .ends_with("in clique abc.1; n2: IMEX answered UNAVAILABLE; last error: bind failed"),
        "{}",
        ready(&s).message
    );
    // A domain of numNodes 0 still needs one ready daemon: no channel of the clique can be
    // prepared without one.
    let mut down = fabric_daemons();
    for d in &mut down.object.as_mut().unwrap().daemons {
        d.status = "NotReady".into();
    }
    let s = clique_mode(&domain(0), "ch", &allocated(), &down, now);
    assert_eq!(s.status, STATUS_NOT_READY);
    // Fewer entries than needed, all ready: the pods that have not registered, with why.
    let mut few = fabric_daemons();
    few.object
        .as_mut()
        .unwrap()
        .daemons
        .retain(|d| d.node_name == "n1");
    let s = clique_mode(&domain(2), "ch", &allocated(), &few, now);
    assert_eq!(ready(&s).reason, "WaitingForNodes");
    assert!(
        ready(&s)
            .message
            .contains("n4 (pod computedomain-daemon-fabric.abc.1-x4): Pending"),
        "{}",
        ready(&s).message
    );
}

#[test]
fn the_daemons_events_on_their_clique_are_the_reasons() {
    let event = |clique: &str, node: &str, at: i64, message: &str| -> Event {
        let type_ = if message.ends_with("ready") {
            "Normal"
        } else {
            "Warning"
        };
        serde_json::from_value(json!({
            "type": type_,
            "metadata": {"name": format!("{clique}.{at}"), "namespace": "nvdra"},
            "involvedObject": {"kind": "ComputeDomainClique", "name": clique,
                               "apiVersion": "resource.nvidia.com/v1beta1"},
            "source": {"component": "nvdra-compute-domain-daemon", "host": node},
            "reason": "NotReady",
            "message": message,
            "lastTimestamp": Timestamp::from_second(at).unwrap().to_string(),
        }))
        .unwrap()
    };
    let events = [
        event("u1.c.1", "n2", 20, "node n2: IMEX is ready"),
        event(
            "u1.c.1",
            "n2",
            30,
            "node n2: nvidia-imex-ctl -q: UNAVAILABLE; last error: [ERROR] bind failed",
        ),
        event("u1.c.1", "n2", 10, "node n2: old"),
        // Another domain's clique.
        event("u10.c.1", "n3", 40, "node n3: not ours"),
        // Recovered: no reason.
        event("u1.c.1", "n1", 10, "node n1: failing"),
        event("u1.c.1", "n1", 11, "node n1: IMEX is ready"),
    ];
    let reasons = event_reasons("u1", &events);
    assert_eq!(
        reasons,
        BTreeMap::from([(
            "n2".to_string(),
            "nvidia-imex-ctl -q: UNAVAILABLE; last error: [ERROR] bind failed".to_string()
        )])
    );
    // They come before the pod's word.
    let cd = domain(2);
    let cliques = [clique(
        "u1.c.1",
        &[("n1", "c.1", 0, "Ready"), ("n2", "c.1", 1, "NotReady")],
    )];
    let pods = [report(&pod(
        "n2",
        &[(DAEMON_REASON_ANNOTATION, "stale")],
        json!({}),
    ))];
    let s = per_node(&cd, &cliques, &pods, &reasons, Timestamp::now());
    assert_eq!(
        ready(&s).message,
        "n2: nvidia-imex-ctl -q: UNAVAILABLE; last error: [ERROR] bind failed"
    );
}
