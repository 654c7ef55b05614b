//! Latency of one estimate: features alone, each estimator in process, the whole family, and
//! one HTTP round trip on loopback. `cargo bench --bench estimate` (needs ORT_DYLIB_PATH or
//! scripts/fetch-onnxruntime.sh).

use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion};
use gpucast::config::ServeConfig;
use std::io::BufRead;

use gpucast::domain::features::AggregateFeatures;
use gpucast::domain::{Family, Job};
use gpucast::estimators::Estimators;
use gpucast::http::estimate::to_job;
use gpucast::http::types::EstimateRequest;
use gpucast::startup::Application;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn dylib() -> PathBuf {
    std::env::var_os("ORT_DYLIB_PATH").map_or_else(|| root().join(".cache/onnxruntime/libonnxruntime.so"), PathBuf::from)
}

fn example() -> serde_json::Value {
    let spec = serde_json::to_value(gpucast::http::openapi()).unwrap();
    spec["components"]["schemas"]["EstimateRequest"]["example"].clone()
}

/// A realistic job of each family: the OpenAPI example MLP, timm resnet50 and ViT-B/16.
fn jobs_by_family() -> Vec<(Family, Job)> {
    let example: EstimateRequest = serde_json::from_value(example()).unwrap();
    let mut jobs = vec![(Family::Mlp, to_job(&example).unwrap())];
    let file = std::fs::File::open(root().join("data/timm/descriptions.jsonl.gz")).unwrap();
    for line in std::io::BufReader::new(flate2::read::GzDecoder::new(file)).lines() {
        let line = line.unwrap();
        for (model, family, batch) in [("timm:resnet50", Family::Cnn, 64), ("timm:vit_base_patch16_224", Family::Transformer, 32)] {
            if line.contains(&format!("\"{model}\"")) {
                let mut request: EstimateRequest = serde_json::from_str(&line).unwrap();
                request.batch_size = batch;
                jobs.push((family, to_job(&request).unwrap()));
            }
        }
    }
    jobs
}

fn in_process(c: &mut Criterion) {
    let estimators = Estimators::load(&root().join("models"), &dylib(), 1).expect("models load");
    let jobs = jobs_by_family();
    let body = example().to_string();

    c.bench_function("parse_and_validate/mlp_example", |b| {
        b.iter(|| to_job(&serde_json::from_str::<EstimateRequest>(&body).unwrap()).unwrap())
    });
    for (family, job) in &jobs {
        let layers = job.layers().len();
        c.bench_function(&format!("aggregate_features/{family}_{layers}_layers"), |b| b.iter(|| AggregateFeatures::of(job)));
        for estimator in estimators.all().iter().filter(|e| e.family == *family) {
            c.bench_function(&format!("estimator/{}", estimator.name()), |b| {
                b.iter(|| estimator.run(job, &AggregateFeatures::of(job)).unwrap())
            });
        }
        c.bench_function(&format!("estimate_all_estimators/{family}"), |b| b.iter(|| estimators.estimate(job, 0.95).unwrap()));
    }

    // 256 held-out MLP jobs through one estimate_many call (what the batch route does).
    let held_out = held_out_mlp_jobs();
    let batch: Vec<_> = held_out.iter().cycle().take(256).map(|job| (job, 0.95)).collect();
    c.bench_function("estimate_many/256_mlp_jobs", |b| b.iter(|| estimators.estimate_many(&batch)));
}

/// Placing a simulated job against a training domain of the size the pipeline writes (~3,000
/// jobs x 11 features; pseudo-random points here): the nearest distance alone, and with the
/// job's normalised vector.
fn extrapolation(c: &mut Criterion) {
    use gpucast::estimators::extrapolation::TrainingDomain;
    const ORDER: [&str; 11] = [
        "sim_reserved_mib", "sim_activations_mib", "total_params", "activations_x_batch", "batch_size", "n_layers",
        "n_conv", "n_attention", "n_norm", "n_embedding", "max_output_size",
    ];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % 6_000) as f64 / 1000.0 - 3.0
    };
    let points: Vec<Vec<f64>> = (0..3000).map(|_| (0..ORDER.len()).map(|_| next()).collect()).collect();
    let features: Vec<serde_json::Value> =
        ORDER.iter().map(|name| serde_json::json!({"name": name, "transform": "log1p", "mean": 5.0, "std": 3.0})).collect();
    let file = serde_json::json!({
        "features": features, "order": ORDER, "optimizers": ["adam"], "precisions": ["fp32"],
        "typical_distance": 1.7, "near": 1.0, "far": 2.0, "max_widen": 2.0, "points": points,
    });
    let domain = TrainingDomain::parse(file.to_string().as_bytes(), |_| true).expect("a valid domain");
    let (_, job) = jobs_by_family().into_iter().find(|(family, _)| *family == Family::Cnn).expect("resnet50");
    let aggregate = AggregateFeatures::of(&job);
    let vector = domain.vector(&aggregate);
    c.bench_function("extrapolation/nearest_of_3000x11", |b| b.iter(|| domain.nearest_distance(std::hint::black_box(&vector))));
    c.bench_function("extrapolation/locate_resnet50", |b| b.iter(|| domain.locate(&job, std::hint::black_box(&aggregate))));
}

fn held_out_mlp_jobs() -> Vec<Job> {
    let file = std::fs::File::open(root().join("data/mlp/test.jsonl.gz")).unwrap();
    std::io::BufReader::new(flate2::read::GzDecoder::new(file))
        .lines()
        .map(|line| {
            let row: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
            to_job(&serde_json::from_value(row["job"].clone()).unwrap()).unwrap()
        })
        .collect()
}

fn http_round_trip(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let config = ServeConfig::for_tests(root().join("models"), dylib());
    let (address, client) = runtime.block_on(async {
        let app = Application::build(&config).await.expect("application starts");
        let address = format!("http://127.0.0.1:{}/v1/estimate", app.port());
        tokio::spawn(app.run_until(std::future::pending()));
        (address, reqwest::Client::new())
    });
    let body = example().to_string();
    c.bench_function("http_round_trip/v1_estimate", |b| {
        b.iter(|| {
            runtime.block_on(async {
                let response = client
                    .post(&address)
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send()
                    .await
                    .unwrap();
                assert!(response.status().is_success());
                response.bytes().await.unwrap()
            })
        })
    });
}

criterion_group!(benches, extrapolation, in_process, http_round_trip);
criterion_main!(benches);
