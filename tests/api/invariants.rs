//! Invariants of the figure, the bound and the decision over committed jobs unlike the ones the
//! estimators were fit on: the published runs of data/public/setup_jobs.jsonl.gz (with and
//! without their simulation) and the timm held-out families of data/timm/test.jsonl.gz.
//!
//! - No figure is below weights + gradients + optimizer state + the CUDA context; no bound is
//!   below its figure; `fits` is the OOM probability at most 1 - confidence; a breakdown
//!   without activations says its peak is the optimizer's step.
//! - Memory-saving changes within one level of detail never raise the figure nor the bound:
//!   SGD instead of the job's optimizer; activation checkpointing of a job already outside the
//!   learned setups; pure bf16 instead of bf16 autocast.
//! - Setups of the same layers share the correction the regressors' answer of their plain
//!   base puts on the training step (`memory.base_correction`).
//! - The figure never shrinks as the batch grows (timm held-out jobs, traced).
//! - Jobs from config.json, the hub's and 40 random decoders: SGD, 8-bit or factored state,
//!   checkpointing, pure bf16, LoRA, QLoRA over LoRA, more FSDP sharding, CPU offload of the
//!   optimizer state, the gradients or the parameters, a shorter sequence and a smaller batch
//!   never raise the figure, nor the bound within a level; accumulation
//!   sits between one micro-batch's peak and that plus the gradients it holds.
//!
//! In process, as floor_sweep does: `answer_items` is what the batch route runs.

use std::time::Instant;

use gpucast::api::types::{EstimateRequest, EstimateResponse, PeakMomentName};
use gpucast::engine::answer::answer_items;
use gpucast::engine::validate::{validate, ValidEstimateRequest};
use gpucast::startup::Application;
use serde_json::{json, Value};

use crate::helpers::{jsonl_gz, models_dir, test_config};

/// Figures are rounded to 0.1 MiB, bounds up to the MiB.
const ROUNDING_MIB: f64 = 1.0;

/// Answers every request (all must be valid), in batches of the route's size.
fn answer(app: &Application, requests: &[Value]) -> Vec<EstimateResponse> {
    let state = &*app.state().engine;
    let mut answers = Vec::with_capacity(requests.len());
    for chunk in requests.chunks(256) {
        let items: Vec<ValidEstimateRequest> = chunk
            .iter()
            .map(|r| {
                let request: EstimateRequest = serde_json::from_value(r.clone()).unwrap();
                validate(&request, &state.catalogue, state.devices.as_ref())
                    .unwrap_or_else(|e| panic!("{e:?}"))
            })
            .collect();
        for answer in answer_items(state, &items, Instant::now()) {
            answers.push(answer.unwrap_or_else(|e| panic!("{e:?}")));
        }
    }
    answers
}

fn figure(a: &EstimateResponse) -> f64 {
    a.memory.estimate_mib.unwrap()
}

fn bound(a: &EstimateResponse) -> f64 {
    a.memory.upper_bound_mib.unwrap()
}

fn assert_holds(label: &str, a: &EstimateResponse) {
    let b = a.memory.breakdown.as_ref().unwrap();
    let known = b.parameters + b.gradients + b.optimizer_state + b.cuda_context;
    assert!(figure(a) >= known - ROUNDING_MIB, "{label}: below {known}");
    assert!(bound(a) >= figure(a), "{label}: bound below the figure");
    // A breakdown with no activation explains itself: the peak is the optimizer's step.
    if b.activations == 0.0 {
        assert_eq!(
            a.memory.peak_moment,
            Some(PeakMomentName::OptimizerStep),
            "{label}"
        );
    }
    let fit = a.fit.as_ref().unwrap();
    let decided = fit.oom_probability <= 1.0 - fit.confidence + 1e-6;
    assert_eq!(fit.fits, decided, "{label}: {fit:?}");
}

/// The published jobs without their simulation, with setup fields stripped to what they are.
fn public_jobs() -> Vec<Value> {
    jsonl_gz("data/public/setup_jobs.jsonl.gz")
        .into_iter()
        .map(|line| {
            let mut job = line["job"].clone();
            job.as_object_mut().unwrap().remove("simulation");
            job
        })
        .collect()
}

