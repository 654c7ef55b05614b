"""The aggregate estimators' weights as plain arrays: what the service's in-process evaluator
(src/estimators/feedforward.rs) reads, written from the ONNX graph a stage exported.

The service evaluates each in-process estimator from `models/<graph stem>.weights.json` and never
parses ONNX for it; the exported graph stays committed beside it (the manifest entry's `graph`)
as what training scored, and the Rust tests check the evaluator against ONNX Runtime's run of it.
`manifest.write_manifest` converts every `in_process` entry whose file is still a graph.

The file (JSON, `"format": "gpucast-mlp-ensemble"`, `"version": 1`):

- `inputs`: the width of a row of normalised features.
- `linear_scale` (optional): `columns`, `means`, `stds`, `scales`; the view
  `(exp(x[c] * std + mean) - 1) / scale` of those columns, appended to the row the members read.
- `members`: each `{"input_mask"?, "layers", "linear"?, "spread"?}`. A member's layers read the
  row (times `input_mask` when given); each layer is `{"inputs", "outputs", "weights", "bias"}`,
  `weights` row-major `[inputs][outputs]`, every layer but the last followed by SiLU.
- `head`: how the members' outputs `y` make the answer, always their mean over the members:
  - `sigmoid`: `sigmoid(y[0])`;
  - `residual`: `base + tanh(y[0])`, base = `x[feature] * std + mean` (`base`);
  - `capped_residual`: `ln(max(exp(x[feature] * std + mean) - 1, floor) + context) +
    tanh(y[0] / cap) * cap`;
  - `ordinal_learned_spread`: class probabilities between `bins`: cdf_k = sigmoid((bins[k] -
    (base + y[0])) / spread), spread = (y[1] if y[1] > threshold else softplus(y[1])) + add;
    p = [cdf, 1] - [0, cdf], at least `floor`;
  - `ordinal_fixed_spread`: as above with centre `linear · view + y[0]` (the member's `linear`
    over the linear-scale view) and the member's own `spread`, no floor.

Every float is the exact value of the graph's float32, written as a decimal that reads back to it.
"""

import json
import os

FORMAT = "gpucast-mlp-ensemble"
VERSION = 1
SUFFIX = ".weights.json"


def weights_file_of(graph_file):
    """`smact.onnx` -> `smact.weights.json`."""
    stem = graph_file[: -len(".onnx")] if graph_file.endswith(".onnx") else graph_file
    return stem + SUFFIX


class Graph:
    """An ONNX graph's constants and nodes, looked up by name."""

    def __init__(self, graph):
        from onnx import numpy_helper  # the exporter's own dependency

        self.constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.nodes = list(graph.node)
        self.made_by = {out: node for node in self.nodes for out in node.output}

    def ops(self):
        return [node.op_type for node in self.nodes]

    def constant(self, name):
        if name not in self.constants:
            raise ValueError("'%s' is not a constant of the graph" % name)
        return self.constants[name]

    def scalar(self, name):
        value = self.constant(name)
        if value.size != 1:
            raise ValueError("'%s' holds %d values, not one" % (name, value.size))
        return value.reshape(())

    def first(self, op_type, **where):
        for node in self.nodes:
            if node.op_type == op_type and all(
                getattr(node, key)[i] == value for key, pairs in where.items() for i, value in pairs
            ):
                return node
        raise ValueError("the graph has no %s node of that form" % op_type)

    def all(self, op_type):
        return [node for node in self.nodes if node.op_type == op_type]


def floats(array):
    """Exact decimals of a float32 array (float32 -> float64 is exact; repr reads back)."""
    import numpy as np

    return [float(v) for v in np.asarray(array, dtype=np.float32).reshape(-1)]


def dense(weight, bias, transposed):
    """One layer: `weight` `[in, out]` (or nn.Linear's `[out, in]` when `transposed`)."""
    import numpy as np

    weight = np.asarray(weight, dtype=np.float32)
    if transposed:
        weight = weight.T
    inputs, outputs = weight.shape
    bias = np.asarray(bias, dtype=np.float32).reshape(-1)
    if bias.size != outputs:
        raise ValueError("a bias of %d values for %d outputs" % (bias.size, outputs))
    return {"inputs": int(inputs), "outputs": int(outputs), "weights": floats(weight), "bias": floats(bias)}


def slice_start(g, node):
    """The one index a Slice of one element along the last axis reads."""
    start, end = int(g.scalar(node.input[1])), int(g.scalar(node.input[2]))
    if end != start + 1:
        raise ValueError("a slice of %d..%d, not one feature" % (start, end))
    return start


def base_feature(g):
    """The raw base feature the residual heads add to: `x[feature] * std + mean`."""
    node = g.first("Slice", input=[(0, "features")])
    return {
        "feature": slice_start(g, node),
        "mean": floats(g.scalar("base.mean"))[0],
        "std": floats(g.scalar("base.std"))[0],
    }


def linear_scale(g):
    gather = g.first("Gather", input=[(0, "features")])
    prefix = "members.0.linear_scale."
    return {
        "columns": [int(c) for c in g.constant(gather.input[1]).reshape(-1)],
        "means": floats(g.constant(prefix + "means")),
        "stds": floats(g.constant(prefix + "stds")),
        "scales": floats(g.constant(prefix + "scales")),
    }


def stacked_members(g, masked):
    """Members stored stacked (`members.w1` `[K, in, out]` ...), optionally with input masks."""
    c = g.constants
    members = []
    for k in range(c["members.w1"].shape[0]):
        member = {"layers": [dense(c["members.w%d" % i][k], c["members.b%d" % i][k], False) for i in (1, 2, 3)]}
        if masked:
            member = {"input_mask": floats(c["member_inputs"][k]), **member}
        members.append(member)
    return members


