//! The validation edge: an untrusted request becomes a [`ValidEstimateRequest`] (a checked
//! job, the confidence asked for, the memory fraction, the GPU resolved) before any estimator
//! runs. Both estimate routes and the calibration routes validate here, so the route modules
//! need not import each other.

use crate::api::types::{
    EstimateRequest, FromFileResponse, GpuChoice, GpuRequest, NamesRequest, SummaryFormatRequest,
};
use crate::calibration::label::Stack;
use crate::devices::sku::Catalogue;
use crate::devices::GpuDevices;
use crate::engine::files;
use crate::error::ApiError;
use crate::job::setup::{
    BaseWeights, Checkpointing, ExpertLayout, LossImplementation, Optimizer,
    OptimizerImplementation, Precision, Strategy, ZeroBuffers, MAX_ZERO_ELEMENTS,
};
use crate::job::{
    echo, Confidence, Job, LayerKind, MemoryFraction, SavedTensors, SimulatedCategories,
    UncheckedLayer, UncheckedSimulation,
};
use crate::job::{Alternative, Assumption, KnownActivations, LayerDetail};
use crate::parsers::files::AssumedDtype;
use crate::parsers::transformer;
use crate::parsers::{parse_summary, SampleShape, SummaryFormat};
use crate::physics::saved;
use crate::placement::{PlacementError, Target};

/// Said back when a summary's saved tensors were derived rather than traced.
pub const DERIVED_SAVED_TENSORS_WARNING: &str = "saved_tensors: derived from the summary's \
printed output shapes (what each layer keeps for backward), not traced by gpucast_describe; \
give the traced saved_tensors for the most accurate figure";

/// Longest sequence accepted (tokens per sample).
pub const MAX_SEQ_LEN: u64 = 1_000_000;

/// The node a request names: its host memory and the job's GPUs on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Node {
    pub memory_mib: u64,
    pub gpus: u64,
}

/// The most GPUs a node holds when the request does not say: the world size, at most this.
const DEFAULT_NODE_GPUS: u64 = 8;

/// A request's `node`, checked: a positive memory, and its GPUs (default: the world size, at
/// most [`DEFAULT_NODE_GPUS`]) no more than the world size.
fn node(raw: Option<&crate::api::types::NodeRequest>, job: &Job) -> Result<Option<Node>, ApiError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    let world = job.setup().parallelism.world_size.max(1);
    if raw.memory_mib == 0 {
        return Err(ApiError::InvalidInput(
            "node.memory_mib: the node's host memory in MiB, at least 1".into(),
        ));
    }
    let gpus = raw.gpus.unwrap_or(world.min(DEFAULT_NODE_GPUS));
    if gpus == 0 || gpus > world {
        return Err(ApiError::InvalidInput(format!(
            "node.gpus: the job's GPUs on one node, 1 to its world size ({world}), got {gpus}"
        )));
    }
    Ok(Some(Node {
        memory_mib: raw.memory_mib,
        gpus,
    }))
}

/// The per-sample input a request gives: `input_shape`, or `summary.input_shape` beside the
/// printout it sizes; both given and different, the top-level one, said in `warnings`. Each
/// is checked wherever it is given (1 to 5 dimensions of 1 to 1,000,000), whether the job
/// reads it or not.
fn given_input_shape(
    request: &EstimateRequest,
    warnings: &mut Vec<String>,
) -> Result<Option<Vec<u64>>, ApiError> {
    let inside = request.summary.as_ref().and_then(|s| s.input_shape.clone());
    for (field, shape) in [
        ("input_shape", request.input_shape.as_ref()),
        ("summary.input_shape", inside.as_ref()),
    ] {
        if let Some(shape) = shape {
            if shape.is_empty() || shape.len() > 5 || shape.iter().any(|&d| d == 0 || d > 1_000_000)
            {
                return Err(ApiError::InvalidInput(format!(
                    "{field}: 1 to 5 dimensions, each 1 to 1000000, got {shape:?}"
                )));
            }
        }
    }
    match (&request.input_shape, inside) {
        (Some(top), Some(inside)) if *top != inside => {
            warnings.push(format!(
                "summary.input_shape: {inside:?} differs from input_shape {top:?}; input_shape \
                 used"
            ));
            Ok(Some(top.clone()))
        }
        (Some(top), _) => Ok(Some(top.clone())),
        (None, inside) => Ok(inside),
    }
}

