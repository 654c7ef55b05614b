"""The simulated stage's combining rule against its golden cases (stdlib).

training/tests/golden/combine.json holds cases of `gpucast_training.combine.combine` (inputs ->
figure, bound, far) that the service's rule (src/estimators/combine.rs) is checked against too:
a change to either side that the other does not make fails one of the two tests. After a
deliberate change of the rule on both sides, rewrite the file with

    cd training && python3 -m tests.test_combine --write

Run from the repository root:  python3 -m unittest discover -s training/tests -t training
"""

import ast
import json
import math
import os
import sys
import unittest

from gpucast_training import combine as cb

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


GOLDEN = os.path.join(REPO, "training", "tests", "golden", "combine.json")

# The figures the simulated stage serves (data/timm/simulated_figures.json): the typical
# distance, the residual log ratios at 0.95 (cnn and transformer corrections, the simulated
# figure) and at 0.5 (below 0: a bound under the figure).
TYPICAL = 1.528993221769941
Q95_CNN, Q95_TRANSFORMER, Q95_SIM = 0.10978161040269008, 0.0698063311867827, 0.14484173204555617
Q50_CNN, Q50_SIM = -0.0038318569791648827, 0.01459622542452621


def case(
    note,
    learned_mib,
    sim_mib,
    floor_mib,
    ratio,
    q_learned=Q95_CNN,
    q_sim=Q95_SIM,
    runs_on_card=True,
    capacity_mib=40960,
    measured_range=True,
):
    """One case's inputs; `ratio` None: outside the domain's setups (no distance)."""
    return {
        "note": note,
        "log_learned": math.log(learned_mib),
        "simulated_mib": sim_mib,
        "floor_mib": floor_mib,
        "distance": None if ratio is None else ratio * TYPICAL,
        "typical_distance": TYPICAL,
        "learned_log_ratio": q_learned,
        "simulated_log_ratio": q_sim,
        "runs_on_card": runs_on_card,
        "capacity_mib": capacity_mib,
        "measured_range": measured_range,
    }


CASES = [
    case("on a training point: the correction, its own bound", 12000.0, 11500.0, 6000.0, 0.0),
    case("within near", 12000.0, 11500.0, 6000.0, 0.5),
    case("at near: not widened yet", 12000.0, 11500.0, 6000.0, 1.0),
    case("between near and far: the correction's bound widened by the ratio", 12000.0, 11500.0, 6000.0, 1.5),
    case("at far: still the correction, widened", 12000.0, 11500.0, 6000.0, 2.0),
    case("just beyond far: the simulated figure, widened at most", 12000.0, 11500.0, 6000.0, 2.000001),
    case("far", 12000.0, 11500.0, 6000.0, 3.0),
    case("outside the setups (no distance): the simulated figure", 12000.0, 11500.0, 6000.0, None),
    case("transformer correction, widened", 20000.0, 19000.0, 9000.0, 1.2, q_learned=Q95_TRANSFORMER),
    case("far, simulated bound capped at the card where the step runs", 40000.0, 39000.0, 20000.0, 2.5),
    case(
        "far, the step does not run on the card: bound not capped", 70000.0, 60000.0, 30000.0, 2.5, runs_on_card=False
    ),
    case(
        "near but beyond the card the labels were measured on: the simulated figure",
        50000.0,
        48000.0,
        20000.0,
        0.3,
        runs_on_card=True,
        capacity_mib=81920,
        measured_range=False,
    ),
    case("near, the correction below the floor: the floor, bound from the correction", 5000.0, 6500.0, 7000.0, 0.4),
    case("far, the simulated figure below the floor: the floor", 5000.0, 6500.0, 7000.0, 4.0),
    case("near, the floor above the widened bound: bound = figure", 5000.0, 6500.0, 9000.0, 1.8),
    case(
        "a log ratio below 0 (low confidence): bound = figure",
        12000.0,
        11500.0,
        6000.0,
        0.2,
        q_learned=Q50_CNN,
        q_sim=Q50_SIM,
    ),
    case("far, a log ratio below 0: bound = figure", 12000.0, 11500.0, 6000.0, 2.5, q_learned=Q50_CNN, q_sim=-0.05),
    case("outside the setups on a 16 GB card, capped at it", 17000.0, 16000.0, 9000.0, None, capacity_mib=16376),
    case("outside the setups on an 80 GB card", 31000.0, 30000.0, 12000.0, None, capacity_mib=81920),
    case(
        "outside the setups, too large for a 16 GB card",
        25000.0,
        24000.0,
        15000.0,
        None,
        runs_on_card=False,
        capacity_mib=16384,
    ),
]


