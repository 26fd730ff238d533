//! The semantic layer's filter side (issue 38; docs/llm.md "The semantic layer"): which request
//! may be looked up by meaning, its exact scope (the same digest as `meshcache/semantic/scope.py`,
//! checked against it by `scope_vectors.json`), the index service's request and answer bodies,
//! and what an answer means for the request. Plain Rust: the hosts only send and receive.
//!
//! The scope is a SHA-256 over canonical JSON (sorted keys, no spaces, Python's `json.dumps`
//! spelling of strings and numbers) of: the cache instance, the policy and its generation, the
//! principal (principal-scoped policies), every request member but `messages` and the policy's
//! `ignore_fields`, every message but the last, and the last one without its content. Only the
//! last message's text is compared by embedding.

use crate::config::{Policy, Scope as PolicyScope, SemanticPolicy, SemanticService};
use crate::entry::Entry;
use crate::hashing::{self, KeyDigest};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

/// The only path whose bodies have a scope (chat completions: the last user turn is compared).
pub const CHAT_PATH: &str = "/v1/chat/completions";
pub const LOOKUP_PATH: &str = "/v1/semantic/lookup";
pub const STORE_PATH: &str = "/v1/semantic/store";
pub const SHADOW_PATH: &str = "/v1/semantic/shadow";
pub const SIMILARITY_HEADER: &str = "x-meshcache-similarity";
pub const CACHE_STATUS_SEMANTIC_HIT: &str = "meshcache; hit; detail=semantic";
/// The service's bounds (meshcache/semantic/service.py): a longer text is not looked up.
pub const MAX_TEXT_CHARS: usize = 32768;
pub const MAX_TTL_S: u64 = 7 * 86400;

/// What a semantic lookup needs, computed once from the request on an exact miss.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Hex SHA-256 of the request's exact scope.
    pub scope: String,
    /// The last user message: what is compared by embedding.
    pub text: String,
    pub policy: String,
    pub threshold: f64,
    pub shadow: bool,
}

/// The request's semantic plan, or None when the layer is off for it (no service, a policy
/// without `semantic`, another path, or a body without a last user text).
pub fn plan(service: Option<&SemanticService>, policy: &Policy, path: &str, body: &[u8], principal: Option<&str>,
            instance: &str) -> Option<Plan> {
    service?;
    let SemanticPolicy { threshold, shadow } = policy.semantic?;
    if path.split('?').next() != Some(CHAT_PATH) {
        return None;
    }
    let principal = if policy.scope == PolicyScope::Principal { Some(principal?) } else { None };
    let (scope, text) = scope(body, &policy.model_prefix, policy.generation, principal, &policy.ignore_fields, instance)?;
    if text.is_empty() || text.chars().count() > MAX_TEXT_CHARS {
        return None;
    }
    Some(Plan { scope, text, policy: policy.model_prefix.clone(), threshold, shadow })
}

/// (scope hex digest, last user text) of a chat completion body: `scope.py`'s `semantic_scope`.
pub fn scope(body: &[u8], policy: &str, generation: u64, principal: Option<&str>, ignore_fields: &[String],
             instance: &str) -> Option<(String, String)> {
    let doc: Value = serde_json::from_slice(body).ok()?;
    let obj = doc.as_object()?;
    let messages = obj.get("messages")?.as_array()?;
    let (last, history) = messages.split_last()?;
    let last = last.as_object()?;
    let text = user_text(last)?;
    let mut request = Map::new();
    for (k, v) in obj.iter() {
        if k != "messages" && !ignore_fields.iter().any(|f| f == k) {
            request.insert(k.clone(), v.clone());
        }
    }
    let mut last_message = last.clone();
    last_message.remove("content");
    let scoped = json!({
        "instance": instance,
        "policy": policy,
        "generation": generation,
        "principal": principal,
        "request": Value::Object(request),
        "history": Value::Array(history.to_vec()),
        "last_message": Value::Object(last_message),
    });
    let mut canonical = String::new();
    write_canonical(&scoped, &mut canonical);
    Some((hashing::hex(&Sha256::digest(canonical.as_bytes())), text))
}