/// A valid request: its job, and what the answer is asked for.
pub struct ValidEstimateRequest {
    pub job: Job,
    pub confidence: Confidence,
    pub fraction: Option<MemoryFraction>,
    /// The card answered for: the one asked about, or the first of a list (the answer
    /// then ranks it with `others`).
    pub target: Target,
    /// The rest of a `gpu` list, in the caller's order.
    pub others: Vec<Target>,
    /// Whether `gpu` was a list (even of one card): the answer then carries its ranking.
    pub listed: bool,
    /// Whether the memory classifiers run (`estimators: all`).
    pub classifiers: bool,
    /// The software environment the job runs in: its GPU's profile in that environment is
    /// used when there is one.
    pub environment: Option<String>,
    /// The training stack the request names (`None`: unsaid, transformers assumed).
    pub stack: Option<Stack>,
    /// What was assumed or overridden to read the request (said back as `warnings`).
    pub warnings: Vec<String>,
    /// The setup values read from the request's files (said back as `setup.from_files`).
    pub from_files: Vec<FromFileResponse>,
    /// The node whose host memory an offloading job's placement checks.
    pub node: Option<Node>,
    /// Whether its answer counts in the metrics (the class answered, the estimators' time): a
    /// caller's request does; a plan's search points are not answers anyone asked for.
    pub counted: bool,
    /// Whether a card is the attached one, read from its driver: its answer is not kept for
    /// reuse ([`crate::engine::memo`]), as the driver may come to report another card.
    pub reads_device: bool,
}

/// Validates a request as both estimate routes do.
pub fn validate(
    request: &EstimateRequest,
    catalogue: &Catalogue,
    devices: &dyn GpuDevices,
) -> Result<ValidEstimateRequest, ApiError> {
    let (job, warnings, from_files) = to_job_reading(request)?;
    let confidence =
        Confidence::parse(request.confidence).map_err(|e| ApiError::InvalidInput(e.to_string()))?;
    let fraction = MemoryFraction::parse(request.memory_fraction)
        .map_err(|e| ApiError::InvalidInput(e.to_string()))?;
    let (target, others) = resolve_choice(request.gpu.as_ref(), catalogue, devices)?;
    let mut warnings = warnings;
    warnings.extend(also_named(request.gpu.as_ref(), catalogue));
    let environment = environment(request.environment.as_deref())?;
    let node = node(request.node.as_ref(), &job)?;
    let stack = request
        .stack
        .as_deref()
        .map(Stack::parse)
        .transpose()
        .map_err(ApiError::InvalidInput)?;
    let [figures, all] = crate::api::vocabulary::ESTIMATOR_CHOICES;
    let classifiers = match request.estimators.as_deref() {
        None => false,
        Some(choice) if choice == figures => false,
        Some(choice) if choice == all => true,
        Some(other) => {
            return Err(ApiError::InvalidInput(format!(
                "estimators: unknown '{}' (known: {})",
                crate::job::echo(other),
                crate::api::vocabulary::ESTIMATOR_CHOICES.join(", ")
            )))
        }
    };
    Ok(ValidEstimateRequest {
        job,
        confidence,
        fraction,
        target,
        others,
        listed: matches!(request.gpu, Some(GpuChoice::Many(_))),
        classifiers,
        environment,
        stack,
        warnings,
        from_files,
        node,
        counted: true,
        reads_device: names_attached(request.gpu.as_ref()),
    })
}

/// Whether `choice` names the attached card (alone or in a list).
fn names_attached(choice: Option<&GpuChoice>) -> bool {
    let attached = |card: &GpuRequest| match card {
        GpuRequest::Name(name) => crate::devices::sku::is_attached(name),
        GpuRequest::Custom(_) => false,
    };
    match choice {
        None => false,
        Some(GpuChoice::One(card)) => attached(card),
        Some(GpuChoice::Many(cards)) => cards.iter().any(attached),
    }
}

