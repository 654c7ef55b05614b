//! Latency of one estimate: features alone, each estimator in process, the whole family, and
//! one HTTP round trip on loopback. `cargo bench --bench estimate` (needs ORT_DYLIB_PATH or
//! scripts/fetch-onnxruntime.sh).

use criterion::{criterion_group, criterion_main, Criterion};
use gpucast::config::ServeConfig;
use std::io::BufRead;

use gpucast::api::types::EstimateRequest;
use gpucast::engine::validate::to_job;
use gpucast::estimators::features::AggregateFeatures;
use gpucast::estimators::Estimators;
use gpucast::job::{Family, Job};
use gpucast::startup::Application;

#[path = "../tests/common/mod.rs"]
mod common;

use common::{example_job as example, ort_dylib as dylib, repo_root as root};

/// A realistic job of each family: the OpenAPI example MLP, timm resnet50 and ViT-B/16.
fn jobs_by_family() -> Vec<(Family, Job)> {
    let example: EstimateRequest = serde_json::from_value(example()).unwrap();
    let mut jobs = vec![(Family::Mlp, to_job(&example).unwrap())];
    let file = std::fs::File::open(root().join("data/timm/descriptions.jsonl.gz")).unwrap();
    for line in std::io::BufReader::new(flate2::read::GzDecoder::new(file)).lines() {
        let line = line.unwrap();
        for (model, family, batch) in [
            ("timm:resnet50", Family::Cnn, 64),
            ("timm:vit_base_patch16_224", Family::Transformer, 32),
        ] {
            if line.contains(&format!("\"{model}\"")) {
                let mut request: EstimateRequest = serde_json::from_str(&line).unwrap();
                request.batch_size = Some(batch);
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
        c.bench_function(
            &format!("aggregate_features/{family}_{layers}_layers"),
            |b| b.iter(|| AggregateFeatures::of(job)),
        );
        for estimator in estimators.all().iter().filter(|e| e.family == *family) {
            c.bench_function(&format!("estimator/{}", estimator.name()), |b| {
                b.iter(|| estimator.run(job, &AggregateFeatures::of(job)).unwrap())
            });
        }
        let a100 = gpucast::devices::sku::Catalogue::builtin()
            .by_id("a100-40gb")
            .unwrap()
            .performance;
        c.bench_function(&format!("roofline/{family}_{layers}_layers"), |b| {
            b.iter(|| gpucast::physics::perf::roofline(std::hint::black_box(job), &a100))
        });
        c.bench_function(&format!("estimate_all_estimators/{family}"), |b| {
            b.iter(|| estimators.estimate(job, 0.95).unwrap())
        });
    }

    // 256 held-out MLP jobs through one estimate_many call (what the batch route does).
    let held_out = held_out_mlp_jobs();
    let batch: Vec<_> = held_out
        .iter()
        .cycle()
        .take(256)
        .map(|job| (job, 0.95))
        .collect();
    c.bench_function("estimate_many/256_mlp_jobs", |b| {
        b.iter(|| estimators.estimate_many(&batch))
    });
}

/// Placing a simulated job against a training domain of the size the pipeline writes (~3,000
/// jobs x 11 features; pseudo-random points here): the nearest distance alone, and with the
/// job's normalised vector.
fn extrapolation(c: &mut Criterion) {
    use gpucast::estimators::extrapolation::TrainingDomain;
    // The coordinates of the committed domain, in its order.
    let committed: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("models/simulated_domain.json")).unwrap(),
    )
    .unwrap();
    let order: Vec<String> = serde_json::from_value(committed["order"].clone()).unwrap();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % 6_000) as f64 / 1000.0 - 3.0
    };
    let points: Vec<Vec<f64>> = (0..3000)
        .map(|_| (0..order.len()).map(|_| next()).collect())
        .collect();
    let features: Vec<serde_json::Value> = order
        .iter()
        .map(
            |name| serde_json::json!({"name": name, "transform": "log1p", "mean": 5.0, "std": 3.0}),
        )
        .collect();
    let file = serde_json::json!({
        "features": features, "order": order, "optimizers": ["adam"], "precisions": ["fp32"],
        "typical_distance": 1.7, "near": 1.0, "far": 2.0, "max_widen": 2.0, "points": points,
    });
    let domain =
        TrainingDomain::parse(file.to_string().as_bytes(), |_| true).expect("a valid domain");
    let (_, job) = jobs_by_family()
        .into_iter()
        .find(|(family, _)| *family == Family::Cnn)
        .expect("resnet50");
    let aggregate = AggregateFeatures::of(&job);
    let vector = domain.vector(&aggregate);
    c.bench_function("extrapolation/nearest_of_3000x11", |b| {
        b.iter(|| domain.nearest_distance(std::hint::black_box(&vector)))
    });
    c.bench_function("extrapolation/locate_resnet50", |b| {
        b.iter(|| domain.locate(&job, std::hint::black_box(&aggregate)))
    });
}

