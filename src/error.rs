//! One API error type; every failure a client can see maps to a status here, and nowhere else
//! (its problem-details body and headers: `api::problem`).

use axum::http::StatusCode;

use crate::estimators::EstimateError;
use crate::job::JobError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON at all (syntax error, truncated, non-finite number).
    #[error("{0}")]
    MalformedJson(String),
    /// The JSON is well formed but does not describe a valid request.
    #[error("{0}")]
    InvalidInput(String),
    #[error("request body exceeds the limit of {0} bytes")]
    PayloadTooLarge(usize),
    #[error("the request body did not arrive within {0} s")]
    BodyTimeout(u64),
    #[error("the request body could not be read: {0}")]
    UnreadableBody(String),
    #[error("content-encoding is not accepted: send the body uncompressed")]
    UnsupportedEncoding,
    #[error(
        "content-type must be application/json (or application/yaml for a job); a model printout (torchsummary, torchinfo, \
         print(model), Keras) goes inside JSON: {{\"summary\": {{\"text\": \"<the printout>\"}}, \
         \"batch_size\": 32}}"
    )]
    UnsupportedMediaType,
    /// The body is a model printout pasted as it is, not JSON.
    #[error(
        "the body is a model printout, not JSON: send it as {{\"summary\": {{\"text\": \
         \"<the printout>\"}}, \"batch_size\": 32}} (the CLI takes the file as it is: gpucast \
         estimate --batch-size 32 printout.txt)"
    )]
    PrintoutBody,
    #[error("the service is at its concurrency limit; retry shortly")]
    Overloaded,
    #[error("the request took too long")]
    Timeout,
    #[error("the service is not ready")]
    NotReady,
    /// The calibration store cannot be written now; nothing of the call was stored.
    #[error("the calibration store is unavailable; nothing was recorded, retry later ({0})")]
    StoreUnavailable(String),
    #[error("a valid bearer token is required")]
    Unauthorized,
    /// The request clashes with the state of the service (a process watched already).
    #[error("{0}")]
    Conflict(String),
    /// As many processes are watched as the service allows.
    #[error("{0}")]
    TooManyWatches(String),
    /// The route is switched off by configuration; the detail says how to switch it on.
    #[error("{0}")]
    Forbidden(String),
    /// The request needs a GPU this host does not have (or cannot read).
    #[error("{0}")]
    NoDevice(String),
    /// The route is listed but switched off by configuration: 404, as if it were not there;
    /// the detail says how to switch it on.
    #[error("{0}")]
    Off(String),
    /// No route has this path.
    #[error("no route {0}; the routes are listed at /docs")]
    NotFound(String),
    /// The route exists, but not for this method (the `Allow` header lists those it has).
    #[error("method {0} is not allowed on this route; see the Allow header")]
    MethodNotAllowed(String),
    /// A bug or a runtime failure: the detail goes to the log, never to the client.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::MalformedJson(_) => StatusCode::BAD_REQUEST,
            ApiError::InvalidInput(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::UnreadableBody(_) => StatusCode::BAD_REQUEST,
            ApiError::UnsupportedMediaType
            | ApiError::PrintoutBody
            | ApiError::UnsupportedEncoding => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Overloaded
            | ApiError::Timeout
            | ApiError::NotReady
            | ApiError::StoreUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::TooManyWatches(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::NoDevice(_) => StatusCode::CONFLICT,
            ApiError::NotFound(_) | ApiError::Off(_) => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub(crate) fn title(&self) -> &'static str {
        match self {
            ApiError::MalformedJson(_) => "Malformed JSON",
            ApiError::InvalidInput(_) => "Invalid request",
            ApiError::PayloadTooLarge(_) => "Payload too large",
            ApiError::BodyTimeout(_) => "Request timeout",
            ApiError::UnreadableBody(_) => "Unreadable body",
            ApiError::UnsupportedMediaType | ApiError::PrintoutBody => "Unsupported media type",
            ApiError::UnsupportedEncoding => "Unsupported content encoding",
            ApiError::Overloaded => "Overloaded",
            ApiError::Timeout => "Timeout",
            ApiError::NotReady => "Not ready",
            ApiError::StoreUnavailable(_) => "Store unavailable",
            ApiError::Unauthorized => "Unauthorized",
            ApiError::Forbidden(_) => "Forbidden",
            ApiError::Conflict(_) => "Conflict",
            ApiError::TooManyWatches(_) => "Too many watches",
            ApiError::NoDevice(_) => "No such device",
            ApiError::NotFound(_) | ApiError::Off(_) => "Not found",
            ApiError::MethodNotAllowed(_) => "Method not allowed",
            ApiError::Internal(_) => "Internal error",
        }
    }

    /// Places an input error inside a larger body: with prefix `items[3].`, the detail
    /// `layers[0].kind: ...` becomes `items[3].layers[0].kind: ...`. Other errors are unchanged.
    pub fn within(self, prefix: &str) -> ApiError {
        match self {
            ApiError::InvalidInput(detail) => ApiError::InvalidInput(format!("{prefix}{detail}")),
            other => other,
        }
    }
}

impl From<JobError> for ApiError {
    fn from(e: JobError) -> Self {
        ApiError::InvalidInput(e.to_string())
    }
}

impl From<EstimateError> for ApiError {
    fn from(e: EstimateError) -> Self {
        match e {
            EstimateError::Inference(e) => ApiError::Internal(e.to_string()),
            other => ApiError::InvalidInput(other.to_string()),
        }
    }
}
