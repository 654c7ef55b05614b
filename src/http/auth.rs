//! The bearer-token check for routes that change state (calibration observations, watches).

use std::net::SocketAddr;

use axum::http::{header, HeaderMap};

use crate::config::ApiToken;
use crate::error::ApiError;
use crate::http::AppState;

/// Who may call the routes that change state (calibration observations and watches).
///
/// Safe by default: a calibration profile moves every estimate for its GPU, so an open write
/// route on a reachable address lets anyone who can reach it poison the answers. Without a
/// token, writes are allowed only when the listener is loopback-only (a sidecar or a local
/// operator); on any other address they are refused with 403.
#[derive(Clone, Debug)]
pub enum WriteAccess {
    /// Writes need `Authorization: Bearer <token>`.
    Token(ApiToken),
    /// No token, but the listener accepts only loopback connections: writes are open.
    Loopback,
    /// No token and a reachable listener: writes are refused.
    Disabled,
}

impl WriteAccess {
    /// The access that follows from the configured token and the address actually bound.
    pub fn new(token: Option<ApiToken>, listening_on: SocketAddr) -> WriteAccess {
        match token {
            Some(token) => WriteAccess::Token(token),
            None if listening_on.ip().is_loopback() => WriteAccess::Loopback,
            None => WriteAccess::Disabled,
        }
    }

    /// One line for the start-up log.
    pub fn describe(&self) -> &'static str {
        match self {
            WriteAccess::Token(_) => "calibration writes need the bearer token",
            WriteAccess::Loopback => {
                "calibration writes are open without a token: the listener is loopback-only"
            }
            WriteAccess::Disabled => DISABLED,
        }
    }
}

/// Why a write is refused when no token is configured and the listener is reachable.
const DISABLED: &str = "calibration writes are disabled: start with --token or listen on loopback";

/// Whether a request may proceed, given its `Authorization` header and the configured token.
///
/// - No token configured: every request is allowed; [`require_write_access`] decides before
///   that whether writes without a token are open at all (loopback-only listener) or refused.
/// - A token configured: the header must be `Bearer <token>` (scheme case-insensitive, as
///   RFC 7235 says); the token is compared in constant time so its bytes cannot be guessed one
///   by one from response times.
/// - An empty configured token authorizes nothing (fail closed); configuration should refuse it.
pub fn authorized(header: Option<&str>, token: Option<&str>) -> bool {
    let Some(expected) = token else {
        return true;
    };
    if expected.is_empty() {
        return false;
    }
    let Some(presented) = header.and_then(bearer_credentials) else {
        return false;
    };
    constant_time_eq(presented.as_bytes(), expected.as_bytes())
}

/// The credentials of a `Bearer` authorization header.
fn bearer_credentials(header: &str) -> Option<&str> {
    let (scheme, credentials) = header.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| credentials.trim_start())
}

/// Compares every byte of the longer input whatever the content, so the time taken depends
/// only on the lengths (a token's length is not a secret worth protecting).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut difference = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        difference |= u64::from(x ^ y);
    }
    std::hint::black_box(difference) == 0
}

/// Lets a write through per [`WriteAccess`]: 403 when writes are disabled, 401 without the
/// configured bearer token, through on a loopback-only listener without one.
pub fn require_write_access(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let token = match &state.writes {
        WriteAccess::Disabled => return Err(ApiError::Forbidden(DISABLED.into())),
        WriteAccess::Loopback => return Ok(()),
        WriteAccess::Token(token) => token,
    };
    let header = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if authorized(header, Some(token.expose())) {
        Ok(())
    } else {
        Err(ApiError::Unauthorized)
    }
}

/// The `Host` (and `Origin`) names a write may carry.
///
/// A web page can make its visitor's browser post to a loopback listener, and DNS rebinding
/// can give such a request a foreign `Host` on the listener's own address. A loopback listener
/// takes writes only for loopback names (`localhost`, 127.0.0.0/8, ::1) and the configured
/// ones; a reachable listener (whose writes need the token) checks only the configured ones,
/// when there are any.
#[derive(Clone, Debug, Default)]
pub struct WriteHosts {
    loopback_listener: bool,
    allowed: Vec<String>,
}

impl WriteHosts {
    pub fn new(listening_on: SocketAddr, allowed: &[String]) -> WriteHosts {
        WriteHosts {
            loopback_listener: listening_on.ip().is_loopback(),
            allowed: allowed
                .iter()
                .map(|h| h.trim().to_ascii_lowercase())
                .collect(),
        }
    }

    /// Whether `authority` (`name[:port]`, as a `Host` header or an origin carries it) names
    /// this service.
    pub fn allows(&self, authority: &str) -> bool {
        let Ok(authority) = authority.parse::<axum::http::uri::Authority>() else {
            return false;
        };
        let name = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_ascii_lowercase();
        if self.allowed.contains(&name) {
            return true;
        }
        if self.loopback_listener {
            return name == "localhost"
                || name
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback());
        }
        self.allowed.is_empty()
    }
}

/// Whether the origin `uri` (authority `origin`) is served on the port the `host` header
/// names, a port left out being the origin's scheme's default: a page served from another
/// port of the same host (another local app) is another origin. Only http and https pages
/// have an origin a write may come from.
fn same_port(uri: &axum::http::Uri, origin: &axum::http::uri::Authority, host: &str) -> bool {
    let default = match uri.scheme_str() {
        Some("http") => 80,
        Some("https") => 443,
        _ => return false,
    };
    host.parse::<axum::http::uri::Authority>()
        .is_ok_and(|host| {
            origin.port_u16().unwrap_or(default) == host.port_u16().unwrap_or(default)
        })
}

