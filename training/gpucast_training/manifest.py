"""models/manifest.json: how every stage writes its part.

Standard library only (converting an exported graph to its weights needs `onnx`, imported there).
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


# What evaluates an estimator in the service (each entry's `runtime`; the service loads a model
# on that runtime only and refuses to start when it cannot run there): its own evaluator of the
# aggregate MLP ensembles, reading their weight arrays (weights.py), or ONNX Runtime, reading the
# graph (the sequence classifiers).
IN_PROCESS = "in_process"
ONNXRUNTIME = "onnxruntime"
RUNTIMES = (IN_PROCESS, ONNXRUNTIME)


def with_weights(entry, graph_sha256, weights_file, weights_sha256):
    """`entry` (an in-process one whose `file` is its exported graph) loading `weights_file`
    instead, the graph kept as its `graph`; the keys in their usual order."""
    out = {}
    for key, value in entry.items():
        if key == "file":
            out["file"] = weights_file
        elif key == "sha256":
            out["sha256"] = weights_sha256
            out["graph"] = {"file": entry["file"], "sha256": graph_sha256}
        elif key != "graph":
            out[key] = value
    return out


def convert_in_process(models_dir, manifest, read_dir=None):
    """Writes the weights of every in-process entry whose file is still its exported graph into
    `models_dir` (graphs read from `read_dir`, default `models_dir`) and points the entry at
    them (in place). Needs `onnx` when there is a graph to convert."""
    from . import weights

    read_dir = read_dir or models_dir
    written = {}
    for i, entry in enumerate(manifest["estimators"]):
        if entry.get("runtime") != IN_PROCESS or not entry["file"].endswith(".onnx"):
            continue
        graph = entry["file"]
        if graph not in written:
            inputs = len(entry["input"]["features"]) if entry["input"]["type"] == "aggregate" else 0
            try:
                path = weights.write_from_graph(
                    os.path.join(read_dir, graph), inputs, os.path.join(models_dir, weights.weights_file_of(graph))
                )
            except ValueError as e:
                raise ValueError("estimator %s: %s; name runtime %s" % (entry["name"], e, ONNXRUNTIME)) from e
            written[graph] = (sha256_of(os.path.join(read_dir, graph)), os.path.basename(path), sha256_of(path))
        manifest["estimators"][i] = with_weights(entry, *written[graph])
    return manifest


def check_runtimes(models_dir, manifest):
    """Raises ValueError, naming the estimator, when an entry names no runtime or one the
    service does not know, or names `in_process` for a file that is not weights the evaluator
    reads, as wide as the entry's features."""
    from . import weights

    for entry in manifest["estimators"]:
        name, runtime = entry["name"], entry.get("runtime")
        if runtime not in RUNTIMES:
            raise ValueError("estimator %s: runtime %r is not one of %s" % (name, runtime, RUNTIMES))
        if runtime != IN_PROCESS:
            continue
        if entry["input"]["type"] != "aggregate":
            raise ValueError("estimator %s: the in-process evaluator reads aggregate input only" % name)
        if not entry["file"].endswith(weights.SUFFIX):
            raise ValueError(
                "estimator %s: in process, the file is weights (%s), not %s" % (name, weights.SUFFIX, entry["file"])
            )
        document = read_json(os.path.join(models_dir, entry["file"]))
        if (document.get("format"), document.get("version")) != (weights.FORMAT, weights.VERSION):
            raise ValueError(
                "estimator %s: %s is not %s version %d" % (name, entry["file"], weights.FORMAT, weights.VERSION)
            )
        if document.get("inputs") != len(entry["input"]["features"]):
            raise ValueError(
                "estimator %s: its weights read %s features, the entry lists %d"
                % (name, document.get("inputs"), len(entry["input"]["features"]))
            )


def write_manifest(path, manifest):
    """Writes the weights of the in-process estimators exported as graphs, checks every
    estimator's runtime against its file, stamps `generated_at` and writes the manifest."""
    convert_in_process(os.path.dirname(path), manifest)
    check_runtimes(os.path.dirname(path), manifest)
    manifest["generated_at"] = utc_now()
    write_json(path, manifest)


def graph_file(entry):
    """The ONNX graph of an estimator (onnxruntime scores it in training): its `graph` when
    it runs in process from weights, else its file."""
    return entry.get("graph", entry)["file"]


def estimators_by_name(manifest):
    return {entry["name"]: entry for entry in manifest["estimators"]}
