//! `POST /v1/kubernetes/admission`: AdmissionReviews as the API server sends them, the JSON
//! Patch of each answer applied to the object, and the placed pods checked against the
//! service's own fit decision (`POST /v1/estimate` with the same cards as a `gpu` list).

use std::collections::BTreeSet;

use base64::Engine as _;
use serde_json::{json, Value};

use crate::helpers::{models_dir, repo_root, spawn_app, spawn_app_with, test_config, TestApp};

const ROUTE: &str = "/v1/kubernetes/admission";

/// The cluster's products in these tests: two A100 40 GB forms, the H100 SXM, an L4, an RTX
/// 4090 and a T4 (not the A100 80 GB, which the job below would fit too).
const PRODUCTS: [&str; 6] = [
    "NVIDIA-A100-SXM4-40GB",
    "NVIDIA-A100-PCIE-40GB",
    "NVIDIA-H100-80GB-HBM3",
    "NVIDIA-L4",
    "NVIDIA-GeForce-RTX-4090",
    "Tesla-T4",
];
/// The catalogue cards of [`PRODUCTS`], with each card's products.
const CARDS: [(&str, &[&str]); 5] = [
    (
        "a100-40gb",
        &["NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB"],
    ),
    ("h100-80gb", &["NVIDIA-H100-80GB-HBM3"]),
    ("l4", &["NVIDIA-L4"]),
    ("rtx-4090", &["NVIDIA-GeForce-RTX-4090"]),
    ("t4", &["Tesla-T4"]),
];

/// GPT-2 medium at 1,024 tokens, batch 8, bf16 autocast: about 34 GB at the bound, so it fits
/// the 40 and 80 GB cards and not the 24 and 16 GB ones.
fn gpt2_medium() -> Value {
    json!({
        "transformer_config": {"model_type": "gpt2", "n_embd": 1024, "n_layer": 24, "n_head": 16,
            "vocab_size": 50257, "n_positions": 1024},
        "seq_len": 1024, "batch_size": 8, "precision": "amp_bf16"
    })
}

/// A 10-layer MLP of 1.6 GB: it fits every card.
fn small_mlp() -> Value {
    crate::helpers::example_job()
}

async fn admission_app(products: &[&str]) -> TestApp {
    let mut config = test_config(&models_dir());
    config.admission = true;
    config.admission_products = products.iter().map(|p| p.to_string()).collect();
    spawn_app_with(config).await
}

fn review(kind: (&str, &str, &str), object: Value) -> Value {
    let (group, version, kind) = kind;
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": format!("{}s", kind.to_lowercase())},
            "requestKind": {"group": group, "version": version, "kind": kind},
            "operation": "CREATE",
            "namespace": "team-a",
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": object,
            "oldObject": null,
            "dryRun": false,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}
        }
    })
}

/// A pod (spec) of one trainer container asking for a GPU, annotated with `job`.
fn pod_spec(job: Option<&Value>) -> Value {
    let mut pod = json!({
        "metadata": {"labels": {"app": "trainer"}, "annotations": {"team": "a"}},
        "spec": {
            "containers": [{"name": "trainer", "image": "trainer:1",
                "resources": {"limits": {"nvidia.com/gpu": 1}}}],
            "restartPolicy": "Never"
        }
    });
    if let Some(job) = job {
        pod["metadata"]["annotations"]["gpucast.dev/job"] = job.to_string().into();
    }
    pod
}

fn pod(job: Option<&Value>) -> Value {
    let mut pod = pod_spec(job);
    pod["apiVersion"] = "v1".into();
    pod["kind"] = "Pod".into();
    pod["metadata"]["name"] = "train".into();
    pod["metadata"]["namespace"] = "team-a".into();
    pod
}

/// The answer's `response`, its uid checked.
async fn answer(app: &TestApp, review: &Value) -> Value {
    let response = app.post_json(ROUTE, review).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(body["kind"], "AdmissionReview");
    assert_eq!(body["response"]["uid"], review["request"]["uid"]);
    body["response"].clone()
}

