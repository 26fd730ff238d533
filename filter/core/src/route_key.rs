//! The client role's routing key: what identifies an answer (model, version, keyed body,
//! colour, vary headers), hashed, so Envoy's consistent hashing (`hash_policy` on
//! `names::ROUTE_KEY_HEADER`) sends identical requests to the replica that holds the answer.
//!
//! The key is computed by the same `decide` path as the server's cache key, so a request the
//! server would bypass gets no routing key and balances normally. It leaves out the caller's
//! identity (principal-scoped entries of every caller of one answer then sit on one replica)
//! and the policy generation (a purge must not reshuffle the replicas).

use crate::config::Config;
use crate::request::{self, BodyDecision, RequestHead};
use crate::hashing::{cache_key, hex, KeyDigest, KeyInput};
use crate::headermap::Headers;
use crate::model::ModelSource;
use crate::names::ROUTE_KEY_HEADER;

/// Hex characters of the key: 128 bits, far more than any ring needs, short on the wire.
pub const ROUTE_KEY_LEN: usize = 32;

/// Stands in for the peer identity so principal-scoped policies key here too; `route_digest`
/// never reads it (the client sidecar's own peer would be the server, not the caller).
const ANY_PRINCIPAL: &str = "-";

fn route_digest(k: &KeyInput) -> KeyDigest {
    cache_key(&KeyInput {
        method: k.method,
        path: k.path,
        model: k.model,
        version: k.version,
        model_headers: k.model_headers,
        generation: 0,
        color: k.color,
        vary: k.vary,
        principal: None,
        body: k.body,
    })
}

/// The routing key of a whole request, or None when the server would bypass it.
pub fn route_key(config: &Config, head: &RequestHead, source: &ModelSource, refresh: bool, body: &[u8]) -> Option<String> {
    let any = || Some(ANY_PRINCIPAL.to_string());
    match request::key_request_with(config, head, source, refresh, body, any, route_digest) {
        BodyDecision::Cacheable(c) => Some(hex(&c.key)[..ROUTE_KEY_LEN].to_string()),
        _ => None,
    }
}