def answer(inputs):
    """`combine` on one case's inputs: (figure, bound, far)."""
    distance = math.inf if inputs["distance"] is None else inputs["distance"]
    return cb.combine(
        inputs["log_learned"],
        inputs["simulated_mib"],
        inputs["floor_mib"],
        distance,
        inputs["typical_distance"],
        inputs["learned_log_ratio"],
        inputs["simulated_log_ratio"],
        inputs["runs_on_card"],
        inputs["capacity_mib"],
        inputs["measured_range"],
    )


def golden():
    cases = []
    for inputs in CASES:
        figure, bound, far = answer(inputs)
        cases.append(
            {
                "inputs": inputs,
                "outputs": {"figure_mib": float(figure), "upper_bound_mib": float(bound), "far": bool(far)},
            }
        )
    return {
        "about": "Cases of the simulated stage's combining rule (training/gpucast_training/combine.py), "
        "which src/estimators/combine.rs must reproduce: far = ratio > far or not measured_range "
        "(ratio = distance / typical_distance, infinite for a null distance); widen = "
        "clamp(ratio / near, 1, max_widen); near the data the correction exp(log_learned) with the "
        "bound figure x exp(learned_log_ratio x widen); far, simulated_mib with the bound "
        "figure x exp(simulated_log_ratio x widen), capped at capacity_mib (not below the figure) "
        "when runs_on_card; then figure = max(figure, floor_mib) and bound = max(bound, figure). "
        "Written by cd training && python3 -m tests.test_combine --write.",
        "near": cb.NEAR,
        "far": cb.FAR,
        "max_widen": cb.MAX_WIDEN,
        "cases": cases,
    }


def close(a, b):
    return a == b or abs(a - b) <= 1e-12 * max(abs(a), abs(b))


class CombineTest(unittest.TestCase):
    def setUp(self):
        with open(GOLDEN) as f:
            self.golden = json.load(f)

    def test_the_thresholds_are_the_files(self):
        self.assertEqual(
            (self.golden["near"], self.golden["far"], self.golden["max_widen"]), (cb.NEAR, cb.FAR, cb.MAX_WIDEN)
        )

    def test_combine_reproduces_every_golden_case(self):
        self.assertEqual(len(self.golden["cases"]), len(CASES))
        for entry in self.golden["cases"]:
            with self.subTest(entry["inputs"]["note"]):
                figure, bound, far = answer(entry["inputs"])
                out = entry["outputs"]
                self.assertTrue(close(figure, out["figure_mib"]), (figure, out["figure_mib"]))
                self.assertTrue(close(bound, out["upper_bound_mib"]), (bound, out["upper_bound_mib"]))
                self.assertEqual(far, out["far"])

    def test_the_cases_cover_each_branch(self):
        outs = [entry["outputs"] for entry in self.golden["cases"]]
        inputs = [entry["inputs"] for entry in self.golden["cases"]]
        self.assertTrue(any(o["far"] for o in outs) and not all(o["far"] for o in outs))
        # The bound at the card, the figure at the floor, the bound at the figure, no distance.
        self.assertTrue(any(o["upper_bound_mib"] == i["capacity_mib"] for o, i in zip(outs, inputs)))
        self.assertTrue(any(o["figure_mib"] == i["floor_mib"] for o, i in zip(outs, inputs)))
        self.assertTrue(any(o["upper_bound_mib"] == o["figure_mib"] for o in outs))
        self.assertTrue(any(i["distance"] is None for i in inputs))

    def test_the_simulated_stage_scores_with_this_rule_and_defines_no_other(self):
        # Read, not imported: the stage needs numpy and torch, this suite runs on the stdlib.
        with open(os.path.join(REPO, "training", "gpucast_training", "simulated.py")) as f:
            tree = ast.parse(f.read())
        imported = {
            alias.name
            for node in tree.body
            if isinstance(node, ast.ImportFrom) and node.module == "combine" and node.level == 1
            for alias in node.names
        }
        self.assertLessEqual({"combine", "NEAR", "FAR", "MAX_WIDEN"}, imported)
        defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        assigned = {
            target.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in ast.walk(node)
            if isinstance(target, ast.Name) and isinstance(target.ctx, ast.Store)
        }
        self.assertNotIn("combine", defined)
        self.assertFalse({"NEAR", "FAR", "MAX_WIDEN"} & assigned)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
        with open(GOLDEN, "w") as f:
            json.dump(golden(), f, indent=1)
            f.write("\n")
        print("wrote %s (%d cases)" % (GOLDEN, len(CASES)))
    else:
        unittest.main()
