//! Response decisions (the response half of what Envoy's cache filter calls its cache policy):
//! whether an origin answer may be stored and for how long (`check_storable`), whether a miss
//! holds its answer back (`should_hold`), and the entry it stores (`build_entry`). The request
//! half is `request`.

use crate::cache_control::{self, Freshness, NotStored, Ttl};
use crate::coalesce::Release;
use crate::config::Policy;
use crate::entry::Entry;
use crate::hashing::{response_hash, AnswerHasher};
use crate::headermap::{header, joined, values, Headers};
use crate::names::{COLOR_HEADER, KSERVE_BINARY_HEADER, MODEL_SELECTING_HEADERS};
use crate::request::Cacheable;
use crate::shaping::{self, RequestId, Splice};
use crate::stale;
/// A miss whose answer arrives whole and small is held until its end, so its headers can say
/// `stored` and carry the hash; larger or streamed answers flow through at once (copied for
/// the store). Well under Envoy's default 1 MiB buffer.
pub const HOLD_BYTES: usize = 256 * 1024;

/// Whether a miss's answer starts out held (see `HOLD_BYTES`): never an event stream; gRPC
/// (unary ModelInfer, one message) until it grows past `HOLD_BYTES`; HTTP only when its
/// declared length is within `HOLD_BYTES` (an answer without a length may be paced).
pub fn should_hold(grpc: bool, content_type: Option<&str>, content_length: Option<&str>) -> bool {
    if content_type.map_or(false, |ct| ct.trim_start().to_ascii_lowercase().starts_with("text/event-stream")) {
        return false;
    }
    if grpc {
        return true;
    }
    content_length.and_then(|n| n.trim().parse::<usize>().ok()).map_or(false, |n| n <= HOLD_BYTES)
}

/// What a miss does with its answer once the answer's headers are in (both hosts).
pub enum Collect {
    /// Not stored, for `why` (its `Cache-Status` says so); a coalescing leader hands its
    /// waiters `release`.
    Skip { why: NotStored, release: Release },
    /// The answer has no body: store it now.
    StoreNow(Ttl),
    /// Copy the body for the store as it passes (up to `limit` bytes: `max_entry_bytes`, plus a
    /// gRPC message's frame). `held`: the response headers wait for the end of a small answer
    /// (`should_hold`; otherwise they leave at once saying `fwd=miss`). `hasher`: fed each chunk
    /// as it arrives, when the hash's leading length is known now and the stored body is the
    /// body as received (an echoed request id is taken out first: hashed at the end instead).
    /// `declared`: the answer's `content-length`, room to reserve for the copy.
    Start { ttl: Ttl, limit: usize, held: bool, hasher: Option<AnswerHasher>, declared: usize },
}

/// The answer's status and what the miss `c` does with it (`eos`: the headers end the answer;
/// `hold_headers`: the configuration's).
pub fn begin_collect(c: &Cacheable, response: &Headers, eos: bool, now_ms: u64, max_entry_bytes: u64, hold_headers: bool)
    -> (u16, Collect) {
    let headers = &response.pairs;
    let status: u16 = header(headers, ":status").and_then(|s| s.parse().ok()).unwrap_or(0);
    let grpc_status = header(headers, "grpc-status");
    let skip = |why: NotStored, release: Release| (status, Collect::Skip { why, release });
    if status != 200 {
        return skip(NotStored::Status, Release::for_status(status, stale::is_origin_error(status, grpc_status)));
    }
    if c.grpc && (eos || grpc_status.is_some()) {
        // Trailers-only gRPC responses are errors (or empty): nothing to store.
        let release =
            if stale::is_origin_error(status, grpc_status) { Release::OriginError } else { Release::not_stored(NotStored::GrpcStatus) };
        return skip(NotStored::GrpcStatus, release);
    }
    let ttl = match check_storable(&c.policy, headers, &response.not_utf8, now_ms) {
        Ok(t) => t,
        Err(why) => return skip(why, Release::not_stored(why)),
    };
    let limit = max_entry_bytes as usize + if c.grpc { 5 } else { 0 };
    let declared_text = header(headers, "content-length");
    let declared = declared_text.and_then(|v| v.trim().parse::<usize>().ok());
    if declared.map_or(false, |n| n > limit) {
        return skip(NotStored::TooBig, Release::not_stored(NotStored::TooBig));
    }
    if eos {
        return (status, Collect::StoreNow(ttl));
    }
    let held = hold_headers && should_hold(c.grpc, header(headers, "content-type"), declared_text);
    let hasher = match (&c.request_id, c.grpc, declared) {
        (RequestId::Spliced(_), _, _) => None,
        (_, true, _) => Some(AnswerHasher::grpc()),
        (_, false, Some(n)) => Some(AnswerHasher::http(n as u64)),
        (_, false, None) => None,
    };
    (status, Collect::Start { ttl, limit, held, hasher, declared: declared.unwrap_or(0).min(limit) })
}