/// The JSON Patch of an answer applied to `object` (it uses `add` only).
fn patched(object: &Value, response: &Value) -> Value {
    assert_eq!(response["allowed"], true, "{response:#}");
    assert_eq!(response["patchType"], "JSONPatch");
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(response["patch"].as_str().expect("a patch"))
        .unwrap();
    let ops: Vec<Value> = serde_json::from_slice(&bytes).unwrap();
    let mut object = object.clone();
    for op in &ops {
        assert_eq!(op["op"], "add", "{op}");
        add(
            &mut object,
            op["path"].as_str().unwrap(),
            op["value"].clone(),
        );
    }
    object
}

/// RFC 6902 `add`: the parent must exist; `-` appends to an array.
fn add(object: &mut Value, path: &str, value: Value) {
    let tokens: Vec<String> = path
        .split('/')
        .skip(1)
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
        .collect();
    let (last, parents) = tokens.split_last().expect("a path below the root");
    let mut node = object;
    for token in parents {
        node = match node {
            Value::Object(map) => map
                .get_mut(token)
                .unwrap_or_else(|| panic!("{path}: no {token}")),
            Value::Array(items) => &mut items[token.parse::<usize>().unwrap()],
            _ => panic!("{path}: {token} is not a container"),
        };
    }
    match node {
        Value::Object(map) => {
            map.insert(last.clone(), value);
        }
        Value::Array(items) if last == "-" => items.push(value),
        Value::Array(items) => items.insert(last.parse().unwrap(), value),
        _ => panic!("{path}: the parent is not a container"),
    }
}

/// The products the service's own fit decision places `job` on among [`CARDS`]: `POST
/// /v1/estimate` with the cards as a `gpu` list, each fitting card's products.
async fn fitting_products(app: &TestApp, job: &Value) -> BTreeSet<String> {
    let mut ranked = job.clone();
    ranked["gpu"] = CARDS.iter().map(|(id, _)| *id).collect::<Vec<_>>().into();
    let answer = app.post_json_value("/v1/estimate", &ranked).await;
    let ranking = answer["gpu_ranking"].as_array().expect("a ranking");
    assert_eq!(ranking.len(), CARDS.len());
    ranking
        .iter()
        .filter(|r| r["fits"] == true)
        .flat_map(|r| {
            let (_, products) = CARDS.iter().find(|(id, _)| r["gpu"] == *id).unwrap();
            products.iter().map(|p| p.to_string())
        })
        .collect()
}

/// The values of every `nvidia.com/gpu.product` requirement of each required term.
fn product_terms(pod: &Value) -> Vec<(Value, BTreeSet<String>)> {
    let terms = pod["spec"]["affinity"]["nodeAffinity"]
        ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        .as_array()
        .expect("required node affinity terms");
    terms
        .iter()
        .map(|term| {
            let products = term["matchExpressions"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["key"] == "nvidia.com/gpu.product")
                .inspect(|e| assert_eq!(e["operator"], "In"))
                .flat_map(|e| {
                    e["values"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|v| v.as_str().unwrap().to_string())
                })
                .collect();
            (term.clone(), products)
        })
        .collect()
}

fn products_annotation(pod: &Value) -> BTreeSet<String> {
    pod["metadata"]["annotations"]["gpucast.dev/products"]
        .as_str()
        .expect("gpucast.dev/products")
        .split(',')
        .map(str::to_string)
        .collect()
}

