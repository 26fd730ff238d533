//! The cache in process memory, shared by all of Envoy's worker threads.
//!
//! Sharded by key (a sha256 digest, so its first bytes are already uniform): each shard is a map
//! behind its own mutex with its own byte budget, and the budgets add up to `max_total_bytes`,
//! so the whole store never holds more than that, counted exactly (every entry's `size()`:
//! body, stored headers, key and a fixed per-entry overhead). A full shard evicts its oldest
//! entries first (insertion order). A hit clones an `Arc` under the lock and copies the body
//! into Envoy's reply outside it.
//!
//! Phase 1: no purge generations, no stale windows, no per-policy accounting (DESIGN.md says
//! where those come from in phase 2).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub type Key = [u8; 32];

/// Map node, deque slot, Arc header and Entry fields, rounded up: counted into every entry.
pub const ENTRY_OVERHEAD: usize = 128;
const SHARDS: usize = 16;

#[derive(Debug)]
pub struct Entry {
    pub body: Box<[u8]>,
    pub content_type: Box<[u8]>,
    pub stored_at: Instant,
    pub expires_at: Instant,
}

impl Entry {
    pub fn size(&self) -> usize {
        ENTRY_OVERHEAD + std::mem::size_of::<Key>() + self.body.len() + self.content_type.len()
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Stored {
    Stored { evicted: usize },
    /// Larger than a shard's budget (or than max_entry_bytes): nothing changed.
    TooBig,
}

/// The key is a digest: its first 8 bytes are the hash (no SipHash over 32 bytes per lookup).
#[derive(Default)]
pub struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // `[u8; 32]` hashes as its length (usize) then its bytes: keep the digest's bytes.
        if bytes.len() >= 8 {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[..8]);
            self.0 = u64::from_le_bytes(b);
        }
    }
}

type Map = HashMap<Key, (u64, Arc<Entry>), BuildHasherDefault<DigestHasher>>;

#[derive(Default)]
struct Shard {
    map: Map,
    /// Insertion order for eviction; (key, sequence) pairs whose sequence no longer matches the
    /// map's are leftovers of replaced or removed entries and are skipped.
    order: VecDeque<(Key, u64)>,
    bytes: usize,
    seq: u64,
}

impl Shard {
    fn remove(&mut self, key: &Key) {
        if let Some((_, e)) = self.map.remove(key) {
            self.bytes -= e.size();
        }
    }

    fn evict_oldest(&mut self) -> bool {
        while let Some((key, seq)) = self.order.pop_front() {
            if matches!(self.map.get(&key), Some((s, _)) if *s == seq) {
                self.remove(&key);
                return true;
            }
        }
        false
    }

    fn compact_order(&mut self) {
        if self.order.len() > 2 * self.map.len() + 64 {
            let map = &self.map;
            self.order.retain(|(k, seq)| matches!(map.get(k), Some((s, _)) if s == seq));
        }
    }
}

pub struct Store {
    shards: Box<[Mutex<Shard>]>,
    shard_budget: usize,
    max_entry_bytes: usize,
}

