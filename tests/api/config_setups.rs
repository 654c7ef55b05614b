//! Training setups of jobs from a Hugging Face `config.json` (docs/user/setups.md), through the
//! API: offload, LoRA's adapted inputs, ZeRO-3's buffers, modules_to_save, master copies, the
//! loss over the vocabulary, tied heads, frozen prefixes, quantised bases, reward heads and
//! reference models, multimodal configs.

use serde_json::{json, Value};

use crate::helpers::spawn_app;
use crate::transformer_config::config;

/// CPU offload through the one step: the optimizer's state leaves the GPU; offloaded
/// parameters leave only the gathered units (and take gradients and state along); the setup
/// says what was understood; what cannot be offloaded, or simulated with offload, is a 422
/// naming the field.
#[tokio::test]
async fn offload_moves_state_gradients_and_weights_off_the_gpu() {
    let app = spawn_app().await;
    let config = config("public/meta-llama__Llama-2-7b-hf");
    let job = |extra: Value| {
        let mut job = json!({"transformer_config": config, "batch_size": 1, "seq_len": 1024,
                             "precision": "bf16", "optimizer": "adamw", "gpu": "a100-80gb",
                             "parallelism": {"strategy": "fsdp", "world_size": 2}});
        for (k, v) in extra.as_object().unwrap() {
            job[k] = v.clone();
        }
        job
    };
    let breakdown = |answer: &Value, k: &str| answer["memory"]["breakdown"][k].as_f64().unwrap();
    let plain: Value = app.post_json_value("/v1/estimate", &job(json!({}))).await;
    let state: Value = app
        .post_json_value(
            "/v1/estimate",
            &job(json!({"offload": {"optimizer_state": true}})),
        )
        .await;
    let params: Value = app
        .post_json_value(
            "/v1/estimate",
            &job(json!({"offload": {"parameters": true}})),
        )
        .await;
    assert!(breakdown(&plain, "optimizer_state") > 1000.0, "{plain}");
    assert_eq!(breakdown(&state, "optimizer_state"), 0.0, "{state}");
    assert_eq!(breakdown(&params, "parameters"), 0.0, "{params}");
    assert!(breakdown(&params, "collective_buffers") > 0.0, "{params}");
    let figure = |a: &Value| a["memory"]["estimate_mib"].as_f64().unwrap();
    assert!(figure(&params) < figure(&state) && figure(&state) < figure(&plain));
    let offload = &params["setup"]["offload"];
    for flag in ["optimizer_state", "gradients", "parameters"] {
        assert_eq!(offload[flag], true, "{offload}");
    }
    // On the host, each rank's shard: FSDP keeps the gradients in the weights' dtype (bf16,
    // as the weights), Adam's two bf16 moments twice that.
    let host = &offload["host_breakdown"];
    let mib = |k: &str| host[k].as_f64().unwrap();
    assert!(
        (mib("gradients") - mib("parameters")).abs() < 0.2,
        "{offload}"
    );
    assert!(
        (mib("optimizer_state") - 2.0 * mib("parameters")).abs() < 0.2,
        "{offload}"
    );
    for (extra, field) in [
        (
            json!({"offload": {"parameters": true}, "parallelism": {"strategy": "ddp", "world_size": 2}}),
            "offload.parameters",
        ),
        (
            json!({"offload": {"parameters": true, "gradients": false}}),
            "offload.parameters",
        ),
    ] {
        let response = app.post_json("/v1/estimate", &job(extra)).await;
        assert_eq!(response.status(), 422);
        let problem: Value = response.json().await.unwrap();
        assert!(
            problem["detail"].as_str().unwrap().starts_with(field),
            "{problem}"
        );
    }
}

