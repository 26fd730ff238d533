//! The bounded cache over Envoy shared data (process-wide, shared by all worker threads).
//!
//! Layout: `max_entries` fixed slots (`meshcache:slot:<i>`, direct-mapped by key digest) and one
//! accounting record (`meshcache:meta`, entries and bytes per policy: `accounting.rs`; each slot's
//! value carries its policy's tag). The number of keys is bounded by construction; bytes are
//! bounded by reserving space in the accounting record (compare-and-swap) *before* writing a
//! slot, evicting with a clock hand when full. Every slot change is paired with exactly one
//! accounting change by the same writer, in the bucket of the tag the slot's value carries, so
//! each policy's accounted entries and bytes equal what is stored under its tag:
//! - every slot key exists (created empty by the one root context that switches the layout),
//!   because Envoy treats a compare-and-swap against a missing key as unconditional; a writer
//!   finding a slot missing does not store;
//! - a writer reserves only while the record's slot count is the one it places entries with,
//!   and re-checks it after writing: a layout change meanwhile makes it take its entry back.

pub use crate::accounting::Meta;
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

/// What the *current* policy allows a stored entry at lookup: an entry is fresh until the
/// earliest of its own expiry, `max_ttl_s` after it was stored and, when its TTL came from the
/// policy (`Entry::ttl_from_policy`), `ttl_s` after it was stored. So lowering either TTL
/// (even to 0) reaches entries already stored; raising one does not lengthen them. Past that,
/// it is kept `keep_ms` for the stale windows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    pub keep_ms: u64,
    pub max_ttl_ms: u64,
    pub ttl_ms: u64,
}

impl Lifetime {
    /// Each entry's own expiry only, kept `keep_ms` past it.
    pub fn keeping(keep_ms: u64) -> Lifetime {
        Lifetime { keep_ms, max_ttl_ms: u64::MAX, ttl_ms: u64::MAX }
    }

    pub fn of(policy: &crate::config::Policy) -> Lifetime {
        Lifetime {
            keep_ms: crate::stale::keep_ms(policy),
            max_ttl_ms: policy.max_ttl_s.saturating_mul(1000),
            ttl_ms: policy.ttl_s.saturating_mul(1000),
        }
    }

    /// When `e` stops being fresh under this policy.
    pub fn expires_at(&self, e: &Entry) -> u64 {
        let mut at = e.expires_at_ms.min(e.stored_at_ms.saturating_add(self.max_ttl_ms));
        if e.ttl_from_policy {
            at = at.min(e.stored_at_ms.saturating_add(self.ttl_ms));
        }
        at
    }
}

