//! What the kubelet socket adapter (`kubelet_plugin::socket`, the `:authority` rewriter in front of h2)
//! adds to a unary call, measured beside the same call without it in the same run:
//!
//! - two tonic servers with the same `pluginregistration.Registration` service, one on a Unix
//!   socket behind the adapter and one on a bare socket; `GetInfo` calls alternate between them
//!   on one connection each, so both see the same machine load;
//! - the rewriter alone on grpc-go's header block (CPU time per request).
//!
//! Run with `cargo bench --bench socket`.

use std::time::{Duration, Instant};

use kubelet_plugin::proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
    registration_client::RegistrationClient,
    registration_server::{Registration, RegistrationServer},
};
use kubelet_plugin::socket;

const WARMUP: usize = 2_000;
const CALLS: usize = 20_000;
const CONNECTIONS: usize = 100_000;

struct Answer;

#[tonic::async_trait]
impl Registration for Answer {
    async fn get_info(
        &self,
        _: tonic::Request<InfoRequest>,
    ) -> Result<tonic::Response<PluginInfo>, tonic::Status> {
        Ok(tonic::Response::new(PluginInfo {
            r#type: "DRAPlugin".into(),
            name: "gpu.nvidia.com".into(),
            endpoint: "/var/lib/kubelet/plugins/gpu.nvidia.com/dra.sock".into(),
            supported_versions: vec!["v1.DRAPlugin".into(), "v1beta1.DRAPlugin".into()],
        }))
    }
    async fn notify_registration_status(
        &self,
        _: tonic::Request<RegistrationStatus>,
    ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
        Ok(tonic::Response::new(RegistrationStatusResponse {}))
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn report(label: &str, times: &mut [Duration]) -> (Duration, Duration) {
    times.sort();
    let (p50, p99) = (percentile(times, 0.5), percentile(times, 0.99));
    println!(
        "{label:<40} p50 {p50:>10.3?}  p99 {p99:>10.3?}  (n={})",
        times.len()
    );
    (p50, p99)
}

/// grpc-go's first header block for a call on a plugin socket (recorded from grpc-go 1.33 with
/// the authority grpc-go 1.83 sends; see src/socket/authority/tests.rs).
const GRPC_GO_BLOCK: &str = "8386459c62ba2d98d558598c84d83498f52fb4b31909b06931ea63115392a94f41ac54587b8ec545868346a8b0f5b632d054aa2c35d16cc6a90a8b0cd5dabd5dcd2186b90f4aa2c325835d07275f5f8b1d75d0620d263d4c4d65647a8b9acac8b4c7602bb2caecff40027465864d833505b11f40899acac8b24d494f6a7f867df7dc6c16ff";
const GRPC_GO_SECOND: &str = "8386c3c2c1c0bf7e867df7df75bb7f";

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn headers_frame(stream: u32, block: &[u8]) -> Vec<u8> {
    let mut f = (block.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend([0x1, 0x4]);
    f.extend(stream.to_be_bytes());
    f.extend_from_slice(block);
    f
}

/// A connection's first two requests as grpc-go sends them (the second refers to the table
/// the first filled), rewritten by a new rewriter each time: the per-request CPU cost, including
/// setting up the connection's HPACK table.
fn rewriter_alone() {
    let mut conn = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    conn.extend([0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    conn.extend(headers_frame(1, &hex(GRPC_GO_BLOCK)));
    conn.extend(headers_frame(3, &hex(GRPC_GO_SECOND)));
    let mut out = Vec::with_capacity(1 << 12);
    let t = Instant::now();
    for _ in 0..CONNECTIONS {
        let mut r = socket::Rewriter::server();
        out.clear();
        r.feed(&conn, &mut out);
        assert_eq!(r.replaced(), 2);
    }
    let per = t.elapsed() / (2 * CONNECTIONS as u32);
    println!(
        "rewriter alone, grpc-go's header blocks: {per:?} per request (n={})",
        2 * CONNECTIONS
    );
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (with, without) = (
        dir.path().join("with.sock"),
        dir.path().join("without.sock"),
    );
    let l_with = socket::bind(&with).expect("bind");
    let l_without = socket::bind(&without).expect("bind");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(Answer))
            .serve_with_incoming(socket::incoming(l_with)),
    );
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RegistrationServer::new(Answer))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(l_without)),
    );
    let mut a = RegistrationClient::new(socket::connect(&with).await.expect("connect"));
    let mut b = RegistrationClient::new(socket::connect(&without).await.expect("connect"));

    let (mut ta, mut tb) = (Vec::with_capacity(CALLS), Vec::with_capacity(CALLS));
    for i in 0..WARMUP + CALLS {
        let t = Instant::now();
        a.get_info(InfoRequest {}).await.expect("GetInfo");
        let da = t.elapsed();
        let t = Instant::now();
        b.get_info(InfoRequest {}).await.expect("GetInfo");
        let db = t.elapsed();
        if i >= WARMUP {
            ta.push(da);
            tb.push(db);
        }
    }
    let (a50, a99) = report("GetInfo through the adapter", &mut ta);
    let (b50, b99) = report("GetInfo on a bare socket", &mut tb);
    let diff = |x: Duration, y: Duration| x.as_secs_f64() * 1e6 - y.as_secs_f64() * 1e6;
    println!(
        "adapter adds: p50 {:+.1} µs, p99 {:+.1} µs",
        diff(a50, b50),
        diff(a99, b99)
    );
    rewriter_alone();
}
