//! The bounded cache over Envoy shared data (process-wide, shared by all worker threads).
//!
//! Layout: `max_entries` fixed slots (`meshcache:slot:<i>`, direct-mapped by key digest) and one
//! accounting record (`meshcache:meta`). The number of keys is bounded by construction; bytes are
//! bounded by reserving space in the accounting record (compare-and-swap) *before* writing a
//! slot, evicting with a clock hand when full. Every slot change is paired with exactly one
//! accounting change by the same writer, so the accounted total equals what is stored:
//! - every slot key exists (created empty by the one root context that switches the layout),
//!   because Envoy treats a compare-and-swap against a missing key as unconditional; a writer
//!   finding a slot missing does not store;
//! - a writer reserves only while the record's slot count is the one it places entries with,
//!   and re-checks it after writing: a layout change meanwhile makes it take its entry back.

use crate::config::Limits;
use crate::entry::Entry;
use crate::hashing::KeyDigest;

/// Envoy's per-key overhead (map node, key string, cas) approximated into each entry's size.
pub const SLOT_OVERHEAD: u64 = 64;
const META_KEY: &str = "meshcache:meta";
const MAX_CAS_RETRIES: usize = 32;
const MAX_EVICTIONS_PER_INSERT: usize = 64;

/// Host shared-data operations (Envoy in the filter, a map in tests).
pub trait SharedData {
    /// The value and its compare-and-swap token, or None if the key was never set.
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)>;
    /// Sets the value if `cas` is 0 or still current; false on mismatch or failure.
    fn set(&self, key: &str, value: &[u8], cas: u32) -> bool;
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    pub total_bytes: u64,
    pub entries: u32,
    pub hand: u32,
    /// The slot count the stored entries were placed with.
    pub slots: u32,
}

impl Meta {
    fn encode(&self) -> [u8; 20] {
        let mut out = [0u8; 20];
        out[..8].copy_from_slice(&self.total_bytes.to_be_bytes());
        out[8..12].copy_from_slice(&self.entries.to_be_bytes());
        out[12..16].copy_from_slice(&self.hand.to_be_bytes());
        out[16..20].copy_from_slice(&self.slots.to_be_bytes());
        out
    }

    fn decode(b: &[u8]) -> Option<Meta> {
        if b.len() != 20 {
            return None;
        }
        let mut t = [0u8; 8];
        t.copy_from_slice(&b[..8]);
        let u = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        Some(Meta { total_bytes: u64::from_be_bytes(t), entries: u(8), hand: u(12), slots: u(16) })
    }
}

#[derive(Debug, PartialEq)]
pub enum Lookup {
    Hit(Entry),
    /// What the slot held when looked at, when known: storing the answer later can then
    /// compare-and-swap against it without reading the slot again (one VM crossing less).
    Miss(Option<SlotSeen>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotSeen {
    pub len: usize,
    pub cas: u32,
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    pub evicted: u32,
    /// Slots whose content could not be decoded (counted as errors, then cleared).
    pub corrupt: u32,
}

#[derive(Debug, PartialEq, Eq)]
pub enum StoreError {
    /// Larger than the whole cache, or space could not be reserved in bounded steps.
    NoSpace,
    /// Another writer changed the slot or the accounting meanwhile; nothing was stored.
    Contended,
}

pub fn slot_key(i: u32) -> String {
    format!("meshcache:slot:{}", i)
}

pub fn slot_of(key: &KeyDigest, slots: u32) -> u32 {
    u32::from_be_bytes([key[0], key[1], key[2], key[3]]) % slots.max(1)
}

fn stored_size(value_len: usize) -> u64 {
    if value_len == 0 {
        0
    } else {
        value_len as u64 + SLOT_OVERHEAD
    }
}

pub struct Cache<'a, S: SharedData> {
    pub data: &'a S,
    pub limits: &'a Limits,
}

/// Limits of a view that only reads the accounting record or a known slot (`meta`,
/// `lookup_at`): those never consult the limits.
static READ_ONLY: Limits = Limits { max_entry_bytes: 0, max_total_bytes: 0, max_entries: 1 };

impl<'a, S: SharedData> Cache<'a, S> {
    /// A view for `meta` and `lookup_at` only (the gRPC stub, the metrics tick).
    pub fn read_only(data: &'a S) -> Self {
        Cache { data, limits: &READ_ONLY }
    }