#[derive(Debug, PartialEq)]
pub enum Lookup {
    Hit(Entry),
    /// Expired, but within what the lookup keeps (`lookup_keeping`): the caller decides what
    /// it may still do (`stale::stale_use`). Storing a fresh answer replaces it (compare-and-
    /// swap against the slot as seen).
    Stale(Entry, SlotSeen),
    /// What the slot held when looked at, when known: storing the answer later can then
    /// compare-and-swap against it without reading the slot again (one VM crossing less).
    Miss(Option<SlotSeen>),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotSeen {
    pub len: usize,
    pub cas: u32,
    /// The policy tag of what the slot held (its accounting bucket).
    pub policy: u64,
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

/// How long past expiry an entry's own stale windows let it be served.
fn stale_keep_ms(e: &Entry) -> u64 {
    (e.stale_if_error_s.max(e.stale_while_revalidate_s) as u64) * 1000
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

    /// Empties slot `i` if it still holds exactly `value` (by cas), releasing its bytes from
    /// the bucket its tag names.
    fn clear_slot(&self, i: u32, value: &[u8], cas: u32) -> bool {
        self.clear_seen_slot(i, value.len(), Entry::peek_policy(value), cas)
    }

    /// `clear_slot` for a value of `len` bytes tagged `tag` (read before it was consumed).
    fn clear_seen_slot(&self, i: u32, len: usize, tag: u64, cas: u32) -> bool {
        if len == 0 || !self.data.set(&slot_key(i), b"", cas) {
            return false;
        }
        self.update_meta(|m| m.remove(tag, stored_size(len)));
        true
    }

    pub fn lookup(&self, key: &KeyDigest, now_ms: u64, out: &mut Outcome) -> Lookup {
        self.lookup_keeping(key, now_ms, Lifetime::keeping(0), out)
    }

    /// Like `lookup`, under the current policy's `life`: an entry expired (as `life` sees it)
    /// less than `life.keep_ms` ago (and less than its own stale windows) is returned as
    /// `Stale` instead of being freed.
    pub fn lookup_keeping(&self, key: &KeyDigest, now_ms: u64, life: Lifetime, out: &mut Outcome) -> Lookup {
        self.lookup_at(slot_of(key, self.limits.max_entries), key, now_ms, life, out)
    }

    /// Looks in slot `i` (where the key's owner placed it) for an entry with this key: fresh,
    /// or expired less than `life.keep_ms` ago and within its stale windows. A returned entry's
    /// `expires_at_ms` is its expiry under `life`.
    pub fn lookup_at(&self, i: u32, key: &KeyDigest, now_ms: u64, life: Lifetime, out: &mut Outcome) -> Lookup {
        let keep_ms = life.keep_ms;
        let (value, cas) = match self.data.get(&slot_key(i)) {
            Some(v) => v,
            // Not created yet (layout being set up): a store must read it again.
            None => return Lookup::Miss(None),
        };
        let seen = Some(SlotSeen { len: value.len(), cas, policy: Entry::peek_policy(&value) });
        if value.is_empty() {
            return Lookup::Miss(seen);
        }
        match Entry::peek_key(&value) {
            Some(k) if k == &key[..] => {}
            Some(_) => return Lookup::Miss(seen),
            None => {
                out.corrupt += 1;
                self.clear_slot(i, &value, cas);
                return Lookup::Miss(None);
            }
        }
        // The value read is the entry's storage from here on: the body is not copied again.
        let (len, tag) = (value.len(), Entry::peek_policy(&value));
        let decoded = Entry::decode_owned(value).map(|e| Entry { expires_at_ms: life.expires_at(&e), ..e });
        match decoded {
            Some(e) if e.expires_at_ms > now_ms => Lookup::Hit(e),
            Some(e) if now_ms - e.expires_at_ms < keep_ms.min(stale_keep_ms(&e)) => {
                let policy = e.policy;
                Lookup::Stale(e, SlotSeen { len, cas, policy })
            }
            Some(_) => {
                // Expired past what may still be served: free the space right away.
                if self.clear_seen_slot(i, len, tag, cas) {
                    out.evicted += 1;
                }
                Lookup::Miss(None)
            }
            None => {
                out.corrupt += 1;
                self.clear_seen_slot(i, len, tag, cas);
                Lookup::Miss(None)
            }
        }
    }

    /// Stores `entry` in its slot. `seen`: the slot as a lookup saw it, if known.
    ///
    /// Shared-data calls: the slot (unless `seen`), the accounting record read and written
    /// once to reserve, the slot written. When full, each eviction reads slots from the clock
    /// hand on to the next occupied one, empties it, and moves the hand, releases the victim's
    /// bytes and (if that made room) reserves ours in a single write of the record. No read
    /// after the write: a layout change writes every slot (`reconcile`), so a slot write
    /// against what was seen before the change fails instead of landing.
    pub fn insert(&self, entry: &Entry, seen: Option<SlotSeen>, out: &mut Outcome) -> Result<(), StoreError> {
        let mut value = entry.encode();
        let size = stored_size(value.len());
        if size > self.limits.max_total_bytes {
            return Err(StoreError::NoSpace);
        }
        let slots = self.limits.max_entries;
        let i = slot_of(&entry.key, slots);
        let (old_len, old_tag, slot_cas) = match seen {
            Some(s) if s.cas != 0 => (s.len, s.policy, s.cas),
            _ => match self.data.get(&slot_key(i)) {
                Some((v, c)) if c != 0 => (v.len(), Entry::peek_policy(&v), c),
                // A missing slot would make the write unconditional: never write one.
                _ => return Err(StoreError::Contended),
            },
        };
        let old_size = stored_size(old_len);
        let was_empty = old_len == 0;
        // What our entry replaces in the accounting: the slot's old value.
        let old = if was_empty { None } else { Some((old_tag, old_size)) };

        // The bucket the entry is counted in: its policy's, or UNATTRIBUTED if the table is full.
        let mut tag = None;
        // Slot reads (and record writes) an insert may spend looking for room.
        let mut budget = MAX_EVICTIONS_PER_INSERT + MAX_CAS_RETRIES;
        while tag.is_none() && budget > 0 {
            budget -= 1;
            let (mut m, meta_cas) = self.meta();
            if m.slots != slots || meta_cas == 0 {
                // The layout is not (or no longer) the one this writer places entries with.
                return Err(StoreError::Contended);
            }
            if let Some(t) = self.reserve(&mut m, size, old, entry.policy) {
                if self.data.set(META_KEY, &m.encode(), meta_cas) {
                    tag = Some(t);
                }
                continue;
            }
            // Full: the next occupied slot from the clock hand on (never our own target slot),
            // at most once round the table.
            let start = m.hand % slots;
            let mut at = start;
            let mut victim = None;
            while budget > 0 {
                budget -= 1;
                let j = at;
                at = (at + 1) % slots;
                if j != i {
                    if let Some((v, c)) = self.data.get(&slot_key(j)) {
                        if !v.is_empty() {
                            victim = Some((j, v, c));
                            break;
                        }
                    }
                }
                if at == start {
                    break;
                }
            }
            m.hand = at;
            let (j, v, c) = match victim {
                Some(found) => found,
                None => {
                    // Nothing to evict within reach: the hand moves on for the next writer.
                    self.data.set(META_KEY, &m.encode(), meta_cas);
                    continue;
                }
            };
            if !self.data.set(&slot_key(j), b"", c) {
                // Changed since we read it: look again.
                continue;
            }
            out.evicted += 1;
            let (victim_size, victim_tag) = (stored_size(v.len()), Entry::peek_policy(&v));
            m.remove(victim_tag, victim_size);
            let ours = self.reserve(&mut m, size, old, entry.policy);
            if self.data.set(META_KEY, &m.encode(), meta_cas) {
                tag = ours;
            } else {
                // The record changed meanwhile: release the victim's bytes on their own.
                self.update_meta(|m| m.remove(victim_tag, victim_size));
            }
        }
        let tag = match tag {
            Some(t) => t,
            None => return Err(StoreError::NoSpace),
        };
        if tag != entry.policy {
            Entry::set_policy(&mut value, tag);
        }
        if self.data.set(&slot_key(i), &value, slot_cas) {
            if !was_empty {
                out.evicted += 1;
            }
            return Ok(());
        }
        // Someone else wrote the slot since we read it (or a layout change emptied it): give
        // the reservation back.
        self.update_meta(|m| {
            m.remove(tag, size);
            if !was_empty {
                m.add(old_tag, old_size);
            }
        });
        Err(StoreError::Contended)
    }

    /// Reserves `size` bytes in `m` for an entry of `policy` replacing `old` (tag and size of
    /// the slot's value, None: empty), if they fit: the bucket the entry is counted in.
    fn reserve(&self, m: &mut Meta, size: u64, old: Option<(u64, u64)>, policy: u64) -> Option<u64> {
        let old_size = old.map_or(0, |(_, s)| s);
        if m.total_bytes().saturating_sub(old_size) + size > self.limits.max_total_bytes {
            return None;
        }
        if let Some((old_tag, old_size)) = old {
            m.remove(old_tag, old_size);
        }
        let tag = m.tag_for(policy);
        m.add(tag, size);
        Some(tag)
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
            let old = m.slots;
            // A record without a layout (first use, or lost: reset by a build that cannot read
            // this format) accounts nothing that is stored: start its buckets from zero.
            let buckets = if old == 0 { Vec::new() } else { m.buckets };
            let switched = Meta { slots, hand: 0, buckets };
            if cas != 0 && self.data.set(META_KEY, &switched.encode(), cas) {
                old_slots = Some(old);
                break;
            }
        }
        if let Some(old) = old_slots {
            // No layout before: no slot is accounted, so slots are emptied without accounting.
            // (Scanned up to the new count only: keys past it are unknown to a lost record.)
            let unaccounted = old == 0;
            for i in 0..old.max(slots) {
                for _ in 0..MAX_CAS_RETRIES {
                    let (v, c) = match self.data.get(&slot_key(i)) {
                        Some(found) => found,
                        None => {
                            // Only the switching context creates slots, and writers never write
                            // a missing one, so this unconditional write overwrites nothing.
                            if i < slots {
                                self.data.set(&slot_key(i), b"", 0);
                            }
                            break;
                        }
                    };
                    // Written even when already empty: its compare-and-swap token changes, so
                    // a writer that reserved under the old layout and writes after this point
                    // fails (`insert` does not read the layout again after writing).
                    if !self.data.set(&slot_key(i), b"", c) {
                        // Such a writer got in between: read it again.
                        continue;
                    }
                    if !v.is_empty() {
                        if !unaccounted {
                            let (size, tag) = (stored_size(v.len()), Entry::peek_policy(&v));
                            self.update_meta(|m| m.remove(tag, size));
                        }
                        out.evicted += 1;
                    }
                    break;
                }
            }
        }
        let mut steps = 0;
        while self.meta().0.total_bytes() > self.limits.max_total_bytes && steps < slots {
            steps += 1;
            let victim = steps - 1;
            if let Some((v, c)) = self.data.get(&slot_key(victim)) {
                if self.clear_slot(victim, &v, c) {
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
        assert_eq!(cache.meta().0.entries(), 0);
        assert_eq!(cache.meta().0.total_bytes(), 0);
        assert_eq!(out.evicted, 1);
    }

    #[test]
    fn expired_entries_are_kept_for_their_stale_window_then_freed() {
        let shared = MemShared::default();
        let l = limits(1 << 20, 16);
        let cache = Cache { data: &shared, limits: &l };
        let mut out = Outcome::default();
        cache.reconcile(&mut out);
        let e = Entry { stale_if_error_s: 5, stale_while_revalidate_s: 2, ..entry(3, b"hello", 2000) };
        cache.insert(&e, None, &mut out).unwrap();
        assert_eq!(cache.lookup_keeping(&key(3), 1999, Lifetime::keeping(60_000), &mut out), Lookup::Hit(e.clone()));
        let seen = match cache.lookup_keeping(&key(3), 2000, Lifetime::keeping(60_000), &mut out) {
            Lookup::Stale(got, seen) => {
                assert_eq!(got, e);
                seen
            }
            other => panic!("{:?}", other),
        };
        // A refreshed answer replaces the stale entry in place (CAS against the slot as seen).
        let fresh = Entry { stored_at_ms: 2500, ..entry(3, b"fresh", 9000) };
        cache.insert(&fresh, Some(seen), &mut out).unwrap();
        assert_eq!(cache.lookup_keeping(&key(3), 8999, Lifetime::keeping(60_000), &mut out), Lookup::Hit(fresh));
        assert_eq!(cache.meta().0.entries(), 1);
        assert_eq!(cache.meta().0.total_bytes(), shared.stored_bytes());
        // Past the entry's own window (5 s), or the caller's (keep_ms), it is a miss and freed.
        let e = Entry { stale_if_error_s: 5, ..entry(4, b"x", 2000) };
        cache.insert(&e, None, &mut out).unwrap();
        assert!(matches!(cache.lookup_keeping(&key(4), 6999, Lifetime::keeping(60_000), &mut out), Lookup::Stale(..)));
        assert!(matches!(cache.lookup_keeping(&key(4), 6999, Lifetime::keeping(1_000), &mut out), Lookup::Miss(None)), "caller keeps 1 s");
        assert_eq!(cache.meta().0.entries(), 1);
        assert_eq!(cache.meta().0.total_bytes(), shared.stored_bytes());
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
            assert!(m.total_bytes() <= l.max_total_bytes);
            assert_eq!(m.total_bytes(), shared.stored_bytes(), "accounting matches what is stored");
            assert!(shared.keys() <= 64 + 1);
        }
        assert!(out.evicted > 900);
        // The most recent entry is always retrievable.
        assert!(matches!(cache.lookup(&key(999), 0, &mut out), Lookup::Hit(_)));
    }

    #[test]
    fn the_current_policy_lifetime_applies_to_stored_entries() {
        // Stored at 1000 for 60 s; a policy lowered to max 10 s (and ttl 5 s) after the fact.
        let shared = MemShared::default();
        let l = limits(1 << 20, 16);
        let cache = Cache { data: &shared, limits: &l };
        let mut out = Outcome::default();
        cache.reconcile(&mut out);
        let lowered = Lifetime { keep_ms: 0, max_ttl_ms: 10_000, ttl_ms: 5_000 };
        let origin = Entry { ttl_from_policy: false, ..entry(1, b"o", 61_000) };
        let policy = Entry { ttl_from_policy: true, ..entry(2, b"p", 61_000) };
        cache.insert(&origin, None, &mut out).unwrap();
        cache.insert(&policy, None, &mut out).unwrap();
        assert_eq!(lowered.expires_at(&origin), 11_000, "max_ttl_s caps every entry");
        assert_eq!(lowered.expires_at(&policy), 6_000, "ttl_s caps entries whose TTL was the policy's");
        assert_eq!(Lifetime { keep_ms: 0, max_ttl_ms: 0, ttl_ms: 0 }.expires_at(&origin), 1000, "0: nothing is fresh");
        assert_eq!(Lifetime::keeping(0).expires_at(&policy), 61_000);
        assert_eq!(Lifetime { keep_ms: 0, max_ttl_ms: 999_000, ttl_ms: 999_000 }.expires_at(&origin), 61_000, "raising never lengthens");
        assert!(matches!(cache.lookup_keeping(&key(1), 10_999, lowered, &mut out), Lookup::Hit(e) if e.expires_at_ms == 11_000));
        assert!(matches!(cache.lookup_keeping(&key(1), 11_000, lowered, &mut out), Lookup::Miss(_)));
        assert!(matches!(cache.lookup_keeping(&key(2), 5_999, lowered, &mut out), Lookup::Hit(_)));
        assert!(matches!(cache.lookup_keeping(&key(2), 6_000, lowered, &mut out), Lookup::Miss(_)));
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
        assert!(matches!(seen, Some(SlotSeen { len: 0, cas, .. }) if cas != 0), "slots exist: a real CAS token");
        cache.insert(&entry(1, b"a", 10), seen, &mut out).unwrap();
        let seen = match cache.lookup(&key(5), 0, &mut out) {
            Lookup::Miss(seen) => seen,
            other => panic!("{:?}", other),
        };
        // Another writer replaces the slot between our lookup and our store.
        cache.insert(&entry(9, b"other", 10), None, &mut out).unwrap();
        assert_eq!(cache.insert(&entry(5, b"late", 10), seen, &mut out), Err(StoreError::Contended));
        assert!(matches!(cache.lookup(&key(9), 0, &mut out), Lookup::Hit(_)));
        assert_eq!(cache.meta().0.total_bytes(), shared.stored_bytes(), "the failed store gave its reservation back");
    }

    #[test]
    fn oversized_and_contended() {
        let shared = MemShared::default();
        let l = limits(1000, 8);
        let cache = Cache { data: &shared, limits: &l };
        let mut out = Outcome::default();
        cache.reconcile(&mut out);
        assert_eq!(cache.insert(&entry(1, &[0u8; 2000], 10), None, &mut out), Err(StoreError::NoSpace));
        assert_eq!(cache.meta().0.total_bytes(), 0);
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
            assert_eq!(cache.meta().0.entries(), 32);
        }
        let fewer_bytes = limits(5000, 32);
        let cache = Cache { data: &shared, limits: &fewer_bytes };
        cache.reconcile(&mut out);
        assert!(cache.meta().0.total_bytes() <= 5000);
        assert_eq!(cache.meta().0.total_bytes(), shared.stored_bytes());
        let fewer_slots = limits(5000, 4);
        let cache = Cache { data: &shared, limits: &fewer_slots };
        cache.reconcile(&mut out);
        assert_eq!(cache.meta().0, Meta { hand: 0, slots: 4, buckets: vec![] });
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
        assert_eq!(cache.meta().0.entries(), 1);
        assert_eq!(cache.meta().0.total_bytes(), shared.stored_bytes());
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
        assert_eq!(new.meta().0.total_bytes(), shared.stored_bytes());
        // Later stores are not refused as store-full.
        for n in 0..20 {
            new.insert(&entry(n, &[1u8; 100], 10), None, &mut out).unwrap();
        }
        assert_eq!(new.meta().0.total_bytes(), shared.stored_bytes());
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
            assert_eq!(m.total_bytes(), shared.stored_bytes(), "accounting equals what is stored");
            assert_eq!(m.entries() as usize, slot_index_of_data(&shared).len());
        }
    }

    /// Counts shared-data calls: in the Wasm host each one is a VM crossing (and a read one
    /// more, for the host to allocate the value in the VM).
    struct Counting<'a> {
        inner: &'a MemShared,
        gets: RefCell<u32>,
        sets: RefCell<u32>,
    }

