//! HPACK (RFC 7541) for the `:authority` adapter: a decoder (the static and dynamic tables,
//! integers, plain and Huffman-coded strings, table size updates, with the limits h2 applies) and
//! the one encoding the adapter emits, literal fields without indexing.
//!
//! Written here rather than taken from a crate: h2's decoder is private, `hpack`/`loona-hpack`
//! rebuild a map-of-maps Huffman table for every Huffman-coded string and decode it bit by bit
//! (77 µs per grpc-go request measured in `benches/socket.rs`, against a 10 µs budget), and
//! `httlib-hpack` copies its input once per field. HPACK is a frozen RFC; this file is tested
//! against its Appendix C examples and, differentially, against `loona-hpack`.

use std::collections::VecDeque;

mod tables;

/// Why a header block does not decode. h2 refuses such a block with COMPRESSION_ERROR.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("header block ends inside a field")]
    Truncated,
    #[error("integer over 2^32 in a header block")]
    IntegerOverflow,
    #[error("index {0} is in neither the static nor the dynamic table")]
    BadIndex(usize),
    #[error("invalid Huffman-coded string")]
    BadHuffman,
    #[error("dynamic table size update to {size} exceeds the {limit} bytes allowed")]
    TableTooBig { size: usize, limit: usize },
    #[error("dynamic table size update after the first field of a block")]
    LateSizeUpdate,
}

/// The decoding side of one connection's HPACK context.
pub struct Decoder {
    /// Newest entry first, as HPACK indexes them (index 62 is the front).
    table: VecDeque<(Vec<u8>, Vec<u8>)>,
    /// The sum of the entries' sizes (name + value + 32 each).
    size: usize,
    max_size: usize,
    /// The most a size update may ask for (our SETTINGS_HEADER_TABLE_SIZE).
    limit: usize,
    name_buf: Vec<u8>,
    value_buf: Vec<u8>,
}

/// The overhead HPACK counts per table entry (RFC 7541 §4.1).
const ENTRY_OVERHEAD: usize = 32;

impl Decoder {
    /// A decoder whose table may grow to `limit` bytes, which is also its initial size.
    pub fn new(limit: usize) -> Self {
        Decoder {
            table: VecDeque::new(),
            size: 0,
            max_size: limit,
            limit,
            name_buf: Vec::new(),
            value_buf: Vec::new(),
        }
    }

    /// Decodes one whole header block, calling `field` with each name and value in order.
    /// After an error the context is unusable (the connection must end).
    pub fn decode(
        &mut self,
        mut block: &[u8],
        mut field: impl FnMut(&[u8], &[u8]),
    ) -> Result<(), Error> {
        let mut first = true;
        while let Some(&b) = block.first() {
            if b & 0x80 != 0 {
                // Indexed field (§6.1).
                let (index, rest) = integer(block, 7)?;
                block = rest;
                let (n, v) = lookup(&self.table, index)?;
                field(n, v);
            } else if b & 0xe0 == 0x20 {
                // Dynamic table size update (§6.3): only before the first field.
                if !first {
                    return Err(Error::LateSizeUpdate);
                }
                let (size, rest) = integer(block, 5)?;
                block = rest;
                if size > self.limit {
                    return Err(Error::TableTooBig {
                        size,
                        limit: self.limit,
                    });
                }
                self.max_size = size;
                self.evict(0);
                continue;
            } else {
                // Literal with incremental indexing (§6.2.1, 6-bit index), or without
                // indexing / never indexed (§6.2.2, §6.2.3, 4-bit index).
                let indexing = b & 0x40 != 0;
                let (index, rest) = integer(block, if indexing { 6 } else { 4 })?;
                block = rest;
                if index == 0 {
                    block = string(block, &mut self.name_buf)?;
                } else {
                    let (n, _) = lookup(&self.table, index)?;
                    self.name_buf.clear();
                    self.name_buf.extend_from_slice(n);
                }
                block = string(block, &mut self.value_buf)?;
                field(&self.name_buf, &self.value_buf);
                if indexing {
                    self.insert();
                }
            }
            first = false;
        }
        Ok(())
    }

    /// Adds the field in `name_buf`/`value_buf` to the dynamic table (§4.4).
    fn insert(&mut self) {
        let size = self.name_buf.len() + self.value_buf.len() + ENTRY_OVERHEAD;
        if size > self.max_size {
            // An entry larger than the table empties it and is not added.
            self.table.clear();
            self.size = 0;
            return;
        }
        self.evict(size);
        self.table
            .push_front((self.name_buf.clone(), self.value_buf.clone()));
        self.size += size;
    }

    /// Evicts the oldest entries until `room` more bytes fit under the maximum size.
    fn evict(&mut self, room: usize) {
        while self.size + room > self.max_size {
            let Some((n, v)) = self.table.pop_back() else {
                break;
            };
            self.size -= n.len() + v.len() + ENTRY_OVERHEAD;
        }
    }
}

/// The field at `index`: 1-61 in the static table, from 62 the dynamic table, newest first.
fn lookup(table: &VecDeque<(Vec<u8>, Vec<u8>)>, index: usize) -> Result<(&[u8], &[u8]), Error> {
    match index {
        0 => Err(Error::BadIndex(0)),
        1..=61 => Ok(tables::STATIC[index - 1]),
        _ => table
            .get(index - 62)
            .map(|(n, v)| (n.as_slice(), v.as_slice()))
            .ok_or(Error::BadIndex(index)),
    }
}

