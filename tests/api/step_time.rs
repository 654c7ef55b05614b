//! Observed step times teach an environment's host cost per op (calibration::step_time): the
//! route end to end, and the fit evaluated on the published step times
//! (data/perf/step_times.json) by leaving rows of one run series out:
//! `cargo test --test api step_time -- --nocapture`.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use gpucast::api::types::EstimateRequest;
use gpucast::calibration::step_time::{curve, fit_host_cost, interpolate, StepTimeSample};
use gpucast::devices::sku::Catalogue;
use gpucast::engine::validate::to_job;
use gpucast::physics::perf::CALIBRATED;

use crate::helpers::{combinations, jsonl_gz, median, repo_root, spawn_app};

const ENVIRONMENT: &str = "torch1.10-transformers4.16";

/// The published step times with their jobs: (row, job, gpu id, measured ms).
fn timed_rows() -> Vec<(u64, Value, &'static str, f64)> {
    let measured: Vec<Value> = serde_json::from_str(
        &std::fs::read_to_string(repo_root().join("data/perf/step_times.json")).unwrap(),
    )
    .unwrap();
    let jobs: BTreeMap<u64, Value> = jsonl_gz("data/public/setup_jobs.jsonl.gz")
        .into_iter()
        .map(|line| (line["row"].as_u64().unwrap(), line["job"].clone()))
        .collect();
    measured
        .iter()
        .filter_map(|row| {
            let index = row["row"].as_u64().unwrap();
            let job = jobs.get(&index)?.clone();
            let gpu = row["gpu"].as_str().unwrap();
            // As tests/api/roofline.rs reads the rows' cards.
            let id = if gpu.contains("V100") {
                "v100-16gb"
            } else if gpu.contains("4090") {
                "rtx-4090"
            } else {
                "a100-80gb"
            };
            Some((index, job, id, row["step_time_ms"].as_f64().unwrap()))
        })
        .collect()
}

#[tokio::test]
async fn step_times_observed_in_an_environment_time_its_other_jobs() {
    let app = spawn_app().await;
    let rows = timed_rows();
    let bert = |index: u64| rows.iter().find(|r| r.0 == index).unwrap();
    let estimate = |job: &Value, environment: Option<&str>| {
        let mut body = job.clone();
        body["gpu"] = json!("v100-16gb");
        if let Some(e) = environment {
            body["environment"] = json!(e);
        }
        body
    };
    let held_out = &bert(8).1;
    let before = app
        .post_json_value("/v1/estimate", &estimate(held_out, Some(ENVIRONMENT)))
        .await;
    assert_eq!(before["performance"]["host_us_per_op"], json!(15.0));
    assert_eq!(before["performance"]["host_cost_observations"], json!(0));

    // Three of the run series' AMP steps (rows 3, 4, 6), each with the peak the service itself
    // predicts (a valid one: the memory is not what this test is about).
    let mut observations = Vec::new();
    for index in [3, 4, 6] {
        let (_, job, _, measured_ms) = bert(index);
        let answer = app
            .post_json_value("/v1/estimate", &estimate(job, None))
            .await;
        observations.push(json!({
            "gpu": "v100-16gb",
            "environment": ENVIRONMENT,
            "job": job,
            "observed_peak_mib": answer["memory"]["estimate_mib"],
            "step_time_ms": measured_ms,
        }));
    }
    // Posted one run at a time, twice over: each update moves the host cost at most one step
    // (x1.25) from the last, so the fit is reached over several.
    let mut recorded = Value::Null;
    for observation in observations.iter().chain(&observations) {
        let response = app
            .post_json("/v1/calibration/observations", &json!([observation]))
            .await;
        assert_eq!(response.status(), 200);
        recorded = response.json().await.unwrap();
    }
    let fit = recorded["profiles"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["environment"] == json!(ENVIRONMENT))
        .unwrap()["step_time_fit"]
        .clone();
    assert_eq!(fit["observations"], json!(6));
    let host = fit["host_us_per_op"].as_f64().unwrap();
    assert!(host > 30.0, "{fit}");

    // Dashboards see the environment's profile and host cost.
    let metrics = app.get("/metrics").await.text().await.unwrap();
    for line in [
        format!(
            "gpucast_calibration_observations{{environment=\"{ENVIRONMENT}\",gpu=\"v100-16gb\"}} 6"
        ),
        format!(
            "gpucast_calibration_host_us_per_op{{environment=\"{ENVIRONMENT}\",gpu=\"v100-16gb\"}}"
        ),
    ] {
        assert!(metrics.contains(&line), "{line} in\n{metrics}");
    }
    // The environment's observations teach the GPU's own profile nothing.
    assert!(
        !metrics.contains("gpucast_calibration_observations{environment=\"\",gpu=\"v100-16gb\"}")
    );

    // The held-out AMP step in that environment is timed with the fitted host cost: nearer the
    // measured 386 ms than the default's 104 ms.
    let after = app
        .post_json_value("/v1/estimate", &estimate(held_out, Some(ENVIRONMENT)))
        .await;
    let performance = &after["performance"];
    assert_eq!(performance["host_cost_observations"], json!(6));
    assert!((performance["host_us_per_op"].as_f64().unwrap() - host).abs() < 1e-2);
    let (step_before, step_after) = (
        before["performance"]["step_time_ms"].as_f64().unwrap(),
        performance["step_time_ms"].as_f64().unwrap(),
    );
    let measured = bert(8).3;
    println!("row 8: measured {measured:.0} ms, default {step_before:.0}, fitted {step_after:.0} (host {host:.1} us/op)");
    assert!((step_after / measured - 1.0).abs() < (step_before / measured - 1.0).abs());
    // Another card's estimates keep the default.
    let mut elsewhere = estimate(held_out, Some(ENVIRONMENT));
    elsewhere["gpu"] = json!("a100-80gb");
    let elsewhere = app.post_json_value("/v1/estimate", &elsewhere).await;
    assert_eq!(elsewhere["performance"]["host_cost_observations"], json!(0));
}

