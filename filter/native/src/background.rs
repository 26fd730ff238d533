//! Stale-while-revalidate refreshes in the native host: the request a filter config sends
//! itself, so it outlives the client's stream (answered at once from the stale entry).
//!
//! A stream hands its refresh to its config (`submit`, any worker); the config's scheduler
//! moves it to Envoy's main thread (`on_scheduled`), which sends it as a config-level HTTP
//! callout (Envoy keeps those in an unlocked per-config map: one thread only); the answer
//! (`on_done`, main thread) is stored by `revalidate::store_refresh` and frees the key's refresh
//! lock, or marks the refresh failed so the next request for the key is forwarded instead
//! (the core's `refresh` rules, as in the Wasm host). Bounded: queued and in-flight refreshes
//! together at most `REFRESH_LOCKS` per config; a config that goes away cancels its callouts
//! and their locks expire after `REFRESH_TIMEOUT_MS`.

use std::collections::HashMap;
use std::os::raw::c_void;
use std::sync::{Arc, Mutex};

use meshcache_core::config::Config;
use meshcache_core::headermap::Headers;
use meshcache_core::metric_names;
use meshcache_core::revalidate::{self, REFRESH_LOCKS, REFRESH_TIMEOUT_MS};
use meshcache_core::store::{Cache, Outcome};
use meshcache_core::request::Cacheable;

use crate::abi::*;
use crate::metrics::{record_gauges, Metrics};
use crate::store::Shared;

/// A refresh handed over by a stream: the request to repeat, to the cluster its route chose.
pub struct Job {
    pub c: Cacheable,
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

/// A fire-and-forget request (`Host::post`: the semantic index store and shadow reports a
/// stream sends once its answer is stored), which must outlive the stream (a stream's own
/// callouts end with it).
pub struct Post {
    pub cluster: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub timeout_ms: u64,
}

/// Posts queued for the main thread at most (more are dropped: the index misses an entry).
const MAX_POSTS: usize = 256;

struct Pending {
    c: Cacheable,
    sent_ms: u64,
}

pub struct Background {
    config_envoy: ConfigEnvoyPtr,
    scheduler: *mut c_void,
    queue: Mutex<Vec<Job>>,
    posts: Mutex<Vec<Post>>,
    pending: Mutex<HashMap<u64, Pending>>,
    shared: Arc<Shared>,
    config: Arc<Config>,
    metrics: Arc<Metrics>,
}

// SAFETY: `config_envoy` is used on Envoy's main thread only (config hooks); the scheduler
// handle is made to be committed from any thread; the rest is behind locks.
unsafe impl Send for Background {}
unsafe impl Sync for Background {}

impl Drop for Background {
    fn drop(&mut self) {
        if !self.scheduler.is_null() {
            // SAFETY: the handle from `scheduler_new`, deleted once.
            unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_delete(self.scheduler) }
        }
    }
}

impl Background {
    /// # Safety
    /// In `on_http_filter_config_new`, with the config pointer Envoy passed to it.
    pub unsafe fn new(config_envoy: ConfigEnvoyPtr, shared: Arc<Shared>, config: Arc<Config>, metrics: Arc<Metrics>)
        -> Background {
        let scheduler = envoy_dynamic_module_callback_http_filter_config_scheduler_new(config_envoy);
        Background {
            config_envoy, scheduler, queue: Mutex::default(), posts: Mutex::default(), pending: Mutex::default(), shared, config,
            metrics,
        }
    }

