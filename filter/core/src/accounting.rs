//! The store's accounting record (`meshcache:meta`): the clock hand, the slot layout, and the
//! entries and bytes stored per policy.
//!
//! Each stored entry carries its policy's tag (`policy_tag` of its `model_prefix`, see
//! `Entry::policy`), so whoever empties a slot knows which bucket to take it out of. Buckets are
//! keyed by tag, not by the current configuration: a policy removed from the configuration
//! keeps its bucket until its entries are gone (reporting counts it as "unattributed"), and a
//! purge (new generation, same prefix) keeps the old entries in the policy's bucket until they
//! are evicted, because they still take space. Totals are sums over the buckets, so the
//! per-policy numbers add up to the total exactly, in every record any writer wrote.
//!
//! Bounded: at most `MAX_BUCKETS` buckets (20 bytes each). An entry whose policy finds the
//! table full is stored under `UNATTRIBUTED`.

use sha2::{Digest, Sha256};

/// The bucket of entries stored while the table was full (and what an unreadable slot held).
pub const UNATTRIBUTED: u64 = 0;
pub const MAX_BUCKETS: usize = 256;
const MAGIC: &[u8; 3] = b"MA2";
const HEADER: usize = 3 + 4 + 4 + 2;
const BUCKET: usize = 8 + 4 + 8;

/// A policy's tag: 64 bits of sha256 over its model prefix (never `UNATTRIBUTED`).
pub fn policy_tag(model_prefix: &str) -> u64 {
    let d = Sha256::new().chain_update(b"meshcache-policy-v1").chain_update(model_prefix.as_bytes()).finalize();
    let mut t = [0u8; 8];
    t.copy_from_slice(&d[..8]);
    u64::from_be_bytes(t).max(1)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub tag: u64,
    /// Signed: writers racing on one slot may each take its entry out before one of them gives
    /// it back (see `store::Cache::insert`), so a bucket can be briefly negative; exact
    /// arithmetic (no clamping) makes it right again once every writer is done.
    pub entries: i32,
    pub bytes: i64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    pub hand: u32,
    /// The slot count the stored entries were placed with.
    pub slots: u32,
    /// Buckets with a non-zero count, sorted by tag.
    pub buckets: Vec<Bucket>,
}

impl Meta {
    /// Entries stored (a transiently negative sum reads as 0).
    pub fn entries(&self) -> u64 {
        self.buckets.iter().map(|b| b.entries as i64).sum::<i64>().max(0) as u64
    }

    /// Bytes stored (a transiently negative sum reads as 0).
    pub fn total_bytes(&self) -> u64 {
        self.buckets.iter().fold(0i64, |n, b| n.saturating_add(b.bytes)).max(0) as u64
    }

    /// (entries, bytes) under `tag`, as stored (may be briefly negative).
    pub fn of(&self, tag: u64) -> (i64, i64) {
        match self.buckets.binary_search_by_key(&tag, |b| b.tag) {
            Ok(i) => (self.buckets[i].entries as i64, self.buckets[i].bytes),
            Err(_) => (0, 0),
        }
    }

    /// The tag an entry of `tag` is stored under: its own, or `UNATTRIBUTED` if a new bucket
    /// would leave no room for that one within `MAX_BUCKETS`.
    pub fn tag_for(&self, tag: u64) -> u64 {
        if self.buckets.len() < MAX_BUCKETS - 1 || self.buckets.binary_search_by_key(&tag, |b| b.tag).is_ok() {
            tag
        } else {
            UNATTRIBUTED
        }
    }

    fn change(&mut self, tag: u64, entries: i32, bytes: i64) {
        match self.buckets.binary_search_by_key(&tag, |b| b.tag) {
            Ok(i) => {
                let b = &mut self.buckets[i];
                b.entries = b.entries.wrapping_add(entries);
                b.bytes = b.bytes.wrapping_add(bytes);
                if b.entries == 0 && b.bytes == 0 {
                    self.buckets.remove(i);
                }
            }
            Err(i) => self.buckets.insert(i, Bucket { tag, entries, bytes }),
        }
    }

    /// Counts one stored entry of `size` bytes under `tag` (from `tag_for`, or the tag the
    /// entry was stored under when giving back a reservation).
    pub fn add(&mut self, tag: u64, size: u64) {
        self.change(tag, 1, size as i64);
    }

    /// Takes one entry of `size` bytes out of `tag`: the tag the slot's value carries.
    pub fn remove(&mut self, tag: u64, size: u64) {
        self.change(tag, -1, -(size as i64));
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + BUCKET * self.buckets.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.hand.to_be_bytes());
        out.extend_from_slice(&self.slots.to_be_bytes());
        out.extend_from_slice(&(self.buckets.len() as u16).to_be_bytes());
        for b in &self.buckets {
            out.extend_from_slice(&b.tag.to_be_bytes());
            out.extend_from_slice(&(b.entries as u32).to_be_bytes());
            out.extend_from_slice(&(b.bytes as u64).to_be_bytes());
        }
        out
    }

    pub fn decode(b: &[u8]) -> Option<Meta> {
        let u32_at = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut t = [0u8; 8];
            t.copy_from_slice(&b[i..i + 8]);
            u64::from_be_bytes(t)
        };
        if b.len() < HEADER || &b[..3] != MAGIC {
            return None;
        }
        // Not checked against MAX_BUCKETS: giving a reservation back may briefly add one
        // bucket per concurrent writer beyond it (u16 bounds the count).
        let n = u16::from_be_bytes([b[11], b[12]]) as usize;
        if b.len() != HEADER + BUCKET * n {
            return None;
        }
        let mut buckets: Vec<Bucket> = (0..n)
            .map(|k| {
                let at = HEADER + BUCKET * k;
                Bucket { tag: u64_at(at), entries: u32_at(at + 8) as i32, bytes: u64_at(at + 12) as i64 }
            })
            .collect();
        if buckets.windows(2).any(|w| w[0].tag >= w[1].tag) {
            buckets.sort_by_key(|b| b.tag);
            buckets.dedup_by_key(|b| b.tag);
        }
        Some(Meta { hand: u32_at(3), slots: u32_at(7), buckets })
    }
}

