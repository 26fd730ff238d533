//! Root contexts: one per plugin configuration. Parses and applies the configuration, keeps
//! the cache within its limits after a change, and reports metrics on the tick.

use crate::abi::{self, Buffer, LogLevel};
use crate::config::{parse_plugin_config, Config};
use crate::metrics;
use crate::store::{Cache, Outcome};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

thread_local! {
    /// Root id -> its configuration (None until `on_configure` accepted one).
    static ROOTS: RefCell<HashMap<u32, Option<Rc<Config>>>> = RefCell::new(HashMap::new());
}

pub fn create(root: u32) {
    ROOTS.with(|r| r.borrow_mut().insert(root, None));
}

pub fn delete(root: u32) {
    ROOTS.with(|r| r.borrow_mut().remove(&root));
}

pub fn is_root(id: u32) -> bool {
    ROOTS.with(|r| r.borrow().contains_key(&id))
}

/// The configuration a new stream of this root runs with.
pub fn config_of(root: u32) -> Option<Rc<Config>> {
    ROOTS.with(|r| r.borrow().get(&root).cloned().flatten())
}

pub fn on_configure(root: u32, size: usize) -> bool {
    let bytes = if size == 0 { Vec::new() } else { abi::buffer(Buffer::PluginConfiguration, 0, size).unwrap_or_default() };
    match parse_plugin_config(&bytes) {
        Ok(cfg) => {
            let cache = Cache { data: &abi::HostShared, limits: &cfg.limits };
            let mut out = Outcome::default();
            cache.reconcile(&mut out);
            metrics::record_outcome(&out);
            metrics::define_all(cfg.policies.iter().map(|p| p.model_prefix.as_str()));
            abi::log(LogLevel::Info, &format!("configuration version {:?} with {} policies", cfg.version, cfg.policies.len()));
            ROOTS.with(|r| r.borrow_mut().insert(root, Some(Rc::new(cfg))));
            abi::set_tick_period_ms(metrics::FLUSH_MS);
            true
        }
        Err(e) => {
            metrics::count(metrics::ERRORS, 1);
            abi::log(LogLevel::Error, &e.to_string());
            false
        }
    }
}

pub fn on_tick(root: u32) {
    metrics::flush();
    if config_of(root).is_some() {
        // Gauges come from the shared accounting record: every worker reports the same value.
        metrics::record_gauges(&Cache::read_only(&abi::HostShared).meta().0);
    }
}
