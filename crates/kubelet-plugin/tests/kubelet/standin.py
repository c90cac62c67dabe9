#!/usr/bin/env python3
"""A kubelet stand-in that the plugin under test did not write: grpcio (C-core) and a raw HTTP/2 client.

The kubelet is a grpc-go program. What it sends on a plugin's sockets differs from what the plugin's own
tonic clients send, above all in `:authority`: grpc-go sends
the percent-encoded socket path, older grpc-go the raw path, grpcio its own encoding of the path,
the device-plugin client `localhost`, and an HTTP/2 client need not send `:authority` at all.
This script plays the kubelet's calls over each of these and prints one JSON object per check on
stdout: {"form", "authority", "socket", "rpc", "ok", "detail" | "error"}. It exits 1 when any
check failed, 2 on bad usage.

Forms (`--form`, repeatable):
  grpc-go         grpcio with grpc.default_authority = the percent-encoded path (grpc-go today)
  raw-path        grpcio with grpc.default_authority = the path itself (grpc-go before 1.5x)
  grpcio-default  grpcio with no authority option (it sends the path, percent-encoded, without
                  its leading slash)
  localhost       grpcio with grpc.default_authority = localhost (the device-plugin client)
  none            the raw HTTP/2 client, with no :authority field at all
  hpack           the raw HTTP/2 client with the grpc-go authority: plain and Huffman strings, a
                  header block over HEADERS + CONTINUATION frames, a padded HEADERS frame with
                  priority, one byte per write, dynamic-table references and table size updates
                  on one connection
  malformed       the raw HTTP/2 client: requests malformed for reasons other than :authority,
                  each of which the server must still refuse (RST_STREAM PROTOCOL_ERROR or
                  GOAWAY; 431 for an over-size header list), with the grpc-go authority and
                  with localhost

Mode `device-plugin` (first argument) plays the kubelet's device manager instead: it SERVES
`<dir>/kubelet.sock` (`v1beta1.Registration/Register`), waits for the expected resources to
register, dials each plugin socket it was given with `:authority localhost` (as the kubelet's
device-plugin client does), and reports GetDevicePluginOptions, the first ListAndWatch list,
Allocate and GetPreferredAllocation answers, and with `--restart` a kubelet restart (its server
stopped, every socket in the directory removed, kubelet.sock served anew) and the
re-registration. See `device_plugin_main` for its options.

Mode `node` (first argument) plays the kubelet of a node running both paths, driven by the test:
it serves `<root>/device-plugins/kubelet.sock` and `<root>/pod-resources/kubelet.sock`
(`v1.PodResourcesLister/List`, answering the pods the test set), and reads one JSON command per
line on stdin, answering each with one JSON line on stdout. See `node_main` for the commands.

Stubs are generated from the repository's proto/ with grpc_tools.protoc at run time, into a
temporary directory, or into `--stubs-cache DIR`/<hash of protos and tool version>, reused while
the protos do not change.

Needs: python3 -m pip install grpcio==1.85.1 grpcio-tools==1.85.1 protobuf==7.36.2 hpack==4.2.0
"""

import argparse
import concurrent.futures
import hashlib
import importlib
import json
import os
import shutil
import socket
import struct
import sys
import tempfile
import urllib.parse

import grpc
import grpc_tools
import hpack
from grpc_tools import protoc

# Generated module name -> proto file under proto/. Flat module names: "dra-health" is not a
# Python package name, and every file is called api.proto.
PROTOS = {
    "registration_v1": "pluginregistration/v1/api.proto",
    "dra_v1": "dra/v1/api.proto",
    "dra_v1beta1": "dra/v1beta1/api.proto",
    "health_v1alpha1": "dra-health/v1alpha1/api.proto",
    "health_v1beta1": "dra-health/v1beta1/api.proto",
    "health_v1": "dra-health/v1/api.proto",
    "deviceplugin_v1beta1": "deviceplugin/v1beta1/api.proto",
    "podresources_v1": "podresources/v1/api.proto",
}

# What the kubelet passes per call (45 s in the kubelet); sent as grpc-timeout.
TIMEOUT_S = 20.0


# ---------------------------------------------------------------------------------------------
# Stubs


def stubs_key(proto_root):
    h = hashlib.sha256()
    h.update(grpc_tools.__file__.encode())
    h.update(getattr(grpc, "__version__", "?").encode())
    for name, rel in sorted(PROTOS.items()):
        h.update(name.encode())
        with open(os.path.join(proto_root, rel), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def generate_stubs(proto_root, out):
    src = os.path.join(out, "src")
    os.makedirs(src)
    files = []
    for name, rel in PROTOS.items():
        dst = os.path.join(src, name + ".proto")
        shutil.copyfile(os.path.join(proto_root, rel), dst)
        files.append(dst)
    args = ["protoc", "-I", src, "--python_out=" + out, "--grpc_python_out=" + out, *files]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"grpc_tools.protoc failed ({rc}) on {proto_root}")


def load_stubs(proto_root, cache):
    """Returns {name: (pb2 module, pb2_grpc module)}."""
    if cache:
        os.makedirs(cache, exist_ok=True)
        out = os.path.join(cache, "stubs-" + stubs_key(proto_root))
        if not os.path.isdir(out):
            tmp = tempfile.mkdtemp(dir=cache, prefix=".gen-")
            generate_stubs(proto_root, tmp)
            try:
                os.rename(tmp, out)
            except OSError:
                # Another process generated the same stubs first.
                shutil.rmtree(tmp, ignore_errors=True)
    else:
        out = tempfile.mkdtemp(prefix="kubelet-standin-")
        generate_stubs(proto_root, out)
    sys.path.insert(0, out)
    return {n: (importlib.import_module(n + "_pb2"), importlib.import_module(n + "_pb2_grpc")) for n in PROTOS}


# ---------------------------------------------------------------------------------------------
# Results


class Report:
    def __init__(self):
        self.failed = 0

    def emit(self, form, authority, sock, rpc, ok, **kw):
        rec = {"form": form, "authority": authority, "socket": sock, "rpc": rpc, "ok": ok}
        rec.update(kw)
        if not ok:
            self.failed += 1
        print(json.dumps(rec, sort_keys=False), flush=True)


class CheckFailed(Exception):
    pass


def run_check(report, form, authority, sock, rpc, fn):
    """Runs `fn` (which returns the check's detail) and reports it, passed or failed."""
    where = f"form {form} (:authority {authority!r}): {sock} {rpc}"
    try:
        detail = fn()
    except CheckFailed as e:
        report.emit(form, authority, sock, rpc, False, error=f"{where}: {e}")
    except Exception as e:  # noqa: BLE001 - every failure is a reported check
        report.emit(form, authority, sock, rpc, False, error=f"{where} failed: {rpc_error(e)}")
    else:
        report.emit(form, authority, sock, rpc, True, detail=detail)


