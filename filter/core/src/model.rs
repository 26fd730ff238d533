//! Which model a request is for: KServe v2 REST path, `x-model-id`, OpenAI-style JSON body,
//! or the KServe v2 gRPC ModelInferRequest.

use crate::names::Bypass;

pub const GRPC_MODEL_INFER_PATH: &str = "/inference.GRPCInferenceService/ModelInfer";
const OPENAI_PATHS: [&str; 3] = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"];
/// The OpenAI APIs whose answers are samples unless `temperature` is 0 or a `seed` is set.
const SAMPLING_PATHS: [&str; 2] = ["/v1/chat/completions", "/v1/completions"];

pub fn is_sampling_path(path: &str) -> bool {
    SAMPLING_PATHS.contains(&strip_query(path))
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelRef {
    pub name: String,
    pub version: String,
}

/// Where the model name will come from, decided from the request headers alone. The most
/// specific source wins: the path, then the body, then the `x-model-id` header; a request whose
/// sources disagree bypasses (see `request::key_request`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// KServe v2 REST path `/v2/models/{m}[/versions/{v}]/infer`.
    Path(ModelRef),
    /// OpenAI-style JSON body `"model"` (falls back to the header when the body has none).
    JsonBody,
    /// KServe v2 gRPC ModelInferRequest fields 1 and 2.
    GrpcBody,
    /// Only the `x-model-id` header names it.
    Header(ModelRef),
}

pub fn strip_query(path: &str) -> &str {
    path.split('?').next().unwrap_or(path)
}

/// `application/grpc`, `application/grpc+proto`, ... but not grpc-web (a different protocol).
pub fn is_grpc(content_type: Option<&str>) -> bool {
    content_type.map_or(false, |ct| {
        ct.strip_prefix("application/grpc").map_or(false, |rest| rest.is_empty() || rest.starts_with('+') || rest.starts_with(';'))
    })
}

pub fn is_grpc_web(content_type: Option<&str>) -> bool {
    content_type.map_or(false, |ct| ct.starts_with("application/grpc-web"))
}

pub fn is_model_infer(path: &str) -> bool {
    strip_query(path) == GRPC_MODEL_INFER_PATH
}

/// Classifies a POST from its headers; Ok(None) means "not an inference request we know", Err a
/// request for an inference path the filter cannot read the way the server routes it.
pub fn source_from_headers(path: &str, content_type: Option<&str>, model_header: Option<&str>) -> Result<Option<ModelSource>, Bypass> {
    let path = strip_query(path);
    if is_grpc(content_type) {
        if path == GRPC_MODEL_INFER_PATH {
            return Ok(Some(ModelSource::GrpcBody));
        }
        return if loosely_inference(path) { Err(Bypass::Path) } else { Ok(None) };
    }
    // A percent-encoded path is decoded by the server before it routes (uvicorn, Go's net/http):
    // `/v2/models/%6d/infer` is model `m` there. Not read here: such paths bypass below.
    if !path.contains('%') {
        if let Some(m) = kserve_rest_model(path) {
            return Ok(Some(ModelSource::Path(m)));
        }
        if OPENAI_PATHS.contains(&path) {
            return Ok(Some(ModelSource::JsonBody));
        }
    }
    if loosely_inference(path) {
        return Err(Bypass::Path);
    }
    Ok(model_header.filter(|m| !m.is_empty()).map(|name| ModelSource::Header(ModelRef { name: name.to_string(), version: String::new() })))
}

/// Whether a path is an inference path exactly as the servers route it (the method decides
/// what to do with it: a non-POST bypasses with `detail=method`).
pub fn is_inference_path(path: &str) -> bool {
    let path = strip_query(path);
    path == GRPC_MODEL_INFER_PATH || OPENAI_PATHS.contains(&path) || kserve_rest_model(path).is_some() || loosely_inference(path)
}

/// Whether some server could route `path` to an inference API: the path percent-decoded,
/// lowercased, with repeated slashes merged and a trailing slash dropped (what path
/// normalisation in routers and proxies may do) is one.
fn loosely_inference(path: &str) -> bool {
    let mut decoded: Vec<u8> = Vec::with_capacity(path.len());
    let bytes = path.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        let hex = |c: u8| (c as char).to_digit(16);
        if b == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                decoded.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        decoded.push(b.to_ascii_lowercase());
        i += 1;
    }
    let mut loose = String::with_capacity(decoded.len());
    for c in String::from_utf8_lossy(&decoded).chars() {
        if c == '/' && loose.ends_with('/') {
            continue;
        }
        loose.extend(c.to_lowercase());
    }
    while loose.len() > 1 && loose.ends_with('/') {
        loose.pop();
    }
    let loose = loose.as_str();
    loose == GRPC_MODEL_INFER_PATH.to_ascii_lowercase() || OPENAI_PATHS.contains(&loose) || kserve_rest_model(loose).is_some()
}

