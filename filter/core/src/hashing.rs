//! Cache keys (sha256) and response hashes (xxh3-128).
//!
//! Keys stay sha256: clients choose requests, so a key collision an attacker could build would
//! serve one caller's answer to another. The response hash only names an answer the origin made
//! (`x-response-hash`, the ETag) and so needs no collision resistance against attackers; in wasm32
//! sha256 was ~55% of a 64 KiB miss, xxh3-128 is ~30 times faster there (docs/filter.md, "Cost").

use crate::shaping::KeyedBytes;
use sha2::{Digest, Sha256};
use xxhash_rust::xxh3::Xxh3;

/// What `x-response-hash` values start with: the algorithm, so clients can tell (a sha256 hash,
/// from filters before it, was bare hex).
pub const RESPONSE_HASH_PREFIX: &str = "xxh3-128:";

pub type KeyDigest = [u8; 32];

/// Everything that shapes an inference answer, and so separates cache entries.
pub struct KeyInput<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub model: &'a str,
    pub version: &'a str,
    /// The value of each `names::MODEL_SELECTING_HEADERS` header, in that order (None: absent).
    pub model_headers: &'a [Option<&'a str>],
    pub generation: u64,
    pub color: &'a str,
    /// (lowercase header name, every value the request had, in order), in policy order.
    pub vary: &'a [(String, Vec<String>)],
    /// The peer's URI SAN when the policy's scope is "principal".
    pub principal: Option<&'a str>,
    /// The body as keyed: the request id and ignored fields left out.
    pub body: &'a KeyedBytes<'a>,
}

