//! Per-request decisions in plain Rust: which requests are cacheable, their key, how a hit is
//! answered and what a miss stores. The proxy-wasm glue only gathers inputs and applies these.

use crate::cache_control;
use crate::config::{Config, Policy, Scope};
use crate::entry::Entry;
use crate::hashing::{cache_key, response_hash, KeyDigest, KeyInput};
use crate::model::{self, ModelRef, ModelSource};
use crate::names::{COLOR_HEADER, MODEL_HEADER};

/// Request bodies larger than this are not buffered; the request passes through uncached.
pub const MAX_REQUEST_BYTES: usize = 8 * 1_048_576;

/// Request headers as the filter sees them (lowercase names).
pub struct RequestHead<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub headers: &'a [(String, String)],
}

impl<'a> RequestHead<'a> {
    pub fn header(&self, name: &str) -> Option<&'a str> {
        header(self.headers, name)
    }
}

pub fn header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

#[derive(Debug, PartialEq)]
pub enum HeadDecision {
    /// Not an inference request: untouched, no Cache-Status.
    Ignore,
    /// An inference request the cache stays out of: `Cache-Status: meshcache; fwd=bypass`.
    Bypass,
    /// Read the whole body, then decide. `refresh`: client no-cache (skip lookup, store).
    Buffer { source: ModelSource, refresh: bool },
}

pub fn on_head(head: &RequestHead) -> HeadDecision {
    if head.method != "POST" {
        return HeadDecision::Ignore;
    }
    if model::is_grpc_web(head.header("content-type")) && model::is_model_infer(head.path) {
        // grpc-web hits would need their own framing and trailers-in-body: not cached (yet).
        return HeadDecision::Bypass;
    }
    let source = match model::source_from_headers(head.path, head.header("content-type"), head.header(MODEL_HEADER)) {
        Some(s) => s,
        None => return HeadDecision::Ignore,
    };
    let cc = head.header("cache-control").map(cache_control::parse).unwrap_or_default();
    if cc.no_store {
        return HeadDecision::Bypass;
    }
    HeadDecision::Buffer { source, refresh: cc.no_cache }
}

/// A request the cache takes part in.
#[derive(Clone, Debug, PartialEq)]
pub struct Cacheable {
    pub key: KeyDigest,
    pub policy: Policy,
    pub grpc: bool,
    pub refresh: bool,
    /// The slot as the lookup saw it (None until looked up, or when unknown).
    pub seen: Option<crate::store::SlotSeen>,
    /// Request time: an answer's age counts from it (RFC 9111 corrected initial age).
    pub request_ms: u64,
}

#[derive(Debug, PartialEq)]
pub enum BodyDecision {
    Bypass,
    Cacheable(Cacheable),
}

pub fn on_body(
    config: &Config,
    head: &RequestHead,
    source: &ModelSource,
    refresh: bool,
    body: &[u8],
    // The peer identity costs a host call: asked for only when the matched policy scopes by it.
    principal: impl FnOnce() -> Option<String>,
) -> BodyDecision {
    let grpc = *source == ModelSource::GrpcBody;
    let model: Option<ModelRef> = match source {
        ModelSource::Known(m) => Some(m.clone()),
        ModelSource::JsonBody => model::model_from_json_body(body),
        ModelSource::GrpcBody => model::model_from_grpc_body(body),
    };
    let model = match model {
        Some(m) => m,
        None => return BodyDecision::Bypass,
    };
    let policy = match config.policy_for(&model.name) {
        Some(p) => p,
        None => return BodyDecision::Bypass,
    };
    let principal = match policy.scope {
        // Without a peer identity there is nothing to scope by: stay out.
        Scope::Principal => match principal().filter(|p| !p.is_empty()) {
            Some(p) => Some(p),
            None => return BodyDecision::Bypass,
        },
        Scope::Shared => {
            if head.header("authorization").is_some() {
                return BodyDecision::Bypass;
            }
            None
        }
    };
    let color = head.header(COLOR_HEADER).unwrap_or(&config.color);
    let vary: Vec<(String, Option<String>)> =
        policy.vary_headers.iter().map(|n| (n.clone(), head.header(n).map(str::to_string))).collect();
    let key = cache_key(&KeyInput {
        method: head.method,
        path: head.path,
        model: &model.name,
        version: &model.version,
        generation: policy.generation,
        color,
        vary: &vary,
        principal: principal.as_deref(),
        body,
    });
    BodyDecision::Cacheable(Cacheable { key, policy: policy.clone(), grpc, refresh, seen: None, request_ms: 0 })
}

