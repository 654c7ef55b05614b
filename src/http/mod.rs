//! The HTTP API: router, shared state, the OpenAPI document and the middleware that guards
//! every route (metrics, concurrency limit, timeout).

pub mod admission;
pub mod auth;
pub mod body;
pub mod calibration;
pub mod devices;
pub mod estimate;
pub mod extract;
pub mod gpus;
pub mod idempotency;
pub mod plan;
pub mod pool;
pub mod service;

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

use crate::devices::watch::Sampler;
use crate::engine::Engine;
use crate::error::ApiError;
use crate::http::auth::{check_write_request, WriteAccess, WriteHosts};
use crate::http::idempotency::IdempotencyKeys;
use crate::job::echo;

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_body_bytes: usize,
    pub max_batch_items: usize,
    pub request_timeout: Duration,
    /// How long a body may take to arrive; it is read before the request takes a permit.
    pub body_read_timeout: Duration,
}

#[derive(Clone)]
pub struct AppState {
    /// What answers read: estimators, catalogue, profiles, metrics, this host's GPUs.
    pub engine: Arc<Engine>,
    pub ready: Arc<AtomicBool>,
    pub limits: Limits,
    /// One permit per request in flight; none left means refuse with 503 at once.
    pub permits: Arc<Semaphore>,
    /// Batches estimated at once: a flood of batches waits here (each is spread over the
    /// estimate pool, where single estimates go first).
    pub batch_slots: Arc<Semaphore>,
    /// The threads every estimate's CPU work runs on, off the async workers that accept
    /// connections and answer health.
    pub pool: Arc<pool::CpuPool>,
    /// Who may call the routes that change state.
    pub writes: WriteAccess,
    /// Every process watch, on one thread; stopped on shutdown.
    pub watches: Arc<Sampler>,
    /// Idempotency keys of recent observation calls and their answers.
    pub idempotency: Arc<IdempotencyKeys>,
    /// The `Host` and `Origin` names writes may carry.
    pub write_hosts: Arc<WriteHosts>,
    /// Request-body bytes that may be held at once, in KiB permits.
    pub body_budget: Arc<Semaphore>,
    /// The GPU products the admission webhook places on; `None`: the webhook is off (404).
    pub admission: Option<Arc<crate::kubernetes::ClusterProducts>>,
    /// The main port's connection slots: none left means it closes new connections at once
    /// (and `/readyz` says not ready).
    pub connection_slots: Arc<Semaphore>,
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
        (name = "kubernetes", description = "The mutating admission webhook (with --admission)"),
    ),
    modifiers(&BearerSecurity)
)]
struct ApiDoc;

fn api_router() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(estimate::estimate))
        .routes(routes!(estimate::estimate_batch))
        .routes(routes!(plan::plan))
        .routes(routes!(service::estimators))
        .routes(routes!(service::healthz))
        .routes(routes!(service::readyz))
        .routes(routes!(service::metrics))
        .routes(routes!(devices::devices))
        .routes(routes!(gpus::gpus))
        .routes(routes!(calibration::profiles))
        .routes(routes!(calibration::observe))
        .routes(routes!(calibration::watch))
        .routes(routes!(admission::admission))
}

/// States in the spec what the code enforces across a job's fields (`engine::validate`): it
/// gives exactly one model, as `layers`, a `summary` printout or a `transformer_config`, the
/// last with `seq_len` and without the traced `saved_tensors` and `simulation`, and only it
/// with `attention` and `loss_implementation`; and `batch_size`, unless the Trainer's
/// `training_arguments` state it. A derived struct schema can only make each optional; a field absent and one sent as null are the same to the service, so "not given"
/// reads `{"type": "null"}` in each alternative (a key it may lack).
struct OneModelPerJob;

