//! The Kubernetes face: a mutating admission webhook. A pod (or a Job's or PyTorchJob's pod
//! template) annotated `gpucast.dev/job` with a job (the body of `POST /v1/estimate`) is
//! estimated on each GPU model the cluster has ([`ClusterProducts`]), by the engine's own
//! validation, cost budget, fit decision and ranking, and given a required node affinity on
//! GPU Feature Discovery's `nvidia.com/gpu.product` listing the products it fits, with the
//! figure and bound as annotations; a job that fits none is denied with its figure. No axum
//! here: `http::admission` reads the body and answers.
//!
//! - [`admit`]: a review answered; [`review`]: the AdmissionReview wire types.
//! - [`pods`]: the pod templates of an object and the JSON Patch that places them.

pub mod pods;
pub mod review;

use std::collections::HashMap;
use std::time::Instant;

use serde_json::{Map, Value};

use crate::api::parse::parse_estimate;
use crate::api::types::{EstimateResponse, GpuChoice, GpuRequest};
use crate::devices::sku::{Catalogue, GpuSelector};
use crate::engine::answer::answer_until;
use crate::engine::cost::Cost;
use crate::engine::{Deadline, Engine};
use crate::error::ApiError;
use crate::job::echo;
use pods::Template;
use review::{
    AdmissionRequest, AdmissionResponse, AdmissionReviewRequest, ADMISSION_API_VERSION,
    MAX_UID_CHARS,
};

/// The operations an AdmissionReview names (`CREATE` is placed; the others let through).
const OPERATIONS: [&str; 4] = ["CREATE", "UPDATE", "DELETE", "CONNECT"];

/// The annotation holding the job (the JSON of `POST /v1/estimate`).
pub const JOB_ANNOTATION: &str = "gpucast.dev/job";
/// The figure written back, MiB (the largest over the products the job fits).
pub const ESTIMATE_ANNOTATION: &str = "gpucast.dev/estimate-mib";
/// The upper bound written back, MiB (the largest over the products the job fits).
pub const BOUND_ANNOTATION: &str = "gpucast.dev/upper-bound-mib";
/// The products the affinity lists, comma-separated. Written by the webhook, never trusted
/// when read: a pod (template) carrying it is placed again like any other (a Job's pods come
/// from its placed template: their affinity asks for those products already, and they are let
/// through unchanged when the job still fits them).
pub const PRODUCTS_ANNOTATION: &str = "gpucast.dev/products";

/// Largest job annotation read, bytes: the API server holds all of an object's annotations
/// to 256 KiB.
pub const MAX_JOB_ANNOTATION_BYTES: usize = 256 * 1024;

/// The GPU models a cluster has: each catalogue card with the GPU Feature Discovery products
/// of it the cluster's nodes carry (`--admission-products`; all of them by default), in
/// catalogue order. Built once, at start.
#[derive(Debug, Clone)]
pub struct ClusterProducts {
    cards: Vec<(String, Vec<String>)>,
}

impl ClusterProducts {
    /// The products of `configured` (every product of the catalogue when empty), by card; an
    /// unknown product is refused, naming the known ones.
    pub fn new(catalogue: &Catalogue, configured: &[String]) -> Result<ClusterProducts, String> {
        for product in configured {
            if catalogue.by_gfd_product(product.trim()).is_none() {
                let known: Vec<&str> = catalogue
                    .all()
                    .iter()
                    .flat_map(|s| s.gfd_products.iter().map(String::as_str))
                    .collect();
                return Err(format!(
                    "--admission-products: `{}` is no GPU Feature Discovery product of the \
                     catalogue (a --gpus file may add cards with theirs); known: {}",
                    echo(product),
                    known.join(", ")
                ));
            }
        }
        let wanted = |p: &String| configured.is_empty() || configured.iter().any(|c| c.trim() == p);
        let cards: Vec<(String, Vec<String>)> = catalogue
            .all()
            .iter()
            .map(|sku| {
                (
                    sku.id.clone(),
                    sku.gfd_products
                        .iter()
                        .filter(|p| wanted(p))
                        .cloned()
                        .collect::<Vec<_>>(),
                )
            })
            .filter(|(_, products)| !products.is_empty())
            .collect();
        if cards.is_empty() {
            return Err("--admission: the catalogue holds no GPU Feature Discovery product".into());
        }
        Ok(ClusterProducts { cards })
    }

    /// Every product, in catalogue order.
    pub fn products(&self) -> impl Iterator<Item = &str> {
        self.cards
            .iter()
            .flat_map(|(_, p)| p.iter().map(String::as_str))
    }