impl Store {
    pub fn new(max_total_bytes: usize, max_entry_bytes: usize) -> Store {
        let shards = (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect::<Vec<_>>().into_boxed_slice();
        Store { shards, shard_budget: max_total_bytes / SHARDS, max_entry_bytes }
    }

    fn shard(&self, key: &Key) -> &Mutex<Shard> {
        // Bytes 8.. pick the shard; bytes ..8 are the map's hash.
        &self.shards[key[8] as usize % SHARDS]
    }

    /// The fresh entry for `key`; an expired one is removed (a miss).
    pub fn get(&self, key: &Key, now: Instant) -> Option<Arc<Entry>> {
        let mut shard = self.shard(key).lock().unwrap_or_else(|p| p.into_inner());
        let expired = match shard.map.get(key) {
            None => return None,
            Some((_, e)) if now < e.expires_at => return Some(e.clone()),
            Some(_) => true,
        };
        if expired {
            shard.remove(key);
        }
        None
    }

    pub fn insert(&self, key: Key, entry: Entry) -> Stored {
        let size = entry.size();
        if entry.body.len() > self.max_entry_bytes || size > self.shard_budget {
            return Stored::TooBig;
        }
        let mut shard = self.shard(&key).lock().unwrap_or_else(|p| p.into_inner());
        shard.remove(&key);
        let mut evicted = 0;
        while shard.bytes + size > self.shard_budget {
            if !shard.evict_oldest() {
                break; // unreachable: an empty shard fits any entry that passed the check above
            }
            evicted += 1;
        }
        shard.seq += 1;
        let seq = shard.seq;
        shard.bytes += size;
        shard.map.insert(key, (seq, Arc::new(entry)));
        shard.order.push_back((key, seq));
        shard.compact_order();
        Stored::Stored { evicted }
    }

    /// (entries, bytes) over all shards.
    pub fn usage(&self) -> (usize, usize) {
        self.shards.iter().fold((0, 0), |(n, b), s| {
            let s = s.lock().unwrap_or_else(|p| p.into_inner());
            (n + s.map.len(), b + s.bytes)
        })
    }

    pub fn max_total_bytes(&self) -> usize {
        self.shard_budget * SHARDS
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn key(n: u64) -> Key {
        // Spread like a digest: shard and hash bytes both vary.
        let mut k = [0u8; 32];
        let x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        k[..8].copy_from_slice(&x.to_le_bytes());
        k[8..16].copy_from_slice(&x.rotate_left(17).to_le_bytes());
        k
    }

    fn entry(body_len: usize, ttl: Duration) -> Entry {
        let now = Instant::now();
        Entry { body: vec![7u8; body_len].into(), content_type: b"application/json"[..].into(), stored_at: now,
                expires_at: now + ttl }
    }

    fn exact_bytes(s: &Store) -> usize {
        s.shards.iter().map(|sh| sh.lock().unwrap().map.values().map(|(_, e)| e.size()).sum::<usize>()).sum()
    }

    #[test]
    fn insert_hit_then_expire() {
        let s = Store::new(1 << 20, 1 << 16);
        assert_eq!(s.insert(key(1), entry(100, Duration::from_millis(50))), Stored::Stored { evicted: 0 });
        let hit = s.get(&key(1), Instant::now()).expect("hit");
        assert_eq!(hit.body.len(), 100);
        assert!(s.get(&key(2), Instant::now()).is_none());
        assert!(s.get(&key(1), Instant::now() + Duration::from_millis(60)).is_none());
        assert_eq!(s.usage(), (0, 0), "the expired entry is freed when seen");
    }

    #[test]
    fn bytes_stay_within_the_budget_and_are_counted_exactly() {
        let total = 64 * 1024;
        let s = Store::new(total, 4096);
        let mut evicted = 0;
        for n in 0..2000 {
            match s.insert(key(n), entry(1000 + (n as usize % 7) * 100, Duration::from_secs(60))) {
                Stored::Stored { evicted: e } => evicted += e,
                Stored::TooBig => panic!("fits"),
            }
            let (_, bytes) = s.usage();
            assert!(bytes <= total, "{} > {}", bytes, total);
            assert_eq!(bytes, exact_bytes(&s));
        }
        assert!(evicted > 1900, "filled 30x past the budget: {}", evicted);
        assert!(s.get(&key(1999), Instant::now()).is_some(), "the newest entry stays");
        assert!(s.get(&key(0), Instant::now()).is_none(), "the oldest went first");
    }

    #[test]
    fn replacing_a_key_keeps_one_entry_and_exact_bytes() {
        let s = Store::new(1 << 20, 1 << 16);
        for len in [10, 5000, 20] {
            s.insert(key(9), entry(len, Duration::from_secs(60)));
        }
        assert_eq!(s.usage(), (1, entry(20, Duration::ZERO).size()));
        assert_eq!(s.get(&key(9), Instant::now()).unwrap().body.len(), 20);
    }

    #[test]
    fn replacements_do_not_grow_the_eviction_queue_without_bound() {
        let s = Store::new(1 << 20, 1 << 16);
        for _ in 0..10_000 {
            s.insert(key(3), entry(10, Duration::from_secs(60)));
        }
        let queued: usize = s.shards.iter().map(|sh| sh.lock().unwrap().order.len()).sum();
        assert!(queued < 200, "{}", queued);
    }

    #[test]
    fn too_big_changes_nothing() {
        let s = Store::new(16 * 1024, 100_000);
        s.insert(key(1), entry(10, Duration::from_secs(60)));
        assert_eq!(s.insert(key(2), entry(2000, Duration::from_secs(60))), Stored::TooBig, "over a shard's budget");
        let s2 = Store::new(1 << 20, 100);
        assert_eq!(s2.insert(key(2), entry(101, Duration::from_secs(60))), Stored::TooBig, "over max_entry_bytes");
        assert_eq!(s.usage().0, 1);
    }

    #[test]
    fn concurrent_writers_and_readers_keep_exact_accounting() {
        let s = Arc::new(Store::new(256 * 1024, 8192));
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for n in 0..5000u64 {
                        let k = key((n * 7 + t) % 3000);
                        if n % 3 == 0 {
                            s.get(&k, Instant::now());
                        } else {
                            s.insert(k, entry(500 + (n as usize % 13) * 300, Duration::from_secs(60)));
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let (_, bytes) = s.usage();
        assert!(bytes <= s.max_total_bytes());
        assert_eq!(bytes, exact_bytes(&s));
    }
}
