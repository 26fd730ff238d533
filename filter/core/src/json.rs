//! A bounded, validating scanner for the top level of a JSON object body.
//!
//! The cache key needs to find and leave out a few top-level members (the KServe request `id`,
//! a policy's `ignore_fields`) and read a few values (`model`, `temperature`, `seed`) without
//! building a document tree. The whole body is validated (RFC 8259 grammar, UTF-8, nesting depth
//! at most `MAX_DEPTH`), so member boundaries are exactly the ones the inference server's parser
//! sees; anything else is "unparsable" and the caller bypasses the cache.

/// Deeper documents are not scanned (the request bypasses); keeps the recursion bounded.
pub const MAX_DEPTH: usize = 128;
/// More top-level members than this are not scanned (the request bypasses).
pub const MAX_MEMBERS: usize = 4096;

/// One top-level `"key": value` member, as byte offsets into the scanned buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    /// The key's opening quote: the member starts here.
    pub start: usize,
    /// Just past the key's closing quote.
    pub key_end: usize,
    /// The value's first byte.
    pub value_start: usize,
    /// Just past the value's last byte: the member ends here.
    pub end: usize,
}

impl Member {
    pub fn key_raw<'a>(&self, buf: &'a [u8]) -> &'a [u8] {
        &buf[self.start..self.key_end]
    }
    pub fn value_raw<'a>(&self, buf: &'a [u8]) -> &'a [u8] {
        &buf[self.value_start..self.end]
    }
    /// Whether the key, with its escapes decoded, is `name` (`"\u0069d"` is `"id"`).
    pub fn key_is(&self, buf: &[u8], name: &str) -> bool {
        let raw = self.key_raw(buf);
        let inner = &raw[1..raw.len() - 1];
        if !inner.contains(&b'\\') {
            return inner == name.as_bytes();
        }
        decode_string(raw).map_or(false, |k| k == name)
    }
}

/// The members of a JSON object document, or None if `buf` is not exactly one valid object.
pub fn object_members(buf: &[u8]) -> Option<Vec<Member>> {
    if std::str::from_utf8(buf).is_err() {
        return None;
    }
    let mut s = Scanner { buf, pos: 0 };
    s.ws();
    s.expect(b'{')?;
    let mut members = Vec::new();
    s.ws();
    if s.peek() == Some(b'}') {
        s.pos += 1;
    } else {
        loop {
            if members.len() >= MAX_MEMBERS {
                return None;
            }
            let start = s.pos;
            s.string()?;
            let key_end = s.pos;
            s.ws();
            s.expect(b':')?;
            s.ws();
            let value_start = s.pos;
            s.value(1)?;
            members.push(Member { start, key_end, value_start, end: s.pos });
            s.ws();
            match s.next()? {
                b',' => s.ws(),
                b'}' => break,
                _ => return None,
            }
        }
    }
    s.ws();
    if s.pos != buf.len() {
        return None;
    }
    Some(members)
}

