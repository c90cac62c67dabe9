//! A call as a driver meets it (issue 36 item 5): its context from `call::current()` (request
//! id, the kubelet's deadline, cancellation when the kubelet gives up, grpcio's client included,
//! or the plugin stops), its tracing span and the `warn` for each failed claim, a tower layer
//! around both servers, the three directories set apart from the kubelet root, and a 403 from
//! the API server named as an RBAC problem.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kubelet_plugin::proto::pluginregistration::{InfoRequest, registration_client};
use kubelet_plugin::testing::{KubeletClient, MemoryClaims, allocated_claim, allocated_device};
use kubelet_plugin::{
    BoxError, CancellationToken, Claim, Driver, ErrorKind, GrpcRequest, Options, PrepareClaim,
    PrepareResults, PreparedDevice, UnprepareResults, call,
};
use tokio::sync::mpsc;

use crate::{require, wait};

const DRIVER: &str = "fpga.example.com";
const NODE: &str = "node-a";

/// What a driver saw of its call.
#[derive(Debug)]
struct Seen {
    id: String,
    deadline: Option<tokio::time::Instant>,
    token: CancellationToken,
}

/// Records each call's context; claims named `fail-*` fail; with `wait`, a prepare waits for
/// its call's cancellation (at most `wait::SOON`) and says whether it came.
struct Observer {
    seen: mpsc::UnboundedSender<Seen>,
    wait: bool,
    cancelled: mpsc::UnboundedSender<bool>,
}

/// The span test sets a subscriber for its own thread, while tracing caches each callsite's
/// interest process-wide: a call made by a test running beside it can compute a callsite's
/// interest while that subscriber is being registered, cache "never", and the span goes missing
/// (seen once in a whole-suite run with four test threads). The span test takes this lock alone; every
/// other test of this module shares it. The other modules of this binary do not take it: the
/// span test also registers a second subscriber (see there).
static CALLSITES: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

fn observer(
    wait: bool,
) -> (
    Arc<Observer>,
    mpsc::UnboundedReceiver<Seen>,
    mpsc::UnboundedReceiver<bool>,
) {
    let (seen, seen_rx) = mpsc::unbounded_channel();
    let (cancelled, cancelled_rx) = mpsc::unbounded_channel();
    (
        Arc::new(Observer {
            seen,
            wait,
            cancelled,
        }),
        seen_rx,
        cancelled_rx,
    )
}

impl Observer {
    fn record(&self) -> call::Call {
        let call = call::current().expect("a call's context inside the driver");
        // A test that does not look has dropped the receiver.
        let _ = self.seen.send(Seen {
            id: call.id().to_string(),
            deadline: call.deadline(),
            token: call.token().clone(),
        });
        call
    }
}

impl Driver for Observer {
    async fn prepare(&self, claims: Vec<PrepareClaim>) -> Result<PrepareResults, BoxError> {
        let call = self.record();
        if self.wait {
            let came = tokio::time::timeout(wait::SOON, call.cancelled())
                .await
                .is_ok();
            self.cancelled.send(came).unwrap();
        }
        Ok(claims
            .into_iter()
            .map(|c| {
                let r = if c.claim.name.starts_with("fail-") {
                    Err("the device is on fire".into())
                } else {
                    Ok(vec![PreparedDevice::new(
                        vec!["fpga".into()],
                        NODE,
                        "fpga-0",
                        vec![format!("{DRIVER}/fpga=fpga-0")],
                    )])
                };
                (c.claim.uid, r)
            })
            .collect())
    }

    async fn unprepare(&self, claims: Vec<Claim>) -> Result<UnprepareResults, BoxError> {
        self.record();
        Ok(claims.into_iter().map(|c| (c.uid, Ok(()))).collect())
    }
}

fn claims(names: &[(&str, &str)]) -> MemoryClaims {
    let claims = MemoryClaims::default();
    for (name, uid) in names {
        claims.insert(allocated_claim(
            "ns",
            name,
            uid,
            vec![allocated_device("fpga", DRIVER, NODE, "fpga-0")],
        ));
    }
    claims
}