def parse_claims(args):
    """[(uid, device)] from --claim UID=DEVICE."""
    return [tuple(c.split("=", 1)) for c in args.claim]


def expect(cond, what):
    if not cond:
        raise CheckFailed(what)


def rpc_error(e):
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        return f"gRPC status {e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"


def grpc_go_authority(path):
    """grpc-go's :authority for a dial target that is a bare socket path."""
    return urllib.parse.quote(path, safe="")


# ---------------------------------------------------------------------------------------------
# grpcio forms


def grpcio_authority(form, path):
    """(authority the form sends, channel options)."""
    if form == "grpc-go":
        a = grpc_go_authority(path)
    elif form == "raw-path":
        a = path
    elif form == "localhost":
        a = "localhost"
    elif form == "grpcio-default":
        # Not set by us: grpcio derives it from the target (observed: path without its leading
        # slash, percent-encoded).
        return urllib.parse.quote(path.lstrip("/"), safe=""), []
    else:
        raise ValueError(form)
    return a, [("grpc.default_authority", a)]


class Checks:
    def __init__(self, args, stubs, report):
        self.args = args
        self.stubs = stubs
        self.report = report

    # -- registration socket

    def check_info(self, info):
        a = self.args
        expect(info.type == "DRAPlugin", f"type {info.type!r}, want 'DRAPlugin'")
        expect(info.name == a.driver, f"name {info.name!r}, want {a.driver!r}")
        expect(info.endpoint == a.dra, f"endpoint {info.endpoint!r}, want the DRA socket {a.dra!r}")
        versions = list(info.supported_versions)
        for v in ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth",
                  "v1beta1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"):
            expect(v in versions, f"supported_versions {versions} lack {v!r}")
        return {"type": info.type, "name": info.name, "endpoint": info.endpoint,
                "supported_versions": versions}

    def registration(self, form):
        pb, pbg = self.stubs["registration_v1"]
        path = self.args.registration
        authority, options = grpcio_authority(form, path)
        with grpc.insecure_channel("unix://" + path, options=options) as ch:
            stub = pbg.RegistrationStub(ch)
            run = lambda rpc, fn: run_check(self.report, form, authority, "registration", rpc, fn)  # noqa: E731
            run("GetInfo", lambda: self.check_info(stub.GetInfo(pb.InfoRequest(), timeout=TIMEOUT_S)))

            def notify():
                stub.NotifyRegistrationStatus(pb.RegistrationStatus(plugin_registered=True), timeout=TIMEOUT_S)
                return {}
            run("NotifyRegistrationStatus", notify)

            def concurrent_info():
                futs = [stub.GetInfo.future(pb.InfoRequest(), timeout=TIMEOUT_S) for _ in range(8)]
                infos = [f.result() for f in futs]
                for i in infos:
                    self.check_info(i)
                return {"calls": len(infos)}
            run("GetInfo x8 concurrent", concurrent_info)
            # Later calls on the same channel: grpcio's encoder now refers to its dynamic table.
            run("GetInfo again", lambda: self.check_info(stub.GetInfo(pb.InfoRequest(), timeout=TIMEOUT_S)))

    # -- DRA socket

    def claim_msg(self, pb, uid):
        return pb.Claim(namespace=self.args.namespace, uid=uid, name=f"claim-{uid}")

    def check_prepared(self, resp, claims):
        a = self.args
        got = {}
        expect(set(resp.claims.keys()) == {u for u, _ in claims},
               f"entries for {sorted(resp.claims.keys())}, want {sorted(u for u, _ in claims)}")
        for uid, device in claims:
            r = resp.claims[uid]
            expect(r.error == "", f"claim {uid}: error {r.error!r}")
            ids = [i for d in r.devices for i in d.cdi_device_ids]
            want = f"k8s.{a.driver}/claim={uid}-{device}"
            expect(ids == [want], f"claim {uid}: CDI device ids {ids}, want [{want!r}]")
            d = r.devices[0]
            expect(d.device_name == device and d.pool_name == a.node,
                   f"claim {uid}: device {d.pool_name}/{d.device_name}, want {a.node}/{device}")
            got[uid] = ids
        return {"cdi_device_ids": got}

    def check_unprepared(self, resp, claims):
        expect(set(resp.claims.keys()) == {u for u, _ in claims},
               f"entries for {sorted(resp.claims.keys())}, want {sorted(u for u, _ in claims)}")
        for uid, _ in claims:
            expect(resp.claims[uid].error == "", f"claim {uid}: error {resp.claims[uid].error!r}")
        return {"claims": sorted(resp.claims.keys())}

    def dra(self, form):
        path = self.args.dra
        authority, options = grpcio_authority(form, path)
        claims = parse_claims(self.args)
        run = lambda rpc, fn: run_check(self.report, form, authority, "dra", rpc, fn)  # noqa: E731
        health_versions = ("v1alpha1", "v1beta1", "v1")
        # One channel for every call and the health streams, as the kubelet keeps one connection
        # per DRA plugin.
        with grpc.insecure_channel("unix://" + path, options=options) as ch:
            streams = {}
            for version in health_versions:
                hpb, hpbg = self.stubs["health_" + version]
                streams[version] = hpbg.DRAResourceHealthStub(ch).NodeWatchResources(
                    hpb.NodeWatchResourcesRequest(), timeout=TIMEOUT_S)

            for version in ("v1", "v1beta1"):
                pb, pbg = self.stubs["dra_" + version]
                stub = pbg.DRAPluginStub(ch)
                req = lambda m: m(claims=[self.claim_msg(pb, u) for u, _ in claims])  # noqa: E731
                run(f"{version} NodePrepareResources", lambda: self.check_prepared(
                    stub.NodePrepareResources(req(pb.NodePrepareResourcesRequest), timeout=TIMEOUT_S), claims))
                # Again: the kubelet re-prepares after a restart; the answer must not change.
                run(f"{version} NodePrepareResources again", lambda: self.check_prepared(
                    stub.NodePrepareResources(req(pb.NodePrepareResourcesRequest), timeout=TIMEOUT_S), claims))
                run(f"{version} NodeUnprepareResources", lambda: self.check_unprepared(
                    stub.NodeUnprepareResources(req(pb.NodeUnprepareResourcesRequest), timeout=TIMEOUT_S), claims))

            pb, pbg = self.stubs["dra_v1"]
            stub = pbg.DRAPluginStub(ch)

            def concurrent(method, check, msg):
                futs = [(c, getattr(stub, method).future(msg(claims=[self.claim_msg(pb, c[0])]), timeout=TIMEOUT_S))
                        for c in claims]
                for c, f in futs:
                    check(f.result(), [c])
                return {"calls": len(futs)}
            n = len(claims)
            run(f"v1 NodePrepareResources x{n} concurrent",
                lambda: concurrent("NodePrepareResources", self.check_prepared, pb.NodePrepareResourcesRequest))
            run(f"v1 NodeUnprepareResources x{n} concurrent",
                lambda: concurrent("NodeUnprepareResources", self.check_unprepared, pb.NodeUnprepareResourcesRequest))

            def first_health(stream):
                msg = next(stream)
                devices = [(d.device.pool_name, d.device.device_name) for d in msg.devices]
                expect(devices, "the first message lists no device")
                for _, device in claims:
                    expect((self.args.node, device) in devices,
                           f"the first message lacks {self.args.node}/{device}: {devices}")
                stream.cancel()
                return {"devices": len(devices)}
            for version in health_versions:
                run(f"{version}.DRAResourceHealth/NodeWatchResources first message",
                    lambda: first_health(streams[version]))