#[tokio::test]
async fn no_answer_is_below_the_counted_terms_and_fits_is_the_oom_probability() {
    let app = Application::build(&test_config(&models_dir()))
        .await
        .expect("the application starts");
    let mut requests: Vec<Value> = jsonl_gz("data/public/setup_jobs.jsonl.gz")
        .into_iter()
        .map(|line| line["job"].clone())
        .collect();
    requests.extend(public_jobs());
    requests.extend(
        jsonl_gz("data/timm/test.jsonl.gz")
            .into_iter()
            .map(|row| row["job"].clone()),
    );
    let answers = answer(&app, &requests);
    for (i, a) in answers.iter().enumerate() {
        assert_holds(&format!("job {i}"), a);
    }
    println!("{} answers hold the invariants", answers.len());
}

#[tokio::test]
async fn memory_saving_changes_within_a_level_never_raise_the_figure_or_the_bound() {
    let app = Application::build(&test_config(&models_dir()))
        .await
        .expect("the application starts");
    let mut pairs: Vec<(String, Value, Value)> = Vec::new();
    for (i, job) in public_jobs().into_iter().enumerate() {
        let with = |fields: Value| {
            let mut changed = job.clone();
            for (k, v) in fields.as_object().unwrap() {
                changed[k] = v.clone();
            }
            changed
        };
        if job["optimizer"] != "sgd" {
            pairs.push((
                format!("{i} sgd"),
                job.clone(),
                with(json!({"optimizer": "sgd"})),
            ));
        }
        let named = job["layers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|l| l.get("name").is_some());
        let checkpointed = job
            .get("activation_checkpointing")
            .is_some_and(|c| c != "none");
        pairs.push((format!("{i} own"), job.clone(), job.clone()));
        if named && !checkpointed {
            pairs.push((
                format!("{i} checkpointing"),
                job.clone(),
                with(json!({"activation_checkpointing": "full"})),
            ));
        }
        if job["precision"] == "amp_bf16" {
            pairs.push((
                format!("{i} pure bf16"),
                job.clone(),
                with(json!({"precision": "bf16"})),
            ));
        }
    }
    let requests: Vec<Value> = pairs
        .iter()
        .flat_map(|(_, before, after)| [before.clone(), after.clone()])
        .collect();
    let answers = answer(&app, &requests);
    let (mut compared, mut across_levels) = (0, 0);
    for ((label, _, _), pair) in pairs.iter().zip(answers.chunks(2)) {
        let (before, after) = (&pair[0], &pair[1]);
        let level = |a: &EstimateResponse| a.memory.uncertainty.as_ref().unwrap().detail.clone();
        if level(before) != level(after) {
            // A plain job and its checkpointed copy are answered at two levels (the learned
            // regressors, then the training step): their spreads differ.
            across_levels += 1;
            assert!(
                figure(after) <= figure(before) + ROUNDING_MIB,
                "{label}: figure {} -> {}",
                figure(before),
                figure(after)
            );
            continue;
        }
        compared += 1;
        // Setups of the same layers share the one correction of their plain base.
        if before.memory.base_correction.is_some() && after.memory.base_correction.is_some() {
            assert_eq!(
                before.memory.base_correction, after.memory.base_correction,
                "{label}"
            );
        }
        assert!(
            figure(after) <= figure(before) + ROUNDING_MIB,
            "{label}: figure {} -> {}",
            figure(before),
            figure(after)
        );
        assert!(
            bound(after) <= bound(before) + ROUNDING_MIB,
            "{label}: bound {} -> {}",
            bound(before),
            bound(after)
        );
    }
    println!("{compared} changes within a level, {across_levels} across levels (figure only)");
    assert!(compared > 200, "{compared}");
}

#[tokio::test]
async fn the_figure_never_shrinks_as_the_batch_grows() {
    let app = Application::build(&test_config(&models_dir()))
        .await
        .expect("the application starts");
    let mut requests = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for row in jsonl_gz("data/timm/test.jsonl.gz") {
        let job = row["job"].clone();
        if !seen.insert(job["model"].as_str().unwrap().to_string()) {
            continue;
        }
        for batch in [1, 2, 4, 8, 16, 32, 64, 128, 256] {
            let mut sized = job.clone();
            sized["batch_size"] = batch.into();
            requests.push(sized);
        }
    }
    let answers = answer(&app, &requests);
    for (models, sizes) in answers.chunks(9).enumerate() {
        let figures: Vec<f64> = sizes.iter().map(figure).collect();
        // Dips under 1 % are tolerated (the real_models test's rule: readings of vgg at 1 and 2).
        assert!(
            figures.windows(2).all(|w| w[1] >= w[0] * 0.99),
            "model {models}: {figures:?}"
        );
    }
}

/// The hub configs of tests/fixtures/transformer_configs/public, and `count` random decoder
/// configs of llama's shape (a fixed-seed generator, so a failure is reproducible by its label).
fn transformer_configs(count: usize) -> Vec<(String, Value)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/transformer_configs/public");
    let mut configs: Vec<(String, Value)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            (
                path.file_name().unwrap().to_string_lossy().into_owned(),
                serde_json::from_str(&text).unwrap(),
            )
        })
        .collect();
    configs.sort_by(|a, b| a.0.cmp(&b.0));
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut draw = |low: u64, high: u64| {
        // xorshift64*: enough spread for shapes, no dependency.
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        low + state.wrapping_mul(0x2545_f491_4f6c_dd1d) % (high - low + 1)
    };
    for i in 0..count {
        let heads = 1u64 << draw(2, 6);
        let head_dim = 32 * draw(1, 4);
        let hidden = heads * head_dim;
        let kv_heads = heads >> draw(0, 2);
        configs.push((
            format!("random {i}"),
            json!({
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": hidden,
                "intermediate_size": hidden * draw(2, 4) + 64 * draw(0, 8),
                "num_hidden_layers": draw(2, 40),
                "num_attention_heads": heads,
                "num_key_value_heads": kv_heads,
                "vocab_size": 1000 * draw(1, 260),
                "tie_word_embeddings": draw(0, 1) == 1,
                "max_position_embeddings": 8192,
                "hidden_act": "silu",
            }),
        ));
    }
    configs
}