/// Issue 34's probe: one observation with the longest step time accepted (an hour) moved the
/// H100's host cost from 15 to 200 us and every environment's ranking with it. Now it moves the
/// card's step time at most one step (x1.25), and an environment without step times of its
/// own keeps the calibrated cost.
#[tokio::test]
async fn one_wild_step_time_moves_a_cards_step_time_at_most_one_step() {
    let app = spawn_app().await;
    let rows = timed_rows();
    let job = &rows[0].1;
    let on = |environment: Option<&str>| {
        let mut body = job.clone();
        body["gpu"] = json!("h100-80gb");
        if let Some(e) = environment {
            body["environment"] = json!(e);
        }
        body
    };
    let step = |answer: &Value| answer["performance"]["step_time_ms"].as_f64().unwrap();
    let before = app.post_json_value("/v1/estimate", &on(None)).await;
    let lab_before = app.post_json_value("/v1/estimate", &on(Some("lab"))).await;
    let observation = json!([{"gpu": "h100-80gb", "job": job,
        "observed_peak_mib": before["memory"]["estimate_mib"], "step_time_ms": 3_600_000.0}]);
    let response = app
        .post_json("/v1/calibration/observations", &observation)
        .await;
    assert_eq!(response.status(), 200);
    let after = app.post_json_value("/v1/estimate", &on(None)).await;
    let lab_after = app.post_json_value("/v1/estimate", &on(Some("lab"))).await;
    println!(
        "h100-80gb step time {:.2} -> {:.2} ms (host {} -> {} us/op)",
        step(&before),
        step(&after),
        before["performance"]["host_us_per_op"],
        after["performance"]["host_us_per_op"]
    );
    assert!(step(&after) > step(&before));
    assert!(step(&after) <= 1.25 * step(&before) + 1e-9);
    assert_eq!(step(&lab_after), step(&lab_before));
}

