"""The client against openapi/openapi.json (no service needed) and against the real service
(GPUCAST_URL, as scripts/client-test.sh starts it); standard library only: this runs in the
package's own venv, without torch."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys
import types
import unittest
import uuid
from pathlib import Path
from unittest import mock

import gpucast
from gpucast import stack
from gpucast.models import JOB_FIELDS, OBSERVATION_FIELDS, Model

URL = os.environ.get("GPUCAST_URL")
OPENAPI = Path(os.environ.get("GPUCAST_OPENAPI", "openapi/openapi.json"))
EXAMPLES = OPENAPI.parent / "examples"
# Fields the client reads that the spec does not declare: RFC 7807's `type` (absent means
# about:blank, which the client fills in).
NOT_IN_SPEC = {("Problem", "type")}


def load_spec() -> dict:
    with open(OPENAPI, encoding="utf-8") as file:
        return json.load(file)


def schema_properties(schema: dict) -> dict:
    """The properties of a schema, through an allOf (EstimateRequest's layers-or-summary rule)."""
    properties = dict(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        properties.update(part.get("properties", {}))
    return properties


def schema_required(schema: dict) -> set:
    required = set(schema.get("required", []))
    for part in schema.get("allOf", []):
        required |= set(part.get("required", [])) if "oneOf" not in part else set()
    return required


def referenced_schemas(node: object) -> set:
    """Every schema name a property refers to, through oneOf/items/nullable wrappers."""
    names = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            names.add(ref.rsplit("/", 1)[-1])
        for value in node.values():
            names |= referenced_schemas(value)
    elif isinstance(node, list):
        for value in node:
            names |= referenced_schemas(value)
    return names


def models() -> list:
    found = []
    for name in gpucast.__all__:
        value = getattr(gpucast, name)
        if isinstance(value, type) and issubclass(value, Model) and value.SCHEMA:
            found.append(value)
    return found


class ContractTest(unittest.TestCase):
    """A route, or a field the client reads, renamed in the service fails here."""

    @classmethod
    def setUpClass(cls) -> None:
        cls.spec = load_spec()
        cls.schemas = cls.spec["components"]["schemas"]

    def test_every_route_is_a_client_method_and_the_other_way_round(self) -> None:
        in_spec = {(method.upper(), path) for path, ops in self.spec["paths"].items() for method in ops}
        in_client = {(route.method, route.path) for route in gpucast.ROUTES.values()}
        self.assertEqual(in_client, in_spec)
        for name in gpucast.ROUTES:
            self.assertTrue(callable(getattr(gpucast.Client, name)), name)
            self.assertTrue(asyncio.iscoroutinefunction(getattr(gpucast.AsyncClient, name)), name)

    def test_answers_and_bodies_are_the_spec_schemas(self) -> None:
        for name, route in gpucast.ROUTES.items():
            operation = self.spec["paths"][route.path][route.method.lower()]
            success = next(r for status, r in operation["responses"].items() if status.startswith("2"))
            content = success.get("content", {})
            if route.response is None:
                self.assertIn("text/plain", content, name)
            else:
                ref = content["application/json"]["schema"]["$ref"]
                self.assertEqual(ref.rsplit("/", 1)[-1], route.response.SCHEMA, name)
            body = operation.get("requestBody", {}).get("content", {}).get("application/json", {})
            wanted = body.get("schema", {}).get("$ref", "").rsplit("/", 1)[-1] or None
            self.assertEqual(route.request_schema, wanted, name)
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")):
                    problem = response["content"]["application/problem+json"]["schema"]["$ref"]
                    self.assertTrue(problem.endswith("/Problem"), (name, status))

    def test_every_field_read_is_in_its_schema(self) -> None:
        for model in models():
            schema = self.schemas[model.SCHEMA]
            properties = schema_properties(schema)
            wire_names = set(model.wire_fields().values())
            for key in wire_names:
                if (model.SCHEMA, key) not in NOT_IN_SPEC:
                    self.assertIn(key, set(properties), f"{model.__name__}.{key} not in {model.SCHEMA}")
            # What the service always sends, the client has a field for.
            self.assertLessEqual(schema_required(schema), wire_names, model.__name__)
            for key, nested in model.nested_models().items():
                self.assertIn(nested.SCHEMA, referenced_schemas(properties[key]), f"{model.__name__}.{key}")

    def test_jobs_and_observations_write_spec_fields(self) -> None:
        job_properties = schema_properties(self.schemas["EstimateRequest"])
        for key in JOB_FIELDS:
            self.assertIn(key, job_properties)
        observation = self.schemas["ObservationRequest"]
        self.assertLessEqual(set(OBSERVATION_FIELDS), set(observation["properties"]))
        self.assertLessEqual(set(observation["required"]), set(OBSERVATION_FIELDS))
        headers = [p["name"] for p in self.spec["paths"]["/v1/calibration/observations"]["post"]["parameters"]]
        self.assertIn("Idempotency-Key", headers)

    def test_unknown_fields_are_kept(self) -> None:
        answer = gpucast.FitResponse.from_dict({"gpu": "x", "fits": True, "new_field": 1})
        self.assertEqual(answer.extra, {"new_field": 1})
        self.assertTrue(answer.fits)


class EnvironmentLabelTest(unittest.TestCase):
    def test_labels_keep_to_the_service_rules(self) -> None:
        self.assertEqual(gpucast.environment_label("2.5.1+cu124", "12.4", "550.54.15"), "torch2.5-cu124-drv550.54.15")
        self.assertEqual(gpucast.environment_label("2.15.0+cpu", None, None), "torch2.15")
        self.assertIsNone(gpucast.environment_label(None, None, None))
        odd = gpucast.environment_label("2.5.0a0+git/abc", "12.4", "5" * 80)
        self.assertLessEqual(len(odd), 64)
        self.assertRegex(odd, r"^[A-Za-z0-9._+-]{1,64}$")


class StackLabelTest(unittest.TestCase):
    """The stack an observation is labelled with: no service, no torch."""

    def test_labels_name_the_framework_libraries_cuda_and_launcher(self) -> None:
        versions = {"transformers": "4.46.3", "torch": "2.5.1+cu124", "peft": "0.13.2", "deepspeed": "0.15.4"}
        label = gpucast.stack_label("transformers", versions, cuda="12.4", launched_by="deepspeed")
        self.assertEqual(label, "hf4.46-torch2.5-cu124-peft0.13-ds0.15-deepspeed")
        self.assertEqual(gpucast.stack_label("lightning", {"lightning": "2.4.0", "torch": "2.4.1"}), "pl2.4-torch2.4")
        self.assertIsNone(gpucast.stack_label(None, {}))

    def test_labels_keep_to_the_service_rules(self) -> None:
        long = {name: "1" * 30 + ".2/3" for name in ("transformers", "torch", "peft", "deepspeed", "accelerate")}
        label = gpucast.stack_label("transformers", long, cuda="12.4", launched_by="torchrun")
        self.assertLessEqual(len(label), 64)
        self.assertRegex(label, r"^[A-Za-z0-9._+-]{1,64}$")
        # The framework comes first; what does not fit is left out, not cut in half.
        self.assertTrue(label.startswith("hf" + "1" * 30 + ".2_3-"), label)

    def test_the_launcher_is_read_from_the_environment_it_set(self) -> None:
        self.assertEqual(stack.launcher({"TORCHELASTIC_RUN_ID": "none", "LOCAL_RANK": "0"}), "torchrun")
        # accelerate's multi-GPU launch runs torch's elastic agent: accelerate is named.
        accelerate = {"TORCHELASTIC_RUN_ID": "x", "ACCELERATE_MIXED_PRECISION": "bf16"}
        self.assertEqual(stack.launcher(accelerate), "accelerate")
        self.assertEqual(stack.launcher({"CROSS_RANK": "0", "LOCAL_SIZE": "8", "RANK": "3"}), "deepspeed")
        self.assertIsNone(stack.launcher({"RANK": "0"}))

    def test_detect_reads_the_installed_versions_of_what_the_job_uses(self) -> None:
        versions = {"transformers": "5.0.0", "torch": "2.9.0", "deepspeed": "0.18.1", "accelerate": "1.11.0"}
        label = stack.detect(
            "transformers",
            uses=("deepspeed",),
            cuda="12.8",
            environ={"TORCHELASTIC_RUN_ID": "abc"},
            version=versions.get,
        )
        self.assertEqual(label, "hf5.0-torch2.9-cu128-ds0.18-torchrun")
        # accelerate's launch names accelerate's version; DeepSpeed through it, DeepSpeed's.
        through_accelerate = stack.detect(
            "transformers",
            environ={"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_USE_DEEPSPEED": "true"},
            version=versions.get,
        )
        self.assertEqual(through_accelerate, "hf5.0-torch2.9-ds0.18-acc1.11-accelerate")


class FakeClient:
    """The service's answers a test chooses, and what was sent to it."""

    def __init__(self) -> None:
        self.estimated: list[dict] = []
        self.observed: list[dict] = []

    def estimate(self, job: dict) -> gpucast.EstimateResponse:
        self.estimated.append(job)
        return gpucast.EstimateResponse.from_dict(
            {
                "family": "transformer",
                "memory": {"estimate_mib": 36981.6, "upper_bound_mib": 46832.0, "confidence": 0.95},
                "fit": {"gpu": "h100-80gb", "fits": True},
            }
        )

    def observe(self, observation: dict, idempotency_key: str | None = None) -> gpucast.ObservationsResponse:
        self.observed.append(observation)
        return gpucast.ObservationsResponse(recorded=1)


class CallbackStackTest(unittest.TestCase):
    """The Trainer callback's hooks, called as the Trainer calls them: no service, no torch."""

    def run_callback(self, **options: object) -> tuple:
        from gpucast.callback import CallbackMethods

        client = FakeClient()
        callback = CallbackMethods(client, {"seq_len": 2048}, steps=2, stats=FakeStats(30000.0), **options)
        args = types.SimpleNamespace(deepspeed={"zero_optimization": {"stage": 2}}, fsdp="")
        environ = {"TORCHELASTIC_RUN_ID": "abc"}
        versions = {"transformers": "4.46.3", "torch": "2.5.1", "deepspeed": "0.15.4"}.get
        with mock.patch.dict(os.environ, environ), mock.patch.object(stack, "installed_version", versions):
            with self.assertLogs("gpucast", logging.INFO) as logs:
                callback.on_train_begin(args, None, None)
                callback.on_step_end(args, None, None)
                callback.on_step_end(args, None, None)
        return client, callback, "\n".join(logs.output)

    def test_observations_are_labelled_with_the_stack_and_the_estimate_logged(self) -> None:
        client, callback, logs = self.run_callback(gpu="h100-80gb")
        label = "hf4.46-torch2.5-ds0.15-torchrun"
        self.assertEqual(client.observed[0]["environment"], label)
        # The estimate is asked in the same environment, and logged.
        self.assertEqual(client.estimated[0]["environment"], label)
        self.assertEqual(client.estimated[0]["gpu"], "h100-80gb")
        self.assertEqual(callback.estimate.memory.estimate_mib, 36981.6)
        self.assertIn("estimated 36982 MiB (bound 46832 MiB at 0.95) on h100-80gb (named): fits", logs)
        self.assertIn(label, logs)
        # One prefix: the logger's name.
        self.assertNotIn("gpucast: gpucast", logs)
        self.assertTrue(all(line.split(":", 2)[2][:8] != "gpucast:" for line in logs.splitlines()), logs)

    def test_a_named_environment_is_kept(self) -> None:
        client, _, _ = self.run_callback(environment="cluster-a")
        self.assertEqual(client.observed[0]["environment"], "cluster-a")
        self.assertEqual(client.estimated[0]["environment"], "cluster-a")
        # The device's name when no gpu is given.
        self.assertEqual(client.estimated[0]["gpu"], "h100-80gb")


class NoDevice:
    """A host without a CUDA device."""

    def available(self) -> bool:
        return False


class CpuHostTest(unittest.TestCase):
    """On a host without a GPU the callback says so, estimates for the card named, and posts
    nothing (and says it posted nothing)."""

    def test_the_named_card_is_estimated_and_no_observation_is_claimed(self) -> None:
        from gpucast.callback import CallbackMethods

        client = FakeClient()
        callback = CallbackMethods(client, {"seq_len": 2048}, steps=1, stats=NoDevice(), gpu="rtx-4090")
        with self.assertLogs("gpucast", logging.INFO) as logs:
            callback.on_train_begin(types.SimpleNamespace(deepspeed=None, fsdp=""), None, None)
            callback.on_step_end(None, None, None)
        text = "\n".join(logs.output)
        self.assertEqual(client.estimated[0]["gpu"], "rtx-4090")
        self.assertIn("(named)", text)
        self.assertIn("WARNING:gpucast:no CUDA device on this host", text)
        self.assertNotIn("gpucast: gpucast", text)
        self.assertEqual(client.observed, [])
        self.assertFalse(callback.observer.posted)
        self.assertTrue(callback.observer.attempted)

    def test_no_card_named_is_said_not_assumed_in_silence(self) -> None:
        from gpucast.callback import CallbackMethods

        client = FakeClient()
        callback = CallbackMethods(client, {"seq_len": 2048}, steps=1, stats=NoDevice())
        with self.assertLogs("gpucast", logging.INFO) as logs:
            callback.on_train_begin(types.SimpleNamespace(deepspeed=None, fsdp=""), None, None)
        text = "\n".join(logs.output)
        self.assertNotIn("gpu", client.estimated[0])
        self.assertIn("no gpu= named", text)
        self.assertIn("the service's reference card", text)


class FakeStats:
    """A CUDA device that is not there: the figures a test chooses."""

    def __init__(self, peak_mib: float, name: str = "h100-80gb") -> None:
        self.peak = int(peak_mib * 1024 * 1024)
        self.name = name
        self.resets = 0
        self.samples = 0

    def available(self) -> bool:
        return True

    def reset(self) -> None:
        self.resets += 1

    def sample(self) -> None:
        self.samples += 1

    def reading(self) -> gpucast.MemoryReading:
        return gpucast.MemoryReading(max_allocated=self.peak // 2, max_reserved=self.peak // 2, device_peak=self.peak)

    def device_name(self) -> str:
        return self.name

    def environment(self) -> str:
        return gpucast.environment_label("2.5.1", "12.4", "550.54.15")


def example_job() -> dict:
    with open(EXAMPLES / "config_request.json", encoding="utf-8") as file:
        job = json.load(file)
    job["gpu"] = "h100-80gb"
    return job


@unittest.skipUnless(URL, "GPUCAST_URL unset: scripts/client-test.sh starts the service and sets it")
class RoundTripTest(unittest.TestCase):
    """One call of every route against the real service."""

    def setUp(self) -> None:
        self.client = gpucast.Client(URL)
        self.job = example_job()

    def test_estimate(self) -> None:
        answer = self.client.estimate(self.job)
        self.assertIsInstance(answer, gpucast.EstimateResponse)
        self.assertGreater(answer.memory.estimate_mib, 0)
        self.assertEqual(answer.fit.gpu, "h100-80gb")
        self.assertTrue(answer.fit.fits)
        self.assertGreater(answer.performance.step_time_ms, 0)
        self.assertEqual(answer.family, "transformer")

    def test_estimate_error_carries_problem_details(self) -> None:
        del self.job["batch_size"]
        with self.assertRaises(gpucast.ProblemError) as caught:
            self.client.estimate(self.job)
        error = caught.exception
        self.assertEqual(error.status, 422)
        self.assertEqual(error.problem.status, 422)
        self.assertIn("batch_size", error.detail)
        self.assertTrue(error.title)
        self.assertEqual(error.type, "about:blank")

    def test_estimate_batch(self) -> None:
        bad = dict(self.job, batch_size=0)
        answer = self.client.estimate_batch([self.job, bad])
        self.assertEqual([item.index for item in answer.items], [0, 1])
        self.assertEqual(answer.items[0].status, 200)
        self.assertGreater(answer.items[0].estimate.memory.estimate_mib, 0)
        self.assertEqual(answer.items[1].status, 422)
        self.assertIn("batch_size", answer.items[1].error.detail)

    def test_plan(self) -> None:
        answer = self.client.plan(self.job, setups=False)
        self.assertIsInstance(answer, gpucast.PlanResponse)
        card = answer.cards[0]
        self.assertEqual(card.gpu, "h100-80gb")
        largest = card.largest_micro_batch
        self.assertGreaterEqual(largest, answer.micro_batch_size)
        # The plan's largest micro-batch is where /v1/estimate still says it fits.
        at = dict(self.job, micro_batch_size=largest, batch_size=largest * answer.gradient_accumulation_steps)
        self.assertTrue(self.client.estimate(at).fit.fits)
        self.assertGreater(answer.estimates, 1)

    def test_reads(self) -> None:
        self.assertEqual(self.client.healthz().status, "ok")
        self.assertTrue(self.client.readyz().ready)
        self.assertIn("# TYPE", self.client.metrics())
        gpus = self.client.gpus().gpus
        self.assertTrue(any(gpu.get("id") == "h100-80gb" for gpu in gpus))
        self.assertTrue(self.client.estimators().estimators)
        devices = self.client.devices()
        self.assertFalse(devices.nvml)
        self.assertIsInstance(self.client.profiles().profiles, list)

    def test_observe_with_idempotency_key(self) -> None:
        peak = self.client.estimate(self.job).memory.estimate_mib * 1.05
        observation = {"gpu": "h100-80gb", "job": self.job, "observed_peak_mib": peak, "step_time_ms": 900.0}
        key = str(uuid.uuid4())
        first = self.client.observe(observation, idempotency_key=key)
        self.assertEqual(first.recorded, 1)
        self.assertTrue(any(p.get("gpu") == "h100-80gb" for p in first.profiles))
        replay = self.client.observe(observation, idempotency_key=key)
        self.assertEqual(replay, first)
        with self.assertRaises(gpucast.ProblemError) as caught:
            self.client.observe(dict(observation, observed_peak_mib=1.0))
        self.assertEqual(caught.exception.status, 422)
        profiles = self.client.profiles().profiles
        self.assertTrue(any(p.get("gpu") == "h100-80gb" for p in profiles))

    def test_watch_without_nvml_is_a_problem(self) -> None:
        # The test service runs --no-nvml: the route answers, with 409 and its details.
        with self.assertRaises(gpucast.ProblemError) as caught:
            self.client.watch(os.getpid(), self.job, interval_ms=100, max_seconds=5)
        self.assertEqual(caught.exception.status, 409)
        self.assertIn("NVML", caught.exception.detail)

    def test_every_route_async(self) -> None:
        client = gpucast.AsyncClient(URL)

        async def run() -> list:
            return await asyncio.gather(
                client.estimate(self.job),
                client.estimate_batch([self.job]),
                client.gpus(),
                client.estimators(),
                client.devices(),
                client.healthz(),
                client.readyz(),
                client.metrics(),
                client.profiles(),
                client.watch(os.getpid(), self.job),
                return_exceptions=True,
            )

        estimate, batch, gpus, estimators, devices, health, ready, metrics, profiles, watch = asyncio.run(run())
        self.assertGreater(estimate.memory.estimate_mib, 0)
        self.assertEqual(batch.items[0].estimate.memory.estimate_mib, estimate.memory.estimate_mib)
        self.assertTrue(gpus.gpus and estimators.estimators)
        self.assertFalse(devices.nvml)
        self.assertEqual(health.status, "ok")
        self.assertTrue(ready.ready)
        self.assertIn("# TYPE", metrics)
        self.assertIsInstance(profiles, gpucast.ProfilesResponse)
        self.assertIsInstance(watch, gpucast.ProblemError)
        peak = estimate.memory.estimate_mib * 1.05
        observed = asyncio.run(client.observe([{"gpu": "h100-80gb", "job": self.job, "observed_peak_mib": peak}]))
        self.assertEqual(observed.recorded, 1)

    def test_unreachable_service_is_a_transport_error(self) -> None:
        with self.assertRaises(gpucast.TransportError):
            gpucast.Client("http://127.0.0.1:9", timeout=2).healthz()


@unittest.skipUnless(URL, "GPUCAST_URL unset: scripts/client-test.sh starts the service and sets it")
class TrackTest(unittest.TestCase):
    """The plain-PyTorch observer, its CUDA figures faked (no GPU here, and no torch needed)."""

    def test_posts_after_the_steps(self) -> None:
        client = gpucast.Client(URL)
        job = example_job()
        peak = client.estimate(job).memory.estimate_mib * 1.05
        stats = FakeStats(peak)
        ticks = iter(float(t) for t in range(100))
        with gpucast.track(client, job, steps=3, stats=stats, clock=lambda: next(ticks)) as observer:
            for _ in range(5):
                observer.step()
        self.assertEqual(observer.response.recorded, 1)
        self.assertEqual(stats.resets, 1)
        self.assertEqual(observer.observation["gpu"], "h100-80gb")
        self.assertAlmostEqual(observer.observation["observed_peak_mib"], peak, delta=0.01)
        self.assertEqual(observer.observation["step_time_ms"], 1000.0)
        self.assertEqual(observer.observation["environment"], "torch2.5-cu124-drv550.54.15")

    def test_a_failed_post_is_a_warning(self) -> None:
        job = example_job()
        with self.assertLogs("gpucast", logging.WARNING) as logs:
            with gpucast.track("http://127.0.0.1:9", job, steps=2, stats=FakeStats(1000.0)) as observer:
                observer.step()
                observer.step()
        self.assertIsNone(observer.response)
        self.assertIn("training goes on", "\n".join(logs.output))
        # An impossible peak is refused (422): a warning too.
        with self.assertLogs("gpucast", logging.WARNING):
            with gpucast.track(URL, job, steps=1, stats=FakeStats(1.0)) as observer:
                observer.step()
        self.assertIsNone(observer.response)

    def test_no_torch_was_imported(self) -> None:
        self.assertNotIn("torch", sys.modules)
        self.assertTrue(dataclasses.is_dataclass(gpucast.EstimateResponse))


if __name__ == "__main__":
    unittest.main()
