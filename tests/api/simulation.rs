//! Jobs that carry `gpucast_describe`'s whole-step simulation: physics leads the figure, the
//! figure never goes below the floor, its breakdown sums to it, `fit` follows the simulation.

use serde_json::{json, Value};

use crate::helpers::{
    assert_bound_is_the_distributions_at_95, committed_manifest, example_job,
    models_without_simulation_regressors, requires_simulation, simulated_context_mib, spawn_app,
    spawn_app_with, test_config, training_description,
};

const MIB: u64 = 1 << 20;

/// A simulation of resnet50 (25,557,032 params, Adam, fp32) that grows with the batch: 60 MiB
/// of activations and 1 MiB of temporaries per sample, a cache of 1/16 of the allocated peak.
pub fn simulation(batch: u64) -> Value {
    let params = 25_557_032u64;
    let (parameters, gradients, optimizer_state) = (4 * params, 4 * params, 8 * params);
    let activations = 60 * MIB * batch + 10 * MIB + 12_345;
    let temporaries = 200 * MIB + MIB * batch + 678;
    let allocated = parameters + gradients + optimizer_state + activations + temporaries;
    let reserved = allocated + allocated / 16 + 20 * MIB;
    let min_capacity = allocated + (reserved - allocated) / 3;
    json!({
        "batch_size": batch,
        "optimizer": "adam",
        "precision": "fp32",
        "allocated_peak_bytes": allocated,
        "reserved_peak_bytes": reserved,
        "min_capacity_bytes": min_capacity,
        "breakdown_at_peak": {
            "parameters": parameters, "gradients": gradients, "optimizer_state": optimizer_state,
            "activations": activations, "temporaries": temporaries
        },
        "attention": "none",
        "interpolated": false
    })
}

fn mib(bytes: &Value) -> f64 {
    bytes.as_u64().unwrap() as f64 / MIB as f64
}

/// resnet50 as `describe` writes it (with its saved tensors), at `batch`, with its simulation.
pub fn simulated_job(batch: u64) -> Value {
    let mut job = training_description("timm:resnet50");
    job["batch_size"] = batch.into();
    job["simulation"] = simulation(batch);
    job
}

pub fn figure(body: &Value, field: &str) -> f64 {
    body["memory"][field]
        .as_f64()
        .unwrap_or_else(|| panic!("memory.{field} in {body}"))
}

/// The class holds the answered figure (figures are rounded to 0.1 MiB).
pub fn assert_class_contains_the_estimate(body: &Value) {
    let estimate = figure(body, "estimate_mib");
    let class = &body["memory"]["class"];
    let lower = class["lower_mib"].as_f64().unwrap();
    assert!(
        estimate > lower - 0.05,
        "{estimate} below its class {class}"
    );
    if let Some(upper) = class["upper_mib"].as_f64() {
        assert!(
            estimate <= upper + 0.05,
            "{estimate} above its class {class}"
        );
    }
    let probabilities: Vec<f64> = class["probabilities"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_f64().unwrap())
        .collect();
    let argmax = (0..probabilities.len()).fold(0, |best, i| {
        if probabilities[i] > probabilities[best] {
            i
        } else {
            best
        }
    });
    assert_eq!(
        class["index"], argmax,
        "the figure's class is also the most probable: {class}"
    );
    assert!((probabilities.iter().sum::<f64>() - 1.0).abs() < 1e-3);
}

/// The breakdown sums to the figure, and the figure is at least the floor.
pub fn assert_breakdown_and_floor(body: &Value) -> Value {
    let estimate = figure(body, "estimate_mib");
    let bound = figure(body, "upper_bound_mib");
    assert!(bound >= estimate, "{body}");
    let breakdown = body["memory"]["breakdown"].clone();
    let names = [
        "parameters",
        "gradients",
        "optimizer_state",
        "activations",
        "temporaries",
        "allocator_cache",
        "cuda_context",
    ];
    let parts: Vec<f64> = names
        .iter()
        .map(|n| {
            breakdown[n]
                .as_f64()
                .unwrap_or_else(|| panic!("breakdown.{n}: {body}"))
        })
        .collect();
    assert!(parts.iter().all(|&p| p >= 0.0), "{breakdown}");
    assert!(
        (parts.iter().sum::<f64>() - estimate).abs() < 0.05,
        "{breakdown} does not sum to {estimate}"
    );
    let simulated = body["memory"]["breakdown_source"] == "simulation";
    let floor = parts[0] + parts[1] + parts[2] + if simulated { parts[3] } else { 0.0 } + parts[6];
    assert!(
        estimate >= floor - 0.05,
        "{estimate} below the floor {floor}"
    );
    breakdown
}

