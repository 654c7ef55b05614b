"""gpucast_probe.campaign: the job plan, the family runner against stand-in children (no torch), and
the whole dry run on the CPU where an interpreter with torch is at hand."""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest
from pathlib import Path

from probe.gpucast_probe import campaign

REPO = Path(__file__).resolve().parents[2]

# A stand-in child: per job id, "crash" dies after announcing it, "hang" never ends, "slow"
# takes 0.3 s, others finish at once.
FAKE_CHILD = textwrap.dedent("""
    import json, os, sys, time
    jobs = json.load(open(sys.argv[1]))
    out = open(sys.argv[2], "a")
    def emit(r):
        out.write(json.dumps(r) + "\\n"); out.flush()
    emit({"environment": {"gpu_name": "Fake GPU", "driver": "1.0"}})
    for job in jobs:
        emit({"start": job["id"]})
        if "crash" in job["id"]:
            os._exit(3)
        if "hang" in job["id"]:
            time.sleep(60)
        if "slow" in job["id"]:
            time.sleep(0.3)
        emit({"done": {"id": job["id"], "status": "ok"}})
""")


def torch_python():
    """An interpreter with torch (describe's venv, or GPUCAST_DESCRIBE_PYTHON), or None."""
    for candidate in (os.environ.get("GPUCAST_DESCRIBE_PYTHON"), str(REPO / ".venv-describe" / "bin" / "python")):
        if candidate and os.path.exists(candidate):
            probe = subprocess.run([candidate, "-c", "import torch, torchvision"], capture_output=True)
            if probe.returncode == 0:
                return candidate
    return None


class Plan(unittest.TestCase):
    def test_at_least_100_jobs_across_families_batches_and_precisions(self):
        jobs = campaign.plan()
        self.assertGreaterEqual(len(jobs), 100)
        self.assertEqual(len({j["id"] for j in jobs}), len(jobs), "ids are unique")
        self.assertEqual({j["family"] for j in jobs}, {"mlp", "cnn", "vit", "nlp"})
        self.assertEqual({j["precision"] for j in jobs}, {"fp32", "amp_bf16"})
        for model in {j["model"] for j in jobs}:
            self.assertGreaterEqual(len({j["batch_size"] for j in jobs if j["model"] == model}), 3, model)
        models = {j["model"] for j in jobs}
        for wanted in (
            "hf:gpt2_small",
            "hf:bert_base_mlm",
            "hf:llama_small",
            "torchvision:resnet50",
            "timm:vit_base_patch16_224",
            "timm:convnext_tiny",
            "torchvision:mobilenet_v3_large",
        ):
            self.assertIn(wanted, models)

    def test_families_run_in_order_each_model_at_its_smallest_batch_first(self):
        jobs = campaign.plan()
        families = [j["family"] for j in jobs]
        self.assertEqual(families, sorted(families, key=campaign.FAMILIES.index))
        cnn = [j for j in jobs if j["family"] == "cnn"]
        first_models = {j["model"] for j in cnn[: 2 * len({j["model"] for j in cnn})]}
        self.assertEqual(first_models, {j["model"] for j in cnn})

    def test_the_dry_run_shrinks_shapes_but_keeps_ids(self):
        full, dry = campaign.plan(), campaign.plan(dry_run=True)
        self.assertEqual([j["id"] for j in full], [j["id"] for j in dry])
        self.assertTrue(all(j["batch_size"] == 2 for j in dry))
        gpt2 = next(j for j in dry if j["model"] == "hf:gpt2_small")
        self.assertEqual(gpt2["input_shape"], [32])
        vit = next(j for j in dry if j["family"] == "vit")
        self.assertEqual(vit["input_shape"], [3, 224, 224])

    def test_selection(self):
        jobs = campaign.select(campaign.plan(), "mlp,nlp", "b64,gpt2", None)
        self.assertTrue(jobs)
        self.assertTrue(all(j["family"] in ("mlp", "nlp") for j in jobs))
        self.assertEqual(len(campaign.select(campaign.plan(), None, None, 5)), 5)


