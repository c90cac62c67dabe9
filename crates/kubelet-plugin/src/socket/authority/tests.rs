//! The rewriter on header blocks recorded from real clients (byte strings below), and h2 itself
//! (a tonic server) reading what the rewriter hands it — with and without the adapter, so these
//! tests show the bug they guard against. What the rewriter emits is read back with
//! loona-hpack, a decoder we did not write.

use super::*;
use crate::proto::pluginregistration::{
    InfoRequest, PluginInfo, RegistrationStatus, RegistrationStatusResponse,
    registration_server::{Registration, RegistrationServer},
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// grpc-go 1.33.3 (Debian's golang-google-grpc-dev) dialing `/tmp/rec/s.sock` exactly as the
/// kubelet dials (`grpc.Dial(path, WithInsecure(), WithContextDialer(unix))`), first call:
/// Huffman-coded strings, incremental indexing, `:authority /tmp/rec/s.sock` (the raw path of
/// grpc-go before it percent-encoded).
const GRPC_GO_RAW_PATH: &str = "8386459c62ba2d98d558598c84d83498f52fb4b31909b06931ea63115392a94f
    418b6134d6c58523085d07275f5f8b1d75d0620d263d4c4d65647a8b9acac8b4c7602bb2caecff40027465864d8335
    05b11f40899acac8b24d494f6a7f867df7dc6c16ff";
/// The same client's second call on that connection: every field but `grpc-timeout` is a
/// reference into the dynamic table the first block filled.
const GRPC_GO_SECOND: &str = "8386c3c2c1c0bf7e867df7df75bb7f";
/// grpc-go's current form (1.83, which percent-encodes a Unix socket path): the recording above with the
/// authority field encoded as grpc-go encodes it, `%2Fvar%2Flib%2Fkubelet%2Fplugins%2F
/// gpu.nvidia.com%2Fdra.sock` Huffman-coded (shorter than plain).
const GRPC_GO_PERCENT: &str = "8386459c62ba2d98d558598c84d83498f52fb4b31909b06931ea63115392a94f
    41ac54587b8ec545868346a8b0f5b632d054aa2c35d16cc6a90a8b0cd5dabd5dcd2186b90f4aa2c325835d07275f
    5f8b1d75d0620d263d4c4d65647a8b9acac8b4c7602bb2caecff40027465864d833505b11f40899acac8b24d494f
    6a7f867df7dc6c16ff";
/// grpcio 1.85.1 (Python, C-core 58) dialing `unix:///tmp/rec/s.sock` with no options: plain
/// strings, incremental indexing, `:authority tmp%2Frec%2Fs.sock`.
const GRPCIO_DEFAULT: &str = "40053a70617468282f706c7567696e726567697374726174696f6e2e52656769
    7374726174696f6e2f476574496e666f400a3a617574686f7269747912746d70253246726563253246732e736f63
    6b8386400c636f6e74656e742d74797065106170706c69636174696f6e2f677270634002746508747261696c6572
    734014677270632d6163636570742d656e636f64696e67176964656e746974792c206465666c6174652c20677a69
    70400c677270632d74696d656f7574023153400a757365722d6167656e7430677270632d707974686f6e2f312e38
    352e3120677270632d632f35382e302e3020286c696e75783b2063687474703229";
/// grpcio's second call: dynamic-table references and a new `grpc-timeout`.
const GRPCIO_SECOND: &str = "c4c38386c2c1c0400c677270632d74696d656f757405313031306dbf";
/// grpcio 1.85.1 with `grpc.default_authority` set to grpc-go's form for the registration
/// socket, `%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.nvidia.com-reg.sock`.
const GRPCIO_PERCENT: &str = "40053a70617468282f706c7567696e726567697374726174696f6e2e52656769
    7374726174696f6e2f476574496e666f400a3a617574686f72697479432532467661722532466c69622532466b75
    62656c6574253246706c7567696e735f72656769737472792532466770752e6e76696469612e636f6d2d7265672e
    736f636b8386400c636f6e74656e742d74797065106170706c69636174696f6e2f677270634002746508747261696c
    6572734014677270632d6163636570742d656e636f64696e67176964656e746974792c206465666c6174652c2067
    7a6970400c677270632d74696d656f757405313031306d400a757365722d6167656e7430677270632d707974686f
    6e2f312e38352e3120677270632d632f35382e302e3020286c696e75783b2063687474703229";
/// The same with `grpc.default_authority=localhost`, as the kubelet's device-plugin client sends.
const GRPCIO_LOCALHOST: &str = "40053a70617468282f706c7567696e726567697374726174696f6e2e526567
    697374726174696f6e2f476574496e666f400a3a617574686f72697479096c6f63616c686f73748386400c636f6e
    74656e742d74797065106170706c69636174696f6e2f677270634002746508747261696c6572734014677270632d
    6163636570742d656e636f64696e67176964656e746974792c206465666c6174652c20677a6970400c677270632d
    74696d656f757405313031306d400a757365722d6167656e7430677270632d707974686f6e2f312e38352e312067
    7270632d632f35382e302e3020286c696e75783b2063687474703229";

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    write_frame_header(&mut f, payload.len(), kind, flags, stream);
    f.extend_from_slice(payload);
    f
}

