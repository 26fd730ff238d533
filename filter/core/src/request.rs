//! Request decisions (the request half of what Envoy's cache filter calls its cache policy):
//! which requests the cache takes part in, from their headers (`classify_head`), and their key
//! once the body is read (`key_request`: the model, the policy, the key-shaped body, the
//! bypass reasons). The response half is `response`; the hosts gather inputs and apply both.

use crate::cache_control;
use crate::config::{ClientNoCache, Config, Policy, Scope};
use crate::hashing::{cache_key, KeyDigest, KeyInput};
use crate::headermap::{joined, values};
use crate::json;
use crate::model::{self, ModelRef, ModelSource};
use crate::names::{Bypass, COLOR_HEADER, KSERVE_BINARY_HEADER, MODEL_HEADER, MODEL_SELECTING_HEADERS};
use crate::shaping::{self, JsonRules, KeyedBytes, RequestId};

/// Request bodies larger than this are not buffered; the request passes through uncached.
/// Kept well under Envoy's default 1 MiB per-connection buffer (an Istio sidecar's), where a
/// paused larger body would be answered 413 by Envoy itself.
pub const MAX_REQUEST_BYTES: usize = 768 * 1024;

/// A request that declares a body over `MAX_REQUEST_BYTES` passes through from its headers on:
/// pausing it first would let Envoy buffer chunks that arrive before the filter sees the size.
pub fn request_declared_too_big(content_length: Option<&str>) -> bool {
    content_length.and_then(|n| n.trim().parse::<u64>().ok()).map_or(false, |n| n > MAX_REQUEST_BYTES as u64)
}


/// Request headers that make a shared answer someone's own: with any of them, a request
/// bypasses unless its policy scopes entries by principal.
pub const CREDENTIAL_HEADERS: [&str; 3] = ["authorization", "proxy-authorization", "cookie"];

/// Request headers as the filter sees them (lowercase names).
pub struct RequestHead<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub headers: &'a [(String, String)],
    /// Names whose value was not UTF-8 (`headermap::Headers::not_utf8`).
    pub not_utf8: &'a [String],
}

impl<'a> RequestHead<'a> {
    pub fn header(&self, name: &str) -> Option<&'a str> {
        crate::headermap::header(self.headers, name)
    }

    /// Every value of `name`, or None when a value is not UTF-8 (its text is not its bytes).
    fn exact_values(&self, name: &str) -> Option<Vec<&'a str>> {
        if self.not_utf8.iter().any(|n| n.eq_ignore_ascii_case(name)) {
            return None;
        }
        Some(values(self.headers, name))
    }
}


/// At most one value, as bytes-exact text: Ok(None) absent, Err repeated or not UTF-8.
fn single<'a>(head: &RequestHead<'a>, name: &str) -> Result<Option<&'a str>, Bypass> {
    match head.exact_values(name).ok_or(Bypass::HeaderBytes)?.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(*one)),
        _ => Err(Bypass::RepeatedHeader),
    }
}

#[derive(Debug, PartialEq)]
pub enum HeadDecision {
    /// Not an inference request: untouched, no Cache-Status.
    Ignore,
    /// An inference request the cache stays out of: `Cache-Status: meshcache; fwd=bypass; detail=..`.
    Bypass(Bypass),
    /// Read the whole body, then decide. `refresh`: the client asks to revalidate (`no-cache`,
    /// `max-age=0`); under a `client_no_cache: revalidate` policy it skips the lookup and stores.
    Buffer { source: ModelSource, refresh: bool },
}

pub fn classify_head(head: &RequestHead) -> HeadDecision {
    if head.method != "POST" {
        return if model::is_inference_path(head.path) { HeadDecision::Bypass(Bypass::Method) } else { HeadDecision::Ignore };
    }
    if model::is_grpc_web(head.header("content-type")) && model::is_model_infer(head.path) {
        // grpc-web hits would need their own framing and trailers-in-body: not cached (yet).
        return HeadDecision::Bypass(Bypass::GrpcWeb);
    }
    let source = match model::source_from_headers(head.path, head.header("content-type"), head.header(MODEL_HEADER)) {
        Ok(Some(s)) => s,
        Ok(None) => return HeadDecision::Ignore,
        Err(why) => return HeadDecision::Bypass(why),
    };
    // Headers that are part of the key must be unambiguous: Envoy's route matcher sees a
    // repeated header as its lines joined, a server's header dict its last line, the key would
    // see something else.
    for name in std::iter::once(COLOR_HEADER).chain(MODEL_SELECTING_HEADERS) {
        if let Err(why) = single(head, name) {
            return HeadDecision::Bypass(why);
        }
    }
    // A compressed body is not read (the key would be over bytes the server reads otherwise).
    let encoded = |name: &str| values(head.headers, name).iter().any(|v| !v.trim().eq_ignore_ascii_case("identity"));
    if source != ModelSource::GrpcBody && encoded("content-encoding") {
        return HeadDecision::Bypass(Bypass::Compressed);
    }
    let cc = joined(head.headers, "cache-control");
    if cc.as_deref().map_or(false, |v| cache_control::parse(v).no_store) {
        return HeadDecision::Bypass(Bypass::NoStore);
    }
    // Whether the policy honours it is known once the body names the model (`key_request`).
    HeadDecision::Buffer { source, refresh: cc.as_deref().map_or(false, cache_control::request_wants_revalidation) }
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
    /// The KServe request id: taken out of the stored answer, put back into hits.
    pub request_id: RequestId,
}

