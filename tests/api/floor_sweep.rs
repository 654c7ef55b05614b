//! The physical floor over every job the committed models may meet: each timm training model
//! `describe` wrote, at batch sizes from 1 to 512, and every simulated (model, batch size) of
//! data/timm/simulations.jsonl.gz where that file exists (or of the file
//! `GPUCAST_SWEEP_SIMULATIONS` names).
//!
//! In process, not over HTTP: the jobs go through `engine::answer::answer_items`, the code the
//! batch route runs once its items are validated (the same estimators, placement, rounding and
//! wire types, class and breakdown), without the round trip's JSON: some 11,000 descriptions of
//! ~30 KB each would be ~350 MB to write and parse in an unoptimised test build, and the body
//! limit (2 MiB) would split them into hundreds of requests. What the sweep checks is the
//! answer, not the transport, which the other API tests cover.

use std::io::BufRead;
use std::time::Instant;

use gpucast::api::types::{
    BreakdownSourceName, EstimateRequest, EstimateResponse, SimulationRequest,
};
use gpucast::engine::answer::answer_items;
use gpucast::engine::validate::{validate, ValidEstimateRequest};
use gpucast::startup::Application;
use serde_json::Value;

use crate::helpers::{models_dir, repo_root, test_config, training_descriptions};

const BATCH_SIZES: [u64; 18] = [
    1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512,
];
const MIB: f64 = 1024.0 * 1024.0;
/// Figures and categories are rounded to 0.1 MiB: half a step either way.
const ROUNDING_MIB: f64 = 0.05;
/// Jobs answered per call, as a batch request would carry them.
const CHUNK: usize = 256;

/// One job of the sweep, and what its answer's model state must be.
struct Case {
    label: String,
    request: EstimateRequest,
    /// Parameters, gradients and optimizer state in MiB, from the request itself: the
    /// simulation's categories, or the per-parameter bytes of docs/design/models.md.
    model_state_mib: [f64; 3],
}

fn analytic_model_state(request: &EstimateRequest) -> [f64; 3] {
    let params: f64 = request
        .layers
        .as_ref()
        .unwrap()
        .iter()
        .map(|l| l.params as f64)
        .sum();
    let weights = match request.precision.as_deref().unwrap_or("fp32") {
        "fp32" => 4.0,
        other => panic!("no description of the sweep is trained in {other}"),
    };
    let state = match request.optimizer.as_deref().unwrap_or("adam") {
        "adam" | "adamw" => 8.0,
        other => panic!("no description of the sweep is trained with {other}"),
    };
    [
        params * weights / MIB,
        params * 4.0 / MIB,
        params * state / MIB,
    ]
}

fn assert_holds(case: &Case, answer: &EstimateResponse) {
    let label = &case.label;
    let memory = &answer.memory;
    let estimate = memory
        .estimate_mib
        .unwrap_or_else(|| panic!("{label}: no figure"));
    let bound = memory.upper_bound_mib.unwrap();
    let breakdown = memory
        .breakdown
        .as_ref()
        .unwrap_or_else(|| panic!("{label}: no breakdown"));
    let parts = [
        breakdown.parameters,
        breakdown.gradients,
        breakdown.optimizer_state,
        breakdown.activations,
        breakdown.temporaries,
        breakdown.allocator_cache,
        breakdown.cuda_context,
    ];
    assert!(parts.iter().all(|&p| p >= 0.0), "{label}: {breakdown:?}");
    assert!(
        (parts.iter().sum::<f64>() - estimate).abs() < ROUNDING_MIB,
        "{label}: {breakdown:?} does not sum to {estimate}"
    );
    // The floor's categories are the job's own (not shrunk to make room for a low figure).
    for (part, expected) in parts.iter().zip(case.model_state_mib) {
        assert!(
            (part - expected).abs() <= 0.1 + 1e-9,
            "{label}: model state {breakdown:?}, expected {:?}",
            case.model_state_mib
        );
    }
    let simulated = memory.breakdown_source == Some(BreakdownSourceName::Simulation);
    assert_eq!(simulated, case.request.simulation.is_some(), "{label}");
    let floor = breakdown.parameters
        + breakdown.gradients
        + breakdown.optimizer_state
        + if simulated {
            breakdown.activations
        } else {
            0.0
        }
        + breakdown.cuda_context;
    assert!(
        estimate >= floor - ROUNDING_MIB,
        "{label}: {estimate} below the floor {floor}"
    );
    assert!(
        bound >= estimate,
        "{label}: bound {bound} below the figure {estimate}"
    );
    let class = &memory.class;
    let inside = estimate > class.lower_mib as f64 - ROUNDING_MIB
        && class
            .upper_mib
            .is_none_or(|upper| estimate <= upper as f64 + ROUNDING_MIB);
    assert!(inside, "{label}: {estimate} outside its class {class:?}");
}