impl utoipa::Modify for OneModelPerJob {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::schema::{AllOfBuilder, ObjectBuilder, OneOfBuilder, Schema, Type};
        use utoipa::openapi::RefOr;
        let Some(components) = openapi.components.as_mut() else {
            return;
        };
        let Some(RefOr::T(Schema::Object(request))) = components.schemas.remove("EstimateRequest")
        else {
            return;
        };
        let example = request.example.clone();
        let null = || ObjectBuilder::new().schema_type(Type::Null);
        let given = |kind| ObjectBuilder::new().schema_type(kind);
        // (title, description, the fields given, the fields left out)
        let alternatives = [
            (
                "LayerListJob",
                "The model as a layer list (`layers`), optionally with `describe`'s traced \
                 `saved_tensors` and `simulation`.",
                vec![("layers", Type::Array)],
                vec![
                    "summary",
                    "transformer_config",
                    "attention",
                    "loss_implementation",
                ],
            ),
            (
                "SummaryJob",
                "The model as a printout (`summary`): torchsummary, torchinfo, print(model) or \
                 Keras.",
                vec![("summary", Type::Object)],
                vec![
                    "layers",
                    "transformer_config",
                    "attention",
                    "loss_implementation",
                ],
            ),
            (
                "TransformerConfigJob",
                "The model as a Hugging Face `config.json` (`transformer_config`) at `seq_len` \
                 tokens; `family`, when given, is `transformer`.",
                vec![
                    ("transformer_config", Type::Object),
                    ("seq_len", Type::Integer),
                ],
                vec!["layers", "summary", "saved_tensors", "simulation"],
            ),
        ];
        let mut exactly_one = OneOfBuilder::new();
        for (title, description, required, absent) in alternatives {
            let mut branch = ObjectBuilder::new()
                .title(Some(title))
                .description(Some(description));
            for (field, kind) in required {
                branch = branch.required(field).property(field, given(kind));
            }
            for field in absent {
                branch = branch.property(field, null());
            }
            if title == "TransformerConfigJob" {
                branch = branch.property(
                    "family",
                    ObjectBuilder::new()
                        .schema_type(utoipa::openapi::schema::SchemaType::from_iter([
                            Type::String,
                            Type::Null,
                        ]))
                        .enum_values(Some([
                            serde_json::Value::from("transformer"),
                            serde_json::Value::Null,
                        ])),
                );
            }
            exactly_one = exactly_one.item(branch);
        }
        // The samples per step: `batch_size`, or the Trainer's arguments that state them.
        let batch = utoipa::openapi::schema::AnyOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .required("batch_size")
                    .property("batch_size", given(Type::Integer)),
            )
            .item(
                ObjectBuilder::new()
                    .required("training_arguments")
                    .property(
                        "training_arguments",
                        given(Type::Object).required("per_device_train_batch_size"),
                    ),
            );
        let description = request.description.clone().map(|d| {
            format!(
                "{d}\n\nExactly one model: `layers`, `summary` or `transformer_config` (the \
                 alternatives below); `batch_size`, unless `training_arguments` state \
                 `per_device_train_batch_size`. Rules no schema states are refused with 422 naming the \
                 field: a value the request states otherwise than its \
                 files (`training_arguments`, `adapter_config`, `deepspeed`, `fsdp`, `load`) is refused; \
                 the layers, printout or config must describe a model the service can build; \
                 and a request priced above the cost budget (`--max-request-cost`) is refused."
            )
        });
        // `example`, not 3.1's `examples`: it is what Swagger UI's "Try it out" fills in.
        #[allow(deprecated)]
        let schema = AllOfBuilder::new()
            .item(request)
            .item(exactly_one)
            .item(batch)
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
    OneModelPerJob.modify(&mut api);
    GuardResponses.modify(&mut api);
    ResponseExamples.modify(&mut api);
    RequestExamples.modify(&mut api);
    api
}

/// What [`admit`] answers before a handler runs, in the spec of every route it guards, so
/// that no route's list can leave it out: a POST's body refused (unreadable 400, late 408,
/// over `--max-body-bytes` 413, compressed 415), a write's headers refused ([`WRITE_ROUTES`]:
/// not JSON 415, a foreign page or host 403, no token 401), no request slot or body bytes
/// left, or the request timeout (503 with Retry-After) on every route but
/// [`UNGUARDED_ROUTES`]. A route's own entry for a status is kept (it says more). Routes
/// without a request body are not documented with the body's statuses: a GET with a body is
/// outside their contract (it is answered the same way).
struct GuardResponses;

