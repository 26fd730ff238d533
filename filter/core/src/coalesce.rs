//! Request coalescing: the first miss for a key leads (goes upstream), identical requests that
//! arrive while it is in flight wait and are answered from the entry it stores.
//!
//! Two parts, both plain Rust:
//! - `LockTable`: which key is in flight, process-wide, in Envoy shared data. A fixed table of
//!   `LOCK_SLOTS` slots (`meshcache:lock:<i>`), created empty once, because Envoy treats a
//!   compare-and-swap against a missing key as unconditional. A slot holds one in-flight key:
//!   its leader, the leader's lease, and the wake queues of the workers with waiters. Keys that
//!   share a slot while one is in flight are not coalesced (they go upstream as before).
//! - `Waiters`: one worker's paused requests, by key, with their deadlines; bounded per key and
//!   in all.
//!
//! The leader's release empties its slot (compare-and-swap) and sends `(key, outcome)` to every
//! queue the slot listed; each worker then resumes its own waiters for that key.

use crate::cache_control::NotStored;
use crate::config::Policy;
use crate::hashing::KeyDigest;
use crate::stale::{self, StaleUse};
use crate::entry::Entry;
use crate::metric_names as m;
use crate::names;
use crate::request::Cacheable;
use crate::store::{Cache, Lifetime, Lookup, Outcome, SharedData};
use std::collections::HashMap;

pub const LOCK_SLOTS: u32 = 1024;
/// Distinct worker queues one in-flight key can wake (Envoy's `--concurrency` beyond this: the
/// extra workers' requests go upstream instead of waiting).
pub const MAX_QUEUES_PER_LOCK: usize = 64;
/// Per worker: requests waiting on one key, and on all keys.
pub const MAX_WAITERS_PER_KEY: usize = 64;
pub const MAX_WAITERS: usize = 512;
const READY_KEY: &str = "meshcache:locks";
const MAX_CAS_RETRIES: usize = 16;
const HEADER_LEN: usize = 1 + 32 + 8 + 8 + 2;
const VERSION: u8 = 1;

pub fn lock_key(i: u32) -> String {
    format!("meshcache:lock:{}", i)
}

/// Bytes 4..8 of the key digest (the store's slot uses 0..4).
pub fn lock_slot_of(key: &KeyDigest) -> u32 {
    u32::from_be_bytes([key[4], key[5], key[6], key[7]]) % LOCK_SLOTS
}

/// What a released key's waiters do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// The answer was stored: look it up.
    Stored,
    /// The leader failed in a way another try may not (5xx, reset, contention): one waiter
    /// becomes the new leader, the others keep waiting (within their own deadline).
    Retry,
    /// The answer cannot be stored for any of them (no-store, Vary, too big, 4xx, ...): each
    /// waiter goes upstream itself.
    Uncacheable,
    /// The origin failed (what stale-if-error covers: 500/502/503/504, gRPC UNAVAILABLE,
    /// DEADLINE_EXCEEDED, INTERNAL): waiters answer from an expired entry their policy lets
    /// them use, else as for `Retry`.
    OriginError,
}

impl Release {
    /// One waiter leads anew (the others wait again).
    pub fn retries(self) -> bool {
        matches!(self, Release::Retry | Release::OriginError)
    }
}

impl Release {
    fn byte(self) -> u8 {
        match self {
            Release::Stored => 0,
            Release::Retry => 1,
            Release::Uncacheable => 2,
            Release::OriginError => 3,
        }
    }

    fn from_byte(b: u8) -> Option<Release> {
        match b {
            0 => Some(Release::Stored),
            1 => Some(Release::Retry),
            2 => Some(Release::Uncacheable),
            3 => Some(Release::OriginError),
            _ => None,
        }
    }

    /// The waiters' outcome when the leader's answer was not stored for this reason.
    pub fn not_stored(why: NotStored) -> Release {
        match why {
            NotStored::GrpcStatus | NotStored::StoreFull | NotStored::Contended | NotStored::Error => Release::Retry,
            _ => Release::Uncacheable,
        }
    }