/// Serves `driver` with `opts`; a client once the DRA socket is there.
async fn start(
    driver: Arc<Observer>,
    opts: Options,
    stop: &CancellationToken,
) -> (KubeletClient, tokio::task::JoinHandle<()>) {
    let socket = opts.sockets().dra;
    let serving = tokio::spawn({
        let stop = stop.clone();
        async move { kubelet_plugin::serve(driver, opts, stop).await.unwrap() }
    });
    let client = wait::until("the DRA socket", wait::SOON, || async {
        KubeletClient::connect(&socket).await.ok()
    })
    .await;
    (client, serving)
}

#[tokio::test]
async fn the_driver_sees_its_call_with_the_kubelets_deadline() {
    let _callsites = CALLSITES.read().await;
    let root = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let (driver, mut seen, _) = observer(false);
    let opts = Options::new(DRIVER, NODE, claims(&[("c", "a")]))
        .unwrap()
        .kubelet_root(root.path());
    let (client, _serving) = start(driver, opts, &stop).await;

    let sent = tokio::time::Instant::now();
    let answers = client
        .clone()
        .with_deadline(Duration::from_secs(45))
        .prepare(&[Claim::new("ns", "c", "a")])
        .await
        .unwrap();
    let returned = tokio::time::Instant::now();
    assert!(answers["a"].is_ok(), "{answers:?}");
    let first = seen.recv().await.unwrap();
    assert_eq!(first.id.len(), 16, "{first:?}");
    assert!(first.id.bytes().all(|b| b.is_ascii_hexdigit()), "{first:?}");
    let deadline = first.deadline.expect("the deadline from grpc-timeout");
    // 45 s after the server read the call, which it did between sending and answering.
    let limit = Duration::from_secs(45);
    assert!(
        deadline >= sent + limit && deadline <= returned + limit,
        "{deadline:?} is not 45 s after the call ({sent:?} to {returned:?})"
    );
    // A call that ended is not cancelled afterwards.
    assert!(!first.token.is_cancelled());

    // No grpc-timeout: no deadline; each call its own id; unprepare too.
    let mut plain = client.clone();
    plain
        .unprepare(&[Claim::new("ns", "c", "a")])
        .await
        .unwrap();
    let second = seen.recv().await.unwrap();
    assert_eq!(second.deadline, None);
    assert_ne!(second.id, first.id);
    stop.cancel();
}

/// The kubelet's deadline passes while the driver works: its call's token is cancelled (the
/// driver is not aborted: it sees the cancellation and answers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kubelet_giving_up_cancels_the_call() {
    let _callsites = CALLSITES.read().await;
    let root = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let (driver, mut seen, mut cancelled) = observer(true);
    let opts = Options::new(DRIVER, NODE, claims(&[("c", "a")]))
        .unwrap()
        .kubelet_root(root.path());
    let (client, _serving) = start(driver, opts, &stop).await;
    let status = client
        .clone()
        .with_deadline(Duration::from_millis(300))
        .prepare(&[Claim::new("ns", "c", "a")])
        .await
        .unwrap_err();
    assert!(
        matches!(
            status.code(),
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled
        ),
        "{status:?}"
    );
    assert!(seen.recv().await.unwrap().deadline.is_some());
    assert_eq!(
        cancelled.recv().await,
        Some(true),
        "the driver saw its call cancelled"
    );
    assert!(!stop.is_cancelled());
    stop.cancel();
}

/// The plugin stops while a call is inside the driver: the call's token is cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugin_stopping_cancels_the_call() {
    let _callsites = CALLSITES.read().await;
    let root = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let (driver, mut seen, mut cancelled) = observer(true);
    let opts = Options::new(DRIVER, NODE, claims(&[("c", "a")]))
        .unwrap()
        .kubelet_root(root.path());
    let (client, serving) = start(driver, opts, &stop).await;
    let call = tokio::spawn(async move {
        let mut client = client;
        client.prepare(&[Claim::new("ns", "c", "a")]).await
    });
    let inside = seen.recv().await.unwrap();
    assert!(!inside.token.is_cancelled());
    stop.cancel();
    assert_eq!(cancelled.recv().await, Some(true));
    // The call still answers (the driver chose to finish), and the plugin stops.
    let answers = call.await.unwrap().unwrap();
    assert!(answers["a"].is_ok(), "{answers:?}");
    tokio::time::timeout(wait::SOON, serving)
        .await
        .expect("the plugin stops")
        .unwrap();
}