#[tokio::test]
async fn a_pod_that_fits_gets_an_affinity_to_exactly_the_fitting_products_kept_beside_its_own() {
    let app = admission_app(&PRODUCTS).await;
    let job = gpt2_medium();
    let expected = fitting_products(&app, &job).await;
    // Some of the cluster's cards and not others: the A100 40 GB forms and the H100.
    assert!(
        expected.contains("NVIDIA-H100-80GB-HBM3") && !expected.contains("Tesla-T4"),
        "{expected:?}"
    );
    let mut object = pod(Some(&job));
    // The pod's own affinity: a zone term and a preference, both kept.
    object["spec"]["affinity"] = json!({"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["zone-a"]}]},
            {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["zone-b"]}]}
        ]},
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference":
            {"matchExpressions": [{"key": "spot", "operator": "NotIn", "values": ["true"]}]}}]
    }});
    let response = answer(&app, &review(("", "v1", "Pod"), object.clone())).await;
    let placed = patched(&object, &response);
    let terms = product_terms(&placed);
    assert_eq!(terms.len(), 2, "no term added: terms are ORed");
    for (zone, (term, products)) in ["zone-a", "zone-b"].iter().zip(&terms) {
        assert_eq!(products, &expected);
        assert_eq!(term["matchExpressions"][0]["values"][0], *zone);
    }
    assert_eq!(
        placed["spec"]["affinity"]["nodeAffinity"]
            ["preferredDuringSchedulingIgnoredDuringExecution"],
        object["spec"]["affinity"]["nodeAffinity"]
            ["preferredDuringSchedulingIgnoredDuringExecution"]
    );
    assert_eq!(products_annotation(&placed), expected);
    let annotations = &placed["metadata"]["annotations"];
    assert_eq!(annotations["team"], "a");
    // The figures: those of the estimate on the fitting cards (the same on each here).
    let mut ranked = job.clone();
    ranked["gpu"] = json!(["h100-80gb"]);
    let estimate = app.post_json_value("/v1/estimate", &ranked).await;
    let mib = |v: &Value| format!("{:.0}", v.as_f64().unwrap().ceil());
    assert_eq!(
        annotations["gpucast.dev/estimate-mib"],
        mib(&estimate["memory"]["estimate_mib"])
    );
    assert_eq!(
        annotations["gpucast.dev/upper-bound-mib"],
        mib(&estimate["memory"]["upper_bound_mib"])
    );
    // Said to kubectl's user: the figure, the bound and how many of the cluster's cards (the
    // A100 40 GB and the H100) it fits.
    let warning = response["warnings"][0].as_str().unwrap();
    let bound = annotations["gpucast.dev/upper-bound-mib"].as_str().unwrap();
    assert!(
        warning.contains(&format!("bound {bound} MiB; fits 2 of")),
        "{warning}"
    );
}

#[tokio::test]
async fn a_job_template_without_affinity_gets_one_and_its_pods_are_let_through() {
    let app = admission_app(&PRODUCTS).await;
    let job = gpt2_medium();
    let expected = fitting_products(&app, &job).await;
    let object = json!({
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "train", "namespace": "team-a"},
        "spec": {"backoffLimit": 0, "template": pod_spec(Some(&job))}
    });
    let response = answer(&app, &review(("batch", "v1", "Job"), object.clone())).await;
    let placed = patched(&object, &response);
    let template = &placed["spec"]["template"];
    let terms = product_terms(template);
    assert_eq!(terms.len(), 1);
    assert_eq!(terms[0].1, expected);
    assert_eq!(products_annotation(template), expected);
    assert_eq!(placed["spec"]["backoffLimit"], 0);
    // The Job's pods carry the placed template: allowed as they are, not placed twice.
    let mut child = template.clone();
    child["apiVersion"] = "v1".into();
    child["kind"] = "Pod".into();
    let response = answer(&app, &review(("", "v1", "Pod"), child)).await;
    assert_eq!(response["allowed"], true);
    assert!(response.get("patch").is_none(), "{response:#}");
}