    /// A leader answered with this HTTP status (not 200; `origin_error`: one stale-if-error
    /// covers): server-side failures may pass.
    pub fn for_status(status: u16, origin_error: bool) -> Release {
        if origin_error {
            Release::OriginError
        } else if status >= 500 || status == 429 || status == 408 {
            Release::Retry
        } else {
            Release::Uncacheable
        }
    }
}

/// What a waiter does when it leaves the wait, from what its own lookup then found (both hosts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterWait {
    /// The leader's entry is there: answer from it (`collapsed`).
    Answer,
    /// The leader's origin failed and the expired entry may stand in for it (stale-if-error):
    /// answer from it at once.
    AnswerStale(StaleUse),
    /// The leader failed in a way another try may not: lead or wait again (within its deadline).
    TryAgain,
    /// Go upstream itself (forwarding an expired entry the lookup found).
    Upstream,
}

/// `release`: the leader's outcome (None: the waiter timed out at `deadline_ms`).
pub fn after_wait(found: &Lookup, policy: &Policy, release: Option<Release>, now_ms: u64, deadline_ms: u64) -> AfterWait {
    if let Lookup::Hit(_) = found {
        return AfterWait::Answer;
    }
    if let (Lookup::Stale(entry, _), Some(Release::OriginError)) = (found, release) {
        if let Some(u) = stale::stale_use(entry, policy, now_ms).filter(|u| u.if_error) {
            return AfterWait::AnswerStale(u);
        }
    }
    if release.map_or(false, Release::retries) && now_ms < deadline_ms {
        AfterWait::TryAgain
    } else {
        AfterWait::Upstream
    }
}

/// What a waiter does when it leaves the wait (both hosts' `resume_waiter`).
pub enum Woken {
    /// Answer from `entry` with this `Cache-Status` (the leader's entry, `collapsed`; or an
    /// expired one standing in for the leader's origin error).
    Answer { entry: Entry, cache_status: String },
    /// Go upstream: after `again` lead or wait once more first (within the deadline);
    /// `expired`, the entry the lookup found past its TTL, stands by for stale-if-error.
    Upstream { again: bool, expired: Option<Entry> },
}

/// Waiter `c` leaves the wait (`release`: its leader's outcome; None: it timed out at
/// `deadline_ms`): looks its key up again, keeping what stale-if-error may still use (a woken
/// waiter must not free it), and says what it does; `c.seen` is what the lookup saw. `count`
/// gets the coalescing counters it moves.
#[allow(clippy::too_many_arguments)]
pub fn wake<S: SharedData>(cache: &Cache<S>, c: &mut Cacheable, release: Option<Release>, now_ms: u64, deadline_ms: u64,
                           out: &mut Outcome, count: &mut dyn FnMut(&'static str)) -> Woken {
    let found = cache.lookup_keeping(&c.key, now_ms, Lifetime::of(&c.policy), out);
    let after = after_wait(&found, &c.policy, release, now_ms, deadline_ms);
    let (expired, seen) = match found {
        Lookup::Hit(entry) => {
            count(m::COALESCE_SERVED);
            return Woken::Answer { entry, cache_status: names::CACHE_STATUS_COLLAPSED.to_string() };
        }
        Lookup::Stale(entry, seen) => {
            if let AfterWait::AnswerStale(u) = after {
                // Every waiter is answered with the expired entry at once.
                count(m::COALESCE_SERVED);
                count(m::STALE_IF_ERROR);
                let cache_status = names::cache_status_collapsed(&names::cache_status_stale_if_error(u.past_s(), None));
                return Woken::Answer { entry, cache_status };
            }
            (Some(entry), Some(seen))
        }
        Lookup::Miss(seen) => (None, seen),
    };
    if release.is_some() {
        count(m::COALESCE_RELEASED);
    }
    c.seen = seen;
    Woken::Upstream { again: after == AfterWait::TryAgain, expired }
}

/// A wake message: `(key, outcome)`.
pub fn encode_wake(key: &KeyDigest, outcome: Release) -> [u8; 33] {
    let mut m = [0u8; 33];
    m[..32].copy_from_slice(key);
    m[32] = outcome.byte();
    m
}

pub fn decode_wake(m: &[u8]) -> Option<(KeyDigest, Release)> {
    if m.len() != 33 {
        return None;
    }
    let mut key = [0u8; 32];
    key.copy_from_slice(&m[..32]);
    Some((key, Release::from_byte(m[32])?))
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Record {
    key: KeyDigest,
    owner: u64,
    lease_until_ms: u64,
    queues: Vec<u32>,
}

impl Record {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + 4 * self.queues.len());
        out.push(VERSION);
        out.extend_from_slice(&self.key);
        out.extend_from_slice(&self.owner.to_be_bytes());
        out.extend_from_slice(&self.lease_until_ms.to_be_bytes());
        out.extend_from_slice(&(self.queues.len() as u16).to_be_bytes());
        for q in &self.queues {
            out.extend_from_slice(&q.to_be_bytes());
        }
        out
    }

    fn decode(b: &[u8]) -> Option<Record> {
        if b.len() < HEADER_LEN || b[0] != VERSION {
            return None;
        }
        let u64_at = |i: usize| {
            let mut t = [0u8; 8];
            t.copy_from_slice(&b[i..i + 8]);
            u64::from_be_bytes(t)
        };
        let mut key = [0u8; 32];
        key.copy_from_slice(&b[1..33]);
        let n = u16::from_be_bytes([b[49], b[50]]) as usize;
        if n > MAX_QUEUES_PER_LOCK || b.len() != HEADER_LEN + 4 * n {
            return None;
        }
        let queues = b[HEADER_LEN..].chunks(4).map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]])).collect();
        Some(Record { key, owner: u64_at(33), lease_until_ms: u64_at(41), queues })
    }
}

