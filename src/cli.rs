//! `gpucast estimate FILE|-`: a job description answered from the command line with the
//! committed models, no server. The same code path as `POST /v1/estimate` (validation, the
//! estimators, the answer) and the same JSON; `--batch` answers as `POST /v1/estimate/batch`;
//! bad input exits with status 2 and the problem JSON the API would return. `gpucast features`
//! prints what the estimators read of the same jobs, for the training pipeline.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

use serde_json::Value;

use crate::api::parse::{parse_estimate, parse_json};
use crate::api::types::{BatchRequest, BatchResponse, PlanRequest, PlanResponse};
use crate::bound::distribution::{self as uncertainty, Calibration};
use crate::bound::learned::{fold_answer, FoldJob};
use crate::calibration::db;
use crate::calibration::store::{ProfileStore, DEFAULT_RETENTION};
use crate::config::{
    located, CombineArgs, EstimateArgs, FeaturesArgs, OfflineArgs, OutputFormat, PlanArgs,
    RecordArgs, StoreArgs,
};
use crate::devices::sku::Catalogue;
use crate::devices::NoDevices;
use crate::engine::cost::Cost;
use crate::engine::observation;
use crate::engine::validate::to_job;
use crate::engine::{parse_items, Deadline, Engine};
use crate::error::ApiError;
use crate::estimators::features::{raw_token_feature, AggregateFeatures, TOKEN_FEATURES};
use crate::estimators::Estimators;
use crate::job::Job;
use crate::metrics::Metrics;

/// Exit status of bad input (the problem JSON is printed).
pub const BAD_INPUT: i32 = 2;
/// Exit status when the models or the input file cannot be read.
pub const FAILED: i32 = 1;

/// Largest calibration file read: the committed one is under 64 KiB.
const MAX_CALIBRATION_BYTES: u64 = 1024 * 1024;