fn user_text(message: &Map<String, Value>) -> Option<String> {
    if message.get("role").and_then(Value::as_str) != Some("user") {
        return None;
    }
    match message.get("content")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(parts) if !parts.is_empty() => {
            let mut text = String::new();
            for p in parts {
                let p = p.as_object()?;
                if p.get("type").and_then(Value::as_str) != Some("text") {
                    return None;
                }
                text.push_str(p.get("text")?.as_str()?);
            }
            Some(text)
        }
        _ => None,
    }
}

/// Python's `json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)`.
fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                out.push_str(&i.to_string());
            } else if let Some(u) = n.as_u64() {
                out.push_str(&u.to_string());
            } else {
                out.push_str(&python_float(n.as_f64().unwrap_or(0.0)));
            }
        }
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Value::Object(m) => {
            // Code point order (Python's sort of str keys) is UTF-8 byte order.
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(k, out);
                out.push(':');
                write_canonical(&m[k.as_str()], out);
            }
            out.push('}');
        }
    }
}

fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest digits that round-trip, fixed notation for decimal
/// exponents -4..16, otherwise `d.ddde+XX` (at least two exponent digits).
fn python_float(f: f64) -> String {
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // `{:e}` is Rust's shortest round-trip digits in scientific form: `d.ddde-X`.
    let sci = format!("{:e}", f);
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let s = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{}{}", sign, s)
    } else {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        format!("{}{}e{}{:02}", sign, m, if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

/// The body of `POST /v1/semantic/lookup`.
pub fn lookup_body(p: &Plan) -> Vec<u8> {
    json!({"scope": p.scope, "text": p.text, "threshold": p.threshold, "shadow": p.shadow}).to_string().into_bytes()
}

/// The body of `POST /v1/semantic/store` for the answer just stored (None: nothing to index,
/// e.g. an entry that lives under a second).
pub fn store_body(p: &Plan, entry: &Entry, answer_digest: &str) -> Option<Vec<u8>> {
    let ttl_s = entry.expires_at_ms.saturating_sub(entry.stored_at_ms) / 1000;
    if ttl_s == 0 {
        return None;
    }
    Some(json!({"policy": p.policy, "scope": p.scope, "text": p.text, "key": hashing::hex(&entry.key),
                "ttl_s": ttl_s.min(MAX_TTL_S), "response_hash": answer_digest}).to_string().into_bytes())
}

/// What shadow mode compares (the index's `response_hash`): a SHA-256 of the answer's text, the
/// choices' `message.content` (JSON) or their `delta.content` joined (SSE), each choice's text
/// after its index. Not the entry's `x-response-hash`: two answers of the same text differ in
/// `id` and `created`. An answer without choices is hashed whole.
pub fn answer_digest(content_type: Option<&str>, body: &[u8]) -> String {
    let mut texts: std::collections::BTreeMap<u64, String> = std::collections::BTreeMap::new();
    let mut add = |doc: &Value, member: &str| {
        for choice in doc.get("choices").and_then(Value::as_array).map(|a| a.as_slice()).unwrap_or(&[]) {
            let index = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
            if let Some(t) = choice.get(member).and_then(|m| m.get("content")).and_then(Value::as_str) {
                texts.entry(index).or_default().push_str(t);
            }
        }
    };
    if crate::sse::is_event_stream(content_type) {
        crate::sse::for_each_data(body, |data| {
            if let Ok(doc) = serde_json::from_slice::<Value>(data) {
                add(&doc, "delta");
            }
        });
    } else if let Ok(doc) = serde_json::from_slice::<Value>(body) {
        add(&doc, "message");
    }
    let mut h = Sha256::new();
    if texts.is_empty() {
        h.update(body);
    }
    for (index, text) in texts.iter() {
        h.update(index.to_be_bytes());
        h.update((text.len() as u64).to_be_bytes());
        h.update(text.as_bytes());
    }
    hashing::hex(&h.finalize())
}

/// The body of `POST /v1/semantic/shadow`: a would-be hit's answer against the upstream one.
pub fn shadow_body(policy: &str, similarity: f64, matched: bool) -> Vec<u8> {
    json!({"policy": policy, "similarity": similarity, "matched": matched}).to_string().into_bytes()
}

/// What the lookup's answer means for the request.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Answer from this entry (if this sidecar still holds it fresh; otherwise go upstream).
    Serve { key: KeyDigest, similarity: f64 },
    /// Shadow mode found a would-be hit: go upstream, then compare the answers.
    Shadow { response_hash: String, similarity: f64 },
    /// Nothing similar enough: go upstream.
    Upstream,
}

/// Reads the service's answer (`status` its HTTP status); Err: a failed lookup (the caller
/// goes upstream and counts `meshcache.semantic.errors`).
pub fn verdict(status: Option<&str>, body: &[u8]) -> Result<Verdict, &'static str> {
    if status != Some("200") {
        return Err("the semantic service did not answer 200");
    }
    let doc: Value = serde_json::from_slice(body).map_err(|_| "the semantic service's answer is not JSON")?;
    let flag = |k: &str| doc.get(k).and_then(Value::as_bool).ok_or("the semantic service's answer lacks hit/would_hit");
    let (hit, would_hit) = (flag("hit")?, flag("would_hit")?);
    if !would_hit {
        return Ok(Verdict::Upstream);
    }
    let similarity = doc.get("similarity").and_then(Value::as_f64).ok_or("a would-be hit without its similarity")?;
    if hit {
        let key = doc.get("key").and_then(Value::as_str).and_then(hashing::unhex).filter(|k| k.len() == 32)
            .ok_or("a hit without a 64-hex key")?;
        let mut digest = [0u8; 32];
        digest.copy_from_slice(&key);
        return Ok(Verdict::Serve { key: digest, similarity });
    }
    let response_hash = doc.get("response_hash").and_then(Value::as_str).unwrap_or("").to_string();
    Ok(Verdict::Shadow { response_hash, similarity })
}

