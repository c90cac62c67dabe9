//! The Prometheus text format read by a parser nvdra did not write: the Python
//! `prometheus_client` library's `text_string_to_metric_families` (what its own tests and many
//! exporters' use), pinned in `.ci/run`.
// Each test binary uses what it needs.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::OnceLock;

use serde::Deserialize;

/// What CI installs (`.ci/run`).
pub const PIP: &str = "python3 -m pip install prometheus_client==0.26.0";

/// Whether python3 can import `prometheus_client` (probed once per test binary); skips or, when
/// `NVDRA_REQUIRE_PROMCLIENT` is set, fails the calling test otherwise.
pub fn have_promclient() -> bool {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    super::python::have(
        &PROBE,
        "import prometheus_client.parser",
        "the Python Prometheus parser",
        "NVDRA_REQUIRE_PROMCLIENT",
        PIP,
    )
}

/// One metric family as the parser reads it.
#[derive(Clone, Debug, Deserialize)]
pub struct Family {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub samples: Vec<Sample>,
}

/// One sample.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

const PARSE: &str = r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
out = [{"name": f.name, "type": f.type,
        "samples": [{"name": s.name, "labels": s.labels, "value": s.value} for s in f.samples]}
       for f in text_string_to_metric_families(sys.stdin.read())]
print(json.dumps(out))
"#;

/// `text` parsed by `prometheus_client`; panics with the parser's error when it refuses it.
pub fn parse(text: &str) -> Vec<Family> {
    let v = super::python::json_of(PARSE, &[], text, "prometheus_client refused the text");
    serde_json::from_value(v).unwrap()
}

/// Every sample of every family.
pub fn samples(families: &[Family]) -> Vec<Sample> {
    families.iter().flat_map(|f| f.samples.clone()).collect()
}

/// The series (name and labels) that appear more than once.
pub fn duplicates(families: &[Family]) -> Vec<String> {
    let mut seen = BTreeMap::new();
    for s in samples(families) {
        *seen
            .entry(format!("{}{:?}", s.name, s.labels))
            .or_insert(0u32) += 1;
    }
    seen.into_iter()
        .filter(|(_, n)| *n > 1)
        .map(|(k, _)| k)
        .collect()
}

/// A raw HTTP GET of `path` on `addr`: the status line and the body.
pub fn get(addr: &str, path: &str) -> std::io::Result<(String, String)> {
    use std::io::Read;
    let mut s = std::net::TcpStream::connect(addr)?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    let (head, body) = buf.split_once("\r\n\r\n").unwrap_or((&buf, ""));
    Ok((
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    ))
}
