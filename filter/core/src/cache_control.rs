//! Cache-Control directives that matter to a shared cache, and the TTL an answer gets.

use crate::config::Policy;

#[derive(Debug, Default, PartialEq, Eq)]
pub struct CacheControl {
    pub no_store: bool,
    pub no_cache: bool,
    pub private: bool,
    pub max_age: Option<u64>,
    pub s_maxage: Option<u64>,
    /// A max-age or s-maxage without a valid delta-seconds, or given twice with different
    /// values: RFC 9111 §4.2.1 / §1.2.2 say to treat the answer as stale.
    pub invalid: bool,
    /// RFC 5861 extensions (Some(0) when malformed: the origin meant something, so no staleness).
    pub stale_if_error: Option<u64>,
    pub stale_while_revalidate: Option<u64>,
    /// must-revalidate / proxy-revalidate (RFC 9111 §5.2.2.2, §5.2.2.8): never served stale
    /// unless the origin also allows it with an explicit `stale-*` directive.
    pub must_revalidate: bool,
}

/// delta-seconds: digits only; values past u64 saturate (RFC 9111 §1.2.2 allows capping).
fn delta_seconds(arg: Option<&str>) -> Option<u64> {
    let a = arg?;
    if a.is_empty() || !a.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(a.parse::<u64>().unwrap_or(u64::MAX))
}

fn set_once(slot: &mut Option<u64>, value: Option<u64>, invalid: &mut bool) {
    match (value, *slot) {
        (None, _) => *invalid = true,
        (Some(v), Some(old)) if old != v => *invalid = true,
        (Some(v), _) => *slot = Some(v),
    }
}

pub fn parse(value: &str) -> CacheControl {
    let mut cc = CacheControl::default();
    for directive in value.split(',') {
        let directive = directive.trim();
        let (name, arg) = match directive.find('=') {
            Some(i) => (&directive[..i], Some(directive[i + 1..].trim().trim_matches('"'))),
            None => (directive, None),
        };
        let seconds = delta_seconds(arg);
        match name.trim().to_ascii_lowercase().as_str() {
            "no-store" => cc.no_store = true,
            "no-cache" => cc.no_cache = true,
            "private" => cc.private = true,
            "max-age" => set_once(&mut cc.max_age, seconds, &mut cc.invalid),
            "s-maxage" => set_once(&mut cc.s_maxage, seconds, &mut cc.invalid),
            "stale-if-error" => cc.stale_if_error = Some(cc.stale_if_error.unwrap_or(u64::MAX).min(seconds.unwrap_or(0))),
            "stale-while-revalidate" => {
                cc.stale_while_revalidate = Some(cc.stale_while_revalidate.unwrap_or(u64::MAX).min(seconds.unwrap_or(0)))
            }
            "must-revalidate" | "proxy-revalidate" => cc.must_revalidate = true,
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
    /// Expired on arrival (`Expires` not after `Date`, an invalid `Expires` or max-age).
    Stale,
    /// The origin's `Vary` names request headers the key does not include (or is `*`).
    Vary,
    /// The answer sets a cookie: it belongs to one client.
    SetCookie,
    /// A header that is not valid UTF-8 could not be stored byte for byte.
    HeaderBytes,
    /// An event stream that did not end with its terminal event (`data: [DONE]`): cut short.
    StreamIncomplete,
    /// An event stream carrying an error event (`data: {"error": ...}`).
    StreamError,
}

impl NotStored {
    /// Every reason, each with its own counter (`metric_names::not_stored_counter`).
    pub const ALL: [NotStored; 17] = [
        NotStored::Status,
        NotStored::GrpcStatus,
        NotStored::NoStore,
        NotStored::Private,
        NotStored::NoCache,
        NotStored::ZeroTtl,
        NotStored::TooBig,
        NotStored::StoreFull,
        NotStored::Contended,
        NotStored::Error,
        NotStored::Unparsable,
        NotStored::Stale,
        NotStored::Vary,
        NotStored::SetCookie,
        NotStored::HeaderBytes,
        NotStored::StreamIncomplete,
        NotStored::StreamError,
    ];

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
            NotStored::Stale => "stale",
            NotStored::Vary => "vary",
            NotStored::SetCookie => "set-cookie",
            NotStored::HeaderBytes => "header-bytes",
            NotStored::StreamIncomplete => "stream-incomplete",
            NotStored::StreamError => "stream-error",
        }
    }
}

