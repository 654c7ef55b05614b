//! Summary text instead of a layer list.

use serde_json::{json, Value};

use crate::helpers::spawn_app;

const MLP_TORCHSUMMARY: &str = "\
----------------------------------------------------------------
        Layer (type)               Output Shape         Param #
================================================================
            Linear-1                 [-1, 1024]         803,840
       BatchNorm1d-2                 [-1, 1024]           2,048
              ReLU-3                 [-1, 1024]               0
           Dropout-4                 [-1, 1024]               0
            Linear-5                  [-1, 512]         524,800
              ReLU-6                  [-1, 512]               0
            Linear-7                   [-1, 10]           5,130
           Softmax-8                   [-1, 10]               0
================================================================
Total params: 1,335,818
Trainable params: 1,335,818
Non-trainable params: 0
----------------------------------------------------------------
";

#[tokio::test]
async fn a_torchsummary_table_is_estimated_like_a_layer_list() {
    let app = spawn_app().await;
    let body =
        json!({"summary": {"format": "torchsummary", "text": MLP_TORCHSUMMARY}, "batch_size": 256});
    let response = app.post_json("/v1/estimate", &body).await;
    assert_eq!(response.status(), 200);
    let from_summary: Value = response.json().await.unwrap();
    assert_eq!(from_summary["family"], "mlp");

    let layers = json!([
        {"kind": "linear", "output_size": 1024, "params": 803840},
        {"kind": "batch_norm", "output_size": 1024, "params": 2048},
        {"kind": "relu", "output_size": 1024, "params": 0},
        {"kind": "dropout", "output_size": 1024, "params": 0},
        {"kind": "linear", "output_size": 512, "params": 524800},
        {"kind": "relu", "output_size": 512, "params": 0},
        {"kind": "linear", "output_size": 10, "params": 5130},
        {"kind": "softmax", "output_size": 10, "params": 0}
    ]);
    let from_layers: Value = app
        .post_json_value(
            "/v1/estimate",
            &json!({"layers": layers, "batch_size": 256}),
        )
        .await;
    assert_eq!(
        from_summary["memory"]["class"],
        from_layers["memory"]["class"]
    );
    assert_eq!(
        from_summary["memory"]["estimators"]["first_principles"],
        from_layers["memory"]["estimators"]["first_principles"]
    );
}

#[tokio::test]
async fn unparseable_summaries_are_refused_naming_the_line() {
    let app = spawn_app().await;
    let garbled = MLP_TORCHSUMMARY.replace(
        "            Linear-5                  [-1, 512]         524,800",
        "            Linear-5    [[-1, 512 oops",
    );
    let cases = [
        (
            json!({"summary": {"format": "torchsummary", "text": garbled}, "batch_size": 8}),
            "summary.text line 8",
        ),
        (
            json!({"summary": {"format": "module_print", "text": "Net(\n  (embed): Embedding(100, 8)\n  (fc): Linear(in_features=8, out_features=2, bias=True)\n)"}, "batch_size": 8}),
            "seq_len: required",
        ),
        (
            json!({"summary": {"format": "torchsummary", "text": ""}, "batch_size": 8}),
            "summary.text line 1",
        ),
        (
            json!({"summary": {"format": "yaml", "text": "x"}, "batch_size": 8}),
            "summary.format",
        ),
        (
            json!({"summary": {"format": "torchsummary", "text": MLP_TORCHSUMMARY}, "layers": [], "batch_size": 8}),
            "either layers or summary",
        ),
        (json!({"batch_size": 8}), "layers"),
    ];
    for (body, needle) in cases {
        let response = app.post_json("/v1/estimate", &body).await;
        assert_eq!(response.status(), 422, "{body}");
        let problem: Value = response.json().await.unwrap();
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.contains(needle),
            "{detail:?} should contain {needle:?}"
        );
    }
}