/// Jobs from a model's config.json (the hub's and random ones): every memory-saving change of
/// the setup never raises the figure, nor the bound when both answers are at one level of
/// detail; the figure never shrinks as the batch or the sequence grows.
#[tokio::test]
async fn config_jobs_obey_the_memory_saving_changes_and_grow_with_batch_and_sequence() {
    let app = Application::build(&test_config(&models_dir()))
        .await
        .expect("the application starts");
    let lora = json!({"rank": 16, "alpha": 32, "target_modules": "all-linear"});
    let qlora = json!({"rank": 16, "alpha": 32, "target_modules": "all-linear",
                       "base_weights": "nf4"});
    let fsdp = |n: u64| json!({"strategy": "fsdp", "world_size": n});
    // (what is saved, the job's fields before, the fields after)
    let changes: Vec<(&str, Value, Value)> = vec![
        ("sgd", json!({}), json!({"optimizer": "sgd"})),
        ("8-bit state", json!({}), json!({"optimizer": "adamw_8bit"})),
        (
            "factored state",
            json!({}),
            json!({"optimizer": "adafactor"}),
        ),
        (
            "checkpointing",
            json!({}),
            json!({"activation_checkpointing": "full"}),
        ),
        ("pure bf16", json!({}), json!({"precision": "bf16"})),
        // LoRA's adapters keep their own copy of each adapted input (PEFT casts it to the
        // adapters' dtype; under autocast lora_A casts it again), so on a small model at long
        // sequences LoRA can need more than full fine-tuning (docs/user/setups.md). It saves where
        // the weights' gradients and state outweigh the activations: one short sequence.
        (
            "lora",
            json!({"batch_size": 1, "seq_len": 128}),
            json!({"batch_size": 1, "seq_len": 128, "lora": lora}),
        ),
        ("qlora", json!({"lora": lora}), json!({"lora": qlora})),
        (
            "more sharding",
            json!({"parallelism": fsdp(2)}),
            json!({"parallelism": fsdp(8)}),
        ),
        ("shorter sequence", json!({}), json!({"seq_len": 256})),
        (
            "optimizer state offloaded",
            json!({}),
            json!({"offload": {"optimizer_state": true}}),
        ),
        (
            "gradients offloaded",
            json!({}),
            json!({"offload": {"gradients": true}}),
        ),
        (
            "parameters offloaded",
            json!({"parallelism": fsdp(2)}),
            json!({"offload": {"parameters": true}}),
        ),
        ("smaller batch", json!({}), json!({"batch_size": 2})),
    ];
    let configs = transformer_configs(40);
    let mut labels = Vec::new();
    let mut requests = Vec::new();
    for (name, config) in &configs {
        let job = json!({
            "transformer_config": config, "batch_size": 4, "seq_len": 512,
            "precision": "amp_bf16", "optimizer": "adamw", "gpu": "h100-80gb",
        });
        let with = |fields: &Value| {
            let mut changed = job.clone();
            for (k, v) in fields.as_object().unwrap() {
                changed[k] = v.clone();
            }
            changed
        };
        for (change, before, after) in &changes {
            labels.push(format!("{name}: {change}"));
            let before = with(before);
            let mut after_job = before.clone();
            for (k, v) in after.as_object().unwrap() {
                after_job[k] = v.clone();
            }
            requests.push(before);
            requests.push(after_job);
        }
    }
    let answers = answer(&app, &requests);
    let mut failures = Vec::new();
    for (label, pair) in labels.iter().zip(answers.chunks(2)) {
        let (before, after) = (&pair[0], &pair[1]);
        assert_holds(label, before);
        assert_holds(label, after);
        let level = |a: &EstimateResponse| a.memory.uncertainty.as_ref().unwrap().detail.clone();
        if figure(after) > figure(before) + ROUNDING_MIB {
            failures.push(format!(
                "{label}: figure {} -> {}",
                figure(before),
                figure(after)
            ));
        }
        if level(before) == level(after) && bound(after) > bound(before) + ROUNDING_MIB {
            failures.push(format!(
                "{label}: bound {} -> {}",
                bound(before),
                bound(after)
            ));
        }
    }
    // Accumulation holds every gradient through the next micro-batch: its peak is one
    // micro-batch's plus at most the gradients, never below one micro-batch's, and below the
    // whole batch's wherever the activations it saves outweigh the gradients it holds.
    let mut requests = Vec::new();
    for (_, config) in &configs {
        let job = json!({
            "transformer_config": config, "batch_size": 8, "seq_len": 512,
            "precision": "amp_bf16", "optimizer": "adamw", "gpu": "h100-80gb",
        });
        let mut accumulated = job.clone();
        accumulated["micro_batch_size"] = 2.into();
        accumulated["gradient_accumulation_steps"] = 4.into();
        let mut micro = job.clone();
        micro["batch_size"] = 2.into();
        requests.extend([job, accumulated, micro]);
    }
    let answers = answer(&app, &requests);
    let mut saving = 0;
    for ((name, _), three) in configs.iter().zip(answers.chunks(3)) {
        let (whole, accumulated, micro) = (&three[0], &three[1], &three[2]);
        let b = accumulated.memory.breakdown.as_ref().unwrap();
        let gradients = b.gradients;
        let (saved, held) = (figure(whole) - figure(micro), gradients);
        assert!(
            figure(micro) <= figure(accumulated) + ROUNDING_MIB
                && figure(accumulated) <= figure(micro) + gradients + ROUNDING_MIB,
            "{name}: micro-batch {}, accumulated {}, gradients {gradients}",
            figure(micro),
            figure(accumulated)
        );
        if saved > 2.0 * held {
            saving += 1;
            assert!(
                figure(accumulated) <= figure(whole) + ROUNDING_MIB,
                "{name}: accumulated {} above the whole batch's {}",
                figure(accumulated),
                figure(whole)
            );
        }
    }
    println!(
        "{saving} of {} accumulated jobs save activations beyond twice their gradients",
        configs.len()
    );
    assert!(saving >= 10, "{saving}");
    assert!(
        failures.is_empty(),
        "{} of {} changes raised the answer:\n{}",
        failures.len(),
        labels.len(),
        failures.join("\n")
    );
}