/// The leader's hold on a key's slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    pub slot: u32,
    pub owner: u64,
    pub key: KeyDigest,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Join {
    /// No one had this key in flight: go upstream and `release` when done.
    Lead(Ticket),
    /// It is in flight and this worker's queue is listed: wait for the wake.
    Wait,
    /// The slot holds another key in flight: not coalesced.
    Busy,
    /// Too many workers wait on this key already: not coalesced.
    Full,
    /// The table is not set up yet, or writers kept colliding: not coalesced.
    Unavailable,
}

pub struct LockTable<'a, S: SharedData> {
    pub data: &'a S,
}

impl<'a, S: SharedData> LockTable<'a, S> {
    /// Creates the slots once per process (per vm_id). Two workers configuring at the same
    /// instant may both create a slot; the later write can only clear a lock taken in between,
    /// whose waiters then wait out their deadline (see docs/filter.md).
    pub fn create_slots(&self) {
        if self.data.get(READY_KEY).is_some() {
            return;
        }
        for i in 0..LOCK_SLOTS {
            if self.data.get(&lock_key(i)).is_none() {
                self.data.set(&lock_key(i), b"", 0);
            }
        }
        self.data.set(READY_KEY, b"1", 0);
    }

    /// Lead or wait on `key`. `owner` identifies the leader (unique per stream in the process);
    /// `queue` is this worker's wake queue; `lease_ms` bounds how long a lock outlives a leader
    /// that never releases it (a worker that died with it).
    pub fn join(&self, key: &KeyDigest, owner: u64, queue: u32, now_ms: u64, lease_ms: u64) -> Join {
        let slot = lock_slot_of(key);
        let name = lock_key(slot);
        for _ in 0..MAX_CAS_RETRIES {
            let (value, cas) = match self.data.get(&name) {
                Some((v, c)) if c != 0 => (v, c),
                _ => return Join::Unavailable,
            };
            let current = Record::decode(&value).filter(|r| r.lease_until_ms > now_ms);
            let next = match current {
                Some(r) if &r.key != key => return Join::Busy,
                Some(r) if r.queues.contains(&queue) => return Join::Wait,
                Some(r) if r.queues.len() >= MAX_QUEUES_PER_LOCK => return Join::Full,
                Some(mut r) => {
                    r.queues.push(queue);
                    if self.data.set(&name, &r.encode(), cas) {
                        return Join::Wait;
                    }
                    continue;
                }
                None => {
                    // Free, unreadable or expired. An expired lock of the same key keeps its
                    // waiters' queues: the new leader's release wakes them.
                    let queues = Record::decode(&value).filter(|r| &r.key == key).map(|r| r.queues).unwrap_or_default();
                    Record { key: *key, owner, lease_until_ms: now_ms.saturating_add(lease_ms.max(1)), queues }
                }
            };
            if self.data.set(&name, &next.encode(), cas) {
                return Join::Lead(Ticket { slot, owner, key: *key });
            }
        }
        Join::Unavailable
    }