/// Answers the cases in chunks and checks every answer; returns (answers checked, floored).
fn sweep(app: &Application, cases: &[Case]) -> (usize, usize) {
    let state = &*app.state().engine;
    let mut floored = 0;
    for chunk in cases.chunks(CHUNK) {
        let items: Vec<ValidEstimateRequest> = chunk
            .iter()
            .map(|case| {
                validate(&case.request, &state.catalogue, state.devices.as_ref())
                    .unwrap_or_else(|e| panic!("{}: refused: {e}", case.label))
            })
            .collect();
        for (case, answer) in chunk
            .iter()
            .zip(answer_items(state, &items, Instant::now()))
        {
            let answer = answer.unwrap_or_else(|e| panic!("{}: {e}", case.label));
            assert_holds(case, &answer);
            floored += usize::from(answer.memory.floored);
        }
    }
    (cases.len(), floored)
}

fn described() -> Vec<(String, EstimateRequest)> {
    training_descriptions()
        .into_iter()
        .map(|d| {
            (
                d["model"].as_str().unwrap().to_string(),
                serde_json::from_value(d).unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn every_timm_model_at_every_batch_size_is_answered_at_or_above_its_physical_floor() {
    let app = Application::build(&test_config(&models_dir()))
        .await
        .expect("the application starts");
    let started = Instant::now();
    let descriptions = described();
    let mut cases = Vec::with_capacity(descriptions.len() * BATCH_SIZES.len());
    for (model, request) in &descriptions {
        for batch in BATCH_SIZES {
            let mut request = request.clone();
            request.batch_size = Some(batch);
            let model_state_mib = analytic_model_state(&request);
            cases.push(Case {
                label: format!("{model} at batch {batch}"),
                request,
                model_state_mib,
            });
        }
    }
    assert!(
        descriptions.len() > 600,
        "the timm descriptions are read: {}",
        descriptions.len()
    );
    let (described_checked, described_floored) = sweep(&app, &cases);
    println!(
        "physical-floor sweep: {described_checked} described jobs checked ({} models x {} batch sizes; {described_floored} raised to the floor) in {:.1} s",
        descriptions.len(),
        BATCH_SIZES.len(),
        started.elapsed().as_secs_f64()
    );

    // GPUCAST_SWEEP_SIMULATIONS: another file of the same format (one to be committed, say).
    let path = std::env::var_os("GPUCAST_SWEEP_SIMULATIONS").map_or_else(
        || repo_root().join("data/timm/simulations.jsonl.gz"),
        std::path::PathBuf::from,
    );
    if !path.exists() {
        println!(
            "physical-floor sweep: {} is absent; the simulated jobs are not swept",
            path.display()
        );
        return;
    }
    let started = Instant::now();
    let by_model: std::collections::HashMap<&str, &EstimateRequest> =
        descriptions.iter().map(|(m, r)| (m.as_str(), r)).collect();
    let file = std::fs::File::open(&path).unwrap();
    let mut cases = Vec::new();
    for line in std::io::BufReader::new(flate2::read::GzDecoder::new(file)).lines() {
        let entry: Value = serde_json::from_str(&line.unwrap()).unwrap();
        let model = entry["model"].as_str().expect("a model name");
        let description = by_model
            .get(model)
            .unwrap_or_else(|| panic!("{model} is simulated but not described"));
        for (batch, simulation) in entry["simulations"]
            .as_object()
            .expect("simulations by batch size")
        {
            let simulation: SimulationRequest = serde_json::from_value(simulation.clone())
                .unwrap_or_else(|e| panic!("{model} at batch {batch}: {e}"));
            let mut request = (*description).clone();
            request.batch_size = Some(
                batch
                    .parse()
                    .unwrap_or_else(|_| panic!("{model}: batch size '{batch}'")),
            );
            // The job is trained as simulated.
            request.optimizer = simulation.optimizer.clone();
            request.precision = simulation.precision.clone();
            let categories = &simulation.breakdown_at_peak;
            let model_state_mib = [
                categories.parameters,
                categories.gradients,
                categories.optimizer_state,
            ]
            .map(|b| b as f64 / MIB);
            request.simulation = Some(simulation);
            cases.push(Case {
                label: format!("{model} at batch {batch}, simulated"),
                request,
                model_state_mib,
            });
        }
    }
    let (simulated_checked, simulated_floored) = sweep(&app, &cases);
    println!(
        "physical-floor sweep: {simulated_checked} simulated jobs checked ({simulated_floored} raised to the floor) in {:.1} s; {} in all",
        started.elapsed().as_secs_f64(),
        described_checked + simulated_checked
    );
}