/// A summary shows no trace: its saved tensors are derived from the printed output shapes
/// (physics::saved), so the traced regressor answers it, and the answer says so. A layer list
/// without saved tensors is left as it is, and saved tensors given with a summary are used.
#[tokio::test]
async fn a_summarys_saved_tensors_are_derived_from_its_shapes_and_the_answer_says_so() {
    let app = spawn_app().await;
    let text = std::fs::read_to_string(
        crate::helpers::repo_root().join("tests/fixtures/summaries/resnet18_torchsummary.txt"),
    )
    .unwrap();
    let derived_warning = |body: &Value| {
        body["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w.as_str().unwrap().starts_with("saved_tensors: derived"))
    };
    let body = json!({"summary": {"format": "torchsummary", "text": text}, "batch_size": 64, "input_shape": [3, 224, 224]});
    let answer: Value = app.post_json_value("/v1/estimate", &body).await;
    assert!(derived_warning(&answer), "{answer}");
    let traced = &answer["memory"]["estimators"]["cnn_traced_memory_regressor"]["estimate_mib"];
    assert!(traced.as_f64().unwrap() > 0.0, "{answer}");

    let mut given = body.clone();
    given["saved_tensors"] = json!({"per_sample_bytes": 40_000_000, "fixed_bytes": 0});
    let answer: Value = app.post_json_value("/v1/estimate", &given).await;
    assert!(!derived_warning(&answer), "{answer}");
    assert_ne!(
        answer["memory"]["estimators"]["cnn_traced_memory_regressor"]["estimate_mib"],
        *traced
    );

    let layers = json!({"batch_size": 64, "layers": [
        {"kind": "conv2d", "output_size": 802816, "params": 9408},
        {"kind": "batch_norm", "output_size": 802816, "params": 128},
        {"kind": "relu", "output_size": 802816, "params": 0},
        {"kind": "linear", "output_size": 10, "params": 8028170}
    ]});
    let answer: Value = app.post_json_value("/v1/estimate", &layers).await;
    assert!(!derived_warning(&answer), "{answer}");
    assert!(answer["memory"]["estimators"]
        .get("cnn_traced_memory_regressor")
        .is_none());
}

/// What people paste: the format left out, a plain `print(model)`, a Keras table, a total that
/// disagrees with the lines. Each is answered, with what was assumed in `warnings`.
#[tokio::test]
async fn pasted_printouts_are_accepted_with_what_was_assumed_in_warnings() {
    let app = spawn_app().await;
    let plain_print = "\
Net(
  (fc1): Linear(in_features=784, out_features=1024, bias=True)
  (bn): BatchNorm1d(1024, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True)
  (relu): ReLU()
  (fc2): Linear(in_features=1024, out_features=10, bias=True)
)";
    let keras = "\
Model: \"sequential\"
┏━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━┓
┃ Layer (type)                    ┃ Output Shape           ┃       Param # ┃
┡━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━┩
│ dense (Dense)                   │ (None, 64)             │        50,240 │
├─────────────────────────────────┼────────────────────────┼───────────────┤
│ dense_1 (Dense)                 │ (None, 10)             │           650 │
└─────────────────────────────────┴────────────────────────┴───────────────┘
 Total params: 50,890 (198.79 KB)
";
    let disagreeing = "\
Net(
  (fc): Linear(in_features=4, out_features=2, bias=True), 10 params
), 10 params
Total params: 12
";
    let cases = [
        (
            json!({"summary": {"text": MLP_TORCHSUMMARY}, "batch_size": 8}),
            None,
        ),
        (
            json!({"summary": {"format": "auto", "text": plain_print}, "batch_size": 8}),
            Some("derived from the printed constructor arguments"),
        ),
        (
            json!({"summary": {"format": "keras", "text": keras}, "batch_size": 8}),
            None,
        ),
        (
            json!({"summary": {"text": disagreeing}, "batch_size": 8}),
            Some("Total params 12 differs from the model's closing line (10)"),
        ),
    ];
    for (body, warning) in cases {
        let response = app.post_json("/v1/estimate", &body).await;
        assert_eq!(response.status(), 200, "{body}");
        let answer: Value = response.json().await.unwrap();
        let warnings = answer["warnings"].as_array().unwrap();
        if let Some(warning) = warning {
            assert!(
                warnings
                    .iter()
                    .any(|w| w.as_str().unwrap().contains(warning)),
                "{warnings:?} should contain {warning:?}"
            );
        }
    }
}

/// A table pasted without `input_shape` (as GPUMemNet's inputs and most pastes come): the
/// input image is read from its `Input size (MB)` footer and first output, so the job is
/// answered as with the shape given. Over the held-out timm printouts of both table tools
/// (tests/fixtures/summaries/printouts.jsonl.gz), a shape read is never another than the true
/// one, and it is read for most of the square RGB ones.
#[tokio::test]
async fn a_tables_input_image_is_read_from_its_footer_when_not_given() {
    use std::io::{BufRead, BufReader};
    let file = std::fs::File::open(
        crate::helpers::repo_root().join("tests/fixtures/summaries/printouts.jsonl.gz"),
    )
    .unwrap();
    let rows: Vec<Value> = BufReader::new(flate2::read::GzDecoder::new(file))
        .lines()
        .map(|line| serde_json::from_str::<Value>(&line.unwrap()).unwrap())
        .filter(|row| {
            row["set"] == "timm_test"
                && (row["tool"] == "torchsummary" || row["tool"] == "torchinfo")
        })
        .collect();
    let app = spawn_app().await;
    let (mut square, mut read, mut answered) = (0, 0, 0);
    for row in &rows {
        let truth = &row["input_shape"];
        let body = json!({"summary": {"text": row["text"]}, "batch_size": 32});
        let response = app.post_json("/v1/estimate", &body).await;
        if response.status() != 200 {
            continue;
        }
        answered += 1;
        let without: Value = response.json().await.unwrap();
        let warned = without["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w.as_str().unwrap().starts_with("input_shape: not given"));
        let rgb_square = truth[0] == 3 && truth[1] == truth[2];
        square += usize::from(rgb_square);
        if !warned {
            continue;
        }
        read += 1;
        assert!(rgb_square, "{}: read a shape for {truth}", row["model"]);
        let with = app
            .post_json_value(
                "/v1/estimate",
                &json!({"summary": {"text": row["text"]}, "batch_size": 32, "input_shape": truth}),
            )
            .await;
        assert_eq!(
            without["memory"]["estimate_mib"], with["memory"]["estimate_mib"],
            "{}",
            row["model"]
        );
    }
    println!("{answered} tables answered, {square} of square RGB input, {read} read");
    assert!(answered >= 150, "{answered}");
    assert!(read * 10 >= square * 8, "{read} of {square}");
}

/// A small CNN as `print(model)` shows it, its first linear layer printed for 32 x 32 inputs
/// (128 channels x 16 x 16 after the pool).
const CNN_FOR_32: &str = "Net(
  (conv1): Conv2d(3, 64, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
  (relu1): ReLU()
  (conv2): Conv2d(64, 128, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1))
  (relu2): ReLU()
  (pool): MaxPool2d(kernel_size=2, stride=2, padding=0, dilation=1, ceil_mode=False)
  (flatten): Flatten(start_dim=1, end_dim=-1)
  (fc1): Linear(in_features=32768, out_features=256, bias=True)
  (fc2): Linear(in_features=256, out_features=10, bias=True)
)";

