//! How a hit is answered: status, headers and body built from a stored entry and the request.
//! Plain Rust so `cargo test` checks it; the stream context only sends what this returns.
//!
//! `hit_message` is the one place the answer's body is derived from the entry: a request-specific
//! rewrite of the stored answer (such as echoing the caller's request id) belongs there. A gRPC
//! hit's message is written into a buffer that starts with the frame header's room, so the answer
//! is copied once on its way to the wire (docs/filter.md, "Cost").

use crate::entry::Entry;
use crate::grpc;
use std::borrow::Cow;
use std::ops::Deref;
use crate::shaping::{self, RequestId, Splice};
use crate::names::{cache_status_hit, CACHE_STATUS, HASH_HEADER, KSERVE_BINARY_HEADER};

/// What the filter knows about the request it answers from the cache.
pub struct HitRequest<'a> {
    /// Request headers, lowercase names.
    pub headers: &'a [(String, String)],
    /// The whole request body (for gRPC the framed ModelInferRequest).
    pub body: &'a [u8],
    /// The request's KServe id, as the key read it: the answer carries it.
    pub id: &'a RequestId,
}

impl<'a> HitRequest<'a> {
    fn header(&self, name: &str) -> Option<&'a str> {
        crate::headermap::header(self.headers, name)
    }
}

#[derive(Debug, PartialEq)]
pub struct HitAnswer<'e> {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: HitBody<'e>,
}

/// What a hit sends as its body. HTTP: the body, borrowed from the entry unless the caller's id
/// was put in. gRPC: the message, built framed. Derefs to the body (HTTP) or the unframed
/// message (gRPC); `into_wire` gives the bytes as sent.
#[derive(Debug, PartialEq)]
pub struct HitBody<'e> {
    bytes: Cow<'e, [u8]>,
    /// Where the body or message starts in `bytes` (gRPC: after the frame header).
    at: usize,
}

impl<'e> HitBody<'e> {
    fn plain(bytes: Cow<'e, [u8]>) -> HitBody<'e> {
        HitBody { bytes, at: 0 }
    }

    /// The bytes as they go on the wire (gRPC: framed), without a copy when they were built.
    pub fn into_wire(self) -> Vec<u8> {
        self.bytes.into_owned()
    }
}

impl Deref for HitBody<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[self.at..]
    }
}

impl PartialEq<Vec<u8>> for HitBody<'_> {
    fn eq(&self, other: &Vec<u8>) -> bool {
        self[..] == other[..]
    }
}

/// Seconds left and age of a fresh entry.
pub fn freshness(entry: &Entry, now_ms: u64) -> (u64, u64) {
    let left = entry.expires_at_ms.saturating_sub(now_ms);
    ((left + 999) / 1000, now_ms.saturating_sub(entry.stored_at_ms) / 1000)
}

/// Headers a hit carries besides the stored ones.
pub fn hit_headers(entry: &Entry, now_ms: u64) -> Vec<(String, String)> {
    let (ttl, age) = freshness(entry, now_ms);
    vec![
        (CACHE_STATUS.to_string(), cache_status_hit(ttl)),
        ("age".to_string(), age.to_string()),
        (HASH_HEADER.to_string(), entry.response_hash.clone()),
    ]
}

/// Replaces a hit's `Cache-Status` (a stale answer says why it was served).
pub fn set_cache_status(answer: &mut HitAnswer, value: String) {
    for (n, v) in answer.headers.iter_mut() {
        if n == CACHE_STATUS {
            *v = value;
            return;
        }
    }
}

