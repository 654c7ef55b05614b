"""describe's layer kinds against the service's vocabulary (openapi/layer_kinds.json, the output
of `gpucast layer-kinds`): a kind describe emits that the service does not know would be a 422.
Its setup names are the service's own (gpucast_describe/vocabulary.json, `gpucast vocabulary`):
each optimizer there must have describe's physics."""

import json
import os
import unittest

import _paths

import torch

from gpucast_describe.kinds import CANONICAL_KINDS, CONV_KINDS, KIND_BY_CLASS_NAME
from gpucast_describe.simulate import make_optimizer
from gpucast_describe.vocabulary import VOCABULARY as SETUP_VOCABULARY

VOCABULARY = os.path.join(_paths.PACKAGE_ROOT, os.pardir, "openapi", "layer_kinds.json")


def normalised(name):
    return "".join(c for c in name if c not in "_- ").lower()


class VocabularyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(VOCABULARY) as handle:
            cls.vocabulary = json.load(handle)

    def test_the_canonical_kinds_are_the_services_in_its_order(self):
        self.assertEqual(list(CANONICAL_KINDS), self.vocabulary["kinds"])

    def test_the_convolutions_are_the_services(self):
        self.assertEqual(set(CONV_KINDS), set(self.vocabulary["groups"]["convolution"]))

    def test_every_class_maps_to_a_service_kind_and_agrees_with_the_services_alias(self):
        aliases, exceptions = self.vocabulary["aliases"], self.vocabulary["class_exceptions"]
        for class_name, kind in KIND_BY_CLASS_NAME.items():
            self.assertIn(kind, self.vocabulary["kinds"], class_name)
            # Where the service reads the class name itself (a pasted summary), it must agree.
            service = exceptions.get(class_name) or aliases.get(normalised(class_name))
            if service is not None:
                self.assertEqual(service, kind, class_name)


class SetupVocabularyTest(unittest.TestCase):
    def test_every_optimizer_the_service_names_is_simulated(self):
        params = [torch.nn.Parameter(torch.zeros(4, 4, device="meta"))]
        for name in SETUP_VOCABULARY["optimizer"]:
            self.assertIsInstance(make_optimizer(name, params), torch.optim.Optimizer, name)


if __name__ == "__main__":
    unittest.main()
