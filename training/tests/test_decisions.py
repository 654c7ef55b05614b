"""The decisions evaluation's own rules: the spread fit and the like-with-like figures (stdlib).

Run from the repository root:  python3 -m unittest discover -s training/tests
"""

import json
import math
import os
import sys
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "training"))

from gpucast_training import decisions  # noqa: E402


def answer(estimate, bound, known, context, uncertain, cache, parameters):
    return {
        "memory": {
            "estimate_mib": estimate,
            "upper_bound_mib": bound,
            "uncertainty": {"known_mib": known, "uncertain_mib": uncertain, "detail": "traced"},
            "breakdown": {
                "cuda_context": context,
                "paged_optimizer_state": 0.0,
                "allocator_cache": cache,
                "parameters": parameters,
            },
        }
    }


class SpreadFit(unittest.TestCase):
    def test_bias_is_the_median_and_the_95th_percentile_sits_at_the_bound(self):
        residuals = [i / 100 for i in range(-50, 51)]  # 101 values, median 0, q95 0.45
        spread = decisions.fit(residuals)
        self.assertEqual(spread["bias"], 0.0)
        self.assertAlmostEqual(spread["log_sd"] * decisions.Z95, 0.45, places=3)
        self.assertEqual(spread["rows"], 101)

    def test_a_spread_never_falls_below_the_minimum(self):
        self.assertEqual(decisions.fit([0.1] * 5)["log_sd"], decisions.MIN_LOG_SD)
        self.assertIsNone(decisions.fit([]))


class LikeWithLike(unittest.TestCase):
    def test_an_allocated_row_is_compared_without_context_and_cache(self):
        a = answer(10_000, 12_000, known=4_000, context=1_000, uncertain=5_000, cache=500, parameters=1_000)
        figure, bound, known, uncertain = decisions.like_with_like({"compare": "allocated"}, a)
        self.assertEqual((figure, bound, known, uncertain), (8_500, 10_500, 4_000, 4_500))
        figure, _, known, _ = decisions.like_with_like({"compare": "device"}, a)
        self.assertEqual((figure, known), (10_000, 5_000))
        figure, _, known, _ = decisions.like_with_like({"compare": "allocated_minus_weights"}, a)
        self.assertEqual((figure, known), (7_500, 3_000))

    def test_the_residual_is_the_log_ratio_of_the_uncertain_terms(self):
        a = answer(10_000, 12_000, known=4_000, context=1_000, uncertain=5_000, cache=0, parameters=1_000)
        row = {"compare": "device", "measured": 15_000}
        self.assertAlmostEqual(decisions.residual(row, a), math.log(10_000 / 5_000))


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


class CommittedSpreads(unittest.TestCase):
    def test_every_level_the_service_reads_is_committed(self):
        with open(os.path.join(REPO, "data", "uncertainty.json")) as f:
            committed = json.load(f)
        self.assertEqual(sorted(committed["levels"]), sorted(decisions.DETAILS))


if __name__ == "__main__":
    unittest.main()