/// PEFT casts each adapted layer's input to the adapters' dtype and lora_A keeps it: adding
/// k_proj to the targets of Llama-2-7B (32 layers, 4,096 inputs, 512 tokens) keeps a new fp32
/// copy under pure bf16 (256 MiB), lora_A's own bf16 cast under autocast (128 MiB), and
/// nothing new in fp32, where lora_A reads the base layer's own input.
#[tokio::test]
async fn lora_keeps_each_adapted_input_in_the_adapters_dtype() {
    let app = spawn_app().await;
    let config = config("public/meta-llama__Llama-2-7b-hf");
    for (precision, expected) in [("bf16", 256.0), ("amp_bf16", 128.0), ("fp32", 0.0)] {
        let mut activations = Vec::new();
        for targets in [json!(["q_proj"]), json!(["q_proj", "k_proj"])] {
            let job = json!({"transformer_config": config, "batch_size": 1, "seq_len": 512,
                             "precision": precision, "optimizer": "adamw", "gpu": "h200",
                             "lora": {"rank": 16, "target_modules": targets}});
            let answer: Value = app.post_json_value("/v1/estimate", &job).await;
            assert_eq!(
                answer["memory"]["peak_moment"], "backward_start",
                "{answer}"
            );
            activations.push(
                answer["memory"]["breakdown"]["activations"]
                    .as_f64()
                    .unwrap(),
            );
        }
        let added = activations[1] - activations[0];
        assert!((added - expected).abs() < 0.5, "{precision}: {added}");
    }
}

/// DeepSpeed ZeRO-3 at its defaults keeps gathered every parameter reused within half its
/// `stage3_max_reuse_distance` (1e9) plus the prefetch bucket (5e7), and allocates its contiguous
/// gradient bucket (`reduce_bucket_size`, 5e8 elements of the parameters' dtype) whole; FSDP
/// gathers two units. A model smaller than the window keeps no more than all its parameters.
#[tokio::test]
async fn zero3_keeps_its_reuse_window_gathered_and_its_gradient_bucket_whole() {
    let app = spawn_app().await;
    let answer = |config: &Value, strategy: &str| {
        let job = json!({"transformer_config": config, "batch_size": 1, "seq_len": 512,
                         "precision": "bf16", "optimizer": "adamw", "gpu": "a100-80gb",
                         "parallelism": {"strategy": strategy, "world_size": 8},
                         "offload": {"parameters": true}});
        let app = &app;
        async move { app.post_json_value("/v1/estimate", &job).await }
    };
    let collective = |a: &Value| {
        a["memory"]["breakdown"]["collective_buffers"]
            .as_f64()
            .unwrap()
    };
    let mib = |bytes: f64| bytes / 1048576.0;
    let llama = config("public/meta-llama__Llama-2-7b-hf");
    let zero3 = collective(&answer(&llama, "zero3").await);
    let fsdp = collective(&answer(&llama, "fsdp").await);
    let window = mib((0.5e9 + 5e7) * 2.0 + 5e8 * 2.0);
    // DeepSpeed's default window and buckets, within what the reuse-distance walk adds
    // (a layer's gather beyond the window, issue 44's ZeRO-3 model).
    assert!((zero3 / window - 1.0).abs() < 0.01, "{zero3} vs {window}");
    // FSDP's two gathered blocks of Llama-2-7B (202M parameters each) and one block's fp32
    // gradients.
    assert!(fsdp < zero3 - 400.0, "{fsdp} vs {zero3}");
    let small = answer(&config("gpt2"), "zero3").await;
    let params = small["setup"]["trainable_params"].as_f64().unwrap();
    assert!(params < 0.1e9, "{params}");
    // A model smaller than the window: every parameter gathered, beside the whole bucket.
    let expected = mib(params * 2.0 + 5e8 * 2.0);
    assert!(
        (collective(&small) - expected).abs() < 1.0,
        "{} vs {expected}",
        collective(&small)
    );
}

