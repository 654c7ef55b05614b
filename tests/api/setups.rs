//! Training setups (docs/user/setups.md): each field moves the per-GPU figure the way the physics
//! says, combinations that cannot run are 422s naming the field, and the answer states the
//! setup it is for.

use serde_json::{json, Value};

use crate::helpers::{spawn_app, TestApp};

/// A small Llama-like decoder as `describe` lists it: embeddings, `blocks` decoder layers with
/// named q/k/v/o and gated-MLP projections (their linear shapes given), a norm and the head.
fn decoder(blocks: usize) -> Value {
    let (hidden, ffn, vocab, seq) = (1024u64, 2816u64, 32000u64, 512u64);
    let linear = |name: String, inputs: u64, outputs: u64| {
        json!({"kind": "linear", "name": name, "in_features": inputs, "out_features": outputs,
               "params": inputs * outputs, "output_size": outputs * seq})
    };
    let mut layers = vec![json!({"kind": "embedding", "name": "model.embed_tokens",
                                 "params": vocab * hidden, "output_size": hidden * seq})];
    for b in 0..blocks {
        let p = format!("model.layers.{b}");
        layers.push(
            json!({"kind": "rms_norm", "name": format!("{p}.input_layernorm"),
                           "params": hidden, "output_size": hidden * seq}),
        );
        for proj in ["q_proj", "k_proj", "v_proj"] {
            layers.push(linear(format!("{p}.self_attn.{proj}"), hidden, hidden));
        }
        layers.push(
            json!({"kind": "attention", "name": format!("{p}.self_attn"),
                           "params": 0, "output_size": hidden * seq}),
        );
        layers.push(linear(format!("{p}.self_attn.o_proj"), hidden, hidden));
        layers.push(
            json!({"kind": "rms_norm", "name": format!("{p}.post_attention_layernorm"),
                           "params": hidden, "output_size": hidden * seq}),
        );
        layers.push(linear(format!("{p}.mlp.gate_proj"), hidden, ffn));
        layers.push(linear(format!("{p}.mlp.up_proj"), hidden, ffn));
        layers.push(json!({"kind": "silu", "name": format!("{p}.mlp.act_fn"),
                           "params": 0, "output_size": ffn * seq}));
        layers.push(linear(format!("{p}.mlp.down_proj"), ffn, hidden));
    }
    layers.push(
        json!({"kind": "rms_norm", "name": "model.norm", "params": hidden,
                       "output_size": hidden * seq}),
    );
    layers.push(linear("lm_head".into(), hidden, vocab));
    json!({"family": "transformer", "batch_size": 8, "optimizer": "adamw",
           "precision": "fp32", "layers": layers})
}

fn with(mut job: Value, fields: Value) -> Value {
    for (key, value) in fields.as_object().unwrap() {
        job[key] = value.clone();
    }
    job
}

pub(crate) async fn answer(app: &TestApp, job: &Value) -> Value {
    let response = app.post_json("/v1/estimate", job).await;
    let status = response.status();
    let body: Value = response.json().await.unwrap();
    assert_eq!(status, 200, "{body}");
    body
}

fn figure(body: &Value) -> f64 {
    body["memory"]["estimate_mib"].as_f64().unwrap()
}

fn part(body: &Value, category: &str) -> f64 {
    body["memory"]["breakdown"][category].as_f64().unwrap()
}

