use serde_json::{json, Value};

use crate::helpers::{
    assert_class_holds_figure, example_job, held_out_mlp_jobs, repo_root, spawn_app,
    training_description, training_descriptions,
};

#[tokio::test]
async fn estimating_the_example_job_returns_every_documented_field() {
    let app = spawn_app().await;
    let mut job = example_job();
    job["estimators"] = "all".into();
    let response = app.post_json("/v1/estimate", &job).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();

    let class = &body["memory"]["class"];
    let index = class["index"].as_u64().unwrap() as usize;
    assert_eq!(class["lower_mib"], json!(index as u64 * 1000));
    let probabilities = class["probabilities"].as_array().unwrap();
    assert_eq!(probabilities.len(), 6);
    let sum: f64 = probabilities.iter().map(|p| p.as_f64().unwrap()).sum();
    assert!((sum - 1.0).abs() < 1e-3, "probabilities sum to {sum}");
    // The example job measured 1545 MiB on the A100: class (1000, 2000].
    assert_eq!(index, 1, "{body}");
    assert_eq!(class["upper_mib"], json!(2000));

    let estimators = body["memory"]["estimators"].as_object().unwrap();
    assert!(
        estimators.contains_key("mlp_ensemble") && estimators.contains_key("sequence_transformer"),
        "{body}"
    );
    for name in ["mlp_ensemble", "sequence_transformer"] {
        assert!(
            estimators[name]["class"]["index"].is_u64() && estimators[name]["version"].is_string()
        );
    }
    // The analytic formulas answer for every family, in MiB.
    for name in ["first_principles", "horus"] {
        assert!(
            estimators[name]["estimate_mib"].as_f64().unwrap() > 0.0,
            "{name}"
        );
    }
    assert_eq!(body["memory"]["confidence"], 0.95);

    for metric in ["smact", "smocc", "drama"] {
        let value = body["utilization"][metric].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&value), "{metric} = {value}");
    }
    // SMACT from the learned MLP regressor, SMOCC and DRAMA from the roofline
    // (docs/design/roofline.md); nothing is null.
    assert_eq!(
        body["utilization"]["sources"],
        json!({"smact": "learned", "smocc": "roofline", "drama": "roofline"})
    );
    assert_eq!(body["utilization"]["null_reasons"], json!({}));
    assert!(body["performance"]["step_time_ms"].as_f64().unwrap() > 0.0);

    let latency = body["latency_us"].as_object().unwrap();
    assert!(latency["total"].as_f64().unwrap() > 0.0);
    for name in [
        "mlp_ensemble",
        "sequence_transformer",
        "smact",
        "smocc",
        "first_principles",
        "horus",
    ] {
        // to 0.1 us: the analytic formulas take well under a microsecond
        let us = latency[name].to_string();
        assert!(
            latency[name].as_f64().unwrap() >= 0.0 && us.split('.').nth(1).map_or(0, str::len) <= 1,
            "latency of {name}: {us}"
        );
        assert!(
            body["estimator_versions"][name].is_string(),
            "version of {name}"
        );
    }
    assert_eq!(body["family"], "mlp");
    // By default the classifiers do not run: the same figures, bound, fit and class, the class
    // probabilities all on the figure's class, and no classifier opinions.
    let plain: Value = app.post_json_value("/v1/estimate", &example_job()).await;
    for key in [
        "estimate_mib",
        "upper_bound_mib",
        "breakdown",
        "uncertainty",
    ] {
        assert_eq!(plain["memory"][key], body["memory"][key], "{key}");
    }
    for key in ["fit", "utilization", "performance", "setup", "warnings"] {
        assert_eq!(plain[key], body[key], "{key}");
    }
    assert_eq!(
        plain["memory"]["class"]["index"],
        body["memory"]["class"]["index"]
    );
    assert_eq!(
        plain["memory"]["class"]["probabilities"],
        json!([0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    );
    let opinions = plain["memory"]["estimators"].as_object().unwrap();
    assert!(
        !opinions.contains_key("mlp_ensemble") && !opinions.contains_key("sequence_transformer")
    );
    let response = app
        .post_json(
            "/v1/estimate",
            &json!({"batch_size": 8, "estimators": "some",
            "layers": [{"kind": "linear", "output_size": 10, "params": 110}]}),
        )
        .await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .starts_with("estimators"),
        "{problem}"
    );
}