fn field(h: &mut Sha256, bytes: &[u8]) {
    // Length-prefixing makes the encoding injective: ("ab","c") never collides with ("a","bc").
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

pub fn cache_key(k: &KeyInput) -> KeyDigest {
    let mut h = Sha256::new();
    h.update(b"meshcache-key-v3");
    field(&mut h, k.method.as_bytes());
    field(&mut h, k.path.as_bytes());
    field(&mut h, k.model.as_bytes());
    field(&mut h, k.version.as_bytes());
    h.update((k.model_headers.len() as u64).to_be_bytes());
    for v in k.model_headers {
        match v {
            Some(v) => {
                h.update([1u8]);
                field(&mut h, v.as_bytes());
            }
            None => h.update([0u8]),
        }
    }
    h.update(k.generation.to_be_bytes());
    field(&mut h, k.color.as_bytes());
    h.update((k.vary.len() as u64).to_be_bytes());
    for (name, values) in k.vary {
        field(&mut h, name.as_bytes());
        // The count separates absent (0) from empty (1 value "") and from repeated lines.
        h.update((values.len() as u64).to_be_bytes());
        for v in values {
            field(&mut h, v.as_bytes());
        }
    }
    match k.principal {
        Some(p) => {
            h.update([1u8]);
            field(&mut h, p.as_bytes());
        }
        None => h.update([0u8]),
    }
    // The id form first: an answer stored without an id never serves a request with one.
    h.update([k.body.form_tag()]);
    let total: usize = k.body.parts.iter().map(|p| p.len()).sum();
    h.update((total as u64).to_be_bytes());
    for part in &k.body.parts {
        h.update(part);
    }
    match k.body.json_len {
        Some(n) => {
            h.update([1u8]);
            h.update(n.to_be_bytes());
        }
        None => h.update([0u8]),
    }
    h.finalize().into()
}

/// `xxh3-128:` and the XXH3 128-bit hash (seed 0, canonical big-endian hex) over the 8-byte
/// big-endian body length, the body, then `name:value\n` for each `hash_headers` name
/// (ascending; already sorted by the config) that the response carries. Repeated headers are
/// joined with "," as HTTP allows.
pub fn response_hash(body: &[u8], headers: &[(String, String)], hash_headers: &[String]) -> String {
    let mut h = Xxh3::new();
    h.update(&(body.len() as u64).to_be_bytes());
    h.update(body);
    finish_response_hash(h, headers, hash_headers)
}

/// The header part of `response_hash`, after the body.
fn finish_response_hash(mut h: Xxh3, headers: &[(String, String)], hash_headers: &[String]) -> String {
    for name in hash_headers {
        let values: Vec<&str> = headers.iter().filter(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str()).collect();
        if values.is_empty() {
            continue;
        }
        h.update(name.as_bytes());
        h.update(b":");
        h.update(values.join(",").as_bytes());
        h.update(b"\n");
    }
    let mut out = String::with_capacity(RESPONSE_HASH_PREFIX.len() + 32);
    out.push_str(RESPONSE_HASH_PREFIX);
    out.push_str(&hex(&h.digest128().to_be_bytes()));
    out
}

/// `response_hash` computed while the answer streams through, a chunk at a time as the host
/// delivers it, so a miss does not walk its whole answer again at the end. The hash starts
/// with the body's length, so it needs the length up front: a declared `content-length`, or
/// (gRPC) the length in the frame header, whose 5 bytes are not hashed. `finish` gives None
/// whenever what was fed is not exactly that body (a wrong declared length, a second frame);
/// the caller then hashes the body whole, as before.
#[derive(Clone)]
pub struct AnswerHasher {
    h: Xxh3,
    /// Body bytes the hash covers (known: `Some`; gRPC before its frame header is complete: None).
    len: Option<u64>,
    /// Body bytes hashed so far.
    fed: u64,
    /// gRPC: frame header bytes still to come, and those seen.
    frame: Option<(usize, [u8; 5])>,
    /// Something did not match: `finish` says None.
    broken: bool,
}

impl AnswerHasher {
    /// An HTTP answer whose body is declared `len` bytes long.
    pub fn http(len: u64) -> AnswerHasher {
        let mut h = Xxh3::new();
        h.update(&len.to_be_bytes());
        AnswerHasher { h, len: Some(len), fed: 0, frame: None, broken: false }
    }

    /// A gRPC answer: one length-prefixed frame; the hash covers its message.
    pub fn grpc() -> AnswerHasher {
        AnswerHasher { h: Xxh3::new(), len: None, fed: 0, frame: Some((0, [0; 5])), broken: false }
    }

    /// The next bytes of the body as received (for gRPC still framed).
    pub fn update(&mut self, mut chunk: &[u8]) {
        if self.broken {
            return;
        }
        if let Some((seen, mut header)) = self.frame {
            if seen < 5 {
                let take = chunk.len().min(5 - seen);
                header[seen..seen + take].copy_from_slice(&chunk[..take]);
                chunk = &chunk[take..];
                self.frame = Some((seen + take, header));
                if seen + take < 5 {
                    return;
                }
                if header[0] != 0 {
                    // Compressed: not an answer the store takes (`grpc::unframe`).
                    self.broken = true;
                    return;
                }
                let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as u64;
                self.h.update(&len.to_be_bytes());
                self.len = Some(len);
            }
        }
        let len = match self.len {
            Some(len) => len,
            None => return,
        };
        self.fed += chunk.len() as u64;
        if self.fed > len {
            self.broken = true;
            return;
        }
        self.h.update(chunk);
    }

    /// The hash of a body of `body_len` bytes (the message, for gRPC) with these headers, if
    /// exactly that body was fed.
    pub fn finish(self, body_len: usize, headers: &[(String, String)], hash_headers: &[String]) -> Option<String> {
        if self.broken || self.len != Some(self.fed) || self.fed != body_len as u64 {
            return None;
        }
        Some(finish_response_hash(self.h, headers, hash_headers))
    }
}

pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    s.as_bytes().chunks(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base<'a>(body: &'a KeyedBytes<'a>, vary: &'a [(String, Vec<String>)]) -> KeyInput<'a> {
        KeyInput {
            method: "POST", path: "/v2/models/m/infer", model: "m", version: "", model_headers: &[None, None],
            generation: 0, color: "", vary, principal: None, body,
        }
    }

    #[test]
    fn body_forms_are_separated() {
        use crate::shaping::RequestId;
        let none: Vec<(String, Vec<String>)> = vec![];
        let whole = KeyedBytes::whole(b"{\"a\":1}");
        let split = KeyedBytes { parts: vec![b"{\"a\"", b":1}"], json_len: None, id: RequestId::None };
        assert_eq!(cache_key(&base(&whole, &none)), cache_key(&base(&split, &none)), "parts hash as their concatenation");
        let spliced = KeyedBytes { id: RequestId::Spliced(b"x".to_vec()), ..whole.clone() };
        let other_id = KeyedBytes { id: RequestId::Spliced(b"y".to_vec()), ..whole.clone() };
        let kept = KeyedBytes { id: RequestId::Kept, ..whole.clone() };
        let binary = KeyedBytes { json_len: Some(7), ..whole.clone() };
        let k = cache_key(&base(&whole, &none));
        assert_eq!(cache_key(&base(&spliced, &none)), cache_key(&base(&other_id, &none)), "the id itself is not keyed");
        for v in [&spliced, &kept, &binary] {
            assert_ne!(cache_key(&base(v, &none)), k);
        }
        assert_ne!(cache_key(&base(&spliced, &none)), cache_key(&base(&kept, &none)));
    }

    #[test]
    fn every_component_changes_the_key() {
        let none: Vec<(String, Vec<String>)> = vec![];
        let (x, y) = (KeyedBytes::whole(b"x"), KeyedBytes::whole(b"y"));
        let k0 = cache_key(&base(&x, &none));
        assert_eq!(k0, cache_key(&base(&x, &none)));
        let mut variants = vec![];
        variants.push(cache_key(&base(&y, &none)));
        variants.push(cache_key(&KeyInput { method: "PUT", ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { path: "/v1/infer", ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { model: "n", ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { version: "2", ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { generation: 1, ..base(&x, &none) }));
        // Model-selecting headers: absent, empty and a value apart, and which header it is.
        variants.push(cache_key(&KeyInput { model_headers: &[Some("m"), None], ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { model_headers: &[None, Some("2")], ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { model_headers: &[None, Some("")], ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { model_headers: &[Some("2"), None], ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { color: "blue", ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { principal: Some("spiffe://a"), ..base(&x, &none) }));
        let vary_a = vec![("x-tenant".to_string(), vec!["a".to_string()])];
        let vary_absent = vec![("x-tenant".to_string(), vec![])];
        let vary_empty = vec![("x-tenant".to_string(), vec![String::new()])];
        let vary_twice = vec![("x-tenant".to_string(), vec!["a".to_string(), "b".to_string()])];
        let vary_joined = vec![("x-tenant".to_string(), vec!["a,b".to_string()])];
        let vary_other_first = vec![("x-tenant".to_string(), vec!["b".to_string(), "a".to_string()])];
        variants.push(cache_key(&base(&x, &vary_a)));
        variants.push(cache_key(&base(&x, &vary_absent)));
        variants.push(cache_key(&base(&x, &vary_empty)));
        variants.push(cache_key(&base(&x, &vary_twice)));
        variants.push(cache_key(&base(&x, &vary_joined)));
        variants.push(cache_key(&base(&x, &vary_other_first)));
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(*v, k0, "variant {}", i);
            for w in &variants[i + 1..] {
                assert_ne!(v, w);
            }
        }
    }

    #[test]
    fn field_boundaries_are_unambiguous() {
        let none: Vec<(String, Vec<String>)> = vec![];
        let empty = KeyedBytes::whole(b"");
        let a = cache_key(&KeyInput { model: "ab", version: "c", ..base(&empty, &none) });
        let b = cache_key(&KeyInput { model: "a", version: "bc", ..base(&empty, &none) });
        assert_ne!(a, b);
    }

    #[test]
    fn response_hash_matches_definition() {
        let headers = vec![
            ("x-model-id".to_string(), "m".to_string()),
            ("Content-Type".to_string(), "application/json".to_string()),
            ("server".to_string(), "x".to_string()),
        ];
        let names = vec!["content-type".to_string(), "etag".to_string(), "x-model-id".to_string()];
        let mut framed = 5u64.to_be_bytes().to_vec();
        framed.extend_from_slice(b"hello");
        framed.extend_from_slice(b"content-type:application/json\nx-model-id:m\n");
        let expected = format!("xxh3-128:{:032x}", xxhash_rust::xxh3::xxh3_128(&framed));
        assert_eq!(response_hash(b"hello", &headers, &names), expected);
        // Known vectors from the reference implementation (Python `xxhash.xxh3_128_hexdigest`):
        // empty body, no headers = eight zero bytes; and the case above.
        assert_eq!(response_hash(b"", &[], &[]), "xxh3-128:2c0a8a99dc147d5445c3b49d035665b2");
        assert_eq!(expected, "xxh3-128:e3fd90888d296f32aa0a03b83d0437d4");
    }

    /// Cuts `body` into chunks at the positions `cuts` (sorted, within the body).
    fn chunks<'a>(body: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
        let mut out = Vec::new();
        let mut at = 0;
        for &c in cuts.iter().chain(std::iter::once(&body.len())) {
            out.push(&body[at..c]);
            at = c;
        }
        out
    }

    #[test]
    fn streamed_hash_equals_one_shot_for_any_chunking() {
        let headers = vec![("content-type".to_string(), "application/json".to_string())];
        let names = vec!["content-type".to_string()];
        let mut rng = crate::test_rng::Rng(0x5eed);
        for round in 0..300 {
            let len = if round < 10 { round } else { rng.below(5000) as usize };
            let body: Vec<u8> = (0..len).map(|i| (i * 7 + round) as u8).collect();
            let mut cuts: Vec<usize> = (0..rng.below(6)).map(|_| rng.below(len as u64 + 1) as usize).collect();
            cuts.sort_unstable();
            let expected = response_hash(&body, &headers, &names);
            // The streaming hasher against the one-shot function over the same bytes.
            let mut whole = (len as u64).to_be_bytes().to_vec();
            whole.extend_from_slice(&body);
            whole.extend_from_slice(b"content-type:application/json\n");
            assert_eq!(expected, format!("xxh3-128:{:032x}", xxhash_rust::xxh3::xxh3_128(&whole)), "round {}", round);
            let mut http = AnswerHasher::http(len as u64);
            for c in chunks(&body, &cuts) {
                http.update(c);
            }
            assert_eq!(http.finish(len, &headers, &names), Some(expected.clone()), "http, round {}", round);
            // gRPC: the same message framed; cuts anywhere, the frame header included.
            let framed = crate::grpc::frame(&body);
            let mut gcuts: Vec<usize> = (0..rng.below(6)).map(|_| rng.below(framed.len() as u64 + 1) as usize).collect();
            gcuts.sort_unstable();
            let mut grpc = AnswerHasher::grpc();
            for c in chunks(&framed, &gcuts) {
                grpc.update(c);
            }
            assert_eq!(grpc.finish(len, &headers, &names), Some(expected), "grpc, round {}", round);
        }
    }

    #[test]
    fn streamed_hash_refuses_what_it_cannot_vouch_for() {
        let none: Vec<(String, String)> = vec![];
        // Declared longer or shorter than what came.
        let mut short = AnswerHasher::http(5);
        short.update(b"abc");
        assert_eq!(short.finish(3, &none, &[]), None);
        let mut long = AnswerHasher::http(2);
        long.update(b"abc");
        assert_eq!(long.finish(3, &none, &[]), None);
        // Fed right, but the caller's body differs in length.
        let mut ok = AnswerHasher::http(3);
        ok.update(b"abc");
        assert_eq!(ok.clone().finish(4, &none, &[]), None);
        assert_eq!(ok.finish(3, &none, &[]), Some(response_hash(b"abc", &none, &[])));
        // gRPC: a compressed frame, a second frame, a frame header cut short.
        let mut compressed = AnswerHasher::grpc();
        compressed.update(&[1, 0, 0, 0, 1, b'x']);
        assert_eq!(compressed.finish(1, &none, &[]), None);
        let mut two = AnswerHasher::grpc();
        let mut both = crate::grpc::frame(b"x");
        both.extend_from_slice(&crate::grpc::frame(b"y"));
        two.update(&both);
        assert_eq!(two.finish(1, &none, &[]), None);
        let mut cut = AnswerHasher::grpc();
        cut.update(&[0, 0, 0]);
        assert_eq!(cut.finish(0, &none, &[]), None);
    }

    #[test]
    fn hex_roundtrip() {
        assert_eq!(hex(&[0, 255, 16]), "00ff10");
        assert_eq!(unhex("00ff10"), Some(vec![0, 255, 16]));
        assert_eq!(unhex("0g"), None);
        assert_eq!(unhex("abc"), None);
    }
}
