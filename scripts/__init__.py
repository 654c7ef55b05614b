"""The project's scripts. Run by hand as files (`python3 scripts/adversarial.py ...`), they import
the shared server harness from this folder (`harness`); the load test, a module run from the
repository root (`python3 -m load-tests.run`), imports it as `scripts.harness`."""
