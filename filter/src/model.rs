//! Which model a request is for: KServe v2 REST path, `x-model-id`, OpenAI-style JSON body,
//! or the KServe v2 gRPC ModelInferRequest.

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
/// sources disagree bypasses (see `decide::on_body`).
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

/// Classifies a POST from its headers; None means "not an inference request we know".
pub fn source_from_headers(path: &str, content_type: Option<&str>, model_header: Option<&str>) -> Option<ModelSource> {
    let path = strip_query(path);
    if is_grpc(content_type) {
        return if path == GRPC_MODEL_INFER_PATH { Some(ModelSource::GrpcBody) } else { None };
    }
    if let Some(m) = kserve_rest_model(path) {
        return Some(ModelSource::Path(m));
    }
    if OPENAI_PATHS.contains(&path) {
        return Some(ModelSource::JsonBody);
    }
    if let Some(name) = model_header.filter(|m| !m.is_empty()) {
        return Some(ModelSource::Header(ModelRef { name: name.to_string(), version: String::new() }));
    }
    None
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

/// The top-level `"model"` string of a scanned JSON object (one, non-empty).
pub fn model_from_members(body: &[u8], members: &[crate::json::Member]) -> Option<ModelRef> {
    let mut found = None;
    for m in members.iter().filter(|m| m.key_is(body, "model")) {
        if found.is_some() {
            return None; // parsers disagree on which duplicate wins
        }
        let raw = m.value_raw(body);
        if raw.first() != Some(&b'"') {
            return None;
        }
        found = Some(crate::json::decode_string(raw)?);
    }
    found.filter(|n| !n.is_empty()).map(|name| ModelRef { name, version: String::new() })
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
        assert_eq!(source_from_headers("/v2/models/a/infer?x=1", Some("application/json"), None), Some(ModelSource::Path(m("a", ""))));
        assert_eq!(source_from_headers("/v2/models/a/infer", None, Some("b")), Some(ModelSource::Path(m("a", ""))));
        assert_eq!(source_from_headers("/v1/infer", None, Some("mlp")), Some(ModelSource::Header(m("mlp", ""))));
        assert_eq!(source_from_headers("/v1/completions", None, Some("mlp")), Some(ModelSource::JsonBody));
        assert_eq!(source_from_headers("/v1/chat/completions", Some("application/json"), None), Some(ModelSource::JsonBody));
        assert_eq!(source_from_headers(GRPC_MODEL_INFER_PATH, Some("application/grpc"), None), Some(ModelSource::GrpcBody));
        assert_eq!(source_from_headers("/inference.GRPCInferenceService/ServerLive", Some("application/grpc"), None), None);
        assert_eq!(source_from_headers("/upload", None, None), None);
        assert!(is_grpc(Some("application/grpc+proto")) && is_grpc(Some("application/grpc")));
        assert!(!is_grpc(Some("application/grpc-web")) && !is_grpc(Some("application/grpcx")));
        assert!(is_grpc_web(Some("application/grpc-web-text")));
    }

    fn json_model(body: &[u8]) -> Option<ModelRef> {
        model_from_members(body, &crate::json::object_members(body)?)
    }

    #[test]
    fn json_body_model() {
        assert_eq!(json_model(br#"{"model": "gpt-x", "messages": []}"#), Some(m("gpt-x", "")));
        assert_eq!(json_model(br#"{"m\u006fdel": "gpt-\u0078"}"#), Some(m("gpt-x", "")));
        assert_eq!(json_model(br#"{"messages": [{"model": "x"}]}"#), None);
        assert_eq!(json_model(br#"{"model": 3}"#), None);
        assert_eq!(json_model(br#"{"model": ""}"#), None);
        assert_eq!(json_model(br#"{"model": "a", "model": "b"}"#), None);
        assert_eq!(json_model(b"not json"), None);
    }

    #[test]
    fn sampling_paths() {
        assert!(is_sampling_path("/v1/chat/completions?x=1"));
        assert!(is_sampling_path("/v1/completions"));
        assert!(!is_sampling_path("/v1/embeddings"));
    }
}
