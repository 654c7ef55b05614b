//! Watching one process's GPU memory until it exits, to learn its real peak.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
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

/// One watch's progress: fed one reading at a time, by [`watch_process`] or by the [`Sampler`].
#[derive(Debug, Clone)]
pub struct Watch {
    pid: u32,
    max_duration: Duration,
    appear_timeout: Duration,
    started: Instant,
    peak_mib: u64,
    samples: u64,
}

impl Watch {
    pub fn new(pid: u32, config: &WatchConfig) -> Watch {
        Watch {
            pid,
            max_duration: config.max_duration,
            appear_timeout: config.appear_timeout,
            started: Instant::now(),
            peak_mib: 0,
            samples: 0,
        }
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    fn report(&self, ended: WatchEnd) -> WatchReport {
        WatchReport {
            pid: self.pid,
            peak_mib: self.peak_mib,
            samples: self.samples,
            ended,
            duration: self.started.elapsed(),
        }
    }

    /// The watch ended from outside (shutdown): the peak so far is a lower bound.
    pub fn stopped(&self) -> WatchReport {
        self.report(WatchEnd::Stopped)
    }

    /// Takes one reading of the process's GPU memory; `Some` when the watch is over.
    ///
    /// The process may not be on the GPU yet when the watch starts; readings of "absent" before
    /// the first sighting are waiting, not an exit. A device error ends the watch with it.
    pub fn step(
        &mut self,
        reading: Result<Option<u64>, DeviceError>,
    ) -> Option<Result<WatchReport, WatchError>> {
        let never_seen = |w: &Watch| WatchError::NeverSeen {
            pid: w.pid,
            waited: w.started.elapsed(),
        };
        match reading {
            Err(e) => return Some(Err(e.into())),
            Ok(Some(mib)) => {
                self.samples += 1;
                self.peak_mib = self.peak_mib.max(mib);
            }
            Ok(None) if self.samples > 0 => return Some(Ok(self.report(WatchEnd::Exited))),
            Ok(None) if self.started.elapsed() >= self.appear_timeout => {
                return Some(Err(never_seen(self)));
            }
            Ok(None) => {}
        }
        if self.started.elapsed() >= self.max_duration {
            return Some(match self.samples {
                0 => Err(never_seen(self)),
                _ => Ok(self.report(WatchEnd::TimedOut)),
            });
        }
        None
    }
}

/// Samples `pid`'s GPU memory every `config.interval` until it leaves the GPU, and reports the
/// largest reading. Blocking: for one watch on a thread of the caller's; the service runs its
/// watches on one [`Sampler`].
pub fn watch_process(
    devices: Arc<dyn GpuDevices>,
    pid: u32,
    config: &WatchConfig,
) -> Result<WatchReport, WatchError> {
    let mut watch = Watch::new(pid, config);
    loop {
        if config.stop.load(Ordering::Relaxed) {
            return Ok(watch.stopped());
        }
        if let Some(result) = watch.step(devices.process_memory_mib(pid)) {
            return result;
        }
        std::thread::sleep(config.interval);
    }
}

/// What to do with a watch's outcome; runs on the sampler's thread, so it should be quick
/// (recording a profile update is).
pub type WatchDone = Box<dyn FnOnce(Result<WatchReport, WatchError>) + Send>;

/// Why a watch was not started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddError {
    #[error("{capacity} processes are watched already, the most at once")]
    Full { capacity: usize },
    #[error("process {0} is watched already")]
    AlreadyWatched(u32),
    #[error("the service is shutting down")]
    Stopped,
    #[error("cannot start the sampler thread: {0}")]
    Thread(String),
}

/// Every watch of the service on one thread.
///
/// A watch lasts as long as a training job (hours), so a thread per watch let clients pile up
/// threads without limit. Here one thread reads every watched process when its interval is
/// due and sleeps until the next one is; it runs only while there are watches. At most
/// `capacity` processes are watched at once, each once.
pub struct Sampler {
    shared: Arc<Shared>,
}

struct Shared {
    devices: Arc<dyn GpuDevices>,
    capacity: usize,
    state: Mutex<SamplerState>,
    wake: Condvar,
}

#[derive(Default)]
struct SamplerState {
    watches: HashMap<u32, Entry>,
    running: bool,
    stopped: bool,
}

struct Entry {
    watch: Watch,
    interval: Duration,
    due: Instant,
    done: WatchDone,
}

impl Sampler {
    pub fn new(devices: Arc<dyn GpuDevices>, capacity: usize) -> Sampler {
        Sampler {
            shared: Arc::new(Shared {
                devices,
                capacity,
                state: Mutex::new(SamplerState::default()),
                wake: Condvar::new(),
            }),
        }
    }

    /// Starts watching `pid`; `done` gets the outcome. Refused when `pid` is watched already,
    /// when `capacity` watches run, or after [`Sampler::stop`].
    pub fn add(&self, pid: u32, config: &WatchConfig, done: WatchDone) -> Result<(), AddError> {
        let mut state = self.shared.lock();
        if state.stopped {
            return Err(AddError::Stopped);
        }
        if state.watches.contains_key(&pid) {
            return Err(AddError::AlreadyWatched(pid));
        }
        if state.watches.len() >= self.shared.capacity {
            return Err(AddError::Full {
                capacity: self.shared.capacity,
            });
        }
        let entry = Entry {
            watch: Watch::new(pid, config),
            interval: config.interval,
            due: Instant::now(),
            done,
        };
        if !state.running {
            let shared = Arc::clone(&self.shared);
            std::thread::Builder::new()
                .name("watch-sampler".into())
                .spawn(move || shared.run())
                .map_err(|e| AddError::Thread(e.to_string()))?;
            state.running = true;
        }
        state.watches.insert(pid, entry);
        drop(state);
        self.shared.wake.notify_all();
        Ok(())
    }

