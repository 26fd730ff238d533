//! The OpenAI `usage` of a stored answer: what every later hit from it saves (issue 38, "tokens
//! saved"). A JSON answer carries `usage` at its top level; a stream carries it in its last
//! chunk when the request set `stream_options.include_usage` (otherwise it has none: 0 tokens).

use crate::sse;
use serde_json::Value;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
}

/// The answer's usage (zero when it has none or is not an OpenAI-shaped JSON or SSE body).
pub fn of_answer(content_type: Option<&str>, body: &[u8]) -> Usage {
    // Most answers (KServe tensors, embeddings without usage) are not parsed at all.
    if !contains(body, b"\"usage\"") {
        return Usage::default();
    }
    if sse::is_event_stream(content_type) {
        let mut last = Usage::default();
        sse::for_each_data(body, |data| {
            if data.first() == Some(&b'{') {
                if let Some(u) = serde_json::from_slice::<Value>(data).ok().as_ref().and_then(usage_member) {
                    last = u;
                }
            }
        });
        return last;
    }
    let json = content_type.map_or(false, |ct| {
        let media = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        media == "application/json" || media.ends_with("+json")
    });
    if !json {
        return Usage::default();
    }
    serde_json::from_slice::<Value>(body).ok().as_ref().and_then(usage_member).unwrap_or_default()
}

fn usage_member(doc: &Value) -> Option<Usage> {
    let u = doc.get("usage")?.as_object()?;
    let n = |k: &str| u.get(k).and_then(Value::as_u64).map_or(0, |v| v.min(u32::MAX as u64) as u32);
    Some(Usage { prompt_tokens: n("prompt_tokens"), completion_tokens: n("completion_tokens") })
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_and_stream_usage() {
        let json = br#"{"id":"x","choices":[],"usage":{"prompt_tokens":27,"completion_tokens":12,"total_tokens":39}}"#;
        assert_eq!(of_answer(Some("application/json"), json), Usage { prompt_tokens: 27, completion_tokens: 12 });
        assert_eq!(of_answer(Some("application/json; charset=utf-8"), json).prompt_tokens, 27);
        // Not JSON, no usage, usage of the wrong shape: nothing saved.
        assert_eq!(of_answer(Some("text/plain"), json), Usage::default());
        assert_eq!(of_answer(Some("application/json"), br#"{"outputs":[]}"#), Usage::default());
        assert_eq!(of_answer(Some("application/json"), br#"{"usage":null}"#), Usage::default());
        assert_eq!(of_answer(Some("application/json"), br#"{"usage":{"prompt_tokens":-1,"completion_tokens":2}}"#),
                   Usage { prompt_tokens: 0, completion_tokens: 2 });
        // A `usage` nested deeper is not the answer's.
        assert_eq!(of_answer(Some("application/json"), br#"{"x":{"usage":{"prompt_tokens":5}}}"#), Usage::default());
        let stream = concat!(
            "data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":27,\"completion_tokens\":12}}\r\n\r\n",
            ": comment\n\ndata: [DONE]\n\n"
        );
        assert_eq!(of_answer(Some("text/event-stream"), stream.as_bytes()), Usage { prompt_tokens: 27, completion_tokens: 12 });
        let no_usage = "data: {\"choices\":[{\"delta\":{\"content\":\"usage\"}}]}\n\ndata: [DONE]\n\n";
        assert_eq!(of_answer(Some("text/event-stream"), no_usage.as_bytes()), Usage::default());
        // An event never dispatched (no blank line after it) does not count.
        let cut = "data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\n";
        assert_eq!(of_answer(Some("text/event-stream"), cut.as_bytes()), Usage::default());
    }
}
