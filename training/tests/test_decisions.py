"""The decisions evaluation's own rules: the conformal quantiles, the audit and the like-with-like
figures (stdlib).

Run from the repository root:  python3 -m unittest discover -s training/tests -t training
"""

import json
import math
import os
import unittest

from gpucast_training import decisions

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def answer(estimate, bound, known, context, uncertain, cache, parameters):
    return {
        "family": "transformer",
        "memory": {
            "estimate_mib": estimate,
            "upper_bound_mib": bound,
            "uncertainty": {
                "known_mib": known,
                "cuda_context_mib": context,
                "uncertain_mib": uncertain,
                "detail": "traced",
                "setup_family": "lora",
            },
            "breakdown": {
                "cuda_context": context,
                "paged_optimizer_state": 0.0,
                "allocator_cache": cache,
                "parameters": parameters,
            },
        },
    }


class ConformalQuantiles(unittest.TestCase):
    def test_the_quantile_at_c_is_the_score_at_rank_n_plus_one_times_c(self):
        scores = [float(i) for i in range(1, 20)]  # 19 scores: rank 20 x 0.95 = 19, the largest
        q = decisions.conformal(scores)
        self.assertEqual(q[95], 19.0)
        self.assertEqual(q[50], 10.0)  # rank 10
        # Fewer rows than the confidence asks for: beyond the largest score, not at it.
        self.assertGreater(decisions.conformal([float(i) for i in range(10)])[95], 9.0)

    def test_a_new_score_from_the_same_distribution_lies_above_the_bound_1_minus_c_of_the_time(self):
        import random

        rng = random.Random(7)
        # 120 rows: enough for rank (n + 1) c <= n at every confidence of the curve (the service
        # reads a group at c only with n >= c / (1 - c) rows).
        for c in decisions.CURVE:
            above, trials = 0, 4000
            for _ in range(trials):
                scores = [rng.gauss(0, 1) for _ in range(120)]
                bound = decisions.conformal(scores)[round(c * 100)]
                above += rng.gauss(0, 1) > bound
            self.assertLess(abs(above / trials - (1 - c)), 3 * math.sqrt(c * (1 - c) / trials) + 0.004, c)

    def test_the_quantiles_never_decrease(self):
        q = decisions.conformal([0.3, -0.2, 0.1, 0.1, 0.9])
        self.assertEqual(q, sorted(q))
        self.assertEqual(len(q), len(decisions.LEVELS))


class Audit(unittest.TestCase):
    def row(self, id_, measured, **extra):
        return dict(
            {
                "id": id_,
                "measured": measured,
                "compare": "device",
                "capacity": None,
                "card": "a100",
                "request": {"n": id_},
            },
            **extra,
        )

    def test_each_rule_keeps_its_rows_out(self):
        a = answer(10_000, 12_000, known=4_000, context=1_000, uncertain=5_000, cache=0, parameters=1_000)
        a["fit"] = {"capacity_mib": 20_000}
        pairs = [
            (self.row("state", 3_000), a),
            (self.row("card", 25_000), a),
            (self.row("low", 9_000, confidence="CONFIDENCE=LOW"), a),
            (self.row("eval", 9_000, unmodelled=["evaluation phase inside the peak"]), a),
            (self.row("kept", 9_000, confidence="CONFIDENCE=HIGH"), a),
            (dict(self.row("twin1", 8_000), request={"same": 1}), a),
            (dict(self.row("twin2", 16_000), request={"same": 1}), a),
        ]
        self.assertEqual(
            decisions.audit(pairs),
            {
                "state": "below_state",
                "card": "above_card",
                "low": "approximate",
                "eval": "outside_step",
                "twin1": "readings_disagree",
                "twin2": "readings_disagree",
            },
        )
        calibration = decisions.calibration(pairs, decisions.audit(pairs))
        self.assertEqual(calibration["groups"]["all"]["rows"], 1)


class LikeWithLike(unittest.TestCase):
    def test_an_allocated_row_is_compared_without_context_and_cache(self):
        a = answer(10_000, 12_000, known=4_000, context=1_000, uncertain=5_000, cache=500, parameters=1_000)
        figure, bound, known, uncertain = decisions.like_with_like({"compare": "allocated"}, a)
        self.assertEqual((figure, bound, known, uncertain), (8_500, 10_500, 4_000, 4_500))
        figure, _, known, _ = decisions.like_with_like({"compare": "device"}, a)
        self.assertEqual((figure, known), (10_000, 5_000))
        figure, _, known, _ = decisions.like_with_like({"compare": "allocated_minus_weights"}, a)
        self.assertEqual((figure, known), (7_500, 3_000))

    def test_the_score_is_the_log_ratio_of_the_whole_figure_on_the_devices_scale(self):
        a = answer(10_000, 12_000, known=4_000, context=1_000, uncertain=5_000, cache=500, parameters=1_000)
        row = {"compare": "device", "measured": 15_000}
        self.assertAlmostEqual(decisions.score(row, a), math.log(15_000 / 10_000) / decisions.share(a))
        # An allocated reading is put back on the device's scale with the answer's own context
        # and cache: 8,500 allocated of a 10,000 MiB figure is the figure exactly.
        self.assertAlmostEqual(decisions.score({"compare": "allocated", "measured": 8_500}, a), 0.0)


class Normalizer(unittest.TestCase):
    def test_the_unstated_fields_range_widens_the_normalizer_by_its_weight(self):
        a = answer(10_000, 12_000, known=4_000, context=1_000, uncertain=5_000, cache=0, parameters=1_000)
        a["memory"]["uncertainty"]["assumed_log_range"] = 0.5
        saved = decisions.ASSUMED_WEIGHT
        try:
            decisions.ASSUMED_WEIGHT = 0.0
            self.assertAlmostEqual(decisions.normalizer(a), decisions.share(a))
            decisions.ASSUMED_WEIGHT = 2.0
            self.assertAlmostEqual(decisions.normalizer(a), decisions.share(a) * 2.0)
        finally:
            decisions.ASSUMED_WEIGHT = saved


class PerfectFigure(unittest.TestCase):
    def test_a_run_is_refused_once_the_bound_passes_its_headroom(self):
        pairs = []
        for measured in (9_000, 5_000):  # 90 % and 50 % of a 10,000 MiB card
            a = answer(measured, measured, known=0, context=0, uncertain=measured, cache=0, parameters=0)
            a["fit"] = {"capacity_mib": 10_000}
            pairs.append(({"compare": "device", "measured": measured, "status": "ran", "kind": "llm"}, a))
        row = decisions.perfect_figure(pairs).splitlines()[2]
        # rows, above 80 %, then refused at 1.00, 1.05, 1.10, 1.15, 1.25x
        self.assertEqual(row, "| llm | 2 | 50.0 % | 0.0 % | 0.0 % | 0.0 % | 50.0 % | 50.0 % |")


class CommittedQuantiles(unittest.TestCase):
    def test_the_committed_file_has_every_level_and_the_all_group(self):
        with open(os.path.join(REPO, "data", "uncertainty.json")) as f:
            committed = json.load(f)
        self.assertEqual(committed["levels"], decisions.LEVELS)
        self.assertIn("all", committed["groups"])
        for group in committed["groups"].values():
            self.assertEqual(len(group["scores"]), len(decisions.LEVELS))
            self.assertGreaterEqual(group["rows"], min(decisions.MIN_ROWS, group["rows"]))


if __name__ == "__main__":
    unittest.main()
