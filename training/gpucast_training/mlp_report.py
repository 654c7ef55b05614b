"""docs/reports/training-mlp.md's sections and its render from docs/reports/training-mlp.json
(stdlib only, so that `python -m gpucast_training mlp --from-data` needs no torch)."""

from . import pages

PAGE = ("docs", "reports", "training-mlp.md")
# Every section: the page is short; the JSON holds it as data too.
KEEP = {"Protocol": None, "Memory classifiers": None, "Utilization regressors": None, "ONNX": None}


def render(layout):
    """`mlp --from-data`: the page again from docs/reports/training-mlp.json."""
    print(pages.render(layout.out(*PAGE), KEEP, "mlp"))