#[tokio::test]
async fn the_family_is_inferred_and_gpumemnet_spellings_are_accepted() {
    let app = spawn_app().await;
    let job = json!({
        "batch_size": 64,
        "layers": [
            {"kind": "Linear", "output_size": 512, "params": 401920},
            {"kind": "batch_normalization", "output_size": 512, "params": 1024},
            {"kind": "LeakyReLU", "output_size": 512, "params": 0},
            {"kind": "linear", "output_size": 10, "params": 5130},
            {"kind": "Softmax", "output_size": 10, "params": 0}
        ]
    });
    let response = app.post_json("/v1/estimate", &job).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["family"], "mlp");
    // What was assumed is said: the family, the setup, each kind read in another spelling once.
    let warnings: Vec<&str> = body["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap())
        .collect();
    let said = |prefix: &str| warnings.iter().find(|w| w.starts_with(prefix)).copied();
    assert!(
        said("family: not given; mlp inferred").is_some(),
        "{warnings:?}"
    );
    assert!(
        said("optimizer: not given; adam assumed").is_some(),
        "{warnings:?}"
    );
    assert!(
        said("precision: not given; fp32 assumed").is_some(),
        "{warnings:?}"
    );
    let kinds = said("layers: kinds read").expect("mapped kinds are said");
    for mapped in [
        "'Linear' as linear",
        "'batch_normalization' as batch_norm",
        "'LeakyReLU' as leaky_relu",
        "'Softmax' as softmax",
    ] {
        assert!(kinds.contains(mapped), "{kinds}");
    }
    assert!(!kinds.contains("'linear'"), "{kinds}");
}

#[tokio::test]
async fn a_bigger_job_never_gets_a_smaller_class() {
    let app = spawn_app().await;
    let job = |batch: u64, width: u64| {
        json!({"batch_size": batch, "layers": [
            {"kind": "linear", "output_size": width, "params": width * 4096 + width},
            {"kind": "relu", "output_size": width, "params": 0},
            {"kind": "linear", "output_size": width, "params": width * width + width},
            {"kind": "relu", "output_size": width, "params": 0},
            {"kind": "linear", "output_size": 10, "params": width * 10 + 10},
            {"kind": "softmax", "output_size": 10, "params": 0}
        ]})
    };
    let class = |body: Value| body["memory"]["class"]["index"].as_u64().unwrap();
    let small = class(app.post_json_value("/v1/estimate", &job(32, 256)).await);
    let large = class(app.post_json_value("/v1/estimate", &job(2048, 8192)).await);
    assert!(
        large > small,
        "small job class {small}, large job class {large}"
    );
}

