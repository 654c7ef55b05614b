//! The aggregate estimators' ONNX graphs evaluated in process: a few dense layers and
//! elementwise ops over one row of features, read from the same `.onnx` file ONNX Runtime loads.
//!
//! Why not ONNX Runtime for these: it costs about 0.4 us a node whatever the node does, so a
//! 19-node regressor took 13 us and a 36-node utilization head 12 us of an estimate whose
//! physics takes 2 (a fused graph of the two saved only 2.6 us; tract-onnx, 122 crates, took
//! 24-28 us). Here each row is evaluated alone, so a job's answer never depends on the jobs
//! batched with it. Only the ops these graphs use are known: a manifest entry that names this
//! runtime (`in_process`) for a graph with any other op fails the load
//! ([`FeedForward::from_onnx`] says why). The tests of `load` check every committed graph
//! against ONNX Runtime's run of it.

use std::collections::HashMap;

use prost::Message;

use super::onnx::{InferenceError, Model, ModelInput};

/// The part of ONNX's protobuf schema (onnx/onnx.proto, field numbers from there) that a
/// feed-forward graph needs; every other field is skipped on decoding.
mod proto {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ModelProto {
        #[prost(message, optional, tag = "7")]
        pub graph: Option<GraphProto>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct GraphProto {
        #[prost(message, repeated, tag = "1")]
        pub node: Vec<NodeProto>,
        #[prost(message, repeated, tag = "5")]
        pub initializer: Vec<TensorProto>,
        #[prost(message, repeated, tag = "11")]
        pub input: Vec<ValueInfoProto>,
        #[prost(message, repeated, tag = "12")]
        pub output: Vec<ValueInfoProto>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueInfoProto {
        #[prost(string, tag = "1")]
        pub name: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct NodeProto {
        #[prost(string, repeated, tag = "1")]
        pub input: Vec<String>,
        #[prost(string, repeated, tag = "2")]
        pub output: Vec<String>,
        #[prost(string, tag = "4")]
        pub op_type: String,
        #[prost(message, repeated, tag = "5")]
        pub attribute: Vec<AttributeProto>,
        #[prost(string, tag = "7")]
        pub domain: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct AttributeProto {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(float, tag = "2")]
        pub f: f32,
        #[prost(int64, tag = "3")]
        pub i: i64,
        #[prost(int64, repeated, tag = "8")]
        pub ints: Vec<i64>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TensorProto {
        #[prost(int64, repeated, tag = "1")]
        pub dims: Vec<i64>,
        #[prost(int32, tag = "2")]
        pub data_type: i32,
        #[prost(float, repeated, tag = "4")]
        pub float_data: Vec<f32>,
        #[prost(int64, repeated, tag = "7")]
        pub int64_data: Vec<i64>,
        #[prost(string, tag = "8")]
        pub name: String,
        #[prost(bytes = "vec", tag = "9")]
        pub raw_data: Vec<u8>,
        #[prost(int32, tag = "14")]
        pub data_location: i32,
    }

    /// TensorProto.DataType values.
    pub const FLOAT: i32 = 1;
    pub const INT64: i32 = 7;
}

/// A dense tensor, row-major.
#[derive(Debug, Clone, PartialEq)]
struct Tensor<T> {
    shape: Vec<usize>,
    data: Vec<T>,
}

impl<T: Copy> Tensor<T> {
    fn new(shape: Vec<usize>, data: Vec<T>) -> Tensor<T> {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor { shape, data }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Value {
    Float(Tensor<f32>),
    Int(Tensor<i64>),
}

type Fallible<T> = Result<T, String>;

impl Value {
    fn float(&self) -> Fallible<&Tensor<f32>> {
        match self {
            Value::Float(t) => Ok(t),
            Value::Int(_) => Err("expected a float tensor, got an integer one".into()),
        }
    }

    fn ints(&self) -> Fallible<&[i64]> {
        match self {
            Value::Int(t) => Ok(&t.data),
            Value::Float(_) => Err("expected an integer tensor, got a float one".into()),
        }
    }
}

/// Where a node's input comes from.
#[derive(Debug, Clone, Copy)]
enum Slot {
    Features,
    Constant(usize),
    Computed(usize),
}

#[derive(Debug, Clone, Copy)]
enum Unary {
    Sigmoid,
    Tanh,
    Exp,
    Log,
    Softplus,
}

#[derive(Debug, Clone, Copy)]
enum Binary {
    Add,
    Sub,
    Mul,
    Div,
}

#[derive(Debug, Clone)]
enum Op {
    Unary(Unary),
    Binary(Binary),
    Clip,
    /// `a > b`, as 0 or 1.
    Greater,
    /// `condition ? x : y`.
    Where,
    Gemm {
        alpha: f32,
        beta: f32,
        trans_a: bool,
        trans_b: bool,
    },
    MatMul,
    Unsqueeze,
    Slice,
    ReduceMean {
        keep_dims: bool,
        noop_with_empty_axes: bool,
    },
    Concat {
        axis: i64,
    },
    Gather {
        axis: i64,
    },
    Shape {
        start: i64,
        end: Option<i64>,
    },
    Expand,
}

#[derive(Debug, Clone)]
struct Node {
    op: Op,
    /// `None` for an optional input left out (an empty name in the graph).
    inputs: Vec<Option<Slot>>,
}

/// One aggregate model's graph, ready to evaluate row by row.
#[derive(Debug)]
pub struct FeedForward {
    constants: Vec<Value>,
    nodes: Vec<Node>,
    /// Which node computes the output the estimator reads.
    output: usize,
}

fn attribute<'a>(node: &'a proto::NodeProto, name: &str) -> Option<&'a proto::AttributeProto> {
    node.attribute.iter().find(|a| a.name == name)
}

fn int_attribute(node: &proto::NodeProto, name: &str, default: i64) -> i64 {
    attribute(node, name).map_or(default, |a| a.i)
}

fn float_attribute(node: &proto::NodeProto, name: &str, default: f32) -> f32 {
    attribute(node, name).map_or(default, |a| a.f)
}

fn op_of(node: &proto::NodeProto) -> Fallible<Op> {
    if !(node.domain.is_empty() || node.domain == "ai.onnx") {
        return Err(format!("op domain '{}'", node.domain));
    }
    Ok(match node.op_type.as_str() {
        "Sigmoid" => Op::Unary(Unary::Sigmoid),
        "Tanh" => Op::Unary(Unary::Tanh),
        "Exp" => Op::Unary(Unary::Exp),
        "Log" => Op::Unary(Unary::Log),
        "Softplus" => Op::Unary(Unary::Softplus),
        "Add" => Op::Binary(Binary::Add),
        "Sub" => Op::Binary(Binary::Sub),
        "Mul" => Op::Binary(Binary::Mul),
        "Div" => Op::Binary(Binary::Div),
        "Clip" => Op::Clip,
        "Greater" => Op::Greater,
        "Where" => Op::Where,
        "Gemm" => Op::Gemm {
            alpha: float_attribute(node, "alpha", 1.0),
            beta: float_attribute(node, "beta", 1.0),
            trans_a: int_attribute(node, "transA", 0) != 0,
            trans_b: int_attribute(node, "transB", 0) != 0,
        },
        "MatMul" => Op::MatMul,
        "Unsqueeze" if node.input.len() == 2 => Op::Unsqueeze,
        "Slice" if node.input.len() >= 3 => Op::Slice,
        "ReduceMean" if attribute(node, "axes").is_none() => Op::ReduceMean {
            keep_dims: int_attribute(node, "keepdims", 1) != 0,
            noop_with_empty_axes: int_attribute(node, "noop_with_empty_axes", 0) != 0,
        },
        "Concat" => Op::Concat {
            axis: int_attribute(node, "axis", 0),
        },
        "Gather" => Op::Gather {
            axis: int_attribute(node, "axis", 0),
        },
        "Shape" => Op::Shape {
            start: int_attribute(node, "start", 0),
            end: attribute(node, "end").map(|a| a.i),
        },
        "Expand" => Op::Expand,
        other => return Err(format!("op {other} (opset form) is not known here")),
    })
}

fn constant_of(tensor: &proto::TensorProto) -> Fallible<Value> {
    if tensor.data_location != 0 {
        return Err(format!(
            "initializer '{}' is stored outside the file",
            tensor.name
        ));
    }
    let shape = tensor
        .dims
        .iter()
        .map(|&d| {
            usize::try_from(d).map_err(|_| format!("initializer '{}': dimension {d}", tensor.name))
        })
        .collect::<Fallible<Vec<usize>>>()?;
    let len: usize = shape.iter().product();
    let value = match tensor.data_type {
        proto::FLOAT => {
            let data: Vec<f32> = if tensor.raw_data.is_empty() {
                tensor.float_data.clone()
            } else {
                tensor
                    .raw_data
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect()
            };
            Value::Float(Tensor { shape, data })
        }
        proto::INT64 => {
            let data: Vec<i64> = if tensor.raw_data.is_empty() {
                tensor.int64_data.clone()
            } else {
                tensor
                    .raw_data
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                    .collect()
            };
            Value::Int(Tensor { shape, data })
        }
        other => {
            return Err(format!(
                "initializer '{}' has data type {other}",
                tensor.name
            ))
        }
    };
    let stored = match &value {
        Value::Float(t) => t.data.len(),
        Value::Int(t) => t.data.len(),
    };
    if stored != len {
        return Err(format!(
            "initializer '{}' holds {stored} values for a shape of {len}",
            tensor.name
        ));
    }
    Ok(value)
}

/// A Gemm whose B is a constant stored transposed (nn.Linear's `[out, in]`) reads a copy
/// laid out `[in, out]` instead, so that its product runs as a row times a matrix.
fn transposed_weights(
    op: Op,
    inputs: Vec<Option<Slot>>,
    constants: &mut Vec<Value>,
) -> (Op, Vec<Option<Slot>>) {
    let Op::Gemm {
        alpha,
        beta,
        trans_a,
        trans_b: true,
    } = op
    else {
        return (op, inputs);
    };
    let Some(Some(Slot::Constant(c))) = inputs.get(1).copied() else {
        return (op, inputs);
    };
    let Value::Float(Tensor { shape, data }) = &constants[c] else {
        return (op, inputs);
    };
    let &[rows, cols] = shape.as_slice() else {
        return (op, inputs);
    };
    let mut transposed = vec![0.0f32; data.len()];
    for r in 0..rows {
        for col in 0..cols {
            transposed[col * rows + r] = data[r * cols + col];
        }
    }
    constants.push(Value::Float(Tensor::new(vec![cols, rows], transposed)));
    let mut inputs = inputs;
    inputs[1] = Some(Slot::Constant(constants.len() - 1));
    let op = Op::Gemm {
        alpha,
        beta,
        trans_a,
        trans_b: false,
    };
    (op, inputs)
}

impl FeedForward {
    /// Reads a graph of one input named `features` whose every node is known here, up to the
    /// output named `output`. `Err` says why the graph cannot be evaluated here.
    pub fn from_onnx(bytes: &[u8], output: &str) -> Result<FeedForward, String> {
        let model =
            proto::ModelProto::decode(bytes).map_err(|e| format!("not an ONNX model: {e}"))?;
        let graph = model.graph.ok_or("the model has no graph")?;
        let inputs: Vec<&str> = graph
            .input
            .iter()
            .map(|i| i.name.as_str())
            .filter(|name| !graph.initializer.iter().any(|t| t.name == *name))
            .collect();
        if inputs != ["features"] {
            return Err(format!("graph inputs are {inputs:?}, not one 'features'"));
        }
        let mut names: HashMap<&str, Slot> = HashMap::from([("features", Slot::Features)]);
        let mut constants = Vec::with_capacity(graph.initializer.len());
        for tensor in &graph.initializer {
            names.insert(tensor.name.as_str(), Slot::Constant(constants.len()));
            constants.push(constant_of(tensor)?);
        }
        let mut nodes = Vec::with_capacity(graph.node.len());
        for node in &graph.node {
            let op = op_of(node)?;
            let inputs = node
                .input
                .iter()
                .map(|name| {
                    if name.is_empty() {
                        return Ok(None);
                    }
                    names.get(name.as_str()).copied().map(Some).ok_or_else(|| {
                        format!("node {} reads '{name}' before it is made", node.op_type)
                    })
                })
                .collect::<Fallible<Vec<_>>>()?;
            let (op, inputs) = transposed_weights(op, inputs, &mut constants);
            let [made] = node.output.as_slice() else {
                return Err(format!(
                    "node {} has {} outputs",
                    node.op_type,
                    node.output.len()
                ));
            };
            names.insert(made.as_str(), Slot::Computed(nodes.len()));
            nodes.push(Node { op, inputs });
        }
        match names.get(output) {
            Some(Slot::Computed(index)) => Ok(FeedForward {
                constants,
                nodes,
                output: *index,
            }),
            _ => Err(format!("no node computes the output '{output}'")),
        }
    }

    /// The output for one row of `width` features.
    fn evaluate_row(&self, row: &[f32]) -> Fallible<Vec<f32>> {
        let features = Value::Float(Tensor::new(vec![1, row.len()], row.to_vec()));
        let mut computed: Vec<Value> = Vec::with_capacity(self.output + 1);
        for node in &self.nodes[..=self.output] {
            let args: Vec<Option<&Value>> = node
                .inputs
                .iter()
                .map(|slot| {
                    slot.map(|slot| match slot {
                        Slot::Features => &features,
                        Slot::Constant(c) => &self.constants[c],
                        Slot::Computed(c) => &computed[c],
                    })
                })
                .collect();
            let value = evaluate(&node.op, &args).map_err(|e| format!("{:?}: {e}", node.op))?;
            computed.push(value);
        }
        match computed.pop().expect("the output node was evaluated") {
            Value::Float(output) => Ok(output.data),
            Value::Int(_) => Err("the output is an integer tensor".into()),
        }
    }
}

impl Model for FeedForward {
    fn infer(&self, input: ModelInput<'_>) -> Result<Vec<f32>, InferenceError> {
        let ModelInput::Aggregate { rows, n_rows } = input else {
            return Err(InferenceError(
                "a feed-forward graph reads aggregate features".into(),
            ));
        };
        if n_rows == 0 {
            return Ok(Vec::new());
        }
        let width = rows.len() / n_rows;
        let mut out = Vec::new();
        for row in rows.chunks_exact(width) {
            out.extend(self.evaluate_row(row).map_err(InferenceError)?);
        }
        Ok(out)
    }
}

fn evaluate(op: &Op, args: &[Option<&Value>]) -> Fallible<Value> {
    let get = |i: usize| -> Fallible<Option<&Value>> { Ok(args.get(i).copied().flatten()) };
    let need = |i: usize| -> Fallible<&Value> {
        args.get(i)
            .copied()
            .flatten()
            .ok_or_else(|| format!("input {i} is missing"))
    };
    Ok(match *op {
        Op::Unary(unary) => {
            let x = need(0)?.float()?;
            // One loop per function, so that each is inlined rather than called per value.
            let data = match unary {
                Unary::Sigmoid => x.data.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect(),
                Unary::Tanh => x.data.iter().map(|&v| v.tanh()).collect(),
                Unary::Exp => x.data.iter().map(|&v| v.exp()).collect(),
                Unary::Log => x.data.iter().map(|&v| v.ln()).collect(),
                // log(1 + e^v) without overflow for large v.
                Unary::Softplus => x
                    .data
                    .iter()
                    .map(|&v| {
                        if v > 0.0 {
                            v + (-v).exp().ln_1p()
                        } else {
                            v.exp().ln_1p()
                        }
                    })
                    .collect(),
            };
            Value::Float(Tensor::new(x.shape.clone(), data))
        }
        Op::Binary(binary) => {
            let (a, b) = (need(0)?.float()?, need(1)?.float()?);
            Value::Float(match binary {
                Binary::Add => broadcast_binary(a, b, |x, y| x + y)?,
                Binary::Sub => broadcast_binary(a, b, |x, y| x - y)?,
                Binary::Mul => broadcast_binary(a, b, |x, y| x * y)?,
                Binary::Div => broadcast_binary(a, b, |x, y| x / y)?,
            })
        }
        Op::Clip => {
            let x = need(0)?.float()?;
            let bound = |i: usize, default: f32| -> Fallible<f32> {
                match get(i)? {
                    None => Ok(default),
                    Some(v) => scalar(v.float()?),
                }
            };
            let (low, high) = (bound(1, f32::NEG_INFINITY)?, bound(2, f32::INFINITY)?);
            Value::Float(Tensor::new(
                x.shape.clone(),
                x.data.iter().map(|&v| v.max(low).min(high)).collect(),
            ))
        }
        Op::Greater => Value::Int(broadcast_binary(
            need(0)?.float()?,
            need(1)?.float()?,
            |a, b| i64::from(a > b),
        )?),
        Op::Where => {
            let condition = match need(0)? {
                Value::Int(t) => t,
                Value::Float(_) => return Err("a float condition".into()),
            };
            let (x, y) = (need(1)?.float()?, need(2)?.float()?);
            let shape = broadcast_shape(&broadcast_shape(&condition.shape, &x.shape)?, &y.shape)?;
            let data = broadcast_offsets(&condition.shape, &shape)
                .into_iter()
                .zip(broadcast_offsets(&x.shape, &shape))
                .zip(broadcast_offsets(&y.shape, &shape))
                .map(|((c, i), j)| {
                    if condition.data[c] != 0 {
                        x.data[i]
                    } else {
                        y.data[j]
                    }
                })
                .collect();
            Value::Float(Tensor::new(shape, data))
        }
        Op::Gemm {
            alpha,
            beta,
            trans_a,
            trans_b,
        } => Value::Float(gemm(
            need(0)?.float()?,
            need(1)?.float()?,
            get(2)?.map(Value::float).transpose()?,
            alpha,
            beta,
            trans_a,
            trans_b,
        )?),
        Op::MatMul => Value::Float(matmul(need(0)?.float()?, need(1)?.float()?)?),
        Op::Unsqueeze => {
            let x = need(0)?;
            let axes = need(1)?.ints()?;
            let shape = unsqueezed(shape_of(x), axes)?;
            reshaped(x, shape)
        }
        Op::Slice => {
            let x = need(0)?.float()?;
            let ints =
                |i: usize| -> Fallible<Option<&[i64]>> { get(i)?.map(Value::ints).transpose() };
            let starts = ints(1)?.ok_or("no starts")?;
            let ends = ints(2)?.ok_or("no ends")?;
            Value::Float(slice(x, starts, ends, ints(3)?, ints(4)?)?)
        }
        Op::ReduceMean {
            keep_dims,
            noop_with_empty_axes,
        } => {
            let x = need(0)?.float()?;
            let axes = get(1)?.map(Value::ints).transpose()?.unwrap_or(&[]);
            if axes.is_empty() && noop_with_empty_axes {
                Value::Float(x.clone())
            } else {
                Value::Float(reduce_mean(x, axes, keep_dims)?)
            }
        }
        Op::Concat { axis } => {
            let parts = (0..args.len())
                .map(|i| need(i).and_then(Value::float))
                .collect::<Fallible<Vec<_>>>()?;
            Value::Float(concat(&parts, axis)?)
        }
        Op::Gather { axis } => {
            let indices = match need(1)? {
                Value::Int(t) => t,
                Value::Float(_) => return Err("float indices".into()),
            };
            Value::Float(gather(need(0)?.float()?, indices, axis)?)
        }
        Op::Shape { start, end } => {
            let shape = shape_of(need(0)?);
            let rank = shape.len() as i64;
            let clamp = |i: i64| (if i < 0 { i + rank } else { i }).clamp(0, rank) as usize;
            let (from, to) = (clamp(start), clamp(end.unwrap_or(rank)));
            let dims: Vec<i64> = shape[from..to.max(from)]
                .iter()
                .map(|&d| d as i64)
                .collect();
            Value::Int(Tensor::new(vec![dims.len()], dims))
        }
        Op::Expand => {
            let x = need(0)?.float()?;
            let target = need(1)?
                .ints()?
                .iter()
                .map(|&d| usize::try_from(d).map_err(|_| format!("dimension {d}")))
                .collect::<Fallible<Vec<usize>>>()?;
            let shape = broadcast_shape(&x.shape, &target)?;
            let data = broadcast_offsets(&x.shape, &shape)
                .into_iter()
                .map(|i| x.data[i])
                .collect();
            Value::Float(Tensor::new(shape, data))
        }
    })
}

fn shape_of(value: &Value) -> &[usize] {
    match value {
        Value::Float(t) => &t.shape,
        Value::Int(t) => &t.shape,
    }
}

fn reshaped(value: &Value, shape: Vec<usize>) -> Value {
    match value {
        Value::Float(t) => Value::Float(Tensor::new(shape, t.data.clone())),
        Value::Int(t) => Value::Int(Tensor::new(shape, t.data.clone())),
    }
}

fn scalar(t: &Tensor<f32>) -> Fallible<f32> {
    match t.data.as_slice() {
        [v] => Ok(*v),
        _ => Err(format!("expected one value, got shape {:?}", t.shape)),
    }
}

/// An axis given from the end (negative) counted from the start, checked against `rank`.
fn axis_of(axis: i64, rank: usize) -> Fallible<usize> {
    let resolved = if axis < 0 { axis + rank as i64 } else { axis };
    usize::try_from(resolved)
        .ok()
        .filter(|&a| a < rank)
        .ok_or_else(|| format!("axis {axis} of a rank-{rank} tensor"))
}

fn unsqueezed(shape: &[usize], axes: &[i64]) -> Fallible<Vec<usize>> {
    let rank = shape.len() + axes.len();
    let mut inserted = axes
        .iter()
        .map(|&a| axis_of(a, rank))
        .collect::<Fallible<Vec<usize>>>()?;
    inserted.sort_unstable();
    let mut dims = shape.iter().copied();
    Ok((0..rank)
        .map(|i| {
            if inserted.binary_search(&i).is_ok() {
                1
            } else {
                dims.next().unwrap_or(1)
            }
        })
        .collect())
}

/// NumPy's broadcasting of two shapes.
fn broadcast_shape(a: &[usize], b: &[usize]) -> Fallible<Vec<usize>> {
    let rank = a.len().max(b.len());
    let dim = |s: &[usize], i: usize| {
        if i + s.len() >= rank {
            s[i + s.len() - rank]
        } else {
            1
        }
    };
    (0..rank)
        .map(|i| match (dim(a, i), dim(b, i)) {
            (x, y) if x == y => Ok(x),
            (1, y) => Ok(y),
            (x, 1) => Ok(x),
            (x, y) => Err(format!(
                "shapes {a:?} and {b:?} do not broadcast ({x} against {y})"
            )),
        })
        .collect()
}

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for axis in (0..shape.len().saturating_sub(1)).rev() {
        strides[axis] = strides[axis + 1] * shape[axis + 1];
    }
    strides
}

/// Row-major strides of `shape` laid against `out_shape`, 0 along broadcast axes.
fn broadcast_strides(shape: &[usize], out_shape: &[usize]) -> Vec<usize> {
    let pad = out_shape.len() - shape.len();
    let mut strides = vec![0; out_shape.len()];
    let mut stride = 1;
    for (i, &d) in shape.iter().enumerate().rev() {
        strides[pad + i] = if d == 1 { 0 } else { stride };
        stride *= d;
    }
    strides
}

/// For each element of `out_shape` in order, the index of the element of a `shape` tensor
/// broadcast to it.
fn broadcast_offsets(shape: &[usize], out_shape: &[usize]) -> Vec<usize> {
    let strides = broadcast_strides(shape, out_shape);
    let len: usize = out_shape.iter().product();
    let mut offsets = Vec::with_capacity(len);
    let mut index = vec![0usize; out_shape.len()];
    let mut offset = 0usize;
    for _ in 0..len {
        offsets.push(offset);
        for axis in (0..out_shape.len()).rev() {
            index[axis] += 1;
            offset += strides[axis];
            if index[axis] < out_shape[axis] {
                break;
            }
            offset -= strides[axis] * index[axis];
            index[axis] = 0;
        }
    }
    offsets
}

fn broadcast_binary<A: Copy, B: Copy, C: Copy>(
    a: &Tensor<A>,
    b: &Tensor<B>,
    f: impl Fn(A, B) -> C,
) -> Fallible<Tensor<C>> {
    let shape = broadcast_shape(&a.shape, &b.shape)?;
    let len: usize = shape.iter().product();
    // Fast paths: equal shapes, and one operand repeating along leading axes only (a bias, a
    // scalar, one row against every member), which is every broadcast these graphs make.
    let repeats = |t: &[usize]| {
        let trailing = t.iter().skip_while(|&&d| d == 1).count();
        t[t.len() - trailing..] == shape[shape.len() - trailing..]
    };
    let data = if a.shape == b.shape {
        a.data.iter().zip(&b.data).map(|(&x, &y)| f(x, y)).collect()
    } else if a.data.len() == len && repeats(&b.shape) {
        let cycle = b.data.len();
        a.data
            .chunks_exact(cycle)
            .flat_map(|chunk| chunk.iter().zip(&b.data).map(|(&x, &y)| f(x, y)))
            .collect()
    } else if b.data.len() == len && repeats(&a.shape) {
        let cycle = a.data.len();
        b.data
            .chunks_exact(cycle)
            .flat_map(|chunk| a.data.iter().zip(chunk).map(|(&x, &y)| f(x, y)))
            .collect()
    } else {
        broadcast_offsets(&a.shape, &shape)
            .into_iter()
            .zip(broadcast_offsets(&b.shape, &shape))
            .map(|(i, j)| f(a.data[i], b.data[j]))
            .collect()
    };
    Ok(Tensor::new(shape, data))
}

/// `alpha * op(A) op(B) + beta * C`, A and B two-dimensional, C broadcast to the product.
fn gemm(
    a: &Tensor<f32>,
    b: &Tensor<f32>,
    c: Option<&Tensor<f32>>,
    alpha: f32,
    beta: f32,
    trans_a: bool,
    trans_b: bool,
) -> Fallible<Tensor<f32>> {
    let ([ar, ac], [br, bc]) = (a.shape.as_slice(), b.shape.as_slice()) else {
        return Err(format!("Gemm of shapes {:?} and {:?}", a.shape, b.shape));
    };
    let (m, k) = if trans_a { (*ac, *ar) } else { (*ar, *ac) };
    let (kb, n) = if trans_b { (*bc, *br) } else { (*br, *bc) };
    if k != kb {
        return Err(format!("Gemm of shapes {:?} and {:?}", a.shape, b.shape));
    }
    let mut data = vec![0.0f32; m * n];
    if !trans_a && !trans_b {
        for (i, out) in data.chunks_exact_mut(n).enumerate() {
            row_times_matrix(&a.data[i * k..(i + 1) * k], &b.data, out);
        }
        if alpha != 1.0 {
            data.iter_mut().for_each(|v| *v *= alpha);
        }
    } else {
        let a_at = |i: usize, p: usize| {
            if trans_a {
                a.data[p * m + i]
            } else {
                a.data[i * k + p]
            }
        };
        let b_at = |p: usize, j: usize| {
            if trans_b {
                b.data[j * k + p]
            } else {
                b.data[p * n + j]
            }
        };
        for i in 0..m {
            for j in 0..n {
                let sum = (0..k).fold(0.0f32, |sum, p| sum + a_at(i, p) * b_at(p, j));
                data[i * n + j] = alpha * sum;
            }
        }
    }
    if let Some(c) = c {
        if broadcast_shape(&c.shape, &[m, n])? != [m, n] {
            return Err(format!(
                "Gemm's C of shape {:?} against [{m}, {n}]",
                c.shape
            ));
        }
        let product = Tensor::new(vec![m, n], data);
        let sum = if beta == 1.0 {
            broadcast_binary(&product, c, |x, y| x + y)?
        } else {
            broadcast_binary(&product, c, |x, y| x + beta * y)?
        };
        return Ok(sum);
    }
    Ok(Tensor::new(vec![m, n], data))
}

/// `out += row B`, B row-major `[row.len(), out.len()]`: each output sums its products in
/// the order of `row`, whatever the width of the vector unit (and never fused into one
/// rounding), so every machine gets the same bits; the widest unit the CPU has does it.
fn row_times_matrix(row: &[f32], b: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F, checked just above.
            return unsafe { row_times_matrix_avx512(row, b, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2, checked just above.
            return unsafe { row_times_matrix_avx2(row, b, out) };
        }
    }
    row_times_matrix_any(row, b, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn row_times_matrix_avx512(row: &[f32], b: &[f32], out: &mut [f32]) {
    row_times_matrix_any(row, b, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn row_times_matrix_avx2(row: &[f32], b: &[f32], out: &mut [f32]) {
    row_times_matrix_any(row, b, out)
}

#[inline(always)]
fn row_times_matrix_any(row: &[f32], b: &[f32], out: &mut [f32]) {
    let n = out.len();
    if n == 1 {
        // One output: a dot product, summed in the same order.
        out[0] = row.iter().zip(b).fold(out[0], |sum, (&x, &y)| sum + x * y);
        return;
    }
    // Sixteen outputs at a time, kept in registers across the whole row rather than stored
    // and loaded again for every product.
    const LANES: usize = 16;
    let mut start = 0;
    while start < n {
        let width = LANES.min(n - start);
        let mut sums = [0.0f32; LANES];
        sums[..width].copy_from_slice(&out[start..start + width]);
        if width == LANES {
            for (p, &x) in row.iter().enumerate() {
                let b_part: &[f32; LANES] = b[p * n + start..p * n + start + LANES]
                    .try_into()
                    .expect("sixteen values");
                for (sum, &y) in sums.iter_mut().zip(b_part) {
                    *sum += x * y;
                }
            }
        } else {
            for (p, &x) in row.iter().enumerate() {
                for (sum, &y) in sums[..width]
                    .iter_mut()
                    .zip(&b[p * n + start..p * n + start + width])
                {
                    *sum += x * y;
                }
            }
        }
        out[start..start + width].copy_from_slice(&sums[..width]);
        start += width;
    }
}

/// NumPy's matmul of two tensors of rank 2 or more, their leading axes broadcast.
fn matmul(a: &Tensor<f32>, b: &Tensor<f32>) -> Fallible<Tensor<f32>> {
    let (ra, rb) = (a.shape.len(), b.shape.len());
    if ra < 2 || rb < 2 {
        return Err(format!("MatMul of shapes {:?} and {:?}", a.shape, b.shape));
    }
    let (m, k) = (a.shape[ra - 2], a.shape[ra - 1]);
    let (kb, n) = (b.shape[rb - 2], b.shape[rb - 1]);
    if k != kb {
        return Err(format!("MatMul of shapes {:?} and {:?}", a.shape, b.shape));
    }
    let batch = broadcast_shape(&a.shape[..ra - 2], &b.shape[..rb - 2])?;
    let a_batches = broadcast_offsets(&a.shape[..ra - 2], &batch);
    let b_batches = broadcast_offsets(&b.shape[..rb - 2], &batch);
    let mut data = vec![0.0f32; a_batches.len() * m * n];
    for (out, (ia, ib)) in data
        .chunks_exact_mut(m * n)
        .zip(a_batches.into_iter().zip(b_batches))
    {
        let a = &a.data[ia * m * k..(ia + 1) * m * k];
        let b = &b.data[ib * k * n..(ib + 1) * k * n];
        for (i, row) in out.chunks_exact_mut(n).enumerate() {
            row_times_matrix(&a[i * k..(i + 1) * k], b, row);
        }
    }
    let mut shape = batch;
    shape.extend([m, n]);
    Ok(Tensor::new(shape, data))
}

fn slice(
    x: &Tensor<f32>,
    starts: &[i64],
    ends: &[i64],
    axes: Option<&[i64]>,
    steps: Option<&[i64]>,
) -> Fallible<Tensor<f32>> {
    let rank = x.shape.len();
    let default_axes: Vec<i64> = (0..starts.len() as i64).collect();
    let axes = axes.unwrap_or(&default_axes);
    if starts.len() != ends.len() || axes.len() != starts.len() {
        return Err("starts, ends and axes differ in length".into());
    }
    if steps.is_some_and(|s| s.iter().any(|&step| step != 1)) {
        return Err("only steps of 1 are known here".into());
    }
    let mut from = vec![0usize; rank];
    let mut shape = x.shape.clone();
    for ((&axis, &start), &end) in axes.iter().zip(starts).zip(ends) {
        let axis = axis_of(axis, rank)?;
        let dim = x.shape[axis] as i64;
        let clamp = |i: i64| (if i < 0 { i.saturating_add(dim) } else { i }).clamp(0, dim) as usize;
        let (start, end) = (clamp(start), clamp(end));
        from[axis] = start;
        shape[axis] = end.saturating_sub(start);
    }
    let strides = strides(&x.shape);
    let base: usize = from.iter().zip(&strides).map(|(f, s)| f * s).sum();
    let len: usize = shape.iter().product();
    let data = (0..len)
        .map(|flat| {
            let mut rest = flat;
            let mut offset = base;
            for axis in (0..rank).rev() {
                offset += (rest % shape[axis].max(1)) * strides[axis];
                rest /= shape[axis].max(1);
            }
            x.data[offset]
        })
        .collect();
    Ok(Tensor::new(shape, data))
}

fn reduce_mean(x: &Tensor<f32>, axes: &[i64], keep_dims: bool) -> Fallible<Tensor<f32>> {
    let rank = x.shape.len();
    let reduced: Vec<usize> = if axes.is_empty() {
        (0..rank).collect()
    } else {
        axes.iter()
            .map(|&a| axis_of(a, rank))
            .collect::<Fallible<_>>()?
    };
    let kept_shape: Vec<usize> = (0..rank)
        .map(|i| if reduced.contains(&i) { 1 } else { x.shape[i] })
        .collect();
    let count: usize = reduced.iter().map(|&i| x.shape[i]).product();
    let targets = broadcast_offsets(&kept_shape, &x.shape);
    let mut sums = vec![0.0f32; kept_shape.iter().product()];
    for (&v, target) in x.data.iter().zip(targets) {
        sums[target] += v;
    }
    let data = sums.into_iter().map(|s| s / count as f32).collect();
    let shape = if keep_dims {
        kept_shape
    } else {
        (0..rank)
            .filter(|i| !reduced.contains(i))
            .map(|i| x.shape[i])
            .collect()
    };
    Ok(Tensor::new(shape, data))
}

fn concat(parts: &[&Tensor<f32>], axis: i64) -> Fallible<Tensor<f32>> {
    let first = parts.first().ok_or("nothing to concatenate")?;
    let rank = first.shape.len();
    let axis = axis_of(axis, rank)?;
    for part in parts {
        let same = part.shape.len() == rank
            && (0..rank).all(|i| i == axis || part.shape[i] == first.shape[i]);
        if !same {
            return Err(format!(
                "Concat of shapes {:?} and {:?}",
                first.shape, part.shape
            ));
        }
    }
    let outer: usize = first.shape[..axis].iter().product();
    let mut shape = first.shape.clone();
    shape[axis] = parts.iter().map(|p| p.shape[axis]).sum();
    let mut data = Vec::with_capacity(shape.iter().product());
    for o in 0..outer {
        for part in parts {
            let chunk = part.data.len() / outer.max(1);
            data.extend_from_slice(&part.data[o * chunk..(o + 1) * chunk]);
        }
    }
    Ok(Tensor::new(shape, data))
}

fn gather(x: &Tensor<f32>, indices: &Tensor<i64>, axis: i64) -> Fallible<Tensor<f32>> {
    let rank = x.shape.len();
    let axis = axis_of(axis, rank)?;
    let dim = x.shape[axis];
    let outer: usize = x.shape[..axis].iter().product();
    let inner: usize = x.shape[axis + 1..].iter().product();
    let picked = indices
        .data
        .iter()
        .map(|&i| {
            let resolved = if i < 0 { i + dim as i64 } else { i };
            usize::try_from(resolved)
                .ok()
                .filter(|&r| r < dim)
                .ok_or_else(|| format!("index {i} along an axis of {dim}"))
        })
        .collect::<Fallible<Vec<usize>>>()?;
    let mut data = Vec::with_capacity(outer * picked.len() * inner);
    for o in 0..outer {
        for &i in &picked {
            let at = (o * dim + i) * inner;
            data.extend_from_slice(&x.data[at..at + inner]);
        }
    }
    let mut shape = x.shape[..axis].to_vec();
    shape.extend(&indices.shape);
    shape.extend(&x.shape[axis + 1..]);
    Ok(Tensor::new(shape, data))
}

#[cfg(test)]
mod tests;
