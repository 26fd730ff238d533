//! The filter configuration: the same JSON the Wasm filter reads (meshcache.contract.filter_config),
//! of which phase 1 uses the limits and each policy's model prefix and TTL. Unknown fields are
//! accepted (they belong to the full filter); wrong types are errors, so Envoy rejects the config.

use serde_json::Value;

pub const DEFAULT_MAX_ENTRY_BYTES: u64 = 1_048_576;
pub const DEFAULT_MAX_TOTAL_BYTES: u64 = 67_108_864;
const LIMIT_MAX_ENTRY_BYTES: u64 = 64 * 1_048_576;
const LIMIT_MAX_TOTAL_BYTES: u64 = 16 * 1024 * 1_048_576;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub model_prefix: String,
    pub ttl_s: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub max_entry_bytes: u64,
    pub max_total_bytes: u64,
    pub policies: Vec<Policy>,
}

fn uint(obj: &serde_json::Map<String, Value>, name: &str) -> Result<Option<u64>, String> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| format!("{}: must be a non-negative integer", name)),
    }
}

pub fn parse(bytes: &[u8]) -> Result<Config, String> {
    let text = if bytes.iter().all(|b| b.is_ascii_whitespace()) { &b"{}"[..] } else { bytes };
    let v: Value = serde_json::from_slice(text).map_err(|e| format!("config is not JSON: {}", e))?;
    let obj = v.as_object().ok_or("config: must be a JSON object")?;
    let max_entry_bytes = uint(obj, "max_entry_bytes")?.unwrap_or(DEFAULT_MAX_ENTRY_BYTES);
    let max_total_bytes = uint(obj, "max_total_bytes")?.unwrap_or(DEFAULT_MAX_TOTAL_BYTES);
    if max_entry_bytes == 0 || max_entry_bytes > LIMIT_MAX_ENTRY_BYTES {
        return Err(format!("max_entry_bytes: must be between 1 and {}", LIMIT_MAX_ENTRY_BYTES));
    }
    if max_total_bytes < max_entry_bytes || max_total_bytes > LIMIT_MAX_TOTAL_BYTES {
        return Err(format!("max_total_bytes: must be between max_entry_bytes and {}", LIMIT_MAX_TOTAL_BYTES));
    }
    let mut policies = Vec::new();
    match obj.get("policies") {
        None | Some(Value::Null) => {}
        Some(Value::Array(items)) => {
            for (i, p) in items.iter().enumerate() {
                let p = p.as_object().ok_or_else(|| format!("policies[{}]: must be an object", i))?;
                if p.get("enabled") == Some(&Value::Bool(false)) {
                    continue;
                }
                let model_prefix = match p.get("model_prefix") {
                    Some(Value::String(s)) if !s.is_empty() => s.clone(),
                    _ => return Err(format!("policies[{}].model_prefix: must be a non-empty string", i)),
                };
                let ttl_s = uint(p, "ttl_s")?.ok_or_else(|| format!("policies[{}].ttl_s: is required", i))?;
                policies.push(Policy { model_prefix, ttl_s });
            }
        }
        Some(_) => return Err("policies: must be an array".into()),
    }
    // Longest prefix first: the most specific policy wins.
    policies.sort_by(|a, b| b.model_prefix.len().cmp(&a.model_prefix.len()));
    Ok(Config { max_entry_bytes, max_total_bytes, policies })
}

impl Config {
    pub fn policy(&self, model: &[u8]) -> Option<&Policy> {
        self.policies.iter().find(|p| model.starts_with(p.model_prefix.as_bytes()))
    }
}

/// The model of a KServe v2 REST inference path: `/v2/models/<m>/infer` or
/// `/v2/models/<m>/versions/<v>/infer` (query string ignored).
pub fn infer_model(path: &[u8]) -> Option<&[u8]> {
    let path = path.split(|b| *b == b'?').next().unwrap_or(path);
    let rest = path.strip_prefix(b"/v2/models/")?;
    let model_end = rest.iter().position(|b| *b == b'/')?;
    let (model, tail) = rest.split_at(model_end);
    if model.is_empty() {
        return None;
    }
    if tail == b"/infer" {
        return Some(model);
    }
    let version_tail = tail.strip_prefix(b"/versions/")?;
    let v_end = version_tail.iter().position(|b| *b == b'/')?;
    (v_end > 0 && &version_tail[v_end..] == b"/infer").then_some(model)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_wasm_filters_config() {
        let c = parse(br#"{"version": "bench", "max_entry_bytes": 9437184, "max_total_bytes": 268435456,
            "hold_headers": true, "policies": [{"model_prefix": "bench", "ttl_s": 3600},
            {"model_prefix": "bench-long", "ttl_s": 5}, {"model_prefix": "off", "ttl_s": 1, "enabled": false}]}"#)
            .unwrap();
        assert_eq!(c.max_entry_bytes, 9437184);
        assert_eq!(c.policy(b"bench-model").unwrap().ttl_s, 3600);
        assert_eq!(c.policy(b"bench-longer").unwrap().ttl_s, 5, "longest prefix wins");
        assert!(c.policy(b"off").is_none());
        assert_eq!(parse(b"").unwrap().max_total_bytes, DEFAULT_MAX_TOTAL_BYTES);
    }

    #[test]
    fn rejects_bad_values() {
        for bad in [&br#"{"max_entry_bytes": -1}"#[..], br#"{"max_entry_bytes": 10, "max_total_bytes": 5}"#,
                    br#"{"policies": [{"ttl_s": 1}]}"#, br#"{"policies": {}}"#, b"[]", b"{"] {
            assert!(parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn inference_paths() {
        assert_eq!(infer_model(b"/v2/models/m1/infer"), Some(&b"m1"[..]));
        assert_eq!(infer_model(b"/v2/models/m1/versions/2/infer?x=1"), Some(&b"m1"[..]));
        for no in [&b"/v2/models//infer"[..], b"/v2/models/m1", b"/v2/models/m1/ready", b"/other",
                   b"/v2/models/m1/versions//infer", b"/v2/models/m1/infer/x"] {
            assert_eq!(infer_model(no), None, "{}", String::from_utf8_lossy(no));
        }
    }
}