/// The body (HTTP) or message (gRPC) a hit sends for this request: the stored answer with the
/// requester's id put back where the server wrote it, and by how many bytes that grew the JSON
/// part (for the binary extension's length header). `grpc`: written once, after the frame
/// header's room, the header written last.
pub fn hit_message<'e>(entry: &'e Entry, request: &HitRequest, grpc: bool) -> (HitBody<'e>, usize) {
    let (splice, id) = (entry.splice.as_ref(), request.id);
    if grpc {
        let mut framed = grpc::frame_buffer(shaping::answer_len(&entry.body, splice, id));
        // The splice point was checked against the body when the entry was decoded.
        let grown = match shaping::write_answer(&mut framed, &entry.body, splice, id) {
            Some(grown) => grown,
            None => {
                framed.extend_from_slice(&entry.body);
                0
            }
        };
        grpc::close_frame(&mut framed);
        return (HitBody { bytes: Cow::Owned(framed), at: grpc::FRAME_HEADER_LEN }, grown);
    }
    let (body, grown) = shaping::answer_body(&entry.body, splice, id).unwrap_or((Cow::Borrowed(&entry.body), 0));
    (HitBody::plain(body), grown)
}

/// The stored headers for this hit: the binary extension's JSON length grows with the id.
fn stored_headers(entry: &Entry, grown: usize) -> Vec<(String, String)> {
    let mut headers = entry.headers.clone();
    if let (true, Some(Splice::Json { json_len_header: true, .. })) = (grown > 0, &entry.splice) {
        for (n, v) in headers.iter_mut() {
            if n == KSERVE_BINARY_HEADER {
                if let Ok(len) = v.parse::<usize>() {
                    *v = (len + grown).to_string();
                }
            }
        }
    }
    headers
}

/// Does the request's If-None-Match name this entry (its ETag or its response hash)?
pub fn not_modified(if_none_match: Option<&str>, entry: &Entry) -> bool {
    let inm = match if_none_match {
        Some(v) => v,
        None => return false,
    };
    let etag = crate::headermap::header(&entry.headers, "etag").map(strip_etag);
    // `*` is not matched: RFC 9110 §13.1.2 allows a 304 for it only on GET and HEAD, and these
    // are POSTs (the hit is answered in full instead, as the origin would).
    inm.split(',').map(str::trim).filter(|t| *t != "*").any(|t| strip_etag(t) == entry.response_hash || Some(strip_etag(t)) == etag)
}

fn strip_etag(t: &str) -> &str {
    t.trim().trim_start_matches("W/").trim_matches('"')
}

/// An HTTP hit: the stored answer with the hit headers, or 304 when If-None-Match names it.
pub fn http_hit<'e>(entry: &'e Entry, request: &HitRequest, now_ms: u64) -> HitAnswer<'e> {
    let mut headers = hit_headers(entry, now_ms);
    if not_modified(request.header("if-none-match"), entry) {
        if let Some(etag) = crate::headermap::header(&entry.headers, "etag") {
            headers.push(("etag".to_string(), etag.to_string()));
        }
        return HitAnswer { status: 304, headers, body: HitBody::plain(Cow::Borrowed(&[])) };
    }
    let (body, grown) = hit_message(entry, request, false);
    let mut all = stored_headers(entry, grown);
    all.append(&mut headers);
    HitAnswer { status: entry.status, headers: all, body }
}

