//! Whether a streamed (`text/event-stream`) answer is complete enough to store: OpenAI-style
//! streams end with a `data: [DONE]` event, and a server that fails mid-stream sends an event
//! whose data is `{"error": {...}}` on a 200 it can no longer change. A truncated stream or one
//! carrying an error passes through to its client but is not stored (it would be replayed to
//! every identical request for the TTL).
//!
//! Events are read per the SSE spec (WHATWG HTML §9.2.6): lines end with CRLF, LF or CR; a
//! blank line dispatches the event; `data` lines are joined with LF; comments (`:`) and other
//! fields do not count.

use crate::cache_control::NotStored;
use crate::json;

/// A content type that is an event stream (parameters and case aside).
pub fn is_event_stream(content_type: Option<&str>) -> bool {
    content_type.map_or(false, |ct| {
        let media = ct.split(';').next().unwrap_or("").trim();
        media.eq_ignore_ascii_case("text/event-stream")
    })
}

/// Ok when `body` ends with a dispatched `data: [DONE]` event (nothing after it but blank
/// lines or comments) and no event's data is a JSON object with a top-level `error` member.
pub fn check_complete(body: &[u8]) -> Result<(), NotStored> {
    let mut data: Vec<u8> = Vec::new();
    let mut has_data = false;
    let mut done = false;
    // Bytes of the current, not yet dispatched, event (a field line was seen).
    let mut pending = false;
    let mut at = 0;
    while at < body.len() {
        let rest = &body[at..];
        let end = match rest.iter().position(|b| *b == b'\n' || *b == b'\r') {
            Some(e) => e,
            // A last line without its end: the stream was cut.
            None => return Err(NotStored::StreamIncomplete),
        };
        let line = &rest[..end];
        let eol = if rest[end] == b'\r' && rest.get(end + 1) == Some(&b'\n') { 2 } else { 1 };
        at += end + eol;
        if line.is_empty() {
            if has_data {
                if done {
                    // An event after `[DONE]`: not the stream's end.
                    done = false;
                }
                if data == b"[DONE]" {
                    done = true;
                } else if is_error_event(&data) {
                    return Err(NotStored::StreamError);
                }
            }
            data.clear();
            has_data = false;
            pending = false;
            continue;
        }
        if line[0] == b':' {
            continue;
        }
        pending = true;
        let (field, value) = match line.iter().position(|b| *b == b':') {
            Some(c) => {
                let v = &line[c + 1..];
                (&line[..c], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        if field == b"data" {
            if has_data {
                data.push(b'\n');
            }
            data.extend_from_slice(value);
            has_data = true;
        }
    }
    if pending || !done {
        return Err(NotStored::StreamIncomplete);
    }
    Ok(())
}

/// Calls `f` with each dispatched event's data (its `data` lines joined with LF), in order; an
/// event not ended by a blank line is not dispatched (the same reading as `check_complete`).
pub fn for_each_data<F: FnMut(&[u8])>(body: &[u8], mut f: F) {
    let mut data: Vec<u8> = Vec::new();
    let mut has_data = false;
    let mut at = 0;
    while at < body.len() {
        let rest = &body[at..];
        let end = match rest.iter().position(|b| *b == b'\n' || *b == b'\r') {
            Some(e) => e,
            None => return,
        };
        let line = &rest[..end];
        at += end + if rest[end] == b'\r' && rest.get(end + 1) == Some(&b'\n') { 2 } else { 1 };
        if line.is_empty() {
            if has_data {
                f(&data);
            }
            data.clear();
            has_data = false;
        } else if let Some(value) = line.strip_prefix(b"data") {
            if value.is_empty() || value[0] == b':' {
                let v = value.get(1..).unwrap_or(b"");
                if has_data {
                    data.push(b'\n');
                }
                data.extend_from_slice(v.strip_prefix(b" ").unwrap_or(v));
                has_data = true;
            }
        }
    }
}

/// The error shape OpenAI-compatible servers send in a stream: a JSON object with `error`.
fn is_error_event(data: &[u8]) -> bool {
    let trimmed = trim(data);
    if trimmed.first() != Some(&b'{') {
        return false;
    }
    match json::object_members(trimmed) {
        Some(members) => members.iter().any(|m| m.key_is(trimmed, "error")),
        None => false,
    }
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b.iter().position(|c| !c.is_ascii_whitespace()).unwrap_or(b.len());
    let end = b.iter().rposition(|c| !c.is_ascii_whitespace()).map_or(start, |e| e + 1);
    &b[start..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHUNK: &str = r#"data: {"id":"c","choices":[{"delta":{"content":"hi"}}]}"#;

    #[test]
    fn only_a_stream_ending_with_done_and_without_error_is_complete() {
        let ok = format!("{}\n\ndata: [DONE]\n\n", CHUNK);
        assert_eq!(check_complete(ok.as_bytes()), Ok(()));
        assert_eq!(check_complete(ok.replace('\n', "\r\n").as_bytes()), Ok(()));
        assert_eq!(check_complete(ok.replace('\n', "\r").as_bytes()), Ok(()));
        // Comments and `event:`/`id:` fields are not data; a comment after [DONE] is fine.
        assert_eq!(check_complete(format!(": ping\n\nid: 1\n{}\n\ndata:[DONE]\n\n: bye\n", CHUNK).as_bytes()), Ok(()));
        let incomplete: Vec<String> = vec![
            String::new(),
            format!("{}\n\n", CHUNK),                      // no [DONE]
            format!("{}\n\ndata: [DONE]\n", CHUNK),        // [DONE] not dispatched
            format!("{}\n\ndata: [DONE]", CHUNK),          // cut mid-line
            format!("{}\n\ndata: [DONE]\n\n{}\n\n", CHUNK, CHUNK), // events after [DONE]
            format!("{}\n\ndata: [DONE]\n\ndata: x", CHUNK),
            format!("{}\n\ndata: [DONE] \n\n", CHUNK),     // not exactly [DONE]
            format!("{}\n\ndata: [DONE]\ndata: x\n\n", CHUNK), // one event "[DONE]\nx"
        ];
        for body in incomplete {
            assert_eq!(check_complete(body.as_bytes()), Err(NotStored::StreamIncomplete), "{:?}", body);
        }
        let errors = [
            format!("{}\n\ndata: {{\"error\": {{\"message\": \"overloaded\"}}}}\n\ndata: [DONE]\n\n", CHUNK),
            "data: {\"error\":null}\r\n\r\n".to_string(),
            // Split over data lines, joined with LF: still one JSON object.
            format!("data: {{\ndata: \"error\": \"x\"}}\n\n{}\n\ndata: [DONE]\n\n", CHUNK),
        ];
        for body in errors.iter() {
            assert_eq!(check_complete(body.as_bytes()), Err(NotStored::StreamError), "{:?}", body);
        }
        // `error` nested, or in a string: not an error event.
        let nested = format!("data: {{\"choices\":[{{\"error\":1}}],\"x\":\"error\"}}\n\n{}\n\ndata: [DONE]\n\n", CHUNK);
        assert_eq!(check_complete(nested.as_bytes()), Ok(()));
    }

    #[test]
    fn event_stream_content_types() {
        assert!(is_event_stream(Some("text/event-stream")));
        assert!(is_event_stream(Some("Text/Event-Stream; charset=utf-8")));
        assert!(!is_event_stream(Some("application/json")));
        assert!(!is_event_stream(Some("text/event-streamx")));
        assert!(!is_event_stream(None));
    }
}