/// Resolves a request's `gpu`, one card or a list, to the first card and the rest. A list
/// naming one card twice (under any of its names) is a mistake to refuse, not to rank twice.
fn resolve_choice(
    choice: Option<&GpuChoice>,
    catalogue: &Catalogue,
    devices: &dyn GpuDevices,
) -> Result<(Target, Vec<Target>), ApiError> {
    let cards = match choice {
        None => return Ok((resolve(None, catalogue, devices)?, Vec::new())),
        Some(GpuChoice::One(card)) => {
            return Ok((resolve(Some(card), catalogue, devices)?, Vec::new()))
        }
        Some(GpuChoice::Many(cards)) => cards,
    };
    let mut targets: Vec<Target> = Vec::with_capacity(cards.len());
    for (index, card) in cards.iter().enumerate() {
        let target = resolve(Some(card), catalogue, devices).map_err(|e| match e {
            ApiError::InvalidInput(detail) => ApiError::InvalidInput(format!(
                "gpu[{index}]{}",
                detail.strip_prefix("gpu").unwrap_or(&detail)
            )),
            other => other,
        })?;
        if let Some(first) = targets.iter().position(|t| t.gpu == target.gpu) {
            return Err(ApiError::InvalidInput(format!(
                "gpu[{index}]: names '{}' again (as gpu[{first}] does)",
                target.gpu
            )));
        }
        targets.push(target);
    }
    let mut targets = targets.into_iter();
    let first = targets.next().expect("a gpu list holds at least one card");
    Ok((first, targets.collect()))
}

