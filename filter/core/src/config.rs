//! Plugin configuration: the JSON the control plane pushes, parsed and validated.
//!
//! Validation names the offending field so the one log line Envoy shows is actionable.
//! Unknown fields are ignored so newer control planes can add fields safely.

use serde_json::{Map, Value};
use std::collections::HashSet;
use std::fmt;

pub const DEFAULT_MAX_ENTRY_BYTES: u64 = 1_048_576;
pub const DEFAULT_MAX_TOTAL_BYTES: u64 = 67_108_864;
pub const DEFAULT_MAX_ENTRIES: u64 = 16_384;
/// Hard ceilings so a bad push cannot ask Envoy for unbounded memory.
pub const LIMIT_MAX_ENTRY_BYTES: u64 = 64 * 1_048_576;
pub const LIMIT_MAX_TOTAL_BYTES: u64 = 16 * 1_073_741_824;
pub const LIMIT_MAX_ENTRIES: u64 = 1_048_576;
pub const LIMIT_POLICIES: usize = 4096;
pub const LIMIT_PREFIX_LEN: usize = 256;
/// `ignore_fields`: at most this many names per policy, each at most `LIMIT_FIELD_LEN` bytes.
pub const LIMIT_IGNORE_FIELDS: usize = 64;
pub const LIMIT_FIELD_LEN: usize = 256;
/// Request coalescing: how long identical misses wait for the first one's answer (0 = off).
pub const DEFAULT_COALESCE_TIMEOUT_MS: u64 = 5000;
pub const LIMIT_COALESCE_TIMEOUT_MS: u64 = 60_000;
/// `stale_if_error_s` / `stale_while_revalidate_s`: expired entries are kept at most this long.
pub const LIMIT_STALE_S: u64 = 86_400;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    Shared,
    Principal,
}

/// What a client's `Cache-Control: no-cache` or `max-age=0` does (`client_no_cache`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientNoCache {
    /// RFC 9111 §5.2.1: the request goes upstream (no lookup, no coalescing) and its answer
    /// refreshes the entry; `Cache-Status: meshcache; fwd=request`.
    Revalidate,
    /// The directive is not honoured: the request is looked up like any other.
    Ignore,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    pub model_prefix: String,
    pub ttl_s: u64,
    pub max_ttl_s: u64,
    pub generation: u64,
    /// Lowercase, sorted, deduplicated: the response hash walks them in ascending order.
    pub hash_headers: Vec<String>,
    /// Lowercase, in configured order.
    pub vary_headers: Vec<String>,
    pub scope: Scope,
    pub enabled: bool,
    /// Top-level JSON body fields left out of the key (e.g. OpenAI's `user`, `metadata`).
    pub ignore_fields: Vec<String>,
    /// OpenAI-style bodies: bypass sampled answers (`temperature` > 0, or absent, without `seed`).
    pub deterministic_only: bool,
    /// Identical misses wait this long for the first one's answer, then go upstream (0 = off).
    pub coalesce_timeout_ms: u64,
    /// RFC 5861: an expired entry may answer for this long past its TTL when upstream fails.
    pub stale_if_error_s: u64,
    /// RFC 5861: an expired entry may answer at once for this long while one request refreshes it.
    pub stale_while_revalidate_s: u64,
    pub client_no_cache: ClientNoCache,
    /// The opt-in semantic layer (`semantic`; None: off). Needs `Config::semantic_service` too.
    pub semantic: Option<SemanticPolicy>,
}

/// A policy's `semantic`: on an exact miss, the index service may name a stored answer whose
/// scope matches exactly and whose last user message is this similar (issue 38, docs/llm.md).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SemanticPolicy {
    /// Cosine similarity at or above which an answer is served (0 < t <= 1).
    pub threshold: f64,
    /// Look up and report, never serve (the would-be hit goes upstream and is compared).
    pub shadow: bool,
}

pub const DEFAULT_SEMANTIC_THRESHOLD: f64 = 0.999;
pub const DEFAULT_SEMANTIC_TIMEOUT_MS: u64 = 200;
pub const LIMIT_SEMANTIC_TIMEOUT_MS: u64 = 5000;

/// `semantic_service`: where the semantic index service is (an Envoy cluster the filter calls).
#[derive(Clone, Debug, PartialEq)]
pub struct SemanticService {
    pub cluster: String,
    /// The `:authority` of the calls (`host[:port]`).
    pub authority: String,
    /// Each call's bound; a lookup that takes longer goes upstream (fails open).
    pub timeout_ms: u64,
}

