"""ONNX export and onnxruntime sessions, shared by every stage that writes a model."""

import time

import onnxruntime as ort
import torch


def export_onnx(model, example_inputs, input_names, output_name, dynamic_axes, path, max_tokens, min_tokens=None):
    """Exports `model` (dynamo) with one self-contained file. `dynamic_axes`: per input, axis ->
    "N" (batch) or "L" (tokens, min_tokens..max_tokens)."""
    dims = {"N": torch.export.Dim("N"), "L": torch.export.Dim("L", min=min_tokens, max=max_tokens)}
    dynamic_shapes = tuple({axis: dims[dim] for axis, dim in axes.items()} for axes in dynamic_axes)
    torch.onnx.export(
        model,
        tuple(torch.as_tensor(a) for a in example_inputs),
        path,
        dynamo=True,
        external_data=False,
        input_names=list(input_names),
        output_names=[output_name],
        dynamic_shapes=dynamic_shapes,
        verbose=False,
        optimize=True,
    )
    strip_stack_traces(path)


# Node metadata the exporter writes that records where the training code ran (absolute paths of
# this machine): nothing reads it, and a committed model must not carry it.
MACHINE_METADATA = ("pkg.torch.onnx.stack_trace",)


def strip_stack_traces(path):
    """Rewrites the ONNX file at `path` without [`MACHINE_METADATA`] on its nodes."""
    import onnx  # the exporter's own dependency

    model = onnx.load(path)
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            kept = [p for p in node.metadata_props if p.key not in MACHINE_METADATA]
            del node.metadata_props[:]
            node.metadata_props.extend(kept)
            graphs.extend(a.g for a in node.attribute if a.HasField("g"))
    onnx.save(model, path)


def onnx_session(path, threads=1):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def median_latency_us(session, feeds, runs=2000):
    for _ in range(100):
        session.run(None, feeds)
    timings = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feeds)
        timings.append(time.perf_counter() - start)
    timings.sort()
    return {"median_us": 1e6 * timings[len(timings) // 2], "p99_us": 1e6 * timings[int(len(timings) * 0.99)]}