/// A calibration file's text, refused beyond [`MAX_CALIBRATION_BYTES`].
fn read_calibration(path: &std::path::Path) -> Result<String, String> {
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut text = String::new();
    file.take(MAX_CALIBRATION_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_CALIBRATION_BYTES {
        return Err(format!("larger than {MAX_CALIBRATION_BYTES} bytes"));
    }
    Ok(text)
}

/// The job's bytes and the engine that answers it, or the exit status of a failure (said on
/// standard error, `command` naming the subcommand).
fn job_and_engine(args: &EstimateArgs, command: &str) -> Result<(Vec<u8>, Engine), i32> {
    let bytes = job_input(args).map_err(|e| {
        eprintln!("gpucast {command}: {e}");
        FAILED
    })?;
    if let Some(path) = &args.uncertainty {
        let calibration = read_calibration(path).and_then(|text| Calibration::parse(&text));
        match calibration {
            Ok(calibration) => {
                uncertainty::install(calibration);
            }
            Err(e) => {
                eprintln!("gpucast {command}: --uncertainty {}: {e}", path.display());
                return Err(FAILED);
            }
        }
    }
    let engine = offline_engine(args).map_err(|e| {
        eprintln!("gpucast {command}: {e}");
        FAILED
    })?;
    Ok((bytes, engine))
}

/// Runs the subcommand; returns the process's exit status.
pub fn estimate(args: &EstimateArgs) -> i32 {
    let (bytes, engine) = match job_and_engine(args, "estimate") {
        Ok(prepared) => prepared,
        Err(status) => return status,
    };
    let started = Instant::now();
    if args.batch {
        match batch_items(&bytes, crate::config::DEFAULT_MAX_BATCH_ITEMS) {
            Ok(items) => match engine.estimate_items(items, started) {
                Ok(items) => {
                    let response = BatchResponse { items };
                    let value = as_sent(&response);
                    print(args.format, &value, true);
                    0
                }
                Err(error) => problem(error),
            },
            Err(error) => problem(error),
        }
    } else {
        let outcome =
            parse_estimate(&bytes, "").and_then(|request| engine.estimate(&request, started));
        match outcome {
            Ok(response) => {
                let value = as_sent(&response);
                print(args.format, &value, false);
                0
            }
            Err(error) => problem(error),
        }
    }
}

/// `gpucast plan`: the job as `estimate` reads it, planned as `POST /v1/plan` plans it.
pub fn plan(args: &PlanArgs) -> i32 {
    if args.estimate.batch {
        eprintln!("gpucast plan: a plan is of one job, not a --batch");
        return FAILED;
    }
    let (bytes, engine) = match job_and_engine(&args.estimate, "plan") {
        Ok(prepared) => prepared,
        Err(status) => return status,
    };
    let mut body = serde_json::Map::new();
    if args.catalogue {
        body.insert("catalogue".into(), Value::Bool(true));
    }
    if let Some(list) = &args.precisions {
        body.insert("precisions".into(), names(list));
    }
    if let Some(max) = args.max_micro_batch {
        body.insert("max_micro_batch".into(), Value::from(max));
    }
    if let Some(max) = args.max_seq_len {
        body.insert("max_seq_len".into(), Value::from(max));
    }
    if args.no_setups {
        body.insert("setups".into(), Value::Bool(false));
    }
    // The job goes in as its bytes: read as the plan route reads its `job`.
    let rest = serde_json::to_string(&body).expect("a JSON value serialises");
    let mut text = format!("{{\"job\":{}", String::from_utf8_lossy(&bytes).trim());
    if body.is_empty() {
        text.push('}');
    } else {
        text.push(',');
        text.push_str(&rest[1..]);
    }
    let outcome = parse_json::<PlanRequest>(text.as_bytes(), "")
        .and_then(|request| crate::engine::plan::plan(&engine, &request, &Deadline::NONE));
    match outcome {
        Ok(plan) => {
            match args.estimate.format {
                OutputFormat::Json => out(&format!(
                    "{}\n",
                    serde_json::to_string_pretty(&plan).expect("plans serialise")
                )),
                OutputFormat::Table => out(&plan_table(&plan)),
            }
            0
        }
        Err(error) => problem(error),
    }
}

/// A plan for people: each card's largest micro-batch, the sequence, the setups ranked.
pub fn plan_table(plan: &PlanResponse) -> String {
    let mib = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.0}"));
    let ms = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.1}"));
    let mut text = format!(
        "at confidence {}, the job's micro-batch {} x {} accumulation steps\n",
        plan.confidence, plan.micro_batch_size, plan.gradient_accumulation_steps
    );
    text.push_str(&format!(
        "{:<16} {:>9} {:<9} {:<5} {:>10} {:>10} {:>10} {:>10}\n",
        "gpu", "MiB", "precision", "fits", "bound MiB", "largest mb", "bound MiB", "step ms"
    ));
    for row in &plan.cards {
        let largest = match (row.largest_micro_batch, row.limited_by_max) {
            (None, _) => "none".to_string(),
            (Some(m), false) => m.to_string(),
            (Some(m), true) => format!("{m}+"),
        };
        let at = row.at_largest.as_ref();
        text.push_str(&format!(
            "{:<16} {:>9} {:<9} {:<5} {:>10} {:>10} {:>10} {:>10}\n",
            row.gpu,
            row.capacity_mib,
            row.precision,
            if row.fits { "yes" } else { "no" },
            mib(row.job.upper_bound_mib),
            largest,
            mib(at.and_then(|a| a.upper_bound_mib)),
            ms(at.and_then(|a| a.step_time_ms)),
        ));
    }
    if plan.cards.len() > 1 {
        text.push_str(&format!(
            "smallest card it fits: {}\n",
            plan.smallest_fitting_gpu.as_deref().unwrap_or("none")
        ));
    }
    if let Some(seq) = &plan.seq_len {
        text.push_str(&format!(
            "longest sequence at micro-batch {} on {}: {}{}\n",
            seq.micro_batch_size,
            seq.gpu,
            seq.longest_seq_len
                .map_or_else(|| "none".into(), |s| s.to_string()),
            if seq.limited_by_max { "+" } else { "" }
        ));
    }
    if !plan.setups.is_empty() {
        text.push_str(&format!(
            "setups at micro-batch {} on {}, best first:\n",
            plan.micro_batch_size, plan.cards[0].gpu
        ));
        text.push_str(&format!(
            "  {:<4} {:<26} {:<5} {:>10} {:>10} {:>10} {:>12}\n",
            "rank", "setup", "fits", "MiB", "bound MiB", "step ms", "ms/sample"
        ));
        for setup in &plan.setups {
            text.push_str(&format!(
                "  {:<4} {:<26} {:<5} {:>10} {:>10} {:>10} {:>12}\n",
                setup.rank,
                setup.setup,
                if setup.fits { "yes" } else { "no" },
                mib(setup.estimate_mib),
                mib(setup.upper_bound_mib),
                ms(setup.step_time_ms),
                ms(setup.ms_per_sample),
            ));
        }
    }
    // The time is the JSON's (`latency_us`): the table stays the same run to run.
    text.push_str(&format!("{} estimates\n", plan.estimates));
    for warning in &plan.warnings {
        text.push_str(&format!("warning: {warning}\n"));
    }
    text
}