/// Which side of the mesh the filter runs on. `role` in the plugin configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The engine's sidecar: the cache ("server").
    Server,
    /// A caller's sidecar: only computes the routing key (`names::ROUTE_KEY_HEADER`) that
    /// sends identical requests to one replica; never answers or stores.
    Client,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    pub max_entry_bytes: u64,
    pub max_total_bytes: u64,
    pub max_entries: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub version: String,
    pub color: String,
    /// Hold request headers until the body is read (the key needs the body). Needs Envoy's
    /// `allow_on_headers_stop_iteration`; hosts that cannot set it (Istio's WasmPlugin) set
    /// this false: headers then continue at once, HTTP hits are still answered at end of body,
    /// gRPC requests bypass (a gRPC hit needs routing, which is decided by then).
    pub hold_headers: bool,
    pub role: Role,
    pub limits: Limits,
    /// Sorted by descending prefix length so the first match is the longest.
    pub policies: Vec<Policy>,
    /// None: the semantic layer is off everywhere (whatever the policies say).
    pub semantic_service: Option<SemanticService>,
}

#[derive(Debug, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "invalid plugin configuration: {}: {}", self.field, self.reason)
    }
}

fn err(field: &str, reason: &str) -> ConfigError {
    ConfigError { field: field.to_string(), reason: reason.to_string() }
}

impl Config {
    pub fn empty() -> Config {
        Config {
            version: String::new(),
            color: String::new(),
            hold_headers: true,
            role: Role::Server,
            limits: Limits {
                max_entry_bytes: DEFAULT_MAX_ENTRY_BYTES,
                max_total_bytes: DEFAULT_MAX_TOTAL_BYTES,
                max_entries: DEFAULT_MAX_ENTRIES as u32,
            },
            policies: Vec::new(),
            semantic_service: None,
        }
    }

    /// The policy with the longest prefix matching `model`, enabled or not (a disabled one
    /// keeps its models out of the cache: it does not hand them to a shorter prefix).
    pub fn policy_matching(&self, model: &str) -> Option<&Policy> {
        self.policies.iter().find(|p| model.starts_with(p.model_prefix.as_str()))
    }
}

pub fn parse_plugin_config(bytes: &[u8]) -> Result<Config, ConfigError> {
    if bytes.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(Config::empty());
    }
    let value: Value = serde_json::from_slice(bytes).map_err(|e| err("(document)", &format!("not valid JSON: {}", e)))?;
    let obj = value.as_object().ok_or_else(|| err("(document)", "must be a JSON object"))?;
    let role = match obj.get("role") {
        None | Some(Value::Null) => Role::Server,
        Some(role) => match role.as_str() {
            Some("server") => Role::Server,
            Some("client") => Role::Client,
            _ => return Err(err("role", "must be \"server\" or \"client\"")),
        },
    };
    let mut cfg = parse_config(obj)?;
    cfg.role = role;
    Ok(cfg)
}

