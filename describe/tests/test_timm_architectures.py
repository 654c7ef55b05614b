"""Every timm architecture describes and simulates: one model of each timm model-entrypoint
module (``timm.list_modules()``, 98 in timm 1.0.31), the one with the fewest parameters, as
``tests/timm_architectures.txt`` lists them (written by ``scripts/timm_architectures.py
select``, which states the timm version).

Each model goes through what ``python -m gpucast_describe timm:<name> --batch-size 2`` does
(layer walk, saved-tensor trace, two simulated fp32 Adam training steps at batch 2, all on
the meta device) and must come out with ``saved_tensors`` and ``simulation`` and with layer
params summing to the model's (``scripts/timm_architectures.py``'s ``check``, which the sweep
over every timm model, ``sweep --all``, uses too). The models of ``KNOWN_EXCEPTIONS`` must
still fail, so that a fix shows up as a test to update.

Runtime, measured on the 2-core development machine when idle (torch 2.15.0, timm 1.0.31):
this module's 3 tests (98 listed models and test_vit3) 74.7 and 75.0 s as unittest reports
it, 79.5 and 81.7 s of wall time with the imports; the whole describe suite, this module
included (219 tests), 160 s of wall time. ``sequencer2d_s`` alone takes 15 s of it (its
LSTMs' meta kernels are Python decompositions, run time step by time step, mostly in the
saved-tensor trace, which does not memoise meta kernels as the simulation does).
"""

import os
import unittest

import _paths

try:
    import timm
except ImportError:  # timm is an optional extra
    timm = None

LIST = os.path.join(_paths.TESTS_DIR, "timm_architectures.txt")
BATCH_SIZE = 2

# model -> why describe cannot walk or simulate it (each must still fail). None at present:
# the SigLIP ViTs' attention-pool head (timm AttentionPoolLatent, a view of a parameter as a
# module's input), which made cait and pit fail too, is fixed in the layer walk's FLOP counter.
KNOWN_EXCEPTIONS = {}

# Models beyond the list for code paths that failed before: model -> what it covers.
REGRESSIONS = {
    # 45 timm 1.0.31 models failed the layer walk with "Expected gradient function to be
    # set" (issue 23): SigLIP and other attention-pooled ViTs (vision_transformer, eva's PE
    # core, naflexvit), cait and pit; test_vit3 is timm's small ViT with that head.
    "test_vit3": "the attention-pool head of SigLIP (timm AttentionPoolLatent)",
}


def _script():
    from scripts import timm_architectures  # describe/scripts, from describe/ (the working directory)

    return timm_architectures


@unittest.skipIf(timm is None, "timm not installed")
class TimmArchitecturesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.script = _script()
        cls.pairs = cls.script.read_list()

    def test_the_list_has_one_model_of_every_timm_module(self):
        listed = [module for module, _ in self.pairs]
        self.assertEqual(len(listed), len(set(listed)), "a module listed twice")
        self.assertEqual(
            sorted(listed),
            sorted(timm.list_modules()),
            f"the list is not of this timm ({timm.__version__}): regenerate it "
            "with cd describe && python -m scripts.timm_architectures select",
        )
        for module, model in self.pairs:
            self.assertIn(model, timm.list_models(module=module), module)
        for model in KNOWN_EXCEPTIONS:
            self.assertIn(model, [m for _, m in self.pairs])

    def test_every_architecture_describes_and_simulates(self):
        for module, model in self.pairs:
            with self.subTest(module=module, model=model):
                reason = self.script.check(model, BATCH_SIZE)
                if model in KNOWN_EXCEPTIONS:
                    self.assertTrue(reason, f"{model} works now: take it out of KNOWN_EXCEPTIONS")
                else:
                    self.assertEqual(reason, "", f"timm:{model} ({module})")

    def test_regressions(self):
        for model, covers in REGRESSIONS.items():
            with self.subTest(model=model, covers=covers):
                self.assertEqual(self.script.check(model, BATCH_SIZE), "")


if __name__ == "__main__":
    unittest.main()
