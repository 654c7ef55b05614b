//! The published training runs of public_training_memory.csv whose setup the API expresses
//! (data/public/setup_jobs.jsonl.gz, made by `python -m gpucast_training public-setups`),
//! answered by the running service and compared like with like with what each source
//! measured (allocated, reserved or the device total), per setup family, beside DeepSpeed's
//! and accelerate's estimates of the same rows. `cargo test --test api public_setups --
//! --nocapture` prints the table (per setup family; held out: docs/reports/accuracy.md).

use std::collections::BTreeMap;
use std::io::BufRead;

use serde_json::Value;

use crate::helpers::median;
use crate::helpers::{repo_root, spawn_app};

pub struct Row {
    pub line: Value,
    pub answer: Value,
}

/// The committed rows (or those of `GPUCAST_PUBLIC_SETUPS`, a path, while regenerating them).
fn rows() -> Vec<Value> {
    let path = std::env::var("GPUCAST_PUBLIC_SETUPS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| repo_root().join("data/public/setup_jobs.jsonl.gz"));
    let file = std::fs::File::open(&path).expect("data/public/setup_jobs.jsonl.gz");
    std::io::BufReader::new(flate2::read::GzDecoder::new(file))
        .lines()
        .map(|line| serde_json::from_str(&line.unwrap()).unwrap())
        .collect()
}

fn part(answer: &Value, category: &str) -> f64 {
    answer["memory"]["breakdown"][category]
        .as_f64()
        .unwrap_or(0.0)
}

/// gpucast's figure for what the row measured, and how far the answer's bound lies above it.
pub fn like_with_like(compare: &str, answer: &Value) -> Option<(f64, f64)> {
    let device = answer["memory"]["estimate_mib"].as_f64()?;
    let bound = answer["memory"]["upper_bound_mib"].as_f64()?;
    let reserved = device - part(answer, "cuda_context") - part(answer, "paged_optimizer_state");
    let allocated = reserved - part(answer, "allocator_cache");
    let weights = part(answer, "parameters");
    let figure = match compare {
        "device" => device,
        "reserved" => reserved,
        "allocated" | "active" => allocated,
        "allocated_minus_weights" => allocated - weights,
        "reserved_minus_weights" => reserved - weights,
        _ => return None,
    };
    Some((figure, bound - device))
}

fn quantile(mut values: Vec<f64>, q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    values[((values.len() - 1) as f64 * q).round() as usize]
}

/// Per-family figures of the public rows.
#[derive(Default)]
struct Family {
    errors: Vec<f64>,
    signed: Vec<f64>,
    exceeded: usize,
    baselines: BTreeMap<&'static str, Vec<f64>>,
}

const BASELINES: [(&str, &str); 3] = [
    ("deepspeed_zero2_mib", "DeepSpeed ZeRO-2"),
    ("deepspeed_zero3_mib", "DeepSpeed ZeRO-3"),
    ("accelerate_mib", "accelerate"),
];

/// Every row answered; `simulations: false` answers the jobs without their `simulation` (the
/// analytic training step's figures).
async fn answered(simulations: bool) -> Vec<Row> {
    let app = spawn_app().await;
    let mut answered = Vec::new();
    for line in rows() {
        let mut job = line["job"].clone();
        if !simulations {
            job.as_object_mut().unwrap().remove("simulation");
        }
        let response = app.post_json("/v1/estimate", &job).await;
        let status = response.status();
        let answer: Value = response.json().await.unwrap();
        assert_eq!(status, 200, "row {}: {answer}", line["row"]);
        answered.push(Row { line, answer });
    }
    answered
}

fn table(rows: &[Row]) -> BTreeMap<String, Family> {
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    for Row { line, answer } in rows {
        let measured = line["measured_mib"].as_f64().unwrap();
        let compare = line["compare"].as_str().unwrap();
        let Some((figure, above)) = like_with_like(compare, answer) else {
            continue;
        };
        let mut names: Vec<String> = line["families"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap().to_string())
            .collect();
        names.push("all rows".into());
        for name in names {
            let family = families.entry(name).or_default();
            family.errors.push((figure / measured - 1.0).abs());
            family.signed.push(figure / measured - 1.0);
            if measured > figure + above {
                family.exceeded += 1;
            }
            for (key, _) in BASELINES {
                if let Some(baseline) = line["baselines"][key].as_f64() {
                    family
                        .baselines
                        .entry(key)
                        .or_default()
                        .push((baseline / measured - 1.0).abs());
                }
            }
        }
    }
    families
}

#[tokio::test]
async fn public_setup_rows_are_answered_per_gpu_and_compared_per_setup_family() {
    let simulated = rows()
        .iter()
        .filter(|l| l["job"]["simulation"].is_object())
        .count();
    if simulated > 0 {
        println!("## {simulated} rows with describe's simulation of their setup, as committed\n");
        let rows = answered(true).await;
        report(&rows);
        println!("\n{}", residuals(&rows, "simulation"));
    }
    println!("\n## The analytic training step (every row without its simulation)\n");
    let rows = answered(false).await;
    report(&rows);
    println!("\n{}", residuals(&rows, "training_step"));
}

fn report(rows: &[Row]) {
    if std::env::var_os("GPUCAST_PUBLIC_ROWS").is_some() {
        // One line per row: what was measured, gpucast's figure of that kind, the breakdown.
        for Row { line, answer } in rows {
            let compare = line["compare"].as_str().unwrap();
            let (figure, _) = like_with_like(compare, answer).unwrap_or((f64::NAN, 0.0));
            let measured = line["measured_mib"].as_f64().unwrap();
            println!(
                "row {} {:+.2} {compare} measured {measured} gpucast {figure:.0} {} {} {}",
                line["row"],
                figure / measured - 1.0,
                line["model"]
                    .as_str()
                    .unwrap()
                    .chars()
                    .take(30)
                    .collect::<String>(),
                line["families"],
                answer["memory"]["breakdown"]
            );
        }
    }
    let families = table(rows);
    println!(
        "| setup family | rows | gpucast median | gpucast p90 | gpucast median signed | bound \
         exceeded | DeepSpeed ZeRO-2 median | DeepSpeed ZeRO-3 median | accelerate median |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (name, family) in &families {
        let baselines: Vec<String> = BASELINES
            .iter()
            .map(|(key, _)| {
                family.baselines.get(key).map_or("-".into(), |v| {
                    format!("{:.1} % ({})", 100.0 * median(v.clone()), v.len())
                })
            })
            .collect();
        println!(
            "| {name} | {} | {:.1} % | {:.1} % | {:+.1} % | {:.1} % | {} |",
            family.errors.len(),
            100.0 * median(family.errors.clone()),
            100.0 * quantile(family.errors.clone(), 0.9),
            100.0 * median(family.signed.clone()),
            100.0 * family.exceeded as f64 / family.errors.len() as f64,
            baselines.join(" | ")
        );
    }
    // Every row is answered with a figure of its kind.
    let all = &families["all rows"];
    assert_eq!(all.errors.len(), rows.len());
    println!("\n{}", ablation(rows));
}

/// log(measured / figure) of every row outside the learned setups answered from `source`, its quantiles,
/// and the bound exceeded at 0.95 when each architecture's quantile comes from the others'
/// rows only (what an unseen architecture would get).
fn residuals(rows: &[Row], source: &str) -> String {
    let logs: Vec<(String, f64)> = rows
        .iter()
        .filter(|r| r.answer["memory"]["breakdown_source"] == source)
        .filter(|r| r.answer["setup"]["learned_estimators_apply"] == false)
        .filter_map(|Row { line, answer }| {
            let (figure, _) = like_with_like(line["compare"].as_str()?, answer)?;
            let measured = line["measured_mib"].as_f64()?;
            Some((
                line["architecture"].as_str()?.to_string(),
                (measured / figure).ln(),
            ))
        })
        .collect();
    let all: Vec<f64> = logs.iter().map(|(_, l)| *l).collect();
    let levels = [0.5, 0.8, 0.9, 0.95, 0.99];
    let quantiles: Vec<String> = levels
        .iter()
        .map(|&q| format!("({q}, {:.3})", quantile(all.clone(), q)))
        .collect();
    let mut exceeded = 0;
    for (architecture, log) in &logs {
        let others: Vec<f64> = logs
            .iter()
            .filter(|(a, _)| a != architecture)
            .map(|(_, l)| *l)
            .collect();
        if *log > quantile(others, 0.95) {
            exceeded += 1;
        }
    }
    format!(
        "{source} residuals outside the learned setups, log(measured / figure), {} rows: {}; \
         above the 0.95 quantile of the other architectures' rows: {exceeded} ({:.1} %)",
        logs.len(),
        quantiles.join(" "),
        100.0 * exceeded as f64 / logs.len().max(1) as f64
    )
}

/// The ablation of Hugging Face's single-GPU guide (bert-large, V100, rows 0-8): each step's
/// ratio, measured and answered.
fn ablation(rows: &[Row]) -> String {
    const STEPS: [(u64, u64, &str); 8] = [
        (0, 1, "+ accumulation (micro-batch 1 x 4)"),
        (1, 2, "+ checkpointing"),
        (0, 3, "fp16 autocast"),
        (3, 4, "fp16: + accumulation + checkpointing"),
        (0, 5, "Adafactor"),
        (5, 6, "Adafactor: + fp16 + accumulation + checkpointing"),
        (0, 7, "8-bit Adam"),
        (7, 8, "8-bit Adam: + fp16 + accumulation + checkpointing"),
    ];
    let figure_of = |row: u64| {
        rows.iter()
            .find(|r| r.line["row"] == row)
            .and_then(|Row { line, answer }| {
                let (figure, _) = like_with_like(line["compare"].as_str()?, answer)?;
                Some((figure, line["measured_mib"].as_f64()?))
            })
    };
    let mut out = vec![
        "| bert-large step | measured ratio | gpucast ratio | difference |".to_string(),
        "| --- | --- | --- | --- |".to_string(),
    ];
    for (from, to, name) in STEPS {
        let (Some((g0, m0)), Some((g1, m1))) = (figure_of(from), figure_of(to)) else {
            continue;
        };
        out.push(format!(
            "| {name} (rows {from} -> {to}) | {:.3} | {:.3} | {:+.3} |",
            m1 / m0,
            g1 / g0,
            g1 / g0 - m1 / m0
        ));
    }
    out.join("\n")
}