fn parse_config(obj: &Map<String, Value>) -> Result<Config, ConfigError> {
    let version = opt_string(obj, "version", "version")?.unwrap_or_default();
    let color = opt_string(obj, "color", "color")?.unwrap_or_default();
    let hold_headers = opt_bool(obj, "hold_headers", "hold_headers")?.unwrap_or(true);
    let max_entry_bytes = opt_uint(obj, "max_entry_bytes", "max_entry_bytes")?.unwrap_or(DEFAULT_MAX_ENTRY_BYTES);
    let max_total_bytes = opt_uint(obj, "max_total_bytes", "max_total_bytes")?.unwrap_or(DEFAULT_MAX_TOTAL_BYTES);
    let max_entries = opt_uint(obj, "max_entries", "max_entries")?.unwrap_or(DEFAULT_MAX_ENTRIES);
    if max_entry_bytes == 0 || max_entry_bytes > LIMIT_MAX_ENTRY_BYTES {
        return Err(err("max_entry_bytes", &format!("must be between 1 and {}", LIMIT_MAX_ENTRY_BYTES)));
    }
    if max_total_bytes < max_entry_bytes || max_total_bytes > LIMIT_MAX_TOTAL_BYTES {
        return Err(err("max_total_bytes", &format!("must be between max_entry_bytes and {}", LIMIT_MAX_TOTAL_BYTES)));
    }
    if max_entries == 0 || max_entries > LIMIT_MAX_ENTRIES {
        return Err(err("max_entries", &format!("must be between 1 and {}", LIMIT_MAX_ENTRIES)));
    }
    let mut policies = Vec::new();
    match obj.get("policies") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) => {
            if items.len() > LIMIT_POLICIES {
                return Err(err("policies", &format!("at most {} policies", LIMIT_POLICIES)));
            }
            // A set, not a scan per policy: 4096 policies must configure in milliseconds.
            let mut seen: HashSet<String> = HashSet::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let field = format!("policies[{}]", i);
                let p = item.as_object().ok_or_else(|| err(&field, "must be an object"))?;
                let policy = parse_policy(p, &field)?;
                if !seen.insert(policy.model_prefix.clone()) {
                    return Err(err(&format!("{}.model_prefix", field), "duplicate prefix"));
                }
                policies.push(policy);
            }
        }
        Some(_) => return Err(err("policies", "must be an array")),
    }
    policies.sort_by(|a, b| b.model_prefix.len().cmp(&a.model_prefix.len()).then(a.model_prefix.cmp(&b.model_prefix)));
    Ok(Config {
        version,
        color,
        hold_headers,
        role: Role::Server,
        limits: Limits { max_entry_bytes, max_total_bytes, max_entries: max_entries as u32 },
        policies,
        semantic_service: parse_semantic_service(obj)?,
    })
}

fn parse_semantic_service(obj: &Map<String, Value>) -> Result<Option<SemanticService>, ConfigError> {
    let s = match obj.get("semantic_service") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(s)) => s,
        Some(_) => return Err(err("semantic_service", "must be an object")),
    };
    let cluster = opt_string(s, "cluster", "semantic_service.cluster")?.unwrap_or_default();
    if cluster.is_empty() || cluster.len() > LIMIT_FIELD_LEN {
        return Err(err("semantic_service.cluster", &format!("is required: an Envoy cluster name of 1 to {} bytes", LIMIT_FIELD_LEN)));
    }
    let authority = opt_string(s, "authority", "semantic_service.authority")?.unwrap_or_default();
    if authority.is_empty() || authority.len() > LIMIT_FIELD_LEN || !authority.bytes().all(|b| b.is_ascii_graphic() && b != b'/' && b != b'@') {
        return Err(err("semantic_service.authority", "is required: host[:port]"));
    }
    let timeout_ms = opt_uint(s, "timeout_ms", "semantic_service.timeout_ms")?.unwrap_or(DEFAULT_SEMANTIC_TIMEOUT_MS);
    if timeout_ms == 0 || timeout_ms > LIMIT_SEMANTIC_TIMEOUT_MS {
        return Err(err("semantic_service.timeout_ms", &format!("must be between 1 and {}", LIMIT_SEMANTIC_TIMEOUT_MS)));
    }
    Ok(Some(SemanticService { cluster, authority, timeout_ms }))
}

fn parse_semantic_policy(p: &Map<String, Value>, field: &str) -> Result<Option<SemanticPolicy>, ConfigError> {
    let s = match p.get("semantic") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(s)) => s,
        Some(_) => return Err(err(field, "must be an object (or null: off)")),
    };
    let threshold = match s.get("threshold") {
        None | Some(Value::Null) => DEFAULT_SEMANTIC_THRESHOLD,
        Some(Value::Number(n)) => n.as_f64().unwrap_or(-1.0),
        Some(_) => -1.0,
    };
    if !(threshold > 0.0 && threshold <= 1.0) {
        return Err(err(&format!("{}.threshold", field), "must be a number with 0 < threshold <= 1"));
    }
    let shadow = opt_bool(s, "shadow", &format!("{}.shadow", field))?.unwrap_or(false);
    Ok(Some(SemanticPolicy { threshold, shadow }))
}