/// Request headers a stored answer may vary on without losing correctness: those the key has.
fn varies_only_on_keyed(policy: &Policy, name: &str) -> bool {
    name == COLOR_HEADER || MODEL_SELECTING_HEADERS.contains(&name) || policy.vary_headers.iter().any(|v| v == name)
}

/// Whether an origin answer may be stored, and for how long (the status is checked before).
/// `Vary` (RFC 9111 §4.1): `*` is never stored; other names are fine only when the key already
/// includes them (policy `vary_headers`, the colour, the model-selecting headers), since a stored answer
/// is then only reused for requests that agree on them. Otherwise `detail=vary`.
pub fn check_storable(
    policy: &Policy,
    headers: &[(String, String)],
    not_utf8: &[String],
    now_ms: u64,
) -> Result<cache_control::Ttl, NotStored> {
    // RFC 2965's Set-Cookie2 (obsolete, still sent by some servers) sets state just the same.
    if header(headers, "set-cookie").is_some() || header(headers, "set-cookie2").is_some() {
        return Err(NotStored::SetCookie);
    }
    let vary = joined(headers, "vary").unwrap_or_default();
    for name in vary.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if name == "*" || !varies_only_on_keyed(policy, &name.to_ascii_lowercase()) {
            return Err(NotStored::Vary);
        }
    }
    let cc = joined(headers, "cache-control");
    let expires = values(headers, "expires");
    let freshness = Freshness { cache_control: cc.as_deref(), expires: &expires, date: header(headers, "date") };
    let ttl = cache_control::response_ttl(policy, &freshness, now_ms / 1000)?;
    // Checked last: a header the filter cannot replay byte for byte (checked after the
    // origin's own reasons, which are more useful to report).
    if !not_utf8.is_empty() {
        return Err(NotStored::HeaderBytes);
    }
    Ok(ttl)
}

/// Response headers that belong to one transmission, not to the cached answer.
fn is_per_response(name: &str) -> bool {
    name.starts_with(':')
        || name.starts_with("x-envoy-")
        || matches!(
            name,
            "date" | "content-length" | "transfer-encoding" | "connection" | "keep-alive" | "age"
                | "cache-status" | "x-response-hash" | "set-cookie" | "set-cookie2" | "grpc-status" | "grpc-message"
                | "proxy-connection" | "upgrade" | "trailer" | "server"
        )
}

/// The answer a miss stores: its hash, the headers replayed on hits, the ETag to send now.
#[derive(Debug)]
pub struct Stored {
    pub entry: Entry,
    /// Some when the origin sent no ETag and the filter adds `"<hash>"`.
    pub added_etag: Option<String>,
}

