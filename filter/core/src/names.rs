//! Header names and `Cache-Status` values the filter reads and writes: the wire contract in one
//! place (see docs/filter.md). Values here are fixed by contract; change none of them lightly.

use crate::cache_control::NotStored;

pub const COLOR_HEADER: &str = "x-traffic-color";
pub const MODEL_HEADER: &str = "x-model-id";
/// The engine's `POST /v1/infer` reads the model's version from it (`engine/http_server.py`).
pub const MODEL_VERSION_HEADER: &str = "x-model-version";
/// Every request header a server behind the filter reads to choose the model or its version
/// (docs/filter.md, "Headers that pick the model"): each is part of the key, on every path,
/// its one value or its absence; repeated or not UTF-8, the request bypasses.
pub const MODEL_SELECTING_HEADERS: [&str; 2] = [MODEL_HEADER, MODEL_VERSION_HEADER];
pub const HASH_HEADER: &str = "x-response-hash";
pub const CACHE_STATUS: &str = "cache-status";
/// KServe's binary tensor extension: the length of a body's JSON part (requests and answers).
pub const KSERVE_BINARY_HEADER: &str = "inference-header-content-length";
/// Internal: set by the client-role filter for consistent-hash routing to the replica holding
/// the answer; removed by the server-role filter (never part of a cache key).
pub const ROUTE_KEY_HEADER: &str = "x-meshcache-route-key";
/// Set on a held gRPC request an expired entry may answer: the cluster its route chose, which
/// the stale route forwards to (docs/filter.md, stale-if-error).
pub const UPSTREAM_CLUSTER_HEADER: &str = "x-meshcache-upstream-cluster";

pub const CACHE_STATUS_STORED: &str = "meshcache; fwd=miss; stored";
pub const CACHE_STATUS_REFRESHED: &str = "meshcache; fwd=request; stored";
pub const CACHE_STATUS_BYPASS: &str = "meshcache; fwd=bypass";
/// A miss whose headers left before its body was read: whether it gets stored is not known yet.
pub const CACHE_STATUS_MISS: &str = "meshcache; fwd=miss";
pub const CACHE_STATUS_REFRESH: &str = "meshcache; fwd=request";
/// RFC 9211 `collapsed`: a miss that waited for an identical request in flight and was answered
/// from the entry that request stored (request coalescing), without going upstream itself.
pub const CACHE_STATUS_COLLAPSED: &str = "meshcache; fwd=miss; collapsed";

/// Any answer served to a request that waited for an identical one in flight (RFC 9211
/// `collapsed`), e.g. a stale-if-error answer after that request's origin failed.
pub fn cache_status_collapsed(status: &str) -> String {
    format!("{}; collapsed", status)
}

pub fn cache_status_hit(ttl_left_s: u64) -> String {
    format!("meshcache; hit; ttl={}", ttl_left_s)
}

/// RFC 5861 answers from an expired entry carry `hit; stale`, a negative `ttl` (RFC 9211: seconds
/// past expiry) and which rule allowed it in `detail`.
pub const CACHE_STATUS_STALE: &str = "stale";
pub const STALE_WHILE_REVALIDATE_DETAIL: &str = "stale-while-revalidate";
pub const STALE_IF_ERROR_DETAIL: &str = "stale-if-error";

/// Served at once while one request refreshes the entry.
pub fn cache_status_stale_while_revalidate(past_s: u64) -> String {
    format!("meshcache; hit; {}; ttl=-{}; detail={}", CACHE_STATUS_STALE, past_s, STALE_WHILE_REVALIDATE_DETAIL)
}

/// Served because the origin failed: the request was forwarded (`fwd=stale`); `fwd_status` is
/// the HTTP status that came back (from the origin or from Envoy for it), when it was not 200.
pub fn cache_status_stale_if_error(past_s: u64, fwd_status: Option<u16>) -> String {
    let status = fwd_status.map(|s| format!("; fwd-status={}", s)).unwrap_or_default();
    format!("meshcache; hit; {}; ttl=-{}; fwd=stale{}; detail={}", CACHE_STATUS_STALE, past_s, status, STALE_IF_ERROR_DETAIL)
}