/// PEFT's modules_to_save: the embeddings and the head get trained copies beside their frozen
/// originals, each with gradients and optimizer state: the trainable count grows by their
/// parameters, and the figure by at least copy + gradients + Adam state of them; a name that
/// names no layer is a 422.
#[tokio::test]
async fn modules_to_save_add_trained_copies_with_gradients_and_state() {
    let app = spawn_app().await;
    let config = config("public/meta-llama__Llama-2-7b-hf");
    let job = |saved: Option<Value>| {
        let mut lora = json!({"rank": 16, "target_modules": "all-linear"});
        if let Some(saved) = saved {
            lora["modules_to_save"] = saved;
        }
        json!({"transformer_config": config, "batch_size": 1, "seq_len": 512,
               "precision": "bf16", "optimizer": "adamw", "gpu": "a100-80gb", "lora": lora})
    };
    let plain: Value = app.post_json_value("/v1/estimate", &job(None)).await;
    let saved: Value = app
        .post_json_value(
            "/v1/estimate",
            &job(Some(json!(["embed_tokens", "lm_head"]))),
        )
        .await;
    let trainable = |a: &Value| a["setup"]["trainable_params"].as_f64().unwrap();
    // Llama-2-7B: 32,000 x 4,096 in the embeddings and again in the head.
    let copied = 2.0 * 32_000.0 * 4_096.0;
    assert!(
        (trainable(&saved) - trainable(&plain) - copied).abs() < 1.0,
        "{}",
        saved["setup"]
    );
    let figure = |a: &Value| a["memory"]["estimate_mib"].as_f64().unwrap();
    // Whichever moment peaks holds the bf16 copy and its two bf16 Adam moments (6 bytes a
    // parameter); the optimizer's step holds their gradients too.
    let at_least = copied * 6.0 / 1_048_576.0;
    assert!(
        figure(&saved) - figure(&plain) >= 0.95 * at_least,
        "{} -> {}",
        figure(&plain),
        figure(&saved)
    );
    // A head tied to the embeddings (Llama-3.2-1B) still gets its own trained copy of the
    // whole 128,256 x 2,048 weight (PEFT's default `ensure_weight_tying=False`): named alone,
    // and beside the embeddings' copy.
    let tied = self::config("public/meta-llama__Llama-3.2-1B");
    let tied_job = |saved: Option<Value>| {
        let mut job = job(saved);
        job["transformer_config"] = tied.clone();
        job
    };
    let tied_plain = trainable(&app.post_json_value("/v1/estimate", &tied_job(None)).await);
    let head = 128_256.0 * 2_048.0;
    for (saved, copies) in [
        (json!(["lm_head"]), 1.0),
        (json!(["embed_tokens", "lm_head"]), 2.0),
    ] {
        let answer: Value = app
            .post_json_value("/v1/estimate", &tied_job(Some(saved.clone())))
            .await;
        assert_eq!(
            trainable(&answer) - tied_plain,
            copies * head,
            "{saved}: {}",
            answer["setup"]
        );
    }
    let response = app
        .post_json("/v1/estimate", &job(Some(json!(["no_such_module"]))))
        .await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .starts_with("lora.modules_to_save"),
        "{problem}"
    );
}

