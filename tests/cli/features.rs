//! `gpucast features`: the features of known jobs as pinned, bad items answered alone.

use super::*;

/// tests/fixtures/features.json: known jobs and the features pinned for them.
fn pinned_features() -> Vec<Value> {
    let text = std::fs::read_to_string(root().join("tests/fixtures/features.json")).unwrap();
    let fixture: Value = serde_json::from_str(&text).unwrap();
    fixture["cases"].as_array().unwrap().clone()
}

fn close(a: &Value, b: &Value) -> bool {
    let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
    (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1.0)
}

#[test]
fn features_batch_prints_the_pinned_features_of_known_jobs() {
    let cases = pinned_features();
    let jobs: Vec<&Value> = cases.iter().map(|c| &c["job"]).collect();
    let body = serde_json::to_vec(&jobs).unwrap();
    let output = gpucast(&["features", "--batch", "-"], Some(&body));
    assert!(output.status.success(), "{output:?}");
    let answer = json(&output);
    let items = answer["items"].as_array().unwrap();
    assert_eq!(items.len(), cases.len());
    for (case, item) in cases.iter().zip(items) {
        let name = case["name"].as_str().unwrap();
        assert_eq!(item["status"], 200, "{name}: {item}");
        let features = &item["features"];
        assert_eq!(features["family"], case["family"], "{name}");
        assert_eq!(features["kinds"], case["kinds"], "{name}");
        let (aggregate, pinned) = (
            features["aggregate"].as_object().unwrap(),
            case["aggregate"].as_object().unwrap(),
        );
        assert_eq!(aggregate.len(), pinned.len(), "{name}: the feature names");
        for (feature, expected) in pinned {
            assert!(
                close(&aggregate[feature], expected),
                "{name}: {feature} = {}, pinned {expected}",
                aggregate[feature]
            );
        }
        let tokens: Vec<&Value> = features["tokens"].as_array().unwrap().iter().collect();
        let pinned: Vec<&Value> = case["tokens"].as_array().unwrap().iter().collect();
        assert_eq!(tokens.len(), pinned.len(), "{name}: tokens");
        for (layer, (t, p)) in tokens.iter().zip(&pinned).enumerate() {
            let (t, p) = (t.as_array().unwrap(), p.as_array().unwrap());
            assert_eq!(t.len(), p.len());
            assert!(
                t.iter().zip(p).all(|(t, p)| close(t, p)),
                "{name}: token {layer}: {t:?}, pinned {p:?}"
            );
        }
        assert_eq!(
            features["token_features"],
            serde_json::json!([
                "output_size",
                "params",
                "batch_size",
                "output_x_batch",
                "position"
            ])
        );
    }
}

#[test]
fn features_answer_a_bad_item_with_its_problem_and_the_rest_with_their_features() {
    let body = br#"{"items": [
        {"batch_size": 0, "layers": [{"kind": "linear", "output_size": 1, "params": 1}]},
        {"batch_size": 2, "layers": [{"kind": "Linear", "output_size": 3, "params": 12}, {"kind": "ReLU", "output_size": 3, "params": 0}]},
        {"batch_size": 2, "layers": [{"kind": "no_such_layer", "output_size": 3, "params": 12}]}
    ]}"#;
    let output = gpucast(&["features", "--batch", "-"], Some(body));
    assert!(output.status.success(), "{output:?}");
    let answer = json(&output);
    let items = answer["items"].as_array().unwrap();
    assert_eq!(items.len(), 3);
    for bad in [0, 2] {
        assert_eq!(items[bad]["index"], bad);
        assert_eq!(items[bad]["status"], 422, "{}", items[bad]);
        assert!(items[bad]["features"].is_null());
        let detail = items[bad]["error"]["detail"].as_str().unwrap();
        assert!(detail.starts_with(&format!("items[{bad}]")), "{detail}");
    }
    let features = &items[1]["features"];
    assert_eq!(features["kinds"], serde_json::json!(["linear", "relu"]));
    assert_eq!(features["aggregate"]["params_x_batch"], 24.0);
    assert_eq!(features["aggregate"]["act_relu"], 1.0);
    // Weights, gradients and Adam's two moments in fp32 plus the activations, over the
    // framework's 1300 MiB.
    let expected = 1300.0 + (12.0 * 16.0 + 6.0 * 2.0 * 4.0) / 1_048_576.0;
    assert_eq!(features["aggregate"]["first_principles_mib"], expected);
    assert_eq!(
        features["tokens"][1],
        serde_json::json!([3.0, 0.0, 2.0, 6.0, 1.0])
    );
}

#[test]
fn features_read_a_job_as_the_estimate_routes_do_within_their_limits() {
    // One job, as `estimate` takes it: a config job's layers come from its builder.
    let output = gpucast(&["features", "tests/fixtures/cli/llama_job.json"], None);
    assert!(output.status.success(), "{output:?}");
    let features = json(&output);
    assert_eq!(features["family"], "transformer");
    assert!(features["kinds"].as_array().unwrap().len() > 10);
    assert!(features["aggregate"]["n_attention"].as_f64().unwrap() > 0.0);
    let bad = gpucast(&["features", "tests/fixtures/cli/bad_job.json"], None);
    assert_eq!(bad.status.code(), Some(2));
    assert_eq!(json(&bad)["status"], 422);
    // More items than a batch takes: refused whole, as the batch route refuses it.
    let job = serde_json::json!({"batch_size": 1, "layers": [{"kind": "linear", "output_size": 1, "params": 1}]});
    let many = serde_json::to_vec(&vec![job.clone(); 257]).unwrap();
    let output = gpucast(&["features", "--batch", "-"], Some(&many));
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(json(&output)["status"], 422);
    // A batch priced above the budget: refused whole, before any item is read.
    let two = serde_json::to_vec(&vec![job; 2]).unwrap();
    let output = gpucast(
        &["features", "--batch", "--max-request-cost", "100", "-"],
        Some(&two),
    );
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    assert_eq!(json(&output)["status"], 422);
    // Input beyond the body limit is not read at all.
    let output = gpucast(
        &["features", "--batch", "--max-body-bytes", "10", "-"],
        Some(&two),
    );
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--max-body-bytes"));
}