    pub fn meta(&self) -> (Meta, u32) {
        match self.data.get(META_KEY) {
            Some((v, cas)) => (Meta::decode(&v).unwrap_or_default(), cas),
            None => (Meta::default(), 0),
        }
    }

    /// Applies `change` to the accounting record with compare-and-swap; bounded retries.
    fn update_meta<F: Fn(&mut Meta)>(&self, change: F) -> bool {
        for _ in 0..MAX_CAS_RETRIES {
            let (mut m, cas) = self.meta();
            change(&mut m);
            if self.data.set(META_KEY, &m.encode(), cas) {
                return true;
            }
        }
        false
    }

    /// Empties slot `i` if it still holds exactly `value` (by cas), releasing its bytes.
    fn clear_slot(&self, i: u32, value_len: usize, cas: u32) -> bool {
        if value_len == 0 || !self.data.set(&slot_key(i), b"", cas) {
            return false;
        }
        let size = stored_size(value_len);
        self.update_meta(|m| {
            m.total_bytes = m.total_bytes.saturating_sub(size);
            m.entries = m.entries.saturating_sub(1);
        });
        true
    }

    pub fn lookup(&self, key: &KeyDigest, now_ms: u64, out: &mut Outcome) -> Lookup {
        self.lookup_at(slot_of(key, self.limits.max_entries), key, now_ms, out)
    }

    /// Looks in slot `i` (where the key's owner placed it) for a fresh entry with this key.
    pub fn lookup_at(&self, i: u32, key: &KeyDigest, now_ms: u64, out: &mut Outcome) -> Lookup {
        let (value, cas) = match self.data.get(&slot_key(i)) {
            Some(v) => v,
            // Not created yet (layout being set up): a store must read it again.
            None => return Lookup::Miss(None),
        };
        let seen = Some(SlotSeen { len: value.len(), cas });
        if value.is_empty() {
            return Lookup::Miss(seen);
        }
        match Entry::peek_key(&value) {
            Some(k) if k == &key[..] => {}
            Some(_) => return Lookup::Miss(seen),
            None => {
                out.corrupt += 1;
                self.clear_slot(i, value.len(), cas);
                return Lookup::Miss(None);
            }
        }
        match Entry::decode(&value) {
            Some(e) if e.expires_at_ms > now_ms => Lookup::Hit(e),
            Some(_) => {
                // Expired entries are never served; free the space right away.
                if self.clear_slot(i, value.len(), cas) {
                    out.evicted += 1;
                }
                Lookup::Miss(None)
            }
            None => {
                out.corrupt += 1;
                self.clear_slot(i, value.len(), cas);
                Lookup::Miss(None)
            }
        }
    }

