//! The evaluator against hand-computed values, and the weights files it refuses.

use serde_json::json;

use super::*;

fn sigmoid_of(v: f32) -> f32 {
    1.0 / (1.0 + (-v).exp())
}

/// Two inputs, one member: Linear(2, 2) -> SiLU -> Linear(2, 1), and `head`.
fn document(head: serde_json::Value, last_outputs: usize) -> serde_json::Value {
    json!({
        "format": FORMAT,
        "version": VERSION,
        "inputs": 2,
        "members": [{
            "layers": [
                // [inputs][outputs]: out0 = x0 + 3 x1, out1 = 2 x0 + 4 x1 - 11.
                {"inputs": 2, "outputs": 2, "weights": [1.0, 2.0, 3.0, 4.0], "bias": [0.0, -11.0]},
                {"inputs": 2, "outputs": last_outputs,
                 "weights": vec![1.0; 2 * last_outputs], "bias": vec![0.5; last_outputs]},
            ],
        }],
        "head": head,
    })
}

fn load(document: &serde_json::Value) -> Result<FeedForward, String> {
    FeedForward::from_weights(&serde_json::to_vec(document).unwrap())
}

fn run(model: &FeedForward, rows: &[f32]) -> Vec<f32> {
    model
        .infer(ModelInput::Aggregate {
            rows,
            n_rows: rows.len() / model.inputs(),
        })
        .unwrap()
}

/// The member's output for one row, by hand.
fn member_output(x: [f32; 2]) -> f32 {
    let silu = |v: f32| v * sigmoid_of(v);
    let (a, b) = (x[0] + 3.0 * x[1], 2.0 * x[0] + 4.0 * x[1] - 11.0);
    silu(a) + silu(b) + 0.5
}

#[test]
fn each_row_is_answered_alone_by_its_layers_and_head() {
    let model = load(&document(json!({"type": "sigmoid"}), 1)).unwrap();
    let rows = [1.0f32, 1.0, 0.0, 0.0];
    let both = run(&model, &rows);
    assert_eq!(
        both,
        [
            sigmoid_of(member_output([1., 1.])),
            sigmoid_of(member_output([0., 0.]))
        ]
    );
    assert_eq!(run(&model, &rows[..2]), both[..1]);
    let wrong_width = model.infer(ModelInput::Aggregate {
        rows: &rows[..3],
        n_rows: 1,
    });
    assert!(wrong_width.is_err());
}

#[test]
fn the_residual_heads_add_to_their_base_feature() {
    let base = json!({"feature": 1, "mean": 2.0, "std": 0.5});
    let model = load(&document(json!({"type": "residual", "base": base}), 1)).unwrap();
    let y = member_output([1., 4.]);
    assert_eq!(run(&model, &[1., 4.]), [(4.0 * 0.5 + 2.0) + y.tanh()]);

    let base = json!({"feature": 0, "mean": 0.0, "std": 1.0, "floor": 0.0, "context": 3.0});
    let capped = json!({"type": "capped_residual", "base": base, "cap": 0.25});
    let model = load(&document(capped, 1)).unwrap();
    let y = member_output([-1., 0.]);
    let log_base = (((-1.0f32).exp() - 1.0).max(0.0) + 3.0).ln();
    assert_eq!(
        run(&model, &[-1., 0.]),
        [log_base + (y / 0.25).tanh() * 0.25]
    );
}

#[test]
fn an_ordinal_head_spreads_a_member_over_classes_that_sum_to_one() {
    let base = json!({"feature": 0, "mean": 0.0, "std": 1.0});
    let head = json!({
        "type": "ordinal_learned_spread", "bins": [0.0, 1.0, 2.0], "base": base,
        "threshold": 20.0, "add": 0.01, "floor": 1e-6,
    });
    let model = load(&document(head, 2)).unwrap();
    let p = run(&model, &[0.5, 0.0]);
    assert_eq!(p.len(), 4);
    assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-5, "{p:?}");
    assert!(p.iter().all(|&v| v >= 1e-6), "{p:?}");
    // Both outputs are member_output + its linear; the spread is softplus(y) + 0.01.
    let y = member_output([0.5, 0.0]);
    let (centre, spread) = (0.5 + y, softplus(y) + 0.01);
    assert_eq!(p[0], sigmoid_of((0.0 - centre) / spread).max(1e-6));
}

#[test]
fn softplus_and_sigmoid_hold_at_the_extremes() {
    assert_eq!(sigmoid(-200.0), 0.0);
    assert_eq!(sigmoid(0.0), 0.5);
    assert_eq!(sigmoid(100.0), 1.0);
    assert_eq!(softplus(-200.0), 0.0);
    assert_eq!(softplus(0.0), std::f32::consts::LN_2);
    assert_eq!(softplus(100.0), 100.0);
}

#[test]
fn a_file_the_evaluator_cannot_run_is_refused_saying_why() {
    let good = document(json!({"type": "sigmoid"}), 1);
    assert!(load(&good).is_ok());
    let refused = |edit: &dyn Fn(&mut serde_json::Value), words: &str| {
        let mut document = good.clone();
        edit(&mut document);
        let why = load(&document).expect_err(words);
        assert!(why.contains(words), "{why} (expected '{words}')");
    };
    refused(&|d| d["format"] = "onnx".into(), "format 'onnx'");
    refused(&|d| d["version"] = 2.into(), "format version 2");
    refused(&|d| d["head"]["type"] = "softsign".into(), "softsign");
    refused(
        &|d| d["inputs"] = 3.into(),
        "layer 0 reads 2 values, it is fed 3",
    );
    refused(
        &|d| d["members"][0]["layers"][1]["bias"] = json!([0.5, 0.5]),
        "layer 1: weights or bias of the wrong length",
    );
    refused(
        &|d| d["head"] = json!({"type": "ordinal_fixed_spread", "bins": [1.0]}),
        "there is none",
    );
    refused(
        &|d| d["members"][0]["input_mask"] = json!([1.0]),
        "an input mask of 1 for 2 inputs",
    );
    refused(&|d| d["members"] = json!([]), "no members");
    refused(&|d| d["extra"] = json!(1), "unknown field");
    assert!(FeedForward::from_weights(b"not json").is_err());
}