/// A header block in literal fields without indexing, plain strings (what any encoder may send).
fn literal_block(fields: &[(&str, &str)]) -> Vec<u8> {
    let mut b = Vec::new();
    for (n, v) in fields {
        encode_literal(&mut b, n.as_bytes(), v.as_bytes());
    }
    b
}

fn request_fields(authority: Option<&str>) -> Vec<(&str, &str)> {
    let mut f = vec![
        (":method", "POST"),
        (":scheme", "http"),
        (":path", GET_INFO),
    ];
    if let Some(a) = authority {
        f.push((":authority", a));
    }
    f.extend([("content-type", "application/grpc"), ("te", "trailers")]);
    f
}

/// The preface and an empty SETTINGS frame, as every client starts.
fn client_start() -> Vec<u8> {
    let mut b = PREFACE.to_vec();
    b.extend(frame(0x4, 0, 0, &[]));
    b
}

/// What `rewrite` emits, decoded by an independent decoder whose dynamic table holds nothing:
/// the fields of each header block, with the frames that carried it.
fn decode_output(bytes: &[u8]) -> Vec<(u32, Vec<(String, String)>)> {
    assert!(bytes.starts_with(PREFACE));
    let mut decoder = loona_hpack::Decoder::new();
    // Size 0: any reference into a dynamic table is an error, proving the output needs none.
    decoder.set_max_table_size(0);
    let mut blocks = Vec::new();
    let mut fragment = Vec::new();
    let mut i = PREFACE.len();
    while i < bytes.len() {
        let len = usize::from(bytes[i]) << 16
            | usize::from(bytes[i + 1]) << 8
            | usize::from(bytes[i + 2]);
        let (kind, flags) = (bytes[i + 3], bytes[i + 4]);
        let stream = u32::from_be_bytes(bytes[i + 5..i + 9].try_into().unwrap());
        assert!(len <= MAX_FRAME, "emitted a {len}-byte frame");
        let payload = &bytes[i + 9..i + 9 + len];
        if kind == HEADERS || kind == CONTINUATION {
            let (_, frag) = if kind == HEADERS {
                assert_eq!(flags & PADDED, 0);
                split_headers_payload(flags, payload).unwrap()
            } else {
                (None, payload)
            };
            fragment.extend_from_slice(frag);
            if flags & END_HEADERS != 0 {
                let fields = decoder
                    .decode(&fragment)
                    .unwrap()
                    .into_iter()
                    .map(|(n, v)| (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap()))
                    .collect();
                blocks.push((stream, fields));
                fragment.clear();
            }
        }
        i += 9 + len;
    }
    assert_eq!(i, bytes.len(), "output ends inside a frame");
    blocks
}

