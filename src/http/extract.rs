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

    /// A YAML body (`application/yaml`, `application/x-yaml`, `text/yaml`: a job written as
    /// accelerate and DeepSpeed users write their configs) is read into its JSON here, on the
    /// blocking pool (it is CPU work in proportion to the body, within its size limit).
    async fn from_request(request: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let yaml = is_yaml(&request);
        let bytes = body_bytes(request, state).await?;
        if !yaml {
            return Ok(JsonBytes(bytes));
        }
        let json = tokio::task::spawn_blocking(move || {
            let text = std::str::from_utf8(&bytes)
                .map_err(|_| ApiError::MalformedJson("the YAML body is not UTF-8".into()))?;
            let value =
                crate::api::unique_keys::file_text(text).map_err(ApiError::MalformedJson)?;
            Ok::<_, ApiError>(Bytes::from(
                serde_json::to_vec(&value).expect("a JSON value serialises"),
            ))
        })
        .await
        .map_err(|_| ApiError::Internal("reading a YAML body failed".into()))??;
        Ok(JsonBytes(json))
    }
}

/// The YAML media types a job body may come as.
const YAML_TYPES: [&str; 3] = ["application/yaml", "application/x-yaml", "text/yaml"];

fn media_type(request: &Request) -> Option<String> {
    let value = request.headers().get(header::CONTENT_TYPE)?;
    let value = value.to_str().unwrap_or("");
    Some(
        value
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase(),
    )
}

fn is_yaml(request: &Request) -> bool {
    media_type(request).is_some_and(|m| YAML_TYPES.contains(&m.as_str()))
}

/// A JSON body that may be one object or an array of them.
pub struct JsonObjectOrArray<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        if is_yaml(&request) {
            return Err(ApiError::UnsupportedMediaType);
        }
        let bytes = body_bytes(request, state).await?;
        parse_json(&bytes, "").map(JsonBody)
    }
}

impl<T: DeserializeOwned> FromRequest<AppState> for JsonObjectOrArray<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        if is_yaml(&request) {
            return Err(ApiError::UnsupportedMediaType);
        }
        let bytes = body_bytes(request, state).await?;
        deserialize(&bytes, "").map(JsonObjectOrArray)
    }
}

async fn body_bytes(request: Request, state: &AppState) -> Result<Bytes, ApiError> {
    // A missing content type is accepted (curl without -H); a different one is not (YAML is
    // let through for the extractors that read it).
    if let Some(media) = media_type(&request) {
        if media != "application/json" && !YAML_TYPES.contains(&media.as_str()) {
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