/// Without a regressor that corrects it (the committed models less those regressors and their
/// domain), the simulated figure leads.
#[tokio::test]
async fn a_simulated_job_is_answered_by_physics_with_a_breakdown_that_sums_to_the_figure() {
    let models = models_without_simulation_regressors();
    let app = spawn_app_with(test_config(models.path())).await;
    let context = simulated_context_mib();
    let job = simulated_job(64);
    let response = app.post_json("/v1/estimate", &job).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    let simulation = &job["simulation"];

    // The figure is the simulated one: the reserved peak (it fits the 40 GB card) + the context.
    let expected = mib(&simulation["reserved_peak_bytes"]) + context;
    let simulated = body["memory"]["estimators"]["simulated"]["estimate_mib"]
        .as_f64()
        .unwrap();
    assert!(
        (simulated - expected).abs() < 0.05,
        "{simulated} vs {expected}"
    );
    assert_eq!(
        body["memory"]["estimate_mib"], body["memory"]["estimators"]["simulated"]["estimate_mib"],
        "{body}"
    );
    // The regressors still answer, under their own names, without leading.
    for name in [
        "cnn_memory_regressor",
        "cnn_traced_memory_regressor",
        "first_principles",
        "traced_first_principles",
    ] {
        assert!(
            body["memory"]["estimators"][name]["estimate_mib"]
                .as_f64()
                .is_some(),
            "{name}"
        );
    }
    assert_eq!(body["estimator_versions"]["simulated"], "1.0.0");
    assert!(body["latency_us"]["simulated"].as_f64().unwrap() > 0.0);
    // No domain: the job is not placed against one, and the bound is not widened.
    assert!(body["memory"]["extrapolation"].is_null(), "{body}");
    assert_no_simulation_regressor_answered(&body);
    // The bound at 0.95 is the distribution of the figure's terms at 0.95.
    assert_bound_is_the_distributions_at_95(&body, 1.0);
    assert_eq!(body["memory"]["floored"], false);

    assert_eq!(body["memory"]["breakdown_source"], "simulation");
    let breakdown = assert_breakdown_and_floor(&body);
    let at_peak = &simulation["breakdown_at_peak"];
    for name in [
        "parameters",
        "gradients",
        "optimizer_state",
        "activations",
        "temporaries",
    ] {
        assert!(
            (breakdown[name].as_f64().unwrap() - mib(&at_peak[name])).abs() <= 0.1,
            "{name}: {breakdown}"
        );
    }
    let cache = mib(&simulation["reserved_peak_bytes"]) - mib(&simulation["allocated_peak_bytes"]);
    assert!(
        (breakdown["allocator_cache"].as_f64().unwrap() - cache).abs() <= 0.1,
        "{breakdown}"
    );
    assert_eq!(breakdown["cuda_context"], context);
    for (field, bytes) in [
        ("allocated_peak_mib", "allocated_peak_bytes"),
        ("reserved_peak_mib", "reserved_peak_bytes"),
        ("min_capacity_mib", "min_capacity_bytes"),
    ] {
        assert!(
            (figure(&body, field) - mib(&simulation[bytes])).abs() <= 0.05,
            "{field}"
        );
    }
    assert_class_contains_the_estimate(&body);
    assert_eq!(body["fit"]["basis"], "simulation");
}