/// Every bad input of the brief gets a problem-details 4xx naming what is wrong, never a 5xx.
#[tokio::test]
async fn bad_inputs_get_a_client_error_naming_the_field() {
    let app = spawn_app().await;
    let layer = json!({"kind": "linear", "output_size": 10, "params": 110});
    let too_many_layers: Vec<Value> = (0..5000).map(|_| layer.clone()).collect();
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("malformed JSON", "{\"batch_size\": 8, \"layers\": [".into(), 400, "malformed"),
        ("not JSON at all", "hello".into(), 400, "malformed"),
        ("non-finite number", "{\"batch_size\": NaN, \"layers\": []}".into(), 400, "malformed"),
        ("number out of range", "{\"batch_size\": 1e400, \"layers\": []}".into(), 400, "malformed"),
        ("wrong type", json!({"batch_size": "eight", "layers": [layer]}).to_string(), 422, "batch_size"),
        ("negative batch", json!({"batch_size": -8, "layers": [layer]}).to_string(), 422, "batch_size"),
        ("fractional batch", json!({"batch_size": 8.5, "layers": [layer]}).to_string(), 422, "batch_size"),
        ("zero batch", json!({"batch_size": 0, "layers": [layer]}).to_string(), 422, "batch_size"),
        ("negative params", json!({"batch_size": 8, "layers": [{"kind": "linear", "output_size": 10, "params": -1}]}).to_string(), 422, "layers[0].params"),
        ("absurd params", json!({"batch_size": 8, "layers": [{"kind": "linear", "output_size": 10, "params": 1u64 << 62}]}).to_string(), 422, "layers[0].params"),
        ("missing field", json!({"batch_size": 8, "layers": [{"kind": "linear", "params": 1}]}).to_string(), 422, "layers[0]"),
        ("unknown field", json!({"batch_size": 8, "layers": [layer], "bacth": 1}).to_string(), 422, "bacth"),
        ("empty layer list", json!({"batch_size": 8, "layers": []}).to_string(), 422, "layers"),
        ("absurdly long layer list", json!({"batch_size": 8, "layers": too_many_layers}).to_string(), 422, "layers"),
        ("unknown layer kind", json!({"batch_size": 8, "layers": [layer, {"kind": "warp_drive", "output_size": 1, "params": 0}]}).to_string(), 422, "layers[1].kind"),
        ("unknown family", json!({"family": "rnn", "batch_size": 8, "layers": [layer]}).to_string(), 422, "family"),
        ("array instead of object", "[1, 2, 3]".into(), 422, "body"),
        ("empty body", String::new(), 400, "malformed"),
        ("confidence out of range", json!({"batch_size": 8, "layers": [layer], "confidence": 1.5}).to_string(), 422, "confidence"),
        ("unknown optimizer", json!({"batch_size": 8, "layers": [layer], "optimizer": "lion"}).to_string(), 422, "optimizer"),
        ("unknown precision", json!({"batch_size": 8, "layers": [layer], "precision": "int4"}).to_string(), 422, "precision"),
        ("absurd sequence length", json!({"batch_size": 8, "layers": [layer], "seq_len": 1u64 << 63}).to_string(), 422, "seq_len"),
        ("zero input dimension", json!({"batch_size": 8, "layers": [layer], "input_shape": [3, 0]}).to_string(), 422, "input_shape"),
        ("negative saved bytes", json!({"batch_size": 8, "layers": [layer], "saved_tensors": {"per_sample_bytes": -1, "fixed_bytes": 0}}).to_string(), 422, "saved_tensors.per_sample_bytes"),
        ("absurd saved bytes", json!({"batch_size": 8, "layers": [layer], "saved_tensors": {"per_sample_bytes": 1, "fixed_bytes": 1u64 << 50}}).to_string(), 422, "saved_tensors.fixed_bytes"),
        ("incomplete saved tensors", json!({"batch_size": 8, "layers": [layer], "saved_tensors": {"per_sample_bytes": 1}}).to_string(), 422, "saved_tensors"),
    ];
    for (name, body, status, needle) in cases {
        let response = app.post_raw("/v1/estimate", "application/json", body).await;
        assert_eq!(response.status().as_u16(), status, "{name}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "{name}"
        );
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["status"], status, "{name}");
        let detail = problem["detail"].as_str().unwrap().to_lowercase();
        assert!(
            detail.contains(&needle.to_lowercase()),
            "{name}: detail {detail:?} should mention {needle:?}"
        );
    }
}

#[tokio::test]
async fn an_oversized_body_is_refused_with_413() {
    let app = spawn_app().await;
    let body = format!(
        "{{\"batch_size\": 8, \"layers\": [], \"pad\": \"{}\"}}",
        "x".repeat(3 * 1024 * 1024)
    );
    let response = app.post_raw("/v1/estimate", "application/json", body).await;
    assert_eq!(response.status(), 413);
    let problem: Value = response.json().await.unwrap();
    assert!(problem["detail"].as_str().unwrap().contains("limit"));
}