class FamilyRunner(unittest.TestCase):
    def run_family(self, ids, job_seconds=5.0, deadline_in=30.0):
        records, environments = [], []
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "child.py")
            with open(script, "w") as f:
                f.write(FAKE_CHILD)
            campaign.run_family(
                [{"id": i} for i in ids],
                lambda jobs, result: [sys.executable, script, jobs, result],
                deadline=time.monotonic() + deadline_in,
                job_seconds=job_seconds,
                startup_seconds=0.0,
                on_record=records.append,
                on_environment=environments.append,
                poll=0.02,
            )
        return records, environments

    def test_every_job_gets_a_record_in_order(self):
        records, environments = self.run_family(["a", "b", "c"])
        self.assertEqual([(r["id"], r["status"]) for r in records], [("a", "ok"), ("b", "ok"), ("c", "ok")])
        self.assertEqual(environments, [{"gpu_name": "Fake GPU", "driver": "1.0"}])

    def test_a_crash_costs_only_the_job_it_happened_in(self):
        records, environments = self.run_family(["a", "b-crash", "c", "d"])
        self.assertEqual(
            [(r["id"], r["status"]) for r in records], [("a", "ok"), ("b-crash", "crashed"), ("c", "ok"), ("d", "ok")]
        )
        self.assertEqual(records[1]["exit_code"], 3)
        self.assertEqual(len(environments), 2, "a new child for the rest")

    def test_a_job_past_its_allowance_is_killed_and_recorded_as_timeout(self):
        started = time.monotonic()
        records, _ = self.run_family(["a", "b-hang", "c"], job_seconds=0.5)
        self.assertLess(time.monotonic() - started, 15)
        self.assertEqual([(r["id"], r["status"]) for r in records], [("a", "ok"), ("b-hang", "timeout"), ("c", "ok")])

    def test_nothing_starts_after_the_deadline(self):
        records, _ = self.run_family(["a-slow", "b-slow", "c-slow", "d-slow", "e-slow", "f-slow"], deadline_in=0.7)
        statuses = [r["status"] for r in records]
        self.assertEqual(len(records), 6)
        self.assertIn("ok", statuses)
        self.assertEqual(statuses[-1], "skipped")
        self.assertTrue(set(statuses) <= {"ok", "deadline", "skipped"}, statuses)

    def test_a_child_that_cannot_start_fails_its_family_after_two_tries(self):
        records = []
        campaign.run_family(
            [{"id": "a"}, {"id": "b"}],
            lambda jobs, result: [sys.executable, "-c", "raise SystemExit(5)"],
            deadline=time.monotonic() + 30,
            job_seconds=5,
            startup_seconds=5,
            on_record=records.append,
            poll=0.02,
        )
        self.assertEqual([(r["id"], r["status"]) for r in records], [("a", "failed"), ("b", "failed")])


@unittest.skipIf(torch_python() is None, "no interpreter with torch and torchvision (describe's venv)")
class DryRun(unittest.TestCase):
    def test_the_whole_campaign_runs_on_the_cpu(self):
        crash = "mlp-a-b256-fp32"
        with tempfile.TemporaryDirectory() as out:
            run = subprocess.run(
                [
                    torch_python(),
                    "-m",
                    "gpucast_probe.campaign",
                    "--dry-run",
                    "--out",
                    out,
                    "--match",
                    "mlp-a-b64,mlp-a-b256-fp32,mlp-d-b64-fp32,resnet18-b32-amp",
                    "--describe-workers",
                    "1",
                    "--minutes",
                    "5",
                ],
                capture_output=True,
                text=True,
                timeout=600,
                cwd=REPO / "probe",  # gpucast_probe from here, as installed in describe's venv
                env=dict(os.environ, GPUCAST_CAMPAIGN_CRASH=crash),
            )
            self.assertEqual(run.returncode, 0, run.stderr[-2000:])
            with open(os.path.join(out, "jobs.jsonl")) as f:
                lines = [json.loads(line) for line in f]
            with open(os.path.join(out, "campaign.json")) as f:
                summary = json.load(f)
        ids = [line["job"]["id"] for line in lines]
        self.assertEqual(
            ids,
            [
                "mlp-a-b64-fp32",
                "mlp-a-b64-amp_bf16",
                "mlp-d-b64-fp32",
                "mlp-a-b256-fp32",
                "torchvision-resnet18-b32-amp_bf16",
            ],
        )
        by_id = {line["job"]["id"]: line for line in lines}
        self.assertEqual(by_id[crash]["measurement"]["status"], "crashed")
        self.assertEqual(summary["by_status"], {"ok": 4, "crashed": 1})
        for line in lines:
            self.assertIn("torch", line["provenance"])
            self.assertIn("date", line["provenance"])
            description = line["description"]
            self.assertEqual(description["batch_size"], 2)
            self.assertIn("simulation", description)
            self.assertTrue(all("flops" in layer for layer in description["layers"]))
            if line["job"]["id"] == crash:
                continue
            m = line["measurement"]
            self.assertEqual(m["status"], "ok", m)
            self.assertGreater(m["step_time_ms"], 0)
            self.assertGreater(m["samples_per_s"], 0)
            self.assertEqual(m["utilization"]["sources"], {"smact": "fake", "smocc": "fake", "drama": "fake"})
        self.assertEqual(by_id["torchvision-resnet18-b32-amp_bf16"]["description"]["precision"], "amp_bf16")


if __name__ == "__main__":
    unittest.main()
