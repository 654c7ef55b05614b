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
    let served: Value = app.get("/openapi.json").await.json().await.unwrap();
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
    let generated = serde_json::to_value(gpucast::domain::vocabulary::layer_vocabulary()).unwrap();
    let committed_path = repo_root().join("openapi/layer_kinds.json");
    let committed: Value =
        serde_json::from_str(&std::fs::read_to_string(&committed_path).unwrap()).unwrap();
    assert!(
        generated == committed,
        "openapi/layer_kinds.json is stale: regenerate it with `cargo run -- layer-kinds > openapi/layer_kinds.json`"
    );
}