# ---------------------------------------------------------------------------------------------
# Raw HTTP/2 client

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
ERROR_CODES = {0: "NO_ERROR", 1: "PROTOCOL_ERROR", 2: "INTERNAL_ERROR", 3: "FLOW_CONTROL_ERROR",
               5: "STREAM_CLOSED", 6: "FRAME_SIZE_ERROR", 7: "REFUSED_STREAM", 8: "CANCEL",
               9: "COMPRESSION_ERROR", 11: "ENHANCE_YOUR_CALM"}
FRAME_NAMES = ["DATA", "HEADERS", "PRIORITY", "RST_STREAM", "SETTINGS", "PUSH_PROMISE", "PING",
               "GOAWAY", "WINDOW_UPDATE", "CONTINUATION"]


def code_name(c):
    return ERROR_CODES.get(c, str(c))


class Response:
    def __init__(self):
        self.headers = []      # decoded header blocks for the stream, in order
        self.data = b""
        self.rst = None        # RST_STREAM error code
        self.goaway = None     # (last stream id, error code, debug data)
        self.closed = False    # EOF without GOAWAY
        self.frames = []       # a log of what came back, for messages

    def field(self, name):
        for block in self.headers:
            for k, v in block:
                if k == name:
                    return v
        return None

    def messages(self):
        out, b = [], self.data
        while len(b) >= 5:
            n = struct.unpack(">I", b[1:5])[0]
            out.append(b[5:5 + n])
            b = b[5 + n:]
        return out

    def describe(self):
        if self.rst is not None:
            return f"RST_STREAM({code_name(self.rst)})"
        if self.goaway is not None:
            last, code, debug = self.goaway
            return f"GOAWAY({code_name(code)}, last stream {last}, {debug!r})"
        if self.closed:
            return "connection closed without GOAWAY"
        return f"headers {self.headers}, grpc-status {self.field('grpc-status')!r} {self.field('grpc-message')!r}"

    def grpc_ok(self):
        return self.rst is None and self.goaway is None and self.field(":status") == "200" \
            and self.field("grpc-status") == "0"

    def refused(self):
        """Refused as a malformed request: RST_STREAM(PROTOCOL_ERROR) or a GOAWAY with an error."""
        if self.rst is not None:
            return self.rst == 1
        if self.goaway is not None:
            return self.goaway[1] in (1, 9)
        return False