/// The request: the job file (or an empty job) with `--config`'s model and the setup flags
/// written over it.
fn job_input(args: &EstimateArgs) -> Result<Vec<u8>, String> {
    let flags = &args.job;
    let limit = args.engine.max_body_bytes;
    let read = |file: &str| read_input(file, limit).map_err(|e| format!("{file}: {e}"));
    let base = match (&args.file, &flags.config) {
        (None, None) => {
            return Err("give a job file (`-` for standard input) or --config config.json".into())
        }
        (Some(file), _) => {
            let bytes = read(file)?;
            // A printout saved as the tool printed it is the job's summary, as it is.
            if crate::api::parse::looks_like_printout(&bytes) && !args.batch {
                let text = String::from_utf8_lossy(&bytes);
                serde_json::to_vec(&serde_json::json!({ "summary": { "text": text } }))
                    .expect("a JSON value serialises")
            } else {
                bytes
            }
        }
        (None, Some(_)) => b"{}".to_vec(),
    };
    let mut fields = match &flags.config {
        Some(config) => model_fields(config, &read)?,
        None => serde_json::Map::new(),
    };
    fields.extend(setup_fields(flags)?);
    for (key, file) in [
        ("training_arguments", &flags.training_args),
        ("adapter_config", &flags.adapter_config),
        ("deepspeed", &flags.deepspeed),
        ("fsdp", &flags.fsdp),
        ("load", &flags.load),
        ("saved_tensors", &flags.saved_tensors),
        ("simulation", &flags.simulation),
    ] {
        if let Some(file) = file {
            let value = json_object(&read(&file.to_string_lossy())?, file)?;
            fields.insert(key.into(), value);
        }
    }
    if let Some(dtype) = &flags.torch_dtype {
        let load = fields
            .entry("load")
            .or_insert_with(|| Value::Object(serde_json::Map::new()));
        if let Some(load) = load.as_object_mut() {
            load.insert("torch_dtype".into(), Value::from(dtype.as_str()));
        }
    }
    if fields.is_empty() {
        return Ok(base);
    }
    if args.batch {
        return Err("the setup flags describe one job, not a --batch".into());
    }
    let mut job: Value = serde_json::from_slice(&base).map_err(|e| format!("the job: {e}"))?;
    let object = job
        .as_object_mut()
        .ok_or("the job must be a JSON object to take the setup flags")?;
    for (key, value) in fields {
        // A layout, offload or load the job states keeps the keys the flags do not set.
        let nested = matches!(key.as_str(), "parallelism" | "offload" | "load" | "node");
        match (object.get_mut(&key), value) {
            (Some(Value::Object(given)), Value::Object(set)) if nested => given.extend(set),
            (_, value) => {
                object.insert(key, value);
            }
        }
    }
    Ok(serde_json::to_vec(&job).expect("a JSON value serialises"))
}

/// A file's object: JSON, or YAML as accelerate writes its config and DeepSpeed users keep
/// theirs ([`crate::api::unique_keys::file_text`], as the service reads a file's text).
fn json_object(text: &[u8], file: &std::path::Path) -> Result<Value, String> {
    let text = std::str::from_utf8(text).map_err(|_| format!("{}: not UTF-8", file.display()))?;
    let value =
        crate::api::unique_keys::file_text(text).map_err(|e| format!("{}: {e}", file.display()))?;
    if !value.is_object() {
        return Err(format!(
            "{}: expected a JSON object or YAML mapping",
            file.display()
        ));
    }
    Ok(value)
}

