//! Watching one process's GPU memory until it exits, to learn its real peak.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::devices::{DeviceError, GpuDevices};

/// How to watch a process.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    /// Time between two readings. nvidia-smi-based measurements (the training data) used 1 s;
    /// shorter catches shorter spikes.
    pub interval: Duration,
    /// The longest a watch may last, whatever the process does.
    pub max_duration: Duration,
    /// How long to wait for the process to appear on the GPU at all (CUDA start-up takes
    /// seconds); after that, a process never seen is an error.
    pub appear_timeout: Duration,
    /// Set to stop the watch early (e.g. on shutdown); checked before every reading.
    pub stop: Arc<AtomicBool>,
}

impl WatchConfig {
    pub fn new(interval: Duration, max_duration: Duration) -> WatchConfig {
        WatchConfig {
            interval,
            max_duration,
            appear_timeout: max_duration.min(Duration::from_secs(120)),
            stop: Arc::new(AtomicBool::new(false)),
        }
    }
}

/// Why a watch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WatchEnd {
    /// The process left the GPU: the peak is the job's peak.
    Exited,
    /// `max_duration` passed with the process still running: the peak so far is a lower bound.
    TimedOut,
    /// The stop flag was set: the peak so far is a lower bound.
    Stopped,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchReport {
    pub pid: u32,
    pub peak_mib: u64,
    /// Readings in which the process was on the GPU.
    pub samples: u64,
    pub ended: WatchEnd,
    pub duration: Duration,
}

impl WatchReport {
    /// Whether the peak is the whole job's and so may be recorded as an observation.
    pub fn complete(&self) -> bool {
        self.ended == WatchEnd::Exited
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WatchError {
    #[error("process {pid} did not appear on any GPU within {waited:?}")]
    NeverSeen { pid: u32, waited: Duration },
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// Samples `pid`'s GPU memory every `config.interval` until it leaves the GPU, and reports the
/// largest reading. Blocking: run it on `tokio::task::spawn_blocking` or a thread of its own.
///
/// The process may not be on the GPU yet when the watch starts; readings of "absent" before
/// the first sighting are waiting, not an exit. A device error ends the watch with that error.
pub fn watch_process(
    devices: Arc<dyn GpuDevices>,
    pid: u32,
    config: &WatchConfig,
) -> Result<WatchReport, WatchError> {
    let started = Instant::now();
    let mut peak_mib = 0;
    let mut samples = 0;
    let report = |peak_mib, samples, ended| WatchReport {
        pid,
        peak_mib,
        samples,
        ended,
        duration: started.elapsed(),
    };
    loop {
        if config.stop.load(Ordering::Relaxed) {
            return Ok(report(peak_mib, samples, WatchEnd::Stopped));
        }
        match devices.process_memory_mib(pid)? {
            Some(mib) => {
                samples += 1;
                peak_mib = peak_mib.max(mib);
            }
            None if samples > 0 => return Ok(report(peak_mib, samples, WatchEnd::Exited)),
            None if started.elapsed() >= config.appear_timeout => {
                return Err(WatchError::NeverSeen {
                    pid,
                    waited: started.elapsed(),
                });
            }
            None => {}
        }
        if started.elapsed() >= config.max_duration {
            return match samples {
                0 => Err(WatchError::NeverSeen {
                    pid,
                    waited: started.elapsed(),
                }),
                _ => Ok(report(peak_mib, samples, WatchEnd::TimedOut)),
            };
        }
        std::thread::sleep(config.interval);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{FakeDevices, NoDevices};

    fn quick(max_ms: u64) -> WatchConfig {
        WatchConfig::new(Duration::from_millis(1), Duration::from_millis(max_ms))
    }

    #[test]
    fn the_peak_is_the_largest_reading_before_exit() {
        let fake = Arc::new(FakeDevices::single("NVIDIA A100-SXM4-40GB", 40960));
        fake.script_process(
            4242,
            [
                None,
                None,
                Some(400),
                Some(2100),
                Some(3900),
                Some(3100),
                None,
            ],
        );
        let report = watch_process(fake, 4242, &quick(5_000)).unwrap();
        assert_eq!(report.peak_mib, 3900);
        assert_eq!(report.samples, 4);
        assert_eq!(report.ended, WatchEnd::Exited);
        assert!(report.complete());
    }

    #[test]
    fn a_process_still_running_at_the_limit_gives_a_partial_peak() {
        let fake = Arc::new(FakeDevices::single("NVIDIA L4", 23034));
        fake.script_process(7, [Some(100), Some(800)]);
        fake.set_process_memory(7, Some(600));
        let report = watch_process(fake, 7, &quick(30)).unwrap();
        assert_eq!(report.peak_mib, 800);
        assert_eq!(report.ended, WatchEnd::TimedOut);
        assert!(!report.complete());
        assert!(report.duration >= Duration::from_millis(30));
    }

    #[test]
    fn a_process_that_never_appears_is_an_error() {
        let fake = Arc::new(FakeDevices::single("NVIDIA L4", 23034));
        let mut config = quick(1_000);
        config.appear_timeout = Duration::from_millis(20);
        let error = watch_process(fake, 99, &config).unwrap_err();
        assert!(matches!(error, WatchError::NeverSeen { pid: 99, .. }));
    }

    #[test]
    fn the_stop_flag_ends_a_watch() {
        let fake = Arc::new(FakeDevices::single("NVIDIA L4", 23034));
        fake.set_process_memory(5, Some(1000));
        let config = quick(60_000);
        let stop = config.stop.clone();
        let handle = std::thread::spawn(move || watch_process(fake, 5, &config));
        std::thread::sleep(Duration::from_millis(20));
        stop.store(true, Ordering::Relaxed);
        let report = handle.join().unwrap().unwrap();
        assert_eq!(report.ended, WatchEnd::Stopped);
        assert_eq!(report.peak_mib, 1000);
    }

    #[test]
    fn without_a_driver_the_watch_fails_with_the_reason() {
        let none: Arc<dyn GpuDevices> = Arc::new(NoDevices::new("no driver"));
        let error = watch_process(none, 1, &quick(100)).unwrap_err();
        assert_eq!(
            error,
            WatchError::Device(DeviceError::Unavailable("no driver".into()))
        );
    }
}