#[tokio::test]
async fn a_lora_job_trains_only_its_adapters_and_physics_answers_it_alone() {
    let app = spawn_app().await;
    let full = answer(&app, &decoder(4)).await;
    assert_eq!(full["setup"]["learned_estimators_apply"], true);
    let lora = answer(
        &app,
        &with(
            decoder(4),
            json!({"precision": "bf16", "estimators": "all",
                   "lora": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]}}),
        ),
    )
    .await;
    // r x (in + out) per target: 2 targets x 4 blocks x 16 x (1024 + 1024).
    assert_eq!(lora["setup"]["lora_params"], 2 * 4 * 16 * 2048);
    assert_eq!(lora["setup"]["trainable_params"], 2 * 4 * 16 * 2048);
    assert_eq!(lora["setup"]["learned_estimators_apply"], false);
    assert_eq!(lora["memory"]["breakdown_source"], "training_step");
    assert!(lora["memory"]["estimators"]["training_step"].is_object());
    assert!(
        lora["warnings"].as_array().unwrap().iter().any(|w| w
            .as_str()
            .unwrap()
            .starts_with("learned estimators left out")),
        "{}",
        lora["warnings"]
    );
    // Frozen bf16 weights, fp32 adapters: gradients and state are the adapters' alone.
    let adapters_mib = (2 * 4 * 16 * 2048) as f64 * 4.0 / 1048576.0;
    assert!(
        part(&lora, "optimizer_state") <= 2.0 * adapters_mib + 0.1,
        "{lora}"
    );
    assert!(part(&lora, "gradients") <= adapters_mib + 0.1);
    assert!(figure(&lora) < figure(&full));
    // LoRA dropout keeps each adapted layer's mask beside the dropped input lora_A keeps in
    // fp32 (in place of the fp32 cast it keeps without dropout): 2 targets x 4 blocks x 8
    // samples x 512 positions x 1024 inputs x 1 byte.
    let dropped = answer(
        &app,
        &with(
            decoder(4),
            json!({"precision": "bf16", "lora": {"rank": 16, "dropout": 0.05,
                   "target_modules": ["q_proj", "v_proj"]}}),
        ),
    )
    .await;
    // Both carry the one correction the regressor's answer of their plain base puts on the
    // step's activations (memory.base_correction).
    let correction = lora["memory"]["base_correction"].as_f64().unwrap_or(1.0);
    assert_eq!(
        dropped["memory"]["base_correction"],
        lora["memory"]["base_correction"]
    );
    let kept_mib = (2 * 4 * 8 * 512 * 1024) as f64 / 1048576.0 * correction;
    let added = part(&dropped, "activations") - part(&lora, "activations");
    assert!(
        (added - kept_mib).abs() < 0.2,
        "{added} MiB added, {kept_mib} expected"
    );
    // QLoRA's 4-bit base: every linear weight but the head in 4.127 bits instead of 16.
    let qlora = answer(
        &app,
        &with(
            decoder(4),
            json!({"precision": "bf16",
                   "lora": {"rank": 16, "target_modules": "all-linear", "base_weights": "nf4"}}),
        ),
    )
    .await;
    let block_linear = 4.0 * (4.0 * 1024.0 * 1024.0 + 3.0 * 1024.0 * 2816.0);
    let saved_mib = block_linear * (2.0 - 4.127 / 8.0) / 1048576.0;
    // Its adapters (fp32) on all seven projections: 4 of 1024 -> 1024, 3 of 1024 <-> 2816.
    let adapters = 4 * 16 * (4 * 2048 + 3 * 3840);
    assert_eq!(qlora["setup"]["lora_params"], adapters);
    let adapters_added = adapters as f64 * 4.0 / 1048576.0;
    let saving = part(&lora, "parameters") - part(&qlora, "parameters") + adapters_added;
    assert!(
        (saving / saved_mib - 1.0).abs() < 0.05,
        "{saving} MiB saved, {saved_mib} expected"
    );
}