struct Scanner<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Scanner<'a> {
    fn peek(&self) -> Option<u8> {
        self.buf.get(self.pos).copied()
    }
    fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.pos += 1;
        Some(b)
    }
    fn expect(&mut self, want: u8) -> Option<()> {
        if self.next()? == want {
            Some(())
        } else {
            None
        }
    }
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }
    fn literal(&mut self, word: &[u8]) -> Option<()> {
        if self.buf.get(self.pos..self.pos + word.len())? == word {
            self.pos += word.len();
            Some(())
        } else {
            None
        }
    }

    fn value(&mut self, depth: usize) -> Option<()> {
        match self.peek()? {
            b'"' => self.string(),
            b'{' => self.container(depth, b'}', true),
            b'[' => self.container(depth, b']', false),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn container(&mut self, depth: usize, close: u8, object: bool) -> Option<()> {
        if depth >= MAX_DEPTH {
            return None;
        }
        self.pos += 1;
        self.ws();
        if self.peek() == Some(close) {
            self.pos += 1;
            return Some(());
        }
        loop {
            if object {
                self.string()?;
                self.ws();
                self.expect(b':')?;
                self.ws();
            }
            self.value(depth + 1)?;
            self.ws();
            match self.next()? {
                b',' => self.ws(),
                b if b == close => return Some(()),
                _ => return None,
            }
        }
    }

    fn string(&mut self) -> Option<()> {
        self.expect(b'"')?;
        loop {
            // Most string bytes need no attention: skip to the next quote, backslash or control
            // byte in one tight loop (answers are mostly long strings or numbers).
            let rest = self.buf.get(self.pos..)?;
            self.pos += rest.iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
            match self.next()? {
                b'"' => return Some(()),
                b'\\' => match self.next()? {
                    b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                    b'u' => {
                        let hex = self.buf.get(self.pos..self.pos + 4)?;
                        if !hex.iter().all(u8::is_ascii_hexdigit) {
                            return None;
                        }
                        self.pos += 4;
                    }
                    _ => return None,
                },
                0..=0x1f => return None,
                _ => {}
            }
        }
    }

    fn digits(&mut self) -> usize {
        let start = self.pos;
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
        self.pos - start
    }

    fn number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.peek()? {
            b'0' => self.pos += 1,
            b'1'..=b'9' => {
                self.digits();
            }
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            if self.digits() == 0 {
                return None;
            }
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            if self.digits() == 0 {
                return None;
            }
        }
        Some(())
    }
}

/// Decodes a raw JSON string token (with its quotes) that `object_members` validated.
/// None for lone surrogates (not representable as a Rust string).
pub fn decode_string(raw: &[u8]) -> Option<String> {
    let inner = raw.get(1..raw.len().checked_sub(1)?)?;
    let text = std::str::from_utf8(inner).ok()?;
    if !text.contains('\\') {
        return Some(text.to_string());
    }
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next()? {
            '"' => out.push('"'),
            '\\' => out.push('\\'),
            '/' => out.push('/'),
            'b' => out.push('\u{8}'),
            'f' => out.push('\u{c}'),
            'n' => out.push('\n'),
            'r' => out.push('\r'),
            't' => out.push('\t'),
            'u' => {
                let hi = hex4(&mut chars)?;
                let code = if (0xd800..0xdc00).contains(&hi) {
                    if chars.next()? != '\\' || chars.next()? != 'u' {
                        return None;
                    }
                    let lo = hex4(&mut chars)?;
                    if !(0xdc00..0xe000).contains(&lo) {
                        return None;
                    }
                    0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00)
                } else {
                    hi
                };
                out.push(char::from_u32(code)?);
            }
            _ => return None,
        }
    }
    Some(out)
}

fn hex4(chars: &mut std::str::Chars) -> Option<u32> {
    let mut v = 0;
    for _ in 0..4 {
        v = v * 16 + chars.next()?.to_digit(16)?;
    }
    Some(v)
}

