//! Cache keys and response hashes (sha256).

use crate::shaping::KeyedBytes;
use sha2::{Digest, Sha256};

pub type KeyDigest = [u8; 32];

/// Everything that shapes an inference answer, and so separates cache entries.
pub struct KeyInput<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub model: &'a str,
    pub version: &'a str,
    pub generation: u64,
    pub color: &'a str,
    /// (lowercase header name, every value the request had, in order), in policy order.
    pub vary: &'a [(String, Vec<String>)],
    /// The peer's URI SAN when the policy's scope is "principal".
    pub principal: Option<&'a str>,
    /// The body as keyed: the request id and ignored fields left out.
    pub body: &'a KeyedBytes<'a>,
}

fn field(h: &mut Sha256, bytes: &[u8]) {
    // Length-prefixing makes the encoding injective: ("ab","c") never collides with ("a","bc").
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

pub fn cache_key(k: &KeyInput) -> KeyDigest {
    let mut h = Sha256::new();
    h.update(b"meshcache-key-v2");
    field(&mut h, k.method.as_bytes());
    field(&mut h, k.path.as_bytes());
    field(&mut h, k.model.as_bytes());
    field(&mut h, k.version.as_bytes());
    h.update(k.generation.to_be_bytes());
    field(&mut h, k.color.as_bytes());
    h.update((k.vary.len() as u64).to_be_bytes());
    for (name, values) in k.vary {
        field(&mut h, name.as_bytes());
        // The count separates absent (0) from empty (1 value "") and from repeated lines.
        h.update((values.len() as u64).to_be_bytes());
        for v in values {
            field(&mut h, v.as_bytes());
        }
    }
    match k.principal {
        Some(p) => {
            h.update([1u8]);
            field(&mut h, p.as_bytes());
        }
        None => h.update([0u8]),
    }
    // The id form first: an answer stored without an id never serves a request with one.
    h.update([k.body.form_tag()]);
    let total: usize = k.body.parts.iter().map(|p| p.len()).sum();
    h.update((total as u64).to_be_bytes());
    for part in &k.body.parts {
        h.update(part);
    }
    match k.body.json_len {
        Some(n) => {
            h.update([1u8]);
            h.update(n.to_be_bytes());
        }
        None => h.update([0u8]),
    }
    h.finalize().into()
}

/// sha256 over the 8-byte big-endian body length, the body, then `name:value\n` for each
/// `hash_headers` name (ascending; already sorted by the config) that the response carries.
/// Repeated headers are joined with "," as HTTP allows.
pub fn response_hash(body: &[u8], headers: &[(String, String)], hash_headers: &[String]) -> String {
    let mut h = Sha256::new();
    h.update((body.len() as u64).to_be_bytes());
    h.update(body);
    for name in hash_headers {
        let values: Vec<&str> = headers.iter().filter(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str()).collect();
        if values.is_empty() {
            continue;
        }
        h.update(name.as_bytes());
        h.update(b":");
        h.update(values.join(",").as_bytes());
        h.update(b"\n");
    }
    hex(&h.finalize())
}

pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

pub fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    s.as_bytes().chunks(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base<'a>(body: &'a KeyedBytes<'a>, vary: &'a [(String, Vec<String>)]) -> KeyInput<'a> {
        KeyInput {
            method: "POST", path: "/v2/models/m/infer", model: "m", version: "", generation: 0, color: "",
            vary, principal: None, body,
        }
    }

    #[test]
    fn body_forms_are_separated() {
        use crate::shaping::RequestId;
        let none: Vec<(String, Vec<String>)> = vec![];
        let whole = KeyedBytes::whole(b"{\"a\":1}");
        let split = KeyedBytes { parts: vec![b"{\"a\"", b":1}"], json_len: None, id: RequestId::None };
        assert_eq!(cache_key(&base(&whole, &none)), cache_key(&base(&split, &none)), "parts hash as their concatenation");
        let spliced = KeyedBytes { id: RequestId::Spliced(b"x".to_vec()), ..whole.clone() };
        let other_id = KeyedBytes { id: RequestId::Spliced(b"y".to_vec()), ..whole.clone() };
        let kept = KeyedBytes { id: RequestId::Kept, ..whole.clone() };
        let binary = KeyedBytes { json_len: Some(7), ..whole.clone() };
        let k = cache_key(&base(&whole, &none));
        assert_eq!(cache_key(&base(&spliced, &none)), cache_key(&base(&other_id, &none)), "the id itself is not keyed");
        for v in [&spliced, &kept, &binary] {
            assert_ne!(cache_key(&base(v, &none)), k);
        }
        assert_ne!(cache_key(&base(&spliced, &none)), cache_key(&base(&kept, &none)));
    }

    #[test]
    fn every_component_changes_the_key() {
        let none: Vec<(String, Vec<String>)> = vec![];
        let (x, y) = (KeyedBytes::whole(b"x"), KeyedBytes::whole(b"y"));
        let k0 = cache_key(&base(&x, &none));
        assert_eq!(k0, cache_key(&base(&x, &none)));
        let mut variants = vec![];
        variants.push(cache_key(&base(&y, &none)));
        variants.push(cache_key(&KeyInput { method: "PUT", ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { path: "/v1/infer", ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { model: "n", ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { version: "2", ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { generation: 1, ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { color: "blue", ..base(&x, &none) }));
        variants.push(cache_key(&KeyInput { principal: Some("spiffe://a"), ..base(&x, &none) }));
        let vary_a = vec![("x-tenant".to_string(), vec!["a".to_string()])];
        let vary_absent = vec![("x-tenant".to_string(), vec![])];
        let vary_empty = vec![("x-tenant".to_string(), vec![String::new()])];
        let vary_twice = vec![("x-tenant".to_string(), vec!["a".to_string(), "b".to_string()])];
        let vary_joined = vec![("x-tenant".to_string(), vec!["a,b".to_string()])];
        let vary_other_first = vec![("x-tenant".to_string(), vec!["b".to_string(), "a".to_string()])];
        variants.push(cache_key(&base(&x, &vary_a)));
        variants.push(cache_key(&base(&x, &vary_absent)));
        variants.push(cache_key(&base(&x, &vary_empty)));
        variants.push(cache_key(&base(&x, &vary_twice)));
        variants.push(cache_key(&base(&x, &vary_joined)));
        variants.push(cache_key(&base(&x, &vary_other_first)));
        for (i, v) in variants.iter().enumerate() {
            assert_ne!(*v, k0, "variant {}", i);
            for w in &variants[i + 1..] {
                assert_ne!(v, w);
            }
        }
    }

    #[test]
    fn field_boundaries_are_unambiguous() {
        let none: Vec<(String, Vec<String>)> = vec![];
        let empty = KeyedBytes::whole(b"");
        let a = cache_key(&KeyInput { model: "ab", version: "c", ..base(&empty, &none) });
        let b = cache_key(&KeyInput { model: "a", version: "bc", ..base(&empty, &none) });
        assert_ne!(a, b);
    }

    #[test]
    fn response_hash_matches_definition() {
        let headers = vec![
            ("x-model-id".to_string(), "m".to_string()),
            ("Content-Type".to_string(), "application/json".to_string()),
            ("server".to_string(), "x".to_string()),
        ];
        let names = vec!["content-type".to_string(), "etag".to_string(), "x-model-id".to_string()];
        let mut expected = Sha256::new();
        expected.update(5u64.to_be_bytes());
        expected.update(b"hello");
        expected.update(b"content-type:application/json\nx-model-id:m\n");
        assert_eq!(response_hash(b"hello", &headers, &names), hex(&expected.finalize()));
        // Known vector: empty body, no headers = sha256 of eight zero bytes.
        assert_eq!(response_hash(b"", &[], &[]), "af5570f5a1810b7af78caf4bc70a660f0df51e42baf91d4de5b2328de0e83dfc");
    }

    #[test]
    fn hex_roundtrip() {
        assert_eq!(hex(&[0, 255, 16]), "00ff10");
        assert_eq!(unhex("00ff10"), Some(vec![0, 255, 16]));
        assert_eq!(unhex("0g"), None);
        assert_eq!(unhex("abc"), None);
    }
}