    /// Frees the leader's slot; returns the queues to wake. A lock that expired and was taken
    /// over for the same key is left to its new leader, but its queues are woken too (the entry
    /// this leader stored answers them).
    pub fn release(&self, t: &Ticket) -> Vec<u32> {
        let name = lock_key(t.slot);
        for _ in 0..MAX_CAS_RETRIES {
            let (value, cas) = match self.data.get(&name) {
                Some(v) => v,
                None => return Vec::new(),
            };
            let r = match Record::decode(&value) {
                Some(r) if r.key == t.key => r,
                _ => return Vec::new(),
            };
            if r.owner != t.owner {
                return r.queues;
            }
            if cas != 0 && self.data.set(&name, b"", cas) {
                return r.queues;
            }
        }
        Vec::new()
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    KeyFull,
    AllFull,
}

/// One worker's waiting requests (stream ids) by key, with their deadlines.
#[derive(Default)]
pub struct Waiters {
    by_key: HashMap<KeyDigest, Vec<u32>>,
    of_stream: HashMap<u32, (KeyDigest, u64)>,
}

impl Waiters {
    pub fn len(&self) -> usize {
        self.of_stream.len()
    }

    pub fn is_empty(&self) -> bool {
        self.of_stream.is_empty()
    }

    pub fn add(&mut self, key: &KeyDigest, stream: u32, deadline_ms: u64) -> Result<(), Refused> {
        if self.of_stream.contains_key(&stream) {
            self.remove(stream);
        }
        if self.of_stream.len() >= MAX_WAITERS {
            return Err(Refused::AllFull);
        }
        let list = self.by_key.entry(*key).or_insert_with(Vec::new);
        if list.len() >= MAX_WAITERS_PER_KEY {
            return Err(Refused::KeyFull);
        }
        list.push(stream);
        self.of_stream.insert(stream, (*key, deadline_ms));
        Ok(())
    }

    /// Everyone waiting on `key` (they leave the table), in arrival order.
    pub fn take(&mut self, key: &KeyDigest) -> Vec<(u32, u64)> {
        let streams = self.by_key.remove(key).unwrap_or_default();
        streams.into_iter().filter_map(|s| self.of_stream.remove(&s).map(|(_, d)| (s, d))).collect()
    }

    /// A stream that ended (or was answered otherwise) stops waiting.
    pub fn remove(&mut self, stream: u32) {
        if let Some((key, _)) = self.of_stream.remove(&stream) {
            if let Some(list) = self.by_key.get_mut(&key) {
                list.retain(|s| *s != stream);
                if list.is_empty() {
                    self.by_key.remove(&key);
                }
            }
        }
    }

    /// Waiters whose deadline has passed (they leave the table).
    pub fn expired(&mut self, now_ms: u64) -> Vec<u32> {
        let late: Vec<u32> = self.of_stream.iter().filter(|(_, (_, d))| *d <= now_ms).map(|(s, _)| *s).collect();
        for s in &late {
            self.remove(*s);
        }
        late
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::MemShared;

    fn key(n: u8) -> KeyDigest {
        let mut k = [n; 32];
        k[4..8].copy_from_slice(&(n as u32).to_be_bytes());
        k
    }

    /// Same lock slot as `key(n)`, different key.
    fn twin(n: u8) -> KeyDigest {
        let mut k = key(n);
        k[31] ^= 0xff;
        k
    }

    /// The ticket of a join that must have led.
    fn led(j: Join) -> Ticket {
        match j {
            Join::Lead(ticket) => ticket,
            other => panic!("expected to lead, got {:?}", other),
        }
    }

    fn table(shared: &MemShared) -> LockTable<'_, MemShared> {
        let t = LockTable { data: shared };
        t.create_slots();
        t
    }