/// `--config`'s fields: `transformer_config`, and `adapter_config` for an adapter. A file is a
/// config.json; a directory is what `save_pretrained` writes (config.json, or PEFT's
/// adapter_config.json whose base is a directory or a hub repo); else a hub repo id.
fn model_fields(
    config: &std::path::Path,
    read: &dyn Fn(&str) -> Result<Vec<u8>, String>,
) -> Result<serde_json::Map<String, Value>, String> {
    let named = config.to_string_lossy();
    let mut fields = serde_json::Map::new();
    let read_json = |path: &std::path::Path| -> Result<Value, String> {
        serde_json::from_slice(&read(&path.to_string_lossy())?)
            .map_err(|e| format!("--config {}: {e}", path.display()))
    };
    if config.is_dir() {
        let (model, adapter) = (
            config.join("config.json"),
            config.join("adapter_config.json"),
        );
        let adapter = adapter
            .is_file()
            .then(|| json_object(&read(&adapter.to_string_lossy())?, &adapter))
            .transpose()?;
        let model = if model.is_file() {
            read_json(&model)?
        } else {
            // PEFT's directory: the base model it names.
            let base = adapter
                .as_ref()
                .and_then(|a| a.get("base_model_name_or_path"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    format!(
                        "--config {}: a directory without config.json (or adapter_config.json \
                         naming its base_model_name_or_path)",
                        config.display()
                    )
                })?;
            let base_dir = std::path::Path::new(base).join("config.json");
            if base_dir.is_file() {
                read_json(&base_dir)?
            } else if crate::hub::is_repo_id(base) {
                crate::hub::model(base)
                    .map_err(|e| format!("--config {}: {e}", config.display()))?
                    .config
            } else {
                return Err(format!(
                    "--config {}: the adapter's base '{base}' is neither a directory with \
                     config.json nor a hub repo",
                    config.display()
                ));
            }
        };
        fields.insert("transformer_config".into(), model);
        if let Some(adapter) = adapter {
            fields.insert("adapter_config".into(), adapter);
        }
    } else if config.is_file() || !crate::hub::is_repo_id(&named) {
        fields.insert("transformer_config".into(), read_json(config)?);
    } else {
        let model = crate::hub::model(&named).map_err(|e| format!("--config {e}"))?;
        fields.insert("transformer_config".into(), model.config);
        if let Some(adapter) = model.adapter_config {
            fields.insert("adapter_config".into(), adapter);
        }
    }
    fields.retain(|_, v| !v.is_null());
    Ok(fields)
}

/// Names separated by commas, as a JSON list.
fn names(list: &str) -> Value {
    Value::from(list.split(',').map(str::trim).collect::<Vec<_>>())
}

/// `--gpu`: one card, or several separated by commas (ranked); `NAME:MIB` a card by its
/// memory.
fn gpu_choice(raw: &str) -> Result<Value, String> {
    let card = |part: &str| -> Result<Value, String> {
        let part = part.trim();
        match part.rsplit_once(':') {
            Some((name, capacity)) => {
                let capacity_mib: u64 = capacity.trim().parse().map_err(|_| {
                    format!("--gpu {part}: NAME:MIB takes the card's memory in MiB")
                })?;
                Ok(serde_json::json!({ "name": name.trim(), "capacity_mib": capacity_mib }))
            }
            None => Ok(Value::from(part)),
        }
    };
    let cards: Vec<Value> = raw.split(',').map(card).collect::<Result<_, _>>()?;
    Ok(match <[Value; 1]>::try_from(cards) {
        Ok([one]) => one,
        Err(many) => Value::from(many),
    })
}