/// The entry a `Verdict::Serve` names, if this store holds it fresh under the request's policy
/// (None: evicted, expired, or never this store's; the request goes upstream).
pub fn served<S: crate::store::SharedData>(cache: &crate::store::Cache<S>, c: &crate::request::Cacheable, key: &KeyDigest,
                                           now: u64, out: &mut crate::store::Outcome) -> Option<Entry> {
    if c.grpc {
        return None;
    }
    match cache.lookup_keeping(key, now, crate::store::Lifetime::of(&c.policy), out) {
        crate::store::Lookup::Hit(e) if e.policy == crate::accounting::policy_tag(&c.policy.model_prefix) => Some(e),
        _ => None,
    }
}

/// A semantic hit's answer: the entry's, with `Cache-Status: meshcache; hit; detail=semantic`
/// and `x-meshcache-similarity`.
pub fn hit_answer<'e>(entry: &'e Entry, request: &crate::hit::HitRequest, now: u64, similarity: f64) -> crate::hit::HitAnswer<'e> {
    let mut reply = crate::hit::http_hit(entry, request, now);
    crate::hit::set_cache_status(&mut reply, CACHE_STATUS_SEMANTIC_HIT.to_string());
    reply.headers.push((SIMILARITY_HEADER.to_string(), similarity_header(similarity)));
    reply
}

/// What a request of a semantic policy sends once its answer is stored: the index store and,
/// after a shadow-mode would-be hit (`shadow`: its answer digest and similarity), the report.
/// (path, body) pairs, fire and forget.
pub fn after_store(plan: &Plan, shadow: Option<&(String, f64)>, entry: &Entry) -> Vec<(&'static str, Vec<u8>)> {
    let digest = answer_digest(crate::headermap::header(&entry.headers, "content-type"), &entry.body);
    let mut calls = Vec::new();
    if let Some(body) = store_body(plan, entry, &digest) {
        calls.push((STORE_PATH, body));
    }
    if let Some((would_be, similarity)) = shadow {
        calls.push((SHADOW_PATH, shadow_body(&plan.policy, *similarity, *would_be == digest)));
    }
    calls
}

/// The headers of a POST to the index service's `path` (hosts add `content-length` as they must).
pub fn call_headers<'s>(service: &'s SemanticService, path: &'s str) -> [(&'static str, &'s str); 4] {
    [(":method", "POST"), (":path", path), (":authority", service.authority.as_str()), ("content-type", "application/json")]
}

