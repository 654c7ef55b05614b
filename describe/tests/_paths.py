"""Make the package and the toy models importable when the package is not installed."""

import os
import sys

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
PACKAGE_ROOT = os.path.dirname(TESTS_DIR)

for path in (PACKAGE_ROOT, TESTS_DIR):
    if path not in sys.path:
        sys.path.insert(0, path)