/// The body with the members marked in `drop` left out, as slices of `buf` in order. Each kept
/// member keeps the separator that followed it; the last kept member is followed by the
/// document's closing part, so `{"a":1,"id":"x"}` and `{"id":"x","a":1}` both become `{"a":1}`.
pub fn without_members<'a>(buf: &'a [u8], members: &[Member], drop: &[bool]) -> Vec<&'a [u8]> {
    let mut parts: Vec<&'a [u8]> = Vec::new();
    let push = |parts: &mut Vec<&'a [u8]>, start: usize, end: usize| {
        if start >= end {
            return;
        }
        // Adjacent ranges merge into one slice, so an unchanged body stays a single part.
        if let Some(last) = parts.last_mut() {
            let last_end = last.as_ptr() as usize - buf.as_ptr() as usize + last.len();
            if last_end == start {
                *last = &buf[start - last.len()..end];
                return;
            }
        }
        parts.push(&buf[start..end]);
    };
    let first = match members.first() {
        Some(m) => m.start,
        None => return vec![buf],
    };
    let tail = members.last().map_or(first, |m| m.end);
    push(&mut parts, 0, first);
    let kept: Vec<usize> = (0..members.len()).filter(|i| !drop.get(*i).copied().unwrap_or(false)).collect();
    for (n, &i) in kept.iter().enumerate() {
        let m = &members[i];
        if n + 1 < kept.len() {
            // The member and the separator after it, up to the next member's key.
            let next_start = members.get(i + 1).map_or(m.end, |x| x.start);
            push(&mut parts, m.start, next_start);
        } else {
            push(&mut parts, m.start, m.end);
        }
    }
    push(&mut parts, tail, buf.len());
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(buf: &[u8]) -> Vec<String> {
        object_members(buf).unwrap().iter().map(|m| decode_string(m.key_raw(buf)).unwrap()).collect()
    }

    fn joined(parts: &[&[u8]]) -> String {
        String::from_utf8(parts.concat()).unwrap()
    }

    #[test]
    fn members_and_spans() {
        let buf = br#" { "a" : 1, "id":"x\"y" ,"n":{"id":[1,{"b":null}]},"z":-0.5e+3 } "#;
        let m = object_members(buf).unwrap();
        assert_eq!(keys(buf), vec!["a", "id", "n", "z"]);
        assert_eq!(m[1].value_raw(buf), br#""x\"y""#);
        assert_eq!(m[2].value_raw(buf), br#"{"id":[1,{"b":null}]}"#);
        assert_eq!(m[3].value_raw(buf), b"-0.5e+3");
        assert!(m[1].key_is(buf, "id") && !m[2].key_is(buf, "id"));
        assert_eq!(object_members(b"{}").unwrap(), vec![]);
    }

    #[test]
    fn escaped_keys_decode() {
        let buf = br#"{"\u0069d": "a", "i\u0064x": 1, "\ud83d\ude00": 2}"#;
        let m = object_members(buf).unwrap();
        assert!(m[0].key_is(buf, "id"));
        assert!(!m[1].key_is(buf, "id"));
        assert_eq!(decode_string(m[2].key_raw(buf)).unwrap(), "\u{1f600}");
        assert_eq!(decode_string(br#""\ud800""#), None, "lone surrogate");
        assert_eq!(decode_string(br#""a\/b\n\u00e9""#).unwrap(), "a/b\n\u{e9}");
    }

    #[test]
    fn invalid_documents_are_rejected() {
        let bad: [&[u8]; 22] = [
            b"", b"[]", b"\"s\"", b"{", b"{\"a\"}", b"{\"a\":}", b"{\"a\":1,}", b"{,}", b"{\"a\":1} x",
            b"{\"a\":01}", b"{\"a\":1.}", b"{\"a\":.5}", b"{\"a\":1e}", b"{\"a\":NaN}", b"{\"a\":tru}",
            b"{\"a\":\"\x01\"}", b"{\"a\":\"\\x\"}", b"{\"a\":\"\\u12g4\"}", b"{\"a\":[1,]}", b"{\"a\":{\"b\"}}",
            b"{\"a\":\"\xff\"}", b"{'a':1}",
        ];
        for b in bad.iter() {
            assert_eq!(object_members(b), None, "{:?}", String::from_utf8_lossy(b));
        }
    }

    #[test]
    fn depth_and_width_are_bounded() {
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert_eq!(object_members(deep.as_bytes()), None);
        let ok = format!("{{\"a\":{}{}}}", "[".repeat(MAX_DEPTH - 2), "]".repeat(MAX_DEPTH - 2));
        assert!(object_members(ok.as_bytes()).is_some());
        let wide = format!("{{{}}}", (0..=MAX_MEMBERS).map(|i| format!("\"k{}\":0", i)).collect::<Vec<_>>().join(","));
        assert_eq!(object_members(wide.as_bytes()), None);
        // Truncation at every byte of a valid body is rejected, never a panic.
        let body = br#"{"id":"abc","inputs":[{"name":"x","data":[1.5,"\u00e9",true]}]}"#;
        for n in 0..body.len() {
            assert_eq!(object_members(&body[..n]), None);
        }
    }

    #[test]
    fn removal_is_canonical() {
        let cases: [(&[u8], &str); 6] = [
            (br#"{"id":"x","a":1}"#, r#"{"a":1}"#),
            (br#"{"a":1,"id":"x"}"#, r#"{"a":1}"#),
            (br#"{"a":1,"id":"x","b":2}"#, r#"{"a":1,"b":2}"#),
            (br#"{"a": 1, "id": "x", "b": 2}"#, r#"{"a": 1, "b": 2}"#),
            (br#"{ "id": "x" }"#, r#"{  }"#),
            (br#"{"a":1 , "id":"x" }"#, r#"{"a":1 }"#),
        ];
        for (body, want) in cases.iter() {
            let m = object_members(body).unwrap();
            let drop: Vec<bool> = m.iter().map(|x| x.key_is(body, "id")).collect();
            assert_eq!(joined(&without_members(body, &m, &drop)), *want);
        }
        let body = br#"{"user":"u","a":1,"metadata":{"k":1},"b":2,"user":"v"}"#;
        let m = object_members(body).unwrap();
        let drop: Vec<bool> = m.iter().map(|x| x.key_is(body, "user") || x.key_is(body, "metadata")).collect();
        assert_eq!(joined(&without_members(body, &m, &drop)), r#"{"a":1,"b":2}"#);
        let nothing = vec![false; m.len()];
        assert_eq!(without_members(body, &m, &nothing), vec![&body[..]], "an unchanged body stays one slice");
    }

    use crate::test_rng::Rng;

    #[test]
    fn agrees_with_serde_json_on_mutated_bodies() {
        // Differential check: byte-level mutations of valid bodies. Whenever serde_json (a
        // reference RFC 8259 parser) accepts an object, the scanner does, with the same keys in
        // the same order; whenever the scanner accepts, serde_json does. Never a panic.
        let seeds: [&[u8]; 4] = [
            br#"{"id":"a-1","inputs":[{"name":"x","shape":[1,2],"datatype":"FP32","data":[1.5,-2e3]}]}"#,
            br#"{"model": "gpt", "messages": [{"role": "user", "content": "h\u00e9\"llo"}], "temperature": 0.0, "seed": null}"#,
            br#" { "a" : { "b" : [ true , false , null ] } , "id" : "\\x" } "#,
            br#"{"\u0069d":"z","k":{"id":"nested"},"n":-0.5E+3}"#,
        ];
        let alphabet = b"{}[]:,\"\\ 0123456789.-+eEtrufalsnid\x01\xc3\xa9u";
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut accepted = 0;
        for i in 0..20_000 {
            let mut body = seeds[i % seeds.len()].to_vec();
            for _ in 0..1 + rng.index(3) {
                let at = rng.index(body.len() + 1);
                match rng.index(3) {
                    0 if at < body.len() => {
                        body.remove(at);
                    }
                    1 => body.insert(at, alphabet[rng.index(alphabet.len())]),
                    _ if at < body.len() => body[at] = alphabet[rng.index(alphabet.len())],
                    _ => {}
                }
            }
            let ours = object_members(&body);
            let reference: Option<serde_json::Map<String, serde_json::Value>> =
                serde_json::from_slice::<serde_json::Value>(&body).ok().and_then(|v| v.as_object().cloned());
            match (&ours, &reference) {
                (Some(m), Some(_)) => {
                    accepted += 1;
                    // serde_json keeps the last duplicate; compare the distinct keys in order.
                    let keys: Vec<String> = m.iter().map(|x| decode_string(x.key_raw(&body)).unwrap_or_default()).collect();
                    let raw: serde_json::Value = serde_json::from_slice(&body).unwrap();
                    for k in &keys {
                        assert!(raw.get(k).is_some() || k.is_empty(), "{:?}", String::from_utf8_lossy(&body));
                    }
                }
                (None, None) => {}
                _ => panic!("disagree on {:?}: ours {:?}", String::from_utf8_lossy(&body), ours.is_some()),
            }
        }
        assert!(accepted > 1000, "the mutations keep enough bodies valid to mean something: {}", accepted);
    }
}
