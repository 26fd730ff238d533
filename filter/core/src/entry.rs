//! A cached response and its compact binary encoding in shared data.

use crate::accounting::UNATTRIBUTED;
use crate::hashing::KeyDigest;
use crate::shaping::Splice;
use std::ops::{Deref, Range};

/// The one layout an entry has. Entries live in shared data only as long as the Envoy process:
/// a filter build that changes the layout changes the magic, and an entry with another magic
/// (left by the build a config update replaced) is unreadable, a miss whose slot is emptied.
const MAGIC: &[u8; 3] = b"MC6";
/// Where the policy tag sits (after magic and key).
const TAG_AT: usize = 3 + 32;

#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub key: KeyDigest,
    /// The storing policy's `accounting::policy_tag`: which per-policy bucket the entry counts in.
    pub policy: u64,
    pub stored_at_ms: u64,
    pub expires_at_ms: u64,
    /// The TTL is the policy's `ttl_s` (the origin gave no freshness): a lower `ttl_s` later
    /// shortens this entry too (`store::Lifetime`).
    pub ttl_from_policy: bool,
    pub status: u16,
    /// A gRPC entry's body is the response message without its 5-byte frame header.
    pub grpc: bool,
    pub response_hash: String,
    /// Response headers replayed on a hit (hop-by-hop and per-response headers removed).
    pub headers: Vec<(String, String)>,
    /// The body without the request id it was answered with.
    pub body: Body,
    /// Where a hit puts the requester's id back (None: the answer carried no id).
    pub splice: Option<Splice>,
    /// How long past expiry this answer may still be served (RFC 5861; the policy's windows,
    /// or the origin's `stale-*` directives clamped by them): when the origin fails, and while
    /// one request refreshes it. The entry is kept until the longer one ends.
    pub stale_if_error_s: u32,
    pub stale_while_revalidate_s: u32,
    /// The answer's OpenAI `usage` (0 when it had none): what each hit from it saves.
    pub usage: crate::usage::Usage,
}

/// An entry's body: bytes of its own, or (`Entry::decode_owned`) a range of the encoded entry
/// it was read from, so a hit does not copy its answer out of what the shared-data read put in
/// the VM's memory (docs/filter.md, "Cost": the copies a Wasm hit makes).
#[derive(Clone, Debug)]
pub struct Body {
    buf: Vec<u8>,
    range: Range<usize>,
}

impl Deref for Body {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[self.range.clone()]
    }
}

impl AsRef<[u8]> for Body {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl From<Vec<u8>> for Body {
    fn from(buf: Vec<u8>) -> Body {
        let range = 0..buf.len();
        Body { buf, range }
    }
}

impl PartialEq for Body {
    fn eq(&self, other: &Body) -> bool {
        self[..] == other[..]
    }
}

impl PartialEq<Vec<u8>> for Body {
    fn eq(&self, other: &Vec<u8>) -> bool {
        self[..] == other[..]
    }
}

impl Entry {
    /// Bytes `encode` produces: what the entry costs in shared data (headers included).
    pub fn encoded_len(&self) -> usize {
        let header_bytes: usize = self.headers.iter().map(|(n, v)| 6 + n.len() + v.len()).sum();
        let splice = match &self.splice {
            None => 1,
            Some(Splice::Proto { at }) => 1 + std::mem::size_of_val(at),
            Some(Splice::Json { at, before, after, .. }) => 1 + std::mem::size_of_val(at) + 1 + 4 + before.len() + after.len(),
        };
        3 + 32 + 8 + 8 + 8 + 2 + 1 + 1 + self.response_hash.len() + 2 + header_bytes + 4 + self.body.len() + splice + 8 + 1 + 8
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.key);
        out.extend_from_slice(&self.policy.to_be_bytes());
        out.extend_from_slice(&self.stored_at_ms.to_be_bytes());
        out.extend_from_slice(&self.expires_at_ms.to_be_bytes());
        out.extend_from_slice(&self.status.to_be_bytes());
        out.push(self.grpc as u8);
        out.push(self.response_hash.len() as u8);
        out.extend_from_slice(self.response_hash.as_bytes());
        out.extend_from_slice(&(self.headers.len() as u16).to_be_bytes());
        for (name, value) in &self.headers {
            out.extend_from_slice(&(name.len() as u16).to_be_bytes());
            out.extend_from_slice(name.as_bytes());
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out.extend_from_slice(&(self.body.len() as u32).to_be_bytes());
        out.extend_from_slice(&self.body);
        match &self.splice {
            None => out.push(0),
            Some(Splice::Proto { at }) => {
                out.push(1);
                out.extend_from_slice(&at.to_be_bytes());
            }
            Some(Splice::Json { at, before, after, json_len_header }) => {
                out.push(2);
                out.extend_from_slice(&at.to_be_bytes());
                out.push(*json_len_header as u8);
                for part in [before, after] {
                    out.extend_from_slice(&(part.len() as u16).to_be_bytes());
                    out.extend_from_slice(part);
                }
            }
        }
        out.extend_from_slice(&self.stale_if_error_s.to_be_bytes());
        out.extend_from_slice(&self.stale_while_revalidate_s.to_be_bytes());
        out.push(self.ttl_from_policy as u8);
        out.extend_from_slice(&self.usage.prompt_tokens.to_be_bytes());
        out.extend_from_slice(&self.usage.completion_tokens.to_be_bytes());
        out
    }