/// The request fields the flags set. Each value is checked where the API checks it.
fn setup_fields(flags: &crate::config::JobFlags) -> Result<serde_json::Map<String, Value>, String> {
    // The flags declared by the request's own fields, as the request states them.
    let Value::Object(mut fields) =
        serde_json::to_value(&flags.request).map_err(|e| format!("the setup flags: {e}"))?
    else {
        unreachable!("a request serialises as an object")
    };
    // What no flag set is absent, at every depth (a layout the job states keeps the keys the
    // flags leave unset).
    fn without_nulls(fields: &mut serde_json::Map<String, Value>) {
        fields.retain(|_, value| !value.is_null());
        fields
            .values_mut()
            .filter_map(Value::as_object_mut)
            .for_each(without_nulls);
    }
    without_nulls(&mut fields);
    let mut set = |key: &str, value: Option<Value>| {
        if let Some(value) = value {
            fields.insert(key.into(), value);
        }
    };
    set(
        "trainable",
        match (flags.trainable_params, &flags.trainable_modules) {
            (Some(params), _) => Some(serde_json::json!({ "params": params })),
            (None, Some(modules)) => Some(serde_json::json!({ "modules": names(modules) })),
            (None, None) => None,
        },
    );
    set(
        "lora",
        flags.lora_rank.map(|rank| {
            let targets = match flags.lora_targets.as_deref() {
                None | Some("all-linear") => Value::from("all-linear"),
                Some(list) => names(list),
            };
            let mut lora = serde_json::json!({
                "rank": rank,
                "target_modules": targets,
            });
            // Absent, the API's default (PEFT's), as every other client gets.
            if let Some(alpha) = flags.lora_alpha {
                lora["alpha"] = Value::from(alpha);
            }
            if let Some(dropout) = flags.lora_dropout {
                lora["dropout"] = Value::from(dropout);
            }
            if let Some(list) = &flags.lora_modules_to_save {
                lora["modules_to_save"] = names(list);
            }
            if let Some(base) = &flags.base_weights {
                lora["base_weights"] = Value::from(base.as_str());
            }
            if let Some(group) = flags.group_size {
                lora["group_size"] = Value::from(group);
            }
            lora
        }),
    );
    let offload = match &flags.offload {
        None => None,
        Some(list) => {
            let mut offload = serde_json::Map::new();
            for word in list.split(',').map(str::trim) {
                match word {
                    "optimizer_state" | "gradients" | "parameters" => {
                        offload.insert(word.into(), Value::Bool(true));
                    }
                    other => {
                        return Err(format!(
                            "--offload: '{}' is none of optimizer_state, gradients, parameters",
                            crate::job::echo(other)
                        ))
                    }
                }
            }
            Some(Value::Object(offload))
        }
    };
    set("offload", offload);
    let input_shape = match &flags.input_shape {
        None => None,
        Some(dims) => Some(Value::from(
            dims.split(',')
                .map(|d| d.trim().parse::<u64>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|_| {
                    format!(
                        "--input-shape: '{}' is not whole numbers separated by commas",
                        crate::job::echo(dims)
                    )
                })?,
        )),
    };
    set("input_shape", input_shape);
    set(
        "node",
        flags.node_memory_mib.map(|memory| {
            let mut node = serde_json::json!({ "memory_mib": memory });
            if let Some(gpus) = flags.node_gpus {
                node["gpus"] = Value::from(gpus);
            }
            node
        }),
    );
    set("gpu", flags.gpu.as_deref().map(gpu_choice).transpose()?);
    Ok(fields)
}

