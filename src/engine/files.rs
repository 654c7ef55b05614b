//! The files a request carries (`training_arguments`, `adapter_config`, `deepspeed`, `fsdp`, `load`),
//! read by [`crate::parsers::files`], written into the request's own setup fields: the job is
//! then validated as if the caller had stated them, so the answer from the files is the
//! hand-stated setup's. A field the request states otherwise is a 422 naming both places.

use crate::api::types::{
    EstimateRequest, FromFileResponse, LoraRequest, NamesRequest, OffloadRequest,
    ParallelismRequest, ZeroRequest,
};
use crate::error::ApiError;
use crate::job::echo;
use crate::job::setup::{
    BaseWeights, Optimizer, OptimizerImplementation, Precision, Strategy, DEFAULT_GROUP_SIZE,
};
use crate::parsers::files::{self, Files, Read};
use crate::parsers::transformer::AttentionKernel;

/// The request with what its files state written in, what was read, and what was assumed.
pub struct Applied {
    pub request: EstimateRequest,
    pub read: Vec<FromFileResponse>,
    pub warnings: Vec<String>,
    /// The load dtype the files left unsaid, taken from the config (transformers 5's default).
    pub assumed_dtype: Option<files::AssumedDtype>,
}

/// Applies a request's files; `None` when it carries none (nothing is copied then).
pub fn apply(request: &EstimateRequest) -> Result<Option<Applied>, ApiError> {
    let given = Files {
        training_arguments: request.training_arguments.as_ref(),
        adapter_config: request.adapter_config.as_ref(),
        deepspeed: request.deepspeed.as_ref(),
        fsdp: request.fsdp.as_ref(),
        load: request.load.as_ref(),
        model_config: request.transformer_config.as_ref(),
        precision_stated: request.precision.is_some(),
    };
    if given.is_empty() {
        return Ok(None);
    }
    let stated = files::read(given).map_err(|e| ApiError::InvalidInput(e.to_string()))?;
    let mut merged = Merge {
        request: request.clone(),
        read: Vec::new(),
        warnings: stated.warnings.clone(),
    };
    let r = &mut merged;
    r.precision(&stated.precision)?;
    if let Some(m) = stated.fp32_master.as_ref().filter(|m| m.value) {
        r.state(
            "master_weights",
            &m.from,
            "fp32".to_string(),
            |req| &mut req.master_weights,
            |g| g.eq_ignore_ascii_case("fp32"),
        )?;
    }
    r.put("optimizer", &stated.optimizer, |req| &mut req.optimizer)?;
    let implementation = &stated.implementation;
    r.put("optimizer_implementation", implementation, |req| {
        &mut req.optimizer_implementation
    })?;
    r.put("micro_batch_size", &stated.micro_batch_size, |req| {
        &mut req.micro_batch_size
    })?;
    let accumulation = &stated.gradient_accumulation_steps;
    r.put("gradient_accumulation_steps", accumulation, |req| {
        &mut req.gradient_accumulation_steps
    })?;
    r.batch_covers(&stated)?;
    if let Some(c) = &stated.checkpointing {
        r.checkpointing(c)?;
    }
    r.put("parallelism.strategy", &stated.strategy, |req| {
        &mut req.parallelism.get_or_insert_with(no_parallelism).strategy
    })?;
    r.put("parallelism.world_size", &stated.world_size, |req| {
        &mut req
            .parallelism
            .get_or_insert_with(no_parallelism)
            .world_size
    })?;
    r.put(
        "offload.optimizer_state",
        &stated.offload_optimizer,
        |req| &mut req.offload.get_or_insert_with(no_offload).optimizer_state,
    )?;
    r.put("offload.parameters", &stated.offload_parameters, |req| {
        &mut req.offload.get_or_insert_with(no_offload).parameters
    })?;
    let buffers = &stated.zero_buffers;
    r.put(
        "zero.reduce_bucket_size",
        &buffers.reduce_bucket_size,
        |req| &mut req.zero.get_or_insert_with(no_zero).reduce_bucket_size,
    )?;
    r.put(
        "zero.prefetch_bucket_size",
        &buffers.prefetch_bucket_size,
        |req| &mut req.zero.get_or_insert_with(no_zero).prefetch_bucket_size,
    )?;
    r.put(
        "zero.max_live_parameters",
        &buffers.max_live_parameters,
        |req| &mut req.zero.get_or_insert_with(no_zero).max_live_parameters,
    )?;
    r.put(
        "zero.max_reuse_distance",
        &buffers.max_reuse_distance,
        |req| &mut req.zero.get_or_insert_with(no_zero).max_reuse_distance,
    )?;
    r.put(
        "zero.param_persistence_threshold",
        &buffers.param_persistence_threshold,
        |req| {
            &mut req
                .zero
                .get_or_insert_with(no_zero)
                .param_persistence_threshold
        },
    )?;
    r.put("zero.sub_group_size", &buffers.sub_group_size, |req| {
        &mut req.zero.get_or_insert_with(no_zero).sub_group_size
    })?;
    // The kernel matters to a job built from its config only (elsewhere it is traced).
    if let Some(kernel) = stated.attention.as_ref() {
        if request.transformer_config.is_some() {
            r.state(
                "attention",
                &kernel.from,
                kernel.value.to_string(),
                |req| &mut req.attention,
                |g| {
                    AttentionKernel::parse(Some(g)).ok()
                        == AttentionKernel::parse(Some(kernel.value)).ok()
                },
            )?;
        }
    }
    if let Some(lora) = &stated.lora {
        r.lora(lora)?;
    }
    if let Some(base) = &stated.base_weights {
        r.base_weights(base)?;
    }
    Ok(Some(Applied {
        request: merged.request,
        read: merged.read,
        warnings: merged.warnings,
        assumed_dtype: stated.assumed_dtype,
    }))
}