#[tokio::test]
async fn each_setup_moves_the_per_gpu_figure_the_way_physics_says() {
    let app = spawn_app().await;
    let base = with(decoder(6), json!({"precision": "amp_bf16"}));
    let plain = answer(&app, &base).await;
    let at = |fields: Value| {
        let job = with(base.clone(), fields);
        let app = &app;
        async move { answer(app, &job).await }
    };
    // Pure bf16 halves weights and gradients against autocast's fp32 masters.
    let pure = at(json!({"precision": "bf16"})).await;
    assert!(part(&pure, "parameters") < 0.5 * part(&plain, "parameters") + 1.0);
    // Checkpointing every block keeps block inputs and one block's activations.
    let unchecked = at(
        json!({"activation_checkpointing": "none", "gradient_accumulation_steps": 1,
                              "optimizer_implementation": "fused"}),
    )
    .await;
    let checkpointed = at(json!({"activation_checkpointing": "full",
                                 "optimizer_implementation": "fused"}))
    .await;
    assert!(
        part(&checkpointed, "activations") < 0.5 * part(&unchecked, "activations"),
        "{} vs {}",
        part(&checkpointed, "activations"),
        part(&unchecked, "activations")
    );
    // Accumulating 4 micro-batches of 2: a quarter of the activations, gradients kept.
    let accumulated = at(json!({"gradient_accumulation_steps": 4})).await;
    assert_eq!(accumulated["setup"]["micro_batch_size"], 2);
    assert!(figure(&accumulated) < figure(&plain));
    // 8-bit Adam: about a quarter of Adam's fp32 state.
    let adam8 = at(json!({"optimizer": "adamw_8bit"})).await;
    let ratio = part(&adam8, "optimizer_state") / part(&plain, "optimizer_state");
    assert!((0.2..0.3).contains(&ratio), "8-bit / fp32 state {ratio}");
    // A paged optimizer's state is on the device, not in PyTorch's allocator.
    let paged = at(json!({"optimizer": "paged_adamw_8bit"})).await;
    assert_eq!(part(&paged, "optimizer_state"), 0.0);
    let paged_state = part(&paged, "paged_optimizer_state");
    assert!((paged_state / part(&adam8, "optimizer_state") - 1.0).abs() < 0.01);
    // FSDP across 8 GPUs: an eighth of the model state per GPU plus the gathered units.
    let fsdp = at(json!({"parallelism": {"strategy": "fsdp", "world_size": 8}})).await;
    assert!(part(&fsdp, "optimizer_state") < 0.13 * part(&plain, "optimizer_state"));
    assert!(part(&fsdp, "collective_buffers") > 0.0);
    assert_eq!(fsdp["setup"]["parallelism"]["data_parallel"], 8);
    // DDP keeps a bucketed copy of the gradients beside them.
    let ddp = at(json!({"parallelism": {"strategy": "ddp", "world_size": 8}})).await;
    assert!(figure(&ddp) > figure(&plain));
    // Tensor parallel over 4: a quarter of the weights.
    let tp = at(json!({"parallelism": {"tensor_parallel": 4}})).await;
    assert!(part(&tp, "parameters") < 0.26 * part(&plain, "parameters"));
    assert_eq!(tp["setup"]["parallelism"]["world_size"], 4);
    assert_eq!(tp["setup"]["parallelism"]["sequence_parallel"], false);
    // Without sequence parallelism every rank keeps the norms' and first linears' inputs
    // whole: more than a quarter of the activations; with it, a quarter.
    let sp = at(json!({"parallelism": {"tensor_parallel": 4, "sequence_parallel": true}})).await;
    let quarter = part(&plain, "activations") / 4.0;
    assert!((part(&sp, "activations") / quarter - 1.0).abs() < 0.02);
    assert!(part(&tp, "activations") > 1.3 * quarter);
    assert!(part(&tp, "activations") < 0.6 * part(&plain, "activations"));
    // A pipeline's answer says which stage's peak it is.
    let pp = at(json!({"parallelism": {"pipeline_parallel": 2}})).await;
    let warnings = pp["warnings"].to_string();
    assert!(
        warnings.contains("first of 2 pipeline stages"),
        "{warnings}"
    );
    assert!(!plain["warnings"].to_string().contains("pipeline stages"));
}

#[tokio::test]
async fn impossible_setups_are_refused_naming_the_field() {
    let app = spawn_app().await;
    let cases = [
        (
            json!({"lora": {"rank": 2048, "target_modules": ["q_proj"]}}),
            "lora.rank",
        ),
        (
            json!({"lora": {"rank": 8, "target_modules": ["query_key_value"]}}),
            "lora.target_modules",
        ),
        (
            json!({"lora": {"rank": 8, "target_modules": ["input_layernorm"]}}),
            "lora.target_modules",
        ),
        (
            json!({"activation_checkpointing": ["model.layers.99"]}),
            "activation_checkpointing",
        ),
        (
            json!({"trainable": {"params": 1u64 << 40}}),
            "trainable.params",
        ),
        (
            json!({"trainable": {"modules": ["classifier"]}}),
            "trainable.modules",
        ),
        (
            json!({"parallelism": {"strategy": "ddp", "world_size": 0}}),
            "parallelism.world_size",
        ),
        (
            json!({"parallelism": {"strategy": "zero3"}}),
            "parallelism.world_size",
        ),
        (
            json!({"parallelism": {"strategy": "fsdp", "world_size": 6, "tensor_parallel": 4}}),
            "parallelism.world_size",
        ),
        (json!({"micro_batch_size": 3}), "micro_batch_size"),
        // Hostile sizes: every list, name and degree is bounded.
        (
            json!({"activation_checkpointing": vec!["model.layers.0"; 257]}),
            "activation_checkpointing",
        ),
        (
            json!({"trainable": {"modules": ["x".repeat(257)]}}),
            "trainable.modules",
        ),
        (
            json!({"parallelism": {"strategy": "ddp", "world_size": 1u64 << 40}}),
            "parallelism.world_size",
        ),
        (
            json!({"parallelism": {"tensor_parallel": 1u64 << 21}}),
            "parallelism.tensor_parallel",
        ),
        (
            json!({"gradient_accumulation_steps": 1u64 << 21}),
            "gradient_accumulation_steps",
        ),
        (
            json!({"lora": {"rank": 1u64 << 17, "target_modules": ["q_proj"]}}),
            "lora.rank",
        ),
        (
            json!({"lora": {"rank": 8, "dropout": 1.5, "target_modules": ["q_proj"]}}),
            "lora.dropout",
        ),
        (json!({"precision": "fp8"}), "precision"),
        (json!({"optimizer": "lion"}), "optimizer"),
        (
            json!({"optimizer": "adamw_8bit", "optimizer_implementation": "for_loop"}),
            "optimizer_implementation",
        ),
    ];
    for (fields, field) in cases {
        let response = app
            .post_json("/v1/estimate", &with(decoder(2), fields.clone()))
            .await;
        assert_eq!(response.status(), 422, "{fields}");
        let body: Value = response.json().await.unwrap();
        let detail = body["detail"].as_str().unwrap();
        assert!(
            detail.starts_with(&format!("{field}:")),
            "{fields}: {detail}"
        );
    }
    // Layers without names cannot be matched by name.
    let mut unnamed = decoder(2);
    for layer in unnamed["layers"].as_array_mut().unwrap() {
        layer.as_object_mut().unwrap().remove("name");
    }
    let response = app
        .post_json(
            "/v1/estimate",
            &with(unnamed, json!({"activation_checkpointing": "full"})),
        )
        .await;
    assert_eq!(response.status(), 422);
}

