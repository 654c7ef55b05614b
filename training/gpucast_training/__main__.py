"""python -m gpucast_training STAGE [options]   (from training/, or anywhere in .venv-describe, where it is installed)

Stages, in the order `all` runs them (each after the ones before it; every feature they learn
from is the built gpucast's: `gpucast features --batch`, gpucast_training/service.py):

  mlp        MLP classifiers and utilization regressors; the base manifest
  timm       timm (cnn / transformer) estimators and the MLP memory regressor
  simulated  the simulated-step regressor, its domain and the `simulated` manifest block
  evaluate   docs/reports/training-real.md from the timm stage's predictions (stdlib only)

and, outside `all` (slow, needs describe/ and transformers):

  weights    models/*.weights.json: the in-process estimators' weight arrays, written from their
             exported graphs, and the manifest pointed at them (no retraining; needs onnx; the
             stages above do it when they write the manifest)
  public-rows  data/public/jobs.jsonl.gz from public_training_memory.csv
  public-setups  data/public/setup_jobs.jsonl.gz: every row whose training setup docs/user/setups.md
               can express, with DeepSpeed's and accelerate's baselines (those two packages are
               needed for it only); --simulate asks describe to simulate each row's setup
  public-offload  data/public/offload_jobs.jsonl.gz: the rows left out for CPU offload alone,
             as jobs from their configs (stdlib only)
  decisions  data/uncertainty.json (the spreads of the uncertain terms) and docs/reports/accuracy.md:
             figures, bounds and fit decisions of `gpucast estimate --batch` on the measured
             rows, leave one source or family out (stdlib only; needs a built gpucast)
  setup-simulations  docs/reports/setup-simulations.md: the training setups of config-path jobs
             (modules_to_save, reward heads, reference models, loss implementations) against
             describe's simulation of the same jobs, figures and deltas (stdlib here; describe
             runs in .venv-describe; needs target/release/gpucast)
  stacks     docs/reports/stack-learning.md: leave one framework out of the published runs,
             post k = 0, 1, 3, 5 of its runs to a running service as observations of one
             environment and ask its other runs there (stdlib only; needs a built gpucast)

Data and output paths: see gpucast_training/data.py (--data-dir / $GPUCAST_DATA_DIR, default
<repository root>/../shared/data; --out-dir / $GPUCAST_OUT_DIR, default the repository root).
"""

import argparse
import importlib

from .data import Layout

STAGES = {
    "mlp": "mlp",
    "timm": "timm",
    "simulated": "simulated",
    "evaluate": "evaluate",
    "weights": "weights",
    "public-rows": "public_rows",
    "public-setups": "public_setups",
    "perf-data": "perf_data",
    "public-offload": "public_offload",
    "decisions": "decisions",
    "setup-simulations": "setup_simulations",
    "stacks": "stacks",
}
ALL = ["mlp", "timm", "simulated", "evaluate"]
# --from-data: the stages that write a report page, and the module that renders it again from
# its data (stdlib only: a module of its own where the stage's imports torch).
RENDERERS = {
    "mlp": "mlp_report",
    "simulated": "simulated_report",
    "evaluate": "evaluate",
    "decisions": "decisions",
    "setup-simulations": "setup_simulations",
    "stacks": "stacks",
}


def parser():
    p = argparse.ArgumentParser(
        prog="python -m gpucast_training",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("stage", choices=list(STAGES) + ["all"])
    p.add_argument("--data-dir", help="measured data (default $GPUCAST_DATA_DIR, else <repo>/../shared/data)")
    p.add_argument(
        "--out-dir", help="where outputs go, at the repository's paths (default $GPUCAST_OUT_DIR, else the repository)"
    )
    p.add_argument("--mlp-csv", help="default $GPUCAST_MLP_CSV, else <data dir>/gpumemnet_mlp_a100.csv")
    p.add_argument("--timm-csv", help="default $GPUCAST_TIMM_CSV, else <data dir>/timm_a100_train.csv")
    p.add_argument("--public-csv", help="default $GPUCAST_PUBLIC_CSV, else <data dir>/public_training_memory.csv")
    p.add_argument("--simulations", help="default data/timm/simulations.jsonl.gz")
    p.add_argument(
        "--observations",
        help="JSON Lines of the service's stored observations (gpucast observations "
        "export): their rows whose job parses join the timm stage's training part",
    )
    p.add_argument("--threads", type=int, help="torch threads (default: the stage's own, 1 or 2)")
    p.add_argument(
        "--from-data",
        action="store_true",
        help="decisions, evaluate, mlp, setup-simulations, simulated, stacks: render the report page "
        "again from its committed data (docs/reports/NAME.json) without running the stage",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="public-setups: describe simulates each row's training setup (off by default)",
    )
    return p


def main(argv=None):
    args = parser().parse_args(argv)
    layout = Layout(
        data_dir=args.data_dir,
        out_dir=args.out_dir,
        mlp_csv=args.mlp_csv,
        timm_csv=args.timm_csv,
        public_csv=args.public_csv,
        simulations=args.simulations,
        observations=args.observations,
    )
    stages = ALL if args.stage == "all" else [args.stage]
    if args.from_data and args.stage == "all":
        stages = [stage for stage in ALL if stage in RENDERERS]
    for stage in stages:
        if args.from_data:
            if stage not in RENDERERS:
                parser().error(f"{stage} writes no report page to render")
            importlib.import_module("." + RENDERERS[stage], __package__).render(layout)
            continue
        module = importlib.import_module("." + STAGES[stage], __package__)
        if args.simulate:
            if stage != "public-setups":
                parser().error("--simulate is public-setups' option")
            module.run(layout, args.threads, simulate=True)
        else:
            module.run(layout, args.threads)


if __name__ == "__main__":
    main()
