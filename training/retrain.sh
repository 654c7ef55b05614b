#!/usr/bin/env bash
# Retrain every estimator and rewrite models/, data/mlp/, tests/fixtures/golden_features.json,
# models/manifest.json and training/report.md.
#
#   training/retrain.sh                      # venv at .venv from training/requirements.txt
#   PYTHON=/path/to/python training/retrain.sh   # use an existing interpreter instead
#   GPUCAST_MLP_CSV=/path/to/gpumemnet_mlp_a100.csv training/retrain.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
    VENV="${GPUCAST_VENV:-.venv}"
    if [[ ! -x "$VENV/bin/python" ]]; then
        python3 -m venv "$VENV"
        "$VENV/bin/pip" install --quiet -r training/requirements.txt
    fi
    PYTHON="$VENV/bin/python"
fi

"$PYTHON" training/pipeline.py "$@"
# The feature tests are stdlib-only; run them with the pipeline's interpreter as a final check.
"$PYTHON" -m unittest discover -s training/tests