#[tokio::test]
async fn a_pytorchjob_places_its_master_and_worker_each_by_its_own_job() {
    let app = admission_app(&PRODUCTS).await;
    let (big, small) = (gpt2_medium(), small_mlp());
    let (big_products, small_products) = (
        fitting_products(&app, &big).await,
        fitting_products(&app, &small).await,
    );
    assert!(big_products.len() < small_products.len());
    let replica = |job: &Value, replicas: u64| json!({"replicas": replicas, "restartPolicy": "OnFailure", "template": pod_spec(Some(job))});
    let object = json!({
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": "ddp", "namespace": "team-a"},
        "spec": {"pytorchReplicaSpecs": {"Master": replica(&small, 1), "Worker": replica(&big, 3)}}
    });
    let response = answer(
        &app,
        &review(("kubeflow.org", "v1", "PyTorchJob"), object.clone()),
    )
    .await;
    let placed = patched(&object, &response);
    for (replica, expected) in [("Master", &small_products), ("Worker", &big_products)] {
        let template = &placed["spec"]["pytorchReplicaSpecs"][replica]["template"];
        assert_eq!(&product_terms(template)[0].1, expected, "{replica}");
        assert_eq!(&products_annotation(template), expected, "{replica}");
    }
    assert_eq!(
        placed["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"],
        3
    );
}

#[tokio::test]
async fn a_job_that_fits_none_of_the_clusters_products_is_denied_with_its_figure() {
    let app = admission_app(&["Tesla-T4", "NVIDIA-L4"]).await;
    let job = gpt2_medium();
    let response = answer(&app, &review(("", "v1", "Pod"), pod(Some(&job)))).await;
    assert_eq!(response["allowed"], false, "{response:#}");
    assert!(response.get("patch").is_none());
    assert_eq!(response["status"]["code"], 403);
    let message = response["status"]["message"].as_str().unwrap();
    let mut on_l4 = job.clone();
    on_l4["gpu"] = json!(["l4"]);
    let estimate = app.post_json_value("/v1/estimate", &on_l4).await;
    let bound = format!(
        "{:.0}",
        estimate["memory"]["upper_bound_mib"]
            .as_f64()
            .unwrap()
            .ceil()
    );
    assert!(message.contains(&bound), "{message} / {bound}");
    assert!(message.contains("l4 (23034 MiB)"), "{message}");
    assert!(message.contains("gpucast.dev/job of the pod"), "{message}");
}

#[tokio::test]
async fn a_products_annotation_the_webhook_did_not_write_is_not_trusted() {
    let app = admission_app(&["Tesla-T4", "NVIDIA-L4"]).await;
    // A job that fits none of the cluster's cards, carrying its own products annotation.
    let mut object = pod(Some(&gpt2_medium()));
    object["metadata"]["annotations"]["gpucast.dev/products"] = "Tesla-T4".into();
    let response = answer(&app, &review(("", "v1", "Pod"), object)).await;
    assert_eq!(response["allowed"], false, "{response:#}");
    assert_eq!(response["status"]["code"], 403);
    // One that fits, with a forged list: placed, the list rewritten to what it fits.
    let mut object = pod(Some(&small_mlp()));
    object["metadata"]["annotations"]["gpucast.dev/products"] = "made-up".into();
    let placed = patched(
        &object,
        &answer(&app, &review(("", "v1", "Pod"), object.clone())).await,
    );
    assert_eq!(
        products_annotation(&placed),
        ["Tesla-T4", "NVIDIA-L4"]
            .iter()
            .map(|s| s.to_string())
            .collect()
    );
}

