//! Makes h2 accept the `:authority` values the kubelet sends, and nothing else it would refuse.
//!
//! A [`Rewriter`] sits between the socket and h2 on the client-to-server direction. It follows
//! the HTTP/2 framing, passes every frame through as it came except header blocks, and for
//! those it decodes the HPACK block with the client's dynamic table, replaces an `:authority` that
//! `http::uri::Authority` (which h2 uses) cannot parse with `localhost`, and re-encodes the rest as literal
//! fields without indexing, split over HEADERS and CONTINUATION frames of at most 16 KiB.
//!
//! Invariants:
//! - h2's HPACK dynamic table stays empty: the re-encoded blocks never insert into it, so the
//!   client's references into *its* table are resolved here and h2 never sees one.
//! - Every field but an unparseable `:authority` reaches h2 with its name and value
//!   unchanged and in order, so h2's checks of a request (pseudo-header order, uppercase or
//!   connection-specific names, header-list size, ...) still refuse what they refused.
//! - Anything this layer does not understand — a frame over 16 KiB, bad padding, a
//!   CONTINUATION out of place, an HPACK block that does not decode (with the same 4 KiB table
//!   limit h2 advertises) — is handed to h2 byte for byte, after which the connection is passed
//!   through untouched: all of these are connection errors that h2 reports as it would have.

use super::hpack::{Decoder, encode_literal};

/// What every HTTP/2 client sends first (RFC 9113 §3.4).
const PREFACE_LEN: usize = 24;
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame a peer may send before SETTINGS raise it (h2's servers never do), and the
/// largest this layer emits.
const MAX_FRAME: usize = 16_384;
/// A header block larger than this is handed to h2 unrewritten (to be refused there); it bounds
/// what one connection can make us buffer.
const MAX_BLOCK: usize = 1 << 20;
/// What replaces an `:authority` h2 would refuse: the value the kubelet's own device-plugin client
/// sends. Replacing rather than dropping keeps h2's checks of a request with an authority (a
/// missing `:path` or `:scheme` is still refused).
const STAND_IN: &[u8] = b"localhost";
/// `SETTINGS_HEADER_TABLE_SIZE` of h2's servers (the protocol default; tonic does not change it).
const TABLE_SIZE: usize = 4096;

/// The client-to-server half of one connection. Feed it what the socket reads; it appends what
/// h2 should read.
pub struct Rewriter {
    state: State,
    /// The frame being collected: its 9-byte header and, for header frames, the payload so far.
    frame: Vec<u8>,
    /// A header block whose HEADERS frame lacked END_HEADERS.
    block: Option<Block>,
    decoder: Decoder,
    /// The re-encoded block, reused between blocks.
    encoded: Vec<u8>,
    replaced: u64,
}

enum State {
    /// Collecting a frame header into `frame`.
    Header,
    /// Forwarding, unchanged, the connection preface or the payload of a frame that carries no
    /// headers; this many bytes are left.
    Forward(usize),
    /// Collecting the payload of a header frame of this length into `frame`.
    Payload(usize),
    /// Something here was not understood; h2 has it and ends the connection.
    Passthrough,
}

struct Block {
    stream: u32,
    end_stream: bool,
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
    /// The frames as they came, in case h2 must see them unchanged.
    raw: Vec<u8>,
}

impl Rewriter {
    /// The server side of a new connection: the next bytes are the client's preface.
    pub fn server() -> Self {
        let decoder = Decoder::new(TABLE_SIZE);
        Rewriter {
            state: State::Forward(PREFACE_LEN),
            frame: Vec::with_capacity(FRAME_HEADER),
            block: None,
            decoder,
            encoded: Vec::new(),
            replaced: 0,
        }
    }

    /// How many `:authority` values were replaced so far.
    pub fn replaced(&self) -> u64 {
        self.replaced
    }

    /// Whether the connection is forwarded untouched from now on (h2 is about to end it).
    pub fn passing_through(&self) -> bool {
        matches!(self.state, State::Passthrough)
    }

    /// Consumes `input` (any split of the byte stream) and appends what h2 should read to `out`.
    pub fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>) {
        while !input.is_empty() {
            match self.state {
                State::Passthrough => {
                    out.extend_from_slice(input);
                    return;
                }
                State::Forward(left) => {
                    let n = left.min(input.len());
                    out.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    self.state = if n == left {
                        State::Header
                    } else {
                        State::Forward(left - n)
                    };
                }
                State::Header => {
                    let n = (FRAME_HEADER - self.frame.len()).min(input.len());
                    self.frame.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    if self.frame.len() == FRAME_HEADER {
                        self.on_frame_header(out);
                    }
                }
                State::Payload(len) => {
                    let want = FRAME_HEADER + len - self.frame.len();
                    let n = want.min(input.len());
                    self.frame.extend_from_slice(&input[..n]);
                    input = &input[n..];
                    if n == want {
                        self.on_header_frame(out);
                    }
                }
            }
        }
    }

    /// The peer closed the connection: hands h2 the incomplete frame, if any, as it came.
    pub fn finish(&mut self, out: &mut Vec<u8>) {
        self.give_up(out);
    }

    fn on_frame_header(&mut self, out: &mut Vec<u8>) {
        let h = &self.frame;
        let len = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
        let kind = h[3];
        if kind == HEADERS || kind == CONTINUATION {
            if len > MAX_FRAME {
                self.give_up(out);
            } else {
                self.state = State::Payload(len);
                if len == 0 {
                    self.on_header_frame(out);
                }
            }
        } else if self.block.is_some() {
            // Only CONTINUATION may follow a header block without END_HEADERS.
            self.give_up(out);
        } else {
            out.extend_from_slice(&self.frame);
            self.frame.clear();
            self.state = if len == 0 {
                State::Header
            } else {
                State::Forward(len)
            };
        }
    }

    /// `frame` holds a whole HEADERS or CONTINUATION frame.
    fn on_header_frame(&mut self, out: &mut Vec<u8>) {
        let frame = std::mem::take(&mut self.frame);
        let (kind, flags) = (frame[3], frame[4]);
        let stream = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
        let payload = &frame[FRAME_HEADER..];
        self.state = State::Header;

        let block = if kind == HEADERS {
            if self.block.is_some() || stream == 0 {
                return self.give_up_with(out, &frame);
            }
            let Some((priority, fragment)) = split_headers_payload(flags, payload) else {
                return self.give_up_with(out, &frame);
            };
            Block {
                stream,
                end_stream: flags & END_STREAM != 0,
                priority,
                fragment: fragment.to_vec(),
                raw: frame.clone(),
            }
        } else {
            let Some(mut block) = self.block.take() else {
                return self.give_up_with(out, &frame);
            };
            if block.stream != stream || block.raw.len() + frame.len() > MAX_BLOCK {
                self.block = Some(block);
                return self.give_up_with(out, &frame);
            }
            block.fragment.extend_from_slice(payload);
            block.raw.extend_from_slice(&frame);
            block
        };
        self.frame = frame;
        self.frame.clear();

        if flags & END_HEADERS == 0 {
            self.block = Some(block);
            return;
        }
        if self.reencode(&block.fragment) {
            write_block(out, &block, &self.encoded);
        } else {
            out.extend_from_slice(&block.raw);
            self.state = State::Passthrough;
        }
    }

    /// Decodes `fragment` into `self.encoded` as literal fields; false if it does not decode.
    fn reencode(&mut self, fragment: &[u8]) -> bool {
        let Rewriter {
            decoder,
            encoded,
            replaced,
            ..
        } = self;
        encoded.clear();
        let decoded = decoder.decode(fragment, |name, value| {
            if name == b":authority" && http::uri::Authority::try_from(value).is_err() {
                *replaced += 1;
                encode_literal(encoded, name, STAND_IN);
            } else {
                encode_literal(encoded, name, value);
            }
        });
        decoded.is_ok()
    }

    /// Hands h2 what is buffered, as it came, and passes everything through from now on.
    fn give_up(&mut self, out: &mut Vec<u8>) {
        if let Some(block) = self.block.take() {
            out.extend_from_slice(&block.raw);
        }
        out.extend_from_slice(&self.frame);
        self.frame.clear();
        self.state = State::Passthrough;
    }

    fn give_up_with(&mut self, out: &mut Vec<u8>, frame: &[u8]) {
        self.give_up(out);
        out.extend_from_slice(frame);
    }
}