class H2:
    """One HTTP/2 connection over a Unix socket, frames written by hand, HPACK by `hpack`."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(TIMEOUT_S)
        self.sock.connect(path)
        self.enc = hpack.Encoder()
        self.dec = hpack.Decoder()
        self.next_stream = 1
        self.buf = b""
        self.sock.sendall(PREFACE + self.frame(SETTINGS, 0, 0, b""))

    def close(self):
        self.sock.close()

    @staticmethod
    def frame(typ, flags, stream, payload):
        return len(payload).to_bytes(3, "big") + bytes([typ, flags]) + struct.pack(">I", stream) + payload

    def recv_exact(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read_frame(self):
        h = self.recv_exact(9)
        n = int.from_bytes(h[:3], "big")
        return h[3], h[4], struct.unpack(">I", h[5:9])[0] & 0x7FFFFFFF, self.recv_exact(n)

    def headers_frames(self, stream, block, cuts=(), pad=None, priority=False):
        """HEADERS (with `pad` bytes of padding, with the PRIORITY fields), then one
        CONTINUATION per cut offset into `block`: (bytes, CONTINUATIONs)."""
        bounds = [0, *sorted(c for c in set(cuts) if 0 < c < len(block)), len(block)]
        parts = [block[a:b] for a, b in zip(bounds, bounds[1:])]
        out = b""
        for i, part in enumerate(parts):
            flags = END_HEADERS if i == len(parts) - 1 else 0
            if i == 0:
                if priority:
                    # Depends on stream 0, not exclusive, weight 16.
                    flags |= PRIORITY_FLAG
                    part = struct.pack(">IB", 0, 15) + part
                if pad is not None:
                    flags |= PADDED
                    part = bytes([pad]) + part + b"\0" * pad
                out += self.frame(HEADERS, flags, stream, part)
            else:
                out += self.frame(CONTINUATION, flags, stream, part)
        return out, len(parts) - 1

    def request_headers(self, path, authority, extra=()):
        h = [(":method", "POST"), (":scheme", "http"), (":path", path)]
        if authority is not None:
            h.append((":authority", authority))
        h += [("content-type", "application/grpc"), ("user-agent", "kubelet-standin"),
              ("te", "trailers"), ("grpc-timeout", "20S")]
        return h + list(extra)

    def call(self, path, message, authority, *, headers=None, huffman=True, cuts=(), pad=None,
             priority=False, bytewise=False):
        """Sends one unary gRPC request (`bytewise`: one byte per write); returns (Response,
        header block bytes, CONTINUATION count)."""
        stream = self.next_stream
        self.next_stream += 2
        if headers is None:
            headers = self.request_headers(path, authority)
        block = self.enc.encode(headers, huffman=huffman)
        frames, continuations = self.headers_frames(stream, block, cuts, pad, priority)
        frames += self.frame(DATA, END_STREAM, stream, b"\0" + struct.pack(">I", len(message)) + message)
        try:
            if bytewise:
                for i in range(len(frames)):
                    self.sock.sendall(frames[i:i + 1])
            else:
                # One write: a server that refuses the headers with a GOAWAY and closes has
                # then read everything, and its GOAWAY is not lost to a reset.
                self.sock.sendall(frames)
        except (BrokenPipeError, ConnectionResetError):
            pass  # what it answered before closing is still to be read
        return self.read_response(stream), block, continuations

    def read_response(self, stream):
        r = Response()
        try:
            while True:
                typ, flags, sid, payload = self.read_frame()
                r.frames.append(f"{FRAME_NAMES[typ] if typ < len(FRAME_NAMES) else typ} flags={flags:#x} stream={sid} len={len(payload)}")
                if typ == SETTINGS and not flags & ACK:
                    self.sock.sendall(self.frame(SETTINGS, ACK, 0, b""))
                elif typ == PING and not flags & ACK:
                    self.sock.sendall(self.frame(PING, ACK, 0, payload))
                elif typ == GOAWAY:
                    last, code = struct.unpack(">II", payload[:8])
                    r.goaway = (last & 0x7FFFFFFF, code, payload[8:])
                    return r
                elif typ == RST_STREAM and sid == stream:
                    r.rst = struct.unpack(">I", payload[:4])[0]
                    return r
                elif typ == HEADERS:
                    frag = payload
                    if flags & PADDED:
                        frag = frag[1:len(frag) - frag[0]]
                    if flags & PRIORITY_FLAG:
                        frag = frag[5:]
                    end = flags & END_STREAM
                    while not flags & END_HEADERS:
                        typ, flags, _, cont = self.read_frame()
                        if typ != CONTINUATION:
                            raise CheckFailed(f"frame type {typ} inside a header block")
                        frag += cont
                    # Decode every block, whichever stream: the table is the connection's.
                    block = [(k.decode(), v.decode()) for k, v in self.dec.decode(frag, raw=True)]
                    if sid == stream:
                        r.headers.append(block)
                        if end:
                            return r
                elif typ == DATA and sid == stream:
                    data = payload
                    if flags & PADDED:
                        data = data[1:len(data) - data[0]]
                    r.data += data
                    if data:
                        # Give the window back so long runs of calls never stall.
                        inc = struct.pack(">I", len(payload))
                        self.sock.sendall(self.frame(WINDOW_UPDATE, 0, 0, inc) + self.frame(WINDOW_UPDATE, 0, stream, inc))
                    if flags & END_STREAM:
                        return r
        except (EOFError, ConnectionResetError, BrokenPipeError):
            r.closed = True
            return r


def dynamic_refs(block):
    """How many fields of `block` are indexed references into the dynamic table (index > 61),
    as single-byte indexed fields (the only kind a small table produces)."""
    n = i = 0
    # Walk the block as hpack's encoder writes it: indexed fields (1xxxxxxx) are one byte for
    # small indexes; anything else ends the count (literals make the walk ambiguous).
    while i < len(block) and block[i] & 0x80:
        idx = block[i] & 0x7F
        if idx == 0x7F:
            break
        if idx > 61:
            n += 1
        i += 1
    return n


class Raw:
    def __init__(self, args, stubs, report):
        self.args = args
        self.stubs = stubs
        self.report = report

    def info_request(self):
        pb, _ = self.stubs["registration_v1"]
        return pb.InfoRequest().SerializeToString()

    def parse_info(self, r):
        pb, _ = self.stubs["registration_v1"]
        msgs = r.messages()
        expect(len(msgs) == 1, f"{len(msgs)} messages in the response")
        info = pb.PluginInfo.FromString(msgs[0])
        expect(info.endpoint == self.args.dra, f"endpoint {info.endpoint!r}, want {self.args.dra!r}")
        expect(info.type == "DRAPlugin", f"type {info.type!r}")
        return info

    def checked(self, form, authority, sock, rpc, fn):
        run_check(self.report, form, authority, sock, rpc, fn)

    def expect_ok(self, r, what):
        expect(r.grpc_ok(), f"{what}: {r.describe()}; frames {r.frames}")

    # -- form "none": no :authority at all

    def no_authority(self):
        form = "none"
        reg, dra = self.args.registration, self.args.dra

        def get_info():
            c = H2(reg)
            try:
                r, _, _ = c.call("/pluginregistration.Registration/GetInfo", self.info_request(), None)
                self.expect_ok(r, "GetInfo without :authority")
                info = self.parse_info(r)
                return {"endpoint": info.endpoint}
            finally:
                c.close()
        self.checked(form, None, "registration", "GetInfo", get_info)

        def prepare_unprepare():
            pb, _ = self.stubs["dra_v1"]
            claims = [pb.Claim(namespace=self.args.namespace, uid=u, name=f"claim-{u}")
                      for u, _ in parse_claims(self.args)]
            svc = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/"
            c = H2(dra)
            try:
                r, _, _ = c.call(svc + "NodePrepareResources",
                                 pb.NodePrepareResourcesRequest(claims=claims).SerializeToString(), None)
                self.expect_ok(r, "NodePrepareResources without :authority")
                resp = pb.NodePrepareResourcesResponse.FromString(r.messages()[0])
                ids = {}
                for claim in claims:
                    e = resp.claims[claim.uid]
                    expect(e.error == "" and e.devices, f"claim {claim.uid}: {e}")
                    ids[claim.uid] = [i for d in e.devices for i in d.cdi_device_ids]
                r, _, _ = c.call(svc + "NodeUnprepareResources",
                                 pb.NodeUnprepareResourcesRequest(claims=claims).SerializeToString(), None)
                self.expect_ok(r, "NodeUnprepareResources without :authority")
                resp = pb.NodeUnprepareResourcesResponse.FromString(r.messages()[0])
                for claim in claims:
                    expect(resp.claims[claim.uid].error == "", f"unprepare {claim.uid}: {resp.claims[claim.uid]}")
                return {"cdi_device_ids": ids}
            finally:
                c.close()
        self.checked(form, None, "dra", "v1 NodePrepareResources + NodeUnprepareResources", prepare_unprepare)

    # -- form "hpack": the grpc-go authority in every encoding HPACK allows

    def hpack_forms(self):
        form = "hpack"
        path = self.args.registration
        authority = grpc_go_authority(path)
        method = "/pluginregistration.Registration/GetInfo"

        for huffman in (False, True):
            def one(huffman=huffman):
                c = H2(path)
                try:
                    r, block, _ = c.call(method, self.info_request(), authority, huffman=huffman)
                    # The authority string is in the block verbatim only when not Huffman-coded.
                    expect((authority.encode() in block) == (not huffman),
                           f"huffman={huffman}: the encoder did not write the form asked for")
                    self.expect_ok(r, f"GetInfo, huffman={huffman}")
                    self.parse_info(r)
                    return {"block_len": len(block)}
                finally:
                    c.close()
            self.checked(form, authority, "registration",
                         "GetInfo, Huffman-coded strings" if huffman else "GetInfo, plain strings", one)

        for huffman in (False, True):
            def continuation(huffman=huffman):
                c = H2(path)
                try:
                    headers = c.request_headers(method, authority)
                    # Where :authority starts: a fresh encoder writes the fields before it
                    # exactly as the connection's fresh encoder will.
                    before = headers[:headers.index((":authority", authority))]
                    at = len(hpack.Encoder().encode(before, huffman=huffman))
                    # Cuts inside the :authority field: after its first byte (between the
                    # representation and the length), and twice inside the string; plus one
                    # in the first field. h2 allows a handful of CONTINUATIONs per block.
                    cuts = (1, at + 1, at + 3, at + 9)
                    r, block, n = c.call(method, self.info_request(), authority, huffman=huffman, cuts=cuts)
                    expect(n == 4, f"sent {n} CONTINUATION frames, meant 4 (block of {len(block)} bytes)")
                    self.expect_ok(r, f"GetInfo over HEADERS + {n} CONTINUATION")
                    self.parse_info(r)
                    return {"continuations": n, "block_len": len(block), "authority_at": at}
                finally:
                    c.close()
            self.checked(form, authority, "registration",
                         f"GetInfo over HEADERS + CONTINUATION ({'Huffman' if huffman else 'plain'})", continuation)

        def padded_with_priority():
            c = H2(path)
            try:
                r, _, _ = c.call(method, self.info_request(), authority, pad=7, priority=True)
                self.expect_ok(r, "GetInfo, HEADERS padded and with PRIORITY")
                self.parse_info(r)
                return {}
            finally:
                c.close()
        self.checked(form, authority, "registration", "GetInfo, HEADERS with padding and priority",
                     padded_with_priority)

        def bytewise():
            c = H2(path)
            try:
                for i in range(2):
                    r, _, _ = c.call(method, self.info_request(), authority, bytewise=True)
                    self.expect_ok(r, f"GetInfo {i + 1} written one byte at a time")
                    self.parse_info(r)
                return {"requests": 2}
            finally:
                c.close()
        self.checked(form, authority, "registration", "GetInfo x2 written one byte per write", bytewise)

        def dynamic_table():
            c = H2(path)
            try:
                steps = []
                # 1: every field a literal with incremental indexing; the table learns them.
                r, b1, _ = c.call(method, self.info_request(), authority)
                self.expect_ok(r, "request 1 (literals, indexed into the table)")
                self.parse_info(r)
                expect(dynamic_refs(b1) == 0, f"request 1 already refers to the table: {b1.hex()}")
                steps.append({"block": b1.hex(), "dynamic_refs": 0})
                # 2: the same fields, now references into the dynamic table (:authority too).
                r, b2, _ = c.call(method, self.info_request(), authority)
                self.expect_ok(r, "request 2 (dynamic-table references)")
                self.parse_info(r)
                # Every field a one-byte index: the two static ones (:method POST, :scheme http)
                # and the rest from the dynamic table.
                n = len(c.request_headers(method, authority))
                refs = dynamic_refs(b2)
                expect(len(b2) == n and refs == n - 2, f"request 2 is not all table references: {b2.hex()}")
                steps.append({"block": b2.hex(), "dynamic_refs": refs})
                # 3: a table size update to 0 (the table empties) and literals again.
                c.enc.header_table_size = 0
                r, b3, _ = c.call(method, self.info_request(), authority)
                self.expect_ok(r, "request 3 (table size update to 0, then literals)")
                self.parse_info(r)
                expect(b3[0] == 0x20, f"request 3 does not start with a size update to 0: {b3.hex()}")
                steps.append({"block": b3.hex(), "dynamic_refs": dynamic_refs(b3)})
                # 4 and 5: back to 4096 (literals indexed anew), then references to the new entries.
                c.enc.header_table_size = 4096
                r, b4, _ = c.call(method, self.info_request(), authority)
                self.expect_ok(r, "request 4 (size update to 4096, literals indexed anew)")
                self.parse_info(r)
                r, b5, _ = c.call(method, self.info_request(), authority)
                self.expect_ok(r, "request 5 (references to the re-learned entries)")
                self.parse_info(r)
                expect(len(b5) == n and dynamic_refs(b5) == n - 2, f"request 5 is not all table references: {b5.hex()}")
                steps += [{"block": b4.hex(), "dynamic_refs": dynamic_refs(b4)},
                          {"block": b5.hex(), "dynamic_refs": dynamic_refs(b5)}]
                # 6: a different authority that shares the name entry, then the first again
                # (its entry has moved down the table).
                other = grpc_go_authority(self.args.dra)
                r, b6, _ = c.call(method, self.info_request(), other)
                self.expect_ok(r, "request 6 (another percent-encoded authority)")
                r, b7, _ = c.call(method, self.info_request(), authority)
                self.expect_ok(r, "request 7 (the first authority, moved down the table)")
                self.parse_info(r)
                steps += [{"block": b6.hex(), "dynamic_refs": dynamic_refs(b6)},
                          {"block": b7.hex(), "dynamic_refs": dynamic_refs(b7)}]
                return {"requests": steps}
            finally:
                c.close()
        self.checked(form, authority, "registration", "GetInfo x7 on one connection (dynamic table)", dynamic_table)

    # -- form "malformed": h2's other checks stay

    def malformed(self):
        form = "malformed"
        path = self.args.registration
        method = "/pluginregistration.Registration/GetInfo"
        cases = [
            ("uppercase header name", lambda h: h + [("X-Kubelet", "1")]),
            ("connection: keep-alive", lambda h: h + [("connection", "keep-alive")]),
            ("te: gzip", lambda h: [x for x in h if x[0] != "te"] + [("te", "gzip")]),
            ("two :authority fields", lambda h: h[:4] + [h[3]] + h[4:]),
            (":authority after a regular field", lambda h: h[:3] + h[4:] + [h[3]]),
            ("no :path", lambda h: [x for x in h if x[0] != ":path"]),
        ]
        for authority in (grpc_go_authority(path), "localhost"):
            def oversize(authority=authority):
                c = H2(path)
                try:
                    # 20000 bytes of metadata: one frame Huffman-coded, over the server's 16 KiB
                    # header list limit once decoded (and more than one frame written plain).
                    headers = c.request_headers(method, authority, [("x-big", "0" * 20000)])
                    r, block, _ = c.call(method, self.info_request(), authority, headers=headers)
                    expect(len(block) < 16384, f"the block is {len(block)} bytes, meant one frame")
                    status = r.field(":status")
                    expect(status == "431" or r.rst in (1, 7),
                           f"an over-size header list was not refused: {r.describe()}; frames {r.frames}")
                    answer = r.describe() if status != "431" else "431"
                    # The connection's HPACK state survived: a valid request still works.
                    r, _, _ = c.call(method, self.info_request(), authority)
                    self.expect_ok(r, "the valid request after the over-size one")
                    return {"answer": answer}
                finally:
                    c.close()
            self.checked(form, authority, "registration",
                         "GetInfo with a header list over 16 KiB is refused", oversize)
            for name, mangle in cases:
                def one(mangle=mangle, name=name, authority=authority):
                    c = H2(path)
                    try:
                        # A valid call first, so the malformed block may refer to the table.
                        r, _, _ = c.call(method, self.info_request(), authority)
                        self.expect_ok(r, "the valid request before the malformed one")
                        headers = mangle(c.request_headers(method, authority))
                        r, block, _ = c.call(method, self.info_request(), authority, headers=headers)
                        expect(r.refused(), f"{name} was not refused: {r.describe()}; frames {r.frames}")
                        return {"answer": r.describe()}
                    finally:
                        c.close()
                self.checked(form, authority, "registration", f"GetInfo with {name} is refused", one)


# ---------------------------------------------------------------------------------------------
# device-plugin mode: the kubelet's device manager


class FakeKubelet:
    """The Registration service; refuses the first `refuse` calls as a kubelet refuses a
    registration (an error status), records the others."""

    def __init__(self, pb, refuse):
        self.pb = pb
        self.refuse = refuse
        self.cond = __import__("threading").Condition()
        self.registered = {}
        self.refused = []

    def Register(self, request, context):  # noqa: N802 - the gRPC method name
        with self.cond:
            if request.version != "v1beta1":
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version!r}")
            if self.refuse > 0:
                self.refuse -= 1
                self.refused.append(request.resource_name)
                context.abort(grpc.StatusCode.UNAVAILABLE, "refused by the stand-in")
            self.registered[request.resource_name] = request
            self.cond.notify_all()
        return self.pb.Empty()

    def wait(self, names, timeout):
        import time
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(n in self.registered for n in names):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CheckFailed(f"registered {sorted(self.registered)}, want {sorted(names)} within {timeout} s")
                self.cond.wait(left)
            return dict(self.registered)


def serve_kubelet(stubs, path, refuse):
    pb, pbg = stubs["deviceplugin_v1beta1"]
    kubelet = FakeKubelet(pb, refuse)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
    pbg.add_RegistrationServicer_to_server(kubelet, server)
    if server.add_insecure_port("unix://" + path) == 0:
        raise SystemExit(f"cannot serve {path}")
    server.start()
    return server, kubelet


def resolve_ids(spec, ids):
    """`@N` is the N-th ID of the first list; anything else is taken as it is."""
    if not spec:
        return []
    return [ids[int(x[1:])] if x.startswith("@") else x for x in spec.split(",")]


def device_plugin_main(argv):
    import time
    p = argparse.ArgumentParser(prog="standin.py device-plugin")
    p.add_argument("--proto-root", required=True)
    p.add_argument("--stubs-cache")
    p.add_argument("--dir", required=True, help="the kubelet's device-plugins directory")
    p.add_argument("--expect", action="append", required=True, metavar="RESOURCE",
                   help="a resource that must register")
    p.add_argument("--allocate", action="append", default=[], metavar="RESOURCE=IDS",
                   help="Allocate one container; IDS: comma list, @N = N-th ID of the first list")
    p.add_argument("--preferred", action="append", default=[], metavar="RESOURCE=SIZE[:MUST[:AVAILABLE]]",
                   help="GetPreferredAllocation; AVAILABLE defaults to the whole first list")
    p.add_argument("--restart", action="store_true", help="then restart the kubelet once")
    p.add_argument("--refuse-first", type=int, default=0, help="refuse the first N registrations")
    p.add_argument("--timeout", type=float, default=30.0)
    a = p.parse_args(argv)
    stubs = load_stubs(a.proto_root, a.stubs_cache)
    pb, pbg = stubs["deviceplugin_v1beta1"]
    report = Report()
    kubelet_sock = os.path.join(a.dir, "kubelet.sock")
    os.makedirs(a.dir, exist_ok=True)
    server, kubelet = serve_kubelet(stubs, kubelet_sock, a.refuse_first)
    print(json.dumps({"event": "serving", "socket": kubelet_sock}), flush=True)
    lists = {}
    run = lambda sock, rpc, fn: run_check(report, "device-plugin", "localhost", sock, rpc, fn)  # noqa: E731

    def channel(endpoint):
        return grpc.insecure_channel("unix://" + os.path.join(a.dir, endpoint),
                                     options=[("grpc.default_authority", "localhost")])

    def first_list(stub):
        stream = stub.ListAndWatch(pb.Empty(), timeout=TIMEOUT_S)
        msg = next(stream)
        stream.cancel()
        return [{"id": d.ID, "health": d.health, "numa": [n.ID for n in d.topology.nodes]}
                for d in msg.devices]

    def registrations(rpc):
        regs = kubelet.wait(a.expect, a.timeout)
        out = {}
        for name in a.expect:
            r = regs[name]
            expect("/" not in r.endpoint, f"endpoint {r.endpoint!r} is not a file name")
            expect(os.path.exists(os.path.join(a.dir, r.endpoint)), f"no socket {r.endpoint} in {a.dir}")
            expect(r.options.get_preferred_allocation_available, "get_preferred_allocation_available is false")
            out[name] = {"version": r.version, "endpoint": r.endpoint, "resource_name": r.resource_name,
                         "preferred": r.options.get_preferred_allocation_available,
                         "pre_start_required": r.options.pre_start_required}
        return {"resources": out, "refused": list(kubelet.refused),
                "unexpected": sorted(set(regs) - set(a.expect))}

    regs = {}

    def first_registration():
        d = registrations("Register")
        regs.update(d["resources"])
        return d
    run("kubelet", "Register", first_registration)
    if not regs:
        server.stop(0)
        return 1
    stubs_by = {}
    for name, r in regs.items():
        ch = channel(r["endpoint"])
        stub = pbg.DevicePluginStub(ch)
        stubs_by[name] = stub

        def options(stub=stub):
            o = stub.GetDevicePluginOptions(pb.Empty(), timeout=TIMEOUT_S)
            return {"preferred": o.get_preferred_allocation_available, "pre_start_required": o.pre_start_required}
        run(name, "GetDevicePluginOptions", options)

        def listed(stub=stub, name=name):
            lists[name] = first_list(stub)
            return {"resource": name, "devices": lists[name]}
        run(name, "ListAndWatch", listed)

    for spec in a.allocate:
        name, ids = spec.split("=", 1)

        def allocate(name=name, ids=ids):
            want = resolve_ids(ids, [d["id"] for d in lists.get(name, [])])
            req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=want)])
            out = {"resource": name, "ids": want}
            try:
                resp = stubs_by[name].Allocate(req, timeout=TIMEOUT_S)
            except grpc.RpcError as e:
                out.update(ok=False, code=e.code().name, message=e.details())
                return out
            c = resp.container_responses[0]
            out.update(ok=True, envs=dict(c.envs), annotations=dict(c.annotations),
                       cdi_devices=[d.name for d in c.cdi_devices],
                       mounts=[{"container_path": m.container_path, "host_path": m.host_path} for m in c.mounts],
                       devices=[{"container_path": d.container_path, "host_path": d.host_path} for d in c.devices])
            return out
        run(name, "Allocate", allocate)

    for spec in a.preferred:
        name, rest = spec.split("=", 1)
        parts = rest.split(":", 2)

        def preferred(name=name, parts=parts):
            ids = [d["id"] for d in lists.get(name, [])]
            size = int(parts[0])
            must = resolve_ids(parts[1], ids) if len(parts) > 1 else []
            avail = resolve_ids(parts[2], ids) if len(parts) > 2 and parts[2] else ids
            req = pb.PreferredAllocationRequest(container_requests=[pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=avail, must_include_deviceIDs=must, allocation_size=size)])
            resp = stubs_by[name].GetPreferredAllocation(req, timeout=TIMEOUT_S)
            return {"resource": name, "size": size, "must": must, "available": avail,
                    "ids": list(resp.container_responses[0].deviceIDs)}
        run(name, "GetPreferredAllocation", preferred)

    if a.restart:
        # What a new kubelet does: its old server is gone, every socket in the directory is
        # removed, then kubelet.sock is served again.
        server.stop(0).wait()
        for f in os.listdir(a.dir):
            if f.endswith(".sock"):
                os.unlink(os.path.join(a.dir, f))
        t0 = time.monotonic()
        server, kubelet = serve_kubelet(stubs, kubelet_sock, 0)

        def again():
            d = registrations("Register after restart")
            d["seconds"] = round(time.monotonic() - t0, 3)
            return d
        run("kubelet", "Register after restart", again)
        for name in a.expect:
            r = kubelet.registered.get(name)
            if r is None:
                continue

            def relisted(r=r, name=name):
                return {"resource": name, "devices": first_list(pbg.DevicePluginStub(channel(r.endpoint)))}
            run(name, "ListAndWatch after restart", relisted)
    server.stop(0)
    return 1 if report.failed else 0


# ---------------------------------------------------------------------------------------------
# node mode: both paths, driven line by line


class PodResources:
    """`v1.PodResourcesLister`: answers List with the pods the test set, counting the calls."""

    def __init__(self, pb):
        import threading
        self.pb = pb
        self.cond = threading.Condition()
        self.pods = []
        self.lists = 0

    def List(self, request, context):  # noqa: N802 - the gRPC method name
        pb = self.pb
        with self.cond:
            pods = list(self.pods)
            self.lists += 1
            self.cond.notify_all()
        return pb.ListPodResourcesResponse(pod_resources=[
            pb.PodResources(name=p["name"], namespace=p["namespace"], containers=[
                pb.ContainerResources(name=c["name"], devices=[
                    pb.ContainerDevices(resource_name=d["resource"], device_ids=d["ids"])
                    for d in c.get("devices", [])])
                for c in p.get("containers", [])])
            for p in pods])

    def GetAllocatableResources(self, request, context):  # noqa: N802
        return self.pb.AllocatableResourcesResponse()

    def Get(self, request, context):  # noqa: N802
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "the stand-in answers List only")

    def set_pods(self, pods):
        with self.cond:
            self.pods = pods
            return self.lists

    def wait_lists(self, n, timeout):
        import time
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.lists < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CheckFailed(f"{self.lists} PodResources List calls, want {n} within {timeout} s")
                self.cond.wait(left)
            return self.lists


class Watch:
    """One ListAndWatch stream, read by a thread into a list of messages."""

    def __init__(self, stub, pb):
        import threading
        self.cond = threading.Condition()
        self.lists = []
        self.error = None
        self.stream = stub.ListAndWatch(pb.Empty())
        threading.Thread(target=self.read, daemon=True).start()

    def read(self):
        try:
            for msg in self.stream:
                devices = [{"id": d.ID, "health": d.health} for d in msg.devices]
                with self.cond:
                    self.lists.append(devices)
                    self.cond.notify_all()
        except grpc.RpcError as e:
            with self.cond:
                self.error = rpc_error(e)
                self.cond.notify_all()

    def wait(self, pred, timeout):
        """The first list (of all received so far, then new ones) for which pred holds."""
        import time
        deadline = time.monotonic() + timeout
        seen = 0
        with self.cond:
            while True:
                for i in range(seen, len(self.lists)):
                    if pred(self.lists[i]):
                        return i, self.lists[i]
                seen = len(self.lists)
                if self.error:
                    raise CheckFailed(f"ListAndWatch ended: {self.error}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CheckFailed(f"no such list within {timeout} s; last {self.lists[-1:]}")
                self.cond.wait(left)


def node_main(argv):
    """Commands (one JSON object per line; each answered by {"ok": true, ...} or
    {"ok": false, "error": ...}):
      {"op": "registered", "names": [...]}         wait until these resources registered
      {"op": "watch", "resource": R}               open ListAndWatch; answers the first list
      {"op": "until", "resource": R, "id": ID, "health": H}
                                                   wait for a list (the first one included) in
                                                   which device ID has health H; answers it and
                                                   its position in the stream
      {"op": "allocate", "resource": R, "ids": [...]}
                                                   Allocate for one container; answers code/message
      {"op": "pods", "pods": [{"namespace", "name", "containers": [{"name", "devices":
         [{"resource", "ids"}]}]}], "wait": true}
                                                   what PodResources List answers from now on;
                                                   answers once the plugin has called List since
                                                   (at once with "wait": false)
      {"op": "prepare" | "unprepare", "claims": [{"namespace", "name", "uid"}]}
                                                   v1 NodePrepare/UnprepareResources on --dra with
                                                   grpc-go's authority; answers per-claim results
                                                   (prepare: error, and per device its name,
                                                   shareID or null, and CDI device ids)
      {"op": "quit"}
    """
    p = argparse.ArgumentParser(prog="standin.py node")
    p.add_argument("--proto-root", required=True)
    p.add_argument("--stubs-cache")
    p.add_argument("--root", required=True, help="the kubelet root directory")
    p.add_argument("--dra", required=True, help="the DRA plugin socket")
    p.add_argument("--timeout", type=float, default=30.0)
    a = p.parse_args(argv)
    stubs = load_stubs(a.proto_root, a.stubs_cache)
    pb, pbg = stubs["deviceplugin_v1beta1"]
    prpb, prpbg = stubs["podresources_v1"]
    dra_pb, dra_pbg = stubs["dra_v1"]
    dp_dir = os.path.join(a.root, "device-plugins")
    pr_dir = os.path.join(a.root, "pod-resources")
    os.makedirs(dp_dir, exist_ok=True)
    os.makedirs(pr_dir, exist_ok=True)
    server, kubelet = serve_kubelet(stubs, os.path.join(dp_dir, "kubelet.sock"), 0)
    pods = PodResources(prpb)
    pr_server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    prpbg.add_PodResourcesListerServicer_to_server(pods, pr_server)
    if pr_server.add_insecure_port("unix://" + os.path.join(pr_dir, "kubelet.sock")) == 0:
        raise SystemExit(f"cannot serve {pr_dir}/kubelet.sock")
    pr_server.start()
    watches, stubs_by = {}, {}
    dra_ch = grpc.insecure_channel("unix://" + a.dra,
                                   options=[("grpc.default_authority", grpc_go_authority(a.dra))])
    dra = dra_pbg.DRAPluginStub(dra_ch)

    def stub(resource):
        if resource not in stubs_by:
            r = kubelet.registered[resource]
            ch = grpc.insecure_channel("unix://" + os.path.join(dp_dir, r.endpoint),
                                       options=[("grpc.default_authority", "localhost")])
            stubs_by[resource] = pbg.DevicePluginStub(ch)
        return stubs_by[resource]

    def claims(cmd):
        return [dra_pb.Claim(namespace=c["namespace"], name=c["name"], uid=c["uid"]) for c in cmd["claims"]]

    def one(cmd):
        op = cmd["op"]
        if op == "registered":
            regs = kubelet.wait(cmd["names"], a.timeout)
            return {"registered": {n: regs[n].endpoint for n in cmd["names"]}}
        if op == "watch":
            w = watches[cmd["resource"]] = Watch(stub(cmd["resource"]), pb)
            return {"devices": w.wait(lambda _: True, a.timeout)[1]}
        if op == "until":
            def pred(devices):
                return any(d["id"] == cmd["id"] and d["health"] == cmd["health"] for d in devices)
            i, devices = watches[cmd["resource"]].wait(pred, a.timeout)
            return {"index": i, "devices": devices}
        if op == "allocate":
            req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=cmd["ids"])])
            try:
                resp = stub(cmd["resource"]).Allocate(req, timeout=TIMEOUT_S)
            except grpc.RpcError as e:
                return {"allocated": False, "code": e.code().name, "message": e.details()}
            return {"allocated": True, "envs": dict(resp.container_responses[0].envs)}
        if op == "pods":
            n = pods.set_pods(cmd["pods"])
            if not cmd.get("wait", True):
                return {"lists": n}
            # List copies the pods and counts itself under one lock, so call n+1 answered the new
            # pods; the plugin polls one call at a time, so once call n+2 came it has handled n+1.
            return {"lists": pods.wait_lists(n + 2, a.timeout)}
        if op in ("prepare", "unprepare"):
            if op == "prepare":
                resp = dra.NodePrepareResources(dra_pb.NodePrepareResourcesRequest(claims=claims(cmd)),
                                                timeout=TIMEOUT_S)
                # share_id is proto3 optional: None when the plugin left it unset.
                return {"claims": {u: {"error": r.error, "devices": [d.device_name for d in r.devices],
                                       "share_ids": [d.share_id if d.HasField("share_id") else None
                                                     for d in r.devices],
                                       "cdi_device_ids": [list(d.cdi_device_ids) for d in r.devices]}
                                   for u, r in resp.claims.items()}}
            resp = dra.NodeUnprepareResources(dra_pb.NodeUnprepareResourcesRequest(claims=claims(cmd)),
                                              timeout=TIMEOUT_S)
            return {"claims": {u: {"error": r.error} for u, r in resp.claims.items()}}
        raise CheckFailed(f"unknown op {op!r}")

    print(json.dumps({"ok": True, "event": "serving"}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            out = {"ok": True, **one(cmd)}
        except (CheckFailed, grpc.RpcError, KeyError) as e:
            out = {"ok": False, "error": rpc_error(e) if isinstance(e, grpc.RpcError) else str(e)}
        print(json.dumps(out), flush=True)
    server.stop(0)
    pr_server.stop(0)
    return 0


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "device-plugin":
        return device_plugin_main(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "node":
        return node_main(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--proto-root", required=True, help="the repository's proto/ directory")
    p.add_argument("--stubs-cache", help="reuse generated stubs in this directory")
    p.add_argument("--registration", required=True, help="the registration socket path")
    p.add_argument("--dra", required=True, help="the DRA socket path (GetInfo's endpoint)")
    p.add_argument("--driver", default="gpu.nvidia.com")
    p.add_argument("--node", required=True, help="the pool name devices are published in")
    p.add_argument("--namespace", default="default")
    p.add_argument("--claim", action="append", default=[], metavar="UID=DEVICE",
                   help="an allocated claim (named claim-UID) in the plugin's API and its device")
    p.add_argument("--form", action="append", required=True,
                   choices=["grpc-go", "raw-path", "grpcio-default", "localhost", "none", "hpack", "malformed"])
    args = p.parse_args()
    if not args.claim and any(f not in ("hpack", "malformed") for f in args.form):
        p.error("the DRA checks need at least one --claim")

    stubs = load_stubs(args.proto_root, args.stubs_cache)
    report = Report()
    checks, raw = Checks(args, stubs, report), Raw(args, stubs, report)
    for form in args.form:
        if form == "none":
            raw.no_authority()
        elif form == "hpack":
            raw.hpack_forms()
        elif form == "malformed":
            raw.malformed()
        else:
            checks.registration(form)
            checks.dra(form)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