/// Response headers that belong to one transmission, not to the cached answer.
fn is_per_response(name: &str) -> bool {
    name.starts_with(':')
        || name.starts_with("x-envoy-")
        || matches!(
            name,
            "date" | "content-length" | "transfer-encoding" | "connection" | "keep-alive" | "age"
                | "cache-status" | "x-response-hash" | "set-cookie" | "grpc-status" | "grpc-message"
                | "proxy-connection" | "upgrade" | "trailer" | "server"
        )
}

/// The answer a miss stores: its hash, the headers replayed on hits, the ETag to send now.
pub struct Stored {
    pub entry: Entry,
    /// Some when the origin sent no ETag and the filter adds `"<hash>"`.
    pub added_etag: Option<String>,
}

pub fn build_entry(
    c: &Cacheable,
    response_headers: &[(String, String)],
    status: u16,
    body: Vec<u8>,
    ttl_s: u64,
) -> Stored {
    let now_ms = c.request_ms;
    let hash = response_hash(&body, response_headers, &c.policy.hash_headers);
    let mut headers: Vec<(String, String)> = response_headers
        .iter()
        .filter(|(n, _)| !is_per_response(&n.to_ascii_lowercase()))
        .map(|(n, v)| (n.to_ascii_lowercase(), v.clone()))
        .collect();
    let added_etag = if header(&headers, "etag").is_none() {
        let etag = format!("\"{}\"", hash);
        headers.push(("etag".to_string(), etag.clone()));
        Some(etag)
    } else {
        None
    };
    let entry = Entry {
        key: c.key,
        stored_at_ms: now_ms,
        expires_at_ms: now_ms.saturating_add(ttl_s.saturating_mul(1000)),
        status,
        grpc: c.grpc,
        response_hash: hash,
        headers,
        body,
    };
    Stored { entry, added_etag }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer::not_modified;
    use crate::config::{parse_plugin_config, PluginConfig};

    fn config(json: &str) -> Config {
        match parse_plugin_config(json.as_bytes()).unwrap() {
            PluginConfig::Cache(c) => c,
            _ => unreachable!(),
        }
    }

    fn hs(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
    }

    fn decide(cfg: &Config, path: &str, headers: &[(&str, &str)], body: &[u8], principal: Option<&str>) -> BodyDecision {
        let h = hs(headers);
        let head = RequestHead { method: "POST", path, headers: &h };
        match on_head(&head) {
            HeadDecision::Buffer { source, refresh } => {
                on_body(cfg, &head, &source, refresh, body, || principal.map(str::to_string))
            }
            other => panic!("{:?}", other),
        }
    }

    fn key(d: BodyDecision) -> KeyDigest {
        match d {
            BodyDecision::Cacheable(c) => c.key,
            BodyDecision::Bypass => panic!("bypass"),
        }
    }

    #[test]
    fn head_decisions() {
        let h = hs(&[("content-type", "application/json")]);
        assert_eq!(on_head(&RequestHead { method: "GET", path: "/v2/models/m/infer", headers: &h }), HeadDecision::Ignore);
        assert_eq!(on_head(&RequestHead { method: "POST", path: "/other", headers: &h }), HeadDecision::Ignore);
        let ns = hs(&[("cache-control", "no-store")]);
        assert_eq!(on_head(&RequestHead { method: "POST", path: "/v2/models/m/infer", headers: &ns }), HeadDecision::Bypass);
        let nc = hs(&[("cache-control", "no-cache")]);
        assert!(matches!(
            on_head(&RequestHead { method: "POST", path: "/v2/models/m/infer", headers: &nc }),
            HeadDecision::Buffer { refresh: true, .. }
        ));
        let web = hs(&[("content-type", "application/grpc-web+proto")]);
        let infer = crate::model::GRPC_MODEL_INFER_PATH;
        assert_eq!(on_head(&RequestHead { method: "POST", path: infer, headers: &web }), HeadDecision::Bypass);
        let grpc = hs(&[("content-type", "application/grpc")]);
        assert_eq!(
            on_head(&RequestHead { method: "POST", path: infer, headers: &grpc }),
            HeadDecision::Buffer { source: ModelSource::GrpcBody, refresh: false }
        );
    }

    #[test]
    fn bypass_rules() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5}, {"model_prefix": "p", "ttl_s": 5, "scope": "principal"}]}"#);
        assert_eq!(decide(&cfg, "/v2/models/other/infer", &[], b"{}", None), BodyDecision::Bypass);
        assert_eq!(decide(&cfg, "/v2/models/m/infer", &[("authorization", "Bearer x")], b"{}", None), BodyDecision::Bypass);
        assert_eq!(decide(&cfg, "/v2/models/p/infer", &[], b"{}", None), BodyDecision::Bypass);
        assert!(matches!(decide(&cfg, "/v2/models/p/infer", &[("authorization", "Bearer x")], b"{}", Some("spiffe://a")), BodyDecision::Cacheable(_)));
        assert_eq!(decide(&cfg, "/v1/chat/completions", &[], br#"{"messages": []}"#, None), BodyDecision::Bypass);
        assert!(matches!(decide(&cfg, "/v1/chat/completions", &[], br#"{"model": "m1"}"#, None), BodyDecision::Cacheable(_)));
    }

    #[test]
    fn peer_identity_is_asked_for_only_by_principal_policies() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5}, {"model_prefix": "p", "ttl_s": 5, "scope": "principal"}]}"#);
        let h = hs(&[]);
        let asked = std::cell::Cell::new(0);
        let ask = || {
            asked.set(asked.get() + 1);
            Some("spiffe://cluster.local/ns/a/sa/x".to_string())
        };
        let shared = RequestHead { method: "POST", path: "/v2/models/m/infer", headers: &h };
        assert!(matches!(on_body(&cfg, &shared, &ModelSource::Known(crate::model::kserve_rest_model(shared.path).unwrap()), false, b"{}", ask), BodyDecision::Cacheable(_)));
        assert_eq!(asked.get(), 0);
        let scoped = RequestHead { method: "POST", path: "/v2/models/p/infer", headers: &h };
        assert!(matches!(on_body(&cfg, &scoped, &ModelSource::Known(crate::model::kserve_rest_model(scoped.path).unwrap()), false, b"{}", ask), BodyDecision::Cacheable(_)));
        assert_eq!(asked.get(), 1);
    }

    #[test]
    fn keys_separate_what_shapes_the_answer() {
        let cfg = config(r#"{"color": "green", "policies": [{"model_prefix": "m", "ttl_s": 5, "vary_headers": ["x-tenant"]},
            {"model_prefix": "p", "ttl_s": 5, "scope": "principal"}]}"#);
        let base = key(decide(&cfg, "/v2/models/m/infer", &[], b"{}", None));
        assert_eq!(base, key(decide(&cfg, "/v2/models/m/infer", &[], b"{}", None)));
        assert_eq!(base, key(decide(&cfg, "/v2/models/m/infer", &[("x-traffic-color", "green")], b"{}", None)), "config colour is the default");
        assert_ne!(base, key(decide(&cfg, "/v2/models/m/infer", &[("x-traffic-color", "blue")], b"{}", None)));
        assert_ne!(base, key(decide(&cfg, "/v2/models/m/infer", &[("x-tenant", "a")], b"{}", None)));
        assert_ne!(base, key(decide(&cfg, "/v2/models/m/infer", &[], b"{ }", None)));
        assert_ne!(base, key(decide(&cfg, "/v2/models/m/versions/2/infer", &[], b"{}", None)));
        let a = key(decide(&cfg, "/v2/models/p/infer", &[], b"{}", Some("spiffe://cluster.local/ns/a/sa/x")));
        let b = key(decide(&cfg, "/v2/models/p/infer", &[], b"{}", Some("spiffe://cluster.local/ns/b/sa/x")));
        assert_ne!(a, b);
        let purged = config(r#"{"color": "green", "policies": [{"model_prefix": "m", "ttl_s": 5, "generation": 1, "vary_headers": ["x-tenant"]}]}"#);
        assert_ne!(base, key(decide(&purged, "/v2/models/m/infer", &[], b"{}", None)), "purge = new generation = new keys");
    }

    #[test]
    fn stored_entries_and_conditional_hits() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5}]}"#);
        let c = match decide(&cfg, "/v2/models/m/infer", &[], b"{}", None) {
            BodyDecision::Cacheable(c) => c,
            _ => unreachable!(),
        };
        let resp = hs(&[(":status", "200"), ("content-type", "application/json"), ("date", "x"), ("content-length", "2"), ("x-custom", "1")]);
        let c = Cacheable { request_ms: 10_000, ..c };
        let s = build_entry(&c, &resp, 200, b"{}".to_vec(), 5);
        assert_eq!(s.entry.expires_at_ms, 15_000);
        let names: Vec<&str> = s.entry.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, vec!["content-type", "x-custom", "etag"]);
        assert_eq!(s.added_etag, Some(format!("\"{}\"", s.entry.response_hash)));
        assert!(not_modified(Some(&format!("\"{}\"", s.entry.response_hash)), &s.entry));
        assert_eq!(crate::answer::freshness(&s.entry, 12_500), (3, 2));
        let with_etag = hs(&[("etag", "\"v1\"")]);
        let s2 = build_entry(&c, &with_etag, 200, b"{}".to_vec(), 5);
        assert_eq!(s2.added_etag, None);
        assert!(not_modified(Some("W/\"v1\""), &s2.entry));
    }
}