    #[test]
    fn first_leads_others_wait_release_wakes_each_queue_once() {
        let shared = MemShared::default();
        let t = table(&shared);
        let lead = led(t.join(&key(1), 7, 100, 1000, 5000));
        assert_eq!(t.join(&key(1), 8, 100, 1001, 5000), Join::Wait);
        assert_eq!(t.join(&key(1), 9, 200, 1002, 5000), Join::Wait);
        assert_eq!(t.join(&key(1), 10, 200, 1003, 5000), Join::Wait);
        assert_eq!(t.join(&twin(1), 11, 100, 1003, 5000), Join::Busy, "another key in the same slot");
        assert!(matches!(t.join(&key(2), 12, 100, 1003, 5000), Join::Lead(_)), "other slots are independent");
        assert_eq!(t.release(&lead), vec![100, 200]);
        assert!(matches!(t.join(&key(1), 13, 100, 1004, 5000), Join::Lead(_)), "free again after release");
    }

    #[test]
    fn a_stale_lock_expires_and_keeps_its_waiters_queues() {
        let shared = MemShared::default();
        let t = table(&shared);
        let dead = led(t.join(&key(3), 1, 100, 0, 50));
        assert_eq!(t.join(&key(3), 2, 200, 10, 50), Join::Wait);
        // The leader never releases; after its lease the next request leads.
        let next = led(t.join(&key(3), 3, 300, 50, 50));
        // The old leader's late release does not free the new lock, but wakes its queues.
        assert_eq!(t.release(&dead), vec![200]);
        assert_eq!(t.join(&key(3), 4, 400, 60, 50), Join::Wait);
        assert_eq!(t.release(&next), vec![200, 400]);
        // An expired lock of another key is simply taken.
        assert!(matches!(t.join(&twin(3), 5, 100, 0, 10), Join::Lead(_)));
        assert!(matches!(t.join(&key(3), 6, 100, 20, 10), Join::Lead(_)));
    }

    #[test]
    fn queues_per_lock_are_bounded_and_missing_slots_never_lock() {
        let shared = MemShared::default();
        let t = table(&shared);
        assert!(matches!(t.join(&key(5), 1, 0, 0, 1000), Join::Lead(_)));
        for q in 1..=MAX_QUEUES_PER_LOCK as u32 {
            assert_eq!(t.join(&key(5), 1, q, 0, 1000), Join::Wait);
        }
        assert_eq!(t.join(&key(5), 1, 99_999, 0, 1000), Join::Full);
        let bare = MemShared::default();
        let untouched = LockTable { data: &bare };
        assert_eq!(untouched.join(&key(5), 1, 1, 0, 1000), Join::Unavailable);
        assert_eq!(bare.keys(), 0, "nothing written without the table");
    }