/// The `x-meshcache-similarity` value: four decimals.
pub fn similarity_header(similarity: f64) -> String {
    format!("{:.4}", similarity)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_plugin_config;

    /// Vectors written by `meshcache/semantic/scope.py` (tests/semantic/test_scope_contract.py
    /// checks the file is what the Python reference computes today).
    const VECTORS: &str = include_str!("../../../tests/semantic/scope_vectors.json");

    #[test]
    fn scopes_equal_the_python_reference() {
        let vectors: Value = serde_json::from_str(VECTORS).unwrap();
        let vectors = vectors.as_array().unwrap();
        assert!(vectors.len() >= 8);
        for v in vectors {
            let body = v["body"].as_str().unwrap();
            let ignore: Vec<String> = v["ignore_fields"].as_array().unwrap().iter().map(|f| f.as_str().unwrap().to_string()).collect();
            let got = scope(body.as_bytes(), v["policy"].as_str().unwrap(), v["generation"].as_u64().unwrap(),
                            v["principal"].as_str(), &ignore, v["instance"].as_str().unwrap());
            let want = v["scope"].as_str().map(|s| (s.to_string(), v["text"].as_str().unwrap().to_string()));
            assert_eq!(got, want, "{}", body);
        }
    }

    #[test]
    fn floats_print_as_python_does() {
        for (f, s) in [(0.7, "0.7"), (1.0, "1.0"), (100.0, "100.0"), (1e16, "1e+16"), (1.5e16, "1.5e+16"), (1e15, "1000000000000000.0"),
                       (0.0001, "0.0001"), (0.00001, "1e-05"), (-2.5e-7, "-2.5e-07"), (1.7976931348623157e308, "1.7976931348623157e+308"),
                       (-0.0, "-0.0"), (123.456, "123.456")] {
            assert_eq!(python_float(f), s);
        }
    }

    fn policy(json: &str) -> Policy {
        parse_plugin_config(json.as_bytes()).unwrap().policies.remove(0)
    }

    #[test]
    fn a_plan_needs_the_service_a_semantic_policy_the_chat_path_and_a_last_user_text() {
        let service = SemanticService { cluster: "s".into(), authority: "a".into(), timeout_ms: 200 };
        let on = policy(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "semantic": {"threshold": 0.9}}]}"#);
        let off = policy(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1}]}"#);
        let body = br#"{"model":"m1","messages":[{"role":"user","content":"hi"}]}"#;
        let p = plan(Some(&service), &on, CHAT_PATH, body, None, "i").unwrap();
        assert_eq!((p.text.as_str(), p.threshold, p.shadow, p.policy.as_str()), ("hi", 0.9, false, "m"));
        assert_eq!(plan(None, &on, CHAT_PATH, body, None, "i"), None);
        assert_eq!(plan(Some(&service), &off, CHAT_PATH, body, None, "i"), None);
        assert_eq!(plan(Some(&service), &on, "/v1/completions", body, None, "i"), None);
        assert!(plan(Some(&service), &on, "/v1/chat/completions?x=1", body, None, "i").is_some());
        assert_eq!(plan(Some(&service), &on, CHAT_PATH, br#"{"model":"m1","messages":[{"role":"assistant","content":"hi"}]}"#, None, "i"), None);
        assert_eq!(plan(Some(&service), &on, CHAT_PATH, br#"{"model":"m1","messages":[{"role":"user","content":""}]}"#, None, "i"), None);
        // Another cache instance, another scope: an index shared by sidecars never hands one
        // sidecar a key another stored.
        assert_ne!(plan(Some(&service), &on, CHAT_PATH, body, None, "j").unwrap().scope, p.scope);
        // Principal-scoped: the principal is in the scope (and required).
        let scoped = policy(r#"{"policies": [{"model_prefix": "m", "ttl_s": 1, "scope": "principal", "semantic": {}}]}"#);
        let a = plan(Some(&service), &scoped, CHAT_PATH, body, Some("spiffe://a"), "i").unwrap();
        let b = plan(Some(&service), &scoped, CHAT_PATH, body, Some("spiffe://b"), "i").unwrap();
        assert_ne!(a.scope, b.scope);
        assert_eq!(plan(Some(&service), &scoped, CHAT_PATH, body, None, "i"), None);
        // A shared policy ignores the caller.
        assert_eq!(plan(Some(&service), &on, CHAT_PATH, body, Some("spiffe://a"), "i").unwrap().scope, p.scope);
    }

    #[test]
    fn service_answers() {
        let key = "ab".repeat(32);
        let hit = format!(r#"{{"hit":true,"would_hit":true,"shadow":false,"similarity":0.97,"key":"{}","response_hash":"","ttl_left_s":3}}"#, key);
        assert_eq!(verdict(Some("200"), hit.as_bytes()), Ok(Verdict::Serve { key: [0xab; 32], similarity: 0.97 }));
        let shadow = format!(r#"{{"hit":false,"would_hit":true,"shadow":true,"similarity":0.95,"key":"{}","response_hash":"{}"}}"#, key, "cd".repeat(32));
        assert_eq!(verdict(Some("200"), shadow.as_bytes()), Ok(Verdict::Shadow { response_hash: "cd".repeat(32), similarity: 0.95 }));
        let none = br#"{"hit":false,"would_hit":false,"shadow":false,"similarity":0.3,"key":null}"#;
        assert_eq!(verdict(Some("200"), none), Ok(Verdict::Upstream));
        assert!(verdict(Some("503"), none).is_err());
        assert!(verdict(None, b"").is_err());
        assert!(verdict(Some("200"), b"{}").is_err());
        assert!(verdict(Some("200"), br#"{"hit":true,"would_hit":true,"similarity":1.0,"key":"zz"}"#).is_err());
        assert_eq!(similarity_header(0.987_65), "0.9877");
    }

    #[test]
    fn answers_with_the_same_text_have_the_same_digest() {
        let json = |id: &str, text: &str| format!(r#"{{"id":"{}","created":1,"choices":[{{"index":0,"message":{{"role":"assistant","content":"{}"}}}}]}}"#, id, text);
        let ct = Some("application/json");
        assert_eq!(answer_digest(ct, json("a", "Paris").as_bytes()), answer_digest(ct, json("b", "Paris").as_bytes()));
        assert_ne!(answer_digest(ct, json("a", "Paris").as_bytes()), answer_digest(ct, json("a", "Lyon").as_bytes()));
        let sse = |id: &str, parts: &[&str]| {
            let mut s = String::new();
            for p in parts {
                s.push_str(&format!("data: {{\"id\":\"{}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n", id, p));
            }
            s + "data: [DONE]\n\n"
        };
        let ct = Some("text/event-stream");
        assert_eq!(answer_digest(ct, sse("a", &["Par", "is"]).as_bytes()), answer_digest(ct, sse("b", &["P", "aris"]).as_bytes()));
        assert_ne!(answer_digest(ct, sse("a", &["Paris"]).as_bytes()), answer_digest(ct, sse("a", &["Lyon"]).as_bytes()));
        // No choices: the whole body.
        assert_ne!(answer_digest(None, b"x"), answer_digest(None, b"y"));
    }

    #[test]
    fn store_and_shadow_bodies() {
        let p = Plan { scope: "0".repeat(64), text: "hi".into(), policy: "m".into(), threshold: 0.9, shadow: false };
        let e = crate::entry::sample(1, b"{}", 1000 + 600_000);
        let body: Value = serde_json::from_slice(&store_body(&p, &e, &"ab".repeat(32)).unwrap()).unwrap();
        assert_eq!(body, json!({"policy": "m", "scope": "0".repeat(64), "text": "hi", "key": "01".repeat(32), "ttl_s": 600,
                                "response_hash": "ab".repeat(32)}));
        assert_eq!(store_body(&p, &crate::entry::sample(1, b"{}", 1500), ""), None);
        let lookup: Value = serde_json::from_slice(&lookup_body(&p)).unwrap();
        assert_eq!(lookup, json!({"scope": "0".repeat(64), "text": "hi", "threshold": 0.9, "shadow": false}));
        let shadow: Value = serde_json::from_slice(&shadow_body("m", 0.5, true)).unwrap();
        assert_eq!(shadow, json!({"policy": "m", "similarity": 0.5, "matched": true}));
    }
}