    /// Processes watched now.
    pub fn len(&self) -> usize {
        self.shared.lock().watches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Ends every watch (each reported [`WatchEnd::Stopped`]) and refuses new ones.
    pub fn stop(&self) {
        self.shared.lock().stopped = true;
        self.shared.wake.notify_all();
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, SamplerState> {
        // The state is consistent between statements; a panic elsewhere does not spoil it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The sampler's loop: read what is due, hand over what ended, sleep until the next due
    /// reading or a change; return when no watch is left.
    fn run(&self) {
        let mut state = self.lock();
        loop {
            if state.stopped {
                let ended: Vec<Entry> = state.watches.drain().map(|(_, e)| e).collect();
                state.running = false;
                drop(state);
                for entry in ended {
                    let report = entry.watch.stopped();
                    finish(entry.done, Ok(report));
                }
                return;
            }
            let now = Instant::now();
            let due: Vec<u32> = state
                .watches
                .iter()
                .filter(|(_, e)| e.due <= now)
                .map(|(pid, _)| *pid)
                .collect();
            if !due.is_empty() {
                // Readings go to the driver: not under the lock, which `add` takes.
                drop(state);
                let readings: Vec<_> = due
                    .iter()
                    .map(|&pid| (pid, self.devices.process_memory_mib(pid)))
                    .collect();
                state = self.lock();
                let mut ended = Vec::new();
                for (pid, reading) in readings {
                    let Some(entry) = state.watches.get_mut(&pid) else {
                        continue;
                    };
                    entry.due = now + entry.interval;
                    if let Some(outcome) = entry.watch.step(reading) {
                        let entry = state.watches.remove(&pid).expect("present");
                        ended.push((entry.done, outcome));
                    }
                }
                if !ended.is_empty() {
                    drop(state);
                    for (done, outcome) in ended {
                        finish(done, outcome);
                    }
                    state = self.lock();
                }
                continue;
            }
            let Some(next) = state.watches.values().map(|e| e.due).min() else {
                state.running = false;
                return;
            };
            let wait = next.saturating_duration_since(Instant::now());
            state = self
                .wake
                .wait_timeout(state, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// Hands over an outcome; a panic in the handler is logged and does not end the sampler.
fn finish(done: WatchDone, outcome: Result<WatchReport, WatchError>) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| done(outcome))).is_err() {
        tracing::error!("a watch's outcome handler panicked");
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

    fn collect() -> (
        WatchDone,
        std::sync::mpsc::Receiver<Result<WatchReport, WatchError>>,
    ) {
        let (send, receive) = std::sync::mpsc::channel();
        let done: WatchDone = Box::new(move |outcome| {
            let _ = send.send(outcome);
        });
        (done, receive)
    }

    #[test]
    fn the_sampler_watches_many_processes_on_one_thread() {
        let fake = Arc::new(FakeDevices::single("NVIDIA L4", 23034));
        let sampler = Sampler::new(fake.clone(), 10);
        let mut outcomes = Vec::new();
        for pid in 1..=5 {
            fake.script_process(pid, [None, Some(100 * pid as u64), Some(50), None]);
            let (done, receive) = collect();
            sampler.add(pid, &quick(5_000), done).unwrap();
            outcomes.push(receive);
        }
        for (pid, receive) in (1..=5).zip(outcomes) {
            let report = receive
                .recv_timeout(Duration::from_secs(5))
                .unwrap()
                .unwrap();
            assert_eq!(report.pid, pid);
            assert_eq!(report.peak_mib, 100 * pid as u64);
            assert!(report.complete());
        }
        assert_eq!(fake.reader_threads(), 1);
        assert!(sampler.is_empty());
    }

    #[test]
    fn the_sampler_refuses_a_pid_twice_and_beyond_its_capacity() {
        let fake = Arc::new(FakeDevices::single("NVIDIA L4", 23034));
        let sampler = Sampler::new(fake.clone(), 2);
        for pid in [1, 3] {
            fake.set_process_memory(pid, Some(100));
        }
        // Read once, then gone 300 ms later: it ends on its own.
        fake.script_process(2, [Some(100)]);
        let slow = WatchConfig::new(Duration::from_millis(300), Duration::from_secs(60));
        sampler.add(1, &quick(60_000), Box::new(|_| {})).unwrap();
        assert_eq!(
            sampler.add(1, &quick(60_000), Box::new(|_| {})),
            Err(AddError::AlreadyWatched(1))
        );
        sampler.add(2, &slow, Box::new(|_| {})).unwrap();
        assert_eq!(
            sampler.add(3, &quick(60_000), Box::new(|_| {})),
            Err(AddError::Full { capacity: 2 })
        );
        // A watch that ends frees its place.
        let deadline = Instant::now() + Duration::from_secs(5);
        while sampler.len() > 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let (done, receive) = collect();
        sampler.add(3, &quick(60_000), done).unwrap();
        sampler.stop();
        let report = receive
            .recv_timeout(Duration::from_secs(5))
            .unwrap()
            .unwrap();
        assert_eq!(report.ended, WatchEnd::Stopped);
        assert_eq!(
            sampler.add(4, &quick(60_000), Box::new(|_| {})),
            Err(AddError::Stopped)
        );
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