/// An integer with an `n`-bit prefix (§5.1) and the bytes after it.
fn integer(block: &[u8], n: u32) -> Result<(usize, &[u8]), Error> {
    let (&first, mut rest) = block.split_first().ok_or(Error::Truncated)?;
    let max = (1usize << n) - 1;
    let mut value = usize::from(first) & max;
    if value < max {
        return Ok((value, rest));
    }
    let mut shift = 0;
    loop {
        let (&b, tail) = rest.split_first().ok_or(Error::Truncated)?;
        rest = tail;
        if shift > 28 {
            return Err(Error::IntegerOverflow);
        }
        value += usize::from(b & 0x7f) << shift;
        shift += 7;
        if b & 0x80 == 0 {
            break;
        }
    }
    if value > u32::MAX as usize {
        return Err(Error::IntegerOverflow);
    }
    Ok((value, rest))
}

/// Decodes a string literal (§5.2) into `out` (cleared first); returns the bytes after it.
fn string<'a>(block: &'a [u8], out: &mut Vec<u8>) -> Result<&'a [u8], Error> {
    let huffman = block.first().is_some_and(|b| b & 0x80 != 0);
    let (len, rest) = integer(block, 7)?;
    if rest.len() < len {
        return Err(Error::Truncated);
    }
    let (s, rest) = rest.split_at(len);
    out.clear();
    if huffman {
        huffman_decode(s, out)?;
    } else {
        out.extend_from_slice(s);
    }
    Ok(rest)
}

/// The canonical form of the Huffman code: HPACK's code (Appendix B) assigns consecutive codes
/// to symbols sorted by code length, so a code of length `l` is `first[l] + k` for the `k`-th
/// symbol of that length.
struct Canonical {
    /// For each length: the first code, how many codes, and where its symbols start in `symbols`.
    first: [u32; 31],
    count: [u32; 31],
    offset: [u16; 31],
    symbols: [u16; 257],
}

const fn canonical() -> Canonical {
    let mut c = Canonical {
        first: [0; 31],
        count: [0; 31],
        offset: [0; 31],
        symbols: [0; 257],
    };
    let mut i = 0;
    while i < 257 {
        c.count[tables::HUFFMAN[i].1 as usize] += 1;
        i += 1;
    }
    let mut len = 1;
    let mut code = 0u32;
    let mut at = 0u16;
    while len < 31 {
        c.first[len] = code;
        c.offset[len] = at;
        at += c.count[len] as u16;
        code = (code + c.count[len]) << 1;
        len += 1;
    }
    // Symbols of each length in symbol order (the order their codes run in).
    let mut fill = c.offset;
    let mut s = 0;
    while s < 257 {
        let l = tables::HUFFMAN[s].1 as usize;
        c.symbols[fill[l] as usize] = s as u16;
        fill[l] += 1;
        s += 1;
    }
    c
}

static CANONICAL: Canonical = canonical();

/// The shortest and longest codes of the HPACK Huffman code.
const MIN_CODE: u32 = 5;
const MAX_CODE: u32 = 30;
const EOS: u16 = 256;

fn huffman_decode(input: &[u8], out: &mut Vec<u8>) -> Result<(), Error> {
    let c = &CANONICAL;
    let mut acc: u64 = 0;
    let mut bits: u32 = 0;
    let mut bytes = input.iter();
    loop {
        while bits <= 56 {
            let Some(&b) = bytes.next() else { break };
            acc = acc << 8 | u64::from(b);
            bits += 8;
        }
        if bits < MIN_CODE {
            break;
        }
        let mut found = None;
        let mut len = MIN_CODE;
        while len <= MAX_CODE.min(bits) {
            let code = ((acc >> (bits - len)) as u32) & ((1 << len) - 1);
            let k = code.wrapping_sub(c.first[len as usize]);
            if k < c.count[len as usize] {
                found = Some((c.symbols[(c.offset[len as usize] as u32 + k) as usize], len));
                break;
            }
            len += 1;
        }
        match found {
            Some((EOS, _)) => return Err(Error::BadHuffman),
            Some((sym, len)) => {
                out.push(sym as u8);
                bits -= len;
            }
            // No code fits what is left: it must be padding.
            None => break,
        }
    }
    // Up to 7 bits of padding, all ones (the start of EOS), and nothing else (§5.2).
    if bits > 7 || acc & ((1 << bits) - 1) != (1 << bits) - 1 {
        return Err(Error::BadHuffman);
    }
    Ok(())
}

// ---- encoding: literals only, which is all the adapter emits ----

/// A literal header field without indexing and with a literal name, both strings plain
/// (RFC 7541 §6.2.2): valid in any decoder state, and it leaves the dynamic table alone.
pub(super) fn encode_literal(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    encode_string(out, name);
    encode_string(out, value);
}

fn encode_string(out: &mut Vec<u8>, s: &[u8]) {
    encode_integer(out, s.len(), 7, 0x00);
    out.extend_from_slice(s);
}

/// An HPACK integer with an `n`-bit prefix (RFC 7541 §5.1); `first` carries the bits above it.
pub(super) fn encode_integer(out: &mut Vec<u8>, mut value: usize, n: u32, first: u8) {
    let max = (1usize << n) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    value -= max;
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

#[cfg(test)]
mod tests;