/// Removes every line of the routing-key header from `headers` (a caller's copy must never
/// steer or reach anything); true when there was one, so the host copy needs removing too.
pub fn strip(headers: &mut Headers) -> bool {
    let before = headers.pairs.len();
    headers.pairs.retain(|(n, _)| !n.eq_ignore_ascii_case(ROUTE_KEY_HEADER));
    headers.pairs.len() != before
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_plugin_config;
    use crate::request::classify_head;
    use crate::request::HeadDecision;

    const POLICIES: &str = r#"{"role": "client", "policies": [{"model_prefix": "m", "ttl_s": 60, "ignore_fields": ["user"]},
        {"model_prefix": "p", "ttl_s": 60, "scope": "principal"}, {"model_prefix": "v", "ttl_s": 60, "vary_headers": ["x-tenant"]}]}"#;

    fn config() -> Config {
        parse_plugin_config(POLICIES.as_bytes()).unwrap()
    }

    fn pairs(extra: &[(&str, &str)]) -> Vec<(String, String)> {
        let mut h: Vec<(String, String)> =
            vec![(":method".into(), "POST".into()), ("content-type".into(), "application/json".into())];
        h.extend(extra.iter().map(|(n, v)| (n.to_string(), v.to_string())));
        h
    }

    /// The routing key of a KServe v2 REST request, through the same head decision as the filter.
    fn key_of(cfg: &Config, path: &str, extra: &[(&str, &str)], body: &str) -> Option<String> {
        let headers = pairs(extra);
        let head = RequestHead { method: "POST", path, headers: &headers, not_utf8: &[] };
        match classify_head(&head) {
            HeadDecision::Buffer { source, refresh } => route_key(cfg, &head, &source, refresh, body.as_bytes()),
            _ => None,
        }
    }

    const BODY: &str = r#"{"id": "a", "inputs": [1]}"#;

    #[test]
    fn identical_answers_share_a_key_and_different_ones_do_not() {
        let c = config();
        let k = key_of(&c, "/v2/models/m/infer", &[], BODY).unwrap();
        assert_eq!(k.len(), ROUTE_KEY_LEN);
        // The request id and ignored fields are not part of the answer's identity.
        assert_eq!(key_of(&c, "/v2/models/m/infer", &[], r#"{"id": "zz", "inputs": [1], "user": "u2"}"#).unwrap(), k);
        assert_ne!(key_of(&c, "/v2/models/m/infer", &[], r#"{"inputs": [2]}"#).unwrap(), k);
        assert_ne!(key_of(&c, "/v2/models/m/versions/2/infer", &[], BODY).unwrap(), k);
        assert_ne!(key_of(&c, "/v2/models/m/infer", &[("x-traffic-color", "blue")], BODY).unwrap(), k);
        assert_ne!(key_of(&c, "/v2/models/m2/infer", &[], BODY).unwrap(), k);
        let v1 = key_of(&c, "/v2/models/v/infer", &[("x-tenant", "a")], BODY).unwrap();
        assert_ne!(key_of(&c, "/v2/models/v/infer", &[("x-tenant", "b")], BODY).unwrap(), v1);
    }

    #[test]
    fn the_key_is_the_same_for_every_caller_and_generation() {
        let c = config();
        // Principal scope: keyed (the server keys it with the peer), the caller left out.
        let p = key_of(&c, "/v2/models/p/infer", &[("authorization", "Bearer a")], BODY).unwrap();
        assert_eq!(key_of(&c, "/v2/models/p/infer", &[("authorization", "Bearer b")], BODY).unwrap(), p);
        let purged = parse_plugin_config(POLICIES.replace("\"ttl_s\": 60,", "\"ttl_s\": 60, \"generation\": 9,").as_bytes()).unwrap();
        assert_eq!(key_of(&purged, "/v2/models/m/infer", &[], BODY), key_of(&c, "/v2/models/m/infer", &[], BODY));
    }

    #[test]
    fn requests_the_server_bypasses_get_no_key() {
        let c = config();
        // No policy for the model.
        assert_eq!(key_of(&c, "/v2/models/other/infer", &[], BODY), None);
        // Credentials on a shared policy.
        assert_eq!(key_of(&c, "/v2/models/m/infer", &[("authorization", "Bearer x")], BODY), None);
        assert_eq!(key_of(&c, "/v2/models/m/infer", &[("cookie", "a=b")], BODY), None);
        // Client no-store, an unparsable body, a repeated colour.
        assert_eq!(key_of(&c, "/v2/models/m/infer", &[("cache-control", "no-store")], BODY), None);
        assert_eq!(key_of(&c, "/v2/models/m/infer", &[], "{not json"), None);
        assert_eq!(key_of(&c, "/v2/models/m/infer", &[("x-traffic-color", "a"), ("x-traffic-color", "b")], BODY), None);
        // Disabled policies and an empty configuration.
        let off = parse_plugin_config(br#"{"role": "client", "policies": [{"model_prefix": "m", "ttl_s": 1, "enabled": false}]}"#).unwrap();
        assert_eq!(key_of(&off, "/v2/models/m/infer", &[], BODY), None);
        assert_eq!(key_of(&Config::empty(), "/v2/models/m/infer", &[], BODY), None);
        // Client no-cache still routes: the server stores the refreshed answer on that replica.
        assert!(key_of(&c, "/v2/models/m/infer", &[("cache-control", "no-cache")], BODY).is_some());
    }

    #[test]
    fn keys_spread_evenly_over_a_ring() {
        // Not Envoy's ring: a sanity check that the hex key is uniform enough to split on.
        let c = config();
        let mut buckets = [0u32; 4];
        for i in 0..400 {
            let k = key_of(&c, "/v2/models/m/infer", &[], &format!(r#"{{"inputs": [{}]}}"#, i)).unwrap();
            buckets[usize::from_str_radix(&k[..2], 16).unwrap() % 4] += 1;
        }
        assert!(buckets.iter().all(|&b| b > 60), "{:?}", buckets);
    }

    #[test]
    fn strip_removes_every_copy() {
        let mut h = Headers {
            pairs: pairs(&[("x-meshcache-route-key", "forged"), ("X-Meshcache-Route-Key", "again"), ("x-other", "1")]),
            not_utf8: vec![],
        };
        assert!(strip(&mut h));
        assert_eq!(h.pairs.len(), 3);
        assert!(!strip(&mut h));
    }
}
