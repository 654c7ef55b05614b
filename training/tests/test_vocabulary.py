"""training's layer kinds against the service's vocabulary (openapi/layer_kinds.json, the
output of `gpucast layer-kinds`): the sequence models' vocabularies are the service's kinds."""

import json
import os
import unittest

from gpucast_training import features as gf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class VocabularyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(os.path.join(ROOT, "openapi", "layer_kinds.json")) as handle:
            cls.vocabulary = json.load(handle)

    def test_all_kinds_are_the_services_in_its_order(self):
        self.assertEqual(gf.ALL_KINDS, self.vocabulary["kinds"])

    def test_the_mlp_vocabulary_is_made_of_service_kinds(self):
        self.assertTrue(set(gf.CANONICAL_KINDS) <= set(self.vocabulary["kinds"]))


if __name__ == "__main__":
    unittest.main()
