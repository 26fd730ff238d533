//! The ABI's serialized header map format (little-endian lengths, NUL-separated bytes).

/// Decodes the ABI's serialized map: count, (key_len, value_len)*, then NUL-terminated bytes.
pub fn deserialize_map(b: &[u8]) -> Vec<(String, String)> {
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
        let k = b.get(data..data + kl).map(|s| String::from_utf8_lossy(s).into_owned());
        let v = b.get(data + kl + 1..data + kl + 1 + vl).map(|s| String::from_utf8_lossy(s).into_owned());
        match (k, v) {
            (Some(k), Some(v)) => out.push((k, v)),
            _ => return out,
        }
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
}