    impl<'a> SharedData for Counting<'a> {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            *self.gets.borrow_mut() += 1;
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
            *self.sets.borrow_mut() += 1;
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn a_store_reads_the_record_once_and_an_eviction_writes_it_once() {
        let shared = MemShared::default();
        let size = stored_size(entry(0, b"body", 10).encode().len());
        let l = limits(3 * size, 8);
        Cache { data: &shared, limits: &l }.reconcile(&mut Outcome::default());
        let counting = Counting { inner: &shared, gets: RefCell::new(0), sets: RefCell::new(0) };
        let cache = Cache { data: &counting, limits: &l };
        let evicted = RefCell::new(0);
        let store = |n: u32| {
            let mut out = Outcome::default();
            let seen = match cache.lookup(&key(n), 0, &mut out) {
                Lookup::Miss(seen) => seen,
                other => panic!("{:?}", other),
            };
            *counting.gets.borrow_mut() = 0;
            *counting.sets.borrow_mut() = 0;
            cache.insert(&entry(n, b"body", 10), seen, &mut out).unwrap();
            *evicted.borrow_mut() += out.evicted;
            (*counting.gets.borrow(), *counting.sets.borrow())
        };
        // Room: the record read and written (reserving), the slot written. Nothing read back.
        for n in 0..3 {
            assert_eq!(store(n), (1, 2), "store {}", n);
        }
        // Full: slots 0-2 hold entries and the hand is at 0. The victim (slot 0) is read,
        // emptied, and the record written once: hand, the victim's bytes and ours.
        assert_eq!(store(3), (2, 3));
        assert_eq!(*evicted.borrow(), 1);
        // The hand, now at 1, finds slot 1 occupied at once.
        assert_eq!(store(4), (2, 3));
        let m = Cache::read_only(&shared).meta().0;
        assert_eq!((m.entries(), m.total_bytes(), m.hand), (3, shared.stored_bytes(), 2));
        assert!(matches!(Cache { data: &shared, limits: &l }.lookup(&key(0), 0, &mut Outcome::default()), Lookup::Miss(_)));
    }

