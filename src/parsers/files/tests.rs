//! Each mapping from a user's file to the setup, and the refusals.

use serde_json::{json, Map, Value};

use super::*;

fn map(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => panic!("an object"),
    }
}

fn args_only(args: Value) -> Result<FileSetup, FileError> {
    let args = map(args);
    read(Files {
        training_arguments: Some(&args),
        ..Files::default()
    })
}

#[test]
fn the_trainers_batch_accumulation_and_checkpointing_are_read_as_stated() {
    let setup = args_only(json!({
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 8,
        "gradient_checkpointing": true, "learning_rate": 2e-4, "report_to": ["wandb"]
    }))
    .unwrap();
    assert_eq!(setup.micro_batch_size.unwrap().value, 4);
    let accumulation = setup.gradient_accumulation_steps.unwrap();
    assert_eq!(accumulation.value, 8);
    assert_eq!(
        accumulation.from,
        "training_arguments.gradient_accumulation_steps"
    );
    assert!(setup.checkpointing.unwrap().value);
    // No precision flags stated: no precision read.
    assert!(setup.precision.is_none());
}

#[test]
fn the_trainers_bf16_is_autocast_and_no_flag_is_fp32() {
    let read_precision = |args: Value| args_only(args).unwrap().precision.map(|p| p.value);
    assert_eq!(
        read_precision(json!({"bf16": true, "fp16": false})),
        Some(Precision::AmpBf16)
    );
    assert_eq!(
        read_precision(json!({"bf16": false, "fp16": true})),
        Some(Precision::AmpFp16)
    );
    assert_eq!(
        read_precision(json!({"bf16": false, "fp16": false})),
        Some(Precision::Fp32)
    );
    assert_eq!(
        read_precision(json!({"bf16": false, "fp16": false, "tf32": true})),
        Some(Precision::Tf32)
    );
    let both = args_only(json!({"bf16": true, "fp16": true})).unwrap_err();
    assert_eq!(both.place, "training_arguments.bf16");
}

#[test]
fn optim_names_map_to_the_optimizer_and_how_it_steps() {
    // "optim optimizer implementation", as docs/user/guide.md lists them.
    let expected = "adamw_torch adamw foreach, adamw_torch_fused adamw fused, \
        adamw_hf adamw for_loop, adafactor adafactor for_loop, sgd sgd foreach, \
        adamw_bnb_8bit adamw_8bit fused, adamw_8bit adamw_8bit fused, \
        paged_adamw_8bit paged_adamw_8bit fused, paged_adamw_32bit paged_adamw fused";
    for row in expected.split(", ") {
        let words: Vec<&str> = row.split_whitespace().collect();
        let setup = args_only(json!({ "optim": words[0] })).unwrap();
        let read = [
            setup.optimizer.unwrap().value.as_str(),
            setup.implementation.unwrap().value.as_str(),
        ];
        assert_eq!(read, words[1..], "{row}");
    }
    let lion = args_only(json!({"optim": "lion_32bit"})).unwrap_err();
    assert_eq!(lion.place, "training_arguments.optim");
    assert!(lion.message.contains("'lion_32bit'") && lion.message.contains("paged_adamw_8bit"));
}

#[test]
fn hostile_values_are_refused_with_their_place() {
    for (args, place) in [
        (
            json!({"per_device_train_batch_size": 0}),
            "per_device_train_batch_size",
        ),
        (
            json!({"per_device_train_batch_size": 1e30}),
            "per_device_train_batch_size",
        ),
        (
            json!({"per_device_train_batch_size": "8"}),
            "per_device_train_batch_size",
        ),
        (
            json!({"gradient_accumulation_steps": -1}),
            "gradient_accumulation_steps",
        ),
        (
            json!({"gradient_checkpointing": "yes"}),
            "gradient_checkpointing",
        ),
        (json!({"optim": "x".repeat(10_000)}), "optim"),
        (json!({"optim": 3}), "optim"),
        (json!({"fsdp": "full_shard bogus"}), "fsdp"),
        (json!({"deepspeed": 7}), "deepspeed"),
    ] {
        let error = args_only(args.clone()).unwrap_err();
        assert_eq!(error.place, format!("training_arguments.{place}"), "{args}");
        assert!(error.to_string().len() < 400, "{error}");
    }
}