/// timm resnet50 at batch 64 and ViT-B/16 at batch 32 as `gpucast_describe` writes them, each
/// with a whole-step `simulation`, parsed and validated by the service's own path
/// (`EstimateRequest` then `to_job`: the simulation's batch size, optimizer and precision match
/// the job's, allocated <= min_capacity <= reserved, the breakdown sums to the allocated peak).
fn simulated_jobs() -> Vec<(Family, Job)> {
    // resnet50, Adam, fp32, batch 64; the categories sum exactly to allocated_peak_bytes.
    let resnet50 = serde_json::json!({
        "batch_size": 64, "optimizer": "adam", "precision": "fp32", "attention": "efficient",
        "allocated_peak_bytes": 5_868_437_504u64, "reserved_peak_bytes": 6_312_427_520u64,
        "min_capacity_bytes": 5_893_849_088u64,
        "breakdown_at_peak": {
            "parameters": 102_475_264u64, "gradients": 8_589_312u64, "optimizer_state": 207_872_000u64,
            "activations": 5_445_000_000u64, "temporaries": 104_500_928u64
        },
        "interpolated": false
    });
    // ViT-B/16 at batch 32, scaled from resnet50's: parameters, gradients and optimizer state by
    // the parameter ratio (86.6 M / 25.6 M), activations and temporaries by saved bytes x batch
    // (0.688), reserved and min_capacity by resnet50's ratios to its allocated peak (reserved
    // rounded up to 2 MiB). allocated 4,670.3 MiB <= min_capacity 4,690.5 <= reserved 5,024.
    let vit_b16 = serde_json::json!({
        "batch_size": 32, "optimizer": "adam", "precision": "fp32", "attention": "efficient",
        "allocated_peak_bytes": 4_897_187_904u64, "reserved_peak_bytes": 5_268_045_824u64,
        "min_capacity_bytes": 4_918_393_856u64,
        "breakdown_at_peak": {
            "parameters": 347_107_840u64, "gradients": 29_093_888u64, "optimizer_state": 704_111_104u64,
            "activations": 3_745_000_000u64, "temporaries": 71_875_072u64
        },
        "interpolated": false
    });
    let wanted = [
        ("timm:resnet50", Family::Cnn, resnet50),
        ("timm:vit_base_patch16_224", Family::Transformer, vit_b16),
    ];
    let file = std::fs::File::open(root().join("data/timm/descriptions.jsonl.gz")).unwrap();
    let mut jobs = Vec::new();
    for line in std::io::BufReader::new(flate2::read::GzDecoder::new(file)).lines() {
        let line = line.unwrap();
        for (model, family, simulation) in &wanted {
            if line.contains(&format!("\"{model}\"")) {
                let mut request: serde_json::Value = serde_json::from_str(&line).unwrap();
                request["batch_size"] = simulation["batch_size"].clone();
                request["simulation"] = simulation.clone();
                let request: EstimateRequest = serde_json::from_value(request).unwrap();
                let job = to_job(&request)
                    .unwrap_or_else(|e| panic!("{model}: the service refuses its simulation: {e}"));
                assert!(job.simulation().is_some(), "{model}: simulation kept");
                assert_eq!(job.family(), *family, "{model}");
                jobs.push((*family, job));
            }
        }
    }
    assert_eq!(
        jobs.len(),
        wanted.len(),
        "both descriptions in data/timm/descriptions.jsonl.gz"
    );
    jobs
}