    /// Decodes a copy of `buf`'s bytes.
    pub fn decode(buf: &[u8]) -> Option<Entry> {
        let (mut entry, body) = Entry::decode_head(buf)?;
        entry.body = buf[body].to_vec().into();
        Some(entry)
    }

    /// Decodes `buf`, keeping it as the body's storage (no copy of the body).
    pub fn decode_owned(buf: Vec<u8>) -> Option<Entry> {
        let (mut entry, body) = Entry::decode_head(&buf)?;
        entry.body = Body { buf, range: body };
        Some(entry)
    }

    /// Everything but the body, and where the body lies in `buf`.
    fn decode_head(buf: &[u8]) -> Option<(Entry, Range<usize>)> {
        let mut r = Reader { buf };
        if r.take(3)? != MAGIC {
            return None;
        }
        let mut key = [0u8; 32];
        key.copy_from_slice(r.take(32)?);
        let policy = r.u64()?;
        let stored_at_ms = r.u64()?;
        let expires_at_ms = r.u64()?;
        let status = r.u16()?;
        let grpc = r.take(1)?[0] != 0;
        let hash_len = r.take(1)?[0] as usize;
        let response_hash = r.string(hash_len)?;
        let n = r.u16()? as usize;
        let mut headers = Vec::with_capacity(n);
        for _ in 0..n {
            let nl = r.u16()? as usize;
            let name = r.string(nl)?;
            let vl = r.u32()? as usize;
            headers.push((name, r.string(vl)?));
        }
        let bl = r.u32()? as usize;
        let body_at = buf.len() - r.buf.len();
        r.take(bl)?;
        let splice = match r.take(1)?[0] {
            0 => None,
            1 => Some(Splice::Proto { at: r.u32()? }),
            2 => {
                let at = r.u32()?;
                let json_len_header = r.take(1)?[0] != 0;
                let bl = r.u16()? as usize;
                let before = r.take(bl)?.to_vec();
                let al = r.u16()? as usize;
                let after = r.take(al)?.to_vec();
                Some(Splice::Json { at, before, after, json_len_header })
            }
            _ => return None,
        };
        let at = match &splice {
            Some(Splice::Proto { at }) | Some(Splice::Json { at, .. }) => *at as usize,
            None => 0,
        };
        let (stale_if_error_s, stale_while_revalidate_s) = (r.u32()?, r.u32()?);
        let ttl_from_policy = r.take(1)?[0] != 0;
        let usage = crate::usage::Usage { prompt_tokens: r.u32()?, completion_tokens: r.u32()? };
        if !r.buf.is_empty() || at > bl {
            return None;
        }
        let body = Body::from(Vec::new());
        let entry = Entry {
            key, policy, stored_at_ms, expires_at_ms, ttl_from_policy, status, grpc, response_hash, headers, body, splice, stale_if_error_s,
            stale_while_revalidate_s, usage,
        };
        Some((entry, body_at..body_at + bl))
    }

    /// The key digest without decoding the rest: a slot is checked before it is unpacked.
    pub fn peek_key(buf: &[u8]) -> Option<&[u8]> {
        if buf.len() < 35 || &buf[..3] != MAGIC {
            return None;
        }
        Some(&buf[3..35])
    }

    /// The policy tag of an encoded entry without decoding it (`UNATTRIBUTED` for anything
    /// unreadable: what emptying the slot takes it out of).
    pub fn peek_policy(buf: &[u8]) -> u64 {
        if buf.len() < TAG_AT + 8 || &buf[..3] != MAGIC {
            return UNATTRIBUTED;
        }
        let mut t = [0u8; 8];
        t.copy_from_slice(&buf[TAG_AT..TAG_AT + 8]);
        u64::from_be_bytes(t)
    }