/// DeepSpeed's bf16 mode: 16-bit weights and gradients on every rank, an fp32 master copy with
/// the fp32 Adam state, both sharded by ZeRO. Against the same job under amp_bf16 (fp32
/// weights and gradients everywhere), the ZeRO-2 figure falls; against pure bf16 (no master),
/// it rises by the master's share; an fp32 master beside fp32 weights is a 422.
#[tokio::test]
async fn an_fp32_master_goes_with_the_sharded_optimizer_state() {
    let app = spawn_app().await;
    let config = config("public/meta-llama__Llama-3.2-1B");
    let job = |precision: &str, master: Option<&str>| {
        let mut job = json!({"transformer_config": config, "batch_size": 4, "seq_len": 512,
                             "precision": precision, "optimizer": "adamw", "gpu": "a100-80gb",
                             "parallelism": {"strategy": "zero2", "world_size": 8}});
        if let Some(m) = master {
            job["master_weights"] = m.into();
        }
        job
    };
    let figure = |a: &Value| a["memory"]["estimate_mib"].as_f64().unwrap();
    let state = |a: &Value| {
        a["memory"]["breakdown"]["optimizer_state"]
            .as_f64()
            .unwrap()
    };
    let amp: Value = app
        .post_json_value("/v1/estimate", &job("amp_bf16", None))
        .await;
    let pure: Value = app
        .post_json_value("/v1/estimate", &job("bf16", None))
        .await;
    let master: Value = app
        .post_json_value("/v1/estimate", &job("bf16", Some("fp32")))
        .await;
    assert_eq!(master["setup"]["master_weights"], "fp32");
    assert!(
        figure(&master) < figure(&amp),
        "{} vs {}",
        figure(&master),
        figure(&amp)
    );
    assert!(figure(&master) > figure(&pure));
    // Adam's two moments in fp32 and the master: 12 bytes a parameter over 8 ranks, against
    // pure bf16's 4 bytes over 8: three times the state.
    assert!(
        (state(&master) / state(&pure) - 3.0).abs() < 0.01,
        "{} vs {}",
        state(&master),
        state(&pure)
    );
    let response = app
        .post_json("/v1/estimate", &job("amp_bf16", Some("fp32")))
        .await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .starts_with("master_weights"),
        "{problem}"
    );
}

/// The loss over a large vocabulary as the libraries take it: Llama-3's 128k vocabulary at
/// 2 x 8,192 tokens. Hugging Face's upcast loss (the default, named in a warning) starts
/// backward with the fp32 gradients of the whole logits; chunked (litgpt, torchtune) frees
/// as it goes but holds the 16-bit logits to its end; fused (Liger) never keeps them. Each saves memory over the one before, by at
/// least the logits' fp32 gradient; the setup says which was counted.
#[tokio::test]
async fn the_loss_over_a_large_vocabulary_follows_its_implementation() {
    let app = spawn_app().await;
    let config = config("public/meta-llama__Meta-Llama-3-8B");
    let job = |loss: Option<&str>| {
        let mut job = json!({"transformer_config": config, "batch_size": 2, "seq_len": 8192,
                             "precision": "bf16", "optimizer": "adamw", "gpu": "h100-80gb",
                             "activation_checkpointing": "full",
                             "lora": {"rank": 16, "target_modules": "all-linear"}});
        if let Some(loss) = loss {
            job["loss_implementation"] = loss.into();
        }
        job
    };
    let upcast: Value = app.post_json_value("/v1/estimate", &job(None)).await;
    let chunked: Value = app
        .post_json_value("/v1/estimate", &job(Some("chunked")))
        .await;
    let fused: Value = app
        .post_json_value("/v1/estimate", &job(Some("fused")))
        .await;
    assert_eq!(upcast["setup"]["loss_implementation"], "upcast_fp32");
    assert_eq!(fused["setup"]["loss_implementation"], "fused");
    assert!(upcast["warnings"]
        .to_string()
        .contains("loss_implementation"));
    let figure = |a: &Value| a["memory"]["estimate_mib"].as_f64().unwrap();
    // 2 x 8,192 tokens x 128,256 classes x 4 bytes: 8,016 MiB of fp32 logits.
    let logits_fp32 = 2.0 * 8192.0 * 128_256.0 * 4.0 / 1_048_576.0;
    assert!(
        figure(&upcast) - figure(&chunked) >= logits_fp32,
        "{} -> {}",
        figure(&upcast),
        figure(&chunked)
    );
    assert!(figure(&chunked) > figure(&fused));
    // torchtune's chunked loss holds the list of every chunk's bf16 logits until it returns,
    // and one chunk's fp32 upcast (of 8) beside them: 2.5 bytes a class and token over the
    // fused loss's temporaries.
    let temporaries = |a: &Value| a["memory"]["breakdown"]["temporaries"].as_f64().unwrap();
    let held = logits_fp32 / 4.0 * 2.5;
    assert!(
        (temporaries(&chunked) - temporaries(&fused) - held).abs() < 1.0,
        "{} - {} vs {held}",
        temporaries(&chunked),
        temporaries(&fused)
    );
    let response = app
        .post_json("/v1/estimate", &json!({"batch_size": 8, "layers": [{"kind": "linear", "output_size": 10, "params": 110}], "loss_implementation": "fused"}))
        .await;
    assert_eq!(response.status(), 422);
    let response = app.post_json("/v1/estimate", &job(Some("sideways"))).await;
    assert_eq!(response.status(), 422);
}