#[derive(Debug, PartialEq)]
pub enum BodyDecision {
    /// The cache stays out, saying why (`Cache-Status: ...; fwd=bypass; detail=<why>`).
    Bypass(Bypass),
    Cacheable(Cacheable),
}

/// A body read once for what the key needs: the model it names, and the JSON members.
enum ReadBody<'a> {
    /// Opaque bytes (x-model-id requests without key-shaping JSON rules).
    Opaque,
    /// A JSON object (with the binary extension: only the JSON part) and its top-level members.
    Json { json_len: usize, binary: bool, members: Vec<json::Member> },
    Grpc(shaping::GrpcRequest<'a>),
}

/// The model is None when a well-formed body names none (the header may then name it).
fn read_body<'a>(source: &ModelSource, head: &RequestHead, body: &'a [u8]) -> Result<(Option<ModelRef>, ReadBody<'a>), Bypass> {
    match source {
        ModelSource::GrpcBody => {
            // Flag 1: a compressed message (`grpc-encoding`), not read.
            if body.first() == Some(&1) {
                return Err(Bypass::Compressed);
            }
            let message = crate::grpc::unframe(body).ok_or(Bypass::Unparsable)?;
            let req = shaping::grpc_request(message)?;
            let m = Some(ModelRef { name: req.model_name.clone(), version: req.model_version.clone() })
                .filter(|m| !m.name.is_empty());
            Ok((m, ReadBody::Grpc(req)))
        }
        ModelSource::JsonBody => {
            let members = json::object_members(body).ok_or(Bypass::Unparsable)?;
            let m = model::model_from_members(body, &members)?;
            Ok((m, ReadBody::Json { json_len: body.len(), binary: false, members }))
        }
        ModelSource::Header(m) => Ok((Some(m.clone()), ReadBody::Opaque)),
        ModelSource::Path(m) => {
            // KServe v2 REST: the request id is in the JSON (part) of the body.
            let lines = head.exact_values(KSERVE_BINARY_HEADER).ok_or(Bypass::BinaryLength)?;
            let (json_len, binary) = shaping::split_binary(body, &lines)?;
            let members = json::object_members(&body[..json_len]).ok_or(Bypass::Unparsable)?;
            Ok((Some(m.clone()), ReadBody::Json { json_len, binary, members }))
        }
    }
}

/// The keyed form of the body under the matched policy.
fn shape_body<'a>(read: ReadBody<'a>, head: &RequestHead, body: &'a [u8], policy: &Policy) -> Result<KeyedBytes<'a>, Bypass> {
    let path = model::strip_query(head.path);
    match read {
        ReadBody::Grpc(req) => Ok(req.key),
        ReadBody::Opaque if policy.ignore_fields.is_empty() => Ok(KeyedBytes::whole(body)),
        ReadBody::Opaque => {
            // Fields to ignore only exist in a JSON body.
            let members = json::object_members(body).ok_or(Bypass::Unparsable)?;
            let rules = JsonRules { request_id: false, ignore_fields: &policy.ignore_fields, deterministic_only: false };
            shaping::shape_json(body, body.len(), false, &members, &rules)
        }
        ReadBody::Json { json_len, binary, members } => {
            let rules = JsonRules {
                request_id: model::kserve_rest_model(path).is_some(),
                ignore_fields: &policy.ignore_fields,
                // Sampling parameters belong to the OpenAI text-generation APIs.
                deterministic_only: policy.deterministic_only && model::is_sampling_path(path),
            };
            shaping::shape_json(body, json_len, binary, &members, &rules)
        }
    }
}

pub fn key_request(
    config: &Config,
    head: &RequestHead,
    source: &ModelSource,
    refresh: bool,
    body: &[u8],
    // The peer identity costs a host call: asked for only when the matched policy scopes by it.
    principal: impl FnOnce() -> Option<String>,
) -> BodyDecision {
    key_request_with(config, head, source, refresh, body, principal, cache_key)
}

