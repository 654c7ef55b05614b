//! The setup: each field parsed, bounded and read with the others.

use super::*;

fn parse(raw: UncheckedSetup<'_>) -> Result<Setup, SetupError> {
    Setup::parse(32, &raw)
}

fn field_of(raw: UncheckedSetup<'_>) -> String {
    parse(raw).expect_err("refused").field
}

#[test]
fn no_fields_is_the_plain_setup_the_learned_models_know() {
    let setup = parse(UncheckedSetup::default()).unwrap();
    assert_eq!(setup, Setup::plain(32));
    assert!(setup.within_learned());
}

#[test]
fn six_precisions_parse_and_the_old_names_still_read_as_fp16_autocast() {
    for (raw, want) in [
        ("fp32", Precision::Fp32),
        ("tf32", Precision::Tf32),
        ("amp_fp16", Precision::AmpFp16),
        ("mixed16", Precision::AmpFp16),
        ("amp_bf16", Precision::AmpBf16),
        ("bf16", Precision::Bf16),
        ("fp16", Precision::Fp16),
    ] {
        assert_eq!(Precision::parse(raw), Some(want), "{raw}");
        assert_eq!(Precision::parse(want.as_str()), Some(want));
    }
    assert_eq!(
        field_of(UncheckedSetup {
            precision: Some("fp8"),
            ..Default::default()
        }),
        "precision"
    );
}

