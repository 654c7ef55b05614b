#!/usr/bin/env bash
# Retrain every estimator and rewrite models/, data/mlp/, data/timm/ (derived files),
# models/manifest.json, docs/reports/training-mlp.md,
# docs/reports/training-real.md and docs/reports/training-simulated.md: the stages of the training
# package, `python -m gpucast_training STAGE` (training/gpucast_training/__main__.py).
#
#   training/retrain.sh                      # .venv-describe with the workspace's `retrain` group
#   PYTHON=/path/to/python training/retrain.sh   # an interpreter with gpucast-training[retrain] instead
#   GPUCAST_DATA_DIR=/path/to/data training/retrain.sh   # measured data (default ../shared/data)
#   GPUCAST_MLP_CSV=/path/to/gpumemnet_mlp_a100.csv GPUCAST_TIMM_CSV=/path/to/timm_a100_train.csv training/retrain.sh
#   training/retrain.sh --out-dir /tmp/retrained # write the outputs there (same layout) instead
#
# Options (--data-dir, --out-dir, --mlp-csv, --timm-csv, --threads, ...) go to every stage.
# Every feature the stages learn from is the built gpucast's (`gpucast features --batch`): build
# it first (cargo build --release), or name one with GPUCAST_BINARY.
set -euo pipefail
cd "$(dirname "$0")/.."

# describe's venv holds torch and the workspace's packages (editable); the `retrain` group of the
# workspace lock (uv.lock) adds onnx, onnxscript, onnxruntime and scikit-learn to it.
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON="$(scripts/describe-venv.sh --group retrain)"
fi

# 1. MLP classifiers and utilization regressors; writes the base manifest.
"$PYTHON" -m gpucast_training mlp "$@"
# 2. Real-model (timm cnn / transformer) estimators and the MLP memory regressor; merges their
#    entries into models/manifest.json.
"$PYTHON" -m gpucast_training timm "$@"
# 2a. The simulated-step regressor (physics first: simulated reserved peak + context, a capped
#     learned correction near the timm data), its extrapolation domain, the `simulated` block,
#     and the evaluation on CV, held-out families and the public rows (docs/reports/training-simulated.md).
#     Needs the committed simulations: describe/scripts/simulate_timm_training_set.py and
#     `python -m gpucast_training public-rows` make them again (~40 min and ~5 min on two cores).
"$PYTHON" -m gpucast_training simulated "$@"
# 3. Grouped-CV comparison with FakeTensor, Horus, first principles and GPUMemNet.
"$PYTHON" -m gpucast_training evaluate "$@" > /dev/null
# The training tests are stdlib-only; run them with the pipeline's interpreter as a final check.
"$PYTHON" -m unittest discover -s training/tests -t training
