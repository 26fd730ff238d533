//! How a hit is answered: status, headers and body built from a stored entry and the request.
//! Plain Rust so `cargo test` checks it; the stream context only sends what this returns.
//!
//! `hit_message` is the one place the answer's body is derived from the entry: a request-specific
//! rewrite of the stored answer (such as echoing the caller's request id) belongs there.

use crate::entry::Entry;
use std::borrow::Cow;
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
    /// HTTP: the body. gRPC: the message, unframed (the caller frames it). Borrowed from the
    /// entry unless the caller's id was put in.
    pub body: Cow<'e, [u8]>,
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

/// The body (HTTP) or message (gRPC, unframed) a hit sends for this request: the stored answer
/// with the requester's id put back where the server wrote it, and by how many bytes that grew
/// the JSON part (for the binary extension's length header).
pub fn hit_message<'e>(entry: &'e Entry, request: &HitRequest) -> (Cow<'e, [u8]>, usize) {
    // The splice point was checked against the body when the entry was decoded.
    shaping::answer_body(&entry.body, entry.splice.as_ref(), request.id).unwrap_or((Cow::Borrowed(&entry.body), 0))
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
        return HitAnswer { status: 304, headers, body: Cow::Borrowed(&[]) };
    }
    let (body, grown) = hit_message(entry, request);
    let mut all = stored_headers(entry, grown);
    all.append(&mut headers);
    HitAnswer { status: entry.status, headers: all, body }
}

/// A gRPC hit: the stored response headers and the hit headers, the message unframed.
pub fn grpc_hit<'e>(entry: &'e Entry, request: &HitRequest, now_ms: u64) -> HitAnswer<'e> {
    let (body, grown) = hit_message(entry, request);
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
}