/// A gRPC hit: the stored response headers and the hit headers, the message (framed on the wire).
pub fn grpc_hit<'e>(entry: &'e Entry, request: &HitRequest, now_ms: u64) -> HitAnswer<'e> {
    let (body, grown) = hit_message(entry, request, true);
    let mut all = stored_headers(entry, grown);
    if crate::headermap::header(&all, "content-type").is_none() {
        all.insert(0, ("content-type".to_string(), "application/grpc".to_string()));
    }
    all.extend(hit_headers(entry, now_ms));
    HitAnswer { status: 200, headers: all, body }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::sample;

    fn request<'a>(headers: &'a [(String, String)]) -> HitRequest<'a> {
        HitRequest { headers, body: b"", id: &RequestId::None }
    }

    #[test]
    fn http_hits_and_304() {
        let mut e = sample(1, b"{}", 15_000);
        e.stored_at_ms = 10_000;
        e.headers.push(("etag".into(), "\"v1\"".into()));
        let none: Vec<(String, String)> = vec![];
        let a = http_hit(&e, &request(&none), 12_500);
        assert_eq!(a.status, 200);
        assert_eq!(&a.body[..], b"{}");
        assert!(a.headers.contains(&("cache-status".into(), "meshcache; hit; ttl=3".into())));
        assert!(a.headers.contains(&("age".into(), "2".into())));
        assert!(a.headers.contains(&("content-type".into(), "application/json".into())));
        let inm = vec![("if-none-match".to_string(), "W/\"v1\"".to_string())];
        let nm = http_hit(&e, &request(&inm), 12_500);
        assert_eq!(nm.status, 304);
        assert!(nm.body.is_empty());
        assert!(nm.headers.contains(&("etag".into(), "\"v1\"".into())));
        assert!(!nm.headers.iter().any(|(n, _)| n == "content-type"));
    }

    #[test]
    fn conditional_matching() {
        let e = sample(1, b"{}", 5);
        assert!(not_modified(Some(&format!("\"{}\"", e.response_hash)), &e));
        assert!(!not_modified(Some("\"zzz\", *"), &e), "* is no match on a POST (RFC 9110 13.1.2)");
        assert!(!not_modified(Some("*"), &e));
        assert!(!not_modified(Some("\"zzz\""), &e));
        assert!(!not_modified(None, &e));
    }

    #[test]
    fn grpc_hit_carries_the_message_and_hit_headers() {
        let mut e = sample(2, b"\x0a\x01m", 9_000);
        e.grpc = true;
        let none: Vec<(String, String)> = vec![];
        let a = grpc_hit(&e, &request(&none), 1_000);
        assert_eq!(&a.body[..], b"\x0a\x01m");
        assert!(a.headers.iter().any(|(n, v)| n == "x-response-hash" && v == &e.response_hash));
        e.splice = Some(Splice::Proto { at: 3 });
        let id = RequestId::Spliced(b"r-9".to_vec());
        let with_id = grpc_hit(&e, &HitRequest { headers: &none, body: b"", id: &id }, 1_000);
        assert_eq!(&with_id.body[..], b"\x0a\x01m\x1a\x03r-9");
    }

    fn pb_bytes(field: u8, value: &[u8]) -> Vec<u8> {
        let mut out = vec![field << 3 | 2];
        grpc::put_varint(&mut out, value.len() as u64);
        out.extend_from_slice(value);
        out
    }

    /// The gRPC hit built framed in one buffer is byte for byte `frame(answer_body(..))`, the two
    /// copies it replaced, for every id length and answer size around the varint boundaries, and
    /// for answers whose id is absent, present or repeated (as shaping stores them).
    #[test]
    fn grpc_hit_built_framed_equals_the_spliced_message_framed() {
        let ids: Vec<Vec<u8>> = [0usize, 1, 5, 126, 127, 128, 129, 255, 256].iter().map(|n| vec![b'i'; *n]).collect();
        let none: Vec<(String, String)> = vec![];
        // Outputs whose field length crosses the 1/2/3-byte varint boundaries, and whole answers
        // of exactly 127/128 and 16383/16384 bytes without the id.
        let mut answers: Vec<Vec<u8>> = Vec::new();
        for payload in [0usize, 127, 128, 16_383, 16_384] {
            answers.push(pb_bytes(6, &vec![7u8; payload]));
        }
        let head = [pb_bytes(1, b"m"), pb_bytes(2, b"1")].concat();
        for total in [127usize, 128, 16_383, 16_384] {
            // A field 6 of `rest` bytes in all (tag, length varint, payload) after `head`.
            let rest = total - head.len();
            let payload = rest - 1 - grpc::varint_len((rest - 2) as u64);
            let filler = pb_bytes(6, &vec![1u8; payload]);
            assert_eq!(head.len() + filler.len(), total);
            answers.push(filler);
        }
        let mut checked = 0;
        for rest in &answers {
            for id in &ids {
                // The request as grpc_request reads it (an empty id is no id).
                let request = [pb_bytes(1, b"m"), pb_bytes(3, id), pb_bytes(5, b"in")].concat();
                let rid = crate::shaping::grpc_request(&request).unwrap().key.id;
                let echoed = [head.clone(), pb_bytes(3, id), rest.clone()].concat();
                let absent = [head.clone(), rest.clone()].concat();
                let repeated = [head.clone(), pb_bytes(3, id), pb_bytes(3, id), rest.clone()].concat();
                for answer in [&echoed, &absent] {
                    let stripped = match shaping::strip_proto_answer(answer.clone(), id) {
                        Ok(s) => s,
                        Err(_) => panic!("storable: id {} B, answer {} B", id.len(), answer.len()),
                    };
                    let mut e = sample(3, &stripped.body, 9_000);
                    e.grpc = true;
                    e.splice = stripped.splice.clone();
                    // As a hit reads it: decoded in place from the stored bytes.
                    let e = Entry::decode_owned(e.encode()).unwrap();
                    let hit = grpc_hit(&e, &HitRequest { headers: &none, body: &request, id: &rid }, 1_000);
                    let (message, _) = shaping::answer_body(&e.body, e.splice.as_ref(), &rid).unwrap();
                    let wire = hit.body.into_wire();
                    assert_eq!(wire, grpc::frame(&message), "id {} B, answer {} B", id.len(), answer.len());
                    assert_eq!(wire.len(), wire.capacity(), "one allocation of the framed size");
                    // Each caller gets the server's answer byte for byte; an empty id is no id in
                    // proto3 (a server writes no field 3 for it), so none goes out.
                    let want: &[u8] = if id.is_empty() { &absent } else { answer };
                    assert_eq!(grpc::unframe(&wire), Some(want), "id {} B, answer {} B", id.len(), answer.len());
                    checked += 1;
                }
                // A repeated echo is not stored (shaping), so no hit ever serves it.
                assert!(shaping::strip_proto_answer(repeated, id).is_err());
            }
        }
        assert_eq!(checked, answers.len() * ids.len() * 2);
        // A splice point past the stored body (an entry that was not decoded) still frames
        // the stored message rather than panic.
        let mut bad = sample(4, b"\x0a\x01m", 9_000);
        bad.grpc = true;
        bad.splice = Some(Splice::Proto { at: 99 });
        let id = RequestId::Spliced(b"r".to_vec());
        let wire = grpc_hit(&bad, &HitRequest { headers: &none, body: b"", id: &id }, 1_000).body.into_wire();
        assert_eq!(wire, grpc::frame(b"\x0a\x01m"));
    }

    /// Host timing of a gRPC hit's message with an echoed id: spliced into a new message then
    /// framed (two allocations and copies of the answer) against built framed (one). Not a test
    /// of speed: `cargo test --release -- --ignored --nocapture grpc_hit_message_cost`.
    #[test]
    #[ignore]
    fn grpc_hit_message_cost() {
        let none: Vec<(String, String)> = vec![];
        let id = RequestId::Spliced(b"bench-request-0001".to_vec());
        for size in [1024usize, 65_536, 1_048_576] {
            let mut e = sample(5, &pb_bytes(5, &vec![3u8; size]), 9_000);
            e.grpc = true;
            e.splice = Some(Splice::Proto { at: 0 });
            let request = HitRequest { headers: &none, body: b"", id: &id };
            let n = if size > 100_000 { 500 } else { 20_000 };
            let t = std::time::Instant::now();
            for _ in 0..n {
                let (message, _) = shaping::answer_body(&e.body, e.splice.as_ref(), &id).unwrap();
                assert_eq!(grpc::frame(&message).len(), message.len() + 5);
            }
            let two = t.elapsed().as_secs_f64() * 1e6 / n as f64;
            let t = std::time::Instant::now();
            for _ in 0..n {
                let (body, _) = hit_message(&e, &request, true);
                assert_eq!(body.into_wire().len(), e.body.len() + 5 + 2 + 18);
            }
            let one = t.elapsed().as_secs_f64() * 1e6 / n as f64;
            println!("answer {} B: spliced then framed {:.2} us, built framed {:.2} us", size, two, one);
        }
    }
}