/// `body` is the answer as sent (a gRPC message without its frame). The echoed request id is
/// taken out, and the hash covers the answer without it: the same for every caller.
/// `hashed`: the answer as it streamed through (`AnswerHasher`), used when it covers exactly
/// this body (no request id taken out); otherwise the body is hashed here.
pub fn build_entry(
    c: &Cacheable,
    response_headers: &[(String, String)],
    status: u16,
    body: Vec<u8>,
    ttl: cache_control::Ttl,
    hashed: Option<AnswerHasher>,
) -> Result<Stored, NotStored> {
    let now_ms = c.request_ms;
    let mut headers: Vec<(String, String)> = response_headers
        .iter()
        .filter(|(n, _)| !is_per_response(&n.to_ascii_lowercase()))
        .map(|(n, v)| (n.to_ascii_lowercase(), v.clone()))
        .collect();
    let stripped = match &c.request_id {
        RequestId::Spliced(id) if c.grpc => shaping::strip_proto_answer(body, id),
        RequestId::Spliced(id) => shaping::strip_json_answer(body, header(&headers, KSERVE_BINARY_HEADER), id),
        _ => Ok(shaping::Stripped { body, splice: None }),
    };
    let shaping::Stripped { body, splice } = stripped.map_err(|_| NotStored::Unparsable)?;
    let hash = if let Some(Splice::Json { json_len_header: true, before, after, .. }) = &splice {
        // The binary extension's JSON length is stored (and hashed) for the answer without its id.
        let removed = before.len() + after.len() + request_id_len(c);
        for (n, v) in headers.iter_mut() {
            if n == KSERVE_BINARY_HEADER {
                *v = v.parse::<usize>().ok().and_then(|x| x.checked_sub(removed)).ok_or(NotStored::Unparsable)?.to_string();
            }
        }
        response_hash(&body, &headers, &c.policy.hash_headers)
    } else {
        match hashed.and_then(|h| h.finish(body.len(), response_headers, &c.policy.hash_headers)) {
            Some(hash) => hash,
            None => response_hash(&body, response_headers, &c.policy.hash_headers),
        }
    };
    let added_etag = if header(&headers, "etag").is_none() {
        let etag = format!("\"{}\"", hash);
        headers.push(("etag".to_string(), etag.clone()));
        Some(etag)
    } else {
        None
    };
    let (stale_if_error_s, stale_while_revalidate_s) =
        cache_control::stale_windows(&c.policy, joined(response_headers, "cache-control").as_deref());
    let usage = if c.grpc { crate::usage::Usage::default() } else { crate::usage::of_answer(header(&headers, "content-type"), &body) };
    let entry = Entry {
        key: c.key,
        policy: crate::accounting::policy_tag(&c.policy.model_prefix),
        stored_at_ms: now_ms,
        expires_at_ms: now_ms.saturating_add(ttl.s.saturating_mul(1000)),
        ttl_from_policy: ttl.from_policy,
        status,
        grpc: c.grpc,
        response_hash: hash,
        headers,
        body: body.into(),
        splice,
        stale_if_error_s,
        stale_while_revalidate_s,
        usage,
    };
    Ok(Stored { entry, added_etag })
}

fn request_id_len(c: &Cacheable) -> usize {
    match &c.request_id {
        RequestId::Spliced(id) => id.len(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn miss(grpc: bool) -> Cacheable {
        Cacheable { grpc, ..crate::insert::tests::cacheable(100).0 }
    }

    fn answer(pairs: &[(&str, &str)]) -> Headers {
        Headers { pairs: pairs.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect(), not_utf8: Vec::new() }
    }

    fn skipped(plan: Collect) -> Option<(NotStored, Release)> {
        match plan {
            Collect::Skip { why, release } => Some((why, release)),
            _ => None,
        }
    }

    #[test]
    fn the_answer_headers_decide_what_a_miss_does() {
        let http = miss(false);
        let at = |pairs: &[(&str, &str)], eos: bool, hold: bool| begin_collect(&http, &answer(pairs), eos, 0, 100, hold);
        // Errors: the leader's waiters learn whether stale-if-error covers it, or may retry.
        assert_eq!(skipped(at(&[(":status", "503")], false, true).1), Some((NotStored::Status, Release::OriginError)));
        assert_eq!(skipped(at(&[(":status", "404")], false, true).1), Some((NotStored::Status, Release::Uncacheable)));
        assert_eq!(skipped(at(&[(":status", "200"), ("cache-control", "no-store")], false, true).1),
                   Some((NotStored::NoStore, Release::Uncacheable)));
        assert_eq!(skipped(at(&[(":status", "200"), ("content-length", "101")], false, true).1),
                   Some((NotStored::TooBig, Release::Uncacheable)));
        assert!(matches!(at(&[(":status", "200")], true, true), (200, Collect::StoreNow(_))));
        // A small declared answer is held and hashed as it arrives; unheld when the config says so.
        match at(&[(":status", "200"), ("content-length", "10")], false, true).1 {
            Collect::Start { held, hasher, declared, limit, .. } => {
                assert!(held && hasher.is_some());
                assert_eq!((declared, limit), (10, 100));
            }
            _ => panic!("collects"),
        }
        assert!(matches!(at(&[(":status", "200"), ("content-length", "10")], false, false).1, Collect::Start { held: false, .. }));
        // No length: streams, hashed at the end.
        assert!(matches!(at(&[(":status", "200")], false, true).1, Collect::Start { held: false, hasher: None, .. }));
        // gRPC: trailers-only is an error (or empty); a frame's 5 bytes on top of the limit.
        let grpc = miss(true);
        let unavailable = answer(&[(":status", "200"), ("grpc-status", "14")]);
        assert_eq!(skipped(begin_collect(&grpc, &unavailable, true, 0, 100, true).1), Some((NotStored::GrpcStatus, Release::OriginError)));
        let ok = answer(&[(":status", "200"), ("content-type", "application/grpc")]);
        assert!(matches!(begin_collect(&grpc, &ok, false, 0, 100, true).1, Collect::Start { held: true, limit: 105, .. }));
    }
}