#[tokio::test]
async fn jobs_without_a_simulation_get_an_analytic_breakdown_and_no_simulated_figures() {
    let app = spawn_app().await;
    let mut traced = training_description("timm:resnet50");
    traced["batch_size"] = 64.into();
    let mut plain = traced.clone();
    plain.as_object_mut().unwrap().remove("saved_tensors");
    for job in [example_job(), traced, plain] {
        let body: Value = app.post_json_value("/v1/estimate", &job).await;
        assert_eq!(body["memory"]["breakdown_source"], "analytic", "{body}");
        let breakdown = assert_breakdown_and_floor(&body);
        assert_eq!(
            breakdown["cuda_context"],
            gpucast::physics::analytic::FRAMEWORK_OVERHEAD_MIB
        );
        assert_eq!(breakdown["allocator_cache"], 0.0);
        for field in [
            "allocated_peak_mib",
            "reserved_peak_mib",
            "min_capacity_mib",
        ] {
            assert!(body["memory"][field].is_null(), "{field}: {body}");
        }
        assert!(body["memory"]["estimators"].get("simulated").is_none());
        assert_eq!(body["memory"]["floored"], false);
        assert_eq!(body["fit"]["basis"], "upper_bound");
        assert_class_contains_the_estimate(&body);
    }
}

/// The class follows the figure for every kind of job, also where the classifiers disagree.
#[tokio::test]
async fn the_class_contains_the_estimate_for_simulated_traced_and_plain_jobs() {
    let app = spawn_app().await;
    let mut jobs = vec![example_job()];
    for batch in [8, 64, 256, 600] {
        let mut traced = training_description("timm:resnet50");
        traced["batch_size"] = batch.into();
        let mut plain = traced.clone();
        plain.as_object_mut().unwrap().remove("saved_tensors");
        jobs.extend([simulated_job(batch), traced, plain]);
    }
    let mut vit = training_description("timm:vit_base_patch16_224");
    vit["batch_size"] = 32.into();
    jobs.push(vit);
    let body: Value = app
        .post_json_value("/v1/estimate/batch", &json!({ "items": jobs }))
        .await;
    for item in body["items"].as_array().unwrap() {
        assert_eq!(item["status"], 200, "{item}");
        assert_class_contains_the_estimate(&item["estimate"]);
        assert_breakdown_and_floor(&item["estimate"]);
    }
}

/// A scheduler that halves a batch to make a job fit must see the figure fall: over a family
/// of simulations that grow with the batch, through the card's capacity (capped figures) and
/// past it (the job no longer runs there).
#[tokio::test]
async fn simulated_figures_never_shrink_as_the_batch_grows() {
    let app = spawn_app().await;
    let mut batches: Vec<u64> = (0..11).map(|p| 1u64 << p).collect();
    batches.extend((596..=640).step_by(4));
    batches.sort_unstable();
    let mut answers = Vec::new();
    for chunk in batches.chunks(8) {
        let items: Vec<Value> = chunk.iter().map(|&b| simulated_job(b)).collect();
        let body: Value = app
            .post_json_value("/v1/estimate/batch", &json!({ "items": items }))
            .await;
        for item in body["items"].as_array().unwrap() {
            assert_eq!(item["status"], 200, "{item}");
            answers.push(item["estimate"].clone());
        }
    }
    let series = |field: &str| answers.iter().map(|a| figure(a, field)).collect::<Vec<_>>();
    for field in [
        "estimate_mib",
        "upper_bound_mib",
        "reserved_peak_mib",
        "min_capacity_mib",
    ] {
        let values = series(field);
        assert!(
            values.windows(2).all(|w| w[1] >= w[0]),
            "{field} shrinks: {values:?}"
        );
    }
    let fits: Vec<bool> = answers
        .iter()
        .map(|a| a["fit"]["fits"].as_bool().unwrap())
        .collect();
    assert!(
        fits[0] && !fits[fits.len() - 1] && fits.windows(2).all(|w| w[0] || !w[1]),
        "{fits:?}"
    );
    // Some batch runs on the card without room for its whole reserved peak: its simulated figure
    // is capped at the card, and so is the figure answered, whichever estimator leads.
    let context = simulated_context_mib();
    let capped = answers.iter().any(|a| {
        figure(a, "min_capacity_mib") + context <= 40_960.0
            && figure(a, "reserved_peak_mib") + context > 40_960.0
            && (estimators_figure(a, "simulated") - 40_960.0).abs() < 0.05
            && figure(a, "estimate_mib") <= 40_960.05
    });
    assert!(capped, "no batch size exercised the cap");
    for answer in &answers {
        assert_breakdown_and_floor(answer);
        assert_class_contains_the_estimate(answer);
    }
}

