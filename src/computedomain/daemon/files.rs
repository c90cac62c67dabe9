//! The files IMEX reads: its config (rendered from the template the plugin's prepare put in
//! the domain's config directory, NVIDIA's `imexd.cfg.tmpl`), the static `nodes.cfg` of DNS
//! names, and the hosts-file block that maps the names of the clique's present daemons to
//! their IPs.
//!
//! Why names and not IPs (NVIDIA's `IMEXDaemonsWithDNSNames`, and its issues 1447/1418): the
//! names are `compute-domain-daemon-<index>`, the index a node holds in its domain's clique
//! object, and `nodes.cfg` lists all of them once, so it never changes while the domain lives
//! (IMEX keys its recovery file to it). Who a name is lives only in the hosts file of this
//! daemon's pod, which serves one domain: the block is rewritten from the clique object on every
//! change, so a name never points at an IP that has left the domain's object, and a pod IP that
//! Kubernetes hands to another domain's daemon stops being a peer here as soon as its entry
//! leaves this domain's object (IMEX is then told to reconnect). The window between a pod's end
//! and the removal of its entry remains; IMEX's own authentication
//! (`IMEX_ENABLE_AUTH_ENCRYPTION`) is what closes it.

use std::collections::BTreeMap;
use std::io;
use std::path::Path;

/// The DNS name of the daemon with `index` (NVIDIA's format).
pub fn dns_name(index: i64) -> String {
    format!("{NAME_PREFIX}{index:04}")
}

/// What every name of ours starts with: the hosts file's lines holding it are ours.
pub const NAME_PREFIX: &str = "compute-domain-daemon-";

/// The first line of our block in the hosts file.
const BLOCK_HEADER: &str = "# nvdra compute-domain daemon: IMEX peers";

/// `nodes.cfg`: every name the domain can hold, one a line.
pub fn nodes_config(max_nodes: u32) -> String {
    (0..i64::from(max_nodes))
        .map(|i| dns_name(i) + "\n")
        .collect()
}

/// The hosts file with our block replaced by one for `peers` (index → IP), every other line
/// kept as it was.
pub fn hosts_file(existing: &str, peers: &BTreeMap<i64, String>) -> String {
    let mut out: String = existing
        .lines()
        .filter(|l| !l.contains(NAME_PREFIX) && l.trim() != BLOCK_HEADER)
        .map(|l| format!("{l}\n"))
        .collect();
    out.push_str(BLOCK_HEADER);
    out.push('\n');
    for (index, ip) in peers {
        out.push_str(&format!("{ip}\t{}\n", dns_name(*index)));
    }
    out
}

/// Rewrites the hosts file in place (it is a bind mount in a pod, which a rename cannot
/// replace); false when it already read so.
pub fn write_hosts(path: &Path, peers: &BTreeMap<i64, String>) -> io::Result<bool> {
    let existing = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e),
    };
    let new = hosts_file(&existing, peers);
    if new == existing {
        return Ok(false);
    }
    std::fs::write(path, new)?;
    Ok(true)
}

/// A template value the config template names but the daemon does not know.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "the IMEX config template names {{{{ {0} }}}}, which the daemon does not fill in (it knows \
     .IMEXCmdBindInterfaceIP and .IMEXDaemonNodesConfigPath): fix the template"
)]
pub struct UnknownField(pub String);

/// Fills in NVIDIA's template fields (`{{ .IMEXCmdBindInterfaceIP }}`,
/// `{{ .IMEXDaemonNodesConfigPath }}`, Go template syntax, any spacing).
pub fn render(template: &str, bind_ip: &str, nodes_path: &str) -> Result<String, UnknownField> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let Some(len) = rest[start..].find("}}") else {
            break;
        };
        let field = rest[start + 2..start + len].trim();
        match field {
            ".IMEXCmdBindInterfaceIP" => out.push_str(bind_ip),
            ".IMEXDaemonNodesConfigPath" => out.push_str(nodes_path),
            other => return Err(UnknownField(other.into())),
        }
        rest = &rest[start + len + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The config used when the domain's directory holds no template: NVIDIA's settings that
/// matter here (logs to stderr, not daemonized, the command service on the pod IP, recovery
/// quorum, wait for ever before cleaning up after a lost peer).
pub const DEFAULT_TEMPLATE: &str = "\
LOG_LEVEL=4
LOG_FILE_NAME=
DAEMONIZE=0
BIND_INTERFACE_IP=
SERVER_PORT=50000
IMEX_NODE_CONFIG_FILE={{ .IMEXDaemonNodesConfigPath }}
IMEX_WAIT_FOR_QUORUM=RECOVERY
IMEX_CMD_ENABLED=1
IMEX_CMD_BIND_INTERFACE_IP={{ .IMEXCmdBindInterfaceIP }}
IMEX_CMD_PORT=50005
IMEX_NODE_DISCONNECTED_GRACE_TIME=-1
";