fn parse_policy(p: &Map<String, Value>, field: &str) -> Result<Policy, ConfigError> {
    let f = |name: &str| format!("{}.{}", field, name);
    let model_prefix = opt_string(p, "model_prefix", &f("model_prefix"))?
        .ok_or_else(|| err(&f("model_prefix"), "is required"))?;
    if model_prefix.is_empty() {
        return Err(err(&f("model_prefix"), "must not be empty"));
    }
    if model_prefix.len() > LIMIT_PREFIX_LEN {
        return Err(err(&f("model_prefix"), &format!("longer than {} bytes", LIMIT_PREFIX_LEN)));
    }
    let ttl_s = opt_uint(p, "ttl_s", &f("ttl_s"))?.ok_or_else(|| err(&f("ttl_s"), "is required"))?;
    let max_ttl_s = opt_uint(p, "max_ttl_s", &f("max_ttl_s"))?.unwrap_or(ttl_s);
    if max_ttl_s < ttl_s {
        return Err(err(&f("max_ttl_s"), "must be at least ttl_s"));
    }
    let generation = opt_uint(p, "generation", &f("generation"))?.unwrap_or(0);
    let mut hash_headers = opt_header_list(p, "hash_headers", &f("hash_headers"))?
        .unwrap_or_else(|| vec!["content-type".to_string(), "x-model-id".to_string()]);
    hash_headers.sort();
    hash_headers.dedup();
    let vary_headers = opt_header_list(p, "vary_headers", &f("vary_headers"))?.unwrap_or_default();
    let scope = match opt_string(p, "scope", &f("scope"))?.as_deref() {
        None | Some("shared") => Scope::Shared,
        Some("principal") => Scope::Principal,
        Some(other) => return Err(err(&f("scope"), &format!("unknown scope {:?} (expected \"shared\" or \"principal\")", other))),
    };
    let enabled = opt_bool(p, "enabled", &f("enabled"))?.unwrap_or(true);
    let ignore_fields = opt_field_list(p, "ignore_fields", &f("ignore_fields"))?;
    let deterministic_only = opt_bool(p, "deterministic_only", &f("deterministic_only"))?.unwrap_or(false);
    let coalesce_timeout_ms = opt_uint(p, "coalesce_timeout_ms", &f("coalesce_timeout_ms"))?
        .unwrap_or(DEFAULT_COALESCE_TIMEOUT_MS);
    let stale_if_error_s = opt_uint(p, "stale_if_error_s", &f("stale_if_error_s"))?.unwrap_or(0);
    let stale_while_revalidate_s = opt_uint(p, "stale_while_revalidate_s", &f("stale_while_revalidate_s"))?.unwrap_or(0);
    let client_no_cache = match opt_string(p, "client_no_cache", &f("client_no_cache"))?.as_deref() {
        None | Some("revalidate") => ClientNoCache::Revalidate,
        Some("ignore") => ClientNoCache::Ignore,
        Some(other) => {
            return Err(err(&f("client_no_cache"), &format!("unknown value {:?} (expected \"revalidate\" or \"ignore\")", other)))
        }
    };
    if coalesce_timeout_ms > LIMIT_COALESCE_TIMEOUT_MS {
        return Err(err(&f("coalesce_timeout_ms"), &format!("must be at most {} (0 turns coalescing off)", LIMIT_COALESCE_TIMEOUT_MS)));
    }
    for (name, value) in [("stale_if_error_s", stale_if_error_s), ("stale_while_revalidate_s", stale_while_revalidate_s)] {
        if value > LIMIT_STALE_S {
            return Err(err(&f(name), &format!("must be at most {}", LIMIT_STALE_S)));
        }
    }
    let semantic = parse_semantic_policy(p, &f("semantic"))?;
    Ok(Policy {
        model_prefix, ttl_s, max_ttl_s, generation, hash_headers, vary_headers, scope, enabled, ignore_fields,
        deterministic_only, coalesce_timeout_ms, stale_if_error_s, stale_while_revalidate_s, client_no_cache, semantic,
    })
}

fn opt_string(obj: &Map<String, Value>, key: &str, field: &str) -> Result<Option<String>, ConfigError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(err(field, "must be a string")),
    }
}

fn opt_uint(obj: &Map<String, Value>, key: &str, field: &str) -> Result<Option<u64>, ConfigError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(v) => Ok(Some(v)),
            None => Err(err(field, "must be a non-negative integer")),
        },
        Some(_) => Err(err(field, "must be a non-negative integer")),
    }
}

fn opt_bool(obj: &Map<String, Value>, key: &str, field: &str) -> Result<Option<bool>, ConfigError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(err(field, "must be a boolean")),
    }
}

