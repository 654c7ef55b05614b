//! A scripted stand-in for the driver, for tests: fixed devices, and per-process memory that a
//! test plays back one reading per call.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Mutex;

use crate::devices::{DeviceError, GpuDevice, GpuDevices};

/// Devices and process readings set by a test.
///
/// A process's readings are a script: each [`GpuDevices::process_memory_mib`] call takes the
/// next one; when the script is used up the process reads its steady value (by default `None`,
/// i.e. it has exited). `None` inside a script means "not on the GPU at that moment".
#[derive(Debug, Default)]
pub struct FakeDevices {
    devices: Vec<GpuDevice>,
    processes: Mutex<HashMap<u32, ProcessScript>>,
    /// The threads that have read a process's memory, so tests can see how watches are run.
    readers: Mutex<HashSet<std::thread::ThreadId>>,
    /// How long listing the devices takes (a slow driver), once the service is up.
    list_delay: Mutex<std::time::Duration>,
}

#[derive(Debug, Default)]
struct ProcessScript {
    readings: VecDeque<Option<u64>>,
    steady: Option<u64>,
}

impl FakeDevices {
    /// These devices, driver `550.54.15` unless [`FakeDevices::with_driver`] says otherwise.
    pub fn new(devices: Vec<GpuDevice>) -> FakeDevices {
        let driver = "550.54.15".to_string();
        let devices = devices
            .into_iter()
            .map(|d| GpuDevice {
                driver_version: driver.clone(),
                ..d
            })
            .collect();
        FakeDevices {
            devices,
            processes: Mutex::new(HashMap::new()),
            readers: Mutex::new(HashSet::new()),
            list_delay: Mutex::new(std::time::Duration::ZERO),
        }
    }

    /// One GPU with this driver name and capacity at index 0.
    pub fn single(name: &str, memory_total_mib: u64) -> FakeDevices {
        FakeDevices::new(vec![GpuDevice::new(
            0,
            "GPU-00000000-fake",
            name,
            memory_total_mib,
        )])
    }

    pub fn with_driver(mut self, driver: &str) -> FakeDevices {
        for device in &mut self.devices {
            device.driver_version = driver.to_string();
        }
        self
    }

    /// Every device reports this compute capability, SM count, highest SM and memory clocks
    /// (MHz) and memory bus width (bits), as NVML would; `None`: the driver cannot say.
    pub fn with_hardware(
        mut self,
        compute_capability: Option<&str>,
        multiprocessor_count: Option<u32>,
        max_sm_clock_mhz: Option<u32>,
        max_memory_clock_mhz: Option<u32>,
        memory_bus_width_bits: Option<u32>,
    ) -> FakeDevices {
        for device in &mut self.devices {
            device.compute_capability = compute_capability.map(str::to_string);
            device.multiprocessor_count = multiprocessor_count;
            device.max_sm_clock_mhz = max_sm_clock_mhz;
            device.max_memory_clock_mhz = max_memory_clock_mhz;
            device.memory_bus_width_bits = memory_bus_width_bits;
        }
        self
    }

    /// Plays back these readings (MiB) for `pid`, one per call, then reports it gone.
    pub fn script_process(&self, pid: u32, readings: impl IntoIterator<Item = Option<u64>>) {
        let script = ProcessScript {
            readings: readings.into_iter().collect(),
            steady: None,
        };
        self.lock().insert(pid, script);
    }

    /// `pid` reads `mib` on every call from now on (`None`: gone), after any script left.
    pub fn set_process_memory(&self, pid: u32, mib: Option<u64>) {
        self.lock().entry(pid).or_default().steady = mib;
    }

    /// Every listing of the devices takes `delay` from now on (blocking the caller).
    pub fn set_list_delay(&self, delay: std::time::Duration) {
        *self.list_delay.lock().unwrap_or_else(|p| p.into_inner()) = delay;
    }

    /// How many distinct threads have read a process's memory so far.
    pub fn reader_threads(&self) -> usize {
        self.readers.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether `pid` has been read at least once and its script is used up.
    pub fn script_done(&self, pid: u32) -> bool {
        self.lock().get(&pid).is_some_and(|s| s.readings.is_empty())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, ProcessScript>> {
        // A test that panicked while holding the lock leaves consistent data: keep going.
        self.processes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl GpuDevices for FakeDevices {
    fn list(&self) -> Result<Vec<GpuDevice>, DeviceError> {
        let delay = *self.list_delay.lock().unwrap_or_else(|p| p.into_inner());
        std::thread::sleep(delay);
        Ok(self.devices.clone())
    }

    fn process_memory_mib(&self, pid: u32) -> Result<Option<u64>, DeviceError> {
        self.readers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(std::thread::current().id());
        let mut processes = self.lock();
        Ok(match processes.get_mut(&pid) {
            None => None,
            Some(script) => script.readings.pop_front().unwrap_or(script.steady),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scripted_process_plays_back_then_exits() {
        let fake = FakeDevices::single("NVIDIA L4", 23034);
        fake.script_process(42, [None, Some(500), Some(900)]);
        let readings: Vec<_> = (0..5)
            .map(|_| fake.process_memory_mib(42).unwrap())
            .collect();
        assert_eq!(readings, vec![None, Some(500), Some(900), None, None]);
        assert_eq!(fake.process_memory_mib(7).unwrap(), None);
    }

    #[test]
    fn a_steady_process_reads_the_same_until_changed() {
        let fake = FakeDevices::single("NVIDIA L4", 23034);
        fake.set_process_memory(1, Some(300));
        assert_eq!(fake.process_memory_mib(1).unwrap(), Some(300));
        assert_eq!(fake.process_memory_mib(1).unwrap(), Some(300));
        fake.set_process_memory(1, None);
        assert_eq!(fake.process_memory_mib(1).unwrap(), None);
    }

    #[test]
    fn devices_carry_the_driver_version() {
        let fake = FakeDevices::single("Tesla T4", 15360).with_driver("535.104.05");
        let devices = fake.list().unwrap();
        assert_eq!(devices[0].driver_version, "535.104.05");
        assert_eq!(devices[0].sku.as_deref(), Some("t4"));
    }
}
