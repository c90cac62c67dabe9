use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;

use super::clique::{self, Full, Me};
use super::files;
use super::imex::{self, Readiness};
use super::*;
use crate::computedomain::api::CliqueDaemon;

fn me(node: &str, ip: &str) -> Me {
    Me {
        node_name: node.into(),
        ip: ip.into(),
        clique_id: "c.1".into(),
        max_nodes: 4,
    }
}

fn entry(node: &str, ip: &str, index: i64) -> CliqueDaemon {
    CliqueDaemon {
        node_name: node.into(),
        ip_address: ip.into(),
        clique_id: "c.1".into(),
        index,
        status: STATUS_READY.into(),
    }
}

#[test]
fn a_new_entry_takes_the_lowest_free_index_and_starts_not_ready() {
    let mut d = vec![entry("a", "10.0.0.1", 0), entry("c", "10.0.0.3", 2)];
    assert_eq!(clique::upsert(&mut d, &me("b", "10.0.0.2")), Ok(true));
    let b = d.iter().find(|e| e.node_name == "b").unwrap();
    assert_eq!((b.index, b.status.as_str()), (1, STATUS_NOT_READY));
    // Again: nothing to change.
    assert_eq!(clique::upsert(&mut d, &me("b", "10.0.0.2")), Ok(false));
}

#[test]
fn a_restarted_pod_keeps_its_index_with_its_new_ip() {
    let mut d = vec![entry("a", "10.0.0.1", 0), entry("b", "10.0.0.2", 3)];
    assert_eq!(clique::upsert(&mut d, &me("b", "10.0.0.9")), Ok(true));
    assert_eq!(d[1].index, 3);
    assert_eq!(d[1].ip_address, "10.0.0.9");
}

#[test]
fn another_nodes_entry_with_this_pods_ip_is_stale_and_dropped() {
    // Node x's pod is gone and its IP went to this pod: one IP must not answer two names.
    let mut d = vec![entry("x", "10.0.0.7", 0)];
    assert_eq!(clique::upsert(&mut d, &me("b", "10.0.0.7")), Ok(true));
    assert_eq!(d.len(), 1);
    assert_eq!((d[0].node_name.as_str(), d[0].index), ("b", 0));
}

#[test]
fn a_full_clique_names_the_limit() {
    let mut d: Vec<_> = (0..4)
        .map(|i| entry(&format!("n{i}"), &format!("10.0.0.{i}"), i))
        .collect();
    let e = clique::upsert(&mut d, &me("new", "10.0.1.1")).unwrap_err();
    assert_eq!(e, Full { max: 4 });
    assert!(e.to_string().contains("--max-nodes-per-imex-domain"), "{e}");
}

#[test]
fn removal_spares_a_successor_pods_entry() {
    let mut d = vec![entry("b", "10.0.0.9", 1)];
    assert!(!clique::remove(&mut d, &me("b", "10.0.0.2")));
    assert!(clique::remove(&mut d, &me("b", "10.0.0.9")));
    assert!(d.is_empty());
}

#[test]
fn status_changes_only_this_nodes_entry() {
    let mut d = vec![entry("a", "10.0.0.1", 0), entry("b", "10.0.0.2", 1)];
    assert!(clique::set_status(&mut d, "b", STATUS_NOT_READY));
    assert!(!clique::set_status(&mut d, "b", STATUS_NOT_READY));
    assert!(!clique::set_status(&mut d, "zz", STATUS_NOT_READY));
    assert_eq!(d[0].status, STATUS_READY);
}

#[test]
fn peer_names_keep_only_this_clique_below_the_maximum() {
    let mut other = entry("o", "10.9.9.9", 1);
    other.clique_id = "c.2".into();
    let d = vec![entry("a", "10.0.0.1", 0), other, entry("z", "10.0.0.5", 7)];
    let names = clique::names(&d, "c.1", 4);
    assert_eq!(names, BTreeMap::from([(0, "10.0.0.1".to_string())]));
}

