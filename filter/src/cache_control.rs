//! Cache-Control directives that matter to a shared cache, and the TTL an answer gets.

use crate::config::Policy;

#[derive(Debug, Default, PartialEq, Eq)]
pub struct CacheControl {
    pub no_store: bool,
    pub no_cache: bool,
    pub private: bool,
    pub max_age: Option<u64>,
    pub s_maxage: Option<u64>,
}

pub fn parse(value: &str) -> CacheControl {
    let mut cc = CacheControl::default();
    for directive in value.split(',') {
        let directive = directive.trim();
        let (name, arg) = match directive.find('=') {
            Some(i) => (&directive[..i], Some(directive[i + 1..].trim().trim_matches('"'))),
            None => (directive, None),
        };
        let seconds = arg.and_then(|a| a.parse::<u64>().ok());
        match name.trim().to_ascii_lowercase().as_str() {
            "no-store" => cc.no_store = true,
            "no-cache" => cc.no_cache = true,
            "private" => cc.private = true,
            "max-age" => cc.max_age = seconds.or(cc.max_age),
            "s-maxage" => cc.s_maxage = seconds.or(cc.s_maxage),
            _ => {}
        }
    }
    cc
}

/// Why a response was not stored; the text goes into `Cache-Status: ...; detail=<text>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotStored {
    Status,
    GrpcStatus,
    NoStore,
    Private,
    NoCache,
    ZeroTtl,
    TooBig,
    StoreFull,
    Contended,
    Error,
    /// The answer's echoed request id could not be taken out (another id, repeated, bad JSON).
    Unparsable,
}

impl NotStored {
    pub fn detail(self) -> &'static str {
        match self {
            NotStored::Status => "status",
            NotStored::GrpcStatus => "grpc-status",
            NotStored::NoStore => "no-store",
            NotStored::Private => "private",
            NotStored::NoCache => "no-cache",
            NotStored::ZeroTtl => "ttl-zero",
            NotStored::TooBig => "too-big",
            NotStored::StoreFull => "store-full",
            NotStored::Unparsable => "unparsable",
            NotStored::Contended => "contended",
            NotStored::Error => "error",
        }
    }
}

/// TTL for an upstream answer: the policy's, or the origin's s-maxage/max-age clamped to max_ttl_s.
pub fn response_ttl(policy: &Policy, cache_control: Option<&str>) -> Result<u64, NotStored> {
    let cc = cache_control.map(parse).unwrap_or_default();
    if cc.no_store {
        return Err(NotStored::NoStore);
    }
    if cc.private {
        return Err(NotStored::Private);
    }
    if cc.no_cache {
        // A shared cache must revalidate every use; we don't revalidate, so don't store.
        return Err(NotStored::NoCache);
    }
    let ttl = cc.s_maxage.or(cc.max_age).unwrap_or(policy.ttl_s).min(policy.max_ttl_s);
    if ttl == 0 {
        return Err(NotStored::ZeroTtl);
    }
    Ok(ttl)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Scope;

    fn policy(ttl: u64, max: u64) -> Policy {
        Policy {
            model_prefix: "m".into(), ttl_s: ttl, max_ttl_s: max, generation: 0, hash_headers: vec![],
            vary_headers: vec![], scope: Scope::Shared, enabled: true, ignore_fields: vec![], deterministic_only: false,
        }
    }

    #[test]
    fn parses_directives() {
        let cc = parse("public, Max-Age=60, s-maxage=\"30\", no-cache");
        assert_eq!(cc, CacheControl { no_cache: true, max_age: Some(60), s_maxage: Some(30), ..Default::default() });
        assert_eq!(parse("max-age=abc").max_age, None);
    }

    #[test]
    fn ttl_rules() {
        let p = policy(300, 1800);
        assert_eq!(response_ttl(&p, None), Ok(300));
        assert_eq!(response_ttl(&p, Some("max-age=60")), Ok(60));
        assert_eq!(response_ttl(&p, Some("max-age=60, s-maxage=90")), Ok(90));
        assert_eq!(response_ttl(&p, Some("max-age=99999")), Ok(1800));
        assert_eq!(response_ttl(&p, Some("no-store")), Err(NotStored::NoStore));
        assert_eq!(response_ttl(&p, Some("private, max-age=5")), Err(NotStored::Private));
        assert_eq!(response_ttl(&p, Some("max-age=0")), Err(NotStored::ZeroTtl));
        assert_eq!(response_ttl(&policy(0, 0), None), Err(NotStored::ZeroTtl));
    }
}