/// Whether python3 can run the grpcio stand-in's modules; skips, or fails when required.
fn have_grpcio() -> bool {
    let ok = Command::new("python3")
        .args([
            "-c",
            "import grpc, grpc_tools.protoc, google.protobuf, hpack",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok || !require::required("KUBELET_PLUGIN_REQUIRE_GRPCIO"),
        "KUBELET_PLUGIN_REQUIRE_GRPCIO=1 but python3 cannot import grpcio (see README.md)"
    );
    if !ok {
        eprintln!("skipped: needs python3 with grpcio (see README.md)");
    }
    ok
}

/// grpcio's client (the C core, not tonic) with a short timeout, as the kubelet's grpc-go
/// client sends one: prints the status code it ends with.
const GRPCIO_CALL: &str = r#"
import importlib.util, sys
import grpc
standin_path, proto_root, cache, sock = sys.argv[1:5]
spec = importlib.util.spec_from_file_location("standin", standin_path)
standin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(standin)
pb, rpc = standin.load_stubs(proto_root, cache)["dra_v1"]
channel = grpc.insecure_channel("unix:" + sock,
    options=[("grpc.default_authority", standin.grpc_go_authority(sock))])
claim = pb.Claim(namespace="ns", name="c", uid="a")
try:
    rpc.DRAPluginStub(channel).NodePrepareResources(
        pb.NodePrepareResourcesRequest(claims=[claim]), timeout=0.5)
    print("OK")
except grpc.RpcError as e:
    print(e.code().name)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpcio_client_giving_up_cancels_the_call() {
    let _callsites = CALLSITES.read().await;
    if !have_grpcio() {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let (driver, mut seen, mut cancelled) = observer(true);
    let opts = Options::new(DRIVER, NODE, claims(&[("c", "a")]))
        .unwrap()
        .kubelet_root(root.path());
    let socket = opts.sockets().dra;
    let (_client, _serving) = start(driver, opts, &stop).await;
    let dir = env!("CARGO_MANIFEST_DIR");
    let out = tokio::task::spawn_blocking(move || {
        Command::new("python3")
            .args(["-c", GRPCIO_CALL])
            .arg(format!("{dir}/tests/kubelet/standin.py"))
            .arg(format!("{dir}/proto"))
            .arg(concat!(env!("CARGO_TARGET_TMPDIR"), "/kubelet-standin"))
            .arg(&socket)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    // Two timers end the call at the same 0.5 s: the client's own (DEADLINE_EXCEEDED) and
    // tonic's server-side one, which enforces the grpc-timeout header and answers CANCELLED
    // ("Timeout expired"). Which one the client hears first is the machine's timing (CI saw
    // both); either way the call ended by its deadline, not with an answer.
    assert!(
        matches!(said.trim(), "DEADLINE_EXCEEDED" | "CANCELLED"),
        "the call ended with {:?}, not by its deadline; stderr: {}",
        said.trim(),
        String::from_utf8_lossy(&out.stderr)
    );
    let inside = seen.recv().await.unwrap();
    assert!(inside.deadline.is_some(), "grpcio sends grpc-timeout");
    assert_eq!(cancelled.recv().await, Some(true));
    stop.cancel();
}

/// Everything the test's subscriber wrote, shared with it.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Each call runs in a span with its method, request id and claim UIDs; a failed claim is a
/// `warn` naming it, inside that span.
#[tokio::test]
async fn calls_have_spans_and_failed_claims_are_warnings() {
    let _callsites = CALLSITES.write().await;
    // While only one subscriber is registered in the process, tracing works out the interest of a
    // callsite reached for the first time from the subscriber of the thread that reaches it. A
    // test of another module of this binary (which does not take CALLSITES) reaching one of the
    // plugin's callsites first, on its own thread, would cache "never" for it, for this test too
    // (it did, every time, beside `serve::` and `metadata::`). A second subscriber, registered
    // for the test's length, makes tracing ask every registered subscriber, this test's included.
    let _second = tracing::Dispatch::new(tracing::subscriber::NoSubscriber::default());
    let out = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_writer({
            let out = out.clone();
            move || out.clone()
        })
        .with_ansi(false)
        .with_max_level(tracing::Level::DEBUG)
        .finish();
    // The test's runtime has one thread: the plugin's tasks log on it.
    let _default = tracing::subscriber::set_default(subscriber);
    // And what a thread worked out while this subscriber was being registered, worked out again.
    tracing::callsite::rebuild_interest_cache();
    let root = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let (driver, mut seen, _) = observer(false);
    let opts = Options::new(DRIVER, NODE, claims(&[("good", "u-1"), ("fail-me", "u-2")]))
        .unwrap()
        .kubelet_root(root.path());
    let (mut client, _serving) = start(driver, opts, &stop).await;
    let answers = client
        .prepare(&[
            Claim::new("ns", "good", "u-1"),
            Claim::new("ns", "fail-me", "u-2"),
        ])
        .await
        .unwrap();
    assert!(answers["u-1"].is_ok());
    assert!(answers["u-2"].is_err());
    let id = seen.recv().await.unwrap().id;
    stop.cancel();
    let text = out.text();
    let span = format!(
        "dra_call{{method=\"NodePrepareResources\" version=\"v1\" request_id=\"{id}\" claims=u-1,u-2}}"
    );
    let warn = text
        .lines()
        .find(|l| l.contains(" WARN ") && l.contains("prepare failed for a claim"))
        .unwrap_or_else(|| panic!("no warning for the failed claim in:\n{text}"));
    assert!(warn.contains(&span), "{warn}");
    for field in [
        "namespace=\"ns\"",
        "name=\"fail-me\"",
        "uid=u-2",
        "error=the device is on fire",
    ] {
        assert!(warn.contains(field), "{field} missing: {warn}");
    }
    assert_eq!(
        text.matches("prepare failed for a claim").count(),
        1,
        "only the failed claim: {text}"
    );
}

/// A tower layer sees the requests of both servers: the DRA socket's and registration's.
#[tokio::test]
async fn a_layer_sees_both_servers_requests() {
    let _callsites = CALLSITES.read().await;
    let root = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let paths = Arc::new(Mutex::new(Vec::<String>::new()));
    let layer = tower::ServiceBuilder::new()
        .map_request({
            let paths = paths.clone();
            move |r: GrpcRequest| {
                paths.lock().unwrap().push(r.uri().path().to_string());
                r
            }
        })
        .into_inner();
    let (driver, _, _) = observer(false);
    let opts = Options::new(DRIVER, NODE, claims(&[("c", "a")]))
        .unwrap()
        .kubelet_root(root.path())
        .layer(layer);
    let registration = opts.sockets().registration;
    let (mut client, _serving) = start(driver, opts, &stop).await;
    client.prepare(&[Claim::new("ns", "c", "a")]).await.unwrap();
    let channel = kubelet_plugin::socket::connect(&registration)
        .await
        .unwrap();
    registration_client::RegistrationClient::new(channel)
        .get_info(InfoRequest {})
        .await
        .unwrap();
    assert_eq!(
        *paths.lock().unwrap(),
        [
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
            "/pluginregistration.Registration/GetInfo"
        ]
    );
    stop.cancel();
}

/// The registry, plugin data and lock directories, set apart from the kubelet root as NVIDIA's
/// flags set them: the sockets, registration's endpoint and the node lock follow them.
#[tokio::test]
async fn the_three_directories_can_be_set_apart() {
    let _callsites = CALLSITES.read().await;
    let base = tempfile::tempdir().unwrap();
    let d = |name: &str| -> PathBuf { base.path().join(name) };
    let stop = CancellationToken::new();
    let (driver, _, _) = observer(false);
    let opts = Options::new(DRIVER, NODE, claims(&[("c", "a")]))
        .unwrap()
        .kubelet_root(d("unused-root"))
        .registrar_directory(d("registry"))
        .plugin_data_directory(d("data"))
        .lock_directory(d("locks"))
        .pod_uid("0f2d5a3c-1234-4bcd-9876-0123456789ab");
    assert_eq!(opts.registry_dir(), d("registry"));
    assert_eq!(opts.plugin_dir(), d("data"));
    assert_eq!(opts.lock_dir(), d("locks"));
    let sockets = opts.sockets();
    assert_eq!(sockets.registration.parent(), Some(d("registry").as_path()));
    assert_eq!(sockets.dra.parent(), Some(d("data").as_path()));
    let (mut client, _serving) = start(driver, opts, &stop).await;
    client.prepare(&[Claim::new("ns", "c", "a")]).await.unwrap();
    let channel = kubelet_plugin::socket::connect(&sockets.registration)
        .await
        .unwrap();
    let info = registration_client::RegistrationClient::new(channel)
        .get_info(InfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(Path::new(&info.endpoint), sockets.dra);
    let lock = kubelet_plugin::nodelock::FILE_NAME;
    assert!(
        d("locks").join(lock).is_file(),
        "the node lock in the lock directory"
    );
    assert!(!d("data").join(lock).exists());
    assert!(!d("unused-root").exists());
    stop.cancel();
}

/// An API server that answers every request 403 Forbidden, as one does for a ServiceAccount
/// without the RBAC to read ResourceClaims.
async fn forbidding_server() -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                // One request per connection; its head is all we need to have read.
                let _ = conn.read(&mut buf).await;
                let body = serde_json::json!({
                    "kind": "Status", "apiVersion": "v1", "metadata": {},
                    "status": "Failure", "reason": "Forbidden", "code": 403,
                    "message": "resourceclaims.resource.k8s.io \"c\" is forbidden: User \
                        \"system:serviceaccount:kube-system:fpga\" cannot get resource \
                        \"resourceclaims\" in API group \"resource.k8s.io\" in the namespace \"ns\"",
                })
                .to_string();
                let response = format!(
                    "HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(response.as_bytes()).await;
            });
        }
    });
    url
}

