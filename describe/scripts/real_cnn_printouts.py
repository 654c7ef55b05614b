"""Real CNNs as people print them, answered by gpucast and held against the A100 campaign's
measured peak of the same architecture (issue 33: "torchsummary printouts of real CNNs").

Prints torchvision's and timm's CNNs with `torchsummary.summary(model, input, batch_size=B)`
(the shapes then lead with B, as GPUMemNet's inputs do) at batches 32, 64 and 128, sends each
printout as `{"summary": {"text": ...}, "batch_size": B, "optimizer": "adam"}` through
`gpucast estimate --batch`, and compares the figure with `measured_peak_mib` of
../shared/data/timm_a100_train.csv for the timm model of the same architecture (`ok` rows).
Not a held-out figure for every row: most of these timm models are in the campaign the learned
estimators were fitted on; the torchvision printouts differ from timm's in their layers' names
and modules, not in the architecture.

    pip install torchsummary==1.5.1   # beside describe's pinned torch, torchvision and timm
    python describe/scripts/real_cnn_printouts.py target/release/gpucast [--data ../shared/data]

Prints one line per printout and the median |error| over the rows with a measured peak.
"""

import argparse
import contextlib
import csv
import io
import json
import os
import statistics
import subprocess

import timm
import torch
import torchvision
from torchsummary import summary

# (the campaign's timm name, the printed model)
MODELS = [
    ("vgg11", "torchvision:vgg11"),
    ("vgg16", "torchvision:vgg16"),
    ("vgg16", "timm:vgg16"),
    ("vgg16_bn", "torchvision:vgg16_bn"),
    ("resnet18", "torchvision:resnet18"),
    ("resnet34", "torchvision:resnet34"),
    ("resnet50", "torchvision:resnet50"),
    ("resnet50", "timm:resnet50"),
    ("resnet152", "torchvision:resnet152"),
    ("efficientnet_b0", "torchvision:efficientnet_b0"),
    ("efficientnet_b0", "timm:efficientnet_b0"),
    ("inception_v3", "torchvision:inception_v3"),
    ("mobilenetv2_100", "torchvision:mobilenet_v2"),
    ("mobilenetv3_large_100", "torchvision:mobilenet_v3_large"),
    ("legacy_xception", "timm:legacy_xception"),
    ("convnext_tiny", "torchvision:convnext_tiny"),
]
BATCHES = (32, 64, 128)


def build(source):
    library, name = source.split(":")
    if library == "timm":
        model = timm.create_model(name)
        return model, tuple(model.pretrained_cfg.get("input_size", (3, 224, 224)))
    kwargs = {"aux_logits": False, "init_weights": False} if name == "inception_v3" else {}
    size = (3, 299, 299) if name == "inception_v3" else (3, 224, 224)
    return getattr(torchvision.models, name)(**kwargs), size


def printouts():
    torch.set_num_threads(2)
    rows = []
    for measured_as, source in MODELS:
        model, size = build(source)
        for batch in BATCHES:
            text = io.StringIO()
            with contextlib.redirect_stdout(text), torch.no_grad():
                summary(model.eval(), size, batch_size=batch, device="cpu")
            rows.append({"measured_as": measured_as, "model": source, "batch_size": batch, "text": text.getvalue()})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("binary")
    parser.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data"))
    options = parser.parse_args()
    with open(os.path.join(options.data, "timm_a100_train.csv")) as f:
        measured = {(r["model"], int(r["batch_size"])): r for r in csv.DictReader(f)}
    rows = printouts()
    jobs = [{"batch_size": r["batch_size"], "optimizer": "adam", "summary": {"text": r["text"]}} for r in rows]
    done = subprocess.run(
        [options.binary, "estimate", "--batch", "-"], input=json.dumps(jobs), capture_output=True, text=True, check=True
    )
    errors = []
    for row, item in zip(rows, json.loads(done.stdout)["items"]):
        memory = item["estimate"]["memory"]
        reading = measured.get((row["measured_as"], row["batch_size"]))
        ok = reading is not None and reading["status"] == "ok"
        error = (memory["estimate_mib"] / float(reading["measured_peak_mib"]) - 1) if ok else None
        if error is not None:
            errors.append(abs(error))
        shown = f"{100 * error:+.1f} %" if error is not None else "no ok reading"
        print(
            f"{row['model']:<32} b{row['batch_size']:<4} estimate {memory['estimate_mib']:>8.0f} "
            f"bound {memory['upper_bound_mib']:>8.0f} measured {reading['measured_peak_mib'] if reading else '-':>6} {shown}"
        )
    print(json.dumps({"rows": len(errors), "median_abs_error": round(statistics.median(errors), 4)}))


if __name__ == "__main__":
    main()