/// JSON field names: non-empty, bounded, unique (order kept; matching is exact and case-sensitive).
fn opt_field_list(obj: &Map<String, Value>, key: &str, field: &str) -> Result<Vec<String>, ConfigError> {
    let items = match obj.get(key) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(err(field, "must be an array of field names")),
    };
    if items.len() > LIMIT_IGNORE_FIELDS {
        return Err(err(field, &format!("at most {} fields", LIMIT_IGNORE_FIELDS)));
    }
    let mut out: Vec<String> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let name = item.as_str().ok_or_else(|| err(&format!("{}[{}]", field, i), "must be a string"))?;
        if name.is_empty() || name.len() > LIMIT_FIELD_LEN {
            return Err(err(&format!("{}[{}]", field, i), &format!("must be 1 to {} bytes", LIMIT_FIELD_LEN)));
        }
        if out.iter().any(|o| o == name) {
            return Err(err(&format!("{}[{}]", field, i), "duplicate field"));
        }
        out.push(name.to_string());
    }
    Ok(out)
}

fn opt_header_list(obj: &Map<String, Value>, key: &str, field: &str) -> Result<Option<Vec<String>>, ConfigError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let name = item.as_str().ok_or_else(|| err(&format!("{}[{}]", field, i), "must be a string"))?;
                if name.is_empty() || !name.bytes().all(is_header_name_byte) {
                    return Err(err(&format!("{}[{}]", field, i), "must be a header name token"));
                }
                out.push(name.to_ascii_lowercase());
            }
            Ok(Some(out))
        }
        Some(_) => Err(err(field, "must be an array of header names")),
    }
}