/// A claim the API server forbids the plugin to read: its error names RBAC (not an unavailable
/// server), and the error hook hears it as fatal.
#[tokio::test]
async fn a_forbidden_claim_read_names_rbac() {
    let _callsites = CALLSITES.read().await;
    let url = forbidding_server().await;
    let client = kube::Client::try_from(kube::Config::new(url.parse().unwrap())).unwrap();
    let root = tempfile::tempdir().unwrap();
    let stop = CancellationToken::new();
    let heard = Arc::new(Mutex::new(Vec::new()));
    let (driver, _, _) = observer(false);
    let opts = Options::new(DRIVER, NODE, client)
        .unwrap()
        .kubelet_root(root.path())
        .on_error({
            let heard = heard.clone();
            move |kind, _, what| heard.lock().unwrap().push((kind, what.to_string()))
        });
    let (mut kubelet, _serving) = start(driver, opts, &stop).await;
    let answers = kubelet
        .prepare(&[Claim::new("ns", "c", "a")])
        .await
        .unwrap();
    let error = answers["a"].as_ref().unwrap_err();
    assert!(
        error.contains("denied by the API server") && error.contains("check RBAC"),
        "{error}"
    );
    assert!(
        error.contains("is forbidden"),
        "the server's message: {error}"
    );
    assert!(!error.contains("unavailable"), "{error}");
    assert_eq!(
        *heard.lock().unwrap(),
        [(ErrorKind::Fatal, "claim refused before prepare".to_string())]
    );
    stop.cancel();
}
