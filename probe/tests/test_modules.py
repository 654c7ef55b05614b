import importlib
import unittest


class Modules(unittest.TestCase):
    def test_every_module_imports_without_torch_or_a_gpu(self):
        for name in ("budget", "cli", "generators", "post", "runner", "sampler", "schema", "train"):
            importlib.import_module(f"probe.gpucast_probe.{name}")

    def test_the_child_builds_every_family(self):
        from probe.gpucast_probe import train
        from probe.gpucast_probe.generators import FAMILIES

        with open(train.__file__) as f:
            source = f.read()
        for family in FAMILIES:
            self.assertIn(f'spec.family == "{family}"', source, family)


if __name__ == "__main__":
    unittest.main()