    #[test]
    fn after_the_wait_a_hit_answers_an_origin_error_answers_stale_failures_retry_within_the_deadline() {
        use crate::config::parse_plugin_config;
        use crate::entry::{sample, Entry};
        use crate::store::SlotSeen;
        let policy = parse_plugin_config(br#"{"policies": [{"model_prefix": "m", "ttl_s": 10, "stale_if_error_s": 5}]}"#)
            .unwrap().policies.remove(0);
        let expired = Entry { stale_if_error_s: 60, ..sample(1, b"{}", 1_000) };
        let seen = SlotSeen { len: 0, cas: 1, policy: 0 };
        let stale = Lookup::Stale(expired.clone(), seen);
        let miss = Lookup::Miss(None);
        assert_eq!(after_wait(&Lookup::Hit(expired.clone()), &policy, None, 2_000, 0), AfterWait::Answer, "even after a timeout");
        match after_wait(&stale, &policy, Some(Release::OriginError), 2_000, 9_000) {
            AfterWait::AnswerStale(u) => assert_eq!(u.past_s(), 1),
            other => panic!("{:?}", other),
        }
        assert_eq!(after_wait(&stale, &policy, Some(Release::OriginError), 7_000, 9_000), AfterWait::TryAgain,
                   "past the policy's window: the origin error is retried like any");
        assert_eq!(after_wait(&stale, &policy, Some(Release::Retry), 2_000, 9_000), AfterWait::TryAgain);
        assert_eq!(after_wait(&miss, &policy, Some(Release::Retry), 9_000, 9_000), AfterWait::Upstream, "deadline passed");
        assert_eq!(after_wait(&miss, &policy, Some(Release::Uncacheable), 2_000, 9_000), AfterWait::Upstream);
        assert_eq!(after_wait(&miss, &policy, Some(Release::Stored), 2_000, 9_000), AfterWait::Upstream, "stored, then evicted");
        assert_eq!(after_wait(&miss, &policy, None, 2_000, 9_000), AfterWait::Upstream, "timed out");
    }

    #[test]
    fn corrupt_slot_is_taken_over() {
        let shared = MemShared::default();
        let t = table(&shared);
        shared.set(&lock_key(lock_slot_of(&key(9))), b"\x01garbage", 0);
        assert!(matches!(t.join(&key(9), 1, 1, 0, 1000), Join::Lead(_)));
    }

    #[test]
    fn under_real_threads_exactly_one_leads_and_its_release_names_every_waiting_worker() {
        use crate::store::per_policy_tests::ThreadShared;
        use std::sync::{Barrier, Mutex};
        const WORKERS: u32 = 8;
        let shared = ThreadShared::default();
        LockTable { data: &shared }.create_slots();
        let barrier = Barrier::new(WORKERS as usize);
        let joined: Mutex<Vec<(u32, Join)>> = Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for worker in 0..WORKERS {
                let (shared, barrier, joined) = (&shared, &barrier, &joined);
                scope.spawn(move || {
                    let table = LockTable { data: shared };
                    for round in 0..300u32 {
                        let mut k = [0u8; 32];
                        k[..4].copy_from_slice(&round.to_be_bytes());
                        k[4..8].copy_from_slice(&(round % 7).to_be_bytes());
                        barrier.wait();
                        let j = table.join(&k, (worker as u64) << 32 | round as u64, 100 + worker, 0, 60_000);
                        joined.lock().unwrap().push((worker, j));
                        barrier.wait();
                        let mine = joined.lock().unwrap().iter().find(|(w, _)| *w == worker).map(|(_, j)| match j {
                            Join::Lead(t) => Some(*t),
                            _ => None,
                        });
                        if let Some(Some(ticket)) = mine {
                            let all = joined.lock().unwrap();
                            let leads = all.iter().filter(|(_, j)| matches!(j, Join::Lead(_))).count();
                            assert_eq!(leads, 1, "round {}: {:?}", round, *all);
                            let mut waiting: Vec<u32> =
                                all.iter().filter(|(_, j)| *j == Join::Wait).map(|(w, _)| 100 + w).collect();
                            drop(all);
                            let mut woken = table.release(&ticket);
                            waiting.sort_unstable();
                            woken.sort_unstable();
                            assert_eq!(woken, waiting, "round {}: every waiter's queue is woken once", round);
                            assert_eq!(waiting.len() as u32, WORKERS - 1);
                        }
                        barrier.wait();
                        if worker == 0 {
                            joined.lock().unwrap().clear();
                        }
                        barrier.wait();
                    }
                });
            }
        });
    }

    #[test]
    fn wake_messages_round_trip() {
        for o in [Release::Stored, Release::Retry, Release::Uncacheable, Release::OriginError].iter() {
            assert_eq!(decode_wake(&encode_wake(&key(4), *o)), Some((key(4), *o)));
        }
        assert_eq!(decode_wake(b"short"), None);
        let mut bad = encode_wake(&key(4), Release::Stored);
        bad[32] = 9;
        assert_eq!(decode_wake(&bad), None);
    }

    #[test]
    fn outcomes_of_failed_leaders() {
        assert_eq!(Release::for_status(503, true), Release::OriginError);
        assert_eq!(Release::for_status(501, false), Release::Retry);
        assert_eq!(Release::for_status(429, false), Release::Retry);
        assert_eq!(Release::for_status(404, false), Release::Uncacheable);
        assert!(Release::OriginError.retries() && Release::Retry.retries() && !Release::Uncacheable.retries());
        assert_eq!(Release::not_stored(NotStored::NoStore), Release::Uncacheable);
        assert_eq!(Release::not_stored(NotStored::Vary), Release::Uncacheable);
        assert_eq!(Release::not_stored(NotStored::TooBig), Release::Uncacheable);
        assert_eq!(Release::not_stored(NotStored::GrpcStatus), Release::Retry);
        assert_eq!(Release::not_stored(NotStored::Contended), Release::Retry);
    }

