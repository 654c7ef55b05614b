//! The evaluator's ops against hand-computed values, and graphs read from ONNX bytes.

use super::*;

fn t(shape: &[usize], data: &[f32]) -> Tensor<f32> {
    Tensor::new(shape.to_vec(), data.to_vec())
}

fn ints(shape: &[usize], data: &[i64]) -> Tensor<i64> {
    Tensor::new(shape.to_vec(), data.to_vec())
}

#[test]
fn binary_ops_broadcast_as_numpy_does_on_every_path() {
    let add = |a: &Tensor<f32>, b: &Tensor<f32>| broadcast_binary(a, b, |x, y| x + y).unwrap();
    // Equal shapes, a repeating row, a scalar, and a column against a row (general path).
    assert_eq!(
        add(&t(&[2], &[1., 2.]), &t(&[2], &[10., 20.])).data,
        [11., 22.]
    );
    let rows = t(&[2, 1, 3], &[1., 2., 3., 4., 5., 6.]);
    assert_eq!(
        add(&t(&[1, 3], &[10., 20., 30.]), &rows),
        t(&[2, 1, 3], &[11., 22., 33., 14., 25., 36.])
    );
    assert_eq!(add(&rows, &t(&[], &[1.])).data, [2., 3., 4., 5., 6., 7.]);
    assert_eq!(
        add(&t(&[2, 1], &[1., 2.]), &t(&[1, 3], &[10., 20., 30.])),
        t(&[2, 3], &[11., 21., 31., 12., 22., 32.])
    );
    assert!(broadcast_binary(&t(&[2], &[1., 2.]), &t(&[3], &[1., 2., 3.]), |x, y| x + y).is_err());
}

#[test]
fn gemm_honours_its_transposes_alpha_and_beta() {
    let a = t(&[1, 2], &[1., 2.]);
    let w = t(&[3, 2], &[1., 0., 0., 1., 1., 1.]); // nn.Linear's [out, in]
    let bias = t(&[3], &[0.5, 0.5, 0.5]);
    let plain = gemm(&a, &w, Some(&bias), 1.0, 1.0, false, true).unwrap();
    assert_eq!(plain, t(&[1, 3], &[1.5, 2.5, 3.5]));
    let scaled = gemm(&a, &w, Some(&bias), 2.0, 2.0, false, true).unwrap();
    assert_eq!(scaled.data, [3., 5., 7.]);
    let at = t(&[2, 1], &[1., 2.]);
    let wt = t(&[2, 3], &[1., 0., 1., 0., 1., 1.]);
    assert_eq!(
        gemm(&at, &wt, None, 1.0, 1.0, true, false).unwrap().data,
        [1., 2., 3.]
    );
    assert_eq!(
        gemm(&a, &wt, None, 1.0, 1.0, false, false).unwrap().data,
        [1., 2., 3.]
    );
}

#[test]
fn matmul_broadcasts_its_leading_axes() {
    // Two members' weights against one shared row.
    let row = t(&[1, 2], &[1., 2.]);
    let weights = t(&[2, 2, 2], &[1., 0., 0., 1., 2., 0., 0., 2.]);
    assert_eq!(
        matmul(&row, &weights).unwrap(),
        t(&[2, 1, 2], &[1., 2., 2., 4.])
    );
    let single = t(&[2, 1], &[3., 4.]);
    assert_eq!(matmul(&row, &single).unwrap(), t(&[1, 1], &[11.]));
    assert!(matmul(&row, &t(&[3, 1], &[1., 1., 1.])).is_err());
}

#[test]
fn shape_ops_move_values_where_onnx_says() {
    let x = t(&[2, 3], &[1., 2., 3., 4., 5., 6.]);
    // Slice to the end (INT64_MAX) and from the end (negative).
    assert_eq!(
        slice(&x, &[1], &[i64::MAX], Some(&[1]), None).unwrap(),
        t(&[2, 2], &[2., 3., 5., 6.])
    );
    assert_eq!(
        slice(&x, &[-1], &[i64::MAX], Some(&[0]), None).unwrap(),
        t(&[1, 3], &[4., 5., 6.])
    );
    assert!(slice(&x, &[0], &[3], Some(&[1]), Some(&[2])).is_err());
    assert_eq!(
        reduce_mean(&x, &[0], false).unwrap(),
        t(&[3], &[2.5, 3.5, 4.5])
    );
    assert_eq!(reduce_mean(&x, &[-1], true).unwrap(), t(&[2, 1], &[2., 5.]));
    assert_eq!(
        gather(&x, &ints(&[2], &[2, -3]), -1).unwrap(),
        t(&[2, 2], &[3., 1., 6., 4.])
    );
    assert!(gather(&x, &ints(&[1], &[3]), 1).is_err());
    assert_eq!(
        concat(&[&x, &t(&[2, 1], &[7., 8.])], -1).unwrap(),
        t(&[2, 4], &[1., 2., 3., 7., 4., 5., 6., 8.])
    );
    assert_eq!(unsqueezed(&[2, 3], &[0, -1]).unwrap(), [1, 2, 3, 1]);
    let expanded = evaluate(
        &Op::Expand,
        &[
            Some(&Value::Float(t(&[], &[1.]))),
            Some(&Value::Int(ints(&[2], &[2, 2]))),
        ],
    );
    assert_eq!(
        expanded.unwrap(),
        Value::Float(t(&[2, 2], &[1., 1., 1., 1.]))
    );
    let shape = evaluate(
        &Op::Shape {
            start: 1,
            end: None,
        },
        &[Some(&Value::Float(x.clone()))],
    );
    assert_eq!(shape.unwrap(), Value::Int(ints(&[1], &[3])));
}

