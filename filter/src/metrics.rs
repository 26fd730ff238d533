//! The filter's Envoy stats. Every host call crosses the VM boundary, which costs more than the
//! cache logic itself, so counters are summed in the VM and handed to Envoy once per tick.

use crate::abi::{self, LogLevel, MetricKind};
use crate::store::{Meta, Outcome};
use std::cell::RefCell;
use std::collections::HashMap;

pub const FLUSH_MS: u32 = 200;

pub const HITS: &str = "meshcache.hits";
pub const MISSES: &str = "meshcache.misses";
pub const BYPASSES: &str = "meshcache.bypasses";
pub const STORES: &str = "meshcache.stores";
pub const EVICTIONS: &str = "meshcache.evictions";
pub const ERRORS: &str = "meshcache.errors";

thread_local! {
    static IDS: RefCell<HashMap<String, u32>> = RefCell::new(HashMap::new());
    static PENDING: RefCell<HashMap<String, u64>> = RefCell::new(HashMap::new());
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

const COUNTERS: [&str; 6] = [HITS, MISSES, BYPASSES, STORES, EVICTIONS, ERRORS];
const POLICY_COUNTERS: [&str; 2] = ["hits", "misses"];

/// The per-policy counter's name; the prefix is reduced to characters safe in a stat name.
fn policy_metric(prefix: &str, what: &str) -> String {
    let safe: String = prefix.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect();
    format!("meshcache.policy.{}.{}", safe, what)
}

pub fn count_policy(prefix: &str, what: &str) {
    count(&policy_metric(prefix, what), 1);
}

/// Defines every counter (and each policy's) up front, so stats, dashboards and alerts see a 0
/// rather than a missing series until the first event.
pub fn define_all<'a, I: Iterator<Item = &'a str>>(prefixes: I) {
    for name in COUNTERS.iter() {
        metric(MetricKind::Counter, name);
    }
    for prefix in prefixes {
        for what in POLICY_COUNTERS.iter() {
            metric(MetricKind::Counter, &policy_metric(prefix, what));
        }
    }
}

pub fn record_outcome(out: &Outcome) {
    count(EVICTIONS, out.evicted as u64);
    count(ERRORS, out.corrupt as u64);
}

pub fn record_gauges(meta: &Meta) {
    if let Some(id) = metric(MetricKind::Gauge, "meshcache.entries") {
        abi::record_metric(id, meta.entries as u64);
    }
    if let Some(id) = metric(MetricKind::Gauge, "meshcache.bytes") {
        abi::record_metric(id, meta.total_bytes);
    }
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