/// A head tied to the embeddings (Llama-3.2-1B) shares their weight: naming it trainable
/// trains that weight, as naming the embeddings does (262,668,288 parameters, their gradients
/// and state), not nothing.
#[tokio::test]
async fn a_trainable_tied_head_trains_the_weight_it_shares_with_the_embeddings() {
    let app = spawn_app().await;
    let config = config("public/meta-llama__Llama-3.2-1B");
    let job = |modules: &[&str]| {
        json!({"transformer_config": config, "batch_size": 4, "seq_len": 1024,
               "precision": "bf16", "optimizer": "adamw", "trainable": {"modules": modules}})
    };
    let head = app
        .post_json_value("/v1/estimate", &job(&["lm_head"]))
        .await;
    let embeddings = app
        .post_json_value("/v1/estimate", &job(&["model.embed_tokens"]))
        .await;
    assert_eq!(head["setup"]["trainable_params"], 262_668_288.0);
    for key in ["gradients", "optimizer_state"] {
        assert_eq!(
            head["memory"]["breakdown"][key], embeddings["memory"]["breakdown"][key],
            "{key}"
        );
    }
    assert_eq!(
        head["memory"]["estimate_mib"],
        embeddings["memory"]["estimate_mib"]
    );
}

/// Freeze tuning: autograd records nothing before the first parameter that trains, so training
/// only the last two of Llama-3.2-1B's 16 blocks keeps two blocks' activations (and what
/// follows them), not sixteen; a trained tied head trains the embeddings' weight, after which
/// every block records again.
#[tokio::test]
async fn layers_before_the_first_trainable_one_keep_no_activations() {
    let app = spawn_app().await;
    let config = config("public/meta-llama__Llama-3.2-1B");
    let job = |modules: &[&str]| {
        json!({"transformer_config": config, "batch_size": 4, "seq_len": 1024,
               "precision": "bf16", "optimizer": "adamw", "trainable": {"modules": modules}})
    };
    let activations = |a: &Value| a["memory"]["breakdown"]["activations"].as_f64().unwrap();
    let full = app
        .post_json_value(
            "/v1/estimate",
            &json!({"transformer_config": config,
        "batch_size": 4, "seq_len": 1024, "precision": "bf16", "optimizer": "adamw"}),
        )
        .await;
    let last_two = app
        .post_json_value(
            "/v1/estimate",
            &job(&["model.layers.14", "model.layers.15", "model.norm"]),
        )
        .await;
    let with_head = app
        .post_json_value(
            "/v1/estimate",
            &job(&["model.layers.14", "model.layers.15", "lm_head"]),
        )
        .await;
    // The 14 frozen blocks' share of what full training keeps, less the head and loss.
    let per_block = (activations(&full) - activations(&last_two)) / 14.0;
    assert!(
        per_block > 0.0,
        "{} vs {}",
        activations(&full),
        activations(&last_two)
    );
    assert!(
        activations(&last_two) < 0.5 * activations(&full),
        "{} of {}",
        activations(&last_two),
        activations(&full)
    );
    assert!(
        (activations(&with_head) - activations(&full)).abs() < 1.0,
        "{} vs {}",
        activations(&with_head),
        activations(&full)
    );
}

