"""Where the tests and describe's folder lie (the tests import gpucast_describe as installed, or
from describe/, the working directory `cd describe && python -m unittest discover -s tests` runs in,
and the toy models from the tests folder, which unittest's discovery puts on the path)."""

import os

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PACKAGE_ROOT = os.path.dirname(TESTS_DIR)