/// Why the cache stays out of a request: every bypass says it as `Cache-Status: meshcache;
/// fwd=bypass; detail=<why>` (docs/filter.md has the table).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bypass {
    /// Not a POST, on an inference path.
    Method,
    /// An inference path spelled other than the way the server routes it (trailing or doubled
    /// slash, other case, percent-encoding): the filter cannot be sure which API it reaches.
    Path,
    /// grpc-web (own framing and trailers in the body).
    GrpcWeb,
    /// A keyed header (`x-model-id`, `x-model-version`, `x-traffic-color`) given more than once.
    RepeatedHeader,
    /// A keyed header whose value is not UTF-8.
    HeaderBytes,
    /// Client `Cache-Control: no-store`.
    NoStore,
    /// A compressed request body (`content-encoding`, a compressed gRPC message).
    Compressed,
    /// The request body is larger than the filter buffers.
    TooBig,
    /// No model named anywhere (body without `model`, no `x-model-id`).
    NoModel,
    /// The body names its model ambiguously: `model` repeated, not a non-empty string.
    AmbiguousModel,
    /// `x-model-id` names another model than the path or body.
    ModelConflict,
    /// No policy matches the model.
    NoPolicy,
    /// The matching policy is disabled.
    Disabled,
    /// `Authorization`, `Proxy-Authorization` or `Cookie` on a shared policy.
    Credentials,
    /// A principal-scoped policy and no peer identity (no mTLS).
    NoIdentity,
    /// `inference-header-content-length` other than one plain decimal no larger than the body.
    BinaryLength,
    /// The body cannot be read the way the key needs.
    Unparsable,
    /// `deterministic_only` and the answer would be a sample.
    Nondeterministic,
    /// `deterministic_only` and the body asks for several answers (`n` other than 1): each
    /// caller would get the first caller's set of samples.
    MultipleChoices,
    /// `deterministic_only` and the body offers tools (`tools`, or the older `functions`): the
    /// answer may be a tool call, whose ids and arguments belong to one conversation.
    ToolCalls,
    /// This worker found the gRPC hit route missing: gRPC requests bypass.
    NoHitRoute,
}

impl Bypass {
    /// Every reason, each with its own counter (`metric_names::bypass_counter`).
    pub const ALL: [Bypass; 21] = [
        Bypass::Method,
        Bypass::Path,
        Bypass::GrpcWeb,
        Bypass::RepeatedHeader,
        Bypass::HeaderBytes,
        Bypass::NoStore,
        Bypass::Compressed,
        Bypass::TooBig,
        Bypass::NoModel,
        Bypass::AmbiguousModel,
        Bypass::ModelConflict,
        Bypass::NoPolicy,
        Bypass::Disabled,
        Bypass::Credentials,
        Bypass::NoIdentity,
        Bypass::BinaryLength,
        Bypass::Unparsable,
        Bypass::Nondeterministic,
        Bypass::MultipleChoices,
        Bypass::ToolCalls,
        Bypass::NoHitRoute,
    ];

    pub fn detail(self) -> &'static str {
        match self {
            Bypass::Method => "method",
            Bypass::Path => "path",
            Bypass::GrpcWeb => "grpc-web",
            Bypass::RepeatedHeader => "repeated-header",
            Bypass::HeaderBytes => "header-bytes",
            Bypass::NoStore => "no-store",
            Bypass::Compressed => "compressed",
            Bypass::TooBig => "too-big",
            Bypass::NoModel => "no-model",
            Bypass::AmbiguousModel => "ambiguous-model",
            Bypass::ModelConflict => "model-conflict",
            Bypass::NoPolicy => "no-policy",
            Bypass::Disabled => "disabled",
            Bypass::Credentials => "credentials",
            Bypass::NoIdentity => "no-identity",
            Bypass::BinaryLength => "binary-length",
            Bypass::Unparsable => "unparsable",
            Bypass::Nondeterministic => "nondeterministic",
            Bypass::MultipleChoices => "multiple-choices",
            Bypass::ToolCalls => "tool-calls",
            Bypass::NoHitRoute => "no-hit-route",
        }
    }
}

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
        assert_eq!(cache_status_collapsed(&cache_status_stale_if_error(3, None)),
                   "meshcache; hit; stale; ttl=-3; fwd=stale; detail=stale-if-error; collapsed");
        assert_eq!(cache_status_not_stored(false, NotStored::TooBig), "meshcache; fwd=miss; detail=too-big");
        assert_eq!(cache_status_not_stored(true, NotStored::Status), "meshcache; fwd=request; detail=status");
        assert_eq!(cache_status_forwarded(false), "meshcache; fwd=miss");
        assert_eq!(cache_status_bypass("unparsable"), "meshcache; fwd=bypass; detail=unparsable");
        assert_eq!(cache_status_stored(true), "meshcache; fwd=request; stored");
        assert_eq!(cache_status_stale_while_revalidate(3), "meshcache; hit; stale; ttl=-3; detail=stale-while-revalidate");
        assert_eq!(cache_status_stale_if_error(12, Some(503)), "meshcache; hit; stale; ttl=-12; fwd=stale; fwd-status=503; detail=stale-if-error");
        assert_eq!(cache_status_stale_if_error(1, None), "meshcache; hit; stale; ttl=-1; fwd=stale; detail=stale-if-error");
    }
}