fn is_header_name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(json: &str) -> Config {
        parse_plugin_config(json.as_bytes()).unwrap()
    }

    fn error(json: &str) -> ConfigError {
        parse_plugin_config(json.as_bytes()).unwrap_err()
    }

    #[test]
    fn full_example_parses() {
        let c = cache(r#"{"version": "7", "color": "", "max_entry_bytes": 1048576, "max_total_bytes": 67108864,
            "max_entries": 16384, "policies": [{"model_prefix": "llama3-70b", "ttl_s": 300, "max_ttl_s": 1800,
            "generation": 0, "hash_headers": ["content-type", "x-model-id"], "vary_headers": [],
            "scope": "shared", "enabled": true}]}"#);
        assert_eq!(c.version, "7");
        assert_eq!(c.limits.max_entries, 16384);
        let p = &c.policies[0];
        assert_eq!((p.ttl_s, p.max_ttl_s, p.scope), (300, 1800, Scope::Shared));
    }

    #[test]
    fn defaults_apply() {
        let c = cache(r#"{"policies": [{"model_prefix": "m", "ttl_s": 5}]}"#);
        let p = &c.policies[0];
        assert_eq!(p.max_ttl_s, 5);
        assert_eq!(p.generation, 0);
        assert_eq!(p.hash_headers, vec!["content-type", "x-model-id"]);
        assert!(p.vary_headers.is_empty());
        assert_eq!(p.scope, Scope::Shared);
        assert!(p.enabled);
        assert!(p.ignore_fields.is_empty());
        assert!(!p.deterministic_only);
        assert_eq!(p.client_no_cache, ClientNoCache::Revalidate);
        assert_eq!((p.coalesce_timeout_ms, p.stale_if_error_s, p.stale_while_revalidate_s), (DEFAULT_COALESCE_TIMEOUT_MS, 0, 0));
        assert_eq!(c.limits, Config::empty().limits);
        assert_eq!(c.color, "");
        assert!(c.hold_headers);
        assert!(!cache(r#"{"hold_headers": false}"#).hold_headers);
    }

    #[test]
    fn longest_prefix_wins_and_disabled_means_none() {
        let c = cache(r#"{"policies": [{"model_prefix": "llama", "ttl_s": 1},
            {"model_prefix": "llama3-70b", "ttl_s": 2}, {"model_prefix": "off", "ttl_s": 3, "enabled": false}]}"#);
        assert_eq!(c.policy_matching("llama3-70b-chat").unwrap().ttl_s, 2);
        assert_eq!(c.policy_matching("llama2").unwrap().ttl_s, 1);
        assert!(c.policy_matching("mistral").is_none());
        assert!(!c.policy_matching("off-model").unwrap().enabled);
    }

    #[test]
    fn key_shaping_fields() {
        let c = cache(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "ignore_fields": ["user", "metadata"],
            "deterministic_only": true}]}"#);
        assert_eq!(c.policies[0].ignore_fields, vec!["user", "metadata"]);
        assert!(c.policies[0].deterministic_only);
        let ignore = cache(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "client_no_cache": "ignore"}]}"#);
        assert_eq!(ignore.policies[0].client_no_cache, ClientNoCache::Ignore);
        let many: Vec<String> = (0..=LIMIT_IGNORE_FIELDS).map(|i| format!("\"f{}\"", i)).collect();
        let json = format!(r#"{{"policies": [{{"model_prefix": "m", "ttl_s": 1, "ignore_fields": [{}]}}]}}"#, many.join(","));
        assert_eq!(error(&json).field, "policies[0].ignore_fields");
    }

    #[test]
    fn coalescing_and_stale_fields() {
        let c = cache(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "coalesce_timeout_ms": 0,
            "stale_if_error_s": 600, "stale_while_revalidate_s": 30}]}"#);
        let p = &c.policies[0];
        assert_eq!((p.coalesce_timeout_ms, p.stale_if_error_s, p.stale_while_revalidate_s), (0, 600, 30));
        let top = format!(r#"{{"policies": [{{"model_prefix": "m", "ttl_s": 1, "coalesce_timeout_ms": {},
            "stale_if_error_s": {}, "stale_while_revalidate_s": {}}}]}}"#, LIMIT_COALESCE_TIMEOUT_MS, LIMIT_STALE_S, LIMIT_STALE_S);
        assert_eq!(cache(&top).policies[0].coalesce_timeout_ms, LIMIT_COALESCE_TIMEOUT_MS);
    }

    #[test]
    fn hash_headers_are_normalised() {
        let c = cache(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "hash_headers": ["X-B", "a", "x-b"]}]}"#);
        assert_eq!(c.policies[0].hash_headers, vec!["a", "x-b"]);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": -1}]}"#, "policies[0].ttl_s"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": "5"}]}"#, "policies[0].ttl_s"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 10, "max_ttl_s": 5}]}"#, "policies[0].max_ttl_s"),
            (r#"{"policies": [{"model_prefix": "", "ttl_s": 1}]}"#, "policies[0].model_prefix"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "scope": "global"}]}"#, "policies[0].scope"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "enabled": "yes"}]}"#, "policies[0].enabled"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "vary_headers": ["bad header"]}]}"#, "policies[0].vary_headers[0]"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1}, {"model_prefix": "m", "ttl_s": 2}]}"#, "policies[1].model_prefix"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "ignore_fields": "user"}]}"#, "policies[0].ignore_fields"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "ignore_fields": [""]}]}"#, "policies[0].ignore_fields[0]"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "ignore_fields": ["a", 1]}]}"#, "policies[0].ignore_fields[1]"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "ignore_fields": ["a", "a"]}]}"#, "policies[0].ignore_fields[1]"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "deterministic_only": 1}]}"#, "policies[0].deterministic_only"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "client_no_cache": "bypass"}]}"#, "policies[0].client_no_cache"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "client_no_cache": true}]}"#, "policies[0].client_no_cache"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "coalesce_timeout_ms": 60001}]}"#, "policies[0].coalesce_timeout_ms"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "coalesce_timeout_ms": -1}]}"#, "policies[0].coalesce_timeout_ms"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "stale_if_error_s": 86401}]}"#, "policies[0].stale_if_error_s"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "stale_while_revalidate_s": 1.5}]}"#, "policies[0].stale_while_revalidate_s"),
            (r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "stale_while_revalidate_s": 86401}]}"#, "policies[0].stale_while_revalidate_s"),
            (r#"{"version": 7}"#, "version"),
            (r#"{"hold_headers": "no"}"#, "hold_headers"),
            (r#"{"max_entries": 0}"#, "max_entries"),
            (r#"{"max_entry_bytes": 10, "max_total_bytes": 5}"#, "max_total_bytes"),
            (r#"{"policies": {}}"#, "policies"),
            (r#"[1]"#, "(document)"),
            (r#"{"#, "(document)"),
        ];
        for (json, field) in cases.iter() {
            let e = error(json);
            assert_eq!(&e.field, field, "{}", json);
            assert!(e.to_string().contains(field));
        }
    }

    #[test]
    fn many_long_prefixes_configure_fast_and_duplicates_are_named() {
        let policies: Vec<String> = (0..LIMIT_POLICIES - 1)
            .map(|i| format!(r#"{{"model_prefix": "{:0>256}", "ttl_s": 1}}"#, i))
            .collect();
        let json = format!(r#"{{"policies": [{}]}}"#, policies.join(","));
        let started = std::time::Instant::now();
        let c = cache(&json);
        // Not a timing assertion (benchmarks measure speed); printed for the record.
        println!("4095 policies of 256-byte prefixes parsed in {:?}", started.elapsed());
        assert_eq!(c.policies.len(), LIMIT_POLICIES - 1);
        let dup = format!(r#"{{"policies": [{}, {}]}}"#, policies[0], policies[0]);
        assert_eq!(error(&dup).field, "policies[1].model_prefix");
    }

    #[test]
    fn unknown_fields_ignored_and_roles() {
        let c = cache(r#"{"surprise": 1, "policies": [{"model_prefix": "m", "ttl_s": 1, "extra": [1]}]}"#);
        assert_eq!(c.policies.len(), 1);
        assert_eq!(error(r#"{"role": "stub"}"#).field, "role");
        assert_eq!(parse_plugin_config(b"").unwrap(), Config::empty());
        assert_eq!(error(r#"{"role": "cache"}"#).field, "role");
        assert_eq!(error(r#"{"role": "x"}"#).field, "role");
        assert_eq!(error(r#"{"role": 1}"#).field, "role");
        assert_eq!(cache(r#"{"role": "server"}"#).role, Role::Server);
        let client = cache(r#"{"role": "client", "policies": [{"model_prefix": "m", "ttl_s": 1}]}"#);
        assert_eq!((client.role, client.policies.len()), (Role::Client, 1));
    }

    #[test]
    fn semantic_is_off_unless_configured_and_validated() {
        let c = cache(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1}]}"#);
        assert_eq!((c.semantic_service.clone(), c.policies[0].semantic), (None, None));
        let c = cache(r#"{"semantic_service": {"cluster": "semantic", "authority": "127.0.0.1:8090"},
            "policies": [{"model_prefix": "m", "ttl_s": 1, "semantic": {}}, {"model_prefix": "n", "ttl_s": 1,
            "semantic": {"threshold": 0.9, "shadow": true}}, {"model_prefix": "o", "ttl_s": 1, "semantic": null}]}"#);
        assert_eq!(c.semantic_service, Some(SemanticService { cluster: "semantic".into(), authority: "127.0.0.1:8090".into(), timeout_ms: 200 }));
        let by = |p: &str| c.policies.iter().find(|x| x.model_prefix == p).unwrap().semantic;
        assert_eq!(by("m"), Some(SemanticPolicy { threshold: 0.999, shadow: false }));
        assert_eq!(by("n"), Some(SemanticPolicy { threshold: 0.9, shadow: true }));
        assert_eq!(by("o"), None);
        let p = |semantic: &str| format!(r#"{{"policies": [{{"model_prefix": "m", "ttl_s": 1, "semantic": {}}}]}}"#, semantic);
        assert_eq!(error(&p(r#"{"threshold": 0}"#)).field, "policies[0].semantic.threshold");
        assert_eq!(error(&p(r#"{"threshold": 1.5}"#)).field, "policies[0].semantic.threshold");
        assert_eq!(error(&p(r#"{"threshold": "0.9"}"#)).field, "policies[0].semantic.threshold");
        assert_eq!(error(&p(r#"{"shadow": 1}"#)).field, "policies[0].semantic.shadow");
        assert_eq!(error(&p("true")).field, "policies[0].semantic");
        assert_eq!(cache(&p(r#"{"threshold": 1}"#)).policies[0].semantic.unwrap().threshold, 1.0);
        let s = |service: &str| format!(r#"{{"semantic_service": {}}}"#, service);
        assert_eq!(error(&s(r#"{"authority": "a:1"}"#)).field, "semantic_service.cluster");
        assert_eq!(error(&s(r#"{"cluster": "c"}"#)).field, "semantic_service.authority");
        assert_eq!(error(&s(r#"{"cluster": "c", "authority": "a/b"}"#)).field, "semantic_service.authority");
        assert_eq!(error(&s(r#"{"cluster": "c", "authority": "a", "timeout_ms": 0}"#)).field, "semantic_service.timeout_ms");
        assert_eq!(error(&s(r#"{"cluster": "c", "authority": "a", "timeout_ms": 5001}"#)).field, "semantic_service.timeout_ms");
        assert_eq!(error(&s("[]")).field, "semantic_service");
        assert_eq!(cache(&s(r#"{"cluster": "c", "authority": "a", "timeout_ms": 5000}"#)).semantic_service.unwrap().timeout_ms, 5000);
    }
}