    #[test]
    fn waiters_are_bounded_taken_by_key_and_expire() {
        let mut w = Waiters::default();
        for s in 0..MAX_WAITERS_PER_KEY as u32 {
            w.add(&key(1), s, 100 + s as u64).unwrap();
        }
        assert_eq!(w.add(&key(1), 9999, 100), Err(Refused::KeyFull));
        w.add(&key(2), 5000, 50).unwrap();
        w.remove(3);
        let taken = w.take(&key(1));
        assert_eq!(taken.len(), MAX_WAITERS_PER_KEY - 1);
        assert_eq!(taken[0], (0, 100));
        assert!(taken.iter().all(|(s, _)| *s != 3));
        assert_eq!(w.len(), 1);
        assert_eq!(w.expired(49), Vec::<u32>::new());
        assert_eq!(w.expired(50), vec![5000]);
        assert!(w.is_empty());
        let mut n = 0u32;
        'fill: for k in 0..=255u8 {
            for _ in 0..MAX_WAITERS_PER_KEY {
                if w.len() == MAX_WAITERS {
                    break 'fill;
                }
                w.add(&key(k), n, 1).unwrap();
                n += 1;
            }
        }
        assert_eq!(w.add(&key(200), n, 1), Err(Refused::AllFull));
        // Re-adding a stream (a retry) replaces its old place.
        let mut r = Waiters::default();
        r.add(&key(1), 1, 10).unwrap();
        r.add(&key(1), 1, 10).unwrap();
        assert_eq!(r.take(&key(1)), vec![(1, 10)]);
    }

    #[test]
    fn records_round_trip_and_reject_bad_lengths() {
        let r = Record { key: key(1), owner: 42, lease_until_ms: 99, queues: vec![1, 2, 3] };
        assert_eq!(Record::decode(&r.encode()), Some(r.clone()));
        let mut b = r.encode();
        b.pop();
        assert_eq!(Record::decode(&b), None);
        assert_eq!(Record::decode(b""), None);
    }

    #[test]
    fn a_woken_waiter_answers_from_the_leaders_entry_or_goes_on() {
        let (mut c, limits) = crate::insert::tests::cacheable(4096);
        let data = MemShared::default();
        let cache = Cache { data: &data, limits: &limits };
        cache.reconcile(&mut Outcome::default());
        let mut counted = Vec::new();
        let wake_at = |c: &mut Cacheable, release: Option<Release>, now: u64, counted: &mut Vec<&'static str>| {
            wake(&cache, c, release, now, 1_000, &mut Outcome::default(), &mut |n| counted.push(n))
        };
        // No entry: a leader that may be retried is, within the deadline; past it, upstream.
        assert!(matches!(wake_at(&mut c, Some(Release::Retry), 10, &mut counted), Woken::Upstream { again: true, expired: None }));
        assert!(matches!(wake_at(&mut c, Some(Release::Retry), 1_000, &mut counted), Woken::Upstream { again: false, .. }));
        assert!(matches!(wake_at(&mut c, None, 10, &mut counted), Woken::Upstream { again: false, .. }));
        assert_eq!(counted, vec![m::COALESCE_RELEASED, m::COALESCE_RELEASED], "a timeout is no release");
        // The leader stored its answer: the waiter is answered from it, `collapsed`.
        let headers = vec![(":status".to_string(), "200".to_string())];
        let ttl = crate::cache_control::Ttl { s: 5, from_policy: true };
        crate::insert::store_answer(&cache, &c, &headers, 200, b"{}".to_vec(), ttl, &mut Outcome::default()).unwrap();
        counted.clear();
        let now = c.request_ms;
        match wake_at(&mut c, Some(Release::Stored), now, &mut counted) {
            Woken::Answer { cache_status, .. } => assert_eq!(cache_status, names::CACHE_STATUS_COLLAPSED),
            Woken::Upstream { .. } => panic!("the stored entry answers"),
        }
        assert_eq!(counted, vec![m::COALESCE_SERVED]);
    }
}