#[test]
fn the_hosts_block_is_replaced_and_other_lines_kept() {
    let existing = "127.0.0.1\tlocalhost\n10.1.1.1\tpod-a\n# nvdra compute-domain daemon: IMEX peers\n\
                    10.0.0.1\tcompute-domain-daemon-0000\n";
    let peers = BTreeMap::from([(1, "10.0.0.2".to_string()), (3, "10.0.0.4".to_string())]);
    let out = files::hosts_file(existing, &peers);
    assert_eq!(
        out,
        "127.0.0.1\tlocalhost\n10.1.1.1\tpod-a\n# nvdra compute-domain daemon: IMEX peers\n\
         10.0.0.2\tcompute-domain-daemon-0001\n10.0.0.4\tcompute-domain-daemon-0003\n"
    );
    assert_eq!(
        files::hosts_file(&out, &peers),
        out,
        "rewriting it changes nothing"
    );
}

#[test]
fn the_hosts_file_is_written_only_when_it_changes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("hosts");
    std::fs::write(&path, "127.0.0.1 localhost\n").unwrap();
    let peers = BTreeMap::from([(0, "10.0.0.1".to_string())]);
    assert!(files::write_hosts(&path, &peers).unwrap());
    assert!(!files::write_hosts(&path, &peers).unwrap());
    assert!(
        std::fs::read_to_string(&path)
            .unwrap()
            .starts_with("127.0.0.1 localhost\n")
    );
}

#[test]
fn nodes_config_lists_every_name_of_the_domain() {
    assert_eq!(
        files::nodes_config(3),
        "compute-domain-daemon-0000\ncompute-domain-daemon-0001\ncompute-domain-daemon-0002\n"
    );
}

#[test]
fn nvidias_template_fields_are_filled_in() {
    let t = "IMEX_NODE_CONFIG_FILE={{ .IMEXDaemonNodesConfigPath }}\nIMEX_CMD_BIND_INTERFACE_IP={{.IMEXCmdBindInterfaceIP}}\nX=1\n";
    assert_eq!(
        files::render(t, "10.0.0.1", "/imexd/nodes.cfg").unwrap(),
        "IMEX_NODE_CONFIG_FILE=/imexd/nodes.cfg\nIMEX_CMD_BIND_INTERFACE_IP=10.0.0.1\nX=1\n"
    );
    let e = files::render("A={{ .Other }}", "ip", "p").unwrap_err();
    assert!(e.to_string().contains(".Other"), "{e}");
    let d = files::render(files::DEFAULT_TEMPLATE, "10.0.0.1", "/n").unwrap();
    assert!(
        d.contains("IMEX_CMD_BIND_INTERFACE_IP=10.0.0.1\n")
            && d.contains("IMEX_NODE_CONFIG_FILE=/n\n")
    );
}

fn output(
    code: i32,
    stdout: &str,
    stderr: &str,
) -> Result<crate::child::Output, crate::child::Error> {
    Ok(crate::child::Output {
        status: std::process::ExitStatus::from_raw(code << 8),
        stdout: stdout.as_bytes().to_vec(),
        stderr: stderr.as_bytes().to_vec(),
    })
}

#[test]
fn only_ready_with_a_zero_exit_is_ready() {
    assert_eq!(imex::readiness(output(0, "READY\n", "")), Readiness::Ready);
    assert_eq!(
        imex::readiness(output(0, "WAITING_FOR_PEERS\n", "")),
        Readiness::NotReady("nvidia-imex-ctl -q: WAITING_FOR_PEERS".into())
    );
    assert_eq!(
        imex::readiness(output(1, "READY\n", "")),
        Readiness::NotReady("nvidia-imex-ctl -q: READY".into())
    );
    let Readiness::NotReady(r) = imex::readiness(output(2, "", "cannot read cfg")) else {
        panic!()
    };
    assert!(r.contains("cannot read cfg"), "{r}");
}

#[test]
fn error_lines_are_told_from_info_lines() {
    assert!(imex::is_error_line(
        "[Dec 05 2026 23:42:17] [ERROR] [tid 1] cannot connect"
    ));
    assert!(imex::is_error_line("[CRITICAL] GPU init failed"));
    assert!(!imex::is_error_line(
        "[Dec 05 2026] [INFO] [tid 1] connected to node n1"
    ));
}