    fn of(&self, card: &str) -> Option<&[String]> {
        self.cards
            .iter()
            .find(|(id, _)| id == card)
            .map(|(_, p)| p.as_slice())
    }
}

/// Where a job lands: the cards it fits, best first, and the figures.
#[derive(Debug, Clone)]
struct Placed {
    /// The products of the cards the job fits, best-ranked card first.
    products: Vec<String>,
    /// How many cards it fits.
    cards: usize,
    /// The largest figure and bound over those cards, MiB.
    estimate_mib: f64,
    upper_bound_mib: f64,
}

/// Why a template is not placed.
enum Refusal {
    /// Denied: a status code for the AdmissionReview and the message.
    Deny(u16, String),
    /// The service could not answer (overloaded, timed out, a bug): an HTTP error, so that
    /// the webhook's failurePolicy decides, not a denial.
    Failed(ApiError),
}

/// The answer to a review: allowed as it is, allowed with a patch, or denied. An error is
/// the service's own failure (the webhook's failurePolicy applies), or a review that is not one.
pub fn admit(
    engine: &Engine,
    cluster: &ClusterProducts,
    review: AdmissionReviewRequest,
    started: Instant,
    deadline: &Deadline,
) -> Result<AdmissionResponse, ApiError> {
    if review.api_version != ADMISSION_API_VERSION || review.kind != "AdmissionReview" {
        return Err(ApiError::InvalidInput(format!(
            "apiVersion, kind: an AdmissionReview of {ADMISSION_API_VERSION} is read, got {} {}",
            echo(&review.api_version),
            echo(&review.kind)
        )));
    }
    let request = review.request;
    if request
        .object
        .as_ref()
        .is_some_and(|o| !o.is_object() && !o.is_null())
    {
        return Err(ApiError::InvalidInput(
            "request.object: expected the object under review (a JSON object)".into(),
        ));
    }
    if !OPERATIONS.contains(&request.operation.as_str()) {
        return Err(ApiError::InvalidInput(format!(
            "request.operation: one of {}, got {}",
            OPERATIONS.join(", "),
            echo(&request.operation)
        )));
    }
    let uid_chars = request.uid.chars().count();
    if uid_chars == 0 || uid_chars > MAX_UID_CHARS {
        return Err(ApiError::InvalidInput(format!(
            "request.uid: 1 to {MAX_UID_CHARS} characters, got {uid_chars}"
        )));
    }
    match decide(engine, cluster, &request, started, deadline) {
        Ok(response) => Ok(response),
        Err(Refusal::Deny(code, message)) => {
            Ok(AdmissionResponse::deny(&request.uid, code, message))
        }
        Err(Refusal::Failed(error)) => Err(error),
    }
}