#[test]
fn the_micro_batch_follows_accumulation_and_must_make_up_the_batch() {
    let setup = parse(UncheckedSetup {
        gradient_accumulation_steps: Some(4),
        ..Default::default()
    })
    .unwrap();
    assert_eq!((setup.micro_batch_size, setup.accumulation), (8, 4));
    assert!(!setup.within_learned());
    // The global batch over 2 DDP ranks is accepted too.
    let setup = parse(UncheckedSetup {
        micro_batch_size: Some(4),
        gradient_accumulation_steps: Some(4),
        parallelism: Some(UncheckedParallelism {
            strategy: Some("ddp"),
            world_size: Some(2),
            ..Default::default()
        }),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(setup.micro_batch_size, 4);
    for raw in [
        UncheckedSetup {
            micro_batch_size: Some(5),
            ..Default::default()
        },
        UncheckedSetup {
            micro_batch_size: Some(0),
            ..Default::default()
        },
    ] {
        assert_eq!(field_of(raw), "micro_batch_size");
    }
    assert_eq!(
        field_of(UncheckedSetup {
            gradient_accumulation_steps: Some(5),
            ..Default::default()
        }),
        "gradient_accumulation_steps"
    );
}

#[test]
fn invalid_layouts_are_refused_naming_the_field() {
    let layout = |strategy, world_size, tensor_parallel| UncheckedSetup {
        parallelism: Some(UncheckedParallelism {
            strategy,
            world_size,
            tensor_parallel,
            ..Default::default()
        }),
        ..Default::default()
    };
    assert_eq!(
        field_of(layout(Some("ddp"), Some(0), None)),
        "parallelism.world_size"
    );
    assert_eq!(
        field_of(layout(Some("zero3"), None, None)),
        "parallelism.world_size"
    );
    assert_eq!(
        field_of(layout(Some("fsdp"), Some(6), Some(4))),
        "parallelism.world_size"
    );
    assert_eq!(
        field_of(layout(None, Some(8), None)),
        "parallelism.strategy"
    );
    assert_eq!(
        field_of(layout(Some("horovod"), Some(8), None)),
        "parallelism.strategy"
    );
    let ok = parse(layout(Some("fsdp"), Some(16), Some(4))).unwrap();
    assert_eq!(ok.parallelism.data(), 4);
    // Tensor parallel alone needs no strategy: no data-parallel ranks.
    let tp = parse(layout(None, None, Some(8))).unwrap();
    assert_eq!((tp.parallelism.world_size, tp.parallelism.data()), (8, 1));
}

#[test]
fn lora_fields_are_checked_and_a_count_of_trainables_does_not_go_with_it() {
    let targets = vec!["q_proj".to_string(), "v_proj".to_string()];
    let with = |rank, base| UncheckedSetup {
        lora: Some(UncheckedLora {
            rank,
            alpha: Some(16.0),
            dropout: None,
            target_modules: UncheckedNames::Names(&targets),
            base_weights: base,
            modules_to_save: None,
            group_size: None,
            expert_layout: None,
        }),
        ..Default::default()
    };
    let setup = parse(with(8, Some("nf4"))).unwrap();
    let lora = setup.lora.clone().unwrap();
    assert_eq!((lora.rank, lora.base_weights), (8, BaseWeights::Nf4));
    assert!(!setup.within_learned());
    assert_eq!(field_of(with(0, None)), "lora.rank");
    assert_eq!(field_of(with(8, Some("nf3"))), "lora.base_weights");
    let mut both = with(8, None);
    both.trainable_params = Some(10);
    assert_eq!(field_of(both), "trainable.params");
    let keyword = UncheckedSetup {
        lora: Some(UncheckedLora {
            rank: 8,
            alpha: None,
            dropout: None,
            target_modules: UncheckedNames::Keyword("everything"),
            base_weights: None,
            modules_to_save: None,
            group_size: None,
            expert_layout: None,
        }),
        ..Default::default()
    };
    assert_eq!(field_of(keyword), "lora.target_modules");
    let dropped_all = UncheckedSetup {
        lora: Some(UncheckedLora {
            rank: 8,
            alpha: None,
            dropout: Some(1.0),
            target_modules: UncheckedNames::Keyword("all-linear"),
            base_weights: None,
            modules_to_save: None,
            group_size: None,
            expert_layout: None,
        }),
        ..Default::default()
    };
    assert_eq!(field_of(dropped_all), "lora.dropout");
}

#[test]
fn lists_read_only_for_whether_they_name_a_layer_keep_each_name_once() {
    let repeated: Vec<String> = [" q_proj", "q_proj", "v_proj", "q_proj "]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let setup = parse(UncheckedSetup {
        lora: Some(UncheckedLora {
            rank: 8,
            alpha: None,
            dropout: None,
            target_modules: UncheckedNames::Names(&repeated),
            base_weights: None,
            modules_to_save: Some(&repeated),
            group_size: None,
            expert_layout: None,
        }),
        activation_checkpointing: Some(UncheckedNames::Names(&repeated)),
        ..Default::default()
    })
    .unwrap();
    let once = vec!["q_proj".to_string(), "v_proj".to_string()];
    let lora = setup.lora.unwrap();
    assert_eq!(lora.targets, LoraTargets::Names(once.clone()));
    assert_eq!(lora.modules_to_save, once);
    // Checkpointed modules keep their repeats: the step counts each entry.
    assert!(matches!(setup.checkpointing, Checkpointing::Modules(m) if m.len() == 4));
    let trainable = parse(UncheckedSetup {
        trainable_modules: Some(&repeated),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(trainable.trainable, Trainable::Modules(once));
}

#[test]
fn optimizers_and_their_implementations_parse() {
    for optimizer in Optimizer::ALL {
        assert_eq!(Optimizer::parse(optimizer.as_str()), Some(optimizer));
    }
    assert!(Optimizer::PagedAdamW8bit.is_paged() && Optimizer::PagedAdamW8bit.is_8bit());
    assert_eq!(
        field_of(UncheckedSetup {
            optimizer: Some("adamw_8bit"),
            optimizer_implementation: Some("for_loop"),
            ..Default::default()
        }),
        "optimizer_implementation"
    );
    assert_eq!(
        field_of(UncheckedSetup {
            optimizer: Some("lion"),
            ..Default::default()
        }),
        "optimizer"
    );
    for (optimizer, precision, implementation) in [
        ("adafactor", "fp32", "fused"),
        ("adamw_8bit", "bf16", "for_loop"),
    ] {
        assert_eq!(
            field_of(UncheckedSetup {
                optimizer: Some(optimizer),
                precision: Some(precision),
                optimizer_implementation: Some(implementation),
                ..Default::default()
            }),
            "optimizer_implementation"
        );
    }
    assert_eq!(
        field_of(UncheckedSetup {
            optimizer: Some("adamw_8bit"),
            precision: Some("fp16"),
            ..Default::default()
        }),
        "optimizer"
    );
}