/// The type of every frame after the preface.
fn frame_kinds(bytes: &[u8]) -> Vec<u8> {
    let mut kinds = Vec::new();
    let mut i = PREFACE.len();
    while i < bytes.len() {
        let len = usize::from(bytes[i]) << 16
            | usize::from(bytes[i + 1]) << 8
            | usize::from(bytes[i + 2]);
        kinds.push(bytes[i + 3]);
        i += 9 + len;
    }
    kinds
}

fn rewrite(input: &[u8]) -> (Vec<u8>, Rewriter) {
    let mut r = Rewriter::server();
    let mut out = Vec::new();
    r.feed(input, &mut out);
    (out, r)
}

fn fields_of(blocks: &[(u32, Vec<(String, String)>)], i: usize) -> Vec<(&str, &str)> {
    blocks[i]
        .1
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect()
}

fn get(fields: &[(&str, &str)], name: &str) -> Option<String> {
    fields
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.to_string())
}

#[test]
fn grpc_go_raw_path_is_replaced_and_later_references_resolve() {
    let mut input = client_start();
    input.extend(frame(HEADERS, END_HEADERS, 1, &hex(GRPC_GO_RAW_PATH)));
    input.extend(frame(0x0, END_STREAM, 1, &[0; 5]));
    input.extend(frame(HEADERS, END_HEADERS, 3, &hex(GRPC_GO_SECOND)));
    let (out, r) = rewrite(&input);
    let blocks = decode_output(&out);
    assert_eq!(blocks.len(), 2);
    for (i, stream) in [(0, 1), (1, 3)] {
        assert_eq!(blocks[i].0, stream);
        let f = fields_of(&blocks, i);
        assert_eq!(get(&f, ":authority").as_deref(), Some("localhost"), "{f:?}");
        assert_eq!(get(&f, ":path").as_deref(), Some(GET_INFO));
        assert_eq!(get(&f, ":method").as_deref(), Some("POST"));
        assert_eq!(get(&f, "user-agent").as_deref(), Some("grpc-go/1.33.3"));
        assert_eq!(get(&f, "te").as_deref(), Some("trailers"));
    }
    assert_eq!(
        get(&fields_of(&blocks, 0), "grpc-timeout").as_deref(),
        Some("999650u")
    );
    assert_eq!(
        get(&fields_of(&blocks, 1), "grpc-timeout").as_deref(),
        Some("999975u")
    );
    assert_eq!(r.replaced(), 2);
    assert!(!r.passing_through());
    // The DATA frame passed through unchanged, between the two header blocks.
    assert!(
        out.windows(14)
            .any(|w| w == frame(0x0, END_STREAM, 1, &[0; 5]).as_slice())
    );
}

#[test]
fn grpc_go_percent_encoded_path_is_replaced() {
    let mut input = client_start();
    input.extend(frame(HEADERS, END_HEADERS, 1, &hex(GRPC_GO_PERCENT)));
    input.extend(frame(HEADERS, END_HEADERS, 3, &hex(GRPC_GO_SECOND)));
    let (out, r) = rewrite(&input);
    let blocks = decode_output(&out);
    assert_eq!(
        get(&fields_of(&blocks, 0), ":authority").as_deref(),
        Some("localhost")
    );
    assert_eq!(
        get(&fields_of(&blocks, 1), ":authority").as_deref(),
        Some("localhost")
    );
    assert_eq!(r.replaced(), 2);
}