#[tokio::test]
async fn fit_follows_the_simulation_and_a_memory_fraction_caps_what_each_copy_occupies() {
    let app = spawn_app().await;
    let job = simulated_job(64);
    let reserved = mib(&job["simulation"]["reserved_peak_bytes"]);
    let min_capacity = mib(&job["simulation"]["min_capacity_bytes"]);
    assert!(
        min_capacity > 4096.0 && min_capacity < 10_240.0,
        "the cases below assume it: {min_capacity}"
    );
    let fit_with = |fraction: Option<f64>| {
        let mut job = job.clone();
        if let Some(f) = fraction {
            job["memory_fraction"] = f.into();
        }
        job
    };
    let context = simulated_context_mib();
    let body: Value = app.post_json_value("/v1/estimate", &fit_with(None)).await;
    assert_eq!(body["fit"]["fits"], true);
    // Each copy occupies its reserved peak, or its bound where the doubt reaches beyond.
    let occupied = (reserved + context).max(body["memory"]["upper_bound_mib"].as_f64().unwrap());
    assert_eq!(
        body["fit"]["max_colocated"],
        (40_960.0 / occupied).floor() as u64,
        "{body}"
    );
    // A quarter of the card: 10,240 MiB holds the step; each copy occupies 10,240 MiB + the
    // context (3 copies while the context is under 3,413 MiB).
    assert!(
        context < 40_960.0 / 3.0 - 10_240.0,
        "the case below assumes it: {context}"
    );
    let body: Value = app
        .post_json_value("/v1/estimate", &fit_with(Some(0.25)))
        .await;
    assert_eq!(
        (
            body["fit"]["fits"].clone(),
            body["fit"]["max_colocated"].clone()
        ),
        (json!(true), json!(3)),
        "{body}"
    );
    // A tenth: 4,096 MiB is less than the step needs.
    let body: Value = app
        .post_json_value("/v1/estimate", &fit_with(Some(0.1)))
        .await;
    assert_eq!(
        (
            body["fit"]["fits"].clone(),
            body["fit"]["max_colocated"].clone()
        ),
        (json!(false), json!(0)),
        "{body}"
    );
    // The whole card: one copy.
    let body: Value = app
        .post_json_value("/v1/estimate", &fit_with(Some(1.0)))
        .await;
    assert_eq!(body["fit"]["max_colocated"], 1);

    // Without a simulation the bound decides, within the cap plus the framework overhead.
    let mut plain = example_job();
    plain["memory_fraction"] = 0.25.into();
    let body: Value = app.post_json_value("/v1/estimate", &plain).await;
    assert_eq!(body["fit"]["basis"], "upper_bound");
    assert_eq!(body["fit"]["fits"], true);
    let occupied = 10_240.0 + gpucast::physics::analytic::FRAMEWORK_OVERHEAD_MIB;
    assert_eq!(
        body["fit"]["max_colocated"],
        (40_960.0 / occupied).floor() as u64,
        "{body}"
    );
}