    /// Stores `entry` in its slot. `seen`: the slot as a lookup saw it, if known.
    pub fn insert(&self, entry: &Entry, seen: Option<SlotSeen>, out: &mut Outcome) -> Result<(), StoreError> {
        let value = entry.encode();
        let size = stored_size(value.len());
        if size > self.limits.max_total_bytes {
            return Err(StoreError::NoSpace);
        }
        let slots = self.limits.max_entries;
        let i = slot_of(&entry.key, slots);
        let (old_len, slot_cas) = match seen {
            Some(s) if s.cas != 0 => (s.len, s.cas),
            _ => match self.data.get(&slot_key(i)) {
                Some((v, c)) if c != 0 => (v.len(), c),
                // A missing slot would make the write unconditional: never write one.
                _ => return Err(StoreError::Contended),
            },
        };
        let old_size = stored_size(old_len);
        let was_empty = old_len == 0;

        let mut reserved = false;
        let mut steps = 0;
        while !reserved && steps < MAX_EVICTIONS_PER_INSERT + MAX_CAS_RETRIES {
            steps += 1;
            let (mut m, meta_cas) = self.meta();
            if m.slots != slots || meta_cas == 0 {
                // The layout is not (or no longer) the one this writer places entries with.
                return Err(StoreError::Contended);
            }
            let new_total = m.total_bytes.saturating_sub(old_size) + size;
            if new_total <= self.limits.max_total_bytes {
                m.total_bytes = new_total;
                m.entries += was_empty as u32;
                reserved = self.data.set(META_KEY, &m.encode(), meta_cas);
                continue;
            }
            // Full: evict the slot under the clock hand (never our own target slot).
            let victim = m.hand % slots;
            m.hand = (victim + 1) % slots;
            if !self.data.set(META_KEY, &m.encode(), meta_cas) || victim == i {
                continue;
            }
            if let Some((v, c)) = self.data.get(&slot_key(victim)) {
                if self.clear_slot(victim, v.len(), c) {
                    out.evicted += 1;
                }
            }
        }
        if !reserved {
            return Err(StoreError::NoSpace);
        }
        if self.data.set(&slot_key(i), &value, slot_cas) {
            if self.meta().0.slots != slots {
                // The layout changed while we wrote: the reconciling context may already have
                // passed this slot, so take our entry back ourselves (if it is still there).
                if let Some((v, c)) = self.data.get(&slot_key(i)) {
                    if v.len() == value.len() && Entry::peek_key(&v) == Some(&entry.key[..]) {
                        self.clear_slot(i, v.len(), c);
                    }
                }
                return Err(StoreError::Contended);
            }
            if !was_empty {
                out.evicted += 1;
            }
            return Ok(());
        }
        // Someone else wrote the slot since we read it: give the reservation back.
        self.update_meta(|m| {
            m.total_bytes = m.total_bytes.saturating_sub(size) + old_size;
            m.entries = m.entries.saturating_sub(was_empty as u32);
        });
        Err(StoreError::Contended)
    }

    /// Brings stored data within the current limits after a configuration change: a new slot
    /// count empties the old slots (their placement no longer matches) and creates the new
    /// ones; a smaller byte budget evicts until it fits. Cheap when nothing changed.
    pub fn reconcile(&self, out: &mut Outcome) {
        let slots = self.limits.max_entries;
        if self.data.get(META_KEY).is_none() {
            // First use of this VM's shared data: a record to compare-and-swap against.
            self.data.set(META_KEY, &Meta::default().encode(), 0);
        }
        // Switch the layout with one compare-and-swap: exactly one context wins and sets up
        // the slots; writers with another slot count stop reserving from this moment.
        let mut old_slots = None;
        for _ in 0..MAX_CAS_RETRIES {
            let (m, cas) = self.meta();
            if m.slots == slots {
                break;
            }
            let switched = Meta { slots, hand: 0, ..m };
            if cas != 0 && self.data.set(META_KEY, &switched.encode(), cas) {
                old_slots = Some(m.slots);
                break;
            }
        }
        if let Some(old) = old_slots {
            for i in 0..old.max(slots) {
                match self.data.get(&slot_key(i)) {
                    Some((v, c)) => {
                        if self.clear_slot(i, v.len(), c) {
                            out.evicted += 1;
                        }
                    }
                    None if i < slots => {
                        // Only the switching context creates slots, and writers never write a
                        // missing one, so this unconditional write overwrites nothing.
                        self.data.set(&slot_key(i), b"", 0);
                    }
                    None => {}
                }
            }
        }
        let mut steps = 0;
        while self.meta().0.total_bytes > self.limits.max_total_bytes && steps < slots {
            steps += 1;
            let victim = steps - 1;
            if let Some((v, c)) = self.data.get(&slot_key(victim)) {
                if self.clear_slot(victim, v.len(), c) {
                    out.evicted += 1;
                }
            }
        }
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::entry::sample;
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// Same semantics as Envoy's shared data: cas 0 = unconditional, a fresh cas per write.
    #[derive(Default)]
    pub struct MemShared {
        map: RefCell<HashMap<String, (Vec<u8>, u32)>>,
        next: RefCell<u32>,
    }

    impl SharedData for MemShared {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.map.borrow().get(key).cloned()
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
            let mut map = self.map.borrow_mut();
            if let Some((_, current)) = map.get(key) {
                if cas != 0 && cas != *current {
                    return false;
                }
            }
            *self.next.borrow_mut() += 1;
            let c = *self.next.borrow();
            map.insert(key.to_string(), (value.to_vec(), c));
            true
        }
    }