#[tokio::test]
async fn a_simulation_of_another_setup_is_refused_and_one_of_the_same_is_sharded() {
    let app = spawn_app().await;
    let simulation = json!({"batch_size": 2, "optimizer": "adamw", "precision": "amp_bf16",
        "gradient_accumulation_steps": 4, "activation_checkpointing": "full",
        "allocated_peak_bytes": 6_000_000_000u64, "reserved_peak_bytes": 6_400_000_000u64,
        "min_capacity_bytes": 6_100_000_000u64,
        "breakdown_at_peak": {"parameters": 2_000_000_000u64, "gradients": 1_000_000_000u64,
            "optimizer_state": 2_000_000_000u64, "activations": 900_000_000u64,
            "temporaries": 100_000_000u64}});
    let job = with(
        decoder(2),
        json!({"precision": "amp_bf16", "gradient_accumulation_steps": 4,
               "activation_checkpointing": "full", "simulation": simulation}),
    );
    let one = answer(&app, &job).await;
    assert_eq!(one["memory"]["breakdown_source"], "simulation");
    let sharded = answer(
        &app,
        &with(
            job.clone(),
            json!({"parallelism": {"strategy": "zero3", "world_size": 4}}),
        ),
    )
    .await;
    assert!(part(&sharded, "optimizer_state") < 0.26 * part(&one, "optimizer_state") + 0.1);
    assert!(part(&sharded, "collective_buffers") > 0.0);
    assert!(figure(&sharded) < figure(&one));
    // The same simulation for a job that does not accumulate describes another job.
    let other = with(
        job,
        json!({"gradient_accumulation_steps": 1, "micro_batch_size": 8}),
    );
    let response = app.post_json("/v1/estimate", &other).await;
    assert_eq!(response.status(), 422);
}