#[test]
fn a_fabric_in_registration_is_a_reason_naming_the_gpu() {
    let mut inv = crate::inventory::sim::SimBackend::from_profile("dgx-h100", "n")
        .unwrap()
        .snapshot()
        .unwrap();
    inv.gpus.truncate(2);
    let f = crate::inventory::Fabric {
        cluster_uuid: crate::inventory::ClusterUuid::parse("6c1f0a3e-0000-4000-8000-000000000001")
            .unwrap(),
        clique_id: 1,
    };
    inv.gpus[0].fabric = Some(f.clone());
    let clique = f.to_string();
    let r = fabric_reason(&inv, &clique).unwrap();
    assert!(
        r.contains("GPU 1 has not completed its fabric registration"),
        "{r}"
    );
    assert!(!r.contains("GPU 0"), "{r}");
    inv.gpus[1].fabric = Some(f);
    assert_eq!(fabric_reason(&inv, &clique), None);
}

fn args(extra: &[&str]) -> Args {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }
    let mut argv = vec![
        "daemon",
        "--cliqueid",
        "c.1",
        "--node-name",
        "n",
        "--pod-ip",
        "10.0.0.1",
        "--pod-namespace",
        "nvdra",
    ];
    argv.extend_from_slice(extra);
    Cli::try_parse_from(argv).unwrap().args
}

#[test]
fn a_domains_daemon_writes_to_its_domains_clique_object() {
    let s = Settings::from_args(&args(&["--compute-domain-uuid", "uid-1"])).unwrap();
    assert_eq!(s.object, "uid-1.c.1");
    assert_eq!(s.domain_uid, "uid-1");
    assert!(matches!(s.mode, Mode::Managed { .. }));
    // Without the domain's UID the CDI edits did not apply: said so, not a clique "<empty>.c.1".
    let e = Settings::from_args(&args(&[])).unwrap_err().to_string();
    assert!(
        e.contains("COMPUTE_DOMAIN_UUID") && e.contains("CDI"),
        "{e}"
    );
}

#[test]
fn the_per_clique_daemon_writes_to_the_fabric_cliques_object() {
    let s = Settings::from_args(&args(&["--per-clique", "--host-managed"])).unwrap();
    assert_eq!(s.object, "fabric.c.1");
    assert_eq!(s.domain_uid, "");
    assert!(matches!(s.mode, Mode::HostManaged { .. }));
}

/// The shape of `nvidia-imex-ctl -N` on a real rack: the sample in AWS's "Configure UltraServer
/// instances" page of the AWS PCS User Guide
/// (<https://docs.aws.amazon.com/pcs/latest/userguide/capacity-blocks-nvidia-imex.html>,
/// "Validate the IMEX setup"; IMEX 570.172, 18 GB200 trays), cut to its first four nodes, with
/// node 2's link to node 1 lost (`D`) and node 3 not answering (`I`, `UNAVAILABLE`).
const NODE_TABLE: &str = "\
Connectivity Table Legend:
I - Invalid - Node wasn't reachable, no connection status available
N - Never Connected
R - Recovering - Connection was lost, but clean up has not yet been triggered.
D - Disconnected - Connection was lost, and clean up has been triggreed.
A - Authenticating - If GSSAPI enabled, client has initiated mutual authentication.
!V! - Version mismatch, communication disabled.
!M! - Node map mismatch, communication disabled.
C - Connected - Ready for operation

5/4/2026 06:08:10.580
Nodes:
Node #0   - 172.31.48.81    - READY                - Version: 570.172
Node #1   - 172.31.48.98    - READY                - Version: 570.172
Node #2   - 172.31.48.221   - READY                - Version: 570.172
Node #3   - 172.31.49.228   - UNAVAILABLE          - Version: 570.172

 Nodes From\\To  0   1   2   3
       0        C   C   C   C
       1        C   C   C   C
       2        C   D   C   C
       3        I   I   I   I

Domain State: DEGRADED
";

#[test]
fn the_node_table_of_nvidia_imex_ctl_is_read() {
    let s = imex::parse_domain_status(NODE_TABLE).unwrap();
    assert_eq!(s.nodes.len(), 4);
    assert_eq!(
        s.nodes[&3],
        ("172.31.49.228".to_string(), "UNAVAILABLE".to_string())
    );
    assert_eq!(s.index_of(&["172.31.48.221"]), Some(2));
    assert_eq!(
        s.connected_from(0),
        ["172.31.48.98", "172.31.48.221", "172.31.49.228"]
    );
    assert_eq!(s.connected_from(2), ["172.31.48.81", "172.31.49.228"]);
    assert!(s.connected_from(3).is_empty());
    assert_eq!(s.links[&(2, 1)], "D");
    // Not the table: the error quotes what it got.
    let e = imex::parse_domain_status("UNAVAILABLE\n").unwrap_err();
    assert!(
        e.contains("no node list") && e.contains("UNAVAILABLE"),
        "{e}"
    );
}