/// `key_request` with the key digest chosen by the caller: the cache key, or the client role's
/// routing key (`route_key`), so both sides take exactly the same bypass decisions.
pub fn key_request_with(
    config: &Config,
    head: &RequestHead,
    source: &ModelSource,
    refresh: bool,
    body: &[u8],
    principal: impl FnOnce() -> Option<String>,
    digest: fn(&KeyInput) -> KeyDigest,
) -> BodyDecision {
    let grpc = *source == ModelSource::GrpcBody;
    let named = match single(head, MODEL_HEADER) {
        Ok(h) => h.filter(|m| !m.is_empty()),
        Err(why) => return BodyDecision::Bypass(why),
    };
    let (model, read) = match read_body(source, head, body) {
        Ok((m, read)) => {
            // A JSON body without a model falls back to the header (the least specific source).
            let m = match (m, source) {
                (None, ModelSource::JsonBody) => named.map(|n| ModelRef { name: n.to_string(), version: String::new() }),
                (m, _) => m,
            };
            match m {
                Some(m) => (m, read),
                None => return BodyDecision::Bypass(Bypass::NoModel),
            }
        }
        Err(why) => return BodyDecision::Bypass(why),
    };
    // The most specific source named the model; a header naming another one is a conflict
    // (it could put one model's request under another model's policy): stay out.
    if named.map_or(false, |n| n != model.name) {
        return BodyDecision::Bypass(Bypass::ModelConflict);
    }
    let policy = match config.policy_matching(&model.name) {
        Some(p) if p.enabled => p,
        Some(_) => return BodyDecision::Bypass(Bypass::Disabled),
        None => return BodyDecision::Bypass(Bypass::NoPolicy),
    };
    let principal = match policy.scope {
        // Without a peer identity there is nothing to scope by: stay out.
        Scope::Principal => match principal().filter(|p| !p.is_empty()) {
            Some(p) => Some(p),
            None => return BodyDecision::Bypass(Bypass::NoIdentity),
        },
        Scope::Shared => {
            if CREDENTIAL_HEADERS.iter().any(|c| head.header(c).is_some()) {
                return BodyDecision::Bypass(Bypass::Credentials);
            }
            None
        }
    };
    let color = match single(head, COLOR_HEADER) {
        Ok(c) => c.unwrap_or(&config.color),
        Err(why) => return BodyDecision::Bypass(why),
    };
    // Every header a server reads to choose the model or its version is keyed on every path
    // (absent and empty apart): `x-model-version` picks the version `/v1/infer` runs.
    // A fixed array: this runs on every request, no allocation needed for two headers.
    let mut model_headers: [Option<&str>; MODEL_SELECTING_HEADERS.len()] = [None; MODEL_SELECTING_HEADERS.len()];
    for (slot, name) in model_headers.iter_mut().zip(MODEL_SELECTING_HEADERS) {
        match single(head, name) {
            Ok(v) => *slot = v,
            Err(why) => return BodyDecision::Bypass(why),
        }
    }
    // Vary headers are keyed on every line, byte-exact; a value that is not UTF-8 bypasses.
    let mut vary: Vec<(String, Vec<String>)> = Vec::with_capacity(policy.vary_headers.len());
    for n in &policy.vary_headers {
        match head.exact_values(n) {
            Some(v) => vary.push((n.clone(), v.into_iter().map(str::to_string).collect())),
            None => return BodyDecision::Bypass(Bypass::HeaderBytes),
        }
    }
    let keyed = match shape_body(read, head, body, policy) {
        Ok(k) => k,
        Err(why) => return BodyDecision::Bypass(why),
    };
    let key = digest(&KeyInput {
        method: head.method,
        path: head.path,
        model: &model.name,
        version: &model.version,
        model_headers: &model_headers,
        generation: policy.generation,
        color,
        vary: &vary,
        principal: principal.as_deref(),
        body: &keyed,
    });
    let request_id = keyed.id;
    let refresh = refresh && policy.client_no_cache == ClientNoCache::Revalidate;
    BodyDecision::Cacheable(Cacheable { key, policy: policy.clone(), grpc, refresh, seen: None, request_ms: 0, request_id })
}