def linear_members(g, body):
    """Members stored one nn.Linear at a time (`members.<k>.<body>.<i>.weight`, `[out, in]`)."""
    members = []
    k = 0
    while "members.%d.%s.0.weight" % (k, body) in g.constants:
        layers = []
        i = 0
        while "members.%d.%s.%d.weight" % (k, body, i) in g.constants:
            name = "members.%d.%s.%d." % (k, body, i)
            layers.append(dense(g.constants[name + "weight"], g.constants[name + "bias"], True))
            i += 2  # Linear, SiLU, Linear, ...
        members.append({"layers": layers})
        k += 1
    return members


def expect_ops(g, allowed):
    unknown = sorted(set(g.ops()) - set(allowed))
    if unknown:
        raise ValueError("ops %s outside this architecture" % ", ".join(unknown))


def convert(graph, inputs):
    """The weights document of an exported aggregate graph (onnx GraphProto), read by its
    architecture; ValueError when the graph is none the evaluator knows."""
    g = Graph(graph)
    names = set(g.constants)
    common = {"Sigmoid", "Mul", "Add", "Unsqueeze", "Concat", "ReduceMean"}
    if "members.w1" in names and "member_inputs" in names and "base.context" in names:
        expect_ops(g, common | {"MatMul", "Div", "Tanh", "Slice", "Exp", "Sub", "Clip", "Log"})
        clip = g.first("Clip")
        add_context = g.first("Add", input=[(1, "base.context")])
        if add_context.input[0] != clip.output[0] or g.made_by[clip.input[0]].op_type != "Sub":
            raise ValueError("the base is not ln(max(expm1(.), floor) + context)")
        cap = g.first("Tanh")
        cap_div = g.made_by[cap.input[0]]
        head = {
            "type": "capped_residual",
            "base": {
                **base_feature(g),
                "floor": floats(g.scalar(clip.input[1]))[0],
                "context": floats(g.scalar("base.context"))[0],
            },
            "cap": floats(g.scalar(cap_div.input[1]))[0],
        }
        document = {"members": stacked_members(g, masked=True), "head": head}
    elif "members.w1" in names and "member_inputs" in names:
        expect_ops(g, common | {"MatMul", "Tanh", "Slice"})
        document = {"members": stacked_members(g, masked=True), "head": {"type": "residual", "base": base_feature(g)}}
    elif "members.w1" in names and "log_bins" in names:
        expect_ops(
            g, common | {"MatMul", "Slice", "Softplus", "Greater", "Where", "Sub", "Div", "Shape", "Expand", "Clip"}
        )
        greater = g.first("Greater")
        where = g.first("Where")
        add_floor = next(n for n in g.all("Add") if n.input[0] == where.output[0])
        clip = g.first("Clip")
        head = {
            "type": "ordinal_learned_spread",
            "bins": floats(g.constant("log_bins")),
            "base": base_feature(g),
            "threshold": floats(g.scalar(greater.input[1]))[0],
            "add": floats(g.scalar(add_floor.input[1]))[0],
            "floor": floats(g.scalar(clip.input[1]))[0],
        }
        document = {"members": stacked_members(g, masked=False), "head": head}
    elif "members.0.head.bins" in names:
        expect_ops(g, common | {"Gather", "Exp", "Sub", "Div", "Gemm", "Shape", "Expand", "Slice"})
        members = linear_members(g, "head.correction")
        for k, member in enumerate(members):
            # The spread of member k divides its centred bins: Div(Sub(bins, centre_k), spread_k).
            subs = [n for n in g.all("Sub") if n.input[0] == "members.0.head.bins"]
            div = next(n for n in g.all("Div") if n.input[0] == subs[k].output[0])
            name = "members.%d.head.linear." % k
            linear = dense(g.constant(name + "weight"), g.constant(name + "bias"), True)
            member["linear"] = {"weights": linear["weights"], "bias": linear["bias"][0]}
            member["spread"] = floats(g.scalar(div.input[1]))[0]
        head = {"type": "ordinal_fixed_spread", "bins": floats(g.constant("members.0.head.bins"))}
        document = {"linear_scale": linear_scale(g), "members": members, "head": head}
    elif "members.0.body.0.weight" in names:
        expect_ops(g, common | {"Gather", "Exp", "Sub", "Div", "Gemm"})
        document = {"linear_scale": linear_scale(g), "members": linear_members(g, "body"), "head": {"type": "sigmoid"}}
    else:
        raise ValueError("the graph is none of the MLP ensembles the in-process evaluator knows")
    return {"format": FORMAT, "version": VERSION, "inputs": inputs, **document}


def write_from_graph(graph_path, inputs, weights_path=None):
    """Writes the weights of the graph at `graph_path` (beside it unless `weights_path`) and
    returns their path."""
    import onnx  # the exporter's own dependency

    weights_path = weights_path or os.path.join(
        os.path.dirname(graph_path), weights_file_of(os.path.basename(graph_path))
    )
    document = convert(onnx.load(graph_path).graph, inputs)
    with open(weights_path, "w") as handle:
        json.dump(document, handle, separators=(",", ":"))
        handle.write("\n")
    return weights_path


def run(layout, threads=None):
    """The `weights` stage: converts the in-process estimators of the manifest whose file is
    still an exported graph (no retraining; `generated_at` kept: the models are the same)."""
    from . import manifest as mf

    del threads  # no torch here
    path = layout.out("models", "manifest.json")
    manifest = mf.read_json(layout.read("models", "manifest.json"))
    mf.convert_in_process(
        os.path.dirname(path), manifest, read_dir=os.path.dirname(layout.read("models", "manifest.json"))
    )
    mf.check_runtimes(os.path.dirname(path), manifest)
    mf.write_json(path, manifest)