/// The review of a well-formed request: allowed, patched or refused.
fn decide(
    engine: &Engine,
    cluster: &ClusterProducts,
    request: &AdmissionRequest,
    started: Instant,
    deadline: &Deadline,
) -> Result<AdmissionResponse, Refusal> {
    let uid = request.uid.as_str();
    let creating = request.operation == "CREATE";
    let Some(object) = request.object.as_ref().filter(|_| creating) else {
        return Ok(AdmissionResponse::allow(uid));
    };
    let templates = pods::templates(&request.kind, object).map_err(|e| Refusal::Deny(422, e))?;
    // The annotated templates, with their jobs: each placed, whatever products annotation it
    // carries (one the webhook did not write is not trusted).
    let mut annotated: Vec<(&Template, &str)> = Vec::new();
    for template in &templates {
        let job = template
            .annotation(JOB_ANNOTATION)
            .map_err(|e| Refusal::Deny(422, e))?;
        template
            .annotation(PRODUCTS_ANNOTATION)
            .map_err(|e| Refusal::Deny(422, e))?;
        if let Some(job) = job {
            pods::price(template).map_err(|e| Refusal::Deny(413, e))?;
            annotated.push((template, job));
        }
    }
    if annotated.is_empty() {
        return Ok(AdmissionResponse::allow(uid));
    }
    // A PyTorchJob's Master and Worker often carry the same job: estimated once.
    let mut placed: HashMap<&str, Placed> = HashMap::new();
    // The object's jobs are priced together, as a batch's items are: its templates share one
    // request's budget.
    let mut spent = Cost::default();
    let mut ops = Vec::new();
    for (template, job) in &annotated {
        let where_ = format!("{JOB_ANNOTATION} of {}", template.label);
        let place = match placed.get(job) {
            Some(place) => place.clone(),
            None => {
                let gpus = pods::requested_gpus(&request.kind, object);
                let place = place(engine, cluster, job, gpus, &mut spent, started, deadline)
                    .map_err(|refusal| match refusal {
                        Refusal::Deny(code, message) => {
                            Refusal::Deny(code, format!("{where_}: {message}"))
                        }
                        failed => failed,
                    })?;
                placed.insert(job, place.clone());
                place
            }
        };
        let mut annotations = Map::new();
        annotations.insert(
            ESTIMATE_ANNOTATION.into(),
            Value::String(format!("{:.0}", place.estimate_mib.ceil())),
        );
        annotations.insert(
            BOUND_ANNOTATION.into(),
            Value::String(format!("{:.0}", place.upper_bound_mib.ceil())),
        );
        annotations.insert(
            PRODUCTS_ANNOTATION.into(),
            Value::String(place.products.join(",")),
        );
        ops.extend(pods::placement_ops(template, &place.products, annotations));
    }
    // Short, as the API server wants warnings: the products are in the annotation.
    let summary: Vec<String> = annotated
        .iter()
        .filter_map(|(template, job)| {
            placed.get(job).map(|p| {
                format!(
                    "gpucast: {}: {:.0} MiB, bound {:.0} MiB; fits {} of the cluster's GPU models",
                    template.label,
                    p.estimate_mib.ceil(),
                    p.upper_bound_mib.ceil(),
                    p.cards
                )
            })
        })
        .collect();
    if ops.is_empty() {
        // Placed already, as it would be now (a pod of a placed template).
        return Ok(AdmissionResponse {
            warnings: summary,
            ..AdmissionResponse::allow(uid)
        });
    }
    let patch =
        serde_json::to_vec(&ops).map_err(|e| Refusal::Failed(ApiError::Internal(e.to_string())))?;
    // The templates' prices bound it already; this is the promise kept whatever they miss.
    if patch.len() > pods::MAX_PATCH_BYTES {
        return Err(Refusal::Deny(
            413,
            format!(
                "the placement would take a {}-byte JSON Patch; at most {} are written (fewer \
                 node selector terms or templates)",
                patch.len(),
                pods::MAX_PATCH_BYTES
            ),
        ));
    }
    use base64::Engine as _;
    Ok(AdmissionResponse {
        patch_type: Some("JSONPatch".into()),
        patch: Some(base64::engine::general_purpose::STANDARD.encode(patch)),
        warnings: summary,
        ..AdmissionResponse::allow(uid)
    })
}

/// The job of an annotation on every card of the cluster it may go to (the cards its `gpu`
/// names, else all), through the same pricing, validation and ranking as `POST /v1/estimate`
/// with a `gpu` list.
fn place(
    engine: &Engine,
    cluster: &ClusterProducts,
    job: &str,
    gpus: Option<u64>,
    spent: &mut Cost,
    started: Instant,
    deadline: &Deadline,
) -> Result<Placed, Refusal> {
    let refuse = |error: ApiError| match error.status().as_u16() {
        code @ 400..=499 => Refusal::Deny(code, error.problem().detail),
        _ => Refusal::Failed(error),
    };
    if job.len() > MAX_JOB_ANNOTATION_BYTES {
        return Err(Refusal::Deny(
            413,
            format!(
                "{} bytes; at most {MAX_JOB_ANNOTATION_BYTES} are read",
                job.len()
            ),
        ));
    }
    let mut request = parse_estimate(job.as_bytes(), "").map_err(refuse)?;
    world_from_pods(&mut request, gpus);
    let cards = candidates(engine, cluster, request.gpu.as_ref()).map_err(refuse)?;
    request.gpu = Some(GpuChoice::Many(
        cards.into_iter().map(GpuRequest::Name).collect(),
    ));
    spent.add(&Cost::of(&request));
    spent.check(engine.cost_budget, None).map_err(refuse)?;
    let valid = engine.validate(&request).map_err(refuse)?;
    let confidence = valid.confidence.get();
    let answer = answer_until(engine, valid, started, deadline).map_err(refuse)?;
    placed(cluster, &answer, confidence).map_err(|message| Refusal::Deny(403, message))
}

