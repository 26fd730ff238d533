//! Header names and `Cache-Status` values the filter reads and writes: the wire contract in one
//! place (see docs/filter.md). Values here are fixed by contract; change none of them lightly.

use crate::cache_control::NotStored;

pub const COLOR_HEADER: &str = "x-traffic-color";
pub const MODEL_HEADER: &str = "x-model-id";
pub const HASH_HEADER: &str = "x-response-hash";
pub const CACHE_STATUS: &str = "cache-status";
/// KServe's binary tensor extension: the length of a body's JSON part (requests and answers).
pub const KSERVE_BINARY_HEADER: &str = "inference-header-content-length";
/// Internal: set by the client-role filter for consistent-hash routing to the replica holding
/// the answer; removed by the server-role filter (never part of a cache key).
pub const ROUTE_KEY_HEADER: &str = "x-meshcache-route-key";

pub const CACHE_STATUS_STORED: &str = "meshcache; fwd=miss; stored";
pub const CACHE_STATUS_REFRESHED: &str = "meshcache; fwd=request; stored";
pub const CACHE_STATUS_BYPASS: &str = "meshcache; fwd=bypass";
/// A miss whose headers left before its body was read: whether it gets stored is not known yet.
pub const CACHE_STATUS_MISS: &str = "meshcache; fwd=miss";
pub const CACHE_STATUS_REFRESH: &str = "meshcache; fwd=request";

pub fn cache_status_hit(ttl_left_s: u64) -> String {
    format!("meshcache; hit; ttl={}", ttl_left_s)
}

/// A bypass whose reason is worth saying: `unparsable`, `nondeterministic`.
pub fn cache_status_bypass(detail: &str) -> String {
    format!("{}; detail={}", CACHE_STATUS_BYPASS, detail)
}

pub fn cache_status_not_stored(refresh: bool, why: NotStored) -> String {
    format!("meshcache; fwd={}; detail={}", if refresh { "request" } else { "miss" }, why.detail())
}

/// What a forwarded request's headers say when they leave before the answer is stored.
pub fn cache_status_forwarded(refresh: bool) -> &'static str {
    if refresh {
        CACHE_STATUS_REFRESH
    } else {
        CACHE_STATUS_MISS
    }
}

pub fn cache_status_stored(refresh: bool) -> &'static str {
    if refresh {
        CACHE_STATUS_REFRESHED
    } else {
        CACHE_STATUS_STORED
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_status_strings() {
        assert_eq!(cache_status_hit(7), "meshcache; hit; ttl=7");
        assert_eq!(cache_status_not_stored(false, NotStored::TooBig), "meshcache; fwd=miss; detail=too-big");
        assert_eq!(cache_status_not_stored(true, NotStored::Status), "meshcache; fwd=request; detail=status");
        assert_eq!(cache_status_forwarded(false), "meshcache; fwd=miss");
        assert_eq!(cache_status_bypass("unparsable"), "meshcache; fwd=bypass; detail=unparsable");
        assert_eq!(cache_status_stored(true), "meshcache; fwd=request; stored");
    }
}