#[tokio::test]
async fn a_review_is_read_strictly_keys_versions_and_operation() {
    let app = admission_app(&PRODUCTS).await;
    // A key repeated deep inside the object: refused, as at the top.
    let body = review(("", "v1", "Pod"), pod(Some(&small_mlp())))
        .to_string()
        .replacen(
            r#""restartPolicy":"Never""#,
            r#""restartPolicy":"Never","restartPolicy":"Always""#,
            1,
        );
    assert!(body.contains(r#""restartPolicy":"Always""#));
    let response = app.post_raw(ROUTE, "application/json", body).await;
    assert_eq!(response.status(), 422);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("duplicate key"),
        "{problem}"
    );
    // Versions the webhook does not know: denied, not placed.
    let response = answer(&app, &review(("", "v2", "Pod"), pod(Some(&small_mlp())))).await;
    assert_eq!(response["status"]["code"], 422, "{response:#}");
    let object = json!({"apiVersion": "batch/v2", "kind": "Job",
        "spec": {"template": pod_spec(Some(&small_mlp()))}});
    let response = answer(&app, &review(("batch", "v1", "Job"), object)).await;
    assert_eq!(response["status"]["code"], 422, "{response:#}");
    // No operation, a null one or an unknown one: not a review.
    for operation in [None, Some(Value::Null), Some(json!("MERGE"))] {
        let mut review = review(("", "v1", "Pod"), pod(Some(&small_mlp())));
        let request = review["request"].as_object_mut().unwrap();
        match &operation {
            None => {
                request.remove("operation");
            }
            Some(op) => {
                request.insert("operation".into(), op.clone());
            }
        }
        let response = app.post_json(ROUTE, &review).await;
        assert_eq!(response.status(), 422, "{operation:?}");
    }
}

#[tokio::test]
async fn an_object_without_the_annotation_is_allowed_unchanged() {
    let app = admission_app(&PRODUCTS).await;
    for (kind, object) in [
        (("", "v1", "Pod"), pod(None)),
        (
            ("batch", "v1", "Job"),
            json!({"spec": {"template": pod_spec(None)}}),
        ),
        (
            ("apps", "v1", "Deployment"),
            json!({"spec": {"template": pod_spec(Some(&small_mlp()))}}),
        ),
    ] {
        let response = answer(&app, &review(kind, object)).await;
        assert_eq!(response["allowed"], true);
        assert!(
            response.get("patch").is_none() && response.get("patchType").is_none(),
            "{response:#}"
        );
    }
}

#[tokio::test]
async fn a_malformed_job_annotation_is_denied_with_the_validation_message() {
    let app = admission_app(&PRODUCTS).await;
    let mut bad = small_mlp();
    bad["layers"][0]["kind"] = "no_such_layer".into();
    let detail = app.post_json_value("/v1/estimate", &bad).await["detail"]
        .as_str()
        .unwrap()
        .to_string();
    let response = answer(&app, &review(("", "v1", "Pod"), pod(Some(&bad)))).await;
    assert_eq!(response["allowed"], false);
    assert_eq!(response["status"]["code"], 422);
    let message = response["status"]["message"].as_str().unwrap();
    assert!(message.contains(&detail), "{message} / {detail}");
    // Not JSON at all, and a gpu the cluster has no product for: denied, not a 5xx.
    let mut object = pod(None);
    object["metadata"]["annotations"]["gpucast.dev/job"] = "{not json".into();
    let response = answer(&app, &review(("", "v1", "Pod"), object)).await;
    assert_eq!(
        (
            response["allowed"].clone(),
            response["status"]["code"].clone()
        ),
        (json!(false), json!(400))
    );
    let mut on_b200 = small_mlp();
    on_b200["gpu"] = "b200".into();
    let response = answer(&app, &review(("", "v1", "Pod"), pod(Some(&on_b200)))).await;
    assert_eq!(response["allowed"], false);
    assert!(response["status"]["message"]
        .as_str()
        .unwrap()
        .contains("none of the cards named"));
    // Bounded: an annotation past the API server's own 256 KiB, more templates than read.
    let mut object = pod(None);
    object["metadata"]["annotations"]["gpucast.dev/job"] = " ".repeat(300 * 1024).into();
    let response = answer(&app, &review(("", "v1", "Pod"), object)).await;
    assert_eq!(response["status"]["code"], 413, "{response:#}");
    let replicas: serde_json::Map<String, Value> = (0..9)
        .map(|i| {
            (
                format!("R{i}"),
                json!({"template": pod_spec(Some(&small_mlp()))}),
            )
        })
        .collect();
    let object = json!({"spec": {"pytorchReplicaSpecs": replicas}});
    let response = answer(&app, &review(("kubeflow.org", "v1", "PyTorchJob"), object)).await;
    assert_eq!(response["status"]["code"], 422, "{response:#}");
    assert!(response["status"]["message"]
        .as_str()
        .unwrap()
        .contains("at most 8"));
    // The review itself malformed: a problem, not a review.
    let response = app
        .post_json(
            ROUTE,
            &json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}),
        )
        .await;
    assert_eq!(response.status(), 422);
    // An object under review that is not an object (schemathesis sent a list).
    let response = app
        .post_json(ROUTE, &review(("", "v1", "Pod"), json!([null, null])))
        .await;
    assert_eq!(response.status(), 422);
}

