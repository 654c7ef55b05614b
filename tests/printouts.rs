//! Every printout of `tests/fixtures/summaries/printouts.jsonl.gz` (real models printed by
//! torchsummary, torchinfo, `print(model)` plain and annotated, Keras) goes through the request
//! edge as a client sends it: with `format` left out (detected) and with its explicit format.
//! Each must be accepted, and its parameter total must be near the model's exact distinct count.
//!
//! The request edge (`to_job_noting`) is what decides between 200 and 422 for a summary; going
//! through it rather than the server keeps the hundreds of rows cheap to run.

use std::collections::BTreeMap;
use std::io::Read;

use gpucast::api::types::EstimateRequest;
use gpucast::engine::validate::to_job_noting;
use serde_json::{json, Value};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/summaries/printouts.jsonl.gz"
);

fn rows() -> Vec<Value> {
    let file = std::fs::File::open(FIXTURE).expect("the printouts fixture");
    let mut text = String::new();
    flate2::read::GzDecoder::new(file)
        .read_to_string(&mut text)
        .expect("gzip JSON lines");
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| serde_json::from_str(line).expect("a JSON row"))
        .collect()
}

/// The format a tool's printout is sent with explicitly.
fn format_of(tool: &str) -> &'static str {
    match tool {
        "torchsummary" | "torchinfo" => "torchsummary",
        "keras" => "keras",
        _ => "module_print",
    }
}

/// Sends one printout; returns the parsed parameter total, or the refusal.
fn total_params(row: &Value, format: Option<&str>) -> Result<u64, String> {
    let mut summary = json!({"text": row["text"]});
    if let Some(format) = format {
        summary["format"] = json!(format);
    }
    let mut body = json!({"summary": summary, "batch_size": 8});
    if row["seq_len"].is_u64() {
        body["seq_len"] = row["seq_len"].clone();
    }
    // Keras shapes are printed; its channels-last input_shape is not the service's [C, H, W].
    if row["input_shape"].is_array() && row["tool"] != "keras" {
        body["input_shape"] = row["input_shape"].clone();
    }
    let request: EstimateRequest = serde_json::from_value(body).map_err(|e| e.to_string())?;
    let (job, _warnings) = to_job_noting(&request).map_err(|e| e.to_string())?;
    Ok(job.layers().iter().map(|layer| layer.params).sum())
}

fn relative_error(parsed: u64, exact: u64) -> f64 {
    (parsed as f64 - exact as f64).abs() / (exact as f64).max(1.0)
}

fn median(sorted: &[f64]) -> f64 {
    sorted.get(sorted.len() / 2).copied().unwrap_or(0.0)
}

#[test]
fn every_printout_is_accepted_detected_or_explicit_and_counts_its_parameters() {
    let rows = rows();
    assert!(!rows.is_empty(), "the fixture holds no row");
    let mut refusals = Vec::new();
    // tool -> (rows, relative parameter errors of the accepted ones)
    let mut by_tool: BTreeMap<String, (usize, Vec<f64>)> = BTreeMap::new();
    let mut exact_misses = Vec::new();
    for row in &rows {
        let tool = row["tool"].as_str().unwrap_or("?").to_string();
        let model = row["model"].as_str().unwrap_or("?");
        let exact = row["params"].as_u64().expect("params");
        let entry = by_tool.entry(tool.clone()).or_default();
        entry.0 += 1;
        let detected = total_params(row, None);
        let explicit = total_params(row, Some(format_of(&tool)));
        match (&detected, &explicit) {
            (Ok(detected), Ok(explicit)) => {
                assert_eq!(
                    detected, explicit,
                    "{tool} {model}: detection changed the reading"
                );
                let error = relative_error(*explicit, exact);
                entry.1.push(error);
                // Counted printouts carry the exact figures; tables may list a shared module
                // once per use (torchsummary), so only the annotated prints must be exact.
                if tool.starts_with("print_counts") && *explicit != exact {
                    exact_misses.push(format!("{tool} {model}: {explicit} != {exact}"));
                }
            }
            _ => refusals.push(format!(
                "{tool} {model}: auto {:?} / explicit {:?}",
                detected.err(),
                explicit.err()
            )),
        }
    }
    for (tool, (count, errors)) in &mut by_tool {
        errors.sort_by(f64::total_cmp);
        let within_2 = errors.iter().filter(|&&e| e <= 0.02).count();
        println!(
            "{tool}: {}/{count} accepted, parameter error median {:.3}% max {:.3}%, within 2%: {within_2}",
            errors.len(),
            100.0 * median(errors),
            100.0 * errors.last().copied().unwrap_or(0.0),
        );
    }
    assert!(refusals.is_empty(), "refused:\n{}", refusals.join("\n"));
    assert!(
        exact_misses.is_empty(),
        "annotated prints off their count:\n{}",
        exact_misses.join("\n")
    );
    for (tool, (_, errors)) in &by_tool {
        let (share, bound) = bound_for(tool);
        let within = errors.iter().filter(|&&e| e <= bound).count();
        assert!(
            within as f64 >= share * errors.len() as f64,
            "{tool}: only {within} of {} rows within {:.1}% of the exact count",
            errors.len(),
            100.0 * bound
        );
    }
}

/// (share of rows, relative error bound) each tool's parameter totals must meet.
fn bound_for(tool: &str) -> (f64, f64) {
    match tool {
        // Tables print every row's count: only shared modules can differ.
        // Measured (429 rows): torchsummary 112/113, torchinfo 140/144, keras 5/5 within 2 %.
        "torchsummary" | "torchinfo" | "keras" => (0.95, 0.02),
        // Annotated prints are checked exactly above.
        "print_counts" | "print_counts_dataparallel" => (1.0, 0.0),
        // Plain prints: parameters derived from the constructor arguments (121/122 within 2 %).
        _ => (0.95, 0.02),
    }
}