/// A value read from a file, as its request field holds it.
trait Wire: Copy {
    type On: Clone + std::fmt::Display;
    fn wire(self) -> Self::On;
    /// Whether the request's own value means the same.
    fn agrees(given: &Self::On, value: Self) -> bool;
}

/// The setup's vocabulary: the request's spelling agrees when it parses to the same word.
macro_rules! words {
    ($($kind:ty),*) => {$(
        impl Wire for $kind {
            type On = String;
            fn wire(self) -> String {
                self.as_str().to_string()
            }
            fn agrees(given: &String, value: Self) -> bool {
                <$kind>::parse(given) == Some(value)
            }
        }
    )*};
}

words!(Precision, Optimizer, OptimizerImplementation, Strategy);

/// Numbers and flags: the same value.
macro_rules! exact {
    ($($kind:ty),*) => {$(
        impl Wire for $kind {
            type On = $kind;
            fn wire(self) -> $kind {
                self
            }
            fn agrees(given: &$kind, value: Self) -> bool {
                *given == value
            }
        }
    )*};
}

exact!(u64, bool);

fn no_parallelism() -> ParallelismRequest {
    ParallelismRequest {
        strategy: None,
        world_size: None,
        tensor_parallel: None,
        pipeline_parallel: None,
        context_parallel: None,
        sequence_parallel: None,
    }
}

fn no_offload() -> OffloadRequest {
    OffloadRequest {
        optimizer_state: None,
        gradients: None,
        parameters: None,
    }
}

fn no_zero() -> ZeroRequest {
    ZeroRequest {
        reduce_bucket_size: None,
        prefetch_bucket_size: None,
        max_live_parameters: None,
        max_reuse_distance: None,
        param_persistence_threshold: None,
        sub_group_size: None,
    }
}

/// Two places that state one field differently.
fn conflict(field: &str, given: &str, from: &str, value: &str) -> ApiError {
    ApiError::InvalidInput(format!(
        "{field}: the request states {given}, {from} states {value}: give one, or make them agree"
    ))
}

struct Merge {
    request: EstimateRequest,
    read: Vec<FromFileResponse>,
    warnings: Vec<String>,
}

impl Merge {
    fn note(&mut self, field: &str, value: impl ToString, from: &str) {
        self.read.push(FromFileResponse {
            field: field.into(),
            value: value.to_string(),
            from: from.into(),
        });
    }

    /// Writes one value into the request's field: refused when the request states it
    /// otherwise (`same` says whether its own spelling means the same).
    fn state<V: Clone + std::fmt::Display>(
        &mut self,
        field: &str,
        from: &str,
        value: V,
        slot: impl Fn(&mut EstimateRequest) -> &mut Option<V>,
        same: impl Fn(&V) -> bool,
    ) -> Result<(), ApiError> {
        let current = slot(&mut self.request);
        if let Some(given) = current.as_ref().filter(|given| !same(given)) {
            let shown = |v: &V| format!("'{}'", echo(&v.to_string()));
            return Err(conflict(field, &shown(given), from, &shown(&value)));
        }
        *current = Some(value.clone());
        self.note(field, value, from);
        Ok(())
    }

    /// A value, if read, written into its request field: the request's own must agree
    /// ([`Wire::agrees`]).
    fn put<V: Wire>(
        &mut self,
        field: &str,
        read: &Option<Read<V>>,
        slot: impl Fn(&mut EstimateRequest) -> &mut Option<V::On>,
    ) -> Result<(), ApiError> {
        let Some(read) = read else { return Ok(()) };
        let value = read.value;
        self.state(field, &read.from, value.wire(), slot, |g| {
            V::agrees(g, value)
        })
    }

