use serde_json::Value;

use crate::helpers::{repo_root, spawn_app};

#[tokio::test]
async fn swagger_ui_and_its_assets_are_served_by_the_service() {
    let app = spawn_app().await;
    let page = app.get("/docs/").await;
    assert_eq!(page.status(), 200);
    let html = page.text().await.unwrap();
    assert!(html.contains("swagger-ui"), "{html}");
    for asset in [
        "/docs/swagger-ui.css",
        "/docs/swagger-ui-bundle.js",
        "/docs/swagger-initializer.js",
    ] {
        let response = app.get(asset).await;
        assert_eq!(response.status(), 200, "{asset}");
        let text = response.text().await.unwrap();
        // Everything is local: no CDN reference that would need the internet.
        assert!(
            !text.contains("unpkg.com") && !text.contains("cdn.jsdelivr"),
            "{asset} refers to a CDN"
        );
    }
    let initializer = app
        .get("/docs/swagger-initializer.js")
        .await
        .text()
        .await
        .unwrap();
    assert!(initializer.contains("/openapi.json"));
}

#[tokio::test]
async fn the_served_spec_equals_the_committed_one() {
    let app = spawn_app().await;
    let served: Value = app.get_json("/openapi.json").await;
    let committed_path = repo_root().join("openapi/openapi.json");
    let committed: Value =
        serde_json::from_str(&std::fs::read_to_string(&committed_path).unwrap()).unwrap();
    // Not assert_eq: printing both documents would bury the message.
    assert!(served == committed, "openapi/openapi.json is stale: regenerate it with `cargo run -- openapi > openapi/openapi.json`");
}

#[tokio::test]
async fn the_spec_documents_every_route_and_an_example_request() {
    let spec = serde_json::to_value(gpucast::http::openapi()).unwrap();
    for path in [
        "/v1/estimate",
        "/v1/estimate/batch",
        "/v1/estimators",
        "/healthz",
        "/readyz",
        "/metrics",
    ] {
        assert!(spec["paths"][path].is_object(), "{path} is not documented");
    }
    let example = &spec["components"]["schemas"]["EstimateRequest"]["example"];
    assert!(example["layers"].as_array().is_some_and(|l| !l.is_empty()));
    for status in ["200", "400", "413", "422", "503"] {
        assert!(
            spec["paths"]["/v1/estimate"]["post"]["responses"][status].is_object(),
            "{status}"
        );
    }
}

#[test]
fn the_committed_layer_kinds_are_the_services() {
    let generated = serde_json::to_value(gpucast::parsers::vocabulary::layer_vocabulary()).unwrap();
    let committed_path = repo_root().join("openapi/layer_kinds.json");
    let committed: Value =
        serde_json::from_str(&std::fs::read_to_string(&committed_path).unwrap()).unwrap();
    assert!(
        generated == committed,
        "openapi/layer_kinds.json is stale: regenerate it with `cargo run -- layer-kinds > openapi/layer_kinds.json`"
    );
}

#[test]
fn the_committed_setup_vocabularies_are_the_services() {
    let generated = serde_json::to_value(gpucast::api::vocabulary::setup_vocabulary()).unwrap();
    for path in gpucast::api::vocabulary::COMMITTED {
        let committed: Value =
            serde_json::from_str(&std::fs::read_to_string(repo_root().join(path)).unwrap())
                .unwrap();
        assert!(
            generated == committed,
            "{path} is stale: regenerate it with `cargo run -q -- vocabulary > {path}`"
        );
    }
}

