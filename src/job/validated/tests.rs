//! The validated job: layers checked, kinds resolved, family and simulation read.

use super::*;

fn unchecked(kind: &str) -> UncheckedLayer<'_> {
    UncheckedLayer {
        kind,
        output_size: 10,
        params: 5,
    }
}

#[test]
fn kinds_parse_from_gpumemnet_and_pytorch_spellings() {
    assert_eq!(
        LayerKind::parse("batch_normalization"),
        Some(LayerKind::BatchNorm)
    );
    assert_eq!(LayerKind::parse("BatchNorm1d"), Some(LayerKind::BatchNorm));
    assert_eq!(LayerKind::parse("LeakyReLU"), Some(LayerKind::LeakyRelu));
    assert_eq!(LayerKind::parse("Softmax"), Some(LayerKind::Softmax));
    assert_eq!(
        LayerKind::parse("conv_transpose2d"),
        Some(LayerKind::ConvTranspose2d)
    );
    assert_eq!(LayerKind::parse("lienar"), None);
}

#[test]
fn every_canonical_name_parses_back_to_its_kind() {
    for kind in LayerKind::ALL {
        assert_eq!(LayerKind::parse(kind.as_str()), Some(kind), "{kind}");
    }
}

#[test]
fn family_is_inferred_from_attention_then_convolution() {
    let job = |kinds: &[&str]| {
        Job::parse(
            None,
            8,
            kinds
                .iter()
                .map(|k| unchecked(k))
                .collect::<Vec<_>>()
                .into_iter(),
        )
        .unwrap()
        .family()
    };
    assert_eq!(job(&["linear", "relu"]), Family::Mlp);
    assert_eq!(job(&["conv2d", "linear"]), Family::Cnn);
    assert_eq!(job(&["conv2d", "attention", "linear"]), Family::Transformer);
}

#[test]
fn an_explicit_family_wins_over_inference() {
    let job = Job::parse(Some("cnn"), 8, vec![unchecked("linear")].into_iter()).unwrap();
    assert_eq!(job.family(), Family::Cnn);
}

#[test]
fn invalid_jobs_are_rejected_with_the_offending_field() {
    let err = Job::parse(None, 0, vec![unchecked("linear")].into_iter()).unwrap_err();
    assert_eq!(err, JobError::BatchSize(0));
    let err = Job::parse(None, 8, Vec::new().into_iter()).unwrap_err();
    assert_eq!(err, JobError::NoLayers);
    let too_many = vec![unchecked("linear"); MAX_LAYERS + 1];
    assert_eq!(
        Job::parse(None, 8, too_many.into_iter()).unwrap_err(),
        JobError::TooManyLayers(MAX_LAYERS + 1)
    );
    let err = Job::parse(
        None,
        8,
        vec![unchecked("linear"), unchecked("warp")].into_iter(),
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .starts_with("layers[1].kind: unknown layer kind 'warp'"),
        "{err}"
    );
    let huge = UncheckedLayer {
        kind: "linear",
        output_size: 1,
        params: u64::MAX,
    };
    let err = Job::parse(None, 8, vec![huge].into_iter()).unwrap_err();
    assert!(err.to_string().starts_with("layers[0].params"), "{err}");
    let err = Job::parse(Some("rnn"), 8, vec![unchecked("linear")].into_iter()).unwrap_err();
    assert_eq!(err, JobError::UnknownFamily("rnn".into()));
}

#[test]
fn training_settings_default_to_adam_fp32_and_reject_unknown_names() {
    let job = Job::parse(None, 8, vec![unchecked("linear")].into_iter()).unwrap();
    assert_eq!(
        (job.optimizer(), job.precision()),
        (Optimizer::Adam, Precision::Fp32)
    );
    let job = job.with_training(Some("SGD"), Some("mixed16")).unwrap();
    assert_eq!(
        (job.optimizer(), job.precision()),
        (Optimizer::Sgd, Precision::AmpFp16)
    );
    let field = |e: JobError| match e {
        JobError::Setup(e) => e.field,
        other => panic!("not a setup error: {other}"),
    };
    assert_eq!(
        field(job.clone().with_training(Some("lion"), None).unwrap_err()),
        "optimizer"
    );
    assert_eq!(
        field(job.clone().with_training(None, Some("int4")).unwrap_err()),
        "precision"
    );
    assert_eq!(
        job.clone()
            .with_input_shape(Some(&[3, 0, 224]))
            .unwrap_err(),
        JobError::InputShape
    );
    assert_eq!(
        job.with_input_shape(Some(&[3, 224, 224]))
            .unwrap()
            .input_shape(),
        Some(&[3, 224, 224][..])
    );
}

fn simulation(batch_size: u64) -> UncheckedSimulation<'static> {
    UncheckedSimulation {
        batch_size,
        optimizer: Some("adam"),
        precision: Some("fp32"),
        allocated_peak_bytes: 15,
        reserved_peak_bytes: 40,
        min_capacity_bytes: 20,
        breakdown_at_peak: SimulatedCategories {
            parameters: 1,
            gradients: 2,
            optimizer_state: 3,
            activations: 4,
            temporaries: 5,
        },
        attention: Some("efficient"),
        interpolated: false,
        ..Default::default()
    }
}

fn simulated(raw: UncheckedSimulation<'_>) -> Result<Job, JobError> {
    Job::parse(None, 8, vec![unchecked("linear")].into_iter())
        .unwrap()
        .with_simulation(Some(raw))
}