/// `gpucast features [--batch] FILE|-`: what the estimators read of each job, read as the
/// estimate routes read it (the same limits, parsing, pricing and validation, the same
/// problem JSON for a bad item), with no models loaded. The training pipeline learns from this
/// output (training/gpucast_training/service.py) instead of restating the features.
pub fn features(args: &FeaturesArgs) -> i32 {
    let bytes = match read_input(&args.file, args.max_body_bytes) {
        Ok(bytes) => bytes,
        Err(e) => {
            eprintln!("gpucast features: {}: {e}", args.file);
            return FAILED;
        }
    };
    if args.batch {
        let parsed = batch_items(&bytes, crate::config::DEFAULT_MAX_BATCH_ITEMS)
            .and_then(|items| parse_items(items, args.max_request_cost));
        let parsed = match parsed {
            Ok(parsed) => parsed,
            Err(error) => return problem(error),
        };
        let items: Vec<Value> = parsed
            .into_iter()
            .enumerate()
            .map(|(index, request)| {
                let job = request.and_then(|request| {
                    to_job(&request).map_err(|e| e.within(&format!("items[{index}].")))
                });
                match job {
                    Ok(job) => serde_json::json!({
                        "index": index,
                        "status": 200,
                        "features": job_features(&job),
                    }),
                    Err(error) => serde_json::json!({
                        "index": index,
                        "status": error.status().as_u16(),
                        "error": error.problem(),
                    }),
                }
            })
            .collect();
        // One compact line: a program reads it, and a batch of models of 900 layers each
        // pretty-printed runs to tens of megabytes.
        let value = serde_json::json!({ "items": items });
        out(&format!(
            "{}\n",
            serde_json::to_string(&value).expect("values serialise")
        ));
        return 0;
    }
    let job = parse_estimate(&bytes, "").and_then(|request| {
        Cost::of(&request).check(args.max_request_cost, None)?;
        to_job(&request)
    });
    match job {
        Ok(job) => {
            print(OutputFormat::Json, &job_features(&job), false);
            0
        }
        Err(error) => problem(error),
    }
}

/// One job's features: every aggregate feature by name (the analytic figures among them), the
/// family, and per layer its canonical kind and raw token features (`token_features` names the
/// columns). Raw values: a model's normalisation is the manifest's, applied by its reader.
fn job_features(job: &Job) -> Value {
    let aggregate: serde_json::Map<String, Value> = AggregateFeatures::of(job)
        .named()
        .into_iter()
        .map(|(name, value)| (name, Value::from(value)))
        .collect();
    let kinds: Vec<&str> = job.layers().iter().map(|l| l.kind.as_str()).collect();
    let tokens: Vec<Vec<f64>> = (0..job.layers().len())
        .map(|index| {
            TOKEN_FEATURES
                .iter()
                .map(|name| raw_token_feature(job, index, name).expect("a known token feature"))
                .collect()
        })
        .collect();
    serde_json::json!({
        "family": job.family().as_str(),
        "aggregate": aggregate,
        "kinds": kinds,
        "token_features": TOKEN_FEATURES,
        "tokens": tokens,
    })
}

/// `gpucast gpus`: the catalogue, as a table for people or the JSON of `GET /v1/gpus`.
pub fn gpus(format: OutputFormat) -> i32 {
    let catalogue = Catalogue::builtin();
    match format {
        OutputFormat::Json => {
            let value = serde_json::to_value(crate::api::gpus::catalogue_response(catalogue))
                .expect("the catalogue serialises");
            println!(
                "{}",
                serde_json::to_string_pretty(&value).expect("JSON prints")
            );
        }
        OutputFormat::Table => {
            println!("{:<16} {:>10}  {:<7} name", "id", "memory MiB", "vendor");
            for sku in catalogue.all() {
                println!(
                    "{:<16} {:>10}  {:<7} {}",
                    sku.id,
                    sku.capacity_mib,
                    sku.vendor.as_str(),
                    sku.name
                );
            }
        }
    }
    0
}

/// The input, refused beyond `limit` bytes (read no further than one byte past it).
fn read_input(file: &str, limit: usize) -> std::io::Result<Vec<u8>> {
    let source: Box<dyn Read> = if file == "-" {
        Box::new(std::io::stdin())
    } else {
        Box::new(std::fs::File::open(file)?)
    };
    let mut bytes = Vec::new();
    source.take(limit as u64 + 1).read_to_end(&mut bytes)?;
    if bytes.len() > limit {
        return Err(std::io::Error::other(format!(
            "larger than --max-body-bytes ({limit} bytes)"
        )));
    }
    Ok(bytes)
}