/// What a write must show before its body is read: JSON (a form post, which a page may send
/// without asking, is not), no cross-site fetch metadata, an `Origin` (when present) and a
/// `Host` that name this service, then the right to write ([`require_write_access`]).
pub fn check_write_request(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return Err(ApiError::UnsupportedMediaType);
    }
    let text = |name| headers.get(name).map(|v| v.to_str().unwrap_or(""));
    if let Some(site) = text(header::HeaderName::from_static("sec-fetch-site")) {
        if !matches!(site, "same-origin" | "none") {
            return Err(ApiError::Forbidden(
                "writes from another site's page are refused (Sec-Fetch-Site)".into(),
            ));
        }
    }
    if let Some(origin) = text(header::ORIGIN) {
        let host = text(header::HOST).unwrap_or("");
        let named = origin.parse::<axum::http::Uri>().ok().and_then(|uri| {
            uri.authority()
                .map(|a| state.write_hosts.allows(a.as_str()) && same_port(&uri, a, host))
        });
        if named != Some(true) {
            return Err(ApiError::Forbidden(
                "writes from another origin are refused (Origin)".into(),
            ));
        }
    }
    if !text(header::HOST).is_some_and(|host| state.write_hosts.allows(host)) {
        return Err(ApiError::Forbidden(
            "the Host header does not name this service (add it with --allowed-hosts)".into(),
        ));
    }
    require_write_access(state, headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_configured_token_everything_is_allowed() {
        assert!(authorized(None, None));
        assert!(authorized(Some("Bearer anything"), None));
    }

    #[test]
    fn the_right_bearer_token_is_allowed() {
        assert!(authorized(Some("Bearer s3cret"), Some("s3cret")));
        assert!(authorized(Some("bearer s3cret"), Some("s3cret")));
        assert!(authorized(Some("BEARER   s3cret "), Some("s3cret")));
    }

    #[test]
    fn wrong_missing_or_malformed_credentials_are_refused() {
        let token = Some("s3cret");
        assert!(!authorized(None, token));
        assert!(!authorized(Some(""), token));
        assert!(!authorized(Some("Bearer"), token));
        assert!(!authorized(Some("Bearer "), token));
        assert!(!authorized(Some("Bearer s3cre"), token));
        assert!(!authorized(Some("Bearer s3cret2"), token));
        assert!(!authorized(Some("Bearer S3CRET"), token));
        assert!(!authorized(Some("Basic s3cret"), token));
        assert!(!authorized(Some("s3cret"), token));
    }

    #[test]
    fn an_empty_configured_token_fails_closed() {
        assert!(!authorized(Some("Bearer "), Some("")));
        assert!(!authorized(None, Some("")));
    }

    #[test]
    fn without_a_token_writes_are_open_only_on_loopback() {
        let at = |a: &str| a.parse::<SocketAddr>().unwrap();
        assert!(matches!(
            WriteAccess::new(None, at("127.0.0.1:8080")),
            WriteAccess::Loopback
        ));
        assert!(matches!(
            WriteAccess::new(None, at("[::1]:8080")),
            WriteAccess::Loopback
        ));
        assert!(matches!(
            WriteAccess::new(None, at("0.0.0.0:8080")),
            WriteAccess::Disabled
        ));
        assert!(matches!(
            WriteAccess::new(None, at("10.1.2.3:8080")),
            WriteAccess::Disabled
        ));
        assert!(matches!(
            WriteAccess::new(Some(ApiToken::new("t")), at("0.0.0.0:8080")),
            WriteAccess::Token(_)
        ));
    }

    #[test]
    fn a_loopback_listener_takes_writes_for_loopback_names_only() {
        let at = |a: &str| a.parse::<SocketAddr>().unwrap();
        let local = WriteHosts::new(at("127.0.0.1:8080"), &[]);
        for host in [
            "localhost:8080",
            "127.0.0.1:8080",
            "127.1.2.3",
            "[::1]:8080",
            "LOCALHOST",
        ] {
            assert!(local.allows(host), "{host}");
        }
        for host in [
            "evil.example:8080",
            "evil.example",
            "10.0.0.1:8080",
            "",
            "a b",
        ] {
            assert!(!local.allows(host), "{host}");
        }
        let named = WriteHosts::new(at("127.0.0.1:8080"), &["gpucast.lan".into()]);
        assert!(named.allows("gpucast.lan:8080") && named.allows("localhost"));
        // A reachable listener's writes need the token; a configured list still narrows them.
        assert!(WriteHosts::new(at("0.0.0.0:8080"), &[]).allows("anything.example"));
        let listed = WriteHosts::new(at("0.0.0.0:8080"), &["gpucast.lan".into()]);
        assert!(listed.allows("gpucast.lan") && !listed.allows("evil.example"));
    }

    #[test]
    fn constant_time_eq_agrees_with_eq() {
        for (a, b) in [
            ("", ""),
            ("a", ""),
            ("abc", "abc"),
            ("abc", "abd"),
            ("abc", "abcd"),
            ("\0", ""),
        ] {
            assert_eq!(
                constant_time_eq(a.as_bytes(), b.as_bytes()),
                a == b,
                "{a:?} vs {b:?}"
            );
        }
    }
}