#[tokio::test]
async fn a_body_that_is_not_json_by_content_type_is_refused_with_415() {
    let app = spawn_app().await;
    let response = app
        .post_raw("/v1/estimate", "text/plain", example_job().to_string())
        .await;
    assert_eq!(response.status(), 415);
}

/// An MLP deeper than the sequence classifier reads (512 positions) is answered by the
/// family's other estimators, and the answer names the one left out.
#[tokio::test]
async fn an_mlp_deeper_than_the_sequence_classifier_is_answered_without_it() {
    let app = spawn_app().await;
    let layers: Vec<Value> = (0..300)
        .flat_map(|_| {
            [
                json!({"kind": "linear", "output_size": 256, "params": 65792}),
                json!({"kind": "relu", "output_size": 256, "params": 0}),
            ]
        })
        .collect();
    let response = app
        .post_json(
            "/v1/estimate",
            &json!({"batch_size": 32, "layers": layers, "estimators": "all"}),
        )
        .await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    let warnings = body["warnings"].as_array().unwrap();
    assert!(
        warnings.iter().any(|w| w
            .as_str()
            .unwrap()
            .contains("reads at most 512 layers, the job has 600")),
        "{body}"
    );
    assert!(body["memory"]["estimate_mib"].as_f64().unwrap() > 0.0);
    // The ordinary example leaves nothing out (and assumes nothing).
    let plain: Value = app.post_json_value("/v1/estimate", &example_job()).await;
    assert_eq!(plain["warnings"], json!([]));
}

#[tokio::test]
async fn every_null_utilization_figure_says_why() {
    // A card known only by its memory: no roofline, and no learned model for CNNs.
    let devices: std::sync::Arc<dyn gpucast::devices::GpuDevices> = std::sync::Arc::new(
        gpucast::devices::FakeDevices::single("Imaginary GPU 9000", 30_000),
    );
    let app = crate::helpers::spawn_app_with_devices(
        crate::helpers::test_config(&crate::helpers::models_dir()),
        devices,
    )
    .await;
    let mut job = training_description("timm:resnet50");
    job["batch_size"] = 32.into();
    job["gpu"] = "attached".into();
    let body: Value = app.post_json_value("/v1/estimate", &job).await;
    let utilization = body["utilization"].as_object().unwrap();
    let reasons = utilization["null_reasons"].as_object().unwrap();
    for metric in ["smact", "smocc", "drama"] {
        assert!(utilization[metric].is_null(), "{metric}");
        let reason = reasons[metric].as_str().unwrap();
        assert!(reason.contains(metric), "{reason}");
        assert!(reason.contains("known only by its memory"), "{reason}");
    }
    // smact and smocc are measured for MLP jobs only: the reason says so
    for metric in ["smact", "smocc"] {
        let reason = reasons[metric].as_str().unwrap();
        assert!(
            reason.contains("cnn jobs") && reason.contains("only for mlp"),
            "{reason}"
        );
    }
    // On a catalogued card the roofline answers them all.
    job["gpu"] = "a100-40gb".into();
    let body: Value = app.post_json_value("/v1/estimate", &job).await;
    assert_eq!(body["utilization"]["null_reasons"], json!({}), "{body}");
}

#[tokio::test]
async fn json_lines_sent_to_the_single_route_are_pointed_to_the_batch_route() {
    let app = spawn_app().await;
    let job = example_job().to_string();
    let lines = format!("{job}\n{job}\n");
    let response = app
        .post_raw("/v1/estimate", "application/json", lines)
        .await;
    assert_eq!(response.status(), 400);
    let problem: Value = response.json().await.unwrap();
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.contains("/v1/estimate/batch") && detail.contains("--batch-body"),
        "{detail}"
    );
    // other trailing junk is still an ordinary syntax error
    let response = app
        .post_raw(
            "/v1/estimate",
            "application/json",
            format!("{job} trailing"),
        )
        .await;
    assert_eq!(response.status(), 400);
    let problem: Value = response.json().await.unwrap();
    assert!(!problem["detail"].as_str().unwrap().contains("batch"));
}