/// `F.cross_entropy` on the logits in their own dtype (nanoGPT's loss): under pure bf16 the
/// log-softmax and backward's first gradients are 16-bit, 2 and 4 bytes a class and token
/// against the upcast loss's 4 and 10 (describe's simulation of it on Llama-3.2-1B:
/// docs/reports/setup-simulations.json, L-full-native); under autocast and in fp32 the op runs in fp32,
/// so it is the upcast loss.
#[tokio::test]
async fn a_native_loss_stays_16_bit_only_under_pure_16_bit_weights() {
    let app = spawn_app().await;
    let config = config("public/meta-llama__Llama-3.2-1B");
    let job = |precision: &str, loss: &str| {
        json!({"transformer_config": config, "batch_size": 2, "seq_len": 1024,
               "precision": precision, "optimizer": "adamw", "gpu": "h100-80gb",
               "loss_implementation": loss})
    };
    let figure = |a: &Value| a["memory"]["estimate_mib"].as_f64().unwrap();
    let temporaries = |a: &Value| a["memory"]["breakdown"]["temporaries"].as_f64().unwrap();
    let upcast = app
        .post_json_value("/v1/estimate", &job("bf16", "upcast_fp32"))
        .await;
    let native = app
        .post_json_value("/v1/estimate", &job("bf16", "native"))
        .await;
    assert_eq!(native["setup"]["loss_implementation"], "native");
    // 2 x 1,024 tokens x 128,256 classes: the upcast loss starts backward with 10 bytes of
    // gradients a class and token, the native one with 4.
    let elements = 2.0 * 1024.0 * 128_256.0 / 1_048_576.0;
    assert!(
        (temporaries(&upcast) - temporaries(&native) - 6.0 * elements).abs() < 1.0,
        "{} vs {}",
        temporaries(&upcast),
        temporaries(&native)
    );
    assert!(figure(&native) < figure(&upcast));
    for precision in ["amp_bf16", "fp32"] {
        let upcast = app
            .post_json_value("/v1/estimate", &job(precision, "upcast_fp32"))
            .await;
        let native = app
            .post_json_value("/v1/estimate", &job(precision, "native"))
            .await;
        assert_eq!(figure(&native), figure(&upcast), "{precision}");
    }
}

/// 4-bit GPTQ and AWQ bases: packed int4 weights with fp16 scales and packed zeros per group
/// of 128 inputs (GPTQ with an int32 index per input): about 0.52 bytes a weight, a little
/// above NF4's 0.516, far below bf16's 2; a smaller group costs more; every quantised base
/// adds its largest layer dequantised to the temporaries; a group size on another base is a
/// 422 naming it.
#[tokio::test]
async fn gptq_and_awq_bases_cost_their_packed_bytes() {
    let app = spawn_app().await;
    let config = config("public/meta-llama__Llama-2-7b-hf");
    let job = |base: &str, group: Option<u64>| {
        let mut lora = json!({"rank": 16, "target_modules": "all-linear", "base_weights": base});
        if let Some(g) = group {
            lora["group_size"] = g.into();
        }
        json!({"transformer_config": config, "batch_size": 1, "seq_len": 512,
               "precision": "bf16", "optimizer": "adamw", "gpu": "a100-80gb", "lora": lora})
    };
    let weights = |a: &Value| a["memory"]["breakdown"]["parameters"].as_f64().unwrap();
    let temporaries = |a: &Value| a["memory"]["breakdown"]["temporaries"].as_f64().unwrap();
    // Each quantised base is dequantised one layer at a time for its matmuls: the largest,
    // an MLP projection of 11008 x 4096, in bf16 beside backward's other temporaries.
    let dequantised = 11008.0 * 4096.0 * 2.0 / 1048576.0;
    let mut answers = Vec::new();
    let mut plain_temporaries = 0.0;
    for (base, group) in [
        ("same", None),
        ("nf4", None),
        ("gptq_int4", None),
        ("awq_int4", None),
        ("awq_int4", Some(32)),
    ] {
        let answer: Value = app.post_json_value("/v1/estimate", &job(base, group)).await;
        assert!(
            answer["memory"]["estimate_mib"].is_number(),
            "{base}: {answer}"
        );
        assert_eq!(answer["memory"]["peak_moment"], "backward_start", "{base}");
        if base == "same" {
            plain_temporaries = temporaries(&answer);
        } else {
            let added = temporaries(&answer) - plain_temporaries;
            assert!((added - dequantised).abs() < 0.2, "{base}: {added}");
        }
        answers.push(weights(&answer));
    }
    let [same, nf4, gptq, awq, awq32] = answers[..] else {
        unreachable!()
    };
    assert!(
        gptq < 0.35 * same && awq < 0.35 * same,
        "{same} {gptq} {awq}"
    );
    assert!(nf4 < awq && awq < gptq, "nf4 {nf4}, awq {awq}, gptq {gptq}");
    assert!(awq32 > awq);
    let response = app.post_json("/v1/estimate", &job("nf4", Some(64))).await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .starts_with("lora.group_size"),
        "{problem}"
    );
}

