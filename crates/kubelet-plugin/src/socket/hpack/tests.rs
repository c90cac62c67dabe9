//! RFC 7541 Appendix C, byte for byte (checked with python-hpack as well), and a differential
//! property test against `loona-hpack`, an implementation we did not write.

use super::*;
use proptest::prelude::*;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn decode(d: &mut Decoder, block: &[u8]) -> Result<Vec<(String, String)>, Error> {
    let mut fields = Vec::new();
    d.decode(block, |n, v| {
        fields.push((
            String::from_utf8(n.to_vec()).unwrap(),
            String::from_utf8(v.to_vec()).unwrap(),
        ))
    })?;
    Ok(fields)
}

fn owned(fields: &[(&str, &str)]) -> Vec<(String, String)> {
    fields
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

fn table(d: &Decoder) -> Vec<(String, String)> {
    d.table
        .iter()
        .map(|(n, v)| {
            (
                String::from_utf8(n.clone()).unwrap(),
                String::from_utf8(v.clone()).unwrap(),
            )
        })
        .collect()
}

/// C.3 (plain strings) and C.4 (the same requests, Huffman-coded): three requests on one
/// connection, with the table the RFC lists after each.
#[test]
fn rfc7541_c3_c4_requests() {
    let first = [
        (":method", "GET"),
        (":scheme", "http"),
        (":path", "/"),
        (":authority", "www.example.com"),
    ];
    let mut second = first.to_vec();
    second.push(("cache-control", "no-cache"));
    let third = [
        (":method", "GET"),
        (":scheme", "https"),
        (":path", "/index.html"),
        (":authority", "www.example.com"),
        ("custom-key", "custom-value"),
    ];
    for blocks in [
        [
            "828684410f7777772e6578616d706c652e636f6d",
            "828684be58086e6f2d6361636865",
            "828785bf400a637573746f6d2d6b65790c637573746f6d2d76616c7565",
        ],
        [
            "828684418cf1e3c2e5f23a6ba0ab90f4ff",
            "828684be5886a8eb10649cbf",
            "828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf",
        ],
    ] {
        let mut d = Decoder::new(4096);
        assert_eq!(decode(&mut d, &hex(blocks[0])).unwrap(), owned(&first));
        assert_eq!(d.size, 57);
        assert_eq!(decode(&mut d, &hex(blocks[1])).unwrap(), owned(&second));
        assert_eq!(d.size, 110);
        assert_eq!(decode(&mut d, &hex(blocks[2])).unwrap(), owned(&third));
        assert_eq!(d.size, 164);
        assert_eq!(
            table(&d),
            owned(&[
                ("custom-key", "custom-value"),
                ("cache-control", "no-cache"),
                (":authority", "www.example.com"),
            ])
        );
    }
}

/// C.6: responses with Huffman coding and a 256-byte table, so entries are evicted.
#[test]
fn rfc7541_c6_responses_evict() {
    let mut d = Decoder::new(256);
    let r1 = decode(
        &mut d,
        &hex("488264025885aec3771a4b6196d07abe941054d444a8200595040b8166e082a62d1bff6e919d29ad171863c78f0b97c8e9ae82ae43d3"),
    )
    .unwrap();
    assert_eq!(
        r1,
        owned(&[
            (":status", "302"),
            ("cache-control", "private"),
            ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
            ("location", "https://www.example.com"),
        ])
    );
    assert_eq!(d.size, 222);
    let r2 = decode(&mut d, &hex("4883640effc1c0bf")).unwrap();
    assert_eq!(r2[0], (":status".into(), "307".into()));
    assert_eq!(d.size, 222);
    assert_eq!(table(&d)[0], (":status".into(), "307".into()));
    assert_eq!(table(&d).len(), 4);
    let r3 = decode(
        &mut d,
        &hex("88c16196d07abe941054d444a8200595040b8166e084a62d1bffc05a839bd9ab77ad94e7821dd7f2e6c7b335dfdfcd5b3960d5af27087f3672c1ab270fb5291f9587316065c003ed4ee5b1063d5007"),
    )
    .unwrap();
    assert_eq!(
        r3.last().unwrap(),
        &(
            "set-cookie".into(),
            "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1".into()
        )
    );
    assert_eq!(d.size, 215);
    assert_eq!(
        table(&d)
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>(),
        ["set-cookie", "content-encoding", "date"]
    );
}

#[test]
fn errors() {
    let cases: [(&str, Error); 8] = [
        ("be", Error::BadIndex(62)),
        ("80", Error::BadIndex(0)),
        ("41", Error::Truncated),
        ("410a61", Error::Truncated),
        (
            "3fe21f",
            Error::TableTooBig {
                size: 4097,
                limit: 4096,
            },
        ),
        ("823f00", Error::LateSizeUpdate),
        ("ffffffffff0f", Error::IntegerOverflow),
        // ":authority" with a Huffman value holding EOS (30 one-bits).
        ("4184ffffffff", Error::BadHuffman),
    ];
    for (block, want) in cases {
        assert_eq!(
            decode(&mut Decoder::new(4096), &hex(block)),
            Err(want),
            "{block}"
        );
    }
    // Padding: more than 7 bits, or not all ones.
    for bad in ["418207ff", "418100", "4181fe"] {
        let got = decode(&mut Decoder::new(4096), &hex(bad));
        assert_eq!(got, Err(Error::BadHuffman), "{bad}");
    }
    // A size update to 0 at the start empties the table; a later reference then fails.
    let mut d = Decoder::new(4096);
    decode(&mut d, &hex("400161016182")).unwrap();
    assert_eq!(d.table.len(), 1);
    assert_eq!(
        decode(&mut d, &hex("2082")).unwrap(),
        owned(&[(":method", "GET")])
    );
    assert!(d.table.is_empty());
    assert_eq!(decode(&mut d, &hex("be")), Err(Error::BadIndex(62)));
}

/// The canonical table reproduces every code of Appendix B.
#[test]
fn huffman_code_is_canonical() {
    let c = &CANONICAL;
    for (sym, &(code, len)) in tables::HUFFMAN.iter().enumerate() {
        let l = len as usize;
        let k = code - c.first[l];
        assert!(k < c.count[l], "symbol {sym}");
        assert_eq!(
            usize::from(c.symbols[c.offset[l] as usize + k as usize]),
            sym
        );
    }
}

/// Huffman encoding by Appendix B, padded with ones: the test's own encoder.
fn huffman_encode(s: &[u8]) -> Vec<u8> {
    let (mut acc, mut bits, mut out) = (0u64, 0u32, Vec::new());
    for &b in s {
        let (code, len) = tables::HUFFMAN[usize::from(b)];
        acc = acc << len | u64::from(code);
        bits += u32::from(len);
        while bits >= 8 {
            out.push((acc >> (bits - 8)) as u8);
            bits -= 8;
        }
    }
    if bits > 0 {
        out.push(((acc << (8 - bits)) as u8) | ((1u8 << (8 - bits)) - 1));
    }
    out
}

fn encode_str(out: &mut Vec<u8>, s: &[u8], huffman: bool) {
    if huffman {
        let h = huffman_encode(s);
        encode_integer(out, h.len(), 7, 0x80);
        out.extend(h);
    } else {
        encode_integer(out, s.len(), 7, 0);
        out.extend_from_slice(s);
    }
}

#[derive(Debug, Clone)]
enum Rep {
    Indexed(usize),
    Literal {
        kind: u8,
        name_index: usize,
        name: Vec<u8>,
        value: Vec<u8>,
        huffman: bool,
    },
    SizeUpdate(usize),
}

fn rep() -> impl Strategy<Value = Rep> {
    let bytes = prop::collection::vec(any::<u8>(), 0..40);
    prop_oneof![
        (1usize..80).prop_map(Rep::Indexed),
        (0u8..3, 0usize..70, bytes.clone(), bytes, any::<bool>()).prop_map(
            |(kind, name_index, name, value, huffman)| Rep::Literal {
                kind,
                name_index,
                name,
                value,
                huffman
            }
        ),
        (0usize..300).prop_map(Rep::SizeUpdate),
    ]
}

fn encode_block(reps: &[Rep]) -> Vec<u8> {
    let mut b = Vec::new();
    for r in reps {
        match r {
            Rep::Indexed(i) => encode_integer(&mut b, *i, 7, 0x80),
            Rep::SizeUpdate(s) => encode_integer(&mut b, *s, 5, 0x20),
            Rep::Literal {
                kind,
                name_index,
                name,
                value,
                huffman,
            } => {
                let (n, first) = match kind {
                    0 => (6, 0x40),
                    1 => (4, 0x00),
                    _ => (4, 0x10),
                };
                encode_integer(&mut b, *name_index, n, first);
                if *name_index == 0 {
                    encode_str(&mut b, name, *huffman);
                }
                encode_str(&mut b, value, *huffman);
            }
        }
    }
    b
}

proptest! {
    /// Random blocks (valid or not: indices past the table, size updates anywhere) decode to
    /// the same fields as loona-hpack, over a connection of several blocks with a small table
    /// so that entries are evicted. Where the two disagree on an error, ours must be one of the
    /// rules loona does not enforce.
    #[test]
    fn agrees_with_loona_hpack(blocks in prop::collection::vec(prop::collection::vec(rep(), 0..12), 1..6)) {
        let limit = 256;
        let mut ours = Decoder::new(limit);
        let mut theirs = loona_hpack::Decoder::new();
        theirs.set_max_allowed_table_size(limit);
        theirs.set_max_table_size(limit);
        for reps in &blocks {
            let block = encode_block(reps);
            let mut a = Vec::new();
            let ra = ours.decode(&block, |n, v| a.push((n.to_vec(), v.to_vec())));
            let mut b = Vec::new();
            let rb = theirs.decode_with_cb(&block, |n, v| b.push((n.to_vec(), v.to_vec())));
            match (ra, rb) {
                (Ok(()), Ok(())) => prop_assert_eq!(&a, &b),
                (Err(_), Err(_)) => return Ok(()),
                // loona refuses a block that ends in a size update; RFC 7541 does not.
                (Ok(()), Err(loona_hpack::decoder::DecoderError::SizeUpdateAtEnd)) => return Ok(()),
                // loona accepts size updates after a field; RFC 7541 §4.2 and h2 do not.
                (Err(Error::LateSizeUpdate), Ok(())) => return Ok(()),
                (ra, rb) => prop_assert!(false, "ours {:?}, loona {:?}", ra, rb.err()),
            }
        }
    }

    /// Every string survives Huffman coding.
    #[test]
    fn huffman_round_trip(s in prop::collection::vec(any::<u8>(), 0..200)) {
        let mut out = Vec::new();
        huffman_decode(&huffman_encode(&s), &mut out).unwrap();
        prop_assert_eq!(out, s);
    }
}