/// The analytic training step against describe's simulations of the same steps: the 631 timm
/// training models at batch 8 and 128 (fp32, Adam; data/timm/simulations.jsonl.gz), allocated
/// peak to allocated peak. Physics against physics: the analytic step answers the jobs that
/// carry no simulation, so it must agree with one where both exist.
#[test]
fn the_analytic_step_agrees_with_the_simulated_steps_of_the_timm_models() {
    use gpucast::api::types::EstimateRequest;
    use gpucast::engine::validate::to_job;
    use gpucast::physics::step::analytic_step;
    use std::io::BufRead;
    let read = |path: &str| -> Vec<Value> {
        let file = std::fs::File::open(crate::helpers::repo_root().join(path)).unwrap();
        std::io::BufReader::new(flate2::read::GzDecoder::new(file))
            .lines()
            .map(|line| serde_json::from_str(&line.unwrap()).unwrap())
            .collect()
    };
    let simulations: std::collections::HashMap<String, Value> =
        read("data/timm/simulations.jsonl.gz")
            .into_iter()
            .map(|s| {
                (
                    s["model"].as_str().unwrap().to_string(),
                    s["simulations"].clone(),
                )
            })
            .collect();
    let mut ratios = Vec::new();
    for description in read("data/timm/descriptions.jsonl.gz") {
        let Some(simulated) = simulations.get(description["model"].as_str().unwrap()) else {
            continue;
        };
        for batch in ["8", "128"] {
            let simulation = &simulated[batch];
            if simulation.is_null() || simulation["interpolated"] == true {
                continue;
            }
            let mut body = description.clone();
            body["batch_size"] = simulation["batch_size"].clone();
            let request: EstimateRequest = serde_json::from_value(body).unwrap();
            let job = to_job(&request).unwrap();
            let analytic = analytic_step(&job).allocated();
            ratios.push(analytic / simulation["allocated_peak_bytes"].as_f64().unwrap());
        }
    }
    ratios.sort_by(f64::total_cmp);
    let at = |q: f64| ratios[((ratios.len() - 1) as f64 * q) as usize];
    println!(
        "analytic / simulated allocated peak, {} steps: p10 {:.3} median {:.3} p90 {:.3}",
        ratios.len(),
        at(0.1),
        at(0.5),
        at(0.9)
    );
    assert!(ratios.len() > 1000);
    assert!((0.9..1.1).contains(&at(0.5)), "median {}", at(0.5));
}

/// Mixtral-8x7B under a 4-bit base (issue 44): bitsandbytes and GPTQ quantise every expert's
/// linears where each is an `nn.Linear` (transformers 4, assumed unless stated), so the weights
/// are about a quarter of the bf16 ones plus what stays in 16 bits (embeddings, head, norms);
/// stated `fused` (transformers 5's 3D experts, left as loaded) they are not. The assumed
/// layout is said and listed with what the other would answer.
#[tokio::test]
async fn a_quantised_base_quantises_each_experts_linears_as_the_layout_says() {
    let app = spawn_app().await;
    let config: Value = serde_json::from_str(include_str!(
        "../fixtures/transformer_configs/moe/mistralai__Mixtral-8x7B-v0.1.json"
    ))
    .unwrap();
    let job = |base: &str, layout: Option<&str>| {
        let mut lora = json!({"rank": 16, "alpha": 32, "dropout": 0.05,
                              "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                              "base_weights": base});
        if let Some(layout) = layout {
            lora["expert_layout"] = json!(layout);
        }
        json!({"transformer_config": config, "seq_len": 4096, "batch_size": 1,
               "precision": "bf16", "optimizer": "paged_adamw_8bit",
               "activation_checkpointing": "full", "gpu": "a100-80gb", "lora": lora})
    };
    let bf16 = answer(&app, &job("same", None)).await;
    let nf4 = answer(&app, &job("nf4", None)).await;
    let gptq = answer(&app, &job("gptq_int4", None)).await;
    let fused = answer(&app, &job("nf4", Some("fused"))).await;
    // 46.4 G of the 46.7 G parameters are in linear layers; embeddings and head, 0.26 G, stay.
    let (whole, kept) = (part(&bf16, "parameters"), 2.0 * 262_144_000.0 / 1048576.0);
    let quarter = (whole - kept) * 4.127 / 16.0 + kept;
    for answer in [&nf4, &gptq] {
        let parameters = part(answer, "parameters");
        assert!(
            (parameters / quarter - 1.0).abs() < 0.03,
            "{parameters} MiB of weights, about {quarter} expected of {whole}"
        );
        assert_eq!(
            answer["memory"]["uncertainty"]["assumed"][0]["field"], "lora.expert_layout",
            "{answer}"
        );
        assert!(answer["warnings"].as_array().unwrap().iter().any(|w| w
            .as_str()
            .unwrap()
            .starts_with("lora.expert_layout: not given; per_expert_linear assumed")));
    }
    // Fused experts stay in 16 bits: all but the attention's quantised linears.
    assert!(part(&fused, "parameters") > 0.95 * whole, "{fused}");
    assert!(fused["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .all(|w| !w.as_str().unwrap().starts_with("lora.expert_layout")));
    // One A100 80GB: the published setup's peak is 30-35 GiB allocated.
    let figure = figure(&nf4);
    assert!((29_000.0..36_000.0).contains(&figure), "{figure} MiB");
}