#[test]
fn fsdp_options_state_the_strategy_and_offload() {
    let setup = args_only(json!({"fsdp": "full_shard auto_wrap offload"})).unwrap();
    assert_eq!(setup.strategy.unwrap().value, Strategy::Fsdp);
    assert!(setup.offload_parameters.unwrap().value);
    assert!(args_only(json!({"fsdp": ""})).unwrap().strategy.is_none());
    assert!(args_only(json!({"fsdp": "hybrid_shard"})).is_err());
}

fn with_fsdp(args: Option<Value>, fsdp: Value) -> Result<FileSetup, FileError> {
    let args = args.map(map);
    let fsdp = map(fsdp);
    read(Files {
        training_arguments: args.as_ref(),
        fsdp: Some(&fsdp),
        ..Files::default()
    })
}

#[test]
fn accelerates_fsdp_config_states_sharding_offload_checkpointing_precision_and_gpus() {
    let setup = with_fsdp(
        None,
        json!({"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 16,
               "fsdp_config": {"fsdp_sharding_strategy": "SHARD_GRAD_OP",
                               "fsdp_offload_params": true,
                               "fsdp_activation_checkpointing": true,
                               "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}}),
    )
    .unwrap();
    let strategy = setup.strategy.unwrap();
    assert_eq!(strategy.value, Strategy::Zero2);
    assert_eq!(strategy.from, "fsdp.fsdp_config.fsdp_sharding_strategy");
    assert!(setup.offload_parameters.unwrap().value);
    assert!(setup.checkpointing.unwrap().value);
    assert_eq!(setup.precision.unwrap().value, Precision::AmpBf16);
    assert_eq!(setup.world_size.unwrap().value, 16);
    // The fsdp_config mapping alone, as the Trainer takes it: numbers, FSDP2's reshard flag,
    // accelerate's default.
    let alone = |options: Value| with_fsdp(None, options).map(|s| s.strategy.unwrap().value);
    assert_eq!(
        alone(json!({"sharding_strategy": 3})).unwrap(),
        Strategy::Ddp
    );
    assert_eq!(
        alone(json!({"reshard_after_forward": false})).unwrap(),
        Strategy::Zero2
    );
    assert_eq!(alone(json!({})).unwrap(), Strategy::Fsdp);
    assert_eq!(
        with_fsdp(None, json!({"mixed_precision": "no", "fsdp_config": {}}))
            .unwrap()
            .precision,
        None
    );
    // Refused, naming the place.
    for (options, place) in [
        (
            json!({"sharding_strategy": "HYBRID_SHARD"}),
            "fsdp.sharding_strategy",
        ),
        (json!({"sharding_strategy": 9}), "fsdp.sharding_strategy"),
        (
            json!({"sharding_strategy": "FULL_SHARD", "reshard_after_forward": false}),
            "fsdp.reshard_after_forward",
        ),
        (
            json!({"distributed_type": "DEEPSPEED", "fsdp_config": {}}),
            "fsdp.distributed_type",
        ),
        (
            json!({"mixed_precision": "fp8", "fsdp_config": {}}),
            "fsdp.mixed_precision",
        ),
        (json!({"fsdp_config": [1]}), "fsdp.fsdp_config"),
    ] {
        let error = with_fsdp(None, options).unwrap_err();
        assert_eq!(error.place, place, "{error}");
    }
    // The Trainer's own options must agree with it.
    let error = with_fsdp(
        Some(json!({"fsdp": "full_shard auto_wrap"})),
        json!({"sharding_strategy": "SHARD_GRAD_OP"}),
    )
    .unwrap_err();
    assert!(error.message.contains("training_arguments.fsdp"), "{error}");
    let error = with_fsdp(
        Some(json!({"fp16": true})),
        json!({"mixed_precision": "bf16", "fsdp_config": {}}),
    )
    .unwrap_err();
    assert_eq!(error.place, "fsdp.mixed_precision", "{error}");
}

fn with_deepspeed(args: Option<Value>, ds: Value) -> Result<FileSetup, FileError> {
    let args = args.map(map);
    let ds = map(ds);
    read(Files {
        training_arguments: args.as_ref(),
        deepspeed: Some(&ds),
        ..Files::default()
    })
}

#[test]
fn deepspeed_auto_values_are_resolved_from_the_training_arguments() {
    let setup = with_deepspeed(
        Some(
            json!({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 16,
                    "bf16": true, "fp16": false, "optim": "adamw_torch"}),
        ),
        json!({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
               "train_batch_size": "auto", "bf16": {"enabled": "auto"},
               "fp16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}),
    )
    .unwrap();
    assert_eq!(setup.micro_batch_size.as_ref().unwrap().value, 2);
    assert_eq!(
        setup.gradient_accumulation_steps.as_ref().unwrap().value,
        16
    );
    assert_eq!(setup.strategy.as_ref().unwrap().value, Strategy::Zero3);
    // DeepSpeed's bf16 is 16-bit weights with an fp32 master copy, not autocast.
    let precision = setup.precision.unwrap();
    assert_eq!(precision.value, Precision::Bf16);
    assert_eq!(
        precision.from,
        "deepspeed.bf16.enabled (auto: training_arguments.bf16|bf16_full_eval)"
    );
    assert!(setup.fp32_master.unwrap().value);
    assert_eq!(setup.optimizer.unwrap().value, Optimizer::AdamW);
}

#[test]
fn deepspeed_numbers_the_arguments_contradict_are_refused_as_the_trainer_refuses_them() {
    let error = with_deepspeed(
        Some(json!({"per_device_train_batch_size": 2})),
        json!({"train_micro_batch_size_per_gpu": 4}),
    )
    .unwrap_err();
    assert_eq!(error.place, "deepspeed.train_micro_batch_size_per_gpu");
    assert!(error
        .message
        .contains("training_arguments.per_device_train_batch_size"));
    let auto_alone = with_deepspeed(None, json!({"train_micro_batch_size_per_gpu": "auto"}));
    assert!(auto_alone
        .unwrap_err()
        .message
        .contains("training_arguments"));
    let bf16 = with_deepspeed(
        Some(json!({"bf16": false, "fp16": true})),
        json!({"bf16": {"enabled": true}}),
    );
    assert_eq!(bf16.unwrap_err().place, "deepspeed.bf16.enabled");
}

#[test]
fn deepspeed_stages_offload_and_optimizer_map_to_the_layout() {
    let setup = with_deepspeed(
        None,
        json!({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
               "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}),
    )
    .unwrap();
    assert_eq!(setup.strategy.unwrap().value, Strategy::Zero2);
    assert_eq!(
        setup.offload_optimizer.unwrap().from,
        "deepspeed.zero_optimization.offload_optimizer.device"
    );
    assert!(setup.offload_parameters.is_none());
    // Offloaded, DeepSpeed's CPU Adam steps: no GPU implementation stated.
    assert!(setup.implementation.is_none());
    assert_eq!(setup.precision.unwrap().value, Precision::Fp32);
    let zero3 = with_deepspeed(
        None,
        json!({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}),
    )
    .unwrap();
    assert!(zero3.offload_parameters.unwrap().value);
    assert_eq!(
        with_deepspeed(None, json!({}))
            .unwrap()
            .strategy
            .unwrap()
            .value,
        Strategy::Ddp
    );
    for (ds, place) in [
        (
            json!({"zero_optimization": {"stage": 4}}),
            "deepspeed.zero_optimization.stage",
        ),
        (
            json!({"zero_optimization": 3}),
            "deepspeed.zero_optimization",
        ),
        (
            json!({"optimizer": {"type": "Lamb"}}),
            "deepspeed.optimizer.type",
        ),
        (
            json!({"zero_optimization": {"offload_param": {"device": "gpu"}}}),
            "deepspeed.zero_optimization.offload_param.device",
        ),
    ] {
        assert_eq!(
            with_deepspeed(None, ds.clone()).unwrap_err().place,
            place,
            "{ds}"
        );
    }
}

#[test]
fn the_trainers_own_deepspeed_dict_is_read_and_a_path_is_said() {
    let setup = args_only(json!({"per_device_train_batch_size": 1,
        "deepspeed": {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": "auto"}}))
    .unwrap();
    assert_eq!(setup.strategy.unwrap().value, Strategy::Zero1);
    let path = args_only(json!({"deepspeed": "ds_zero3.json"})).unwrap();
    assert!(path.strategy.is_none());
    assert!(path.warnings[0].contains("ds_zero3.json"));
}

/// One file (`adapter_config` or `load`) read beside the model's config.
fn one_file(field: &str, file: Value, config: Option<Value>) -> Result<FileSetup, FileError> {
    let file = map(file);
    let config = config.map(map);
    let mut files = Files {
        model_config: config.as_ref(),
        ..Files::default()
    };
    match field {
        "adapter_config" => files.adapter_config = Some(&file),
        _ => files.load = Some(&file),
    }
    read(files)
}

fn adapter(config: Value, model_type: Option<&str>) -> Result<FileSetup, FileError> {
    one_file(
        "adapter_config",
        config,
        model_type.map(|t| json!({ "model_type": t })),
    )
}

#[test]
fn peft_adapter_configs_become_the_lora_block() {
    let lora = adapter(
        json!({"peft_type": "LORA", "r": 64, "lora_alpha": 16, "lora_dropout": 0.1,
               "target_modules": ["q_proj", "k_proj"], "bias": "none", "task_type": "CAUSAL_LM",
               "modules_to_save": null, "inference_mode": true}),
        None,
    )
    .unwrap()
    .lora
    .unwrap()
    .value;
    assert_eq!((lora.rank, lora.alpha, lora.dropout), (64, 16.0, 0.1));
    assert_eq!(lora.targets.unwrap(), ["q_proj", "k_proj"]);
    assert!(lora.modules_to_save.is_none());
    let all = adapter(
        json!({"peft_type": "LORA", "r": 8, "target_modules": "all-linear"}),
        None,
    );
    assert!(all.unwrap().lora.unwrap().value.targets.is_none());
    // No targets: PEFT's default for the model type.
    let default = adapter(json!({"peft_type": "LORA", "r": 8}), Some("llama")).unwrap();
    assert_eq!(
        default.lora.unwrap().value.targets.unwrap(),
        ["q_proj", "v_proj"]
    );
}

#[test]
fn adapters_the_service_does_not_model_are_refused() {
    for (config, place) in [
        (json!({"peft_type": "IA3"}), "peft_type"),
        (json!({"peft_type": "LORA", "r": 0}), "r"),
        (
            json!({"peft_type": "LORA", "r": 8, "lora_dropout": 2}),
            "lora_dropout",
        ),
        (
            json!({"peft_type": "LORA", "r": 8, "lora_alpha": "big"}),
            "lora_alpha",
        ),
        (
            json!({"peft_type": "LORA", "r": 8, "target_modules": ".*proj"}),
            "target_modules",
        ),
        (
            json!({"peft_type": "LORA", "r": 8, "target_modules": ["q", 3]}),
            "target_modules",
        ),
        (
            json!({"peft_type": "LORA", "r": 8, "target_modules": ["q"], "bias": "all"}),
            "bias",
        ),
        (
            json!({"peft_type": "LORA", "r": 8, "target_modules": ["q"], "use_dora": true}),
            "use_dora",
        ),
        (
            json!({"peft_type": "LORA", "r": 8, "target_modules": ["q"], "rank_pattern": {"q": 4}}),
            "rank_pattern",
        ),
        (json!({"peft_type": "LORA", "r": 8}), "target_modules"),
    ] {
        let error = adapter(config.clone(), None).unwrap_err();
        assert_eq!(error.place, format!("adapter_config.{place}"), "{config}");
    }
    let many: Vec<String> = (0..1000).map(|i| format!("m{i}")).collect();
    let error = adapter(
        json!({"peft_type": "LORA", "r": 8, "target_modules": many}),
        None,
    );
    assert!(error.unwrap_err().message.contains("at most"));
}

fn loaded(load: Value, config: Option<Value>) -> Result<FileSetup, FileError> {
    one_file("load", load, config)
}

#[test]
fn quantisation_configs_become_the_base_weights() {
    let nf4 = loaded(
        json!({"torch_dtype": "bfloat16", "quantization_config": {"load_in_4bit": true,
            "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": true,
            "bnb_4bit_compute_dtype": "bfloat16"}}),
        None,
    )
    .unwrap();
    assert_eq!(nf4.base_weights.unwrap().value, BaseWeights::Nf4);
    assert_eq!(nf4.precision.unwrap().value, Precision::Bf16);
    assert!(nf4.warnings.is_empty());
    let int8 = loaded(json!({"quantization_config": {"load_in_8bit": true}}), None).unwrap();
    assert_eq!(int8.base_weights.unwrap().value, BaseWeights::Int8);
    // transformers' default dtype for a quantised model is fp16.
    assert_eq!(int8.precision.unwrap().value, Precision::Fp16);
    let gptq = loaded(
        json!({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32}}),
        None,
    )
    .unwrap();
    assert_eq!(
        gptq.base_weights.unwrap().value,
        BaseWeights::Gptq { group_size: 32 }
    );
    let awq = loaded(
        json!({"quantization_config": {"quant_method": "awq", "w_bit": 4, "q_group_size": 64,
            "version": "GEMM"}}),
        None,
    )
    .unwrap();
    assert_eq!(
        awq.base_weights.unwrap().value,
        BaseWeights::Awq { group_size: 64 }
    );
    let single = loaded(json!({"quantization_config": {"load_in_4bit": true}}), None).unwrap();
    assert!(single.warnings[0].contains("bnb_4bit_use_double_quant"));
    let eager = loaded(json!({"attn_implementation": "eager"}), None).unwrap();
    assert_eq!(eager.attention.unwrap().value, "eager");
    let flash = loaded(json!({"attn_implementation": "flash_attention_2"}), None).unwrap();
    assert_eq!(flash.attention.unwrap().value, "sdpa");
    for (load, place) in [
        (
            json!({"quantization_config": {"quant_method": "hqq"}}),
            "load.quantization_config.quant_method",
        ),
        (
            json!({"quantization_config": {"quant_method": "gptq", "bits": 8}}),
            "load.quantization_config.bits",
        ),
        (
            json!({"quantization_config": {"quant_method": "gptq", "group_size": -1}}),
            "load.quantization_config.group_size",
        ),
        (json!({"torch_dtype": "float8"}), "load.torch_dtype"),
        (
            json!({"attn_implementation": "paged"}),
            "load.attn_implementation",
        ),
        (json!({"torch_dtype": "auto"}), "load.torch_dtype"),
        (
            json!({"torch_dtype": "float16", "dtype": "bfloat16"}),
            "load.dtype",
        ),
    ] {
        assert_eq!(
            loaded(load.clone(), None).unwrap_err().place,
            place,
            "{load}"
        );
    }
}

#[test]
fn the_loaded_dtype_decides_pure_16_bits_and_auto_reads_the_config() {
    let auto = loaded(
        json!({"torch_dtype": "auto"}),
        Some(json!({"torch_dtype": "bfloat16"})),
    );
    let precision = auto.unwrap().precision.unwrap();
    assert_eq!(precision.value, Precision::Bf16);
    assert!(precision.from.contains("auto"));
    // Under the Trainer's bf16 autocast: bf16 weights train as pure bf16, fp32 weights
    // autocast, fp16 weights as pure fp16 (the same bytes), the mix said.
    let args = map(json!({"bf16": true}));
    let under_bf16 = |dtype: &str| {
        let load = map(json!({ "torch_dtype": dtype }));
        read(Files {
            training_arguments: Some(&args),
            load: Some(&load),
            ..Files::default()
        })
        .unwrap()
    };
    let bf16 = under_bf16("torch.bfloat16");
    assert_eq!(bf16.precision.unwrap().value, Precision::Bf16);
    let fp32 = under_bf16("float32");
    assert_eq!(fp32.precision.unwrap().value, Precision::AmpBf16);
    let mixed = under_bf16("float16");
    assert_eq!(mixed.precision.unwrap().value, Precision::Fp16);
    assert!(mixed.warnings[0].starts_with("training_arguments.bf16: autocasts"));
}

#[test]
fn an_unsaid_load_dtype_is_the_configs_16_bit_one_as_transformers_5_loads() {
    let args = map(json!({"bf16": true, "per_device_train_batch_size": 1}));
    let adapter = map(json!({"peft_type": "LORA", "r": 16}));
    let config = |dtype: &str| map(json!({"model_type": "llama", "torch_dtype": dtype}));
    let bf16_config = config("bfloat16");
    let files = Files {
        training_arguments: Some(&args),
        adapter_config: Some(&adapter),
        model_config: Some(&bf16_config),
        ..Files::default()
    };
    // No load block: the config's bf16, trained as pure bf16 under the Trainer's autocast;
    // transformers 4's fp32 (autocast over it) is the alternative, and a warning says so.
    let taken = read(files).unwrap();
    let precision = taken.precision.unwrap();
    assert_eq!(precision.value, Precision::Bf16);
    assert!(precision.from.starts_with("transformer_config.torch_dtype"));
    assert_eq!(
        taken.assumed_dtype,
        Some(AssumedDtype {
            dtype: Precision::Bf16,
            alternative: Some(Precision::AmpBf16),
        })
    );
    assert!(taken
        .warnings
        .iter()
        .any(|w| w.starts_with("load.torch_dtype: not given") && w.contains("transformers 5")));
    // A load block without a dtype leaves it unsaid too; with no Trainer flags the
    // alternative is fp32 weights trained in fp32.
    let attention_only = map(json!({"attn_implementation": "sdpa"}));
    let unflagged = read(Files {
        adapter_config: Some(&adapter),
        load: Some(&attention_only),
        model_config: Some(&bf16_config),
        ..Files::default()
    })
    .unwrap();
    assert_eq!(unflagged.precision.unwrap().value, Precision::Bf16);
    assert_eq!(
        unflagged.assumed_dtype.unwrap().alternative,
        Some(Precision::Fp32)
    );
    // Nothing moves where the request states its precision, the config says fp32 or
    // nothing, the dtype is stated, or DeepSpeed casts the model itself.
    let stated = read(Files {
        precision_stated: true,
        ..files
    })
    .unwrap();
    assert_eq!(stated.precision.unwrap().value, Precision::AmpBf16);
    assert_eq!(stated.assumed_dtype, None);
    let fp32_config = config("float32");
    let no_dtype = map(json!({"model_type": "llama"}));
    for model_config in [&fp32_config, &no_dtype] {
        let plain = read(Files {
            model_config: Some(model_config),
            ..files
        })
        .unwrap();
        assert_eq!(plain.precision.unwrap().value, Precision::AmpBf16);
        assert_eq!(plain.assumed_dtype, None);
    }
    let fp32_load = map(json!({"torch_dtype": "float32"}));
    let told = read(Files {
        load: Some(&fp32_load),
        ..files
    })
    .unwrap();
    assert_eq!(told.precision.unwrap().value, Precision::AmpBf16);
    assert_eq!(told.assumed_dtype, None);
    let ds = map(json!({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}}));
    let deepspeed = read(Files {
        deepspeed: Some(&ds),
        ..files
    })
    .unwrap();
    assert_eq!(deepspeed.assumed_dtype, None);
}

#[test]
fn lightning_precision_strings_are_read_as_lightning_means_them() {
    let pairs = "bf16-mixed=amp_bf16 16-mixed=amp_fp16 bf16-true=bf16 16-true=fp16 32-true=fp32";
    for pair in pairs.split(' ') {
        let (lightning, own) = pair.split_once('=').unwrap();
        assert_eq!(Precision::parse(lightning), Precision::parse(own), "{pair}");
        assert!(Precision::parse(lightning).is_some(), "{pair}");
    }
}

#[test]
fn deepspeed_zero3_buffers_are_read_and_auto_ones_follow_the_hidden_size() {
    let ds = map(json!({"zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 0, "sub_group_size": 1e8}}));
    let config = map(json!({"model_type": "llama", "hidden_size": 4096}));
    let read_with = |config: Option<&Map<String, Value>>| {
        read(Files {
            deepspeed: Some(&ds),
            model_config: config,
            ..Files::default()
        })
    };
    let buffers = read_with(Some(&config)).unwrap().zero_buffers;
    let value = |r: &Option<Read<u64>>| r.as_ref().unwrap().value;
    assert_eq!(value(&buffers.reduce_bucket_size), 4096 * 4096);
    assert_eq!(value(&buffers.prefetch_bucket_size), 15_099_494);
    assert_eq!(value(&buffers.param_persistence_threshold), 40_960);
    assert_eq!(value(&buffers.max_live_parameters), 1_000_000_000);
    assert_eq!(value(&buffers.max_reuse_distance), 0);
    assert_eq!(value(&buffers.sub_group_size), 100_000_000);
    assert!(buffers
        .reduce_bucket_size
        .unwrap()
        .from
        .contains("auto: the model's hidden size"));
    // Without the model's config "auto" cannot be resolved, as the Trainer cannot.
    let error = read_with(None).unwrap_err();
    assert_eq!(
        error.place,
        "deepspeed.zero_optimization.reduce_bucket_size"
    );
    // Stage 2 reads its reduce bucket only; stage 0 none.
    let stage = |n: u64| {
        let ds = map(
            json!({"zero_optimization": {"stage": n, "reduce_bucket_size": 2e8,
                                                 "stage3_prefetch_bucket_size": 5}}),
        );
        read(Files {
            deepspeed: Some(&ds),
            ..Files::default()
        })
        .unwrap()
        .zero_buffers
    };
    assert_eq!(value(&stage(2).reduce_bucket_size), 200_000_000);
    assert!(stage(2).prefetch_bucket_size.is_none());
    assert_eq!(stage(0), ZeroBuffersRead::default());
}