fn contradictions(answer: &Value) -> Vec<String> {
    answer["warnings"]
        .as_array()
        .unwrap_or_else(|| panic!("{answer}"))
        .iter()
        .map(|w| w.as_str().unwrap().to_string())
        .filter(|w| w.contains("features, but input_shape"))
        .collect()
}

#[tokio::test]
async fn input_shape_is_read_inside_summary_as_at_the_top() {
    let app = spawn_app().await;
    let inside =
        json!({"summary": {"text": CNN_FOR_32, "input_shape": [3, 32, 32]}, "batch_size": 64});
    let top =
        json!({"summary": {"text": CNN_FOR_32}, "input_shape": [3, 32, 32], "batch_size": 64});
    let (a, b) = (
        app.post_json_value("/v1/estimate", &inside).await,
        app.post_json_value("/v1/estimate", &top).await,
    );
    assert!(a["memory"]["estimate_mib"].is_number(), "{a}");
    assert_eq!(a["memory"], b["memory"]);
    assert!(contradictions(&a).is_empty(), "{a}");
    let both = json!({"summary": {"text": CNN_FOR_32, "input_shape": [3, 64, 64]},
        "input_shape": [3, 32, 32], "batch_size": 64});
    // Both given and different: the top-level one, said (the schema cannot forbid it).
    let answer = app.post_json_value("/v1/estimate", &both).await;
    assert_eq!(answer["memory"], b["memory"], "{answer}");
    assert!(answer["warnings"]
        .to_string()
        .contains("summary.input_shape: [3, 64, 64] differs"));
    // An empty shape is refused wherever it is given, whichever path builds the job.
    for job in [
        json!({"summary": {"text": CNN_FOR_32, "input_shape": []}, "batch_size": 64}),
        json!({"transformer_config": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2,
            "n_head": 2, "vocab_size": 100}, "seq_len": 16, "batch_size": 1, "input_shape": []}),
    ] {
        let response = app.post_json("/v1/estimate", &job).await;
        assert_eq!(response.status(), 422, "{job}");
    }
}

#[tokio::test]
async fn a_printout_whose_sizes_contradict_input_shape_is_warned_naming_the_layer() {
    let app = spawn_app().await;
    // Printed for 32 x 32, asked at 224 x 224: fc1 takes 32,768 features, the maps 1,605,632.
    let job =
        json!({"summary": {"text": CNN_FOR_32, "input_shape": [3, 224, 224]}, "batch_size": 8});
    let answer = app.post_json_value("/v1/estimate", &job).await;
    let warned = contradictions(&answer);
    assert_eq!(warned.len(), 1, "{answer}");
    assert!(
        warned[0].contains("line 8: fc1 (Linear) takes 32768"),
        "{}",
        warned[0]
    );
    assert!(warned[0].contains("gives 1605632"), "{}", warned[0]);
}

#[tokio::test]
async fn a_printout_smaller_than_any_learned_job_is_answered_by_its_counted_terms() {
    let app = spawn_app().await;
    // CIFAR-sized: the traced regressor, fit on ImageNet-sized timm models, answers below the
    // CUDA context, so the counted terms answer. torch's saved-tensor hooks on this network
    // at batch 64 (fp32) hold 72.8 MiB beside the parameters: what the breakdown must show.
    let job = json!({"summary": {"text": CNN_FOR_32}, "input_shape": [3, 32, 32],
        "batch_size": 64, "optimizer": "adam", "precision": "fp32"});
    let answer = app.post_json_value("/v1/estimate", &job).await;
    let memory = &answer["memory"];
    let activations = memory["breakdown"]["activations"].as_f64().unwrap();
    assert!((activations - 72.8).abs() < 0.5, "{memory}");
    let traced = memory["estimators"]["traced_first_principles"]["estimate_mib"].as_f64();
    assert_eq!(memory["estimate_mib"].as_f64(), traced, "{memory}");
    assert_eq!(memory["floored"], false, "{memory}");
    assert!(
        answer["warnings"]
            .to_string()
            .contains("cnn_traced_memory_regressor: left out: it answered"),
        "{answer}"
    );
}
