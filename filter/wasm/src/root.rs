//! Root contexts: one per plugin configuration. Parses and applies the configuration, keeps
//! the cache within its limits after a change, and reports metrics on the tick.

use crate::abi::{self, Buffer, LogLevel};
use meshcache_core::config::{parse_plugin_config, Config, Role};
use crate::metrics;
use meshcache_core::store::{Cache, Outcome};
use crate::stream;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;

/// The tick resumes coalesced requests whose timeout passed: its period is their precision.
const TICK_MS: u32 = 25;

thread_local! {
    /// Root id -> its configuration (None until `on_configure` accepted one).
    static ROOTS: RefCell<HashMap<u32, Option<Arc<Config>>>> = RefCell::new(HashMap::new());
    static TICKS: Cell<u32> = Cell::new(0);
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
pub fn config_of(root: u32) -> Option<Arc<Config>> {
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
            // Only the server role caches (and so coalesces).
            let cfg_role_is_server = cfg.role == Role::Server;
            ROOTS.with(|r| r.borrow_mut().insert(root, Some(Arc::new(cfg))));
            if cfg_role_is_server {
                stream::setup_coalescing();
            }
            abi::set_tick_period_ms(TICK_MS);
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
    stream::expire_waiters();
    let ticks = TICKS.with(|t| {
        t.set(t.get().wrapping_add(1));
        t.get()
    });
    if ticks % (metrics::FLUSH_MS / TICK_MS) != 0 {
        return;
    }
    metrics::flush();
    if let Some(cfg) = config_of(root) {
        let (mut meta, _) = Cache::read_only(&abi::HostShared).meta();
        if meta.slots == 0 {
            // No layout: the record was lost or reset (an older build running beside this one
            // during a code change reads this record's format as empty and writes it back so).
            // Set the layout up again rather than refuse every store until the next push.
            let mut out = Outcome::default();
            Cache { data: &abi::HostShared, limits: &cfg.limits }.reconcile(&mut out);
            metrics::record_outcome(&out);
            meta = Cache::read_only(&abi::HostShared).meta().0;
        }
        // Gauges come from the shared accounting record: every worker reports the same value.
        // Entries are attributed to the policies of every configured root of this VM.
        let prefixes: Vec<String> = ROOTS.with(|r| {
            let mut all: Vec<String> = r.borrow().values().flatten()
                .flat_map(|c| c.policies.iter().map(|p| p.model_prefix.clone())).collect();
            all.sort();
            all.dedup();
            all
        });
        metrics::record_gauges(&meta, &prefixes);
    }
}