    impl MemShared {
        pub fn stored_bytes(&self) -> u64 {
            self.map.borrow().iter().filter(|(k, _)| k.starts_with("meshcache:slot:")).map(|(_, (v, _))| stored_size(v.len())).sum()
        }
        pub fn keys(&self) -> usize {
            self.map.borrow().len()
        }
    }

    fn limits(total: u64, entries: u32) -> Limits {
        Limits { max_entry_bytes: total, max_total_bytes: total, max_entries: entries }
    }

    fn key(n: u32) -> KeyDigest {
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(&n.to_be_bytes());
        k[31] = 1;
        k
    }

    fn entry(n: u32, body: &[u8], expires: u64) -> Entry {
        Entry { key: key(n), ..sample(0, body, expires) }
    }

    #[test]
    fn insert_then_hit_then_expire() {
        let shared = MemShared::default();
        let l = limits(1 << 20, 16);
        let cache = Cache { data: &shared, limits: &l };
        let mut out = Outcome::default();
        cache.reconcile(&mut out);
        let e = entry(3, b"hello", 2000);
        cache.insert(&e, None, &mut out).unwrap();
        assert_eq!(cache.lookup(&key(3), 1999, &mut out), Lookup::Hit(e));
        assert!(matches!(cache.lookup(&key(4), 1999, &mut out), Lookup::Miss(_)));
        // Same slot (3 % 16 == 19 % 16), different key: miss, not a wrong answer.
        assert!(matches!(cache.lookup(&key(19), 1999, &mut out), Lookup::Miss(_)));
        assert!(matches!(cache.lookup(&key(3), 2000, &mut out), Lookup::Miss(_)), "expired entries are never served");
        assert_eq!(cache.meta().0.entries, 0);
        assert_eq!(cache.meta().0.total_bytes, 0);
        assert_eq!(out.evicted, 1);
    }

    #[test]
    fn memory_bound_holds_when_filled_past_the_limit() {
        let shared = MemShared::default();
        let l = limits(20_000, 64);
        let cache = Cache { data: &shared, limits: &l };
        let mut out = Outcome::default();
        cache.reconcile(&mut out);
        for n in 0..1000u32 {
            let body = vec![n as u8; 500 + (n as usize * 37) % 2000];
            let r = cache.insert(&entry(n, &body, u64::MAX), None, &mut out);
            assert!(r.is_ok(), "insert {} failed: {:?}", n, r);
            let (m, _) = cache.meta();
            assert!(m.total_bytes <= l.max_total_bytes);
            assert_eq!(m.total_bytes, shared.stored_bytes(), "accounting matches what is stored");
            assert!(shared.keys() <= 64 + 1);
        }
        assert!(out.evicted > 900);
        // The most recent entry is always retrievable.
        assert!(matches!(cache.lookup(&key(999), 0, &mut out), Lookup::Hit(_)));
    }