/// On the committed models: a step that does not run on the 40 GB card the simulation
/// regressors' labels were measured on is not corrected by them, whatever its distance from
/// their data; the simulated figure leads.
#[tokio::test]
async fn a_simulation_that_does_not_fit_the_card_is_answered_uncapped_and_does_not_fit() {
    let app = spawn_app().await;
    let job = simulated_job(1024);
    let body: Value = app.post_json_value("/v1/estimate", &job).await;
    let context = simulated_context_mib();
    assert!(
        mib(&job["simulation"]["min_capacity_bytes"]) + context > 40_960.0,
        "the step does not run on the card"
    );
    let expected = mib(&job["simulation"]["reserved_peak_bytes"]) + context;
    assert!(
        (figure(&body, "estimate_mib") - expected).abs() < 0.05,
        "{body}"
    );
    assert_eq!(
        body["memory"]["estimate_mib"], body["memory"]["estimators"]["simulated"]["estimate_mib"],
        "{body}"
    );
    assert_eq!(body["memory"]["floored"], false, "{body}");
    assert_no_simulation_regressor_answered(&body);
    assert_eq!(
        (
            body["fit"]["fits"].clone(),
            body["fit"]["max_colocated"].clone()
        ),
        (json!(false), json!(0))
    );
    assert_eq!(
        body["memory"]["class"]["upper_mib"],
        Value::Null,
        "the top class: does not fit the 40 GB card"
    );
    // On an H200 it runs, and its whole reserved peak fits.
    let mut h200 = job.clone();
    h200["gpu"] = "h200-141gb".into();
    let body: Value = app.post_json_value("/v1/estimate", &h200).await;
    assert_eq!(body["fit"]["fits"], true);
    assert!(
        (figure(&body, "estimate_mib") - expected).abs() < 0.05,
        "{body}"
    );
    // Runs on the H200, not on the card the correction was measured on: still not corrected.
    assert_eq!(
        body["memory"]["estimate_mib"], body["memory"]["estimators"]["simulated"]["estimate_mib"],
        "{body}"
    );
    assert_no_simulation_regressor_answered(&body);
}

/// No regressor that requires the simulation ran (none named among the estimators or their
/// versions), and the answer says the correction was not applied.
pub fn assert_no_simulation_regressor_answered(body: &Value) {
    let manifest = committed_manifest();
    let correcting = manifest["estimators"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| requires_simulation(e));
    for name in correcting.map(|e| e["name"].as_str().unwrap()) {
        assert!(
            body["memory"]["estimators"].get(name).is_none(),
            "{name}: {body}"
        );
        assert!(
            body["estimator_versions"].get(name).is_none(),
            "{name}: {body}"
        );
    }
    if !body["memory"]["extrapolation"].is_null() {
        assert_eq!(
            body["memory"]["extrapolation"]["correction_applied"], false,
            "{body}"
        );
    }
}