/// `{"items": [...]}` as the batch route takes it, or a plain JSON array of jobs.
fn batch_items(
    bytes: &[u8],
    max: usize,
) -> Result<Vec<Box<serde_json::value::RawValue>>, ApiError> {
    let starts_with_array = bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[');
    let items = if starts_with_array {
        serde_json::from_slice::<Vec<Box<serde_json::value::RawValue>>>(bytes)
            .map_err(|e| ApiError::MalformedJson(e.to_string()))?
    } else {
        parse_json::<BatchRequest>(bytes, "")?.items
    };
    if items.is_empty() || items.len() > max {
        return Err(ApiError::InvalidInput(format!(
            "items: between 1 and {max} items are accepted, got {}",
            items.len()
        )));
    }
    Ok(items)
}

fn problem(error: ApiError) -> i32 {
    let body = serde_json::to_string_pretty(&error.problem()).expect("problems serialise");
    out(&format!("{body}\n"));
    BAD_INPUT
}

/// Writes to standard output; a closed pipe (`| head`) is not an error worth a panic.
fn out(text: &str) {
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}

/// What an answer reads, without a server: the committed models, the built-in catalogue, the
/// calibration profiles of the store when there is one (`--database-url`, or a store in
/// `--data-dir`), no NVML.
fn offline_engine(args: &EstimateArgs) -> Result<Engine, String> {
    engine_over_store(&args.engine, &args.store, false)
}

/// The engine of a command run without a server: its store opened (`create`: made where it
/// is absent), else an empty one of its own.
fn engine_over_store(
    offline: &OfflineArgs,
    store: &StoreArgs,
    create: bool,
) -> Result<Engine, String> {
    let (models, dylib) = (located(&offline.models), located(&offline.ort_dylib));
    let estimators = Estimators::load(&models, &dylib, 1).map_err(|e| e.to_string())?;
    let database_url = store.database_url.as_ref().map(|u| u.expose());
    let stored = create || database_url.is_some() || store.data_dir.join(db::SQLITE_FILE).is_file();
    let (profiles, _) = if stored {
        ProfileStore::open(&store.data_dir, database_url, DEFAULT_RETENTION)
    } else {
        // No store: an empty one of this process's own, so nothing is created where the
        // command runs and concurrent runs share nothing.
        let empty = std::env::temp_dir().join(format!("gpucast-estimate-{}", std::process::id()));
        let opened = ProfileStore::load(&empty);
        // Read once at open: the files are not needed after.
        let _ = std::fs::remove_dir_all(&empty);
        opened
    }
    .map_err(|e| e.to_string())?;
    Ok(Engine {
        estimators: Arc::new(estimators),
        catalogue: Arc::new(Catalogue::builtin().clone()),
        profiles: Arc::new(profiles),
        metrics: Arc::new(Metrics::new()),
        devices: Arc::new(NoDevices::new(
            "gpucast estimate does not read NVML: name the gpu",
        )),
        cost_budget: offline.max_request_cost,
        memo: crate::engine::memo::AnswerMemo::OFF,
    })
}

/// A training fold's jobs for `gpucast combine`: the domain's thresholds and the jobs.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Fold {
    near: f64,
    far: f64,
    max_widen: f64,
    items: Vec<FoldJob>,
}

/// `gpucast combine`: each fold job answered by [`fold_answer`].
pub fn combine(args: &CombineArgs) -> i32 {
    let outcome = read_input(&args.file, args.max_body_bytes)
        .map_err(|e| ApiError::InvalidInput(format!("{}: {e}", args.file)))
        .and_then(|bytes| parse_json::<Fold>(&bytes, ""));
    match outcome {
        Ok(fold) => {
            let items: Vec<_> = fold
                .items
                .iter()
                .map(|job| fold_answer(job, fold.near, fold.far, fold.max_widen))
                .collect();
            print(
                OutputFormat::Json,
                &serde_json::json!({ "items": items }),
                false,
            );
            0
        }
        Err(error) => problem(error),
    }
}