    #[test]
    fn insert_reuses_what_the_lookup_saw_and_detects_changes_since() {
        let shared = MemShared::default();
        let l = limits(1 << 20, 4);
        let cache = Cache { data: &shared, limits: &l };
        let mut out = Outcome::default();
        cache.reconcile(&mut out);
        let seen = match cache.lookup(&key(1), 0, &mut out) {
            Lookup::Miss(seen) => seen,
            other => panic!("{:?}", other),
        };
        assert!(matches!(seen, Some(SlotSeen { len: 0, cas }) if cas != 0), "slots exist: a real CAS token");
        cache.insert(&entry(1, b"a", 10), seen, &mut out).unwrap();
        let seen = match cache.lookup(&key(5), 0, &mut out) {
            Lookup::Miss(seen) => seen,
            other => panic!("{:?}", other),
        };
        // Another writer replaces the slot between our lookup and our store.
        cache.insert(&entry(9, b"other", 10), None, &mut out).unwrap();
        assert_eq!(cache.insert(&entry(5, b"late", 10), seen, &mut out), Err(StoreError::Contended));
        assert!(matches!(cache.lookup(&key(9), 0, &mut out), Lookup::Hit(_)));
        assert_eq!(cache.meta().0.total_bytes, shared.stored_bytes(), "the failed store gave its reservation back");
    }

    #[test]
    fn oversized_and_contended() {
        let shared = MemShared::default();
        let l = limits(1000, 8);
        let cache = Cache { data: &shared, limits: &l };
        let mut out = Outcome::default();
        cache.reconcile(&mut out);
        assert_eq!(cache.insert(&entry(1, &[0u8; 2000], 10), None, &mut out), Err(StoreError::NoSpace));
        assert_eq!(cache.meta().0.total_bytes, 0);
    }

    #[test]
    fn reconcile_after_shrinking_limits() {
        let shared = MemShared::default();
        let big = limits(1 << 20, 32);
        let mut out = Outcome::default();
        {
            let cache = Cache { data: &shared, limits: &big };
            cache.reconcile(&mut out);
            for n in 0..32 {
                cache.insert(&entry(n, &[1u8; 1000], u64::MAX), None, &mut out).unwrap();
            }
            assert_eq!(cache.meta().0.entries, 32);
        }
        let fewer_bytes = limits(5000, 32);
        let cache = Cache { data: &shared, limits: &fewer_bytes };
        cache.reconcile(&mut out);
        assert!(cache.meta().0.total_bytes <= 5000);
        assert_eq!(cache.meta().0.total_bytes, shared.stored_bytes());
        let fewer_slots = limits(5000, 4);
        let cache = Cache { data: &shared, limits: &fewer_slots };
        cache.reconcile(&mut out);
        assert_eq!(cache.meta().0, Meta { total_bytes: 0, entries: 0, hand: 0, slots: 4 });
        assert_eq!(shared.stored_bytes(), 0);
    }

    fn slot_index_of_data(shared: &MemShared) -> Vec<u32> {
        shared.map.borrow().iter()
            .filter(|(k, (v, _))| k.starts_with("meshcache:slot:") && !v.is_empty())
            .map(|(k, _)| k["meshcache:slot:".len()..].parse().unwrap())
            .collect()
    }

    #[test]
    fn concurrent_misses_into_an_empty_slot_store_once() {
        let shared = MemShared::default();
        let l = limits(1 << 20, 8);
        let cache = Cache { data: &shared, limits: &l };
        let mut out = Outcome::default();
        cache.reconcile(&mut out);
        // Three slow misses for the same key looked up before any of them stored.
        let seen: Vec<Option<SlotSeen>> = (0..3)
            .map(|_| match cache.lookup(&key(5), 0, &mut out) {
                Lookup::Miss(s) => s,
                other => panic!("{:?}", other),
            })
            .collect();
        let results: Vec<_> = seen.iter().map(|s| cache.insert(&entry(5, b"answer", 10), *s, &mut out)).collect();
        assert_eq!(results, vec![Ok(()), Err(StoreError::Contended), Err(StoreError::Contended)]);
        assert_eq!(cache.meta().0.entries, 1);
        assert_eq!(cache.meta().0.total_bytes, shared.stored_bytes());
    }

