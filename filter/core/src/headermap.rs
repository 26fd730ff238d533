//! The ABI's serialized header map format (little-endian lengths, NUL-separated bytes).

/// A decoded header map. HTTP header values are bytes; the filter works with text, so values
/// that are not UTF-8 are kept lossily converted and their names listed in `not_utf8`: anything
/// that compares or replays those headers must not trust the text (keys bypass, answers with
/// them are not stored), so two different byte strings never collapse into one.
#[derive(Debug, Default, PartialEq)]
pub struct Headers {
    pub pairs: Vec<(String, String)>,
    /// Lowercase names whose name or value was not valid UTF-8.
    pub not_utf8: Vec<String>,
}

pub fn decode_headers(b: &[u8]) -> Headers {
    let mut not_utf8 = Vec::new();
    let pairs = deserialize_with(b, &mut |name: &str| not_utf8.push(name.to_ascii_lowercase()));
    Headers { pairs, not_utf8 }
}


/// The first value of a header (lowercase `name`, compared case-insensitively).
pub fn header<'h>(headers: &'h [(String, String)], name: &str) -> Option<&'h str> {
    headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

/// Every value of a header, in order (a repeated header is several lines).
pub fn values<'h>(headers: &'h [(String, String)], name: &str) -> Vec<&'h str> {
    headers.iter().filter(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str()).collect()
}

/// All lines of a list-valued header joined with "," (RFC 9110 §5.3), None when absent.
pub fn joined(headers: &[(String, String)], name: &str) -> Option<String> {
    let v = values(headers, name);
    if v.is_empty() {
        None
    } else {
        Some(v.join(","))
    }
}

/// Decodes the ABI's serialized map: count, (key_len, value_len)*, then NUL-terminated bytes.
pub fn deserialize_map(b: &[u8]) -> Vec<(String, String)> {
    deserialize_with(b, &mut |_: &str| {})
}

fn deserialize_with(b: &[u8], lossy: &mut dyn FnMut(&str)) -> Vec<(String, String)> {
    let u32_at = |i: usize| -> Option<usize> {
        b.get(i..i + 4).map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]) as usize)
    };
    let n = match u32_at(0) {
        Some(n) => n,
        None => return Vec::new(),
    };
    let mut out = Vec::with_capacity(n);
    let mut data = 4 + n * 8;
    for i in 0..n {
        let (kl, vl) = match (u32_at(4 + i * 8), u32_at(8 + i * 8)) {
            (Some(k), Some(v)) => (k, v),
            _ => return out,
        };
        let (kb, vb) = match (b.get(data..data + kl), b.get(data + kl + 1..data + kl + 1 + vl)) {
            (Some(k), Some(v)) => (k, v),
            _ => return out,
        };
        let k = String::from_utf8_lossy(kb).into_owned();
        if std::str::from_utf8(kb).is_err() || std::str::from_utf8(vb).is_err() {
            lossy(&k);
        }
        out.push((k, String::from_utf8_lossy(vb).into_owned()));
        data += kl + vl + 2;
    }
    out
}

pub fn serialize_map(pairs: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_example_roundtrip() {
        let bytes = serialize_map(&[("a", "1"), ("b", "22")]);
        let expected: Vec<u8> = vec![2, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, b'a', 0, b'1', 0, b'b', 0, b'2', b'2', 0];
        assert_eq!(bytes, expected);
        assert_eq!(deserialize_map(&bytes), vec![("a".to_string(), "1".to_string()), ("b".to_string(), "22".to_string())]);
        assert!(deserialize_map(&[]).is_empty());
        assert!(deserialize_map(&[0]).is_empty());
        assert_eq!(deserialize_map(&bytes[..bytes.len() - 3]).len(), 1, "truncated input keeps what is whole");
    }

    #[test]
    fn non_utf8_values_are_flagged() {
        let mut bytes = serialize_map(&[("X-Tenant", "a\u{e9}"), ("b", "ok")]);
        // Replace the UTF-8 "é" (c3 a9) with Latin-1 0xe9 0x20: same length, not UTF-8.
        let at = bytes.windows(2).position(|w| w == [0xc3, 0xa9]).unwrap();
        bytes[at] = 0xe9;
        bytes[at + 1] = b' ';
        let h = decode_headers(&bytes);
        assert_eq!(h.not_utf8, vec!["x-tenant".to_string()]);
        assert_eq!(h.pairs.len(), 2);
        assert!(decode_headers(&serialize_map(&[("a", "1")])).not_utf8.is_empty());
    }
}