/// Over every job the tests have (held-out MLP jobs, the timm descriptions at three batch
/// sizes, the summary fixtures), no answer's class disagrees with its figure.
#[tokio::test]
async fn no_answer_has_a_class_that_disagrees_with_its_figure() {
    let app = spawn_app().await;
    let mut jobs: Vec<Value> = held_out_mlp_jobs()
        .into_iter()
        .map(|(job, _)| job)
        .collect();
    for description in training_descriptions() {
        for batch_size in [8, 64, 256] {
            let mut job = description.clone();
            job["batch_size"] = batch_size.into();
            jobs.push(job);
        }
    }
    let fixtures = repo_root().join("tests/fixtures/summaries");
    for entry in std::fs::read_dir(&fixtures).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "txt") {
            let text = std::fs::read_to_string(&path).unwrap();
            let table = text.contains("Param #");
            let format = if table {
                "torchsummary"
            } else {
                "module_print"
            };
            jobs.push(
                json!({"summary": {"format": format, "text": text}, "batch_size": 32,
                "seq_len": (!table).then_some(128)}),
            );
        }
    }
    let mut answered = 0;
    // 16 a request: timm descriptions are large, and a body holds at most 2 MiB
    for chunk in jobs.chunks(16) {
        let body: Value = app
            .post_json_value("/v1/estimate/batch", &json!({ "items": chunk }))
            .await;
        for item in body["items"].as_array().expect("a batch answer") {
            assert_eq!(item["status"], 200, "{item}");
            assert_class_holds_figure(&item["estimate"], &format!("item {answered}"));
            answered += 1;
        }
    }
    assert_eq!(answered, jobs.len());
    assert!(answered > 2000, "{answered}");
}

/// A kind the family's sequence classifier has no token for leaves that classifier out (said
/// in warnings); the family's other estimators answer, as for a job longer than it reads.
#[tokio::test]
async fn a_kind_outside_a_sequence_classifiers_vocabulary_leaves_it_out() {
    let app = spawn_app().await;
    let job = json!({"family": "mlp", "batch_size": 8, "optimizer": "adam", "precision": "fp32",
        "estimators": "all",
        "layers": [{"kind": "linear", "output_size": 10, "params": 110},
                   {"kind": "conv2d", "output_size": 10, "params": 10}]});
    let response = app.post_json("/v1/estimate", &job).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(
        body["warnings"],
        json!(["estimator 'sequence_transformer' left out: it has no token for layer kind 'conv2d' (layers[1])"])
    );
    assert!(body["memory"]["estimators"]["sequence_transformer"].is_null());
    assert!(body["memory"]["estimate_mib"].as_f64().unwrap() > 0.0);
}

/// What a new user gets wrong, answered with what to do: a printout pasted as the body is a
/// 415 showing how to wrap it; `bf16` is answered with a warning saying it is pure bf16 and
/// how to state autocast; a GPU near a known one is suggested.
#[tokio::test]
async fn common_mistakes_are_answered_with_what_to_do() {
    let app = spawn_app().await;
    let printout = "Net(\n  (fc): Linear(in_features=3, out_features=4, bias=True)\n)";
    let pasted = crate::common::post_bytes(
        &app.client,
        &format!("{}/v1/estimate", app.address),
        printout.as_bytes(),
    )
    .await;
    assert_eq!(pasted.status(), 415);
    let problem: Value = pasted.json().await.unwrap();
    assert!(
        problem["detail"].as_str().unwrap().contains("\"summary\""),
        "{problem}"
    );

    let mut job = example_job();
    job["precision"] = "bfloat16".into();
    let answer: Value = app.post_json_value("/v1/estimate", &job).await;
    let warnings = answer["warnings"].to_string();
    assert!(
        warnings.contains("pure bf16") && warnings.contains("amp_bf16"),
        "{warnings}"
    );

    let mut job = example_job();
    job["gpu"] = "4090".into();
    let refused = app.post_json("/v1/estimate", &job).await;
    assert_eq!(refused.status(), 422);
    let problem: Value = refused.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("did you mean rtx-4090?"),
        "{problem}"
    );
}
