//! Where coalesced requests wait in the native host: the wake mechanism only (who leads, who
//! waits, what a woken waiter does are the core's `coalesce` rules and `flow`).
//!
//! One `Parking` per Envoy process. Each worker (the lock table's "queue": Envoy's worker
//! index) has its own table of waiters (the core's `Waiters`: bounded per key and in all) and,
//! per parked stream, a `Wake` (in Envoy: that stream's scheduler handle). A leader's release
//! wakes the streams parked on its key in every worker the lock listed, from whichever thread
//! the leader runs on; a waiter's deadline is kept by one timer thread (lib.rs) calling
//! `expire`. A `Wake` is used and dropped under its worker's lock, and a stream that goes away
//! takes its own out under the same lock (`unpark`), so no wake reaches a stream after its
//! destroy hook.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use meshcache_core::coalesce::{Refused, Release, Waiters, MAX_QUEUES_PER_LOCK};
use meshcache_core::hashing::KeyDigest;

/// Delivers an event to one parked stream, on that stream's own worker; callable from any
/// thread.
pub trait Wake: Send {
    fn wake(&self, event: u64);
}

/// The event a waiter past its `coalesce_timeout_ms` gets.
pub const EVENT_TIMEOUT: u64 = 16;

/// The event that carries a leader's outcome.
pub fn event_of(release: Release) -> u64 {
    match release {
        Release::Stored => 1,
        Release::Retry => 2,
        Release::Uncacheable => 3,
        Release::OriginError => 4,
    }
}

/// A leader's outcome from its event; None for a timeout (or an unknown event).
pub fn release_of(event: u64) -> Option<Release> {
    match event {
        1 => Some(Release::Stored),
        2 => Some(Release::Retry),
        3 => Some(Release::Uncacheable),
        4 => Some(Release::OriginError),
        _ => None,
    }
}

/// Workers with their own table: the lock table lists at most this many queues per key, so a
/// worker index beyond it could not be woken anyway (its requests go upstream).
pub const MAX_WORKERS: usize = MAX_QUEUES_PER_LOCK;

#[derive(Default)]
struct Worker {
    waiters: Waiters,
    wakes: HashMap<u32, Box<dyn Wake>>,
}

pub struct Parking {
    workers: Vec<Mutex<Worker>>,
    /// Streams parked, all workers: the timer sleeps while it is 0.
    parked: AtomicUsize,
}

impl Default for Parking {
    fn default() -> Self {
        Parking { workers: (0..MAX_WORKERS).map(|_| Mutex::new(Worker::default())).collect(), parked: AtomicUsize::new(0) }
    }
}

impl Parking {
    fn worker(&self, queue: u32) -> Option<std::sync::MutexGuard<'_, Worker>> {
        self.workers.get(queue as usize).map(|w| w.lock().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn parked(&self) -> usize {
        self.parked.load(Ordering::Relaxed)
    }

    /// Parks `stream` of worker `queue` on `key` until woken or `deadline_ms`.
    pub fn park(&self, queue: u32, stream: u32, key: &KeyDigest, deadline_ms: u64, wake: Box<dyn Wake>)
        -> Result<(), Refused> {
        let mut w = self.worker(queue).ok_or(Refused::AllFull)?;
        if w.wakes.remove(&stream).is_some() {
            w.waiters.remove(stream);
            self.parked.fetch_sub(1, Ordering::Relaxed);
        }
        w.waiters.add(key, stream, deadline_ms)?;
        w.wakes.insert(stream, wake);
        self.parked.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// A stream that ends (or stops waiting otherwise) leaves its table; its `Wake` is dropped.
    pub fn unpark(&self, queue: u32, stream: u32) {
        if let Some(mut w) = self.worker(queue) {
            w.waiters.remove(stream);
            if w.wakes.remove(&stream).is_some() {
                self.parked.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// The leader of `key` is done: every stream parked on it in these workers gets `release`.
    pub fn wake(&self, queues: &[u32], key: &KeyDigest, release: Release) {
        for q in queues {
            if let Some(mut w) = self.worker(*q) {
                for (stream, _) in w.waiters.take(key) {
                    if let Some(wake) = w.wakes.remove(&stream) {
                        self.parked.fetch_sub(1, Ordering::Relaxed);
                        wake.wake(event_of(release));
                    }
                }
            }
        }
    }

    /// Waiters whose deadline has passed get `EVENT_TIMEOUT`.
    pub fn expire(&self, now_ms: u64) {
        for w in &self.workers {
            let mut w = w.lock().unwrap_or_else(|p| p.into_inner());
            if w.waiters.is_empty() {
                continue;
            }
            for stream in w.waiters.expired(now_ms) {
                if let Some(wake) = w.wakes.remove(&stream) {
                    self.parked.fetch_sub(1, Ordering::Relaxed);
                    wake.wake(EVENT_TIMEOUT);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    struct Record(Arc<Mutex<Vec<(u32, u64)>>>, u32);

    impl Wake for Record {
        fn wake(&self, event: u64) {
            self.0.lock().unwrap().push((self.1, event));
        }
    }

    #[test]
    fn wakes_reach_only_the_streams_parked_on_the_key_once_and_timeouts_the_late_ones() {
        let p = Parking::default();
        let got = Arc::new(Mutex::new(Vec::new()));
        let rec = |s: u32| Box::new(Record(got.clone(), s)) as Box<dyn Wake>;
        let (a, b) = ([1u8; 32], [2u8; 32]);
        p.park(0, 1, &a, 100, rec(1)).unwrap();
        p.park(1, 2, &a, 100, rec(2)).unwrap();
        p.park(1, 3, &b, 50, rec(3)).unwrap();
        p.park(0, 4, &a, 100, rec(4)).unwrap();
        p.unpark(0, 4);
        assert_eq!(p.parked(), 3);
        p.wake(&[0, 1], &a, Release::Stored);
        assert_eq!(*got.lock().unwrap(), vec![(1, 1), (2, 1)], "stream 4 left before the wake");
        p.wake(&[0, 1], &a, Release::Stored);
        assert_eq!(got.lock().unwrap().len(), 2, "each waiter is woken once");
        p.expire(49);
        assert_eq!(got.lock().unwrap().len(), 2);
        p.expire(50);
        assert_eq!(got.lock().unwrap()[2], (3, EVENT_TIMEOUT));
        assert_eq!(p.parked(), 0);
        assert!(p.park(MAX_WORKERS as u32, 9, &a, 1, rec(9)).is_err(), "no table for that worker");
    }
}
