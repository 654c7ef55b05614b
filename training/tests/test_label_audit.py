"""label_audit on readings taken from timm_a100_train.csv (stdlib only).

Run from the repository root:  python3 -m unittest discover -s training/tests -t training
"""

import unittest


from gpucast_training import label_audit as la


def rows(model, readings):
    """readings: batch -> (status, peak)."""
    return [(model, batch, status, peak) for batch, (status, peak) in sorted(readings.items())]


class LabelAuditTest(unittest.TestCase):
    def test_a_normal_series_is_trusted(self):
        resnet50 = rows(
            "resnet50", {8: ("ok", 2875), 16: ("ok", 3733), 32: ("ok", 5229), 64: ("ok", 8465), 128: ("ok", 15169)}
        )
        self.assertEqual(la.failed_ok(resnet50), [False] * 5)

    def test_stuck_and_jumping_readings_are_failed_runs(self):
        siglip = rows(
            "vit_base_patch16_siglip_224",
            {8: ("ok", 2117), 16: ("ok", 2281), 32: ("ok", 2281), 64: ("ok", 2281), 128: ("ok", 2281)},
        )
        self.assertEqual(la.failed_ok(siglip), [False, True, True, True, True])
        resnetaa50d = rows("resnetaa50d", {16: ("ok", 4489), 32: ("ok", 38835), 64: ("oom", 10151)})
        self.assertEqual(la.failed_ok(resnetaa50d), [False, True, False])

    def test_an_oom_that_the_models_own_readings_say_fits_is_a_crash(self):
        betwixt = rows(
            "vit_betwixt_patch32_clip_224",
            {8: ("ok", 1969), 16: ("ok", 2391), 32: ("oom", 1969), 64: ("oom", 1969), 128: ("oom", 1969)},
        )
        self.assertEqual(la.fitting_oom(betwixt), [False, False, True, True, True])
        self.assertEqual(la.credible_oom(betwixt), [False] * 5)
        # resnetaa50d: one trusted reading, 4,489 MiB at 16, bounds batch 64 by 4 x 4,489 MiB.
        resnetaa50d = rows("resnetaa50d", {16: ("ok", 4489), 32: ("ok", 38835), 64: ("oom", 10151)})
        self.assertEqual(la.fitting_oom(resnetaa50d), [False, False, True])

    def test_an_oom_reading_near_the_capacity_is_credible_for_larger_batches_too(self):
        evos = rows(
            "regnetz_d8_evos",
            {8: ("ok", 6847), 16: ("ok", 11571), 32: ("ok", 21361), 64: ("oom", 40191), 128: ("oom", 2925)},
        )
        self.assertEqual(la.credible_oom(evos), [False, False, False, True, True])
        self.assertEqual(la.fitting_oom(evos), [False] * 5)


if __name__ == "__main__":
    unittest.main()