/// Reward and value heads on every decoder family and T5 (`...ForSequenceClassification`):
/// the language-model head (and its logits and loss over the vocabulary) gives way to a score
/// of `num_labels` over every position (T5: `classification_head`, dense then out_proj, on the
/// end-of-sequence token); the parameters change by exactly those heads, and the figure falls.
#[tokio::test]
async fn reward_heads_replace_the_language_model_head_on_every_family() {
    let app = spawn_app().await;
    for (fixture, reward, hidden, vocab, lm_head_params, head_params) in [
        // GPT-2 ties its head to the embeddings: the head adds nothing of its own.
        (
            "gpt2.json",
            "GPT2ForSequenceClassification",
            512.0,
            8000.0,
            0.0,
            512.0,
        ),
        (
            "gpt_neox.json",
            "GPTNeoXForSequenceClassification",
            512.0,
            8000.0,
            512.0 * 8000.0,
            512.0,
        ),
        // Phi's head has a bias.
        (
            "public/microsoft__phi-1_5.json",
            "PhiForSequenceClassification",
            2048.0,
            51200.0,
            2048.0 * 51200.0 + 51200.0,
            2048.0,
        ),
        (
            "t5.json",
            "T5ForSequenceClassification",
            512.0,
            8000.0,
            0.0,
            512.0 * 512.0 + 512.0 + 512.0 + 1.0,
        ),
    ] {
        let config = config(fixture.trim_end_matches(".json"));
        let mut reward_config = config.clone();
        reward_config["architectures"] = json!([reward]);
        reward_config["num_labels"] = 1.into();
        let job = |config: &Value| {
            json!({"transformer_config": config, "batch_size": 4, "seq_len": 512,
                   "precision": "bf16", "optimizer": "adamw", "gpu": "a100-80gb"})
        };
        let lm: Value = app.post_json_value("/v1/estimate", &job(&config)).await;
        let rm: Value = app
            .post_json_value("/v1/estimate", &job(&reward_config))
            .await;
        let params = |a: &Value| a["setup"]["trainable_params"].as_f64().unwrap();
        assert_eq!(
            params(&rm) - params(&lm),
            head_params - lm_head_params,
            "{fixture}: {} vs {}",
            params(&rm),
            params(&lm)
        );
        let figure = |a: &Value| a["memory"]["estimate_mib"].as_f64().unwrap();
        // At least the fp32 logits over the vocabulary are gone.
        let logits = 4.0 * 512.0 * vocab * 4.0 / 1048576.0;
        assert!(
            figure(&rm) < figure(&lm) - logits,
            "{fixture}: {} vs {} ({hidden})",
            figure(&rm),
            figure(&lm)
        );
    }
}

