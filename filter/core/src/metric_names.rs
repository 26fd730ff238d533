//! The cache's Envoy stat names, one set for both hosts (the Wasm host under Envoy's
//! `wasmcustom.` prefix; the native host's metrics namespace is set to the same), so stats
//! readers, the status page and dashboards see the same names whichever host runs.

use crate::cache_control::NotStored;
use crate::names::Bypass;

pub const HITS: &str = "meshcache.hits";
pub const MISSES: &str = "meshcache.misses";
pub const BYPASSES: &str = "meshcache.bypasses";
/// Bypasses again, one counter per reason: `meshcache.bypass.<detail>`, the `detail` of the
/// bypass's `Cache-Status` (a fixed set: `Bypass::ALL`). Prometheus spells them
/// `meshcache_bypass_<detail with _ for ->`; the scrape configs in deploy/ move the reason into a
/// `reason` label (`meshcache_bypasses_by_reason{reason="no-policy"}`). A stat-name convention,
/// not Envoy tag extraction: an Istio sidecar's bootstrap has no tag rule for it, and the native
/// host must spell it the same.
pub fn bypass_counter(why: Bypass) -> &'static str {
    match why {
        Bypass::Method => "meshcache.bypass.method",
        Bypass::Path => "meshcache.bypass.path",
        Bypass::GrpcWeb => "meshcache.bypass.grpc-web",
        Bypass::RepeatedHeader => "meshcache.bypass.repeated-header",
        Bypass::HeaderBytes => "meshcache.bypass.header-bytes",
        Bypass::NoStore => "meshcache.bypass.no-store",
        Bypass::Compressed => "meshcache.bypass.compressed",
        Bypass::TooBig => "meshcache.bypass.too-big",
        Bypass::NoModel => "meshcache.bypass.no-model",
        Bypass::AmbiguousModel => "meshcache.bypass.ambiguous-model",
        Bypass::ModelConflict => "meshcache.bypass.model-conflict",
        Bypass::NoPolicy => "meshcache.bypass.no-policy",
        Bypass::Disabled => "meshcache.bypass.disabled",
        Bypass::Credentials => "meshcache.bypass.credentials",
        Bypass::NoIdentity => "meshcache.bypass.no-identity",
        Bypass::BinaryLength => "meshcache.bypass.binary-length",
        Bypass::Unparsable => "meshcache.bypass.unparsable",
        Bypass::Nondeterministic => "meshcache.bypass.nondeterministic",
        Bypass::MultipleChoices => "meshcache.bypass.multiple-choices",
        Bypass::ToolCalls => "meshcache.bypass.tool-calls",
        Bypass::NoHitRoute => "meshcache.bypass.no-hit-route",
    }
}
/// Misses whose answer was not stored, one counter per reason: `meshcache.not_stored.<detail>`,
/// the `detail` of the miss's `Cache-Status` (`NotStored::ALL`). The only record of why a
/// streamed answer was not stored: its headers left before its end.
pub fn not_stored_counter(why: NotStored) -> &'static str {
    match why {
        NotStored::Status => "meshcache.not_stored.status",
        NotStored::GrpcStatus => "meshcache.not_stored.grpc-status",
        NotStored::NoStore => "meshcache.not_stored.no-store",
        NotStored::Private => "meshcache.not_stored.private",
        NotStored::NoCache => "meshcache.not_stored.no-cache",
        NotStored::ZeroTtl => "meshcache.not_stored.ttl-zero",
        NotStored::TooBig => "meshcache.not_stored.too-big",
        NotStored::StoreFull => "meshcache.not_stored.store-full",
        NotStored::Contended => "meshcache.not_stored.contended",
        NotStored::Error => "meshcache.not_stored.error",
        NotStored::Unparsable => "meshcache.not_stored.unparsable",
        NotStored::Stale => "meshcache.not_stored.stale",
        NotStored::Vary => "meshcache.not_stored.vary",
        NotStored::SetCookie => "meshcache.not_stored.set-cookie",
        NotStored::HeaderBytes => "meshcache.not_stored.header-bytes",
        NotStored::StreamIncomplete => "meshcache.not_stored.stream-incomplete",
        NotStored::StreamError => "meshcache.not_stored.stream-error",
    }
}
pub const STORES: &str = "meshcache.stores";
pub const EVICTIONS: &str = "meshcache.evictions";
pub const ERRORS: &str = "meshcache.errors";
/// Client role: requests given a routing key.
pub const ROUTED: &str = "meshcache.routed";

