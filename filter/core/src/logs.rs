//! The lines the filter writes to Envoy's log, the same on both hosts. Bounded: no body bytes,
//! each value cut to `MAX_VALUE_CHARS` with anything but printable ASCII replaced, so a
//! request cannot forge or flood log lines.

use crate::headermap;
use crate::model;
use crate::names::{Bypass, MODEL_HEADER};

/// Longest value (model, path) a log line carries, in characters.
pub const MAX_VALUE_CHARS: usize = 128;

/// Why the cache stayed out of a request (Envoy's debug level: one line per bypass, quiet at
/// info): the `detail` its `Cache-Status` names, the model the headers name (`x-model-id`, or
/// the KServe path's; `-` when only the body names it) and the path without its query.
pub fn bypass_line(why: Bypass, request: &[(String, String)]) -> String {
    let path = model::strip_query(headermap::header(request, ":path").unwrap_or(""));
    let named = headermap::header(request, MODEL_HEADER).map(str::to_string);
    let model = named.or_else(|| model::kserve_rest_model(path).map(|m| m.name));
    format!(
        "meshcache: bypass detail={} model={} path={}",
        why.detail(),
        bounded(model.as_deref().unwrap_or("-")),
        bounded(path)
    )
}

fn bounded(value: &str) -> String {
    let mut out: String =
        value.chars().take(MAX_VALUE_CHARS).map(|c| if c.is_ascii_graphic() { c } else { '?' }).collect();
    if value.chars().nth(MAX_VALUE_CHARS).is_some() {
        out.push_str("...");
    }
    if out.is_empty() {
        out.push('-');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter().map(|(n, v)| (n.to_string(), v.to_string())).collect()
    }

    #[test]
    fn says_the_reason_model_and_path() {
        let r = pairs(&[(":path", "/v2/models/m1/infer?token=secret"), ("content-type", "application/json")]);
        assert_eq!(bypass_line(Bypass::NoPolicy, &r), "meshcache: bypass detail=no-policy model=m1 path=/v2/models/m1/infer");
        let r = pairs(&[(":path", "/v1/chat/completions"), ("x-model-id", "chat-a")]);
        assert_eq!(bypass_line(Bypass::RepeatedHeader, &r), "meshcache: bypass detail=repeated-header model=chat-a path=/v1/chat/completions");
        let r = pairs(&[(":path", "/v1/chat/completions")]);
        assert_eq!(bypass_line(Bypass::NoModel, &r), "meshcache: bypass detail=no-model model=- path=/v1/chat/completions");
    }

    #[test]
    fn values_are_bounded_and_cannot_break_the_line() {
        let long = "m".repeat(10_000);
        let r = pairs(&[(":path", "/v2/models/x/infer"), ("x-model-id", &long)]);
        let line = bypass_line(Bypass::Credentials, &r);
        assert!(line.len() < 300, "{}", line.len());
        assert!(line.contains(&format!("model={}...", "m".repeat(MAX_VALUE_CHARS))));
        let r = pairs(&[(":path", "/v2/models/a\nfake line/infer"), ("x-model-id", "é\r\n")]);
        let line = bypass_line(Bypass::Method, &r);
        assert!(!line.contains('\n') && !line.contains('\r'), "{:?}", line);
        assert!(line.contains("model=???"), "{:?}", line);
    }
}