    #[test]
    fn a_missing_slot_is_never_written() {
        let shared = MemShared::default();
        let l = limits(1 << 20, 8);
        let cache = Cache { data: &shared, limits: &l };
        // No reconcile yet: no layout, no slots.
        assert_eq!(cache.insert(&entry(1, b"x", 10), None, &mut Outcome::default()), Err(StoreError::Contended));
        assert_eq!(shared.stored_bytes(), 0);
    }

    #[test]
    fn stores_of_an_old_slot_count_never_leak() {
        let shared = MemShared::default();
        let eight = limits(1 << 20, 8);
        let four = limits(1 << 20, 4);
        let mut out = Outcome::default();
        let old = Cache { data: &shared, limits: &eight };
        old.reconcile(&mut out);
        // A miss looked up under 8 slots; the configuration changes to 4; then it stores.
        let k = 7u32; // slot 7 of 8: out of range for 4
        let seen = match old.lookup(&key(k), 0, &mut out) {
            Lookup::Miss(s) => s,
            other => panic!("{:?}", other),
        };
        Cache { data: &shared, limits: &four }.reconcile(&mut out);
        assert_eq!(old.insert(&entry(k, b"late", 10), seen, &mut out), Err(StoreError::Contended));
        assert!(slot_index_of_data(&shared).is_empty());
        let new = Cache { data: &shared, limits: &four };
        assert_eq!(new.meta().0.total_bytes, shared.stored_bytes());
        // Later stores are not refused as store-full.
        for n in 0..20 {
            new.insert(&entry(n, &[1u8; 100], 10), None, &mut out).unwrap();
        }
        assert_eq!(new.meta().0.total_bytes, shared.stored_bytes());
        assert!(slot_index_of_data(&shared).iter().all(|&i| i < 4));
    }

    /// Runs `hook` once, just before the first write to a slot key: a configuration change
    /// landing between a writer's reservation and its slot write.
    struct Interleave<'a> {
        inner: &'a MemShared,
        hook: RefCell<Option<Box<dyn FnOnce() + 'a>>>,
    }

    impl<'a> SharedData for Interleave<'a> {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
            if key.starts_with("meshcache:slot:") && !value.is_empty() {
                if let Some(h) = self.hook.borrow_mut().take() {
                    h();
                }
            }
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn a_layout_change_between_reservation_and_write_is_undone_by_the_writer() {
        let shared = MemShared::default();
        let eight = limits(1 << 20, 8);
        let two = limits(1 << 20, 2);
        let mut out = Outcome::default();
        Cache { data: &shared, limits: &eight }.reconcile(&mut out);
        for (slots, k) in [(two.clone(), 7u32), (eight.clone(), 6u32)] {
            let hooked = Interleave {
                inner: &shared,
                hook: RefCell::new(Some(Box::new(|| {
                    Cache { data: &shared, limits: &slots }.reconcile(&mut Outcome::default())
                }))),
            };
            let current = if slots.max_entries == 2 { &eight } else { &two };
            let writer = Cache { data: &hooked, limits: current };
            assert_eq!(writer.insert(&entry(k, b"in flight", 10), None, &mut out), Err(StoreError::Contended));
            let m = Cache::read_only(&shared).meta().0;
            assert_eq!(m.total_bytes, shared.stored_bytes(), "accounting equals what is stored");
            assert_eq!(m.entries as usize, slot_index_of_data(&shared).len());
        }
    }

    #[test]
    fn corrupt_slot_is_a_counted_miss() {
        let shared = MemShared::default();
        let l = limits(1 << 20, 4);
        let cache = Cache { data: &shared, limits: &l };
        cache.reconcile(&mut Outcome::default());
        let k = key(2);
        shared.set(&slot_key(slot_of(&k, 4)), b"junk-junk-junk-junk-junk-junk-junk-junk", 0);
        let mut out = Outcome::default();
        assert!(matches!(cache.lookup(&k, 0, &mut out), Lookup::Miss(_)));
        assert_eq!(out.corrupt, 1);
    }
}
