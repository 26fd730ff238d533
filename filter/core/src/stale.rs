//! RFC 5861 stale answers in plain Rust: whether an expired entry may still answer a request,
//! and which origin answers count as the errors stale-if-error covers.

use crate::config::Policy;
use crate::entry::Entry;

/// How long past expiry a lookup under this policy keeps an entry (the longer window): past it
/// the entry is a miss and its slot is freed.
pub fn keep_ms(policy: &Policy) -> u64 {
    policy.stale_if_error_s.max(policy.stale_while_revalidate_s).saturating_mul(1000)
}

/// What an expired entry may still do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StaleUse {
    /// Milliseconds since the entry expired.
    pub past_ms: u64,
    /// Answer at once while one request refreshes the entry.
    pub while_revalidate: bool,
    /// Answer when the origin fails (5xx, gRPC UNAVAILABLE, unreachable, timed out).
    pub if_error: bool,
}

impl StaleUse {
    /// Seconds past expiry as `Cache-Status` reports them (a negative `ttl`): rounded up, so a
    /// stale answer never says 0.
    pub fn past_s(&self) -> u64 {
        ((self.past_ms + 999) / 1000).max(1)
    }
}

/// None when the entry is fresh or past both windows. Each window is the entry's (what its
/// answer allowed when stored), never more than the policy's now: a policy set to 0 turns it
/// off at once for stored entries too.
pub fn stale_use(entry: &Entry, policy: &Policy, now_ms: u64) -> Option<StaleUse> {
    if now_ms < entry.expires_at_ms {
        return None;
    }
    let past_ms = now_ms - entry.expires_at_ms;
    let within = |entry_s: u32, policy_s: u64| past_ms < (entry_s as u64).min(policy_s).saturating_mul(1000);
    let u = StaleUse {
        past_ms,
        while_revalidate: within(entry.stale_while_revalidate_s, policy.stale_while_revalidate_s),
        if_error: within(entry.stale_if_error_s, policy.stale_if_error_s),
    };
    if u.while_revalidate || u.if_error {
        Some(u)
    } else {
        None
    }
}

/// gRPC codes stale-if-error covers: UNAVAILABLE (what clients see for an unreachable or
/// overloaded server, and Envoy's 503s), DEADLINE_EXCEEDED (timeouts), INTERNAL (a 500).
const GRPC_ERRORS: [&str; 3] = ["14", "4", "13"];

/// Whether an answer is an origin failure a stale entry may replace: HTTP 500, 502, 503, 504
/// (RFC 5861 §4: also what Envoy answers for an unreachable or timed-out upstream), or a gRPC
/// status in `GRPC_ERRORS`.
pub fn is_origin_error(status: u16, grpc_status: Option<&str>) -> bool {
    matches!(status, 500 | 502 | 503 | 504) || grpc_status.map_or(false, |g| GRPC_ERRORS.contains(&g.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_plugin_config;
    use crate::entry::sample;

    fn policy(if_error: u64, while_revalidate: u64) -> Policy {
        let json = format!(
            r#"{{"policies": [{{"model_prefix": "m", "ttl_s": 10, "stale_if_error_s": {}, "stale_while_revalidate_s": {}}}]}}"#,
            if_error, while_revalidate
        );
        parse_plugin_config(json.as_bytes()).unwrap().policies.remove(0)
    }

    fn entry(if_error: u32, while_revalidate: u32) -> Entry {
        Entry { stale_if_error_s: if_error, stale_while_revalidate_s: while_revalidate, ..sample(1, b"{}", 10_000) }
    }

    #[test]
    fn windows_are_the_smaller_of_entry_and_policy() {
        let p = policy(60, 5);
        let e = entry(60, 5);
        assert_eq!(stale_use(&e, &p, 9_999), None, "fresh");
        assert_eq!(stale_use(&e, &p, 10_000), Some(StaleUse { past_ms: 0, while_revalidate: true, if_error: true }));
        assert_eq!(stale_use(&e, &p, 14_999).map(|u| (u.while_revalidate, u.if_error)), Some((true, true)));
        assert_eq!(stale_use(&e, &p, 15_000).map(|u| (u.while_revalidate, u.if_error)), Some((false, true)));
        assert_eq!(stale_use(&e, &p, 69_999).map(|u| u.past_s()), Some(60));
        assert_eq!(stale_use(&e, &p, 70_000), None, "past both windows");
        assert_eq!(stale_use(&e, &policy(0, 0), 10_001), None, "policy 0 = off, for stored entries too");
        assert_eq!(stale_use(&entry(0, 0), &p, 10_001), None, "the answer allowed none");
        assert_eq!(stale_use(&entry(2, 0), &p, 11_000).map(|u| (u.while_revalidate, u.if_error)), Some((false, true)));
        assert_eq!(keep_ms(&p), 60_000);
        assert_eq!(StaleUse { past_ms: 1, while_revalidate: false, if_error: true }.past_s(), 1);
    }

    #[test]
    fn origin_errors() {
        for s in [500, 502, 503, 504] {
            assert!(is_origin_error(s, None), "{}", s);
        }
        for s in [200, 404, 429, 501, 505] {
            assert!(!is_origin_error(s, None), "{}", s);
        }
        assert!(is_origin_error(200, Some("14")));
        assert!(is_origin_error(200, Some("4")));
        assert!(!is_origin_error(200, Some("3")), "INVALID_ARGUMENT is the request's fault");
        assert!(!is_origin_error(200, Some("0")));
    }
}
