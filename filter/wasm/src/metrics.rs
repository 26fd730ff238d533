//! The filter's Envoy stats. Every host call crosses the VM boundary, which costs more than the
//! cache logic itself, so counters are summed in the VM and handed to Envoy once per tick.

use crate::abi::{self, LogLevel, MetricKind};
use meshcache_core::accounting::{attribute, policy_tag};
use meshcache_core::config::LIMIT_POLICIES;
pub use meshcache_core::metric_names::*;
use meshcache_core::store::{Meta, Outcome};
use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};

pub const FLUSH_MS: u32 = 200;

thread_local! {
    static IDS: RefCell<HashMap<String, u32>> = RefCell::new(HashMap::new());
    static PENDING: RefCell<HashMap<String, u64>> = RefCell::new(HashMap::new());
    /// Policy tags by prefix (sha256 per prefix once, not per tick); bounded.
    static TAGS: RefCell<HashMap<String, u64>> = RefCell::new(HashMap::new());
    /// Per-policy stat names whose gauges were set: a policy removed since reports 0 (its
    /// entries move to the unattributed gauges).
    static POLICY_GAUGES: RefCell<BTreeSet<String>> = RefCell::new(BTreeSet::new());
    /// Per-policy counter names by prefix: (what, stat name); bounded like TAGS.
    static POLICY_NAMES: RefCell<HashMap<String, Vec<(String, String)>>> = RefCell::new(HashMap::new());
}

fn metric(kind: MetricKind, name: &str) -> Option<u32> {
    if let Some(id) = IDS.with(|m| m.borrow().get(name).copied()) {
        return Some(id);
    }
    let id = abi::define_metric(kind, name)?;
    IDS.with(|m| m.borrow_mut().insert(name.to_string(), id));
    Some(id)
}

pub fn count(name: &str, n: u64) {
    if n == 0 {
        return;
    }
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        match p.get_mut(name) {
            Some(v) => *v += n,
            None => {
                p.insert(name.to_string(), n);
            }
        }
    });
}




fn tag_of(prefix: &str) -> u64 {
    TAGS.with(|t| {
        let mut t = t.borrow_mut();
        if let Some(tag) = t.get(prefix) {
            return *tag;
        }
        if t.len() > 2 * LIMIT_POLICIES {
            t.clear();
        }
        let tag = policy_tag(prefix);
        t.insert(prefix.to_string(), tag);
        tag
    })
}

/// Counts a per-policy event (`what`: one of `POLICY_COUNTERS`). Runs on every request, so the
/// stat names are built once per policy rather than formatted each time.
pub fn count_policy(prefix: &str, what: &str, n: u64) {
    POLICY_NAMES.with(|m| {
        let mut m = m.borrow_mut();
        if !m.contains_key(prefix) {
            if m.len() > 2 * LIMIT_POLICIES {
                m.clear();
            }
            m.insert(prefix.to_string(), Vec::new());
        }
        if let Some(names) = m.get_mut(prefix) {
            match names.iter().find(|(w, _)| w == what) {
                Some((_, name)) => count(name, n),
                None => {
                    let name = policy_metric(prefix, what);
                    count(&name, n);
                    names.push((what.to_string(), name));
                }
            }
        }
    });
}

/// Defines every counter (and each policy's) up front, so stats, dashboards and alerts see a 0
/// rather than a missing series until the first event.
pub fn define_all<'a, I: Iterator<Item = &'a str>>(prefixes: I) {
    for name in COUNTERS.iter() {
        metric(MetricKind::Counter, name);
    }
    for why in meshcache_core::names::Bypass::ALL.iter() {
        metric(MetricKind::Counter, bypass_counter(*why));
    }
    for why in meshcache_core::cache_control::NotStored::ALL.iter() {
        metric(MetricKind::Counter, meshcache_core::metric_names::not_stored_counter(*why));
    }
    for name in [ENTRIES, BYTES, UNATTRIBUTED_ENTRIES, UNATTRIBUTED_BYTES].iter() {
        metric(MetricKind::Gauge, name);
    }
    for prefix in prefixes {
        for what in POLICY_COUNTERS.iter() {
            metric(MetricKind::Counter, &policy_metric(prefix, what));
        }
        for what in POLICY_GAUGES_OF.iter() {
            metric(MetricKind::Gauge, &policy_metric(prefix, what));
        }
    }
}

pub fn record_outcome(out: &Outcome) {
    count(EVICTIONS, out.evicted as u64);
    count(ERRORS, out.corrupt as u64);
}

fn set_gauge(name: &str, value: u64) {
    if let Some(id) = metric(MetricKind::Gauge, name) {
        abi::record_metric(id, value);
    }
}

/// Cache-wide and per-policy entries and bytes from the accounting record; `prefixes`: the
/// policies configured now (the entries of any other tag are reported as unattributed).
pub fn record_gauges(meta: &Meta, prefixes: &[String]) {
    set_gauge(ENTRIES, meta.entries());
    set_gauge(BYTES, meta.total_bytes());
    let named: Vec<(u64, String)> = prefixes.iter().map(|p| (tag_of(p), safe_name(p))).collect();
    let got = attribute(meta, &named);
    set_gauge(UNATTRIBUTED_ENTRIES, got.unattributed.0);
    set_gauge(UNATTRIBUTED_BYTES, got.unattributed.1);
    POLICY_GAUGES.with(|g| {
        let mut g = g.borrow_mut();
        for gone in g.iter().filter(|n| !got.per_name.contains_key(*n)) {
            set_gauge(&format!("meshcache.policy.{}.entries", gone), 0);
            set_gauge(&format!("meshcache.policy.{}.bytes", gone), 0);
        }
        g.clear();
        for (name, (entries, bytes)) in &got.per_name {
            set_gauge(&format!("meshcache.policy.{}.entries", name), *entries);
            set_gauge(&format!("meshcache.policy.{}.bytes", name), *bytes);
            g.insert(name.clone());
        }
    });
}

pub fn flush() {
    let pending: Vec<(String, u64)> = PENDING.with(|p| p.borrow_mut().drain().filter(|(_, v)| *v > 0).collect());
    for (name, n) in pending {
        if let Some(id) = metric(MetricKind::Counter, &name) {
            abi::increment_metric(id, n as i64);
        }
    }
}

/// An internal surprise: counted and logged; the caller fails open.
pub fn error(msg: &str) {
    count(ERRORS, 1);
    abi::log(LogLevel::Warn, msg);
}