/// Every invalid simulation, and an invalid memory fraction, gets a 422 naming the field.
#[tokio::test]
async fn invalid_simulations_are_refused_naming_the_field() {
    let app = spawn_app().await;
    let with = |edit: &dyn Fn(&mut Value)| {
        let mut job = simulated_job(64);
        edit(&mut job);
        job
    };
    let huge = 1u64 << 45;
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "reserved below allocated",
            with(&|j| {
                j["simulation"]["reserved_peak_bytes"] = j["simulation"]["allocated_peak_bytes"]
                    .as_u64()
                    .map(|a| a - 1)
                    .into()
            }),
            "simulation.reserved_peak_bytes",
        ),
        (
            "min capacity below allocated",
            with(&|j| {
                j["simulation"]["min_capacity_bytes"] = j["simulation"]["allocated_peak_bytes"]
                    .as_u64()
                    .map(|a| a - 1)
                    .into()
            }),
            "simulation.min_capacity_bytes",
        ),
        (
            "min capacity above reserved",
            with(&|j| {
                j["simulation"]["min_capacity_bytes"] = j["simulation"]["reserved_peak_bytes"]
                    .as_u64()
                    .map(|r| r + 1)
                    .into()
            }),
            "simulation.min_capacity_bytes",
        ),
        (
            "breakdown off by one byte",
            with(&|j| {
                j["simulation"]["breakdown_at_peak"]["temporaries"] = j["simulation"]
                    ["breakdown_at_peak"]["temporaries"]
                    .as_u64()
                    .map(|t| t + 1)
                    .into()
            }),
            "simulation.breakdown_at_peak",
        ),
        (
            "another batch size",
            with(&|j| j["simulation"]["batch_size"] = 32.into()),
            "simulation.batch_size",
        ),
        (
            "another optimizer",
            with(&|j| j["simulation"]["optimizer"] = "adamw".into()),
            "simulation.optimizer",
        ),
        (
            "another precision",
            with(&|j| j["simulation"]["precision"] = "bf16".into()),
            "simulation.precision",
        ),
        (
            "unknown optimizer",
            with(&|j| j["simulation"]["optimizer"] = "lion".into()),
            "simulation.optimizer",
        ),
        (
            "over 16 TiB",
            with(&|j| j["simulation"]["reserved_peak_bytes"] = huge.into()),
            "simulation.reserved_peak_bytes",
        ),
        (
            "category over 16 TiB",
            with(&|j| j["simulation"]["breakdown_at_peak"]["activations"] = huge.into()),
            "simulation.breakdown_at_peak.activations",
        ),
        (
            "fractional bytes",
            with(&|j| j["simulation"]["allocated_peak_bytes"] = 1.5.into()),
            "simulation.allocated_peak_bytes",
        ),
        (
            "negative bytes",
            with(&|j| j["simulation"]["min_capacity_bytes"] = (-1).into()),
            "simulation.min_capacity_bytes",
        ),
        (
            "bytes as a string",
            with(&|j| j["simulation"]["allocated_peak_bytes"] = "9e9".into()),
            "simulation.allocated_peak_bytes",
        ),
        (
            "missing breakdown",
            with(&|j| {
                j["simulation"]
                    .as_object_mut()
                    .unwrap()
                    .remove("breakdown_at_peak");
            }),
            "simulation",
        ),
        (
            "missing category",
            with(&|j| {
                j["simulation"]["breakdown_at_peak"]
                    .as_object_mut()
                    .unwrap()
                    .remove("gradients");
            }),
            "simulation.breakdown_at_peak",
        ),
        (
            "unknown field",
            with(&|j| j["simulation"]["peak_bytes"] = 1.into()),
            "simulation",
        ),
        (
            "unknown category",
            with(&|j| j["simulation"]["breakdown_at_peak"]["workspaces"] = 0.into()),
            "simulation.breakdown_at_peak",
        ),
        (
            "interpolated not a bool",
            with(&|j| j["simulation"]["interpolated"] = "yes".into()),
            "simulation.interpolated",
        ),
        (
            "zero memory fraction",
            with(&|j| j["memory_fraction"] = 0.into()),
            "memory_fraction",
        ),
        (
            "memory fraction above one",
            with(&|j| j["memory_fraction"] = 1.5.into()),
            "memory_fraction",
        ),
        (
            "negative memory fraction",
            with(&|j| j["memory_fraction"] = (-0.2).into()),
            "memory_fraction",
        ),
    ];
    for (name, body, needle) in &cases {
        let response = app.post_json("/v1/estimate", body).await;
        assert_eq!(response.status(), 422, "{name}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "{name}"
        );
        let problem: Value = response.json().await.unwrap();
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.starts_with(needle),
            "{name}: detail {detail:?} should name {needle:?}"
        );
    }
    // In a batch, the error is placed at its item; the other items are answered.
    let items = json!({"items": [simulated_job(64), cases[0].1.clone()]});
    let body: Value = app.post_json_value("/v1/estimate/batch", &items).await;
    assert_eq!(body["items"][0]["status"], 200);
    assert_eq!(body["items"][1]["status"], 422);
    let detail = body["items"][1]["error"]["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("items[1].simulation.reserved_peak_bytes"),
        "{detail}"
    );
}

/// A copy of the committed models, less their own simulation regressors and domain
/// ([`models_without_simulation_regressors`]), with the plain CNN regressor's graph and features
/// under a name that requires a simulation: a stand-in simulation regressor whose figures the
/// tests can predict, and no domain (every simulated job is corrected).
pub fn models_with_a_simulation_regressor() -> tempfile::TempDir {
    let models = models_without_simulation_regressors();
    let manifest_path = models.path().join("manifest.json");
    let mut manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(&manifest_path).unwrap()).unwrap();
    let estimators = manifest["estimators"].as_array_mut().unwrap();
    let mut entry = estimators
        .iter()
        .find(|e| e["name"] == "cnn_memory_regressor")
        .unwrap()
        .clone();
    entry["name"] = "cnn_simulated_memory_regressor".into();
    entry["requires"] = json!(["simulation", "saved_tensors"]);
    estimators.insert(0, entry);
    std::fs::write(&manifest_path, manifest.to_string()).unwrap();
    models
}