#[test]
fn grpcio_forms_plain_strings() {
    for (block, replaced) in [
        (GRPCIO_DEFAULT, true),
        (GRPCIO_PERCENT, true),
        (GRPCIO_LOCALHOST, false),
    ] {
        let mut input = client_start();
        input.extend(frame(HEADERS, END_HEADERS, 1, &hex(block)));
        input.extend(frame(HEADERS, END_HEADERS, 3, &hex(GRPCIO_SECOND)));
        let (out, r) = rewrite(&input);
        let blocks = decode_output(&out);
        for i in 0..2 {
            let f = fields_of(&blocks, i);
            assert_eq!(get(&f, ":authority").as_deref(), Some("localhost"), "{f:?}");
            assert_eq!(get(&f, ":path").as_deref(), Some(GET_INFO));
            assert_eq!(
                get(&f, "user-agent").as_deref(),
                Some("grpc-python/1.85.1 grpc-c/58.0.0 (linux; chttp2)")
            );
        }
        assert_eq!(
            get(&fields_of(&blocks, 1), "grpc-timeout").as_deref(),
            Some("1010m")
        );
        assert_eq!(r.replaced(), if replaced { 2 } else { 0 });
    }
}

#[test]
fn any_split_of_the_stream_gives_the_same_output() {
    let mut input = client_start();
    let block = hex(GRPC_GO_PERCENT);
    // The first block over a HEADERS (padded, with priority) and two CONTINUATION frames.
    let mut headers = vec![3u8];
    headers.extend([0, 0, 0, 0, 15]);
    headers.extend_from_slice(&block[..20]);
    headers.extend([0; 3]);
    input.extend(frame(HEADERS, PADDED | PRIORITY, 1, &headers));
    input.extend(frame(CONTINUATION, 0, 1, &block[20..50]));
    input.extend(frame(CONTINUATION, END_HEADERS, 1, &block[50..]));
    input.extend(frame(0x0, END_STREAM, 1, &[0; 5]));
    input.extend(frame(0x8, 0, 0, &[0, 0, 0x10, 0]));
    input.extend(frame(
        HEADERS,
        END_HEADERS | END_STREAM,
        3,
        &hex(GRPC_GO_SECOND),
    ));
    let (whole, _) = rewrite(&input);

    let mut r = Rewriter::server();
    let mut bytewise = Vec::new();
    for b in &input {
        r.feed(std::slice::from_ref(b), &mut bytewise);
    }
    assert_eq!(bytewise, whole);
    for cut in 0..input.len() {
        let mut r = Rewriter::server();
        let mut out = Vec::new();
        r.feed(&input[..cut], &mut out);
        r.feed(&input[cut..], &mut out);
        assert_eq!(out, whole, "split at {cut}");
    }

    let blocks = decode_output(&whole);
    assert_eq!(blocks.len(), 2);
    assert_eq!(
        get(&fields_of(&blocks, 0), ":authority").as_deref(),
        Some("localhost")
    );
    assert_eq!(
        get(&fields_of(&blocks, 1), "user-agent").as_deref(),
        Some("grpc-go/1.33.3")
    );
    // The priority survived, padding did not, and END_STREAM stayed where it was.
    let first = &whole[PREFACE.len() + 9..];
    assert_eq!(first[3], HEADERS);
    assert_eq!(first[4], PRIORITY | END_HEADERS);
    assert_eq!(&first[9..14], &[0, 0, 0, 0, 15]);
}

#[test]
fn blocks_larger_than_a_frame_are_split_over_continuations() {
    let big = "x".repeat(40_000);
    let mut fields = request_fields(Some("%2Frun%2Fplugin.sock"));
    fields.push(("x-big", &big));
    let block = literal_block(&fields);
    let mut input = client_start();
    let mut chunks = block.chunks(MAX_FRAME);
    input.extend(frame(HEADERS, 0, 1, chunks.next().unwrap()));
    let rest: Vec<_> = chunks.collect();
    for (i, c) in rest.iter().enumerate() {
        let flags = if i + 1 == rest.len() { END_HEADERS } else { 0 };
        input.extend(frame(CONTINUATION, flags, 1, c));
    }
    let (out, _) = rewrite(&input);
    let blocks = decode_output(&out);
    let f = fields_of(&blocks, 0);
    assert_eq!(get(&f, "x-big").map(|v| v.len()), Some(40_000));
    assert_eq!(get(&f, ":authority").as_deref(), Some("localhost"));
    assert_eq!(
        frame_kinds(&out),
        vec![0x4, HEADERS, CONTINUATION, CONTINUATION]
    );
}

