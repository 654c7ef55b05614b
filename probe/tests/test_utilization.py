import time
import unittest
from types import SimpleNamespace

from probe.gpucast_probe.measure import HostTimer, measure_steps
from probe.gpucast_probe.utilization import (
    SOURCE_GPM,
    SOURCE_RATES,
    FakeSampler,
    GpmSampler,
    NullSampler,
    RatesSampler,
    choose_sampler,
)


class FakeGpmNvml:
    """pynvml's GPM calls: samples carry a sequence number; the metrics between two samples
    are fixed percentages per metric id; allocations and frees are counted."""

    NVML_GPM_METRIC_SM_UTIL = 2
    NVML_GPM_METRIC_SM_OCCUPANCY = 3
    NVML_GPM_METRIC_DRAM_BW_UTIL = 10
    NVML_GPM_METRICS_GET_VERSION = 1
    VALUES = {2: 80.0, 3: 40.0, 10: 30.0}

    def __init__(self, supported=True):
        self.supported, self.allocated, self.freed, self.taken = supported, 0, 0, 0

    def nvmlGpmQueryDeviceSupport(self, handle):
        return SimpleNamespace(isSupportedDevice=int(self.supported))

    def nvmlGpmSampleAlloc(self):
        self.allocated += 1
        return SimpleNamespace(n=None)

    def nvmlGpmSampleFree(self, sample):
        self.freed += 1

    def nvmlGpmSampleGet(self, handle, sample):
        self.taken += 1
        sample.n = self.taken

    class c_nvmlGpmMetricsGet_t:  # noqa: N801 (pynvml's name)
        def __init__(self):
            self.metrics = [SimpleNamespace(metricId=0, value=0.0, nvmlReturn=0) for _ in range(98)]

    def nvmlGpmMetricsGet(self, request):
        assert request.sample2.n > request.sample1.n, "metrics between an earlier and a later sample"
        for metric in request.metrics[: request.numMetrics]:
            metric.value = self.VALUES[metric.metricId]

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=97, memory=41)