#[test]
fn imex_addresses_map_back_to_node_names_through_the_clique_entries() {
    let s = imex::parse_domain_status(NODE_TABLE).unwrap();
    let mut daemons = vec![
        entry("tray-0", "172.31.48.81", 0),
        entry("tray-1", "172.31.48.98", 1),
        entry("tray-2", "172.31.48.221", 2),
        entry("tray-3", "172.31.49.228", 3),
    ];
    // Node 2 lost node 1: its peers lack it.
    assert_eq!(
        peer_names(&s, &daemons, &me("tray-2", "172.31.48.221")),
        Some(vec!["tray-0".to_string(), "tray-3".to_string()])
    );
    // Only this clique's entries name a node; an address no entry holds is left out.
    daemons[3].clique_id = "c.2".into();
    assert_eq!(
        peer_names(&s, &daemons, &me("tray-0", "172.31.48.81")),
        Some(vec!["tray-1".to_string(), "tray-2".to_string()])
    );
    // A node absent from the table cannot say.
    assert_eq!(peer_names(&s, &daemons, &me("tray-9", "10.9.9.9")), None);

    // nvdra's nodes.cfg lists per-domain DNS names: the table then shows those.
    let by_name = NODE_TABLE
        .replace("172.31.48.81 ", &files::dns_name(0))
        .replace("172.31.48.98 ", &files::dns_name(1))
        .replace("172.31.48.221", &files::dns_name(2))
        .replace("172.31.49.228", &files::dns_name(3));
    let s = imex::parse_domain_status(&by_name).unwrap();
    assert_eq!(
        peer_names(&s, &daemons[..3], &me("tray-2", "172.31.48.221")),
        Some(vec!["tray-0".to_string()])
    );
}

#[test]
fn imex_config_comes_from_the_domains_template_else_the_built_in_one() {
    let dir = tempfile::tempdir().unwrap();
    let config_dir = dir.path().to_str().unwrap();
    let settings = Settings::from_args(&args(&[
        "--compute-domain-uuid",
        "uid-1",
        "--config-dir",
        config_dir,
    ]))
    .unwrap();
    let daemon = || {
        Daemon::new(
            settings.clone(),
            Arc::new(clique::MemoryCliques::default()),
            Box::new(NoFabricCheck),
        )
    };
    let nodes = dir.path().join("nodes.cfg").display().to_string();
    let written = || std::fs::read_to_string(dir.path().join("imexd.cfg")).unwrap();

    // No /imexd/imexd.cfg.tmpl (a plugin that writes none): the built-in template.
    daemon().write_config().unwrap();
    assert_eq!(
        written(),
        files::render(files::DEFAULT_TEMPLATE, "10.0.0.1", &nodes).unwrap()
    );
    assert!(written().contains("IMEX_CMD_PORT=50005\n"), "{}", written());
    assert_eq!(
        std::fs::read_to_string(&nodes).unwrap(),
        files::nodes_config(18)
    );

    // The template NVIDIA's plugin puts there (its two fields, Go's spacing either way) wins.
    std::fs::write(
        dir.path().join("imexd.cfg.tmpl"),
        "SERVER_PORT=50123\nIMEX_NODE_CONFIG_FILE={{ .IMEXDaemonNodesConfigPath }}\n\
         IMEX_CMD_BIND_INTERFACE_IP={{.IMEXCmdBindInterfaceIP}}\n",
    )
    .unwrap();
    daemon().write_config().unwrap();
    assert_eq!(
        written(),
        format!(
            "SERVER_PORT=50123\nIMEX_NODE_CONFIG_FILE={nodes}\nIMEX_CMD_BIND_INTERFACE_IP=10.0.0.1\n"
        )
    );

    // A field the daemon does not know is refused naming it, and no config is half written.
    std::fs::write(
        dir.path().join("imexd.cfg.tmpl"),
        "X={{ .IMEXServerPort }}\n",
    )
    .unwrap();
    let e = daemon().write_config().unwrap_err();
    assert!(e.contains(".IMEXServerPort"), "{e}");
    assert!(written().contains("SERVER_PORT=50123"), "{}", written());
}