#[test]
fn a_consistent_simulation_is_kept_with_its_job() {
    let job = simulated(simulation(8)).unwrap();
    let kept = job.simulation().unwrap();
    assert_eq!(
        (
            kept.allocated_peak_bytes,
            kept.reserved_peak_bytes,
            kept.min_capacity_bytes
        ),
        (15, 40, 20)
    );
    assert_eq!(kept.breakdown_at_peak.activations, 4);
    assert_eq!(kept.attention.as_deref(), Some("efficient"));
    // Optimizer and precision may be left out, and are matched by meaning, not spelling.
    let loose = UncheckedSimulation {
        optimizer: None,
        precision: Some("FP32"),
        ..simulation(8)
    };
    assert!(simulated(loose).is_ok());
    // The bounds are inclusive: min_capacity may equal either peak.
    let tight = UncheckedSimulation {
        min_capacity_bytes: 15,
        reserved_peak_bytes: 15,
        ..simulation(8)
    };
    assert!(simulated(tight).is_ok());
    let job = Job::parse(None, 8, vec![unchecked("linear")].into_iter()).unwrap();
    assert_eq!(job.with_simulation(None).unwrap().simulation(), None);
}

#[test]
fn a_simulation_of_another_job_or_an_inconsistent_one_is_refused_naming_the_field() {
    let field = |raw: UncheckedSimulation<'_>| simulated(raw).unwrap_err().to_string();
    assert!(field(simulation(16)).starts_with("simulation.batch_size:"));
    let adamw = UncheckedSimulation {
        optimizer: Some("adamw"),
        ..simulation(8)
    };
    assert!(field(adamw).starts_with("simulation.optimizer: 'adamw'"));
    let unknown = UncheckedSimulation {
        optimizer: Some("lion"),
        ..simulation(8)
    };
    assert!(field(unknown).starts_with("simulation.optimizer:"));
    let bf16 = UncheckedSimulation {
        precision: Some("bf16"),
        ..simulation(8)
    };
    assert!(field(bf16).starts_with("simulation.precision:"));
    let above = UncheckedSimulation {
        allocated_peak_bytes: 41,
        ..simulation(8)
    };
    assert!(field(above).starts_with("simulation.reserved_peak_bytes:"));
    let low = UncheckedSimulation {
        min_capacity_bytes: 14,
        ..simulation(8)
    };
    assert!(field(low).starts_with("simulation.min_capacity_bytes:"));
    let high = UncheckedSimulation {
        min_capacity_bytes: 41,
        ..simulation(8)
    };
    assert!(field(high).starts_with("simulation.min_capacity_bytes:"));
    let mut off_by_one = simulation(8);
    off_by_one.breakdown_at_peak.temporaries = 6;
    assert!(field(off_by_one).starts_with("simulation.breakdown_at_peak:"));
    let huge = UncheckedSimulation {
        reserved_peak_bytes: MAX_SAVED_BYTES + 1,
        ..simulation(8)
    };
    assert!(field(huge).starts_with("simulation.reserved_peak_bytes: must be at most"));
    let mut huge_category = simulation(8);
    huge_category.breakdown_at_peak.gradients = u64::MAX;
    assert!(
        field(huge_category).starts_with("simulation.breakdown_at_peak.gradients: must be at most")
    );
}

#[test]
fn the_simulation_is_checked_against_the_jobs_training_settings() {
    let job = Job::parse(None, 8, vec![unchecked("linear")].into_iter()).unwrap();
    let sgd = job
        .clone()
        .with_training(Some("sgd"), Some("mixed16"))
        .unwrap();
    let raw = UncheckedSimulation {
        optimizer: Some("SGD"),
        precision: Some("amp_fp16"),
        ..simulation(8)
    };
    assert!(sgd.clone().with_simulation(Some(raw.clone())).is_ok());
    // Pure fp16 is another precision than fp16 autocast.
    let pure = UncheckedSimulation {
        precision: Some("fp16"),
        ..raw.clone()
    };
    assert!(matches!(
        sgd.clone().with_simulation(Some(pure)),
        Err(JobError::SimulatedPrecision { .. })
    ));
    // Another setup than the job's: accumulation, checkpointing.
    let accumulated = UncheckedSimulation {
        gradient_accumulation_steps: Some(2),
        ..raw.clone()
    };
    assert!(matches!(
        sgd.clone().with_simulation(Some(accumulated)),
        Err(JobError::Setup(e)) if e.field == "simulation.gradient_accumulation_steps"
    ));
    let checkpointed = UncheckedSimulation {
        activation_checkpointing: Some("full"),
        ..raw.clone()
    };
    assert!(matches!(
        sgd.with_simulation(Some(checkpointed)),
        Err(JobError::Setup(e)) if e.field == "simulation.activation_checkpointing"
    ));
    // A simulation that trained a subset is not of a job that trains every parameter.
    let subset = UncheckedSimulation {
        trainable_params: Some(1),
        ..raw.clone()
    };
    let sgd = job
        .clone()
        .with_training(Some("sgd"), Some("mixed16"))
        .unwrap();
    assert!(matches!(
        sgd.clone().with_simulation(Some(subset)),
        Err(JobError::Setup(e)) if e.field == "simulation.trainable_params"
    ));
    // The job's default (adam, fp32) is what a simulation of sgd contradicts.
    assert!(matches!(
        job.with_simulation(Some(raw)),
        Err(JobError::SimulatedOptimizer { .. })
    ));
}
