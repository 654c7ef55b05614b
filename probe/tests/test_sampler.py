import unittest
from types import SimpleNamespace

from probe.gpucast_probe.sampler import Nvml, mean, parse_dcgmi_dmon

DMON = """\
#Entity   GPUTL  GRACT  SMACT  SMOCC  DRAMA  FP32A
ID
GPU 0     0      0.000  0.000  0.000  0.000  0.000
GPU 0     90     0.950  0.800  0.400  0.300  N/A
GPU 0     96     0.970  0.900  0.500  0.500  0.200
"""


class Dcgm(unittest.TestCase):
    def test_dmon_output_is_averaged_per_field_skipping_na(self):
        m = parse_dcgmi_dmon(DMON)
        self.assertAlmostEqual(m["gputl"], 62.0)
        self.assertAlmostEqual(m["smact"], (0.0 + 0.8 + 0.9) / 3)
        self.assertAlmostEqual(m["drama"], (0.0 + 0.3 + 0.5) / 3)
        self.assertAlmostEqual(m["fp32a"], 0.1)

    def test_no_readings_give_no_values(self):
        m = parse_dcgmi_dmon("Error: unable to connect to host engine\n")
        self.assertTrue(all(v is None for v in m.values()))
        self.assertIn("drama", m)

    def test_mean_ignores_missing(self):
        self.assertIsNone(mean([]))
        self.assertIsNone(mean([None]))
        self.assertEqual(mean([1.0, None, 3.0]), 2.0)


class FakePynvml:
    """Enough of pynvml to exercise the guards: some calls work, the rest raise."""

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, h):
        return "GPU-1234"

    def nvmlSystemGetDriverVersion(self):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=143771 * 2**20, used=1000 * 2**20 + 1, free=0)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=7, usedGpuMemory=512 * 2**20), SimpleNamespace(pid=8, usedGpuMemory=None)]

    def nvmlDeviceGetUtilizationRates(self, h):
        raise RuntimeError("not supported")


class GuardedNvml(unittest.TestCase):
    def test_failing_calls_become_none_not_exceptions(self):
        nvml = Nvml(FakePynvml())
        info = nvml.device_info(0)
        self.assertEqual(info, {"name": "NVIDIA H200", "uuid": "GPU-1234", "driver": "", "total_mib": 143771})
        self.assertEqual(nvml.used_mib(0), 1001, "used memory rounds up to whole MiB")
        self.assertEqual(nvml.process_mib(0, 7), 512)
        self.assertIsNone(nvml.process_mib(0, 8), "unknowable per-process memory is None")
        self.assertIsNone(nvml.process_mib(0, 9))
        self.assertIsNone(nvml.gputl(0))
        self.assertFalse(nvml.gpm_supported(0))
        self.assertIsNone(nvml.gpm_sample(0))
        self.assertEqual(nvml.gpm_metrics(None, None), {})

    def test_open_without_pynvml_or_driver_is_none(self):
        # Here (no GPU) pynvml is either missing or finds no driver.
        try:
            import pynvml  # noqa: F401

            pynvml.nvmlInit()
            self.skipTest("a driver is present")
        except Exception:
            self.assertIsNone(Nvml.open())


if __name__ == "__main__":
    unittest.main()
