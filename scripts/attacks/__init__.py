"""The adversarial suite's attacks (scripts/adversarial.py runs them, scripts/hardening_report.py
writes what they measured): suite (the legitimate client, the samplers and the targets every
attack runs inside), connections (the HTTP front), calibration (the store), cli (the CLI)."""