    /// Queues a refresh for the main thread (any worker). False: none can be sent now.
    pub fn submit(&self, job: Job) -> bool {
        if self.scheduler.is_null() {
            return false;
        }
        let in_flight = self.pending.lock().unwrap_or_else(|p| p.into_inner()).len();
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        if queue.len() + in_flight >= REFRESH_LOCKS as usize {
            return false;
        }
        queue.push(job);
        drop(queue);
        // SAFETY: a live handle (deleted only with `self`).
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_commit(self.scheduler, 1) };
        true
    }

    /// Queues a fire-and-forget request for the main thread (any worker). False: not sent.
    pub fn post(&self, post: Post) -> bool {
        if self.scheduler.is_null() {
            return false;
        }
        let mut posts = self.posts.lock().unwrap_or_else(|p| p.into_inner());
        if posts.len() >= MAX_POSTS {
            return false;
        }
        posts.push(post);
        drop(posts);
        // SAFETY: a live handle (deleted only with `self`).
        unsafe { envoy_dynamic_module_callback_http_filter_config_scheduler_commit(self.scheduler, 1) };
        true
    }

    /// Main thread: sends what the workers queued.
    ///
    /// # Safety
    /// In `on_http_filter_config_scheduled` for this config.
    pub unsafe fn on_scheduled(&self, now_ms: u64) {
        let posts = std::mem::take(&mut *self.posts.lock().unwrap_or_else(|p| p.into_inner()));
        for post in posts {
            // Envoy sets content-length.
            let hs: Vec<ModuleHttpHeader> =
                post.headers.iter().map(|(k, v)| ModuleHttpHeader::of(k.as_bytes(), v.as_bytes())).collect();
            let mut id = 0u64;
            // Its answer is not read (`on_done` finds no refresh under its id).
            envoy_dynamic_module_callback_http_filter_config_http_callout(
                self.config_envoy, &mut id, ModuleBuffer::of(post.cluster.as_bytes()), hs.as_ptr(), hs.len(),
                ModuleBuffer::of(&post.body), post.timeout_ms);
        }
        let jobs = std::mem::take(&mut *self.queue.lock().unwrap_or_else(|p| p.into_inner()));
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        // Answers that can never come (lost callouts) do not hold a place for ever.
        pending.retain(|_, p| now_ms < p.sent_ms + 2 * REFRESH_TIMEOUT_MS);
        for job in jobs {
            let hs: Vec<ModuleHttpHeader> =
                job.headers.iter().map(|(k, v)| ModuleHttpHeader::of(k.as_bytes(), v.as_bytes())).collect();
            let mut id = 0u64;
            let sent = envoy_dynamic_module_callback_http_filter_config_http_callout(
                self.config_envoy, &mut id, ModuleBuffer::of(job.cluster.as_bytes()), hs.as_ptr(), hs.len(),
                ModuleBuffer::of(&job.body), REFRESH_TIMEOUT_MS);
            if sent == CALLOUT_SUCCESS {
                pending.insert(id, Pending { c: job.c, sent_ms: now_ms });
            } else {
                self.failed(&job.c, now_ms);
            }
        }
    }

    /// Main thread: a refresh's answer (`result` not success: no answer).
    ///
    /// # Safety
    /// In `on_http_filter_config_http_callout_done` for this config; `headers` and `chunks`
    /// as Envoy passed them (valid during the hook).
    pub unsafe fn on_done(&self, id: u64, result: u32, headers: &[EnvoyHttpHeader], chunks: &[EnvoyBuffer], now_ms: u64) {
        let p = match self.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&id) {
            Some(p) => p,
            None => return,
        };
        if result != CALLOUT_SUCCESS {
            return self.failed(&p.c, now_ms);
        }
        let mut response = Headers::default();
        for h in headers {
            let (k, v) = (h.key.as_slice(), h.value.as_slice());
            let name = String::from_utf8_lossy(k).to_ascii_lowercase();
            if std::str::from_utf8(k).is_err() || std::str::from_utf8(v).is_err() {
                response.not_utf8.push(name.clone());
            }
            response.pairs.push((name, String::from_utf8_lossy(v).into_owned()));
        }
        let size: usize = chunks.iter().map(|c| c.length).sum();
        let limit = self.config.limits.max_entry_bytes as usize + if p.c.grpc { 5 } else { 0 };
        if size > limit {
            return self.failed(&p.c, now_ms);
        }
        let mut body = Vec::with_capacity(size);
        chunks.iter().for_each(|c| body.extend_from_slice(c.as_slice()));
        let cache = Cache { data: &*self.shared, limits: &self.config.limits };
        let mut out = Outcome::default();
        // The callout's answer comes without its trailers (`None`): see `store_refresh`.
        match revalidate::store_refresh(&cache, &p.c, &response, None, body, now_ms, &mut out) {
            Ok(()) => {
                self.metrics.count_config(self.config_envoy, metric_names::STORES, 1);
                if out.evicted > 0 {
                    self.metrics.count_config(self.config_envoy, metric_names::EVICTIONS, out.evicted as u64);
                }
                let (metrics, config_envoy) = (&self.metrics, self.config_envoy);
                record_gauges(&self.shared, &self.config, &mut |name, value| metrics.set_gauge_config(config_envoy, name, value));
                revalidate::release(&*self.shared, &p.c.key);
            }
            Err(_) => self.failed(&p.c, now_ms),
        }
    }

    /// The refresh could not be sent or brought no storable answer: the next request for the
    /// key is forwarded instead.
    unsafe fn failed(&self, c: &Cacheable, now_ms: u64) {
        self.metrics.count_config(self.config_envoy, metric_names::REFRESH_FAILURES, 1);
        revalidate::failed(&*self.shared, &c.key, now_ms);
    }
}