/// Every estimator for a simulated job: the `simulated` figure, and whatever regressor that
/// requires the simulation (and training domain) models/ holds, beside the family's others.
fn simulated(c: &mut Criterion) {
    let estimators = Estimators::load(&root().join("models"), &dylib(), 1).expect("models load");
    let a100 = gpucast::devices::sku::Catalogue::builtin()
        .by_id("a100-40gb")
        .unwrap()
        .performance;
    for (family, job) in simulated_jobs() {
        let layers = job.layers().len();
        let batch = job.batch_size();
        let answer = estimators
            .estimate(&job, 0.95)
            .expect("a simulated job is estimated");
        let ran: Vec<&str> = answer.runs.iter().map(|run| run.name.as_str()).collect();
        eprintln!("simulated {family} ({layers} layers, batch {batch}): ran {ran:?}");
        c.bench_function(
            &format!("roofline/simulated_{family}_{layers}_layers_batch{batch}"),
            |b| b.iter(|| gpucast::physics::perf::roofline(std::hint::black_box(&job), &a100)),
        );
        c.bench_function(
            &format!("estimate_all_estimators/simulated_{family}_{layers}_layers_batch{batch}"),
            |b| {
                b.iter(|| {
                    estimators
                        .estimate(std::hint::black_box(&job), 0.95)
                        .unwrap()
                })
            },
        );
    }
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
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let config = ServeConfig::for_tests(root().join("models"), dylib());
    let (address, client) = runtime.block_on(async {
        let app = Application::build(&config)
            .await
            .expect("application starts");
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

/// A job from a Hugging Face config alone (issue 16): Llama-2-70B's (80 layers, 725 modules)
/// at 4,096 tokens, bf16, LoRA: validating the request builds the model; then every
/// estimator that applies (the analytic step) and the roofline on an A100 (the answer's
/// `performance`).
fn transformer_config(c: &mut Criterion) {
    let estimators = Estimators::load(&root().join("models"), &dylib(), 1).expect("models load");
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            root()
                .join("tests/fixtures/transformer_configs/public/meta-llama__Llama-2-70b-hf.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let body = serde_json::json!({
        "transformer_config": config,
        "seq_len": 4096,
        "batch_size": 8,
        "micro_batch_size": 1,
        "gradient_accumulation_steps": 8,
        "precision": "bf16",
        "activation_checkpointing": "full",
        "lora": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
    })
    .to_string();
    let parse = |body: &str| -> Job {
        let request: EstimateRequest = serde_json::from_str(body).unwrap();
        to_job(&request).unwrap()
    };
    let job = parse(&body);
    eprintln!("llama-2-70b config: {} layers", job.layers().len());
    c.bench_function("transformer_config/llama2_70b_parse_and_build", |b| {
        b.iter(|| parse(std::hint::black_box(&body)))
    });
    c.bench_function("transformer_config/llama2_70b_estimate", |b| {
        b.iter(|| {
            estimators
                .estimate(std::hint::black_box(&job), 0.95)
                .unwrap()
        })
    });
    let a100 = gpucast::devices::sku::Catalogue::builtin()
        .by_id("a100-80gb")
        .unwrap()
        .performance;
    c.bench_function("transformer_config/llama2_70b_roofline", |b| {
        b.iter(|| gpucast::physics::perf::roofline(std::hint::black_box(&job), &a100))
    });
    c.bench_function("transformer_config/llama2_70b_request_to_answer", |b| {
        b.iter(|| {
            let job = parse(std::hint::black_box(&body));
            let estimate = estimators.estimate(&job, 0.95).unwrap();
            (estimate, gpucast::physics::perf::roofline(&job, &a100))
        })
    });
}

criterion_group!(
    benches,
    transformer_config,
    extrapolation,
    simulated,
    in_process,
    http_round_trip
);
criterion_main!(benches);
