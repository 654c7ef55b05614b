"""models/manifest.json: how every stage writes its part.

Standard library only (the graph check reads the written graphs with `onnx`, imported there).
Each stage replaces its own estimators (by name) and top-level blocks in the manifest the
earlier stages wrote.
"""

import datetime
import hashlib
import json
import os


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()


def read_json(path):
    with open(path) as handle:
        return json.load(handle)


def write_json(path, value, indent=1, newline=True, separators=None):
    with open(path, "w") as handle:
        json.dump(value, handle, indent=indent, separators=separators)
        if newline:
            handle.write("\n")


def replace_estimators(manifest, names, entries):
    """The manifest's estimators without those named `names`, then `entries` (in place)."""
    manifest["estimators"] = [e for e in manifest["estimators"] if e["name"] not in set(names)] + list(entries)
    return manifest


# What evaluates an estimator's graph in the service (each entry's `runtime`; the service loads
# a model on that runtime only and refuses to start when it cannot run there): its own evaluator
# of the aggregate feed-forward graphs, or ONNX Runtime (the sequence classifiers).
IN_PROCESS = "in_process"
ONNXRUNTIME = "onnxruntime"
RUNTIMES = (IN_PROCESS, ONNXRUNTIME)

# The ops the in-process evaluator knows (src/estimators/feedforward.rs, `op_of`): keep the two
# equal. It reads Unsqueeze and Slice in their opset 13+ forms, ReduceMean in its opset 18+ one.
IN_PROCESS_OPS = frozenset(
    {"Sigmoid", "Tanh", "Exp", "Log", "Softplus", "Add", "Sub", "Mul", "Div", "Clip", "Greater", "Where"}
    | {"Gemm", "MatMul", "Unsqueeze", "Slice", "ReduceMean", "Concat", "Gather", "Shape", "Expand"}
)


def in_process_refusals(nodes):
    """Why the in-process evaluator cannot read a graph of `nodes` (ONNX NodeProto: domain,
    op_type, input, attribute), one line per distinct reason; empty when it can."""
    reasons = set()
    for node in nodes:
        op = node.op_type
        if node.domain not in ("", "ai.onnx"):
            reasons.add("op %s of domain %s" % (op, node.domain))
        elif op not in IN_PROCESS_OPS:
            reasons.add("op %s" % op)
        elif (op == "Unsqueeze" and len(node.input) != 2) or (op == "Slice" and len(node.input) < 3):
            reasons.add("op %s in its opset < 13 form" % op)
        elif op == "ReduceMean" and any(a.name == "axes" for a in node.attribute):
            reasons.add("op ReduceMean in its opset < 18 form")
    return sorted(reasons)


def check_runtimes(models_dir, manifest):
    """Raises ValueError, naming the estimator, when an entry names no runtime or one the
    service does not know, or names `in_process` for a graph the evaluator cannot read."""
    for entry in manifest["estimators"]:
        name, runtime = entry["name"], entry.get("runtime")
        if runtime not in RUNTIMES:
            raise ValueError("estimator %s: runtime %r is not one of %s" % (name, runtime, RUNTIMES))
        if runtime != IN_PROCESS:
            continue
        if entry["input"]["type"] != "aggregate":
            raise ValueError("estimator %s: the in-process evaluator reads aggregate input only" % name)
        import onnx  # only here: the rest of this module is standard library

        graph = onnx.load(os.path.join(models_dir, entry["file"])).graph
        refusals = in_process_refusals(graph.node)
        if refusals:
            raise ValueError(
                "estimator %s: the in-process evaluator does not know %s; export other ops or "
                "name runtime %s" % (name, ", ".join(refusals), ONNXRUNTIME)
            )


def write_manifest(path, manifest):
    """Checks every estimator's runtime against its graph, stamps `generated_at` and writes
    the manifest."""
    check_runtimes(os.path.dirname(path), manifest)
    manifest["generated_at"] = utc_now()
    write_json(path, manifest)


def estimators_by_name(manifest):
    return {entry["name"]: entry for entry in manifest["estimators"]}