    /// The precision the files state, against the request's own. The weights' dtype a load
    /// states is not the whole precision: fp32 weights train in fp32, tf32 or under autocast
    /// (the request's field says which), and 16-bit weights under autocast train as pure
    /// 16-bit (autocast keeps no fp32 copy of them), as the files' own rule reads the
    /// Trainer's `bf16=True` beside them.
    fn precision(&mut self, stated: &Option<Read<Precision>>) -> Result<(), ApiError> {
        let Some(read) = stated else { return Ok(()) };
        let given = self.request.precision.as_deref().and_then(Precision::parse);
        if let (Some(given), true) = (given, read.from.starts_with("load.")) {
            let fp32_weights = matches!(
                given,
                Precision::Fp32 | Precision::Tf32 | Precision::AmpFp16 | Precision::AmpBf16
            );
            if read.value == Precision::Fp32 && fp32_weights {
                return Ok(());
            }
            if given.is_autocast() && read.value.compute_bytes() == 2.0 {
                self.warnings.push(format!(
                    "precision: {} over the {} weights {} loads trains as pure {} (autocast \
                     keeps no fp32 copy of 16-bit weights)",
                    given.as_str(),
                    read.value.as_str(),
                    read.from,
                    read.value.as_str()
                ));
                self.request.precision = Some(read.value.as_str().to_string());
                self.note("precision", read.value.as_str(), &read.from);
                return Ok(());
            }
        }
        self.put("precision", stated, |req| &mut req.precision)
    }

    /// The request's `batch_size` must be whole micro-batches x accumulation (per GPU, or
    /// times the data-parallel ranks, which the setup checks); not given, it is one GPU's.
    fn batch_covers(&mut self, stated: &files::FileSetup) -> Result<(), ApiError> {
        let Some(micro) = &stated.micro_batch_size else {
            return Ok(());
        };
        let accumulation = self.request.gradient_accumulation_steps.unwrap_or(1);
        let step = micro.value.saturating_mul(accumulation);
        let from = stated
            .gradient_accumulation_steps
            .as_ref()
            .map_or(String::new(), |k| format!(" x {}", k.from));
        let Some(batch) = self.request.batch_size else {
            self.request.batch_size = Some(step);
            self.note("batch_size", step, &format!("{}{from}", micro.from));
            return Ok(());
        };
        if batch == 0 || !batch.is_multiple_of(step) {
            return Err(ApiError::InvalidInput(format!(
                "batch_size: the request states {batch}, not a multiple of {}{from} \
                 ({} x {accumulation} samples a GPU per step): give batch_size as that, or \
                 that x the data-parallel ranks",
                micro.from, micro.value
            )));
        }
        Ok(())
    }

    fn checkpointing(&mut self, read: &Read<bool>) -> Result<(), ApiError> {
        let value = if read.value { "full" } else { "none" };
        if let Some(given) = &self.request.activation_checkpointing {
            let agrees = match given {
                NamesRequest::Keyword(word) => match word.to_ascii_lowercase().as_str() {
                    "full" | "on" => read.value,
                    "none" | "off" => !read.value,
                    _ => false,
                },
                NamesRequest::Names(_) => false,
            };
            if !agrees {
                let shown = match given {
                    NamesRequest::Keyword(word) => format!("'{}'", echo(word)),
                    NamesRequest::Names(list) => format!("a list of {} modules", list.len()),
                };
                return Err(conflict(
                    "activation_checkpointing",
                    &shown,
                    &read.from,
                    &format!("{} ('{value}')", read.value),
                ));
            }
        }
        self.request.activation_checkpointing = Some(NamesRequest::Keyword(value.into()));
        self.note("activation_checkpointing", value, &read.from);
        Ok(())
    }