/// A request's `Cache-Control` (all lines joined) asks the cache to revalidate: `no-cache`, or
/// `max-age=0` (RFC 9111 §5.2.1.1: no stored answer of any age is acceptable).
pub fn request_wants_revalidation(value: &str) -> bool {
    let cc = parse(value);
    cc.no_cache || cc.max_age == Some(0)
}

/// What the origin said about freshness: all `Cache-Control` lines joined, every `Expires`
/// line, and `Date`.
#[derive(Default)]
pub struct Freshness<'a> {
    pub cache_control: Option<&'a str>,
    pub expires: &'a [&'a str],
    pub date: Option<&'a str>,
}

/// TTL for an upstream answer: the origin's s-maxage, else max-age, else `Expires` - `Date`
/// (RFC 9111 §4.2.1), else the policy's; clamped to `max_ttl_s`. `now_s`: when `Date` is absent.
/// How long a stored answer is fresh, and whether that came from the policy's `ttl_s` (the
/// origin said nothing): such an entry follows a later, lower `ttl_s` (see `Lifetime`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ttl {
    pub s: u64,
    pub from_policy: bool,
}

pub fn response_ttl(policy: &Policy, f: &Freshness, now_s: u64) -> Result<Ttl, NotStored> {
    let cc = f.cache_control.map(parse).unwrap_or_default();
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
    if cc.invalid {
        return Err(NotStored::Stale);
    }
    let origin = match cc.s_maxage.or(cc.max_age) {
        Some(s) => Some(s),
        None => match f.expires {
            [] => None,
            // Invalid dates (e.g. "0") and repeated Expires lines mean "already expired".
            [one] => {
                let expires = http_date(one).ok_or(NotStored::Stale)?;
                let base = f.date.and_then(http_date).unwrap_or(now_s);
                if expires <= base {
                    return Err(NotStored::Stale);
                }
                Some(expires - base)
            }
            _ => return Err(NotStored::Stale),
        },
    };
    let ttl = origin.unwrap_or(policy.ttl_s).min(policy.max_ttl_s);
    if ttl == 0 {
        return Err(NotStored::ZeroTtl);
    }
    Ok(Ttl { s: ttl, from_policy: origin.is_none() })
}

/// The stale windows (RFC 5861) a stored answer gets: (stale-if-error, stale-while-revalidate)
/// seconds. Each is the policy's, or the origin's directive when it sends one, never more than
/// the policy's (0 = off). Without an explicit directive, `must-revalidate`, `proxy-revalidate`
/// and `s-maxage` (which implies proxy-revalidate for a shared cache, RFC 9111 §5.2.2.10) forbid
/// serving the answer stale.
pub fn stale_windows(policy: &Policy, cache_control: Option<&str>) -> (u32, u32) {
    let cc = cache_control.map(parse).unwrap_or_default();
    let forbidden = cc.must_revalidate || cc.s_maxage.is_some();
    let window = |origin: Option<u64>, limit: u64| -> u32 {
        let s = match origin {
            Some(s) => s.min(limit),
            None if forbidden => 0,
            None => limit,
        };
        s.min(u32::MAX as u64) as u32
    };
    (window(cc.stale_if_error, policy.stale_if_error_s), window(cc.stale_while_revalidate, policy.stale_while_revalidate_s))
}