#[test]
fn elementwise_functions_and_selection() {
    let x = Value::Float(t(&[3], &[-200., 0., 100.]));
    let sigmoid = evaluate(&Op::Unary(Unary::Sigmoid), &[Some(&x)]).unwrap();
    assert_eq!(sigmoid, Value::Float(t(&[3], &[0.0, 0.5, 1.0])));
    let softplus = evaluate(&Op::Unary(Unary::Softplus), &[Some(&x)]).unwrap();
    assert_eq!(
        softplus,
        Value::Float(t(&[3], &[0.0, std::f32::consts::LN_2, 100.0]))
    );
    let zero = Value::Float(t(&[], &[0.]));
    let clipped = evaluate(&Op::Clip, &[Some(&x), Some(&zero), None]).unwrap();
    assert_eq!(clipped, Value::Float(t(&[3], &[0., 0., 100.])));
    let greater = evaluate(&Op::Greater, &[Some(&x), Some(&zero)]).unwrap();
    assert_eq!(greater, Value::Int(ints(&[3], &[0, 0, 1])));
    let chosen = evaluate(&Op::Where, &[Some(&greater), Some(&x), Some(&zero)]).unwrap();
    assert_eq!(chosen, Value::Float(t(&[3], &[0., 0., 100.])));
}

fn float_initializer(name: &str, dims: &[i64], values: &[f32]) -> proto::TensorProto {
    proto::TensorProto {
        dims: dims.to_vec(),
        data_type: proto::FLOAT,
        name: name.into(),
        raw_data: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ..Default::default()
    }
}

fn node(op: &str, inputs: &[&str], output: &str) -> proto::NodeProto {
    proto::NodeProto {
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: vec![output.into()],
        op_type: op.into(),
        attribute: if op == "Gemm" {
            vec![proto::AttributeProto {
                name: "transB".into(),
                i: 1,
                ..Default::default()
            }]
        } else {
            Vec::new()
        },
        ..Default::default()
    }
}

/// features [N, 2] -> Linear(2, 2) -> Sigmoid -> `value`, encoded as an ONNX file is.
fn linear_sigmoid(op: &str) -> Vec<u8> {
    let value_info = |name: &str| proto::ValueInfoProto { name: name.into() };
    proto::ModelProto {
        graph: Some(proto::GraphProto {
            node: vec![
                node("Gemm", &["features", "w", "b"], "linear"),
                node(op, &["linear"], "value"),
            ],
            initializer: vec![
                float_initializer("w", &[2, 2], &[1., 2., 3., 4.]),
                float_initializer("b", &[2], &[0., -11.]),
            ],
            input: vec![value_info("features")],
            output: vec![value_info("value")],
        }),
    }
    .encode_to_vec()
}

#[test]
fn a_graph_is_read_from_its_onnx_bytes_and_each_row_answered_alone() {
    let graph = FeedForward::from_onnx(&linear_sigmoid("Sigmoid"), "value").unwrap();
    let rows = [1.0f32, 1.0, 0.0, 0.0];
    let both = graph
        .infer(ModelInput::Aggregate {
            rows: &rows,
            n_rows: 2,
        })
        .unwrap();
    // [1, 1] -> [1 + 2, 3 + 4 - 11] = [3, -4]; [0, 0] -> [0, -11].
    let sigmoid = |v: f32| 1.0 / (1.0 + (-v).exp());
    assert_eq!(both, [sigmoid(3.), sigmoid(-4.), 0.5, sigmoid(-11.)]);
    let first = graph
        .infer(ModelInput::Aggregate {
            rows: &rows[..2],
            n_rows: 1,
        })
        .unwrap();
    assert_eq!(first, both[..2]);
    assert!(FeedForward::from_onnx(&linear_sigmoid("Sigmoid"), "missing").is_err());
}

#[test]
fn a_graph_with_an_unknown_op_is_refused_with_its_name() {
    let why = FeedForward::from_onnx(&linear_sigmoid("Softsign"), "value").unwrap_err();
    assert!(why.contains("Softsign"), "{why}");
    assert!(FeedForward::from_onnx(b"not protobuf at all", "value").is_err());
}