/// A distributed job (a data-parallel strategy, or a DeepSpeed or FSDP config) that does not
/// state its world size runs on the GPUs its pods ask for (limits x replicas), when they are
/// more than one: what `torchrun` and accelerate would launch it on. A job without a strategy
/// is one GPU's, whatever its pods ask for.
fn world_from_pods(request: &mut crate::api::types::EstimateRequest, gpus: Option<u64>) {
    let Some(gpus) = gpus.filter(|&g| g > 1) else {
        return;
    };
    let layout = request.parallelism.as_ref();
    let stated = layout.is_some_and(|p| p.world_size.is_some());
    let distributed = layout
        .and_then(|p| p.strategy.as_deref())
        .is_some_and(|s| !s.eq_ignore_ascii_case("none"))
        || request.deepspeed.is_some()
        || request.fsdp.is_some();
    if stated || !distributed {
        return;
    }
    let layout = request
        .parallelism
        .get_or_insert(crate::api::types::ParallelismRequest {
            strategy: None,
            world_size: None,
            tensor_parallel: None,
            pipeline_parallel: None,
            context_parallel: None,
            sequence_parallel: None,
        });
    layout.world_size = Some(gpus);
}

/// The catalogue ids of the cluster's cards the job may go to: those its `gpu` names (by any
/// name the catalogue knows), else all. A card the cluster lacks, `attached` or a card
/// described by its memory cannot be placed on.
fn candidates(
    engine: &Engine,
    cluster: &ClusterProducts,
    gpu: Option<&GpuChoice>,
) -> Result<Vec<String>, ApiError> {
    let Some(choice) = gpu else {
        return Ok(cluster.cards.iter().map(|(id, _)| id.clone()).collect());
    };
    let mut ids: Vec<String> = Vec::new();
    for (index, card) in choice.cards().iter().enumerate() {
        let GpuRequest::Name(name) = card else {
            return Err(ApiError::InvalidInput(format!(
                "gpu[{index}]: a card described by its memory has no GPU Feature Discovery product to place on; name a catalogue card"
            )));
        };
        let sku = match engine
            .catalogue
            .select(name)
            .map_err(|e| ApiError::InvalidInput(format!("gpu[{index}]: {e}")))?
        {
            GpuSelector::Sku(sku) => sku,
            GpuSelector::Attached => {
                return Err(ApiError::InvalidInput(format!(
                    "gpu[{index}]: `attached` means the service's own host; name a catalogue card"
                )))
            }
        };
        if cluster.of(&sku.id).is_some() && !ids.contains(&sku.id) {
            ids.push(sku.id.clone());
        }
    }
    if ids.is_empty() {
        return Err(ApiError::InvalidInput(format!(
            "gpu: none of the cards named is among this cluster's GPU products ({})",
            cluster.products().collect::<Vec<_>>().join(", ")
        )));
    }
    Ok(ids)
}

/// The cards of a ranked answer the job fits, with their products and figures; or why it
/// fits none: the figure against the largest card.
fn placed(
    cluster: &ClusterProducts,
    answer: &EstimateResponse,
    confidence: f64,
) -> Result<Placed, String> {
    let fitting: Vec<_> = answer.gpu_ranking.iter().filter(|r| r.fits).collect();
    if fitting.is_empty() {
        let largest = answer
            .gpu_ranking
            .iter()
            .max_by_key(|r| r.capacity_mib)
            .ok_or_else(|| "no card was ranked".to_string())?;
        let mib = |v: Option<f64>| {
            v.map_or_else(|| "unknown".to_string(), |v| format!("{:.0}", v.ceil()))
        };
        return Err(format!(
            "the job fits none of this cluster's GPU products ({} card{} checked): on the \
             largest, {} ({} MiB), it needs {} MiB, {} MiB at the {:.0} % bound the fit is \
             decided at",
            answer.gpu_ranking.len(),
            if answer.gpu_ranking.len() == 1 {
                ""
            } else {
                "s"
            },
            largest.gpu,
            largest.capacity_mib,
            mib(largest.estimate_mib),
            mib(largest.upper_bound_mib),
            confidence * 100.0
        ));
    }
    let mut products = Vec::new();
    for card in &fitting {
        products.extend(cluster.of(&card.gpu).unwrap_or_default().iter().cloned());
    }
    let most = |f: fn(&crate::api::types::GpuRankResponse) -> Option<f64>| {
        fitting.iter().filter_map(|r| f(r)).fold(0.0_f64, f64::max)
    };
    Ok(Placed {
        products,
        cards: fitting.len(),
        estimate_mib: most(|r| r.estimate_mib),
        upper_bound_mib: most(|r| r.upper_bound_mib),
    })
}