/// One job, one figure on every path (issue 33, item 6): GPT-2 (124 M, batch 8 x 512 tokens) as
/// `describe` prints it, answered from its simulation, from its traced saved tensors and from
/// its layers alone. Each path without the simulation is within 15 % of it, except the layer
/// list's regressor, held to within 25 % (measured +22.7 %: a regressor of vision models on a
/// language model's layers); and on the traced and layer paths each memory-saving setup
/// (autocast, checkpointing, micro-batches, LoRA) lowers the figure of the plain job.
#[tokio::test]
async fn every_path_of_one_job_agrees_with_its_simulation_and_every_saving_lowers_it() {
    let app = Application::build(&test_config(&models_dir()))
        .await
        .expect("the application starts");
    let full: Value =
        serde_json::from_str(include_str!("../fixtures/describe/gpt2_small_b8_s512.json")).unwrap();
    let without = |keys: &[&str]| {
        let mut job = full.clone();
        for key in keys {
            job.as_object_mut().unwrap().remove(*key);
        }
        job
    };
    let traced = without(&["simulation"]);
    let layers = without(&["simulation", "saved_tensors"]);
    let savings = [
        ("amp_bf16", json!({"precision": "amp_bf16"})),
        ("checkpointing", json!({"activation_checkpointing": "full"})),
        (
            "micro-batches",
            json!({"micro_batch_size": 2, "gradient_accumulation_steps": 4}),
        ),
        (
            "lora",
            json!({"lora": {"rank": 8, "target_modules": ["c_attn"]}}),
        ),
    ];
    let mut requests = vec![full.clone()];
    for base in [&traced, &layers] {
        requests.push(base.clone());
        for (_, change) in &savings {
            let mut job = base.clone();
            for (key, value) in change.as_object().unwrap() {
                job[key] = value.clone();
            }
            requests.push(job);
        }
    }
    let answers = answer(&app, &requests);
    let simulated = figure(&answers[0]);
    for (path, (plain, saved), tolerance) in [
        ("traced", (&answers[1], &answers[2..6]), 0.15),
        ("layers", (&answers[6], &answers[7..11]), 0.25),
    ] {
        let f = figure(plain);
        println!("{path}: {f} MiB against the simulation's {simulated}");
        assert!(
            (f / simulated - 1.0).abs() <= tolerance,
            "{path}: {f} MiB, the simulation {simulated}"
        );
        for ((name, _), answer) in savings.iter().zip(saved) {
            println!("  {name}: {}", figure(answer));
            assert!(
                figure(answer) < f,
                "{path} with {name}: {} MiB, plain {f}",
                figure(answer)
            );
        }
    }
}