/// The priority fields and the header block fragment of a HEADERS payload, or `None` when the
/// padding or priority do not fit (a connection error h2 reports).
fn split_headers_payload(flags: u8, payload: &[u8]) -> Option<(Option<[u8; 5]>, &[u8])> {
    let mut rest = payload;
    let mut pad = 0;
    if flags & PADDED != 0 {
        let (&n, tail) = rest.split_first()?;
        pad = usize::from(n);
        rest = tail;
    }
    let priority = if flags & PRIORITY != 0 {
        let (p, tail) = rest.split_first_chunk::<5>()?;
        rest = tail;
        Some(*p)
    } else {
        None
    };
    let end = rest.len().checked_sub(pad)?;
    Some((priority, &rest[..end]))
}

/// Writes `encoded` as one HEADERS frame and as many CONTINUATION frames as it needs.
fn write_block(out: &mut Vec<u8>, block: &Block, encoded: &[u8]) {
    let prio_len = if block.priority.is_some() { 5 } else { 0 };
    let first = encoded.len().min(MAX_FRAME - prio_len);
    let mut flags = 0;
    if block.end_stream {
        flags |= END_STREAM;
    }
    if block.priority.is_some() {
        flags |= PRIORITY;
    }
    if first == encoded.len() {
        flags |= END_HEADERS;
    }
    write_frame_header(out, prio_len + first, HEADERS, flags, block.stream);
    if let Some(p) = &block.priority {
        out.extend_from_slice(p);
    }
    out.extend_from_slice(&encoded[..first]);
    let mut chunks = encoded[first..].chunks(MAX_FRAME).peekable();
    while let Some(chunk) = chunks.next() {
        let flags = if chunks.peek().is_none() {
            END_HEADERS
        } else {
            0
        };
        write_frame_header(out, chunk.len(), CONTINUATION, flags, block.stream);
        out.extend_from_slice(chunk);
    }
}

fn write_frame_header(out: &mut Vec<u8>, len: usize, kind: u8, flags: u8, stream: u32) {
    // `len` is at most MAX_FRAME, so it fits the 24-bit length field.
    out.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
}

#[cfg(test)]
mod tests;
