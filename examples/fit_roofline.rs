//! Fits the roofline performance model's two host constants (`host_us_per_op`,
//! `step_host_us`: src/physics/perf/) on the measured SMACT and SMOCC of the MLP TRAIN rows
//! (data/perf/mlp_train_utilization.jsonl.gz, A100 40 GB), with leave-one-shape-out folds:
//! for each architecture shape, the constants that minimise the mean absolute error of
//! SMACT + SMOCC on the other three shapes are scored on it. Then the constants chosen on all
//! train rows. The held-out test rows are never read here (tests/api/roofline.rs scores them).
//!
//! ```sh
//! cargo run --release --example fit_roofline
//! ```

use std::collections::BTreeMap;
use std::io::BufRead;

use gpucast::api::types::EstimateRequest;
use gpucast::devices::sku::Catalogue;
use gpucast::engine::validate::to_job;
use gpucast::job::Job;
use gpucast::physics::perf::{roofline_with, Constants, CALIBRATED};

struct Row {
    shape: String,
    job: Job,
    smact: f64,
    smocc: f64,
}

fn rows() -> Vec<Row> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data/perf/mlp_train_utilization.jsonl.gz");
    let file = std::fs::File::open(&path).expect("data/perf/mlp_train_utilization.jsonl.gz");
    std::io::BufReader::new(flate2::read::GzDecoder::new(file))
        .lines()
        .map(|line| {
            let value: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
            let request: EstimateRequest = serde_json::from_value(value["job"].clone()).unwrap();
            Row {
                shape: value["shape"].as_str().unwrap().to_string(),
                job: to_job(&request).unwrap(),
                smact: value["smact"].as_f64().unwrap(),
                smocc: value["smocc"].as_f64().unwrap(),
            }
        })
        .collect()
}

/// Mean absolute errors (SMACT, SMOCC) of `constants` on `rows`.
fn errors<'a>(rows: impl Iterator<Item = &'a Row>, constants: &Constants) -> (f64, f64, usize) {
    let gpu = Catalogue::builtin().by_id("a100-40gb").unwrap().performance;
    let (mut act, mut occ, mut n) = (0.0, 0.0, 0);
    for row in rows {
        let r = roofline_with(&row.job, &gpu, constants);
        act += (r.smact - row.smact).abs();
        occ += (r.smocc - row.smocc).abs();
        n += 1;
    }
    (act / n as f64, occ / n as f64, n)
}

fn grid() -> Vec<Constants> {
    let mut grid = Vec::new();
    for host in [2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 15.0, 20.0, 25.0, 30.0] {
        for step in [0.0, 250.0, 500.0, 1000.0, 2000.0, 4000.0] {
            for input in [0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0] {
                grid.push(Constants {
                    host_us_per_op: host,
                    step_host_us: step,
                    input_host_ns_per_element: input,
                    ..CALIBRATED
                });
            }
        }
    }
    grid
}

fn best(rows: &[&Row], grid: &[Constants]) -> (Constants, f64) {
    grid.iter()
        .map(|c| {
            let (a, o, _) = errors(rows.iter().copied(), c);
            (*c, a + o)
        })
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap()
}

fn main() {
    let rows = rows();
    let grid = grid();
    let shapes: Vec<String> = {
        let mut s: Vec<String> = rows.iter().map(|r| r.shape.clone()).collect();
        s.sort();
        s.dedup();
        s
    };
    println!("{} train rows, {} grid points\n", rows.len(), grid.len());
    println!("| held-out shape | rows | constants chosen on the others (host us/op, step host us, input host ns/element) | SMACT MAE | SMOCC MAE |");
    println!("| --- | --- | --- | --- | --- |");
    let mut pooled: BTreeMap<&str, (f64, f64, usize)> = BTreeMap::new();
    for shape in &shapes {
        let others: Vec<&Row> = rows.iter().filter(|r| &r.shape != shape).collect();
        let (chosen, _) = best(&others, &grid);
        let (a, o, n) = errors(rows.iter().filter(|r| &r.shape == shape), &chosen);
        println!(
            "| {shape} | {n} | {}, {}, {} | {a:.4} | {o:.4} |",
            chosen.host_us_per_op, chosen.step_host_us, chosen.input_host_ns_per_element
        );
        let e = pooled.entry("all").or_default();
        e.0 += a * n as f64;
        e.1 += o * n as f64;
        e.2 += n;
    }
    let (a, o, n) = pooled["all"];
    println!(
        "| all (leave-one-shape-out) | {n} | | {:.4} | {:.4} |",
        a / n as f64,
        o / n as f64
    );
    let all: Vec<&Row> = rows.iter().collect();
    let (chosen, _) = best(&all, &grid);
    let (a, o, _) = errors(rows.iter(), &chosen);
    println!(
        "\nOn all train rows: host_us_per_op = {}, step_host_us = {}, input_host_ns_per_element = {} \
         (SMACT MAE {a:.4}, SMOCC MAE {o:.4})",
        chosen.host_us_per_op, chosen.step_host_us, chosen.input_host_ns_per_element
    );
    let (a, o, _) = errors(rows.iter(), &CALIBRATED);
    println!(
        "Committed CALIBRATED ({}, {}, {}): SMACT MAE {a:.4}, SMOCC MAE {o:.4}",
        CALIBRATED.host_us_per_op, CALIBRATED.step_host_us, CALIBRATED.input_host_ns_per_element
    );
    if std::env::args().any(|a| a == "--rows") {
        let gpu = Catalogue::builtin().by_id("a100-40gb").unwrap().performance;
        for row in rows.iter().step_by(97) {
            let r = roofline_with(&row.job, &gpu, &CALIBRATED);
            println!(
                "{} batch {} layers {}: smact {:.3} (measured {:.3}) smocc {:.3} ({:.3}) step {:.3} ms {:?}",
                row.shape,
                row.job.batch_size(),
                row.job.layers().len(),
                r.smact,
                row.smact,
                r.smocc,
                row.smocc,
                r.step_time_ms,
                r.bound
            );
        }
    }
}
