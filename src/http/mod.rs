//! The HTTP API: router, shared state, the OpenAPI document and the middleware that guards
//! every route (metrics, concurrency limit, timeout).

pub mod answer;
pub mod auth;
pub mod calibration;
pub mod devices;
pub mod estimate;
pub mod extract;
pub mod idempotency;
pub mod service;
pub mod types;
pub mod validate;

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use tokio::sync::Semaphore;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use utoipa_swagger_ui::SwaggerUi;

use crate::calibration::store::ProfileStore;
use crate::devices::watch::Sampler;
use crate::devices::GpuDevices;
use crate::error::ApiError;
use crate::estimators::Estimators;
use crate::http::auth::WriteAccess;
use crate::http::idempotency::IdempotencyKeys;
use crate::metrics::Metrics;

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_body_bytes: usize,
    pub max_batch_items: usize,
    pub request_timeout: Duration,
}

#[derive(Clone)]
pub struct AppState {
    pub estimators: Arc<Estimators>,
    pub metrics: Arc<Metrics>,
    pub ready: Arc<AtomicBool>,
    pub limits: Limits,
    /// One permit per request in flight; none left means refuse with 503 at once.
    pub permits: Arc<Semaphore>,
    pub devices: Arc<dyn GpuDevices>,
    pub profiles: Arc<ProfileStore>,
    /// Who may call the routes that change state.
    pub writes: WriteAccess,
    /// Every process watch, on one thread; stopped on shutdown.
    pub watches: Arc<Sampler>,
    /// Idempotency keys of recent observation calls and their answers.
    pub idempotency: Arc<IdempotencyKeys>,
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "gpucast",
        description = "Estimates the GPU memory and utilization of a deep-learning training job before it runs."
    ),
    tags(
        (name = "estimate", description = "Memory and utilization estimates"),
        (name = "operations", description = "Health, readiness and metrics"),
        (name = "devices", description = "GPUs of this host and per-GPU calibration"),
    ),
    modifiers(&BearerSecurity)
)]
struct ApiDoc;

fn api_router() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(estimate::estimate))
        .routes(routes!(estimate::estimate_batch))
        .routes(routes!(service::estimators))
        .routes(routes!(service::healthz))
        .routes(routes!(service::readyz))
        .routes(routes!(service::metrics))
        .routes(routes!(devices::devices))
        .routes(routes!(calibration::profiles))
        .routes(routes!(calibration::observe))
        .routes(routes!(calibration::watch))
}

/// States in the spec what the code enforces: a job gives exactly one of `layers` and
/// `summary` (a derived struct schema can only make both optional).
struct LayersOrSummary;

impl utoipa::Modify for LayersOrSummary {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::schema::{
            AllOfBuilder, ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, Type,
        };
        use utoipa::openapi::RefOr;
        let Some(components) = openapi.components.as_mut() else {
            return;
        };
        let Some(RefOr::T(Schema::Object(request))) = components.schemas.remove("EstimateRequest")
        else {
            return;
        };
        let example = request.example.clone();
        let exactly_one = OneOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .required("layers")
                    .property("layers", ArrayBuilder::new()),
            )
            .item(
                ObjectBuilder::new()
                    .required("summary")
                    .property("summary", ObjectBuilder::new().schema_type(Type::Object)),
            );
        let description = request.description.clone();
        // `example`, not 3.1's `examples`: it is what Swagger UI's "Try it out" fills in.
        #[allow(deprecated)]
        let schema = AllOfBuilder::new()
            .item(request)
            .item(exactly_one)
            .description(description)
            .example(example)
            .build();
        components
            .schemas
            .insert("EstimateRequest".into(), RefOr::T(Schema::AllOf(schema)));
    }
}

/// Declares the bearer token of the calibration routes in the spec.
struct BearerSecurity;

impl utoipa::Modify for BearerSecurity {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The OpenAPI document, generated from the handlers and wire types.
pub fn openapi() -> utoipa::openapi::OpenApi {
    complete(api_router().split_for_parts().1)
}

/// What the derives cannot say: the version, and rules across fields. Runs after the routes
/// have registered their schemas (the `#[openapi]` modifiers run before).
fn complete(mut api: utoipa::openapi::OpenApi) -> utoipa::openapi::OpenApi {
    use utoipa::Modify;
    api.info.version = env!("CARGO_PKG_VERSION").to_string();
    LayersOrSummary.modify(&mut api);
    api
}

pub fn router(state: AppState) -> Router {
    let (api_routes, api) = api_router().split_for_parts();
    let api = complete(api);
    api_routes
        .merge(SwaggerUi::new("/docs").url("/openapi.json", api))
        .layer(DefaultBodyLimit::max(state.limits.max_body_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// Admission control, timeout and HTTP metrics for every request.
async fn guard(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = request.method().as_str().to_owned();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = match state.permits.clone().try_acquire_owned() {
        Err(_) => {
            // Read the body before refusing: a connection closed with request bytes unread is
            // reset by the kernel, and the client would see a reset instead of 503 + Retry-After.
            let body = axum::body::to_bytes(request.into_body(), state.limits.max_body_bytes);
            let _ = tokio::time::timeout(Duration::from_secs(1), body).await;
            ApiError::Overloaded.into_response()
        }
        Ok(permit) => {
            let response =
                match tokio::time::timeout(state.limits.request_timeout, next.run(request)).await {
                    Ok(response) => response,
                    Err(_) => ApiError::Timeout.into_response(),
                };
            drop(permit);
            response
        }
    };
    let status = response.status().as_u16().to_string();
    let labels = [method.as_str(), route.as_str(), status.as_str()];
    state
        .metrics
        .http_requests_total
        .with_label_values(&labels)
        .inc();
    state
        .metrics
        .http_request_duration_seconds
        .with_label_values(&labels)
        .observe(started.elapsed().as_secs_f64());
    response
}