    #[test]
    fn a_full_cache_with_nothing_to_evict_but_the_target_slot_gives_up() {
        // One slot, and bytes accounted that no slot holds (a smaller layout's leftovers
        // before the switch releases them): the only slot is the writer's own, never a victim.
        let shared = MemShared::default();
        let l = limits(1000, 1);
        let cache = Cache { data: &shared, limits: &l };
        cache.reconcile(&mut Outcome::default());
        cache.update_meta(|m| m.add(7, 900));
        assert_eq!(cache.insert(&entry(1, &[0u8; 200], 10), None, &mut Outcome::default()), Err(StoreError::NoSpace));
        assert_eq!(shared.stored_bytes(), 0);
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

#[cfg(test)]
pub mod per_policy_tests {
    //! Per-policy accounting: every bucket of the accounting record equals the entries and
    //! bytes stored under its tag, whatever interleaving of writers, layout changes, evictions
    //! and corrupt slots led there.
    use super::tests::MemShared;
    use super::*;
    use crate::accounting::{policy_tag, UNATTRIBUTED};
    use crate::entry::sample;
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    /// (entries, bytes) per tag, counted from the slots' values.
    fn stored_by_tag<'v, I: Iterator<Item = &'v Vec<u8>>>(values: I) -> BTreeMap<u64, (i64, i64)> {
        let mut out = BTreeMap::new();
        for v in values.filter(|v| !v.is_empty()) {
            let e = out.entry(Entry::peek_policy(v)).or_insert((0, 0));
            e.0 += 1;
            e.1 += stored_size(v.len()) as i64;
        }
        out
    }

    fn accounted(m: &Meta) -> BTreeMap<u64, (i64, i64)> {
        m.buckets.iter().map(|b| (b.tag, (b.entries as i64, b.bytes))).collect()
    }

    fn slot_values(shared: &MemShared, slots: u32) -> Vec<Vec<u8>> {
        (0..slots.max(64)).filter_map(|i| shared.get(&slot_key(i)).map(|(v, _)| v)).collect()
    }

    fn assert_exact<S: SharedData>(cache: &Cache<S>, values: &[Vec<u8>], what: &str) {
        let m = cache.meta().0;
        assert_eq!(accounted(&m), stored_by_tag(values.iter()), "per-policy accounting after {}", what);
        let (entries, bytes) = stored_by_tag(values.iter()).values().fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        assert_eq!((m.entries() as i64, m.total_bytes() as i64), (entries, bytes), "totals after {}", what);
    }

    use crate::test_rng::Rng;

    const POLICIES: [&str; 4] = ["resnet", "bert", "llama-3", "whisper"];

    fn key(n: u64) -> KeyDigest {
        let mut k = [0u8; 32];
        k[..8].copy_from_slice(&n.to_be_bytes());
        k[..4].copy_from_slice(&((n as u32).wrapping_mul(2_654_435_761)).to_be_bytes());
        k
    }

    fn entry_of(rng: &mut Rng, n: u64) -> Entry {
        let body = vec![b'x'; 1 + rng.below(3000) as usize];
        let policy = policy_tag(POLICIES[(n % POLICIES.len() as u64) as usize]);
        Entry { key: key(n), policy, ..sample(0, &body, 1 + rng.below(2000)) }
    }

    #[test]
    fn buckets_equal_what_is_stored_under_random_operations() {
        for seed in 1..=40u64 {
            let shared = MemShared::default();
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let mut lim = Limits { max_entry_bytes: 1 << 20, max_total_bytes: 40_000, max_entries: 16 };
            Cache { data: &shared, limits: &lim }.reconcile(&mut Outcome::default());
            // Misses looked up earlier whose answers are stored later (concurrent streams).
            let mut pending: Vec<(Option<SlotSeen>, Entry, Limits)> = Vec::new();
            for step in 0..400 {
                let cache = Cache { data: &shared, limits: &lim };
                let mut out = Outcome::default();
                let now = rng.below(2000);
                let n = rng.below(48);
                let what = match rng.below(10) {
                    0..=2 => {
                        let _ = cache.insert(&entry_of(&mut rng, n), None, &mut out);
                        "insert"
                    }
                    3..=4 => {
                        if let Lookup::Miss(seen) = cache.lookup(&key(n), now, &mut out) {
                            let e = entry_of(&mut rng, n);
                            pending.push((seen, e, lim.clone()));
                        }
                        "lookup"
                    }
                    5..=6 if !pending.is_empty() => {
                        // A store with what its lookup saw, possibly under an older layout.
                        let (seen, e, l) = pending.swap_remove(rng.below(pending.len() as u64) as usize);
                        let _ = Cache { data: &shared, limits: &l }.insert(&e, seen, &mut out);
                        "late store"
                    }
                    7 => {
                        lim = Limits {
                            max_entry_bytes: 1 << 20,
                            max_total_bytes: [8_000, 20_000, 40_000, 100_000][rng.below(4) as usize],
                            max_entries: [4, 8, 16, 32][rng.below(4) as usize],
                        };
                        Cache { data: &shared, limits: &lim }.reconcile(&mut out);
                        "reconcile"
                    }
                    8 => {
                        // Bit rot in a stored entry: same length and tag, undecodable.
                        let i = rng.below(lim.max_entries as u64) as u32;
                        if let Some((mut v, c)) = shared.get(&slot_key(i)) {
                            if !v.is_empty() {
                                let splice_at = v.len() - 18; // the splice byte, before the stale windows (8), the TTL source (1) and the usage (8)
                                v[splice_at] = 9; // no such splice form
                                assert!(Entry::decode(&v).is_none());
                                shared.set(&slot_key(i), &v, c);
                                if let Some(k) = Entry::peek_key(&v) {
                                    let mut kd = [0u8; 32];
                                    kd.copy_from_slice(k);
                                    cache.lookup_at(i, &kd, 0, Lifetime::keeping(0), &mut out);
                                    assert_eq!(out.corrupt, 1);
                                }
                            }
                        }
                        "corrupt slot"
                    }
                    _ => {
                        let _ = cache.lookup(&key(n), now, &mut out);
                        "lookup (expiry)"
                    }
                };
                let values = slot_values(&shared, 64);
                let cache = Cache { data: &shared, limits: &lim };
                assert_exact(&cache, &values, &format!("seed {} step {}: {}", seed, step, what));
                assert!(cache.meta().0.total_bytes() <= 100_000);
            }
        }
    }

    /// Envoy's shared data under real threads: each get/set is atomic, nothing more.
    #[derive(Default)]
    pub struct ThreadShared {
        map: Mutex<(BTreeMap<String, (Vec<u8>, u32)>, u32)>,
    }

    impl SharedData for ThreadShared {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.map.lock().unwrap().0.get(key).cloned()
        }
        fn set(&self, key: &str, value: &[u8], cas: u32) -> bool {
            let mut g = self.map.lock().unwrap();
            let (map, next) = &mut *g;
            if let Some((_, current)) = map.get(key) {
                if cas != 0 && cas != *current {
                    return false;
                }
            }
            *next += 1;
            let c = *next;
            map.insert(key.to_string(), (value.to_vec(), c));
            true
        }
    }

    #[test]
    fn concurrent_workers_keep_every_bucket_exact() {
        let shared = ThreadShared::default();
        let lim = Limits { max_entry_bytes: 1 << 20, max_total_bytes: 30_000, max_entries: 8 };
        Cache { data: &shared, limits: &lim }.reconcile(&mut Outcome::default());
        let stored = std::sync::atomic::AtomicU32::new(0);
        std::thread::scope(|scope| {
            for worker in 0..4u64 {
                let (shared, lim, stored) = (&shared, &lim, &stored);
                scope.spawn(move || {
                    let mut rng = Rng(0x1234_5678 + worker * 7919);
                    let cache = Cache { data: shared, limits: lim };
                    for _ in 0..3000 {
                        let n = rng.below(24);
                        let mut out = Outcome::default();
                        if let Lookup::Miss(seen) = cache.lookup(&key(n), rng.below(2000), &mut out) {
                            let e = entry_of(&mut rng, n);
                            if cache.insert(&e, seen, &mut out).is_ok() {
                                stored.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                    }
                });
            }
        });
        assert!(stored.load(std::sync::atomic::Ordering::Relaxed) > 1000, "the workers did store");
        let values: Vec<Vec<u8>> = shared.map.lock().unwrap().0.iter()
            .filter(|(k, _)| k.starts_with("meshcache:slot:")).map(|(_, (v, _))| v.clone()).collect();
        let cache = Cache { data: &shared, limits: &lim };
        assert_exact(&cache, &values, "4 concurrent workers");
        assert!(cache.meta().0.buckets.iter().all(|b| b.entries > 0 && b.bytes > 0), "no bucket left negative");
    }

    #[test]
    fn entries_past_a_full_policy_table_count_as_unattributed() {
        let shared = MemShared::default();
        let lim = Limits { max_entry_bytes: 1 << 20, max_total_bytes: 1 << 30, max_entries: 1024 };
        let cache = Cache { data: &shared, limits: &lim };
        cache.reconcile(&mut Outcome::default());
        // 300 policies, one entry each: the table keeps 255 of them, the rest are unattributed.
        let mut rng = Rng(99);
        for n in 0..300u64 {
            let e = Entry { policy: policy_tag(&format!("model-{}", n)), ..entry_of(&mut rng, n) };
            cache.insert(&e, None, &mut Outcome::default()).unwrap();
        }
        let m = cache.meta().0;
        assert_eq!(m.buckets.len(), crate::accounting::MAX_BUCKETS);
        assert_eq!(m.of(UNATTRIBUTED).0, 300 - 255);
        assert_exact(&cache, &slot_values(&shared, 1024), "a full table");
    }

    #[test]
    fn a_record_reset_by_another_build_is_rebuilt_without_negative_buckets() {
        let shared = MemShared::default();
        let lim = Limits { max_entry_bytes: 1 << 20, max_total_bytes: 1 << 20, max_entries: 16 };
        let cache = Cache { data: &shared, limits: &lim };
        cache.reconcile(&mut Outcome::default());
        let mut rng = Rng(5);
        for n in 0..10 {
            cache.insert(&entry_of(&mut rng, n), None, &mut Outcome::default()).unwrap();
        }
        // An older build read the record as empty and wrote its own format back: no layout.
        let (_, c) = shared.get(META_KEY).unwrap();
        shared.set(META_KEY, &[0u8; 20], c);
        assert_eq!(cache.insert(&entry_of(&mut rng, 11), None, &mut Outcome::default()), Err(StoreError::Contended));
        let mut out = Outcome::default();
        cache.reconcile(&mut out);
        assert!(out.evicted >= 8, "the unaccounted entries are emptied");
        assert_exact(&cache, &slot_values(&shared, 16), "rebuilding a lost record");
        assert!(cache.meta().0.buckets.is_empty(), "nothing negative left behind");
        for n in 20..30 {
            cache.insert(&entry_of(&mut rng, n), None, &mut Outcome::default()).unwrap();
        }
        assert_exact(&cache, &slot_values(&shared, 16), "storing after the rebuild");
    }
}