    fn lora(&mut self, read: &Read<files::AdapterLora>) -> Result<(), ApiError> {
        let adapter = &read.value;
        let at = |key: &str| format!("{}.{key}", read.from);
        let targets = match &adapter.targets {
            None => NamesRequest::Keyword("all-linear".into()),
            Some(list) => NamesRequest::Names(list.clone()),
        };
        let shown_targets = match &adapter.targets {
            None => "all-linear".to_string(),
            Some(list) => list.join(", "),
        };
        match &mut self.request.lora {
            None => {
                self.request.lora = Some(LoraRequest {
                    rank: adapter.rank,
                    alpha: Some(adapter.alpha),
                    dropout: Some(adapter.dropout),
                    target_modules: targets,
                    base_weights: None,
                    group_size: None,
                    expert_layout: None,
                    modules_to_save: adapter.modules_to_save.clone(),
                });
            }
            Some(given) => {
                if given.rank != adapter.rank {
                    return Err(conflict(
                        "lora.rank",
                        &given.rank.to_string(),
                        &at("r"),
                        &adapter.rank.to_string(),
                    ));
                }
                for (field, key, mine, theirs) in [
                    ("lora.alpha", "lora_alpha", &mut given.alpha, adapter.alpha),
                    (
                        "lora.dropout",
                        "lora_dropout",
                        &mut given.dropout,
                        adapter.dropout,
                    ),
                ] {
                    match mine {
                        Some(x) if *x != theirs => {
                            return Err(conflict(
                                field,
                                &x.to_string(),
                                &at(key),
                                &theirs.to_string(),
                            ))
                        }
                        _ => *mine = Some(theirs),
                    }
                }
                if !same_names(&given.target_modules, &targets) {
                    return Err(conflict(
                        "lora.target_modules",
                        &names_shown(&given.target_modules),
                        &at("target_modules"),
                        &format!("[{shown_targets}]"),
                    ));
                }
                match (&given.modules_to_save, &adapter.modules_to_save) {
                    (Some(a), Some(b)) if !same_list(a, b) => {
                        return Err(conflict(
                            "lora.modules_to_save",
                            &format!("[{}]", a.join(", ")),
                            &at("modules_to_save"),
                            &format!("[{}]", b.join(", ")),
                        ))
                    }
                    (Some(a), None) => {
                        return Err(conflict(
                            "lora.modules_to_save",
                            &format!("[{}]", a.join(", ")),
                            &at("modules_to_save"),
                            "none",
                        ))
                    }
                    _ => given.modules_to_save = adapter.modules_to_save.clone(),
                }
            }
        }
        self.note("lora.rank", adapter.rank, &at("r"));
        self.note("lora.alpha", adapter.alpha, &at("lora_alpha"));
        self.note("lora.dropout", adapter.dropout, &at("lora_dropout"));
        self.note("lora.target_modules", shown_targets, &at("target_modules"));
        if let Some(list) = &adapter.modules_to_save {
            self.note(
                "lora.modules_to_save",
                list.join(", "),
                &at("modules_to_save"),
            );
        }
        Ok(())
    }

    fn base_weights(&mut self, read: &Read<BaseWeights>) -> Result<(), ApiError> {
        let Some(lora) = &mut self.request.lora else {
            return Err(ApiError::InvalidInput(format!(
                "{}: a quantised base trains through adapters: give adapter_config or lora",
                read.from
            )));
        };
        let group = match read.value {
            BaseWeights::Gptq { group_size } | BaseWeights::Awq { group_size } => Some(group_size),
            _ => None,
        };
        if let Some(given) = lora.base_weights.as_deref() {
            let parsed = BaseWeights::parse(given);
            let given_group = lora.group_size.unwrap_or(DEFAULT_GROUP_SIZE);
            let same = parsed.map(BaseWeights::as_str) == Some(read.value.as_str())
                && group.is_none_or(|g| g == given_group);
            if !same {
                return Err(conflict(
                    "lora.base_weights",
                    &format!("'{}' (group_size {given_group})", echo(given)),
                    &read.from,
                    &format!("'{}'", read.value.as_str()),
                ));
            }
        }
        lora.base_weights = Some(read.value.as_str().into());
        if let Some(g) = group {
            lora.group_size = Some(g);
        }
        self.note("lora.base_weights", read.value.as_str(), &read.from);
        if let Some(g) = group {
            self.note("lora.group_size", g, &read.from);
        }
        Ok(())
    }
}

fn same_list(a: &[String], b: &[String]) -> bool {
    let mut a: Vec<&str> = a.iter().map(|s| s.trim()).collect();
    let mut b: Vec<&str> = b.iter().map(|s| s.trim()).collect();
    a.sort_unstable();
    b.sort_unstable();
    a.dedup();
    b.dedup();
    a == b
}

fn same_names(a: &NamesRequest, b: &NamesRequest) -> bool {
    let all_linear =
        |w: &str| matches!(w.to_ascii_lowercase().as_str(), "all-linear" | "all_linear");
    match (a, b) {
        (NamesRequest::Keyword(x), NamesRequest::Keyword(y)) => all_linear(x) && all_linear(y),
        (NamesRequest::Names(x), NamesRequest::Names(y)) => same_list(x, y),
        _ => false,
    }
}

fn names_shown(n: &NamesRequest) -> String {
    match n {
        NamesRequest::Keyword(w) => format!("'{}'", echo(w)),
        NamesRequest::Names(list) => format!("[{}]", echo(&list.join(", "))),
    }
}