/// Entries and bytes as the gauges report them: per configured policy's stat name (policies
/// whose names collide are summed), and `unattributed`: what no configured policy claims
/// (removed policies, entries stored while the table was full).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Attributed {
    pub per_name: std::collections::BTreeMap<String, (u64, u64)>,
    pub unattributed: (u64, u64),
}

/// `policies`: (tag, stat name) of every configured policy.
pub fn attribute(meta: &Meta, policies: &[(u64, String)]) -> Attributed {
    let mut out = Attributed::default();
    let mut name_of = std::collections::HashMap::new();
    for (tag, name) in policies {
        name_of.insert(*tag, name.as_str());
        out.per_name.insert(name.clone(), (0, 0));
    }
    // Summed signed, then clamped: a briefly negative bucket never shows as a huge number.
    let mut sums: std::collections::BTreeMap<Option<&str>, (i64, i64)> = std::collections::BTreeMap::new();
    for b in &meta.buckets {
        let s = sums.entry(name_of.get(&b.tag).copied()).or_insert((0, 0));
        s.0 += b.entries as i64;
        s.1 = s.1.saturating_add(b.bytes);
    }
    for (name, (e, b)) in sums {
        let v = (e.max(0) as u64, b.max(0) as u64);
        match name {
            Some(n) => {
                out.per_name.insert(n.to_string(), v);
            }
            None => out.unattributed = v,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_sums_and_removal() {
        let mut m = Meta { hand: 3, slots: 16, buckets: vec![] };
        m.add(policy_tag("a"), 100);
        m.add(policy_tag("b"), 50);
        m.add(policy_tag("a"), 10);
        assert_eq!(m.of(policy_tag("a")), (2, 110));
        assert_eq!((m.entries(), m.total_bytes()), (3, 160));
        assert_eq!(Meta::decode(&m.encode()), Some(m.clone()));
        m.remove(policy_tag("b"), 50);
        assert_eq!(m.buckets.len(), 1, "an empty bucket is dropped");
        // Racing writers: taken out twice, given back once: exact, not clamped.
        m.remove(policy_tag("a"), 100);
        m.remove(policy_tag("a"), 10);
        assert!(m.buckets.is_empty());
        m.remove(policy_tag("a"), 110);
        assert_eq!(m.of(policy_tag("a")), (-1, -110));
        assert_eq!((m.entries(), m.total_bytes()), (0, 0), "a negative total reads as 0");
        assert_eq!(Meta::decode(&m.encode()), Some(m.clone()));
        m.add(policy_tag("a"), 110);
        assert!(m.buckets.is_empty());
        assert_eq!(Meta::decode(b"MA2"), None);
        let mut one = Meta::default();
        one.add(7, 1);
        assert_eq!(Meta::decode(&one.encode()[..20]), None);
    }

    #[test]
    fn attribution_to_configured_policies() {
        let mut m = Meta::default();
        m.add(policy_tag("a"), 100);
        m.add(policy_tag("a.b"), 10);
        m.add(policy_tag("a_b"), 20);
        m.add(policy_tag("gone"), 7);
        m.add(UNATTRIBUTED, 5);
        m.remove(policy_tag("negative"), 3);
        let named = |p: &str| (policy_tag(p), p.replace('.', "_"));
        let got = attribute(&m, &[named("a"), named("a.b"), named("a_b"), named("idle")]);
        assert_eq!(got.per_name.get("a"), Some(&(1, 100)));
        assert_eq!(got.per_name.get("a_b"), Some(&(2, 30)), "colliding names are summed");
        assert_eq!(got.per_name.get("idle"), Some(&(0, 0)), "a policy without entries reports 0");
        // "gone" (removed from the configuration) + UNATTRIBUTED - the transient negative.
        assert_eq!(got.unattributed, (1, 9));
        let sum = got.per_name.values().fold(got.unattributed, |a, b| (a.0 + b.0, a.1 + b.1));
        assert_eq!(sum, (m.entries(), m.total_bytes()), "per-policy + unattributed = total");
        // The removed policy comes back: its entries are its own again.
        assert_eq!(attribute(&m, &[named("gone")]).per_name.get("gone"), Some(&(1, 7)));
    }

    #[test]
    fn table_is_bounded() {
        let mut m = Meta::default();
        for n in 0..MAX_BUCKETS + 10 {
            let tag = m.tag_for(policy_tag(&format!("model-{}", n)));
            m.add(tag, 1);
        }
        assert_eq!(m.buckets.len(), MAX_BUCKETS);
        assert_eq!(m.of(UNATTRIBUTED), (11, 11), "past 255 policies, entries land in UNATTRIBUTED");
        assert_eq!(m.tag_for(policy_tag("model-0")), policy_tag("model-0"), "known tags keep their bucket");
        assert_eq!(m.entries() as usize, MAX_BUCKETS + 10);
        assert!(m.encode().len() <= HEADER + BUCKET * MAX_BUCKETS);
        assert!(policy_tag("") != UNATTRIBUTED && policy_tag("a") != policy_tag("b"));
    }
}
