//! The native host's Envoy stats: the same names as the Wasm filter's (`meshcache_core::
//! metric_names`; the Envoy config sets the module's metrics namespace to `wasmcustom`, the Wasm
//! filter's prefix), defined when a config is created (Envoy freezes stat creation after that)
//! and updated per request with plain calls (no VM crossings, so no batching).

use std::collections::HashMap;

use meshcache_core::config::Config;
use meshcache_core::cache_control::NotStored;
use meshcache_core::names::Bypass;
use meshcache_core::metric_names::{
    bypass_counter, not_stored_counter, policy_metric, BYTES, COUNTERS, ENTRIES, POLICY_COUNTERS, POLICY_GAUGES_OF, UNATTRIBUTED_BYTES, UNATTRIBUTED_ENTRIES,
};

use crate::abi::*;
use crate::store::Shared;
use meshcache_core::accounting::{attribute, policy_tag};
use meshcache_core::metric_names;
use meshcache_core::store::Cache;

#[derive(Default)]
pub struct Metrics {
    counters: HashMap<String, usize>,
    gauges: HashMap<String, usize>,
}

impl Metrics {
    /// Defines every counter and gauge for `config` (its policies' too), so stats show a 0
    /// rather than a missing series until the first event.
    ///
    /// # Safety
    /// `config_envoy` is the config pointer Envoy passed to the running config hook.
    pub unsafe fn define(config_envoy: ConfigEnvoyPtr, config: &Config) -> Metrics {
        let mut m = Metrics::default();
        let mut counters: Vec<String> = COUNTERS.iter().map(|n| n.to_string()).collect();
        counters.extend(Bypass::ALL.iter().map(|w| bypass_counter(*w).to_string()));
        counters.extend(NotStored::ALL.iter().map(|w| not_stored_counter(*w).to_string()));
        let mut gauges: Vec<String> =
            [ENTRIES, BYTES, UNATTRIBUTED_ENTRIES, UNATTRIBUTED_BYTES].iter().map(|n| n.to_string()).collect();
        for p in &config.policies {
            counters.extend(POLICY_COUNTERS.iter().map(|w| policy_metric(&p.model_prefix, w)));
            gauges.extend(POLICY_GAUGES_OF.iter().map(|w| policy_metric(&p.model_prefix, w)));
        }
        for name in counters {
            let mut id = 0usize;
            if envoy_dynamic_module_callback_http_filter_config_define_counter(
                config_envoy, ModuleBuffer::of(name.as_bytes()), std::ptr::null(), 0, &mut id) == METRICS_SUCCESS {
                m.counters.insert(name, id);
            }
        }
        for name in gauges {
            let mut id = 0usize;
            if envoy_dynamic_module_callback_http_filter_config_define_gauge(
                config_envoy, ModuleBuffer::of(name.as_bytes()), std::ptr::null(), 0, &mut id) == METRICS_SUCCESS {
                m.gauges.insert(name, id);
            }
        }
        m
    }

    /// # Safety
    /// `filter` is the stream pointer Envoy passed to the running hook.
    pub unsafe fn count(&self, filter: FilterEnvoyPtr, name: &str, n: u64) {
        if let Some(id) = self.counters.get(name) {
            envoy_dynamic_module_callback_http_filter_increment_counter(filter, *id, std::ptr::null(), 0, n);
        }
    }

    /// `count` from config context (a config hook on the main thread).
    ///
    /// # Safety
    /// `config` is the config pointer Envoy passed to the running config hook.
    pub unsafe fn count_config(&self, config: ConfigEnvoyPtr, name: &str, n: u64) {
        if let Some(id) = self.counters.get(name) {
            envoy_dynamic_module_callback_http_filter_config_increment_counter(config, *id, std::ptr::null(), 0, n);
        }
    }

    /// `set_gauge` from config context (a config hook on the main thread).
    ///
    /// # Safety
    /// As for `count_config`.
    pub unsafe fn set_gauge_config(&self, config: ConfigEnvoyPtr, name: &str, value: u64) {
        if let Some(id) = self.gauges.get(name) {
            envoy_dynamic_module_callback_http_filter_config_set_gauge(config, *id, std::ptr::null(), 0, value);
        }
    }

    /// # Safety
    /// As for `count`.
    pub unsafe fn set_gauge(&self, filter: FilterEnvoyPtr, name: &str, value: u64) {
        if let Some(id) = self.gauges.get(name) {
            envoy_dynamic_module_callback_http_filter_set_gauge(filter, *id, std::ptr::null(), 0, value);
        }
    }
}

/// Entries and bytes, cache-wide and per policy of `config`, from the accounting record, each
/// given to `set`. Under one lock per process: the last writer reads the newest record, so the
/// gauges end at its value.
pub fn record_gauges(shared: &Shared, config: &Config, set: &mut dyn FnMut(&str, u64)) {
    let _one_at_a_time = shared.gauges.lock().unwrap_or_else(|p| p.into_inner());
    let (meta, _) = Cache::read_only(shared).meta();
    set(metric_names::ENTRIES, meta.entries());
    set(metric_names::BYTES, meta.total_bytes());
    let named: Vec<(u64, String)> =
        config.policies.iter().map(|p| (policy_tag(&p.model_prefix), metric_names::safe_name(&p.model_prefix))).collect();
    let got = attribute(&meta, &named);
    set(metric_names::UNATTRIBUTED_ENTRIES, got.unattributed.0);
    set(metric_names::UNATTRIBUTED_BYTES, got.unattributed.1);
    for (name, (entries, bytes)) in &got.per_name {
        set(&format!("meshcache.policy.{}.entries", name), *entries);
        set(&format!("meshcache.policy.{}.bytes", name), *bytes);
    }
}