/// `gpucast observations record`: observations recorded into the store through the rules
/// `POST /v1/calibration/observations` holds them to ([`crate::engine::observation`]).
pub fn record(args: &RecordArgs) -> i32 {
    let bytes = match read_input(&args.file, args.engine.max_body_bytes) {
        Ok(bytes) => bytes,
        Err(e) => {
            eprintln!("gpucast: {}: {e}", args.file);
            return 2;
        }
    };
    let engine = match engine_over_store(&args.engine, &args.store, true) {
        Ok(engine) => engine,
        Err(e) => {
            eprintln!("gpucast: {e}");
            return 1;
        }
    };
    let outcome = std::str::from_utf8(&bytes)
        .map_err(|_| ApiError::MalformedJson("the file is not UTF-8".into()))
        .and_then(observation::parse)
        .and_then(|observations| {
            observation::price(&engine, &observations)?;
            observation::record(&engine, observations, &Deadline::NONE)
        });
    match outcome {
        Ok(response) => {
            print(OutputFormat::Json, &as_sent(&response), false);
            0
        }
        Err(error) => problem(error),
    }
}

/// An answer as the service sends it: through its JSON text, so that an `f32` figure prints
/// as its shortest form (`0.078`), as HTTP's do, not widened to an `f64` (`serde_json`'s
/// `to_value` gives `0.07800000160932541`).
fn as_sent<T: serde::Serialize>(answer: &T) -> Value {
    let text = serde_json::to_string(answer).expect("answers serialise");
    serde_json::from_str(&text).expect("answers parse back")
}

fn print(format: OutputFormat, value: &Value, batch: bool) {
    match format {
        OutputFormat::Json => out(&format!(
            "{}\n",
            serde_json::to_string_pretty(value).expect("values serialise")
        )),
        OutputFormat::Table if batch => {
            for item in value["items"].as_array().into_iter().flatten() {
                out(&format!(
                    "== item {} (status {})\n",
                    item["index"], item["status"]
                ));
                match item.get("estimate").filter(|e| !e.is_null()) {
                    Some(estimate) => out(&table(estimate)),
                    None => out(&format!(
                        "  {}: {}\n",
                        item["error"]["title"].as_str().unwrap_or("error"),
                        item["error"]["detail"].as_str().unwrap_or_default()
                    )),
                }
            }
        }
        OutputFormat::Table => out(&table(value)),
    }
}

fn mib(value: &Value) -> String {
    value
        .as_f64()
        .map_or_else(|| "-".into(), |v| format!("{v:>10.1} MiB"))
}

/// The answer for people: the figure, its bound and fit, the breakdown, the step time.
pub fn table(answer: &Value) -> String {
    let memory = &answer["memory"];
    let fit = &answer["fit"];
    let setup = &answer["setup"];
    let mut out = String::new();
    let text = |v: &Value| v.as_str().map_or_else(|| v.to_string(), str::to_string);
    out.push_str(&format!(
        "{} job: {} {} (micro-batch {}), on {} ({} MiB)\n",
        text(&answer["family"]),
        text(&setup["precision"]),
        text(&setup["optimizer"]),
        setup["micro_batch_size"],
        text(&fit["gpu"]),
        fit["capacity_mib"],
    ));
    out.push_str(&format!(
        "memory   {}  (bound {} at {}; {})\n",
        mib(&memory["estimate_mib"]).trim(),
        mib(&memory["upper_bound_mib"]).trim(),
        memory["confidence"],
        if fit["fits"].as_bool() == Some(true) {
            format!("fits, {} per card", fit["max_colocated"])
        } else {
            "does not fit".into()
        }
    ));
    out.push_str(&format!(
        "breakdown ({}):\n",
        text(&memory["breakdown_source"])
    ));
    if let Some(parts) = memory["breakdown"].as_object() {
        for (name, value) in parts {
            out.push_str(&format!("  {name:<24}{}\n", mib(value)));
        }
    }
    if let Some(host) = setup["offload"]["host_memory_mib"].as_f64() {
        out.push_str(&format!(
            "host     {host:.1} MiB per GPU's process (offload)\n"
        ));
    }
    let performance = &answer["performance"];
    if performance.is_object() {
        out.push_str(&format!(
            "step     {:.1} ms ({} bound), {:.1} samples/s\n",
            performance["step_time_ms"].as_f64().unwrap_or(f64::NAN),
            text(&performance["bound"]),
            performance["samples_per_s"].as_f64().unwrap_or(f64::NAN),
        ));
    }
    for warning in answer["warnings"].as_array().into_iter().flatten() {
        out.push_str(&format!("warning: {}\n", text(warning)));
    }
    out
}