/// What an answer says the allocator holds: the figure without the CUDA context and the cache
/// the allocator reserves beyond it (`max_memory_allocated`, what a simulation's allocated
/// peak reads).
fn allocated(a: &EstimateResponse) -> f64 {
    let b = a.memory.breakdown.as_ref().unwrap();
    figure(a) - b.cuda_context - b.allocator_cache
}

/// One job, two physics no more (issue 44): GPT-2 (batch 8 x 512 tokens, fp32 Adam) with LoRA
/// r8 on `c_attn`. describe's simulation of the step with the adapters allocates 6,513 MiB
/// against 8,222 without them (issue 44's figures): a 20.8 % saving, the optimizer state and
/// the inputs of the frozen `c_fc` and `mlp.c_proj`. Answered from the traced saved tensors
/// (no simulation), LoRA saves as much of the allocated bytes, within 15 % of that saving
/// (measured 20.9 %; 9.7 % while frozen linears still kept their inputs).
#[tokio::test]
async fn lora_saves_on_the_traced_path_what_the_simulation_saves() {
    let app = Application::build(&test_config(&models_dir()))
        .await
        .expect("the application starts");
    let mut traced: Value =
        serde_json::from_str(include_str!("../fixtures/describe/gpt2_small_b8_s512.json")).unwrap();
    traced.as_object_mut().unwrap().remove("simulation");
    let mut lora = traced.clone();
    lora["lora"] = json!({"rank": 8, "target_modules": ["c_attn"]});
    let answers = answer(&app, &[traced, lora]);
    let simulated_saving = 1.0 - 6513.0 / 8222.0;
    let saving = 1.0 - allocated(&answers[1]) / allocated(&answers[0]);
    println!(
        "traced: {:.1} -> {:.1} MiB allocated, {:.1} % saved (simulation {:.1} %)",
        allocated(&answers[0]),
        allocated(&answers[1]),
        100.0 * saving,
        100.0 * simulated_saving
    );
    assert!(
        (saving / simulated_saving - 1.0).abs() <= 0.15,
        "LoRA saves {saving:.3} on the traced path, the simulation {simulated_saving:.3}"
    );
}
