//! The native host's shared data: the core's store (`meshcache_core::store::Cache`: slots,
//! per-policy accounting record, compare-and-swap reservations, clock eviction, purge by policy
//! generation in the key) runs over this map in process memory, one per Envoy process, shared by
//! every worker. The semantics are those of Envoy's shared data, which the core's exactness
//! arguments rely on: a value and a compare-and-swap token per key, cas 0 = unconditional, a
//! fresh token on every write. So both hosts evict, account and purge alike.
//!
//! No host calls: a lookup is a lock of one shard (16, by key) and a copy of the slot's bytes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use meshcache_core::store::SharedData;

const SHARDS: usize = 16;

pub struct Shared {
    shards: [Mutex<HashMap<String, (Vec<u8>, u32)>>; SHARDS],
    next_cas: AtomicU32,
    /// Held while the gauges are read from the accounting record and set (metrics).
    pub gauges: Mutex<()>,
}

impl Default for Shared {
    fn default() -> Self {
        Shared {
            shards: std::array::from_fn(|_| Mutex::new(HashMap::new())),
            next_cas: AtomicU32::new(1),
            gauges: Mutex::new(()),
        }
    }
}

impl Shared {
    fn shard(&self, key: &str) -> &Mutex<HashMap<String, (Vec<u8>, u32)>> {
        // FNV-1a over the key (short strings: "meshcache:slot:<i>", "meshcache:meta", ...).
        let h = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3));
        &self.shards[(h as usize) % SHARDS]
    }

    fn token(&self) -> u32 {
        loop {
            let t = self.next_cas.fetch_add(1, Ordering::Relaxed);
            if t != 0 {
                return t; // 0 means "unconditional": never a stored token
            }
        }
    }
}

/// The most capacity a rewritten value may keep: its length, an eighth more and 1 KiB (small
/// records such as the accounting record are rewritten in place without an allocation).
fn snug(len: usize) -> usize {
    len + len / 8 + 1024
}

impl Shared {
    /// Bytes of value buffers held (capacity, not length): what the process really keeps.
    #[cfg(test)]
    fn held_bytes(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap().values().map(|(v, _)| v.capacity()).sum::<usize>()).sum()
    }
}

impl SharedData for Shared {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        let shard = self.shard(key).lock().unwrap_or_else(|p| p.into_inner());
        shard.get(key).cloned()
    }

    fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
        let mut shard = self.shard(key).lock().unwrap_or_else(|p| p.into_inner());
        match shard.get_mut(key) {
            Some((_, current)) if cas != 0 && cas != *current => false,
            Some(slot) => {
                if slot.0.capacity() <= snug(value.len()) {
                    slot.0.clear();
                    slot.0.extend_from_slice(value);
                } else {
                    // A slot that held a large entry and now holds a small one (or nothing,
                    // after an eviction) must not keep the large buffer: the accounting counts
                    // what a value holds, so kept capacity would let the process exceed
                    // max_total_bytes by up to slots x max_entry_bytes (measured: ~1 GB for a
                    // 256 MiB budget of 64 KiB answers).
                    slot.0 = value.to_vec();
                }
                slot.1 = self.token();
                true
            }
            None => {
                shard.insert(key.to_string(), (value.to_vec(), self.token()));
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshcache_core::config::Limits;
    use meshcache_core::entry::Entry;
    use meshcache_core::store::{Cache, Lookup, Outcome};
    use std::sync::Arc;

    fn entry(thread: u8, i: u32, body_len: usize) -> Entry {
        let mut key = [thread; 32];
        key[1..5].copy_from_slice(&i.to_be_bytes());
        Entry {
            key,
            policy: meshcache_core::accounting::policy_tag("m"),
            stored_at_ms: 0,
            expires_at_ms: u64::MAX / 2,
            ttl_from_policy: false,
            status: 200,
            grpc: false,
            response_hash: "ab".repeat(32),
            headers: vec![("content-type".into(), "application/json".into())],
            body: vec![b'x'; body_len].into(),
            splice: None,
            stale_if_error_s: 0,
            stale_while_revalidate_s: 0,
            usage: Default::default(),
        }
    }

    #[test]
    fn compare_and_swap_has_envoys_semantics() {
        let s = Shared::default();
        assert!(s.get("k").is_none());
        assert!(s.set("k", b"a", 0));
        let (v, cas) = s.get("k").unwrap();
        assert_eq!(v, b"a");
        assert!(!s.set("k", b"b", cas + 1), "a stale token fails");
        assert!(s.set("k", b"b", cas));
        let (_, cas2) = s.get("k").unwrap();
        assert_ne!(cas, cas2, "every write gets a fresh token");
        assert!(!s.set("k", b"c", cas));
        assert!(s.set("k", b"c", 0), "0 is unconditional");
    }

    #[test]
    fn a_rewritten_value_does_not_keep_a_larger_buffer() {
        let s = Shared::default();
        assert!(s.set("slot", &vec![b'x'; 64 * 1024], 0));
        assert!(s.set("slot", b"", 0)); // evicted
        assert!(s.held_bytes() <= snug(0), "{} bytes kept for an empty slot", s.held_bytes());
        assert!(s.set("slot", &vec![b'y'; 900], 0));
        assert!(s.set("slot", &vec![b'z'; 800], 0)); // close in size: rewritten in place
        assert_eq!(s.get("slot").unwrap().0, vec![b'z'; 800]);
        assert!(s.held_bytes() <= snug(900));
    }

    #[test]
    fn the_core_store_over_process_memory_keeps_exact_accounting_under_threads() {
        let shared = Arc::new(Shared::default());
        let limits = Limits { max_entry_bytes: 4096, max_total_bytes: 64 * 1024, max_entries: 64 };
        Cache { data: &*shared, limits: &limits }.reconcile(&mut Outcome::default());
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let (shared, limits) = (shared.clone(), limits.clone());
                std::thread::spawn(move || {
                    let cache = Cache { data: &*shared, limits: &limits };
                    for i in 0..200u32 {
                        let e = entry(t, i, 100 + (i as usize % 7) * 300);
                        let _ = cache.insert(&e, None, &mut Outcome::default());
                        let _ = cache.lookup(&e.key, 0, &mut Outcome::default());
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        let cache = Cache { data: &*shared, limits: &limits };
        let (meta, _) = cache.meta();
        let slots = meta.slots;
        assert_eq!(slots, 64);
        // What the record accounts is what the slots hold, byte for byte.
        let mut entries = 0u64;
        let mut bytes = 0u64;
        for i in 0..slots {
            if let Some((v, _)) = shared.get(&meshcache_core::store::slot_key(i)) {
                if !v.is_empty() {
                    entries += 1;
                    bytes += v.len() as u64 + meshcache_core::store::SLOT_OVERHEAD;
                }
            }
        }
        assert_eq!((meta.entries(), meta.total_bytes()), (entries, bytes));
        assert!(bytes <= limits.max_total_bytes);
        assert!(matches!(cache.lookup(&[0u8; 32], 0, &mut Outcome::default()), Lookup::Miss(_)));
    }
}