#[tokio::test]
async fn bad_step_times_are_refused_and_record_nothing() {
    let app = spawn_app().await;
    let rows = timed_rows();
    let job = &rows[0].1;
    let mut body = job.clone();
    body["gpu"] = json!("v100-16gb");
    let answer = app.post_json_value("/v1/estimate", &body).await;
    let peak = answer["memory"]["estimate_mib"].clone();
    let observation = |gpu: Value, step: Value| json!({"gpu": gpu, "job": job, "observed_peak_mib": peak, "step_time_ms": step});
    for (gpu, step, says) in [
        (json!("v100-16gb"), json!(0), "step_time_ms"),
        (json!("v100-16gb"), json!(-5.0), "step_time_ms"),
        (json!("v100-16gb"), json!(1e9), "step_time_ms"),
        (
            json!({"name": "lab card", "capacity_mib": 16384}),
            json!(400.0),
            "known only by its memory",
        ),
    ] {
        let good = observation(json!("v100-16gb"), json!(450.0));
        let response = app
            .post_json(
                "/v1/calibration/observations",
                &json!([good, observation(gpu, step)]),
            )
            .await;
        assert_eq!(response.status(), 422);
        let problem: Value = response.json().await.unwrap();
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains("[1].") && detail.contains(says), "{detail}");
    }
    let profiles = app.get_json("/v1/calibration/profiles").await;
    assert_eq!(profiles["profiles"], json!([]), "nothing was recorded");
}

/// Each run series (one source on one card: one environment) with k of its rows observed and
/// the others timed with the fitted host cost, against the default's; every choice of k rows.
#[test]
fn a_host_cost_fitted_to_a_few_of_a_series_steps_times_its_others_better() {
    let catalogue = Catalogue::builtin();
    let mut series: BTreeMap<&str, Vec<(u64, StepTimeSample)>> = BTreeMap::new();
    for (row, job, gpu, measured_ms) in timed_rows() {
        let request: EstimateRequest = serde_json::from_value(job).unwrap();
        let job = to_job(&request).unwrap();
        let performance = catalogue.by_id(gpu).unwrap().performance;
        let name = match gpu {
            "v100-16gb" => "BERT-large, transformers guide (V100)",
            "rtx-4090" => "Llama-2-7B, torchtune (RTX 4090)",
            _ => "Llama-2-70B, torchtune (A100 x8)",
        };
        series.entry(name).or_default().push((
            row,
            StepTimeSample {
                curve: curve(&job, &performance),
                observed_ms: measured_ms,
            },
        ));
    }
    println!("\n| series | rows | k | draws | median error: default | fitted | within 30 %: default | fitted | fitted host us/op (median) |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut pooled: BTreeMap<usize, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
    for (name, rows) in &series {
        for k in [1, 3] {
            if rows.len() <= k {
                continue;
            }
            let picks = combinations(rows.len(), k);
            let (mut default, mut fitted, mut hosts) = (Vec::new(), Vec::new(), Vec::new());
            for pick in &picks {
                let observed: Vec<StepTimeSample> =
                    pick.iter().map(|&i| rows[i].1.clone()).collect();
                let fit = fit_host_cost(&observed).unwrap();
                hosts.push(fit.host_us_per_op);
                for (i, (_, sample)) in rows.iter().enumerate() {
                    if pick.contains(&i) {
                        continue;
                    }
                    let error = |host: f64| {
                        (interpolate(&sample.curve, host).unwrap() / sample.observed_ms - 1.0).abs()
                    };
                    default.push(error(CALIBRATED.host_us_per_op));
                    fitted.push(error(fit.host_us_per_op));
                }
            }
            let within = |errors: &[f64]| {
                100.0 * errors.iter().filter(|e| **e <= 0.3).count() as f64 / errors.len() as f64
            };
            println!(
                "| {name} | {} | {k} | {} | {:.1} % | {:.1} % | {:.0} % | {:.0} % | {:.1} |",
                rows.len(),
                picks.len(),
                100.0 * median(default.clone()),
                100.0 * median(fitted.clone()),
                within(&default),
                within(&fitted),
                median(hosts),
            );
            let (d, f) = pooled.entry(k).or_default();
            d.extend(default);
            f.extend(fitted);
        }
    }
    for (k, (default, fitted)) in &pooled {
        println!(
            "| all held-out steps (pooled) | | {k} | | {:.1} % | {:.1} % | | | |",
            100.0 * median(default.clone()),
            100.0 * median(fitted.clone())
        );
    }
    let (default, fitted) = &pooled[&3];
    assert!(
        median(fitted.clone()) < median(default.clone()),
        "k = 3: fitted {} vs default {}",
        median(fitted.clone()),
        median(default.clone())
    );
}