#[test]
fn valid_and_absent_authorities_are_left_alone() {
    for authority in [
        Some("localhost"),
        Some("[::]:50051"),
        Some("dra.sock"),
        None,
    ] {
        let mut input = client_start();
        input.extend(frame(
            HEADERS,
            END_HEADERS,
            1,
            &literal_block(&request_fields(authority)),
        ));
        let (out, r) = rewrite(&input);
        let blocks = decode_output(&out);
        assert_eq!(fields_of(&blocks, 0), request_fields(authority));
        assert_eq!(r.replaced(), 0);
    }
    // Everything h2 refuses in an authority is replaced: '%', '/', an empty value.
    for bad in ["%2Frun%2Fx.sock", "/run/x.sock", "run%2Fx.sock", ""] {
        let mut input = client_start();
        input.extend(frame(
            HEADERS,
            END_HEADERS,
            1,
            &literal_block(&request_fields(Some(bad))),
        ));
        let (out, r) = rewrite(&input);
        assert_eq!(
            fields_of(&decode_output(&out), 0),
            request_fields(Some("localhost")),
            "{bad:?}"
        );
        assert_eq!(r.replaced(), 1);
    }
}

#[test]
fn what_is_not_understood_reaches_h2_unchanged() {
    let cases: Vec<(&str, Vec<u8>)> = vec![
        // An index past the tables.
        ("bad index", frame(HEADERS, END_HEADERS, 1, &[0xff, 0x7f])),
        // A table size update over the 4 KiB h2 advertises.
        (
            "table too big",
            frame(HEADERS, END_HEADERS, 1, &[0x3f, 0xe1, 0x7f, 0x82]),
        ),
        // Padding longer than the payload.
        (
            "bad padding",
            frame(HEADERS, PADDED | END_HEADERS, 1, &[9, 0x82]),
        ),
        // HEADERS on stream 0.
        ("stream 0", frame(HEADERS, END_HEADERS, 0, &[0x82])),
        // A CONTINUATION with no block open.
        (
            "stray continuation",
            frame(CONTINUATION, END_HEADERS, 1, &[0x82]),
        ),
        // Another frame inside a header block.
        ("interleaved", {
            let mut f = frame(HEADERS, 0, 1, &[0x82]);
            f.extend(frame(0x8, 0, 0, &[0, 0, 0, 1]));
            f
        }),
        // A frame over 16 KiB.
        (
            "oversized",
            frame(HEADERS, END_HEADERS, 1, &vec![0x82; MAX_FRAME + 1]),
        ),
    ];
    for (what, bad) in cases {
        let mut input = client_start();
        input.extend_from_slice(&bad);
        let after = frame(0x8, 0, 0, &[0, 0, 0, 1]);
        input.extend_from_slice(&after);
        let (out, r) = rewrite(&input);
        assert_eq!(out, input, "{what}");
        assert!(r.passing_through(), "{what}");
    }
    // A truncated frame at the end of the connection reaches h2 too.
    let mut input = client_start();
    input.extend_from_slice(&frame(HEADERS, END_HEADERS, 1, &hex(GRPC_GO_PERCENT))[..30]);
    let (mut out, mut r) = rewrite(&input);
    r.finish(&mut out);
    assert_eq!(out, input);
}

// ---- h2 itself, through tonic: what the kubelet sees ----

#[derive(Default)]
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
            ..Default::default()
        }))
    }
    async fn notify_registration_status(
        &self,
        _: tonic::Request<RegistrationStatus>,
    ) -> Result<tonic::Response<RegistrationStatusResponse>, tonic::Status> {
        Ok(tonic::Response::new(RegistrationStatusResponse {}))
    }
}

/// What a tonic server made of each stream: the gRPC status of a completed call, or the error
/// code of a RST_STREAM.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Status(String),
    Reset(u32),
    GoAway(u32),
}