/// `/v2/models/{model}[/versions/{v}]/infer`
pub fn kserve_rest_model(path: &str) -> Option<ModelRef> {
    let rest = path.strip_prefix("/v2/models/")?;
    let parts: Vec<&str> = rest.split('/').collect();
    match parts.as_slice() {
        [name, "infer"] if !name.is_empty() => Some(ModelRef { name: name.to_string(), version: String::new() }),
        [name, "versions", v, "infer"] if !name.is_empty() && !v.is_empty() => {
            Some(ModelRef { name: name.to_string(), version: v.to_string() })
        }
        _ => None,
    }
}

/// The top-level `"model"` of a scanned JSON object: Ok(None) when there is none, Err when a
/// server could read it otherwise than the filter: repeated (Python's json keeps the last,
/// other parsers the first or reject), not a string, empty, or not decodable (a lone
/// surrogate, which Python decodes).
pub fn model_from_members(body: &[u8], members: &[crate::json::Member]) -> Result<Option<ModelRef>, Bypass> {
    let mut found = None;
    for m in members.iter().filter(|m| m.key_is(body, "model")) {
        if found.is_some() {
            return Err(Bypass::AmbiguousModel);
        }
        let raw = m.value_raw(body);
        if raw.first() != Some(&b'"') {
            return Err(Bypass::AmbiguousModel);
        }
        let name = crate::json::decode_string(raw).filter(|n| !n.is_empty()).ok_or(Bypass::AmbiguousModel)?;
        found = Some(ModelRef { name, version: String::new() });
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(name: &str, version: &str) -> ModelRef {
        ModelRef { name: name.into(), version: version.into() }
    }

    #[test]
    fn kserve_paths() {
        assert_eq!(kserve_rest_model("/v2/models/resnet/infer"), Some(m("resnet", "")));
        assert_eq!(kserve_rest_model("/v2/models/resnet/versions/3/infer"), Some(m("resnet", "3")));
        assert_eq!(kserve_rest_model("/v2/models/resnet"), None);
        assert_eq!(kserve_rest_model("/v2/models//infer"), None);
        assert_eq!(kserve_rest_model("/v2/models/a/versions//infer"), None);
    }

    #[test]
    fn sources() {
        let src = |p: &str, ct: Option<&str>, h: Option<&str>| source_from_headers(p, ct, h);
        assert_eq!(src("/v2/models/a/infer?x=1", Some("application/json"), None), Ok(Some(ModelSource::Path(m("a", "")))));
        assert_eq!(src("/v2/models/a/infer", None, Some("b")), Ok(Some(ModelSource::Path(m("a", "")))));
        assert_eq!(src("/v1/infer", None, Some("mlp")), Ok(Some(ModelSource::Header(m("mlp", "")))));
        assert_eq!(src("/v1/completions", None, Some("mlp")), Ok(Some(ModelSource::JsonBody)));
        assert_eq!(src("/v1/chat/completions", Some("application/json"), None), Ok(Some(ModelSource::JsonBody)));
        assert_eq!(src(GRPC_MODEL_INFER_PATH, Some("application/grpc"), None), Ok(Some(ModelSource::GrpcBody)));
        assert_eq!(src("/inference.GRPCInferenceService/ServerLive", Some("application/grpc"), None), Ok(None));
        assert_eq!(src("/upload", None, None), Ok(None));
        assert!(is_grpc(Some("application/grpc+proto")) && is_grpc(Some("application/grpc")));
        assert!(!is_grpc(Some("application/grpc-web")) && !is_grpc(Some("application/grpcx")));
        assert!(is_grpc_web(Some("application/grpc-web-text")));
    }

    #[test]
    fn inference_paths_spelled_otherwise_bypass() {
        // Whatever a router might normalise to an inference path is not read (x-model-id or not).
        for p in ["/v1/chat/completions/", "//v1/chat/completions", "/V1/Chat/Completions", "/v1//chat/completions",
                  "/v1/chat/%63ompletions", "/v1/chat/completions%2F", "/v2/models/%6d/infer", "/v2/models/m/infer/",
                  "/v2//models/m/infer", "/V2/models/m/infer", "/v1/embeddings//?x=1"] {
            assert_eq!(source_from_headers(p, None, Some("m")), Err(Bypass::Path), "{}", p);
            assert!(is_inference_path(p), "{}", p);
        }
        assert_eq!(source_from_headers("//inference.GRPCInferenceService/ModelInfer", Some("application/grpc"), None), Err(Bypass::Path));
        // Other paths are not inference paths, however spelled.
        for p in ["/v1/chat", "/v1/chat/completions/x", "/v2/models/m", "/%zz", "/%"] {
            assert_eq!(source_from_headers(p, None, None), Ok(None), "{}", p);
        }
        assert!(!is_inference_path("/v2/health/ready") && is_inference_path("/v2/models/m/versions/1/infer"));
    }

    fn json_model(body: &[u8]) -> Result<Option<ModelRef>, Bypass> {
        model_from_members(body, &crate::json::object_members(body).unwrap())
    }

    #[test]
    fn json_body_model() {
        assert_eq!(json_model(br#"{"model": "gpt-x", "messages": []}"#), Ok(Some(m("gpt-x", ""))));
        assert_eq!(json_model(br#"{"m\u006fdel": "gpt-\u0078"}"#), Ok(Some(m("gpt-x", ""))));
        assert_eq!(json_model(br#"{"messages": [{"model": "x"}]}"#), Ok(None));
        for ambiguous in [&br#"{"model": 3}"#[..], br#"{"model": ""}"#, br#"{"model": "a", "model": "b"}"#,
                          br#"{"model": "a", "model": "a"}"#, br#"{"model": null}"#, br#"{"model": ["a"]}"#,
                          br#"{"model": {"name": "a"}}"#, br#"{"model": true}"#, br#"{"model": "\ud800"}"#,
                          br#"{"model": "a", "mod\u0065l": "b"}"#] {
            assert_eq!(json_model(ambiguous), Err(Bypass::AmbiguousModel), "{}", String::from_utf8_lossy(ambiguous));
        }
    }

    #[test]
    fn the_body_model_is_the_one_python_json_reads_or_none() {
        // Differential: generated chat bodies (repeated and escaped `model` keys, odd types,
        // nested `model`s, whitespace). Whenever the filter reads a model, serde_json (keeping the
        // last of repeated keys, as Python's json does) reads exactly that string, from the only
        // top-level `model` member; whenever a body has one string `model`, the filter reads it.
        let keys = [r#""model""#, r#""mo\u0064el""#, r#""Model""#, r#""model ""#];
        let values = [r#""alpha""#, r#""be\u0074a""#, r#""""#, "3", "null", "true", r#"["a"]"#, r#"{"model":"x"}"#,
                      r#""\udc00""#, r#""\ud83d\ude00""#, r#""a\"b""#];
        let others = [r#""messages":[{"model":"beta"}]"#, r#""temperature":0"#, r#""user":"u""#, r#""n":{"model":"g"}"#];
        let ws = ["", " ", "\n", "\t "];
        let mut rng = crate::test_rng::Rng(0x5eed_2222);
        let (mut read, mut ambiguous) = (0, 0);
        for _ in 0..20_000 {
            let mut members: Vec<String> = Vec::new();
            let mut top_level_models = 0; // members whose key decodes to `model` (keys 0 and 1)
            for _ in 0..rng.index(3) {
                let k = rng.index(keys.len());
                top_level_models += (k < 2) as usize;
                members.push(format!("{}{}:{}{}", keys[k], ws[rng.index(ws.len())], ws[rng.index(ws.len())],
                                     values[rng.index(values.len())]));
            }
            for _ in 0..rng.index(3) {
                members.push(others[rng.index(others.len())].to_string());
            }
            let n = members.len();
            for i in (1..n).rev() {
                members.swap(i, rng.index(i + 1));
            }
            let body = format!("{}{{{}}}", ws[rng.index(ws.len())], members.join(","));
            let ours = match crate::json::object_members(body.as_bytes()) {
                Some(m) => model_from_members(body.as_bytes(), &m),
                None => continue,
            };
            let reference: serde_json::Map<String, serde_json::Value> = match serde_json::from_str(&body) {
                Ok(v) => v,
                Err(_) => continue, // lone surrogates: serde_json refuses, Python does not; we never read those
            };
            match ours {
                Ok(Some(m)) => {
                    read += 1;
                    assert_eq!(reference.get("model").and_then(|v| v.as_str()), Some(m.name.as_str()), "{}", body);
                    assert_eq!(top_level_models, 1, "{}", body);
                }
                Ok(None) => assert!(reference.get("model").is_none(), "{}", body),
                Err(_) => {
                    ambiguous += 1;
                    let plain = reference.get("model").and_then(|v| v.as_str()).map_or(false, |s| !s.is_empty());
                    let one_string = top_level_models == 1 && plain;
                    assert!(!one_string, "one plain model, yet ambiguous: {}", body);
                }
            }
        }
        assert!(read > 2000 && ambiguous > 2000, "{} {}", read, ambiguous);
    }

    #[test]
    fn sampling_paths() {
        assert!(is_sampling_path("/v1/chat/completions?x=1"));
        assert!(is_sampling_path("/v1/completions"));
        assert!(!is_sampling_path("/v1/embeddings"));
    }
}