/// A reward model (`LlamaForSequenceClassification`, one label): a score head instead of the
/// language-model head, no logits over the vocabulary. DPO's reference: a frozen copy adds the
/// model's weights once more (bf16: 2 bytes a parameter); with LoRA the adapters-disabled base
/// adds none; `adapters_disabled` without LoRA is a 422.
#[tokio::test]
async fn reward_heads_and_reference_models() {
    let app = spawn_app().await;
    let config = config("public/meta-llama__Llama-3.2-1B");
    let job = |config: &Value, extra: Value| {
        let mut job = json!({"transformer_config": config, "batch_size": 8, "seq_len": 1024,
                             "precision": "bf16", "optimizer": "adamw", "gpu": "a100-80gb"});
        for (k, v) in extra.as_object().unwrap() {
            job[k] = v.clone();
        }
        job
    };
    let mut reward_config = config.clone();
    reward_config["architectures"] = json!(["LlamaForSequenceClassification"]);
    reward_config["num_labels"] = 1.into();
    let figure = |a: &Value| a["memory"]["estimate_mib"].as_f64().unwrap();
    let lm: Value = app
        .post_json_value("/v1/estimate", &job(&config, json!({})))
        .await;
    let reward: Value = app
        .post_json_value("/v1/estimate", &job(&reward_config, json!({})))
        .await;
    assert!(
        figure(&reward) < figure(&lm),
        "{} vs {}",
        figure(&reward),
        figure(&lm)
    );
    let params = |a: &Value| a["memory"]["breakdown"]["parameters"].as_f64().unwrap();
    let copy: Value = app
        .post_json_value(
            "/v1/estimate",
            &job(&config, json!({"reference_model": "copy"})),
        )
        .await;
    assert_eq!(copy["setup"]["reference_model"], "copy");
    // Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings), 2 bytes each.
    let copied = 1_235_814_400.0 * 2.0 / 1_048_576.0;
    assert!(
        (params(&copy) - params(&lm) - copied).abs() < 0.01 * copied,
        "{} -> {}",
        params(&lm),
        params(&copy)
    );
    let lora = json!({"rank": 16, "target_modules": "all-linear"});
    let with_lora: Value = app
        .post_json_value("/v1/estimate", &job(&config, json!({"lora": lora})))
        .await;
    let disabled: Value = app
        .post_json_value(
            "/v1/estimate",
            &job(
                &config,
                json!({"lora": lora, "reference_model": "adapters_disabled"}),
            ),
        )
        .await;
    assert_eq!(params(&disabled), params(&with_lora));
    let response = app
        .post_json(
            "/v1/estimate",
            &job(&config, json!({"reference_model": "adapters_disabled"})),
        )
        .await;
    assert_eq!(response.status(), 422);
}

/// A multimodal config (its language model under `text_config`, as Gemma 3, LLaVA and
/// Qwen2-VL ship) is answered from that text config, as the text config alone is, with a
/// warning saying what it leaves out.
#[tokio::test]
async fn a_multimodal_config_is_answered_from_its_text_config() {
    let app = spawn_app().await;
    let text = config("public/meta-llama__Llama-3.2-1B");
    let multimodal = json!({
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024},
        "text_config": text.clone(),
    });
    let setup = json!({"batch_size": 4, "seq_len": 1024, "precision": "amp_bf16"});
    let mut from_text = setup.clone();
    from_text["transformer_config"] = text;
    let mut from_multimodal = setup.clone();
    from_multimodal["transformer_config"] = multimodal;
    let alone: Value = app.post_json_value("/v1/estimate", &from_text).await;
    let answered: Value = app.post_json_value("/v1/estimate", &from_multimodal).await;
    assert_eq!(answered["memory"], alone["memory"], "{answered}");
    let warnings = answered["warnings"].to_string();
    assert!(
        warnings.contains("answered from its text_config"),
        "{warnings}"
    );
}