#[tokio::test]
async fn a_flood_of_node_selector_terms_is_refused_before_any_work_with_a_small_answer() {
    let app = admission_app(&PRODUCTS).await;
    let with_terms = |terms: Vec<Value>| {
        let mut object = pod(Some(&small_mlp()));
        object["spec"]["affinity"] = json!({"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}});
        object
    };
    // 200,000 empty terms (600 KB): once one patch operation each, listing every product.
    let object = with_terms(vec![json!({}); 200_000]);
    let response = app
        .post_json(ROUTE, &review(("", "v1", "Pod"), object))
        .await;
    assert_eq!(response.status(), 200);
    let bytes = response.bytes().await.unwrap();
    assert!(bytes.len() < 4096, "{} bytes", bytes.len());
    let body: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(body["response"]["allowed"], false);
    assert_eq!(body["response"]["status"]["code"], 413);
    assert!(body["response"]["status"]["message"]
        .as_str()
        .unwrap()
        .contains("200000 node selector terms"));
    // As many requirements as terms allow, over the limit on requirements.
    let requirement = json!({"key": "zone", "operator": "In", "values": ["a"]});
    let object = with_terms(vec![
        json!({"matchExpressions": vec![requirement.clone(); 9]});
        64
    ]);
    let response = answer(&app, &review(("", "v1", "Pod"), object)).await;
    assert_eq!(response["status"]["code"], 413, "{response:#}");
    // At the limit: placed, and a term that selects nothing is left selecting nothing (the
    // product requirement added to it would widen where the pod may go).
    let mut terms = vec![json!({"matchExpressions": [requirement]}); 63];
    terms.push(json!({}));
    let object = with_terms(terms);
    let placed = patched(
        &object,
        &answer(&app, &review(("", "v1", "Pod"), object.clone())).await,
    );
    let terms = placed["spec"]["affinity"]["nodeAffinity"]
        ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        .as_array()
        .unwrap();
    assert_eq!(terms[63], json!({}));
    assert!(terms[..63]
        .iter()
        .all(|t| t["matchExpressions"].as_array().unwrap().len() == 2));
    // More containers than read.
    let mut object = pod(Some(&small_mlp()));
    object["spec"]["containers"] = json!(vec![json!({"name": "c", "image": "i"}); 65]);
    let response = answer(&app, &review(("", "v1", "Pod"), object)).await;
    assert_eq!(response["status"]["code"], 413, "{response:#}");
}

#[tokio::test]
async fn a_named_gpu_narrows_the_affinity_to_that_card() {
    let app = admission_app(&PRODUCTS).await;
    let mut job = small_mlp();
    job["gpu"] = "NVIDIA A100-SXM4-40GB".into();
    let object = pod(Some(&job));
    let placed = patched(
        &object,
        &answer(&app, &review(("", "v1", "Pod"), object.clone())).await,
    );
    let expected: BTreeSet<String> = ["NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(product_terms(&placed)[0].1, expected);
}

#[tokio::test]
async fn the_admission_route_is_not_found_unless_enabled() {
    let app = spawn_app().await;
    let response = app
        .post_json(ROUTE, &review(("", "v1", "Pod"), pod(Some(&small_mlp()))))
        .await;
    assert_eq!(response.status(), 404);
    let problem: Value = response.json().await.unwrap();
    assert!(
        problem["detail"].as_str().unwrap().contains("--admission"),
        "{problem}"
    );
}

#[tokio::test]
async fn an_unknown_product_is_refused_at_start() {
    let mut config = test_config(&models_dir());
    config.admission = true;
    config.admission_products = vec!["NVIDIA-A100-SXM4-40G".into()];
    let refused = gpucast::startup::Application::build(&config)
        .await
        .err()
        .expect("refused");
    assert!(
        refused.to_string().contains("NVIDIA-A100-SXM4-40GB"),
        "{refused}"
    );
}

/// A TLS connector that trusts the test CA of tests/fixtures/tls.
fn test_connector() -> tokio_rustls::TlsConnector {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(repo_root().join("tests/fixtures/tls/ca.pem")).unwrap())
        .unwrap();
    let client = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    tokio_rustls::TlsConnector::from(std::sync::Arc::new(client))
}

fn tls_config() -> gpucast::config::ServeConfig {
    let tls = repo_root().join("tests/fixtures/tls");
    let mut config = test_config(&models_dir());
    config.admission = true;
    config.tls_cert = Some(tls.join("cert.pem"));
    config.tls_key = Some(tls.join("key.pem"));
    config
}

#[tokio::test]
async fn tls_connections_keep_the_connection_cap_and_a_silent_handshake_is_closed() {
    use tokio::io::AsyncReadExt;
    use tokio_rustls::rustls::pki_types::ServerName;
    let mut config = tls_config();
    config.max_connections = 1;
    config.header_read_timeout_secs = 1;
    let app = spawn_app_with(config).await;
    let handshake = |tcp| test_connector().connect(ServerName::try_from("localhost").unwrap(), tcp);
    // A connection that never shakes hands holds the one slot: the next is closed at once.
    let mut silent = tokio::net::TcpStream::connect(("127.0.0.1", app.port))
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let second = tokio::net::TcpStream::connect(("127.0.0.1", app.port))
        .await
        .unwrap();
    assert!(
        handshake(second).await.is_err(),
        "past the cap, a connection is closed"
    );
    // Within the header timeout the silent one is closed, and its slot is free again.
    let mut byte = [0u8; 1];
    let closed =
        tokio::time::timeout(std::time::Duration::from_secs(5), silent.read(&mut byte)).await;
    assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
    let third = tokio::net::TcpStream::connect(("127.0.0.1", app.port))
        .await
        .unwrap();
    assert!(handshake(third).await.is_ok());
}

#[tokio::test]
async fn the_webhook_answers_over_tls_with_the_configured_certificate() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_rustls::rustls::pki_types::ServerName;

    let app = spawn_app_with(tls_config()).await;
    // Plain HTTP to the TLS port gets no answer.
    assert!(reqwest::Client::new()
        .get(format!("{}/healthz", app.address))
        .send()
        .await
        .is_err());
    let connector = test_connector();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", app.port))
        .await
        .unwrap();
    let mut stream = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("the handshake verifies the certificate against the CA");
    let body = review(("", "v1", "Pod"), pod(Some(&small_mlp()))).to_string();
    let request = format!(
        "POST {ROUTE} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut bytes = Vec::new();
    let _ = stream.read_to_end(&mut bytes).await;
    let answer = String::from_utf8_lossy(&bytes);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let (_, json) = answer.split_once("\r\n\r\n").unwrap();
    let review: Value = serde_json::from_str(json).unwrap();
    assert_eq!(review["response"]["allowed"], true);
    assert_eq!(review["response"]["patchType"], "JSONPatch");
}
