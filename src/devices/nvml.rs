//! The real devices, read through NVML (the library nvidia-smi uses).

use nvml_wrapper::enum_wrappers::device::Clock;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

use crate::devices::derived::sm_count_from_cores;
use crate::devices::{DeviceError, GpuDevice, GpuDevices, NoDevices};

const MIB: u64 = 1024 * 1024;

/// GPUs read through a loaded NVML library.
pub struct NvmlDevices {
    nvml: Nvml,
}

impl std::fmt::Debug for NvmlDevices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlDevices").finish_non_exhaustive()
    }
}

impl NvmlDevices {
    /// NVML when a driver with at least one GPU is present, else [`NoDevices`] with the reason.
    /// Never fails: a host without a GPU runs the service with device routes saying so.
    pub fn detect() -> Box<dyn GpuDevices> {
        match Nvml::init() {
            Err(e) => {
                let reason = init_failure_reason(&e);
                tracing::info!(%reason, "no NVML device");
                Box::new(NoDevices::new(reason))
            }
            Ok(nvml) => match nvml.device_count() {
                Ok(0) => {
                    tracing::info!("NVML is loaded but lists no GPU");
                    Box::new(NoDevices::new("the NVIDIA driver lists no GPU"))
                }
                Ok(count) => {
                    tracing::info!(count, "NVML devices found");
                    Box::new(NvmlDevices { nvml })
                }
                Err(e) => Box::new(NoDevices::new(format!("NVML could not count GPUs: {e}"))),
            },
        }
    }

    fn device(&self, index: u32) -> Result<GpuDevice, NvmlError> {
        let device = self.nvml.device_by_index(index)?;
        let memory = device.memory_info()?;
        let name = device.name()?;
        let mut record = GpuDevice::new(index, device.uuid()?, name, memory.total / MIB);
        record.memory_used_mib = memory.used.div_ceil(MIB);
        record.memory_free_mib = memory.free / MIB;
        // Optional facts: a driver that cannot tell them still lists the device.
        record.compute_capability = device
            .cuda_compute_capability()
            .ok()
            .map(|cc| format!("{}.{}", cc.major, cc.minor));
        record.driver_version = self.nvml.sys_driver_version().unwrap_or_default();
        // What peaks of a card the catalogue lacks are derived from (devices::derived).
        record.multiprocessor_count = device
            .attributes()
            .ok()
            .map(|a| a.multiprocessor_count)
            .filter(|&n| n > 0)
            .or_else(|| {
                let cc = record.compute_capability.as_deref()?;
                sm_count_from_cores(cc, device.num_cores().ok()?)
            });
        record.max_sm_clock_mhz = device.max_clock_info(Clock::SM).ok();
        record.max_memory_clock_mhz = device.max_clock_info(Clock::Memory).ok();
        record.memory_bus_width_bits = device.memory_bus_width().ok();
        Ok(record)
    }
}

/// A sentence for the log and for `GET /v1/devices` on a host without a usable driver.
fn init_failure_reason(error: &NvmlError) -> String {
    match error {
        NvmlError::LibloadingError(e) => {
            format!("the NVML library could not be loaded (no NVIDIA driver?): {e}")
        }
        NvmlError::DriverNotLoaded => "the NVIDIA driver is not loaded".to_string(),
        NvmlError::LibraryNotFound => "the NVML library was not found".to_string(),
        other => format!("NVML failed to initialise: {other}"),
    }
}

fn nvml_error(e: NvmlError) -> DeviceError {
    DeviceError::Nvml(e.to_string())
}

impl GpuDevices for NvmlDevices {
    fn list(&self) -> Result<Vec<GpuDevice>, DeviceError> {
        let count = self.nvml.device_count().map_err(nvml_error)?;
        (0..count)
            .map(|i| self.device(i).map_err(nvml_error))
            .collect()
    }

    /// Sums the process's `used_gpu_memory` over every GPU's running compute processes
    /// (what `nvidia-smi --query-compute-apps=used_memory` shows).
    fn process_memory_mib(&self, pid: u32) -> Result<Option<u64>, DeviceError> {
        let count = self.nvml.device_count().map_err(nvml_error)?;
        let mut seen = false;
        let mut known_bytes: Option<u64> = None;
        for index in 0..count {
            let device = self.nvml.device_by_index(index).map_err(nvml_error)?;
            let processes = device.running_compute_processes().map_err(nvml_error)?;
            for process in processes.iter().filter(|p| p.pid == pid) {
                seen = true;
                if let UsedGpuMemory::Used(bytes) = process.used_gpu_memory {
                    known_bytes = Some(known_bytes.unwrap_or(0) + bytes);
                }
            }
        }
        match (seen, known_bytes) {
            (false, _) => Ok(None),
            (true, Some(bytes)) => Ok(Some(bytes.div_ceil(MIB))),
            // Seen but never measurable (WDDM, some MIG or container setups): a peak of 0 would
            // be a lie, so say it cannot be done.
            (true, None) => Err(DeviceError::Unsupported(format!(
                "the driver does not report GPU memory of process {pid}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a host without a driver (CI, this repository's developers) detection must give
    /// `NoDevices` with a reason, not fail; on a GPU host it lists at least one device.
    #[test]
    fn detection_never_fails() {
        let devices = NvmlDevices::detect();
        match devices.unavailable_reason() {
            Some(reason) => {
                assert!(!reason.is_empty());
                assert!(matches!(devices.list(), Err(DeviceError::Unavailable(_))));
            }
            None => {
                let listed = devices.list().expect("NVML lists devices");
                assert!(!listed.is_empty());
                assert!(listed
                    .iter()
                    .all(|d| d.memory_total_mib > 0 && !d.uuid.is_empty()));
                assert_eq!(
                    devices.process_memory_mib(std::process::id()).unwrap(),
                    None
                );
            }
        }
    }

    #[test]
    fn a_missing_library_reads_as_no_driver() {
        let reason = init_failure_reason(&NvmlError::LibraryNotFound);
        assert!(reason.contains("not found"));
        let reason = init_failure_reason(&NvmlError::DriverNotLoaded);
        assert!(reason.contains("not loaded"));
    }
}