/// A regressor that requires the simulation leads over the simulated figure and over the
/// traced regressor; what it adds to physics shows in the temporaries, and the floor holds it.
#[tokio::test]
async fn a_regressor_that_requires_the_simulation_leads_and_the_floor_holds_it() {
    let models = models_with_a_simulation_regressor();
    let app = spawn_app_with(test_config(models.path())).await;

    let job = simulated_job(64);
    let body: Value = app.post_json_value("/v1/estimate", &job).await;
    let estimators = &body["memory"]["estimators"];
    let learned = estimators["cnn_simulated_memory_regressor"]["estimate_mib"]
        .as_f64()
        .unwrap();
    let simulated = estimators["simulated"]["estimate_mib"].as_f64().unwrap();
    assert_eq!(figure(&body, "estimate_mib"), learned, "{body}");
    assert!(
        learned > simulated
            && estimators["cnn_traced_memory_regressor"]["estimate_mib"]
                .as_f64()
                .unwrap()
                != learned
    );
    assert_eq!(body["memory"]["breakdown_source"], "simulation");
    let breakdown = assert_breakdown_and_floor(&body);
    let temporaries = mib(&job["simulation"]["breakdown_at_peak"]["temporaries"]);
    assert!(
        (breakdown["temporaries"].as_f64().unwrap() - (temporaries + learned - simulated)).abs()
            <= 0.2,
        "{breakdown}"
    );
    assert_eq!(body["memory"]["floored"], false);
    assert_class_contains_the_estimate(&body);

    // Activations the regressor cannot have seen (30 GiB at the peak): the floor raises it.
    let mut heavy = job.clone();
    let extra = 30 * 1024 * MIB;
    for field in [
        "allocated_peak_bytes",
        "reserved_peak_bytes",
        "min_capacity_bytes",
    ] {
        heavy["simulation"][field] = (heavy["simulation"][field].as_u64().unwrap() + extra).into();
    }
    let activations = &mut heavy["simulation"]["breakdown_at_peak"]["activations"];
    *activations = (activations.as_u64().unwrap() + extra).into();
    let body: Value = app.post_json_value("/v1/estimate", &heavy).await;
    assert_eq!(body["memory"]["floored"], true, "{body}");
    let breakdown = assert_breakdown_and_floor(&body);
    assert_eq!(
        (
            breakdown["temporaries"].as_f64(),
            breakdown["allocator_cache"].as_f64()
        ),
        (Some(0.0), Some(0.0)),
        "{breakdown}"
    );
    let at_peak = &heavy["simulation"]["breakdown_at_peak"];
    let model_and_activations: f64 = ["parameters", "gradients", "optimizer_state", "activations"]
        .iter()
        .map(|n| mib(&at_peak[n]))
        .sum();
    let floor = model_and_activations + simulated_context_mib();
    assert!(
        (figure(&body, "estimate_mib") - floor).abs() < 0.05,
        "{body}"
    );
    assert!(estimators_figure(&body, "cnn_simulated_memory_regressor") < floor);
}

fn estimators_figure(body: &Value, name: &str) -> f64 {
    body["memory"]["estimators"][name]["estimate_mib"]
        .as_f64()
        .unwrap()
}

/// describe simulates a step that keeps everything on the GPU: with offload the simulation is
/// of another setup, a 422 naming `offload`.
#[tokio::test]
async fn a_simulation_is_not_of_an_offloaded_step() {
    let app = spawn_app().await;
    let mut job = simulated_job(64);
    job["offload"] = json!({"optimizer_state": true});
    let response = app.post_json("/v1/estimate", &job).await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"].as_str().unwrap().starts_with("offload"),
        "{problem}"
    );
}