/// `H100` is the SXM card, where `A100` is refused as ambiguous: said back with the other
/// cards of that name, so that a PCIe card's user knows to name it.
fn also_named(choice: Option<&GpuChoice>, catalogue: &Catalogue) -> Vec<String> {
    let names: Vec<&str> = match choice {
        Some(GpuChoice::One(GpuRequest::Name(name))) => vec![name.as_str()],
        Some(GpuChoice::Many(cards)) => cards
            .iter()
            .filter_map(|c| match c {
                GpuRequest::Name(name) => Some(name.as_str()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    names
        .into_iter()
        .filter_map(|name| {
            let chosen = catalogue.parse(name).ok()?;
            let others = catalogue.also_named(name, chosen);
            (!others.is_empty()).then(|| {
                format!(
                    "gpu: `{}` read as {} ({}); {} also {} that name: give its id to choose",
                    echo(name),
                    chosen.id,
                    chosen.name,
                    others.join(", "),
                    if others.len() == 1 { "has" } else { "have" }
                )
            })
        })
        .collect()
}

/// An optional environment label, checked.
pub fn environment(raw: Option<&str>) -> Result<Option<String>, ApiError> {
    raw.map(crate::calibration::label::parse_environment)
        .transpose()
        .map_err(ApiError::InvalidInput)
}

/// Turns a request into a validated job: from its layer list, or by parsing its summary text.
pub fn to_job(request: &EstimateRequest) -> Result<Job, ApiError> {
    to_job_noting(request).map(|(job, _)| job)
}

/// [`to_job`], with what was assumed or overridden to read the request.
pub fn to_job_noting(request: &EstimateRequest) -> Result<(Job, Vec<String>), ApiError> {
    to_job_reading(request).map(|(job, warnings, _)| (job, warnings))
}

/// [`to_job_noting`], with the setup values read from the request's files: those are written
/// into the request's own fields first ([`files::apply`]).
fn to_job_reading(
    request: &EstimateRequest,
) -> Result<(Job, Vec<String>, Vec<FromFileResponse>), ApiError> {
    let (job, mut warnings, read) = to_job_from_files(request)?;
    if let Some(stage) = pipeline_stage(&job) {
        warnings.push(stage);
    }
    Ok((job, warnings, read))
}

/// Which pipeline stage's peak the answer is, when the job has more than one.
fn pipeline_stage(job: &Job) -> Option<String> {
    let setup = job.setup();
    let stages = setup.parallelism.pipeline;
    (stages > 1).then(|| {
        format!(
            "parallelism: the figure is the first of {stages} pipeline stages', the most loaded \
             under 1F1B: it holds {} micro-batches' activations of its layers in flight, the \
             last stage one",
            stages.min(setup.accumulation.max(1))
        )
    })
}

fn to_job_from_files(
    request: &EstimateRequest,
) -> Result<(Job, Vec<String>, Vec<FromFileResponse>), ApiError> {
    let Some(applied) = files::apply(request)? else {
        return to_job_stated(request, None).map(|(job, warnings)| (job, warnings, Vec::new()));
    };
    let (job, mut warnings) = to_job_stated(&applied.request, applied.assumed_dtype)?;
    // The files chose the precision and `setup.from_files` says where: the caller did not
    // type `bf16`, so the warning about the word is not theirs.
    if applied.read.iter().any(|r| r.field == "precision") {
        warnings.retain(|w| !w.starts_with(PURE_BF16_WORD));
    }
    warnings.extend(applied.warnings);
    Ok((job, warnings, applied.read))
}

/// The job of a request whose setup is in its own fields; `assumed_dtype`: the load dtype its
/// files left unsaid, taken from its config.
fn to_job_stated(
    request: &EstimateRequest,
    assumed_dtype: Option<AssumedDtype>,
) -> Result<(Job, Vec<String>), ApiError> {
    let batch_size = batch_size(request)?;
    let mut warnings = Vec::new();
    if let Some(seq_len) = request.seq_len.filter(|&l| l == 0 || l > MAX_SEQ_LEN) {
        return Err(ApiError::InvalidInput(format!(
            "seq_len: must be between 1 and {MAX_SEQ_LEN}, got {seq_len}"
        )));
    }
    // Saved tensors derived from a summary's layers, when the request traced none.
    let mut derived = None;
    // The per-sample input: the request's, else what a printed table's footer says.
    let mut input_shape = given_input_shape(request, &mut warnings)?;
    let given_shape = input_shape.clone();
    if let Some(config) = &request.transformer_config {
        return config_job(request, config, assumed_dtype);
    }
    if request.attention.is_some() {
        return Err(ApiError::InvalidInput(
            "attention: applies to a transformer_config job only".into(),
        ));
    }
    if request.loss_implementation.is_some() {
        return Err(ApiError::InvalidInput(
            "loss_implementation: applies to a transformer_config job only (a traced job's \
             loss is in its saved tensors: describe --loss)"
                .into(),
        ));
    }
    let job = match (&request.layers, &request.summary) {
        (Some(layers), None) => {
            let layers = layers.iter().map(|l| UncheckedLayer {
                kind: &l.kind,
                output_size: l.output_size,
                params: l.params,
            });
            Job::parse(request.family.as_deref(), batch_size, layers)?
        }
        (None, Some(summary)) => {
            let format = match summary.format {
                SummaryFormatRequest::Auto => SummaryFormat::Auto,
                SummaryFormatRequest::Torchsummary => SummaryFormat::Torchsummary,
                SummaryFormatRequest::ModulePrint => SummaryFormat::ModulePrint,
                SummaryFormatRequest::Keras => SummaryFormat::Keras,
            };
            let sample = SampleShape {
                seq_len: request.seq_len,
                input_shape: given_shape.as_deref(),
            };
            let parsed = parse_summary(format, &summary.text, batch_size, sample)
                .map_err(|e| ApiError::InvalidInput(e.to_string()))?;
            warnings.extend(parsed.warnings);
            if input_shape.is_none() {
                if let Some(shape) = parsed.input_shape {
                    warnings.push(format!(
                        "input_shape: not given; {shape:?} read from the table's Input size \
                         footer and first output (a square RGB image); give input_shape if it \
                         is not"
                    ));
                    input_shape = Some(shape.to_vec());
                }
            }
            let job =
                Job::from_layers(request.family.as_deref(), batch_size, parsed.layers)?.printed();
            if request.saved_tensors.is_none() {
                // The traced regressors need saved tensors; a summary shows only output shapes,
                // from which physics::saved rebuilds what backward keeps (issue 12).
                let input = input_shape
                    .as_deref()
                    .and_then(|shape| shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d)));
                match saved::hidden_share(job.layers()) {
                    None => {
                        derived = Some(saved::derive(job.layers(), input));
                        warnings.push(DERIVED_SAVED_TENSORS_WARNING.into());
                    }
                    Some(share) => warnings.push(format!(
                        "saved_tensors: not derived: layers of unknown kind hold {:.0} % of the \
                         parameters, so the summary hides the layers that compute (a torchinfo \
                         table cut at its default depth=3?); print it with every layer, or give \
                         the traced saved_tensors",
                        100.0 * share
                    )),
                }
            }
            job
        }
        (Some(_), Some(_)) => {
            return Err(ApiError::InvalidInput(
                "layers: give either layers or summary, not both".into(),
            ))
        }
        (None, None) => {
            return Err(ApiError::InvalidInput(
                "layers: missing; give layers or summary".into(),
            ))
        }
    };
    let simulation = request.simulation.as_ref().map(|s| UncheckedSimulation {
        batch_size: s.batch_size,
        optimizer: s.optimizer.as_deref(),
        precision: s.precision.as_deref(),
        allocated_peak_bytes: s.allocated_peak_bytes,
        reserved_peak_bytes: s.reserved_peak_bytes,
        min_capacity_bytes: s.min_capacity_bytes,
        breakdown_at_peak: SimulatedCategories {
            parameters: s.breakdown_at_peak.parameters,
            gradients: s.breakdown_at_peak.gradients,
            optimizer_state: s.breakdown_at_peak.optimizer_state,
            activations: s.breakdown_at_peak.activations,
            temporaries: s.breakdown_at_peak.temporaries,
        },
        attention: s.attention.as_deref(),
        interpolated: s.interpolated.unwrap_or(false),
        activation_checkpointing: s.activation_checkpointing.as_ref().map(|c| match c {
            NamesRequest::Keyword(word) => word.as_str(),
            NamesRequest::Names(_) => "modules",
        }),
        gradient_accumulation_steps: s.gradient_accumulation_steps,
        optimizer_implementation: s.optimizer_implementation.as_deref(),
        trainable_params: s.trainable_params,
        paged_optimizer_state_bytes: s.paged_optimizer_state_bytes,
    });
    if let Some(layers) = &request.layers {
        warnings.extend(mapped_kinds(layers.iter().map(|l| l.kind.as_str())));
    }
    let details = request.layers.as_ref().map(|layers| {
        layers
            .iter()
            .map(|l| LayerDetail {
                name: l.name.clone(),
                in_features: l.in_features,
                out_features: l.out_features,
                flops: l.flops,
                experts: None,
            })
            .collect::<Vec<_>>()
    });
    let job = match details {
        Some(details) => job.with_layer_details(details)?,
        None => job,
    };
    let job = job
        .with_setup(&request.unchecked_setup())?
        .with_input_shape(input_shape.as_deref())?
        .with_saved_tensors(
            request
                .saved_tensors
                .as_ref()
                .map(|saved| SavedTensors {
                    per_sample_bytes: saved.per_sample_bytes,
                    fixed_bytes: saved.fixed_bytes,
                })
                .or(derived),
        )?
        // After the training settings: the simulation must be of the same optimizer and precision.
        .with_simulation(simulation)?;
    if request.family.is_none() {
        warnings.push(format!(
            "family: not given; {} inferred from the layers (attention makes a transformer, \
             else convolutions a cnn, else an mlp)",
            job.family().as_str()
        ));
    }
    note_defaults(request, &job, &mut warnings);
    let job = with_assumed_setup(request, job, assumed_dtype, &|_| None, None);
    Ok((with_assumed_implementation(request, job), warnings))
}

/// The request's samples per step (stated, or made from its training arguments).
fn batch_size(request: &EstimateRequest) -> Result<u64, ApiError> {
    request.batch_size.ok_or_else(|| {
        ApiError::InvalidInput(
            "batch_size: missing; give the samples per training step (or training_arguments \
             with per_device_train_batch_size)"
                .into(),
        )
    })
}

/// A job built from a Hugging Face configuration (issue 16): the layers and activations come
/// from `parsers::transformer`, the setup as for any job; the analytic step answers it.
fn config_job(
    request: &EstimateRequest,
    config: &serde_json::Map<String, serde_json::Value>,
    assumed_dtype: Option<AssumedDtype>,
) -> Result<(Job, Vec<String>), ApiError> {
    let invalid = |e: transformer::ConfigError| ApiError::InvalidInput(e.to_string());
    let batch_size = batch_size(request)?;
    for (given, field) in [
        (request.layers.is_some(), "layers"),
        (request.summary.is_some(), "summary"),
        (request.saved_tensors.is_some(), "saved_tensors"),
        (request.simulation.is_some(), "simulation"),
    ] {
        if given {
            return Err(ApiError::InvalidInput(format!(
                "{field}: give either transformer_config or {field}, not both"
            )));
        }
    }
    let Some(seq_len) = request.seq_len else {
        return Err(ApiError::InvalidInput(
            "seq_len: required with transformer_config (tokens per sample)".into(),
        ));
    };
    if let Some(family) = request.family.as_deref().filter(|f| *f != "transformer") {
        return Err(ApiError::InvalidInput(format!(
            "family: a transformer_config job is a transformer, got '{}'",
            crate::job::echo(family)
        )));
    }
    let kernel =
        transformer::AttentionKernel::parse(request.attention.as_deref()).map_err(invalid)?;
    // A multimodal config's language model is what is built (and priced: the same rule), and
    // the answer says what it leaves out.
    let (config, text_only) = transformer::language_model(config);
    let parsed = transformer::TransformerConfig::parse(config).map_err(invalid)?;
    // The precision picks the attention kernel: read it before building.
    let setup = request.unchecked_setup();
    let precision = crate::job::Setup::parse(batch_size.max(1), &setup)
        .map(|s| s.precision)
        .unwrap_or_default();
    // Kept to build the model again at an unstated field's other values.
    let config_read = parsed.clone();
    let hidden = parsed.hidden as f64;
    let mut model = transformer::build(parsed, seq_len, precision, kernel).map_err(invalid)?;
    let mut warnings = std::mem::take(&mut model.warnings);
    if text_only {
        warnings.push(
            "transformer_config: a multimodal config; answered from its text_config, the \
             language model alone (the vision tower and projector are not counted: add them \
             as a layer list or trace the whole model with describe)"
                .into(),
        );
    }
    // (Both before the layers move into the job: autocast's weight copies are counted from them.)
    let loss = transformer::parse_loss_implementation(request.loss_implementation.as_deref())
        .map_err(invalid)?;
    if request.loss_implementation.is_none() {
        warnings.push(format!(
            "loss_implementation: not given; {} assumed (Hugging Face transformers' loss: fp32 \
             logits whole); chunked (litgpt, torchtune) and fused (Liger, Cut Cross-Entropy) \
             keep far less over a large vocabulary",
            loss.as_str()
        ));
    }
    let (cast, gathered) = (
        model.activations_with(precision, false, loss),
        model.activations_with(precision, true, loss),
    );
    // An unstated loss is taken to be transformers' (which keeps the most): the fused loss
    // (which keeps the least) bounds the range it leaves open.
    let other_losses: Vec<_> = if request.loss_implementation.is_none() {
        [LossImplementation::Fused]
            .into_iter()
            .filter(|&other| other != loss)
            .map(|other| {
                (
                    other,
                    model.activations_with(precision, false, other),
                    model.activations_with(precision, true, other),
                )
            })
            .collect()
    } else {
        Vec::new()
    };
    let job = Job::from_layers(
        Some("transformer"),
        batch_size,
        std::mem::take(&mut model.layers),
    )?
    .with_layer_details(std::mem::take(&mut model.details))?
    .with_setup(&setup)?
    .with_input_shape(Some(&[seq_len]))?;
    let sharded_weights = job.setup().parallelism.strategy.shards().2;
    let mut job = job.with_known_activations(if sharded_weights { gathered } else { cast });
    if !other_losses.is_empty() {
        job = job.with_assumption(Assumption {
            field: "loss_implementation",
            assumed: loss.as_str(),
            alternatives: other_losses
                .into_iter()
                .map(|(other, cast, gathered)| {
                    Alternative::Loss(other, if sharded_weights { gathered } else { cast })
                })
                .collect(),
        });
    }
    note_defaults(request, &job, &mut warnings);
    // The model's activations at another precision or kernel: built again, as each picks
    // its own attention path (grouped-query attention in fp32 runs the math path).
    let known_at = |precision: Precision, kernel: transformer::AttentionKernel| {
        transformer::build_unnamed(config_read.clone(), seq_len, precision, kernel)
            .ok()
            .map(|m| m.activations_with(precision, sharded_weights, loss))
    };
    let eager = request
        .attention
        .is_none()
        .then(|| known_at(precision, transformer::AttentionKernel::Eager))
        .flatten();
    let job = with_assumed_setup(request, job, assumed_dtype, &|p| known_at(p, kernel), eager);
    let job = with_assumed_zero(request, job, hidden);
    let job = with_assumed_expert_layout(request, job, &mut warnings);
    Ok((with_assumed_implementation(request, job), warnings))
}

/// Notes unstated ZeRO-3 buffers: DeepSpeed's defaults are assumed (a 5e8-element gradient
/// bucket allocated whole, 5e7 prefetched), and Hugging Face's `"auto"` values from the hidden
/// size `h` (bucket `h^2`, prefetch `0.9 h^2`, persistence `10 h`), which its integration
/// writes into most configs, bound the range.
fn with_assumed_zero(request: &EstimateRequest, job: Job, hidden: f64) -> Job {
    let setup = job.setup();
    let defaults = ZeroBuffers::default();
    if request.zero.is_some()
        || setup.parallelism.strategy != Strategy::Zero3
        || setup.zero != defaults
        || hidden < 1.0
    {
        return job;
    }
    let square = (hidden * hidden).min(MAX_ZERO_ELEMENTS as f64);
    let auto = ZeroBuffers {
        reduce_bucket: (square as u64).max(1),
        prefetch_bucket: (0.9 * square) as u64,
        persistence_threshold: (10.0 * hidden) as u64,
        ..defaults
    };
    job.with_assumption(Assumption {
        field: "zero",
        assumed: "deepspeed_defaults",
        alternatives: vec![Alternative::Zero(auto)],
    })
}

/// Notes an unstated expert layout where it matters (a mixture of experts under a quantised
/// base): transformers 4's one `nn.Linear` per expert projection is assumed, which the
/// published QLoRA and GPTQ-LoRA runs of Mixtral used and the libraries quantise; transformers
/// 5's fused 3D experts stay in the weights' dtype and bound the range.
fn with_assumed_expert_layout(
    request: &EstimateRequest,
    job: Job,
    warnings: &mut Vec<String>,
) -> Job {
    let Some(lora) = job.setup().lora.as_ref() else {
        return job;
    };
    let stated = request
        .lora
        .as_ref()
        .is_some_and(|l| l.expert_layout.is_some());
    let has_experts = job.layer_details().iter().any(|d| d.experts.is_some());
    if stated || !has_experts || lora.base_weights == BaseWeights::Same {
        return job;
    }
    let assumed = lora.expert_layout;
    warnings.push(format!(
        "lora.expert_layout: not given; {} assumed (transformers 4: an nn.Linear per expert \
         projection, quantised with the base); transformers 5 fuses the experts into 3D \
         parameters, which bitsandbytes leaves unquantised: state `fused` for that",
        assumed.as_str()
    ));
    job.with_assumption(Assumption {
        field: "lora.expert_layout",
        assumed: assumed.as_str(),
        alternatives: vec![Alternative::ExpertLayout(ExpertLayout::Fused)],
    })
}

/// Notes the setup fields the request left unsaid whose other values move the figure (more
/// than 5 % on common jobs, docs/user/guide.md): each defaults to the value that keeps the
/// most but the load dtype, so the value that keeps the least bounds its range. `known_at`:
/// the model's activations at another precision, where its config gives them (`None`:
/// counted from the layers); `eager`: its activations under eager attention, where unstated.
fn with_assumed_setup(
    request: &EstimateRequest,
    mut job: Job,
    assumed_dtype: Option<AssumedDtype>,
    known_at: &dyn Fn(Precision) -> Option<KnownActivations>,
    eager: Option<KnownActivations>,
) -> Job {
    let setup = job.setup().clone();
    if let Some(assumed) = assumed_dtype {
        // transformers 5 loads the config's dtype; transformers 4 loaded fp32.
        let alternative = assumed.alternative.unwrap_or_default();
        job = job.with_assumption(Assumption {
            field: "load.torch_dtype",
            assumed: match assumed.dtype {
                Precision::Fp16 => "float16",
                _ => "bfloat16",
            },
            alternatives: vec![Alternative::Precision(alternative, known_at(alternative))],
        });
    }
    if request.precision.is_none() {
        let alternatives = [Precision::AmpBf16, Precision::Bf16]
            .into_iter()
            .filter(|&p| p != setup.precision)
            .map(|p| Alternative::Precision(p, known_at(p)))
            .collect();
        job = job.with_assumption(Assumption {
            field: "precision",
            assumed: setup.precision.as_str(),
            alternatives,
        });
    }
    if request.optimizer.is_none() && setup.optimizer != Optimizer::Sgd {
        job = job.with_assumption(Assumption {
            field: "optimizer",
            assumed: setup.optimizer.as_str(),
            alternatives: vec![Alternative::Optimizer(Optimizer::Sgd)],
        });
    }
    if request.activation_checkpointing.is_none() && setup.checkpointing == Checkpointing::None {
        job = job.with_assumption(Assumption {
            field: "activation_checkpointing",
            assumed: Checkpointing::None.as_str(),
            alternatives: vec![Alternative::Checkpointing(Checkpointing::Full)],
        });
    }
    if let Some(eager) = eager {
        job = job.with_assumption(Assumption {
            field: "attention",
            assumed: "sdpa",
            alternatives: vec![Alternative::Attention(eager)],
        });
    }
    if request.master_weights.is_none() && setup.precision.is_pure_16bit() && !setup.fp32_master {
        job = job.with_assumption(Assumption {
            field: "master_weights",
            assumed: "none",
            alternatives: vec![Alternative::MasterWeights],
        });
    }
    job
}

/// Notes an unstated optimizer implementation: PyTorch's default (foreach, a copy of the
/// state per step: the most) is assumed, and the implementation the optimizer has that keeps
/// the least (fused, else the for-loop) bounds the range.
fn with_assumed_implementation(request: &EstimateRequest, job: Job) -> Job {
    if request.optimizer_implementation.is_some() {
        return job;
    }
    let setup = job.setup();
    let least = [
        OptimizerImplementation::Fused,
        OptimizerImplementation::ForLoop,
    ]
    .into_iter()
    .find(|&other| setup.optimizer.runs_as(other));
    let alternatives: Vec<Alternative> = least
        .filter(|&other| other != setup.implementation)
        .map(Alternative::OptimizerImplementation)
        .into_iter()
        .collect();
    if alternatives.is_empty() {
        return job;
    }
    let assumed = setup.implementation.as_str();
    job.with_assumption(Assumption {
        field: "optimizer_implementation",
        assumed,
        alternatives,
    })
}

/// How the warning about the word `bf16` begins.
const PURE_BF16_WORD: &str = "precision: `";

/// Says which of the setup's defaults the job was answered with.
fn note_defaults(request: &EstimateRequest, job: &Job, warnings: &mut Vec<String>) {
    if request.optimizer.is_none() {
        warnings.push(format!(
            "optimizer: not given; {} assumed",
            job.optimizer().as_str()
        ));
    }
    match request.precision.as_deref().map(str::to_ascii_lowercase) {
        None => warnings.push(format!(
            "precision: not given; {} assumed",
            job.precision().as_str()
        )),
        // Pure bf16 here, where HF Trainer's `--bf16` and Lightning's `bf16-mixed` mean
        // autocast: a full fine-tune stated the Trainer's way would read half its memory.
        Some(word) if word == "bf16" || word == "bfloat16" => warnings.push(format!(
            "{PURE_BF16_WORD}{word}` read as pure bf16 (weights, gradients and optimizer state in \
             bf16); for autocast over fp32 weights (HF Trainer's --bf16, Lightning's \
             bf16-mixed) state amp_bf16"
        )),
        Some(_) => {}
    }
}

/// The layer kinds given in another spelling than the service's own name, each once:
/// `batch_normalization` read as `batch_norm` is an assumption worth saying.
fn mapped_kinds<'a>(kinds: impl Iterator<Item = &'a str>) -> Option<String> {
    const SHOWN: usize = 5;
    let mut mapped: Vec<(&str, &str)> = Vec::new();
    for raw in kinds {
        // Valid kinds only: an unknown one has already been refused.
        let Some(kind) = LayerKind::parse(raw) else {
            continue;
        };
        if raw != kind.as_str() && !mapped.iter().any(|(seen, _)| *seen == raw) {
            mapped.push((raw, kind.as_str()));
        }
    }
    if mapped.is_empty() {
        return None;
    }
    let shown: Vec<String> = mapped
        .iter()
        .take(SHOWN)
        .map(|(raw, kind)| format!("'{}' as {kind}", echo(raw)))
        .collect();
    let more = mapped.len().saturating_sub(SHOWN);
    let rest = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    Some(format!(
        "layers: kinds read in the service's names: {}{rest}",
        shown.join(", ")
    ))
}

/// Resolves a `gpu` field (`None`: the reference card) to the GPU an answer is placed on.
pub fn resolve(
    gpu: Option<&GpuRequest>,
    catalogue: &Catalogue,
    devices: &dyn GpuDevices,
) -> Result<Target, ApiError> {
    Target::resolve(gpu.map(GpuRequest::ask), catalogue, devices).map_err(|e| match e {
        PlacementError::NoDevice(_) => ApiError::NoDevice(e.to_string()),
        PlacementError::Sku(_) => ApiError::InvalidInput(e.to_string()),
    })
}