/// Serves one connection with or without the adapter, writes `input` (preface, requests) and
/// reads until every stream in `streams` ended.
async fn serve_one(adapted: bool, input: Vec<u8>, streams: &[u32]) -> Vec<(u32, Outcome)> {
    let (client, server) = tokio::net::UnixStream::pair().unwrap();
    let router = tonic::transport::Server::builder().add_service(RegistrationServer::new(Answer));
    let server_task = if adapted {
        let conns = futures::stream::iter([Ok::<_, std::io::Error>(
            super::super::KubeletStream::new(server),
        )]);
        tokio::spawn(async move { router.serve_with_incoming(conns).await })
    } else {
        let conns = futures::stream::iter([Ok::<_, std::io::Error>(server)]);
        tokio::spawn(async move { router.serve_with_incoming(conns).await })
    };
    let (mut rd, mut wr) = client.into_split();
    wr.write_all(&input).await.unwrap();
    // Acknowledge the server's SETTINGS so it proceeds.
    wr.write_all(&frame(0x4, 0x1, 0, &[])).await.unwrap();

    let mut decoder = loona_hpack::Decoder::new();
    let mut outcomes = Vec::new();
    let mut buf = Vec::new();
    let mut fragment = Vec::new();
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while outcomes.len() < streams.len()
        && !outcomes
            .iter()
            .any(|(_, o)| matches!(o, Outcome::GoAway(_)))
    {
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout_at(deadline, rd.read(&mut chunk))
            .await
            .expect("server answered every stream")
            .unwrap();
        assert!(n > 0, "server closed the connection; got {outcomes:?}");
        buf.extend_from_slice(&chunk[..n]);
        while buf.len() >= 9 {
            let len = usize::from(buf[0]) << 16 | usize::from(buf[1]) << 8 | usize::from(buf[2]);
            if buf.len() < 9 + len {
                break;
            }
            let f: Vec<u8> = buf.drain(..9 + len).collect();
            let (kind, flags) = (f[3], f[4]);
            let stream = u32::from_be_bytes(f[5..9].try_into().unwrap()) & 0x7fff_ffff;
            match kind {
                0x3 => outcomes.push((
                    stream,
                    Outcome::Reset(u32::from_be_bytes(f[9..13].try_into().unwrap())),
                )),
                0x7 => {
                    let code = u32::from_be_bytes(f[13..17].try_into().unwrap());
                    outcomes.push((0, Outcome::GoAway(code)));
                    break;
                }
                HEADERS | CONTINUATION => {
                    let frag = if kind == HEADERS {
                        split_headers_payload(flags, &f[9..]).unwrap().1.to_vec()
                    } else {
                        f[9..].to_vec()
                    };
                    fragment.extend(frag);
                    if flags & END_HEADERS != 0 {
                        let fields = decoder.decode(&fragment).unwrap();
                        fragment.clear();
                        if let Some((_, v)) = fields.iter().find(|(n, _)| n == b"grpc-status") {
                            outcomes.push((
                                stream,
                                Outcome::Status(String::from_utf8(v.clone()).unwrap()),
                            ));
                        }
                    }
                }
                _ => {}
            }
        }
    }
    server_task.abort();
    outcomes.sort_by_key(|(s, _)| *s);
    outcomes
}

/// A unary GetInfo on `stream` with this header block.
fn call(stream: u32, block: &[u8]) -> Vec<u8> {
    let mut b = frame(HEADERS, END_HEADERS, stream, block);
    b.extend(frame(0x0, END_STREAM, stream, &[0; 5]));
    b
}

const PROTOCOL_ERROR: u32 = 0x1;

fn ok() -> Outcome {
    Outcome::Status("0".into())
}