pub const ENTRIES: &str = "meshcache.entries";
pub const BYTES: &str = "meshcache.bytes";
/// Entries and bytes no configured policy claims (see accounting.rs).
pub const UNATTRIBUTED_ENTRIES: &str = "meshcache.unattributed.entries";
pub const UNATTRIBUTED_BYTES: &str = "meshcache.unattributed.bytes";
/// RFC 5861: expired entries served because the origin failed / while one request refreshes
/// them; background refreshes started and failed.
pub const STALE_IF_ERROR: &str = "meshcache.stale_if_error";
pub const STALE_WHILE_REVALIDATE: &str = "meshcache.stale_while_revalidate";
pub const REFRESHES: &str = "meshcache.refreshes";
pub const REFRESH_FAILURES: &str = "meshcache.refresh_failures";
/// Request coalescing: a miss paused to wait for an identical request in flight; a waiter
/// answered from the entry its leader stored; a waiter that gave up at `coalesce_timeout_ms`;
/// a waiter woken without an entry (the leader's answer was not stored); a miss that could not
/// wait (waiter bounds, a lock slot busy with another key) and went upstream at once.
pub const COALESCE_WAITS: &str = "meshcache.coalesce.waits";
pub const COALESCE_SERVED: &str = "meshcache.coalesce.served";
pub const COALESCE_TIMEOUTS: &str = "meshcache.coalesce.timeouts";
pub const COALESCE_RELEASED: &str = "meshcache.coalesce.released";
pub const COALESCE_OVERFLOW: &str = "meshcache.coalesce.overflow";

/// The semantic layer (issue 38): lookups sent on an exact miss; answers served from a similar
/// prompt's entry; would-be hits of shadow mode (or whose entry this sidecar no longer holds);
/// lookups that failed (unreachable, timed out, a bad answer: the request went upstream).
pub const SEMANTIC_LOOKUPS: &str = "meshcache.semantic.lookups";
pub const SEMANTIC_HITS: &str = "meshcache.semantic.hits";
pub const SEMANTIC_WOULD_HIT: &str = "meshcache.semantic.would_hit";
pub const SEMANTIC_ERRORS: &str = "meshcache.semantic.errors";

pub const COUNTERS: [&str; 20] = [
    HITS, MISSES, BYPASSES, STORES, EVICTIONS, ERRORS, ROUTED, STALE_IF_ERROR, STALE_WHILE_REVALIDATE, REFRESHES,
    REFRESH_FAILURES, COALESCE_WAITS, COALESCE_SERVED, COALESCE_TIMEOUTS, COALESCE_RELEASED, COALESCE_OVERFLOW,
    SEMANTIC_LOOKUPS, SEMANTIC_HITS, SEMANTIC_WOULD_HIT, SEMANTIC_ERRORS,
];
/// Per policy: counters and gauges (`meshcache.policy.<prefix>.<what>`).
/// `tokens_saved_*`: the stored OpenAI `usage` of every hit's entry, summed (issue 38).
pub const POLICY_COUNTERS: [&str; 4] = ["hits", "misses", TOKENS_SAVED_PROMPT, TOKENS_SAVED_COMPLETION];
pub const TOKENS_SAVED_PROMPT: &str = "tokens_saved_prompt";
pub const TOKENS_SAVED_COMPLETION: &str = "tokens_saved_completion";
pub const POLICY_GAUGES_OF: [&str; 2] = ["entries", "bytes"];

/// The prefix reduced to characters safe in a stat name.
pub fn safe_name(prefix: &str) -> String {
    prefix.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' { c } else { '_' }).collect()
}

/// The per-policy counter's or gauge's name.
pub fn policy_metric(prefix: &str, what: &str) -> String {
    format!("meshcache.policy.{}.{}", safe_name(prefix), what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_bypass_counter_per_reason_named_after_its_detail() {
        let mut seen = std::collections::BTreeSet::new();
        for why in Bypass::ALL.iter() {
            assert_eq!(bypass_counter(*why), format!("meshcache.bypass.{}", why.detail()));
            assert!(seen.insert(why.detail()), "{} twice", why.detail());
        }
        let mut seen = std::collections::BTreeSet::new();
        for why in NotStored::ALL.iter() {
            assert_eq!(not_stored_counter(*why), format!("meshcache.not_stored.{}", why.detail()));
            assert!(seen.insert(why.detail()), "{} twice", why.detail());
        }
    }
}
