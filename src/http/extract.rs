//! JSON body extractors whose rejections are [`ApiError`]s naming the offending field, so
//! malformed input gets the same problem-details body as every other error (the parsing itself
//! is [`crate::api::parse`], shared with the CLI).

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, StatusCode};
use serde::de::DeserializeOwned;

use crate::api::parse::{deserialize, parse_json};
use crate::error::ApiError;
use crate::http::AppState;

/// A JSON object body.
pub struct JsonBody<T>(pub T);

/// A JSON body still unparsed: the estimate routes parse it on the estimate pool
/// ([`crate::http::pool`]), since a large one is milliseconds of CPU (an estimate body with
/// [`crate::api::parse::parse_estimate`], which also takes a Hugging Face `config.json` as the
/// hub serves it with the training setup beside its keys).
pub struct JsonBytes(pub Bytes);

impl FromRequest<AppState> for JsonBytes {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        body_bytes(request, state).await.map(JsonBytes)
    }
}

/// A JSON body that may be one object or an array of them.
pub struct JsonObjectOrArray<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let bytes = body_bytes(request, state).await?;
        parse_json(&bytes, "").map(JsonBody)
    }
}

impl<T: DeserializeOwned> FromRequest<AppState> for JsonObjectOrArray<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let bytes = body_bytes(request, state).await?;
        deserialize(&bytes, "").map(JsonObjectOrArray)
    }
}

async fn body_bytes(request: Request, state: &AppState) -> Result<Bytes, ApiError> {
    // A missing content type is accepted (curl without -H); a different one is not.
    if let Some(content_type) = request.headers().get(header::CONTENT_TYPE) {
        let is_json = content_type
            .to_str()
            .map(|v| {
                v.split(';')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .eq_ignore_ascii_case("application/json")
            })
            .unwrap_or(false);
        if !is_json {
            return Err(ApiError::UnsupportedMediaType);
        }
    }
    Bytes::from_request(request, state)
        .await
        .map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge(state.limits.max_body_bytes)
            } else {
                ApiError::MalformedJson(rejection.body_text())
            }
        })
}