impl utoipa::Modify for GuardResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::header::HeaderBuilder;
        use utoipa::openapi::schema::{ObjectBuilder, Type};
        use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
        let problem = |description: &str, retry_after: bool| {
            let mut response = ResponseBuilder::new().description(description).content(
                "application/problem+json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("Problem")))
                    .build(),
            );
            if retry_after {
                response = response.header(
                    "Retry-After",
                    HeaderBuilder::new()
                        .schema(ObjectBuilder::new().schema_type(Type::Integer))
                        .description(Some("Seconds to wait before retrying"))
                        .build(),
                );
            }
            RefOr::T(response.build())
        };
        for (route, item) in openapi.paths.paths.iter_mut() {
            let guarded = !UNGUARDED_ROUTES.contains(&route.as_str());
            let write = WRITE_ROUTES.contains(&route.as_str());
            let operations = [(false, item.get.as_mut()), (true, item.post.as_mut())];
            for (post, operation) in operations {
                let Some(operation) = operation else {
                    continue;
                };
                let mut statuses: Vec<(&str, &str, bool)> = Vec::new();
                if post {
                    statuses.extend([
                        ("400", "The body could not be read", false),
                        (
                            "408",
                            "The body did not arrive within `--body-read-timeout-secs`",
                            false,
                        ),
                        ("413", "Body larger than `--max-body-bytes`", false),
                        (
                            "415",
                            "A compressed body (`Content-Encoding`): send it uncompressed",
                            false,
                        ),
                    ]);
                }
                if post && write {
                    statuses.extend([
                        ("401", "Missing or wrong bearer token", false),
                        (
                            "403",
                            "Writes disabled, or from another site's page, origin or host",
                            false,
                        ),
                        (
                            "415",
                            "Not `Content-Type: application/json` (a write must say it is JSON)",
                            false,
                        ),
                    ]);
                }
                if guarded {
                    statuses.push((
                        "503",
                        "Overloaded (every request slot taken, or the bytes bodies may hold at \
                         once), or the request timeout passed; see Retry-After",
                        true,
                    ));
                }
                for (status, description, retry_after) in statuses {
                    let responses = &mut operation.responses.responses;
                    if !responses.contains_key(status) {
                        responses.insert(status.to_string(), problem(description, retry_after));
                    }
                }
            }
        }
    }
}

/// Named request examples of `POST /v1/estimate` beside the schema's layer-list example, one
/// per kind of input Swagger UI can send: `cargo test --test api request_examples` checks each
/// is answered. Swagger UI offers them in the order of their names and fills in the first, so
/// the names are numbered: the README's first job (the layer list) comes first.
struct RequestExamples;

/// `(name, summary, request)` of each named example.
pub const REQUEST_EXAMPLES: [(&str, &str, &str); 2] = [
    (
        "2_describe",
        "A describe job: timm resnet10t at batch 64 on 32 x 32 images, with its traced saved \
         tensors and its training-step simulation (python -m gpucast_describe)",
        include_str!("../../openapi/examples/describe_request.json"),
    ),
    (
        "3_transformer_config",
        "A Hugging Face config.json job: QLoRA of Llama-3-8B (NF4 base, LoRA r16 on every \
         linear layer) at 2,048 tokens with full activation checkpointing on an RTX 4090",
        include_str!("../../openapi/examples/config_request.json"),
    ),
];

impl utoipa::Modify for RequestExamples {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::example::ExampleBuilder;
        use utoipa::openapi::RefOr;
        // The schema's own example (the layer list Swagger UI fills in) first, by name.
        let layers = openapi
            .components
            .as_ref()
            .and_then(|c| c.schemas.get("EstimateRequest"))
            .and_then(|schema| serde_json::to_value(schema).ok())
            .map(|schema| schema["example"].clone())
            .filter(|example| example.is_object());
        let Some(content) = openapi
            .paths
            .paths
            .get_mut("/v1/estimate")
            .and_then(|path| path.post.as_mut())
            .and_then(|post| post.request_body.as_mut())
            .and_then(|body| body.content.get_mut("application/json"))
        else {
            return;
        };
        if let Some(value) = layers {
            let example = ExampleBuilder::new()
                .summary("A layer list: a 10-layer MLP (the schema's example)")
                .value(Some(value))
                .build();
            content
                .examples
                .insert("1_layers".to_string(), RefOr::T(example));
        }
        for (name, summary, request) in REQUEST_EXAMPLES {
            let Ok(value) = serde_json::from_str::<serde_json::Value>(request) else {
                continue;
            };
            let example = ExampleBuilder::new()
                .summary(summary)
                .value(Some(value))
                .build();
            content.examples.insert(name.to_string(), RefOr::T(example));
        }
    }
}

/// Real answers as the estimate routes' response examples, so that Swagger UI shows what the
/// example request gets instead of schema placeholders. The files are answers of this service
/// to the example request; `cargo test --test api response_examples` checks they still are
/// (and rewrites them with `GPUCAST_WRITE_EXAMPLES=1`).
struct ResponseExamples;

/// `(route, committed answer)` for each POST route with a response example.
pub const RESPONSE_EXAMPLES: [(&str, &str); 2] = [
    (
        "/v1/estimate",
        include_str!("../../openapi/examples/estimate_response.json"),
    ),
    (
        "/v1/estimate/batch",
        include_str!("../../openapi/examples/batch_response.json"),
    ),
];