/// The committed response examples are this service's answers to the example requests: the
/// same fields, the same figures (latencies aside, and MiB within 0.5 % for other CPUs'
/// floating point). `GPUCAST_WRITE_EXAMPLES=1` rewrites them from the answers.
#[tokio::test]
async fn response_examples_are_real_answers_to_the_example_requests() {
    let app = spawn_app().await;
    let spec = serde_json::to_value(gpucast::http::openapi()).unwrap();
    let schemas = &spec["components"]["schemas"];
    let requests = [
        (
            "/v1/estimate",
            schemas["EstimateRequest"]["example"].clone(),
        ),
        (
            "/v1/estimate/batch",
            schemas["BatchRequest"]["example"].clone(),
        ),
    ];
    for ((route, request), (example_route, committed)) in
        requests.into_iter().zip(gpucast::http::RESPONSE_EXAMPLES)
    {
        assert_eq!(route, example_route);
        let response = app.post_json(route, &request).await;
        assert_eq!(response.status(), 200, "{route}");
        let answer: Value = response.json().await.unwrap();
        let file = repo_root().join(format!(
            "openapi/examples/{}_response.json",
            route.rsplit('/').next().unwrap()
        ));
        if std::env::var_os("GPUCAST_WRITE_EXAMPLES").is_some() {
            let text = serde_json::to_string_pretty(&answer).unwrap() + "\n";
            std::fs::write(&file, text).unwrap();
            continue;
        }
        let committed: Value = serde_json::from_str(committed).unwrap();
        same_answer(&committed, &answer, route);
        let served = &spec["paths"][route]["post"]["responses"]["200"]["content"]
            ["application/json"]["example"];
        assert_eq!(
            served, &committed,
            "{route}: the spec's example is the committed file"
        );
    }
}

fn same_answer(expected: &Value, actual: &Value, path: &str) {
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => {
            let (ek, ak): (Vec<_>, Vec<_>) = (e.keys().collect(), a.keys().collect());
            assert_eq!(
                ek, ak,
                "{path}: fields differ; rewrite with GPUCAST_WRITE_EXAMPLES=1"
            );
            for (key, value) in e {
                if path.ends_with("latency_us") {
                    continue;
                }
                same_answer(value, &a[key], &format!("{path}.{key}"));
            }
        }
        (Value::Array(e), Value::Array(a)) => {
            assert_eq!(e.len(), a.len(), "{path}");
            for (i, (e, a)) in e.iter().zip(a).enumerate() {
                same_answer(e, a, &format!("{path}[{i}]"));
            }
        }
        (Value::Number(e), Value::Number(a)) => {
            let (e, a) = (e.as_f64().unwrap(), a.as_f64().unwrap());
            assert!(
                (e - a).abs() <= 0.005 * e.abs().max(1.0),
                "{path}: {e} committed, {a} answered; rewrite with GPUCAST_WRITE_EXAMPLES=1"
            );
        }
        _ => assert_eq!(expected, actual, "{path}"),
    }
}

/// Every named request example of `POST /v1/estimate` (a layer list, a describe job, a
/// config.json job) is answered.
#[tokio::test]
async fn request_examples_are_answered() {
    let app = spawn_app().await;
    let spec = serde_json::to_value(gpucast::http::openapi()).unwrap();
    let examples = spec["paths"]["/v1/estimate"]["post"]["requestBody"]["content"]
        ["application/json"]["examples"]
        .as_object()
        .expect("named request examples")
        .clone();
    let names: Vec<&str> = examples.keys().map(String::as_str).collect();
    assert_eq!(names, ["1_layers", "2_describe", "3_transformer_config"]);
    // The one Swagger UI fills in is the README's first request.
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let first = readme
        .split("-d '")
        .nth(1)
        .and_then(|rest| rest.split('\'').next())
        .expect("a curl -d example in the README");
    let first: Value = serde_json::from_str(first).unwrap();
    assert_eq!(examples["1_layers"]["value"], first);
    for (name, example) in &examples {
        let response = app.post_json("/v1/estimate", &example["value"]).await;
        assert_eq!(response.status(), 200, "{name}");
        let answer: Value = response.json().await.unwrap();
        assert!(
            answer["memory"]["estimate_mib"].as_f64().unwrap() > 0.0,
            "{name}"
        );
        // Every showcase is a setup known to run on its card (QLoRA of Llama-3-8B with
        // checkpointing on a 24 GB card: about 12 GB), so each must be admitted.
        assert_eq!(answer["fit"]["fits"], true, "{name}: {}", answer["fit"]);
    }
}