#[tokio::test]
async fn h2_accepts_every_kubelet_form_only_through_the_adapter() {
    let forms: [(&str, Vec<u8>, Vec<u8>, bool); 6] = [
        (
            "grpc-go raw path",
            hex(GRPC_GO_RAW_PATH),
            hex(GRPC_GO_SECOND),
            true,
        ),
        (
            "grpc-go percent-encoded",
            hex(GRPC_GO_PERCENT),
            hex(GRPC_GO_SECOND),
            true,
        ),
        (
            "grpcio default",
            hex(GRPCIO_DEFAULT),
            hex(GRPCIO_SECOND),
            true,
        ),
        (
            "grpcio percent-encoded",
            hex(GRPCIO_PERCENT),
            hex(GRPCIO_SECOND),
            true,
        ),
        (
            "localhost",
            hex(GRPCIO_LOCALHOST),
            hex(GRPCIO_SECOND),
            false,
        ),
        (
            "none",
            literal_block(&request_fields(None)),
            literal_block(&request_fields(None)),
            false,
        ),
    ];
    for (what, first, second, refused_by_h2) in forms {
        let mut input = client_start();
        input.extend(call(1, &first));
        input.extend(call(3, &second));
        let through = serve_one(true, input.clone(), &[1, 3]).await;
        assert_eq!(
            through,
            vec![(1, ok()), (3, ok())],
            "{what} through the adapter"
        );
        let bare = serve_one(false, input, &[1, 3]).await;
        let expect = if refused_by_h2 {
            vec![
                (1, Outcome::Reset(PROTOCOL_ERROR)),
                (3, Outcome::Reset(PROTOCOL_ERROR)),
            ]
        } else {
            vec![(1, ok()), (3, ok())]
        };
        assert_eq!(bare, expect, "{what} without the adapter");
    }
}

#[tokio::test]
async fn h2_still_refuses_requests_malformed_otherwise() {
    let with = |authority: &'static str, extra: &[(&'static str, &'static str)]| {
        let mut f = request_fields(Some(authority));
        f.extend_from_slice(extra);
        literal_block(&f)
    };
    let malformed: [(&str, Vec<u8>); 4] = [
        ("uppercase name", with("localhost", &[("X-Upper", "1")])),
        (
            "connection header",
            with("localhost", &[("connection", "keep-alive")]),
        ),
        (
            "pseudo-header after a regular one",
            with("localhost", &[(":status", "200")]),
        ),
        (
            "no :path",
            literal_block(&[
                (":method", "POST"),
                (":scheme", "http"),
                (":authority", "localhost"),
            ]),
        ),
    ];
    for (what, block) in malformed {
        // With an authority h2 accepts, the adapter changes nothing: the same verdict as bare h2.
        let mut input = client_start();
        input.extend(call(1, &block));
        let bare = serve_one(false, input.clone(), &[1]).await;
        assert_ne!(bare, vec![(1, ok())], "{what}: h2 accepts it");
        assert_eq!(serve_one(true, input, &[1]).await, bare, "{what}");

        // With grpc-go's authority as well, it is still refused the same way.
        let fields = decode_output(&{
            let mut b = client_start();
            b.extend(frame(HEADERS, END_HEADERS, 1, &block));
            b
        });
        let kubelet: Vec<(&str, &str)> = fields_of(&fields, 0)
            .into_iter()
            .map(|(n, v)| {
                if n == ":authority" {
                    (n, "%2Frun%2Fx.sock")
                } else {
                    (n, v)
                }
            })
            .collect();
        let mut input = client_start();
        input.extend(call(1, &literal_block(&kubelet)));
        assert_eq!(
            serve_one(true, input, &[1]).await,
            bare,
            "{what} with grpc-go's authority"
        );
    }

    // A good request after a refused one still works: the connection and the tables survived.
    // (h2 answers a connection-specific header with RST_STREAM; an uppercase name ends the
    // connection.)
    let mut input = client_start();
    input.extend(call(
        1,
        &with("%2Frun%2Fx.sock", &[("connection", "keep-alive")]),
    ));
    input.extend(call(3, &hex(GRPC_GO_PERCENT)));
    input.extend(call(5, &hex(GRPC_GO_SECOND)));
    assert_eq!(
        serve_one(true, input, &[1, 3, 5]).await,
        vec![(1, Outcome::Reset(PROTOCOL_ERROR)), (3, ok()), (5, ok())]
    );
}