/// Seconds since the epoch of an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), the form
/// RFC 9110 §5.6.7 requires senders to use. The obsolete forms read as invalid (= stale).
pub fn http_date(s: &str) -> Option<u64> {
    let b = s.trim().as_bytes();
    if b.len() != 29 || &b[3..5] != b", " || &b[25..] != b" GMT" || b[7] != b' ' || b[11] != b' ' || b[16] != b' ' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<u64> {
        let part = b.get(r)?;
        if !part.iter().all(|c| c.is_ascii_digit()) {
            return None;
        }
        std::str::from_utf8(part).ok()?.parse().ok()
    };
    const MONTHS: [&[u8]; 12] = [b"Jan", b"Feb", b"Mar", b"Apr", b"May", b"Jun", b"Jul", b"Aug", b"Sep", b"Oct", b"Nov", b"Dec"];
    let month = MONTHS.iter().position(|m| *m == &b[8..11])? as u64 + 1;
    let (day, year) = (num(5..7)?, num(12..16)?);
    let (h, m, sec) = (num(17..19)?, num(20..22)?, num(23..25)?);
    if b[19] != b':' || b[22] != b':' || day == 0 || day > 31 || h > 23 || m > 59 || sec > 60 || year < 1970 {
        return None;
    }
    // Days from the civil date (proleptic Gregorian), after H. Hinnant's algorithm.
    let (y, mo) = if month <= 2 { (year - 1, month + 9) } else { (year, month - 3) };
    let era = y / 400;
    let yoe = y - era * 400;
    let doy = (153 * mo + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe;
    let days_since_epoch = days.checked_sub(719_468)?;
    Some(days_since_epoch * 86_400 + h * 3600 + m * 60 + sec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ClientNoCache, Scope};

    fn policy(ttl: u64, max: u64) -> Policy {
        Policy {
            model_prefix: "m".into(), ttl_s: ttl, max_ttl_s: max, generation: 0, hash_headers: vec![],
            vary_headers: vec![], scope: Scope::Shared, enabled: true, ignore_fields: vec![], deterministic_only: false,
            coalesce_timeout_ms: 0, stale_if_error_s: 0, stale_while_revalidate_s: 0,
            client_no_cache: ClientNoCache::Revalidate,
            semantic: None,
        }
    }

    #[test]
    fn parses_directives() {
        let cc = parse("public, Max-Age=60, s-maxage=\"30\", no-cache");
        assert_eq!(cc, CacheControl { no_cache: true, max_age: Some(60), s_maxage: Some(30), ..Default::default() });
        assert_eq!(parse("max-age=abc").max_age, None);
    }

    #[test]
    fn requests_that_ask_to_revalidate() {
        // Conflicting max-age values with a 0 among them: revalidating is the safe reading.
        for v in ["no-cache", "max-age=0", "Max-Age=\"0\"", "max-stale, max-age=0", "NO-CACHE", "max-age=0, max-age=5"] {
            assert!(request_wants_revalidation(v), "{}", v);
        }
        for v in ["", "max-age=1", "max-age=abc", "no-transform", "only-if-cached"] {
            assert!(!request_wants_revalidation(v), "{}", v);
        }
    }

    #[test]
    fn stale_windows_are_the_policys_or_the_origins_clamped() {
        let mut p = policy(60, 60);
        p.stale_if_error_s = 600;
        p.stale_while_revalidate_s = 30;
        assert_eq!(stale_windows(&p, None), (600, 30));
        assert_eq!(stale_windows(&p, Some("max-age=5, stale-if-error=100")), (100, 30));
        assert_eq!(stale_windows(&p, Some("stale-if-error=100000, stale-while-revalidate=99999")), (600, 30), "clamped");
        assert_eq!(stale_windows(&p, Some("stale-while-revalidate=0")), (600, 0));
        assert_eq!(stale_windows(&p, Some("stale-if-error=abc")), (0, 30), "malformed: none");
        assert_eq!(stale_windows(&p, Some("stale-if-error=9, stale-if-error=3")), (3, 30), "repeated: the smaller");
        assert_eq!(stale_windows(&p, Some("must-revalidate")), (0, 0));
        assert_eq!(stale_windows(&p, Some("s-maxage=9")), (0, 0), "s-maxage implies proxy-revalidate");
        assert_eq!(stale_windows(&p, Some("proxy-revalidate, stale-if-error=50")), (50, 0), "explicit beats implied");
        let off = policy(60, 60);
        assert_eq!(stale_windows(&off, Some("stale-if-error=100, stale-while-revalidate=100")), (0, 0), "policy 0 = off");
    }

    fn ttl(p: &Policy, cc: Option<&str>) -> Result<u64, NotStored> {
        response_ttl(p, &Freshness { cache_control: cc, ..Default::default() }, 0).map(|t| t.s)
    }

    #[test]
    fn ttl_rules() {
        let p = policy(300, 1800);
        assert_eq!(ttl(&p, None), Ok(300));
        assert_eq!(ttl(&p, Some("max-age=60")), Ok(60));
        assert_eq!(ttl(&p, Some("max-age=60, s-maxage=90")), Ok(90));
        assert_eq!(ttl(&p, Some("max-age=99999")), Ok(1800));
        assert_eq!(ttl(&p, Some("max-age=99999999999999999999999")), Ok(1800));
        assert_eq!(ttl(&p, Some("no-store")), Err(NotStored::NoStore));
        assert_eq!(ttl(&p, Some("private, max-age=5")), Err(NotStored::Private));
        assert_eq!(ttl(&p, Some("max-age=0")), Err(NotStored::ZeroTtl));
        assert_eq!(ttl(&policy(0, 0), None), Err(NotStored::ZeroTtl));
    }

    #[test]
    fn invalid_max_age_is_stale() {
        let p = policy(300, 1800);
        for bad in ["max-age=abc", "max-age=-1", "max-age", "max-age=", "max-age=5, max-age=6", "s-maxage=1x"] {
            assert_eq!(ttl(&p, Some(bad)), Err(NotStored::Stale), "{}", bad);
        }
        assert_eq!(ttl(&p, Some("max-age=5, max-age=5")), Ok(5));
    }

    #[test]
    fn expires_and_date() {
        let p = policy(300, 1800);
        let date = "Sun, 06 Nov 1994 08:49:37 GMT";
        assert_eq!(http_date(date), Some(784_111_777));
        assert_eq!(http_date("Thu, 01 Jan 1970 00:00:00 GMT"), Some(0));
        assert_eq!(http_date("0"), None);
        assert_eq!(http_date("Sunday, 06-Nov-94 08:49:37 GMT"), None);
        let f = |expires: &'static [&'static str], date: Option<&'static str>, cc: Option<&'static str>| {
            response_ttl(&p, &Freshness { cache_control: cc, expires, date }, 784_111_777).map(|t| t.s)
        };
        assert_eq!(f(&["Sun, 06 Nov 1994 08:49:00 GMT"], Some(date), None), Err(NotStored::Stale), "in the past");
        assert_eq!(f(&["Sun, 06 Nov 1994 08:49:37 GMT"], None, None), Err(NotStored::Stale), "now = expired");
        assert_eq!(f(&["0"], Some(date), None), Err(NotStored::Stale), "invalid = in the past");
        assert_eq!(f(&["Sun, 06 Nov 1994 08:50:37 GMT"], Some(date), None), Ok(60));
        assert_eq!(f(&["Sun, 06 Nov 1994 08:50:37 GMT", "Sun, 06 Nov 1994 08:51:37 GMT"], Some(date), None), Err(NotStored::Stale));
        assert_eq!(f(&["Sun, 06 Nov 1994 08:49:00 GMT"], Some(date), Some("max-age=30")), Ok(30), "max-age wins over Expires");
    }
}
