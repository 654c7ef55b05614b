//! Where one estimate's time goes in process, stage by stage: parse the body, validate it into
//! a job, run the estimators and physics, the whole answer (estimators, physics, roofline,
//! placement, the wire answer), and serialise it. Each request file given is one job; every
//! stage is run `--runs` times and its median and p90 printed in microseconds as JSON lines,
//! then each model and formula of the estimators stage as the estimate times it
//! (scripts/floor-bench.py runs this beside the HTTP comparison and writes the tables).
//!
//! `cargo run --release --example stage_timings -- [--runs N] [--gap-ms MS] FILE...` (needs ORT_DYLIB_PATH or
//! scripts/fetch-onnxruntime.sh).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpucast::api::parse::parse_estimate;
use gpucast::calibration::store::ProfileStore;
use gpucast::devices::sku::Catalogue;
use gpucast::devices::NoDevices;
use gpucast::engine::answer::{answer, learned_utilization};
use gpucast::engine::validate::validate;
use gpucast::engine::Engine;
use gpucast::estimators::{Estimators, Query};
use gpucast::metrics::Metrics;
use gpucast::physics::perf::roofline;

/// The service's allocator (src/main.rs), so that the stages cost what they cost there.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A duration in microseconds, to a tenth.
fn micros(d: Duration) -> f64 {
    (d.as_nanos() as f64 / 100.0).round() / 10.0
}

/// Median and 90th percentile of `runs` timings of `f`, in microseconds; with a `gap`, the
/// process sleeps that long after each run (a request that arrives alone finds the CPU's
/// caches gone to other work).
fn time<T>(runs: usize, gap: Duration, mut f: impl FnMut() -> T) -> (f64, f64) {
    let mut samples: Vec<Duration> = (0..runs)
        .map(|_| {
            let started = Instant::now();
            std::hint::black_box(f());
            let elapsed = started.elapsed();
            std::thread::sleep(gap);
            elapsed
        })
        .collect();
    samples.sort_unstable();
    (micros(samples[runs / 2]), micros(samples[runs * 9 / 10]))
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut runs = 2000;
    if let Some(at) = args.iter().position(|a| a == "--runs") {
        runs = args[at + 1].parse().expect("--runs N");
        args.drain(at..at + 2);
    }
    let mut gap = Duration::ZERO;
    if let Some(at) = args.iter().position(|a| a == "--gap-ms") {
        gap = Duration::from_millis(args[at + 1].parse().expect("--gap-ms N"));
        args.drain(at..at + 2);
    }
    let dylib = std::env::var("ORT_DYLIB_PATH")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root().join(".cache/onnxruntime/libonnxruntime.so"));
    let estimators = Estimators::load(&root().join("models"), &dylib, 1).expect("models load");
    let store_dir = std::env::temp_dir().join(format!("gpucast-stages-{}", std::process::id()));
    let (profiles, _) = ProfileStore::load(&store_dir).expect("an empty profile store");
    let _ = std::fs::remove_dir_all(&store_dir);
    let engine = Engine {
        estimators: Arc::new(estimators),
        catalogue: Arc::new(Catalogue::builtin().clone()),
        profiles: Arc::new(profiles),
        metrics: Arc::new(Metrics::new()),
        devices: Arc::new(NoDevices::new("stage timings read no GPU")),
        cost_budget: gpucast::config::DEFAULT_MAX_REQUEST_COST,
        // Every stage is timed as computed: no answer is reused.
        memo: gpucast::engine::memo::AnswerMemo::OFF,
    };
    for file in &args {
        let body = std::fs::read(file).expect("a request file");
        let request = parse_estimate(&body, "").expect("a valid request");
        let valid = || validate(&request, &engine.catalogue, engine.devices.as_ref()).unwrap();
        let sample = valid();
        let response = answer(&engine, valid(), Instant::now()).expect("an answer");
        let query = Query {
            job: &sample.job,
            confidence: sample.confidence.get(),
            capacity_mib: sample.target.capacity_mib,
            classifiers: sample.classifiers,
            utilization: learned_utilization(&engine, &sample.target),
        };
        let stages = [
            (
                "parse",
                time(runs, gap, || parse_estimate(&body, "").unwrap()),
            ),
            ("validate", time(runs, gap, valid)),
            (
                "estimators_and_physics",
                time(runs, gap, || {
                    engine.estimators.estimate_query(query).unwrap()
                }),
            ),
            (
                "roofline",
                time(runs, gap, || {
                    sample
                        .target
                        .performance
                        .as_ref()
                        .map(|gpu| roofline(&sample.job, gpu))
                }),
            ),
            (
                "answer",
                time(runs, gap, || {
                    answer(&engine, valid(), Instant::now()).unwrap()
                }),
            ),
            (
                "serialise",
                time(runs, gap, || serde_json::to_vec(&response).unwrap()),
            ),
            (
                "in_process_total",
                time(runs, gap, || {
                    let request = parse_estimate(&body, "").unwrap();
                    let valid =
                        validate(&request, &engine.catalogue, engine.devices.as_ref()).unwrap();
                    serde_json::to_vec(&answer(&engine, valid, Instant::now()).unwrap()).unwrap()
                }),
            ),
        ];
        for (stage, (p50, p90)) in stages {
            println!(
                "{}",
                serde_json::json!({"file": file, "stage": stage, "p50_us": p50, "p90_us": p90})
            );
        }
        // Each model and formula of the estimators stage, as the estimate times it.
        let mut by_model: std::collections::BTreeMap<String, Vec<Duration>> = Default::default();
        for _ in 0..runs {
            let estimate = engine.estimators.estimate_query(query).unwrap();
            for run in estimate.runs {
                by_model.entry(run.name).or_default().push(run.latency);
            }
            std::thread::sleep(gap);
        }
        for (model, mut samples) in by_model {
            samples.sort_unstable();
            let (p50, p90) = (
                micros(samples[samples.len() / 2]),
                micros(samples[samples.len() * 9 / 10]),
            );
            println!(
                "{}",
                serde_json::json!({"file": file, "model": model, "p50_us": p50, "p90_us": p90})
            );
        }
    }
}