class Samplers(unittest.TestCase):
    def test_gpm_averages_the_metrics_between_consecutive_samples_as_fractions(self):
        nv = FakeGpmNvml()
        sampler = GpmSampler(nv, handle=0, interval=0.005)
        sampler.start()
        time.sleep(0.05)
        window = sampler.stop()
        for name, value in {"smact": 0.8, "smocc": 0.4, "drama": 0.3}.items():
            self.assertAlmostEqual(window["metrics"][name], value)
        self.assertEqual(window["sources"], {"smact": SOURCE_GPM, "smocc": SOURCE_GPM, "drama": SOURCE_GPM})
        self.assertGreaterEqual(window["intervals"], 1)
        self.assertEqual(window["intervals"], nv.taken - 1, "one reading per pair of samples")
        self.assertEqual(nv.allocated, nv.freed, "every GPM sample is freed")

    def test_a_window_shorter_than_the_interval_still_has_one_reading(self):
        nv = FakeGpmNvml()
        sampler = GpmSampler(nv, handle=0, interval=60)
        sampler.start()
        window = sampler.stop()
        self.assertEqual(window["intervals"], 1)
        self.assertEqual(window["metrics"]["smact"], 0.8)

    def test_utilization_rates_are_reported_as_such_never_as_sm_activity(self):
        sampler = RatesSampler(FakeGpmNvml(), handle=0, interval=60)
        sampler.start()
        window = sampler.stop()
        self.assertEqual(window["metrics"], {"gpu_util_pct": 97.0, "mem_util_pct": 41.0})
        self.assertEqual(set(window["sources"].values()), {SOURCE_RATES})
        self.assertNotIn("smact", window["metrics"])

    def test_gpm_from_compute_capability_9_when_nvml_supports_it(self):
        self.assertIsInstance(choose_sampler(FakeGpmNvml(), 0, (9, 0)), GpmSampler)
        self.assertIsInstance(choose_sampler(FakeGpmNvml(), 0, (10, 0)), GpmSampler)
        self.assertIsInstance(choose_sampler(FakeGpmNvml(), 0, (8, 0)), RatesSampler, "A100: rates")
        self.assertIsInstance(choose_sampler(FakeGpmNvml(supported=False), 0, (9, 0)), RatesSampler)
        self.assertIsInstance(choose_sampler(None, None, (9, 0)), NullSampler)

    def test_a_failing_gpm_sample_is_a_missing_interval(self):
        nv = FakeGpmNvml()
        sampler = GpmSampler(nv, handle=0, interval=60)
        sampler.start()

        def broken(handle, sample):
            raise RuntimeError("NVML_ERROR_UNKNOWN")

        nv.nvmlGpmSampleGet = broken
        window = sampler.stop()
        self.assertEqual(window["intervals"], 0)
        self.assertIsNone(window["metrics"]["smact"])
        self.assertEqual(nv.allocated, nv.freed)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class SteadySteps(unittest.TestCase):
    def setUp(self):
        self.clock, self.steps = Clock(), 0
        self.sampler = FakeSampler()

    def step(self):
        # warm-up steps are slow (allocator, autotuning), the steady ones 100 ms
        self.steps += 1
        self.clock.now += 1.0 if self.steps <= 3 else 0.1

    def test_warm_up_steps_are_not_measured_and_the_sampler_covers_the_measured_ones(self):
        started_at = []
        self.sampler.start = lambda: started_at.append(self.steps)
        result = measure_steps(
            self.step,
            lambda: None,
            self.sampler,
            batch_size=32,
            warmup_steps=3,
            max_steps=10,
            min_steps=3,
            max_seconds=100,
            clock=self.clock,
        )
        self.assertEqual(started_at, [3])
        self.assertEqual(self.sampler.stopped, 1)
        self.assertEqual(result["measured_steps"], 10)
        self.assertAlmostEqual(result["step_time_ms"], 100.0)
        self.assertAlmostEqual(result["samples_per_s"], 320.0)
        self.assertEqual(result["utilization"]["sources"]["smact"], "fake")

    def test_the_time_limit_stops_after_the_minimum_steps(self):
        result = measure_steps(
            self.step,
            lambda: None,
            self.sampler,
            8,
            warmup_steps=3,
            max_steps=100,
            min_steps=5,
            max_seconds=0.25,
            clock=self.clock,
        )
        self.assertEqual(result["measured_steps"], 5)

    def test_the_median_resists_one_slow_step(self):
        def step():
            self.steps += 1
            self.clock.now += 2.0 if self.steps == 5 else 0.1

        result = measure_steps(
            step,
            lambda: None,
            self.sampler,
            1,
            warmup_steps=1,
            max_steps=5,
            min_steps=5,
            max_seconds=100,
            clock=self.clock,
        )
        self.assertAlmostEqual(result["step_time_ms"], 100.0)
        self.assertGreater(result["step_time_ms_mean"], 400.0)

    def test_host_timer_synchronises_after_every_step(self):
        syncs = []
        timer = HostTimer(lambda: syncs.append(self.steps), self.clock)
        measure_steps(
            self.step,
            lambda: None,
            self.sampler,
            1,
            warmup_steps=0,
            max_steps=4,
            min_steps=4,
            max_seconds=100,
            clock=self.clock,
            timer=timer,
        )
        self.assertEqual(syncs, [1, 2, 3, 4])

    def test_a_failing_step_stops_the_sampler_and_propagates(self):
        def step():
            self.steps += 1
            if self.steps == 3:
                raise MemoryError("CUDA out of memory")

        with self.assertRaises(MemoryError):
            measure_steps(step, lambda: None, self.sampler, 1, warmup_steps=1, max_steps=5, clock=self.clock)
        self.assertEqual((self.sampler.started, self.sampler.stopped), (1, 1))


if __name__ == "__main__":
    unittest.main()