impl utoipa::Modify for ResponseExamples {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::RefOr;
        for (route, answer) in RESPONSE_EXAMPLES {
            let Ok(example) = serde_json::from_str::<serde_json::Value>(answer) else {
                continue;
            };
            let response = openapi
                .paths
                .paths
                .get_mut(route)
                .and_then(|path| path.post.as_mut())
                .and_then(|post| post.responses.responses.get_mut("200"));
            if let Some(RefOr::T(response)) = response {
                if let Some(content) = response.content.get_mut("application/json") {
                    content.example = Some(example);
                }
            }
        }
    }
}

pub fn router(state: AppState) -> Router {
    let (api_routes, api) = api_router().split_for_parts();
    let api = complete(api);
    api_routes
        .merge(SwaggerUi::new("/docs").url("/openapi.json", api))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(state.limits.max_body_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// The routes of the health listener (`--health-listen`): liveness and readiness alone, no
/// admission (no body is read), answered on its own thread.
pub fn health_router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", axum::routing::get(service::healthz))
        .route("/readyz", axum::routing::get(service::readyz))
        .fallback(not_found)
        .with_state(state)
}

/// Unknown paths get a problem like every other error. The path is the caller's: echoed cut short.
async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::NotFound(echo(uri.path()))
}

async fn method_not_allowed(method: axum::http::Method) -> ApiError {
    ApiError::MethodNotAllowed(echo(method.as_str()))
}

/// Admission control, timeout and HTTP metrics for every request.
async fn guard(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = method_label(request.method());
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let response = admit(&state, &route, request, next).await;
    let status = response.status().as_u16().to_string();
    let labels = [method, route.as_str(), status.as_str()];
    state
        .engine
        .metrics
        .http_requests_total
        .with_label_values(&labels)
        .inc();
    state
        .engine
        .metrics
        .http_request_duration_seconds
        .with_label_values(&labels)
        .observe(started.elapsed().as_secs_f64());
    response
}

/// The routes a liveness or readiness probe and a scraper call: never behind the permits, so
/// that a saturated service is not restarted for being busy.
const UNGUARDED_ROUTES: [&str; 3] = ["/healthz", "/readyz", "/metrics"];

/// The routes that change state: checked (origin, host, token) before their body is read.
const WRITE_ROUTES: [&str; 2] = ["/v1/calibration/observations", "/v1/calibration/watch"];

/// Admission before buffering: a write shows its right to write before a byte of its body is
/// read. Then the body, its bytes taken from the budget held over all connections as they
/// arrive, then a permit: a client that trickles its body holds a connection and the bytes it
/// sent, never one of the request slots. A declared length over the limit is refused before any
/// byte is read; a body that does not arrive in time is answered 408.
async fn admit(state: &AppState, route: &str, request: Request, next: Next) -> Response {
    let limit = state.limits.max_body_bytes;
    let declared = request
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return ApiError::PayloadTooLarge(limit).into_response();
    }
    // No decompression here: a compressed body would pass the byte limit and expand past it.
    let encoded = request
        .headers()
        .get(axum::http::header::CONTENT_ENCODING)
        .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
    if encoded {
        return ApiError::UnsupportedEncoding.into_response();
    }
    if request.method() == axum::http::Method::POST && WRITE_ROUTES.contains(&route) {
        if let Err(refused) = check_write_request(state, request.headers()) {
            return refused.into_response();
        }
    }
    // The body is charged for the bytes that arrive, as they arrive (`body`): a declared
    // length or a chunked header holds nothing it has not sent.
    let (parts, body) = request.into_parts();
    let timeout = state.limits.body_read_timeout;
    let read = tokio::time::timeout(timeout, body::read_within(body, limit, &state.body_budget));
    let body::ReadBody { bytes, _held } = match read.await {
        Err(_) => return ApiError::BodyTimeout(timeout.as_secs()).into_response(),
        Ok(Err(refused)) => return refused.into_response(),
        Ok(Ok(read)) => read,
    };
    let request = Request::from_parts(parts, axum::body::Body::from(bytes));
    if UNGUARDED_ROUTES.contains(&route) {
        return next.run(request).await;
    }
    let Ok(permit) = state.permits.clone().try_acquire_owned() else {
        return ApiError::Overloaded.into_response();
    };
    let response = match tokio::time::timeout(state.limits.request_timeout, next.run(request)).await
    {
        Ok(response) => response,
        Err(_) => ApiError::Timeout.into_response(),
    };
    drop(permit);
    response
}

/// The method as a metrics label: the standard ones by name, anything else `other`, so that
/// no caller can grow the label set.
fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::HEAD => "HEAD",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}
