//! An [`ApiError`]'s wire form: the problem-details body (RFC 9457) and the headers a client
//! sees with its status. The error type and its statuses stay in `crate::error`; what clients
//! receive is the wire's, here.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::api::types::Problem;
use crate::error::ApiError;

/// Seconds a refused client is asked to wait before retrying.
const RETRY_AFTER_SECS: &str = "1";
/// Seconds a client refused a watch is asked to wait: watches last as long as training jobs,
/// so a place frees up in minutes, not at once.
const WATCH_RETRY_AFTER_SECS: &str = "60";

impl ApiError {
    /// The body a client sees.
    pub fn problem(&self) -> Problem {
        let detail = match self {
            ApiError::Internal(detail) => {
                tracing::error!(%detail, "internal error");
                "an internal error occurred; it has been logged".to_string()
            }
            other => bounded(other.to_string()),
        };
        Problem {
            title: self.title().into(),
            status: self.status().as_u16(),
            detail,
        }
    }
}

/// The most characters of a problem's detail a client gets back: a detail may quote the
/// caller (serde's messages quote an unknown field's name whole), and a megabyte of name must
/// not come back as a megabyte of answer.
const MAX_DETAIL_CHARS: usize = 1024;

fn bounded(detail: String) -> String {
    match detail.char_indices().nth(MAX_DETAIL_CHARS) {
        None => detail,
        Some((cut, _)) => {
            let rest = detail[cut..].chars().count();
            format!("{}… ({rest} more characters)", &detail[..cut])
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let mut response = (status, axum::Json(self.problem())).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if status == StatusCode::TOO_MANY_REQUESTS {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(WATCH_RETRY_AFTER_SECS),
            );
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            headers.insert(
                header::RETRY_AFTER,
                HeaderValue::from_static(RETRY_AFTER_SECS),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_detail_quoting_the_caller_comes_back_cut_short() {
        let name = "k".repeat(1_500_000);
        let problem = ApiError::MalformedJson(format!("unknown field `{name}`")).problem();
        assert!(
            problem.detail.chars().count() < MAX_DETAIL_CHARS + 40,
            "{}",
            problem.detail.len()
        );
        assert!(problem.detail.ends_with("more characters)"));
        let short = ApiError::MalformedJson("expected `,`".into()).problem();
        assert_eq!(short.detail, "expected `,`");
    }
}