#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache_control::NotStored;
    use crate::headermap::header;
    use crate::response::{build_entry, check_storable, should_hold};
    use crate::hit::not_modified;
    use crate::config::parse_plugin_config;

    fn config(json: &str) -> Config {
        parse_plugin_config(json.as_bytes()).unwrap()
    }

    const TTL5: cache_control::Ttl = cache_control::Ttl { s: 5, from_policy: true };

    fn hs(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect()
    }

    fn decide(cfg: &Config, path: &str, headers: &[(&str, &str)], body: &[u8], principal: Option<&str>) -> BodyDecision {
        let h = hs(headers);
        let head = RequestHead { method: "POST", path, headers: &h, not_utf8: &[] };
        match classify_head(&head) {
            HeadDecision::Buffer { source, refresh } => {
                key_request(cfg, &head, &source, refresh, body, || principal.map(str::to_string))
            }
            other => panic!("{:?}", other),
        }
    }

    fn key(d: BodyDecision) -> KeyDigest {
        match d {
            BodyDecision::Cacheable(c) => c.key,
            other => panic!("{:?}", other),
        }
    }

    #[test]
    fn head_decisions() {
        let h = hs(&[("content-type", "application/json")]);
        assert_eq!(classify_head(&RequestHead { method: "GET", path: "/v2/models/m/infer", headers: &h, not_utf8: &[] }), HeadDecision::Bypass(Bypass::Method));
        assert_eq!(classify_head(&RequestHead { method: "GET", path: "/v2/models/m", headers: &h, not_utf8: &[] }), HeadDecision::Ignore);
        assert_eq!(classify_head(&RequestHead { method: "POST", path: "/other", headers: &h, not_utf8: &[] }), HeadDecision::Ignore);
        let ns = hs(&[("cache-control", "no-store")]);
        assert_eq!(classify_head(&RequestHead { method: "POST", path: "/v2/models/m/infer", headers: &ns, not_utf8: &[] }), HeadDecision::Bypass(Bypass::NoStore));
        let nc = hs(&[("cache-control", "no-cache")]);
        assert!(matches!(
            classify_head(&RequestHead { method: "POST", path: "/v2/models/m/infer", headers: &nc, not_utf8: &[] }),
            HeadDecision::Buffer { refresh: true, .. }
        ));
        let web = hs(&[("content-type", "application/grpc-web+proto")]);
        let infer = crate::model::GRPC_MODEL_INFER_PATH;
        assert_eq!(classify_head(&RequestHead { method: "POST", path: infer, headers: &web, not_utf8: &[] }), HeadDecision::Bypass(Bypass::GrpcWeb));
        let grpc = hs(&[("content-type", "application/grpc")]);
        assert_eq!(
            classify_head(&RequestHead { method: "POST", path: infer, headers: &grpc, not_utf8: &[] }),
            HeadDecision::Buffer { source: ModelSource::GrpcBody, refresh: false }
        );
    }

    #[test]
    fn bypass_rules() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5}, {"model_prefix": "p", "ttl_s": 5, "scope": "principal"}]}"#);
        assert_eq!(decide(&cfg, "/v2/models/other/infer", &[], b"{}", None), BodyDecision::Bypass(Bypass::NoPolicy));
        assert_eq!(decide(&cfg, "/v2/models/m/infer", &[("authorization", "Bearer x")], b"{}", None), BodyDecision::Bypass(Bypass::Credentials));
        assert_eq!(decide(&cfg, "/v2/models/p/infer", &[], b"{}", None), BodyDecision::Bypass(Bypass::NoIdentity));
        assert!(matches!(decide(&cfg, "/v2/models/p/infer", &[("authorization", "Bearer x")], b"{}", Some("spiffe://a")), BodyDecision::Cacheable(_)));
        assert_eq!(decide(&cfg, "/v1/chat/completions", &[], br#"{"messages": []}"#, None), BodyDecision::Bypass(Bypass::NoModel));
        assert_eq!(decide(&cfg, "/v1/chat/completions", &[], br#"{"model": "m1""#, None), BodyDecision::Bypass(Bypass::Unparsable));
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
        let shared = RequestHead { method: "POST", path: "/v2/models/m/infer", headers: &h, not_utf8: &[] };
        assert!(matches!(key_request(&cfg, &shared, &ModelSource::Path(crate::model::kserve_rest_model(shared.path).unwrap()), false, b"{}", ask), BodyDecision::Cacheable(_)));
        assert_eq!(asked.get(), 0);
        let scoped = RequestHead { method: "POST", path: "/v2/models/p/infer", headers: &h, not_utf8: &[] };
        assert!(matches!(key_request(&cfg, &scoped, &ModelSource::Path(crate::model::kserve_rest_model(scoped.path).unwrap()), false, b"{}", ask), BodyDecision::Cacheable(_)));
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
    fn which_answers_are_held() {
        assert!(should_hold(false, Some("application/json"), Some("1000")));
        assert!(!should_hold(false, Some("application/json"), Some("300000")));
        assert!(!should_hold(false, Some("application/json"), None), "no length: may be paced");
        assert!(!should_hold(false, Some("Text/Event-Stream; charset=utf-8"), Some("10")));
        assert!(should_hold(true, Some("application/grpc"), None));
        assert!(!should_hold(false, None, Some("x")));
    }

    #[test]
    fn repeated_keyed_headers_bypass_or_are_keyed_on_every_line() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5, "vary_headers": ["x-tenant"]}]}"#);
        let infer = "/v2/models/m/infer";
        for twice in [[("x-traffic-color", ""), ("x-traffic-color", "blue")], [("x-traffic-color", "green"), ("x-traffic-color", "blue")],
                      [("x-model-id", "m"), ("x-model-id", "m")]] {
            let h = hs(&twice);
            assert_eq!(classify_head(&RequestHead { method: "POST", path: infer, headers: &h, not_utf8: &[] }), HeadDecision::Bypass(Bypass::RepeatedHeader), "{:?}", twice);
        }
        let one = key(decide(&cfg, infer, &[("x-tenant", "a")], b"{}", None));
        let two = key(decide(&cfg, infer, &[("x-tenant", "a"), ("x-tenant", "b")], b"{}", None));
        let other = key(decide(&cfg, infer, &[("x-tenant", "b"), ("x-tenant", "a")], b"{}", None));
        assert!(one != two && two != other && one != other);
    }

    #[test]
    fn values_that_are_not_utf8_never_share_a_key() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5, "vary_headers": ["x-tenant"]}]}"#);
        let h = hs(&[("x-tenant", "a\u{fffd}")]);
        let flagged = vec!["x-tenant".to_string()];
        let head = RequestHead { method: "POST", path: "/v2/models/m/infer", headers: &h, not_utf8: &flagged };
        let source = ModelSource::Path(crate::model::kserve_rest_model(head.path).unwrap());
        assert_eq!(key_request(&cfg, &head, &source, false, b"{}", || None), BodyDecision::Bypass(Bypass::HeaderBytes));
        // An unrelated header that is not UTF-8 does not matter to the key.
        let other = vec!["user-agent".to_string()];
        let head = RequestHead { not_utf8: &other, ..head };
        assert!(matches!(key_request(&cfg, &head, &source, false, b"{}", || None), BodyDecision::Cacheable(_)));
    }

    #[test]
    fn credentials_bypass_shared_policies() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5}, {"model_prefix": "p", "ttl_s": 5, "scope": "principal"}]}"#);
        for cred in ["authorization", "proxy-authorization", "cookie", "Cookie"] {
            assert_eq!(decide(&cfg, "/v2/models/m/infer", &[(cred, "x")], b"{}", None), BodyDecision::Bypass(Bypass::Credentials), "{}", cred);
            assert!(matches!(decide(&cfg, "/v2/models/p/infer", &[(cred, "x")], b"{}", Some("spiffe://a")), BodyDecision::Cacheable(_)));
        }
    }

    #[test]
    fn model_sources_path_then_body_then_header_and_conflicts_bypass() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5}, {"model_prefix": "other", "ttl_s": 5}]}"#);
        // Path vs header.
        assert_eq!(decide(&cfg, "/v2/models/m/infer", &[("x-model-id", "other")], b"{}", None), BodyDecision::Bypass(Bypass::ModelConflict));
        // A model-selecting header is keyed wherever it is sent (its presence too).
        assert_ne!(key(decide(&cfg, "/v2/models/m/infer", &[("x-model-id", "m")], b"{}", None)),
                   key(decide(&cfg, "/v2/models/m/infer", &[], b"{}", None)));
        // Body vs header: the body names the model; a different header is a conflict.
        let chat = br#"{"model": "m1", "messages": []}"#;
        assert_eq!(decide(&cfg, "/v1/chat/completions", &[("x-model-id", "unpolicied")], chat, None), BodyDecision::Bypass(Bypass::ModelConflict));
        assert!(matches!(decide(&cfg, "/v1/chat/completions", &[("x-model-id", "m1")], chat, None), BodyDecision::Cacheable(_)));
        // A body without a model falls back to the header.
        assert!(matches!(decide(&cfg, "/v1/chat/completions", &[("x-model-id", "m1")], br#"{"messages": []}"#, None), BodyDecision::Cacheable(_)));
    }

    #[test]
    fn every_header_that_picks_the_model_or_its_version_is_keyed() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5}]}"#);
        let body = br#"{"input": [1], "shape": [1]}"#;
        // The engine's /v1/infer: x-model-id picks the model, x-model-version its version.
        let v1 = |h: &[(&str, &str)]| key(decide(&cfg, "/v1/infer", h, body, None));
        let (plain, one, two, empty) = (v1(&[("x-model-id", "m")]), v1(&[("x-model-id", "m"), ("x-model-version", "1")]),
                                        v1(&[("x-model-id", "m"), ("x-model-version", "2")]),
                                        v1(&[("x-model-id", "m"), ("X-Model-Version", "")]));
        for (i, a) in [plain, one, two, empty].iter().enumerate() {
            for b in [plain, one, two, empty].iter().skip(i + 1) {
                assert_ne!(a, b);
            }
        }
        assert_eq!(one, v1(&[("x-model-version", "1"), ("x-model-id", "m")]), "header order does not matter");
        // On every path: KServe REST, OpenAI-style, gRPC (metadata).
        for (path, ct, b) in [("/v2/models/m/infer", "application/json", &b"{}"[..]),
                              ("/v1/chat/completions", "application/json", br#"{"model": "m", "temperature": 0}"#)] {
            let k = |h: &[(&str, &str)]| {
                let mut h = h.to_vec();
                h.push(("content-type", ct));
                key(decide(&cfg, path, &h, b, None))
            };
            assert_ne!(k(&[]), k(&[("x-model-version", "2")]), "{}", path);
        }
        let grpc = crate::grpc::frame(b"\x0a\x01m");
        let g = |h: &[(&str, &str)]| {
            let mut h = h.to_vec();
            h.push(("content-type", "application/grpc"));
            key(decide(&cfg, crate::model::GRPC_MODEL_INFER_PATH, &h, &grpc, None))
        };
        assert_ne!(g(&[]), g(&[("x-model-version", "2")]));
        // Repeated or not UTF-8: what the server reads is not certain; bypass.
        let twice = hs(&[("x-model-id", "m"), ("x-model-version", "1"), ("x-model-version", "2")]);
        let head = RequestHead { method: "POST", path: "/v1/infer", headers: &twice, not_utf8: &[] };
        assert_eq!(classify_head(&head), HeadDecision::Bypass(Bypass::RepeatedHeader));
        let once = hs(&[("x-model-id", "m"), ("x-model-version", "2")]);
        let bad = vec!["x-model-version".to_string()];
        let head = RequestHead { method: "POST", path: "/v1/infer", headers: &once, not_utf8: &bad };
        let source = model::source_from_headers("/v1/infer", None, Some("m")).unwrap().unwrap();
        assert_eq!(key_request(&cfg, &head, &source, false, body, || None), BodyDecision::Bypass(Bypass::HeaderBytes));
    }

    #[test]
    fn client_no_cache_revalidates_only_under_a_revalidate_policy() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5},
            {"model_prefix": "i", "ttl_s": 5, "client_no_cache": "ignore"}]}"#);
        let refresh = |path: &str, cc: &str| match decide(&cfg, path, &[("cache-control", cc)], b"{}", None) {
            BodyDecision::Cacheable(c) => c.refresh,
            other => panic!("{:?}", other),
        };
        for cc in ["no-cache", "max-age=0"] {
            assert!(refresh("/v2/models/m/infer", cc), "{}", cc);
            assert!(!refresh("/v2/models/i/infer", cc), "{}: ignored by the policy", cc);
        }
        assert!(!refresh("/v2/models/m/infer", "max-age=60"));
        // The key is the same either way: a revalidation refreshes the entry others hit.
        assert_eq!(key(decide(&cfg, "/v2/models/m/infer", &[("cache-control", "no-cache")], b"{}", None)),
                   key(decide(&cfg, "/v2/models/m/infer", &[], b"{}", None)));
    }

    #[test]
    fn an_ambiguous_body_model_never_falls_back_to_the_header() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5}, {"model_prefix": "off", "ttl_s": 5, "enabled": false}]}"#);
        let chat = "/v1/chat/completions";
        for body in [&br#"{"model": "p", "model": "m", "messages": []}"#[..], br#"{"model": "m", "model": "m"}"#,
                     br#"{"model": 3}"#, br#"{"model": null}"#, br#"{"model": ""}"#, br#"{"model": ["m"]}"#,
                     br#"{"model": "\udc00"}"#, br#"{"m\u006fdel": "m", "model": "m"}"#] {
            assert_eq!(decide(&cfg, chat, &[("x-model-id", "m")], body, None), BodyDecision::Bypass(Bypass::AmbiguousModel),
                       "{}", String::from_utf8_lossy(body));
        }
        // Absent: the header names it; with neither, nothing does.
        assert!(matches!(decide(&cfg, chat, &[("x-model-id", "m")], br#"{"messages": []}"#, None), BodyDecision::Cacheable(_)));
        assert_eq!(decide(&cfg, chat, &[], br#"{"messages": []}"#, None), BodyDecision::Bypass(Bypass::NoModel));
        // A disabled policy keeps its models out; it does not hand them to a shorter prefix.
        assert_eq!(decide(&cfg, chat, &[], br#"{"model": "off-1"}"#, None), BodyDecision::Bypass(Bypass::Disabled));
    }

    #[test]
    fn compressed_bodies_and_odd_binary_lengths_bypass() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5}]}"#);
        let head = |h: &[(&str, &str)]| {
            let h = hs(h);
            classify_head(&RequestHead { method: "POST", path: "/v2/models/m/infer", headers: &h, not_utf8: &[] })
        };
        assert_eq!(head(&[("content-encoding", "gzip")]), HeadDecision::Bypass(Bypass::Compressed));
        assert!(matches!(head(&[("content-encoding", "identity")]), HeadDecision::Buffer { .. }));
        let body = br#"{"inputs":[]}xyz"#;
        let n = (body.len() - 3).to_string();
        let bin = "inference-header-content-length";
        assert!(matches!(decide(&cfg, "/v2/models/m/infer", &[(bin, &n)], body, None), BodyDecision::Cacheable(_)));
        let signed = format!("+{}", n);
        for lines in [vec![(bin, signed.as_str())], vec![(bin, n.as_str()), (bin, n.as_str())], vec![(bin, "1e1")]] {
            assert_eq!(decide(&cfg, "/v2/models/m/infer", &lines, body, None), BodyDecision::Bypass(Bypass::BinaryLength), "{:?}", lines);
        }
    }

    #[test]
    fn set_cookie2_answers_are_not_stored() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5}]}"#);
        let h = hs(&[("Set-Cookie2", "a=b; Version=1")]);
        assert_eq!(check_storable(&cfg.policies[0], &h, &[], 0), Err(NotStored::SetCookie));
        let t = check_storable(&cfg.policies[0], &hs(&[]), &[], 0).unwrap();
        assert!(t.from_policy && t.s == 5);
        let t = check_storable(&cfg.policies[0], &hs(&[("cache-control", "max-age=3")]), &[], 0).unwrap();
        assert!(!t.from_policy && t.s == 3);
    }

    #[test]
    fn what_the_origin_says_decides_storing() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5, "vary_headers": ["x-tenant"]}]}"#);
        let p = &cfg.policies[0];
        let ok = |h: &[(&str, &str)]| check_storable(p, &hs(h), &[], 0).map(|t| t.s);
        assert_eq!(ok(&[]), Ok(5));
        assert_eq!(ok(&[("set-cookie", "a=b")]), Err(NotStored::SetCookie));
        assert_eq!(ok(&[("vary", "*")]), Err(NotStored::Vary));
        assert_eq!(ok(&[("vary", "x-user")]), Err(NotStored::Vary));
        assert_eq!(ok(&[("vary", "Accept-Encoding")]), Err(NotStored::Vary));
        assert_eq!(ok(&[("vary", "X-Tenant, x-traffic-color"), ("vary", "x-model-id")]), Ok(5));
        assert_eq!(ok(&[("vary", "x-tenant"), ("vary", "x-user")]), Err(NotStored::Vary), "every Vary line counts");
        assert_eq!(ok(&[("cache-control", "max-age=60"), ("cache-control", "private")]), Err(NotStored::Private));
        assert_eq!(ok(&[("expires", "0")]), Err(NotStored::Stale));
        assert_eq!(ok(&[("cache-control", "max-age=abc")]), Err(NotStored::Stale));
        assert_eq!(check_storable(p, &hs(&[("x-odd", "?")]), &["x-odd".to_string()], 0), Err(NotStored::HeaderBytes));
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
        let s = build_entry(&c, &resp, 200, b"{}".to_vec(), TTL5, None).unwrap();
        assert_eq!(s.entry.expires_at_ms, 15_000);
        let names: Vec<&str> = s.entry.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, vec!["content-type", "x-custom", "etag"]);
        assert_eq!(s.added_etag, Some(format!("\"{}\"", s.entry.response_hash)));
        assert!(not_modified(Some(&format!("\"{}\"", s.entry.response_hash)), &s.entry));
        assert_eq!(crate::hit::freshness(&s.entry, 12_500), (3, 2));
        let with_etag = hs(&[("etag", "\"v1\"")]);
        let s2 = build_entry(&c, &with_etag, 200, b"{}".to_vec(), TTL5, None).unwrap();
        assert_eq!(s2.added_etag, None);
        assert!(not_modified(Some("W/\"v1\""), &s2.entry));
    }

    fn cacheable(d: BodyDecision) -> Cacheable {
        match d {
            BodyDecision::Cacheable(c) => c,
            other => panic!("{:?}", other),
        }
    }

    #[test]
    fn request_ids_leave_the_key_and_come_back_on_hits() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5}]}"#);
        let body = |id: &str| format!(r#"{{"id":"{}","inputs":[{{"name":"x","data":[1]}}]}}"#, id);
        let a = cacheable(decide(&cfg, "/v2/models/m/infer", &[], body("a-1").as_bytes(), None));
        let b = cacheable(decide(&cfg, "/v2/models/m/infer", &[], body("b-2").as_bytes(), None));
        assert_eq!(a.key, b.key);
        let none = cacheable(decide(&cfg, "/v2/models/m/infer", &[], br#"{"inputs":[{"name":"x","data":[1]}]}"#, None));
        assert_ne!(none.key, a.key, "an answer without an id never serves a request with one");
        let answer = |id: &str| format!(r#"{{"model_name":"m","model_version":"1","id":"{}","outputs":[]}}"#, id).into_bytes();
        let json = hs(&[("content-type", "application/json")]);
        let stored = build_entry(&Cacheable { request_ms: 1000, ..a.clone() }, &json, 200, answer("a-1"), TTL5, None).unwrap();
        assert_eq!(stored.entry.body, br#"{"model_name":"m","model_version":"1","outputs":[]}"#.to_vec());
        let from_b = build_entry(&Cacheable { request_ms: 1000, ..b.clone() }, &json, 200, answer("b-2"), TTL5, None).unwrap();
        assert_eq!(stored.entry.response_hash, from_b.entry.response_hash, "the hash is id-independent");
        assert_eq!(stored.added_etag, from_b.added_etag);
        let none_h: Vec<(String, String)> = vec![];
        let hit = crate::hit::http_hit(&stored.entry, &crate::hit::HitRequest { headers: &none_h, body: b"", id: &b.request_id }, 1000);
        assert_eq!(hit.body, answer("b-2"));
        // An answer that echoes some other id is not stored.
        let wrong = build_entry(&a, &json, 200, answer("zzz"), TTL5, None);
        assert_eq!(wrong.err(), Some(NotStored::Unparsable));
        // Malformed bodies on KServe paths bypass as unparsable.
        for bad in [&b"not json"[..], br#"{"id":"a","id":"b"}"#, br#"{"id":"a""#, br#"{"id":5}"#] {
            assert_eq!(decide(&cfg, "/v2/models/m/infer", &[], bad, None), BodyDecision::Bypass(Bypass::Unparsable));
        }
        // x-model-id requests without key-shaping rules stay opaque (any body).
        assert!(matches!(decide(&cfg, "/v1/infer", &[("x-model-id", "m")], b"\xff raw", None), BodyDecision::Cacheable(_)));
    }

    #[test]
    fn binary_extension_answers_keep_their_header_right() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5}]}"#);
        let req_json = br#"{"id":"r1","inputs":[{"name":"x","parameters":{"binary_data_size":1}}]}"#;
        let req = [&req_json[..], b"\x07"].concat();
        let n = req_json.len().to_string();
        let c = cacheable(decide(&cfg, "/v2/models/m/infer", &[("inference-header-content-length", &n)], &req, None));
        let ans_json = br#"{"id":"r1","outputs":[{"name":"y","parameters":{"binary_data_size":1}}]}"#;
        let ans = [&ans_json[..], b"\x09"].concat();
        let h = hs(&[("content-type", "application/octet-stream"), ("inference-header-content-length", &ans_json.len().to_string())]);
        let s = build_entry(&c, &h, 200, ans.clone(), TTL5, None).unwrap();
        let stored_len = header(&s.entry.headers, "inference-header-content-length").unwrap();
        assert_eq!(stored_len, (ans_json.len() - r#""id":"r1","#.len()).to_string());
        let none_h: Vec<(String, String)> = vec![];
        let hit = |id: &[u8]| {
            let id = RequestId::Spliced(id.to_vec());
            let a = crate::hit::http_hit(&s.entry, &crate::hit::HitRequest { headers: &none_h, body: b"", id: &id }, 1000);
            (a.body, a.headers)
        };
        let (body, headers) = hit(b"r1");
        assert_eq!(body, ans);
        assert_eq!(header(&headers, "inference-header-content-length").unwrap(), ans_json.len().to_string());
        let (body2, headers2) = hit(b"longer-id");
        let n2: usize = header(&headers2, "inference-header-content-length").unwrap().parse().unwrap();
        assert_eq!(&body2[..n2], &br#"{"id":"longer-id","outputs":[{"name":"y","parameters":{"binary_data_size":1}}]}"#[..]);
    }

    #[test]
    fn grpc_ids_leave_the_key() {
        let cfg = config(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5}]}"#);
        let framed = |id: &[u8]| {
            let mut msg = vec![0x0a, 1, b'm'];
            if !id.is_empty() {
                msg.extend_from_slice(&[0x1a, id.len() as u8]);
                msg.extend_from_slice(id);
            }
            msg.extend_from_slice(&[0x2a, 3, 0x0a, 1, b'x']);
            crate::grpc::frame(&msg)
        };
        let grpc = [("content-type", "application/grpc")];
        let path = crate::model::GRPC_MODEL_INFER_PATH;
        let a = cacheable(decide(&cfg, path, &grpc, &framed(b"one"), None));
        let b = cacheable(decide(&cfg, path, &grpc, &framed(b"two"), None));
        let none = cacheable(decide(&cfg, path, &grpc, &framed(b""), None));
        assert_eq!(a.key, b.key);
        assert_ne!(a.key, none.key);
        assert_eq!(b.request_id, RequestId::Spliced(b"two".to_vec()));
        assert_eq!(decide(&cfg, path, &grpc, b"\x00\x00\x00\x00\x02\x18\x01", None), BodyDecision::Bypass(Bypass::Unparsable));
        assert_eq!(decide(&cfg, path, &grpc, b"\x01\x00\x00\x00\x00", None), BodyDecision::Bypass(Bypass::Compressed));
    }

    #[test]
    fn openai_policy_rules() {
        let cfg = config(r#"{"policies": [{"model_prefix": "gpt", "ttl_s": 5, "ignore_fields": ["user", "metadata"],
            "deterministic_only": true}, {"model_prefix": "emb", "ttl_s": 5, "deterministic_only": true}]}"#);
        let chat = "/v1/chat/completions";
        let k1 = key(decide(&cfg, chat, &[], br#"{"model":"gpt-4","messages":[],"temperature":0,"user":"alice"}"#, None));
        let k2 = key(decide(&cfg, chat, &[], br#"{"model":"gpt-4","messages":[],"temperature":0,"user":"bob","metadata":{"x":1}}"#, None));
        assert_eq!(k1, k2);
        assert_ne!(k1, key(decide(&cfg, chat, &[], br#"{"model":"gpt-4","messages":[1],"temperature":0}"#, None)));
        assert_eq!(decide(&cfg, chat, &[], br#"{"model":"gpt-4","messages":[],"temperature":0.8}"#, None), BodyDecision::Bypass(Bypass::Nondeterministic));
        assert!(matches!(decide(&cfg, chat, &[], br#"{"model":"gpt-4","messages":[],"temperature":0.8,"seed":7}"#, None), BodyDecision::Cacheable(_)));
        // Embeddings are not samples; the rule does not apply there.
        assert!(matches!(decide(&cfg, "/v1/embeddings", &[], br#"{"model":"emb-1","input":"x"}"#, None), BodyDecision::Cacheable(_)));
        // OpenAI bodies carry no KServe request id: "id" is ordinary data there.
        assert_ne!(
            key(decide(&cfg, chat, &[], br#"{"model":"gpt-4","id":"a","temperature":0}"#, None)),
            key(decide(&cfg, chat, &[], br#"{"model":"gpt-4","id":"b","temperature":0}"#, None))
        );
    }

    #[test]
    fn declared_request_size_over_the_limit_passes_through() {
        assert!(request_declared_too_big(Some("2097152")));
        assert!(!request_declared_too_big(Some(&MAX_REQUEST_BYTES.to_string())));
        assert!(!request_declared_too_big(Some("12")));
        assert!(!request_declared_too_big(Some("not a number")));
        assert!(!request_declared_too_big(None));
    }
}