    /// Rewrites the policy tag of an encoded entry in place.
    pub fn set_policy(buf: &mut [u8], tag: u64) {
        if buf.len() >= TAG_AT + 8 && &buf[..3] == MAGIC {
            buf[TAG_AT..TAG_AT + 8].copy_from_slice(&tag.to_be_bytes());
        }
    }
}

struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.buf.len() < n {
            return None;
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Some(head)
    }
    fn u16(&mut self) -> Option<u16> {
        let b = self.take(2)?;
        Some(u16::from_be_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Option<u32> {
        let b = self.take(4)?;
        Some(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Option<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Some(u64::from_be_bytes(a))
    }
    fn string(&mut self, n: usize) -> Option<String> {
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
}

#[cfg(test)]
pub fn sample(key_byte: u8, body: &[u8], expires_at_ms: u64) -> Entry {
    Entry {
        key: [key_byte; 32],
        policy: crate::accounting::policy_tag("m"),
        stored_at_ms: 1000,
        expires_at_ms,
        ttl_from_policy: false,
        status: 200,
        grpc: false,
        response_hash: "ab".repeat(32),
        headers: vec![("content-type".into(), "application/json".into())],
        body: body.to_vec().into(),
        splice: None,
        stale_if_error_s: 0,
        stale_while_revalidate_s: 0,
        usage: crate::usage::Usage::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_rejects_garbage() {
        let e = sample(7, b"{\"x\":1}", 5000);
        let buf = e.encode();
        assert_eq!(buf.len(), e.encoded_len());
        assert_eq!(Entry::decode(&buf), Some(e.clone()));
        assert_eq!(Entry::peek_key(&buf), Some(&[7u8; 32][..]));
        assert_eq!(Entry::decode(&buf[..buf.len() - 1]), None);
        let mut longer = buf.clone();
        longer.push(0);
        assert_eq!(Entry::decode(&longer), None);
        assert_eq!(Entry::decode(b"garbage"), None);
        assert_eq!(Entry::peek_key(b""), None);
    }

    #[test]
    fn decoding_in_place_keeps_the_read_buffer_as_the_body() {
        let e = Entry { splice: Some(Splice::Proto { at: 2 }), ..sample(8, b"answer", 5000) };
        let buf = e.encode();
        let owned = Entry::decode_owned(buf.clone()).unwrap();
        assert_eq!(owned, e);
        assert_eq!(&owned.body[..], b"answer");
        assert_eq!(owned.body, b"answer".to_vec());
        // The body points into the buffer that was read (no copy), not at a new allocation.
        let moved = buf;
        let range = moved.as_ptr() as usize..moved.as_ptr() as usize + moved.len();
        let kept = Entry::decode_owned(moved).unwrap();
        assert!(range.contains(&(kept.body.as_ptr() as usize)), "body outside the read buffer");
        for n in 0..e.encoded_len() {
            assert_eq!(Entry::decode_owned(e.encode()[..n].to_vec()), None);
        }
    }

    #[test]
    fn splices_roundtrip_and_v1_entries_decode() {
        let splices = [
            Splice::Proto { at: 9 },
            Splice::Json { at: 40, before: b"\"id\":\"".to_vec(), after: b"\",".to_vec(), json_len_header: true },
        ];
        for sp in splices.iter() {
            let e = Entry { splice: Some(sp.clone()), ..sample(3, &[b' '; 64], 9) };
            let buf = e.encode();
            assert_eq!(buf.len(), e.encoded_len());
            assert_eq!(Entry::decode(&buf), Some(e));
            for n in 0..buf.len() {
                assert_eq!(Entry::decode(&buf[..n]), None);
            }
        }
        let from_policy = Entry { ttl_from_policy: true, ..sample(4, b"{}", 9) };
        assert_eq!(Entry::decode(&from_policy.encode()), Some(from_policy.clone()));
        let e = sample(4, b"{}", 9);
        assert_eq!(Entry::peek_policy(&e.encode()), e.policy);
        // Another build's layout (another magic) is unreadable: a miss, its slot emptied.
        let mut other = e.encode();
        other[..3].copy_from_slice(b"MC5");
        assert_eq!((Entry::decode(&other), Entry::peek_key(&other), Entry::peek_policy(&other)), (None, None, UNATTRIBUTED));
        let mut retagged = e.encode();
        Entry::set_policy(&mut retagged, 42);
        assert_eq!(Entry::decode(&retagged).map(|d| d.policy), Some(42));
        let windows = Entry { stale_if_error_s: 600, stale_while_revalidate_s: 7, ..sample(6, b"{}", 9) };
        assert_eq!(Entry::decode(&windows.encode()), Some(windows));
        let used = Entry { usage: crate::usage::Usage { prompt_tokens: 27, completion_tokens: 70_000 }, ..sample(6, b"{}", 9) };
        assert_eq!(Entry::decode(&used.encode()), Some(used));
        // A splice point past the body is a corrupt entry.
        let bad = Entry { splice: Some(Splice::Proto { at: 3 }), ..sample(5, b"{}", 9) };
        assert_eq!(Entry::decode(&bad.encode()), None);
    }
}
