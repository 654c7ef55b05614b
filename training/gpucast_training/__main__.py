"""python -m gpucast_training STAGE [stage options]"""

import importlib
import sys

STAGES = {"mlp": "mlp", "timm": "timm", "simulated": "simulated", "golden": "golden",
          "evaluate": "evaluate", "public-rows": "public_rows"}
ALL = ["mlp", "timm", "simulated", "golden", "evaluate"]


def main(argv):
    if not argv or argv[0] not in list(STAGES) + ["all"]:
        sys.exit("usage: python -m gpucast_training {%s} [options]" % "|".join(list(STAGES) + ["all"]))
    stages = ALL if argv[0] == "all" else [argv[0]]
    for stage in stages:
        module = importlib.import_module("." + STAGES[stage], __package__)
        sys.argv = ["gpucast_training " + stage] + argv[1:]
        module.main()


if __name__ == "__main__":
    main(sys.argv[1:])
