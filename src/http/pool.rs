//! The threads that do estimate work (parsing, validation, the estimators and physics,
//! placement), apart from the async workers. The async workers accept connections, read
//! bodies, route and answer `/healthz` and `/readyz`; no estimate runs on them, so no estimate
//! can delay a probe (issue 34: two costly requests once stalled every route for 131 s).
//!
//! - Two sets of threads, one thread per core each; work waits in a queue, which the request
//!   permits and batch slots bound.
//! - Prompt threads, at the process's priority, answer single estimates priced at most
//!   [`PROMPT_UNITS`] (a fraction of a millisecond each): [`Work::Estimate`]. An estimate
//!   priced above is handed on to the bulk threads once priced ([`Work::LongEstimate`]).
//! - Bulk threads, at lower priority (Linux nice 10 below the process), run everything that
//!   may run long: batch parts, plans, calibration, admission reviews, long estimates. When
//!   every core is busy with them, an async worker woken by a probe or a new connection still
//!   runs at once. (Issue 47: at nice 10 the short estimates lost their core to anything else
//!   runnable on the host, a load generator or a neighbour, which halved throughput at 32
//!   connections; a thread cannot raise its priority back unprivileged, hence two sets.)
//! - Among bulk work, long single estimates go first: a thread free takes one before any part
//!   of a batch, so that a batch spread over every thread delays one by one part at most.
//!   But not forever: when no part has been taken for [`BATCH_PATIENCE`], the oldest waiting
//!   part goes next, so a flood of singles slows batches without starving them.
//! - Work nobody waits for stops: when the caller's future is dropped (the request answered
//!   503 at its timeout, or its connection closed) its [`Deadline`] is abandoned, and the work
//!   stops at its next check, or is not started. Work past its deadline is not started either.
//!   Stopped work is counted in `gpucast_cancelled_total`.

use std::collections::VecDeque;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::engine::Deadline;
use crate::error::ApiError;
use crate::http::body;
use crate::metrics::Metrics;

/// What a piece of work belongs to: its place in the queue and its metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    /// `POST /v1/estimate` until priced: on a prompt thread.
    Estimate,
    /// A single estimate priced above [`PROMPT_UNITS`], or an admission review: on a bulk
    /// thread, before batch parts.
    LongEstimate,
    /// A part of `POST /v1/estimate/batch` (or a plan, calibration): on a bulk thread, when
    /// no long estimate waits.
    Batch,
}

impl Work {
    pub fn as_str(self) -> &'static str {
        match self {
            Work::Estimate | Work::LongEstimate => "estimate",
            Work::Batch => "batch",
        }
    }
}

/// How far below the process's priority the bulk threads run: the async workers (at the
/// process's) then win a busy core whenever they have something to do.
#[cfg(target_os = "linux")]
const BULK_NICE: libc::c_int = 10;

/// The price ([`crate::engine::cost::Cost`]: units of about 0.1 us as priced; a release build
/// now spends less) up to which a single estimate stays on a prompt thread: the README's job is
/// 790 units, the describe job of floor-bench 3,571, Llama-3-8B's config on one card 3,904, on 16
/// cards 12,356.
pub const PROMPT_UNITS: u64 = 10_000;

type Job = Box<dyn FnOnce() + Send>;

/// How long batch parts wait behind single estimates before one of them goes first: under a
/// flood of singles, batches still get a part through every this often (a part is a few
/// milliseconds of work, so singles wait that much longer at most).
const BATCH_PATIENCE: Duration = Duration::from_millis(20);

/// How long a pool thread stays idle before it hands back the memory a batch part freed
/// (`body::release_freed_memory_when_idle`).
const RELEASE_AFTER_IDLE: Duration = Duration::from_millis(20);

#[derive(Default)]
struct Queues {
    /// Single estimates not yet priced: the prompt threads'.
    prompt: VecDeque<Job>,
    /// Long single estimates: the bulk threads', before batch parts.
    estimates: VecDeque<Job>,
    /// Parts of batches, each with when it was queued.
    batches: VecDeque<(Instant, Job)>,
    /// When a thread last took a batch part.
    last_batch_taken: Option<Instant>,
    closed: bool,
}

impl Queues {
    fn is_empty(&self) -> bool {
        self.estimates.is_empty() && self.batches.is_empty()
    }

    /// The next job for a free prompt thread.
    fn next_prompt(&mut self) -> Option<Job> {
        self.prompt.pop_front()
    }

    /// The next job for a free bulk thread: a batch part that has waited [`BATCH_PATIENCE`] since
    /// it was queued and since the last part was taken, else a single estimate, else a part.
    fn next(&mut self, now: Instant) -> Option<Job> {
        let part_due = self.batches.front().is_some_and(|(queued, _)| {
            let since = self.last_batch_taken.map_or(*queued, |t| t.max(*queued));
            now.saturating_duration_since(since) >= BATCH_PATIENCE
        });
        if !part_due {
            if let Some(job) = self.estimates.pop_front() {
                return Some(job);
            }
        }
        let (_, job) = self.batches.pop_front()?;
        self.last_batch_taken = Some(now);
        Some(job)
    }
}

struct Shared {
    queues: Mutex<Queues>,
    /// Bulk work queued.
    work: Condvar,
    /// Prompt work queued.
    prompt_work: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The estimate threads. Dropping the pool stops them once the work they run ends; work still
/// queued is dropped, and whoever waits on it gets a 500.
pub struct CpuPool {
    shared: Arc<Shared>,
    threads: usize,
    metrics: Arc<Metrics>,
}

impl CpuPool {
    /// `threads` bulk threads (at least one), named `gpucast-cpu-N`, and as many prompt
    /// threads, `gpucast-now-N`.
    pub fn new(threads: usize, metrics: Arc<Metrics>) -> std::io::Result<CpuPool> {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            queues: Mutex::new(Queues::default()),
            work: Condvar::new(),
            prompt_work: Condvar::new(),
        });
        for n in 0..threads {
            let bulk = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("gpucast-cpu-{n}"))
                .spawn(move || serve(&bulk))?;
            let prompt = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("gpucast-now-{n}"))
                .spawn(move || serve_prompt(&prompt))?;
        }
        Ok(CpuPool {
            shared,
            threads,
            metrics,
        })
    }

    /// How many bulk threads estimate at once: what a batch is spread over.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Queues `work` now and returns its outcome when done. Dropping the returned future
    /// before it is done abandons `deadline` (the work's own copy, checked inside its loops).
    /// Work whose deadline has passed or was abandoned when a thread takes it is not started;
    /// an outcome of [`ApiError::Timeout`] (not started, or stopped inside its loops) counts as
    /// cancelled.
    pub fn run<T, F>(
        &self,
        kind: Work,
        deadline: Deadline,
        work: F,
    ) -> impl Future<Output = Result<T, ApiError>> + Send + 'static
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T, ApiError> + Send + 'static,
    {
        let (sender, receiver) = tokio::sync::oneshot::channel();
        let metrics = Arc::clone(&self.metrics);
        let abandon = AbandonOnDrop(Some(deadline.clone()));
        let job: Job = Box::new(move || {
            let (stage, outcome) = if deadline.check().is_err() {
                ("queued", Err(ApiError::Timeout))
            } else {
                let outcome = catch_unwind(AssertUnwindSafe(work)).unwrap_or_else(|_| {
                    Err(ApiError::Internal(format!(
                        "{} work panicked",
                        kind.as_str()
                    )))
                });
                ("running", outcome)
            };
            if matches!(outcome, Err(ApiError::Timeout)) {
                metrics
                    .cancelled_total
                    .with_label_values(&[kind.as_str(), stage])
                    .inc();
            }
            // The caller may be gone (answered 503 at its timeout): nothing to tell.
            let _ = sender.send(outcome);
        });
        {
            let mut queues = self.shared.lock();
            match kind {
                Work::Estimate => queues.prompt.push_back(job),
                Work::LongEstimate => queues.estimates.push_back(job),
                Work::Batch => queues.batches.push_back((Instant::now(), job)),
            }
        }
        match kind {
            Work::Estimate => self.shared.prompt_work.notify_one(),
            Work::LongEstimate | Work::Batch => self.shared.work.notify_one(),
        }
        async move {
            let mut abandon = abandon;
            let outcome = receiver.await.unwrap_or_else(|_| {
                Err(ApiError::Internal(
                    "estimate work was dropped unfinished".into(),
                ))
            });
            abandon.0 = None;
            outcome
        }
    }
}

/// Abandons its deadline when dropped armed: the caller stopped waiting before the outcome.
struct AbandonOnDrop(Option<Deadline>);

impl Drop for AbandonOnDrop {
    fn drop(&mut self) {
        if let Some(deadline) = &self.0 {
            deadline.abandon();
        }
    }
}

impl Drop for CpuPool {
    fn drop(&mut self) {
        let dropped = {
            let mut queues = self.shared.lock();
            queues.closed = true;
            (
                std::mem::take(&mut queues.prompt),
                std::mem::take(&mut queues.estimates),
                std::mem::take(&mut queues.batches),
            )
        };
        // Outside the lock: dropping a job tells its caller.
        drop(dropped);
        self.shared.work.notify_all();
        self.shared.prompt_work.notify_all();
    }
}

/// One prompt thread: single estimates until priced, at the process's priority, until the pool
/// is dropped.
fn serve_prompt(shared: &Shared) {
    loop {
        let job = {
            let mut queues = shared.lock();
            loop {
                if queues.closed {
                    return;
                }
                if let Some(job) = queues.next_prompt() {
                    break job;
                }
                queues = shared
                    .prompt_work
                    .wait(queues)
                    .unwrap_or_else(|p| p.into_inner());
            }
        };
        job();
    }
}

/// One bulk thread: long single estimates first, then parts of batches ([`Queues::next`]),
/// until the pool is dropped.
fn serve(shared: &Shared) {
    lower_priority();
    loop {
        let job = {
            let mut queues = shared.lock();
            loop {
                if queues.closed {
                    return;
                }
                if let Some(job) = queues.next(Instant::now()) {
                    break job;
                }
                if body::release_due() {
                    // Memory a batch part freed goes back to the system once the thread has
                    // stayed idle a moment; a flood's next part reuses it instead.
                    let (waited, timeout) = shared
                        .work
                        .wait_timeout(queues, RELEASE_AFTER_IDLE)
                        .unwrap_or_else(|p| p.into_inner());
                    queues = waited;
                    if timeout.timed_out() && !queues.closed && queues.is_empty() {
                        drop(queues);
                        body::release_freed_memory();
                        queues = shared.lock();
                    }
                    continue;
                }
                queues = shared.work.wait(queues).unwrap_or_else(|p| p.into_inner());
            }
        };
        job();
    }
}

/// This thread [`BULK_NICE`] below the process (on Linux a nice value is a thread's own);
/// elsewhere, and where the system refuses, the thread keeps its priority.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: gettid, getpriority and setpriority read and set this thread's scheduling value
    // only. getpriority's -1 is nice -1 or an error; either way the thread counts from there.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        let base = libc::getpriority(libc::PRIO_PROCESS, tid);
        libc::setpriority(libc::PRIO_PROCESS, tid, (base + BULK_NICE).min(19));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(threads: usize) -> CpuPool {
        CpuPool::new(threads, Arc::new(Metrics::new())).expect("threads start")
    }

    /// A job that records its name when run.
    fn named(name: &'static str, ran: &Arc<Mutex<Vec<&'static str>>>) -> Job {
        let ran = Arc::clone(ran);
        Box::new(move || ran.lock().unwrap().push(name))
    }

    #[test]
    fn singles_go_first_until_a_part_has_waited_its_patience() {
        let ran = Arc::new(Mutex::new(Vec::new()));
        let start = Instant::now();
        let mut queues = Queues::default();
        queues.batches.push_back((start, named("part 1", &ran)));
        queues.batches.push_back((start, named("part 2", &ran)));
        for _ in 0..3 {
            queues.estimates.push_back(named("single", &ran));
        }
        // Before the patience: singles first.
        queues.next(start + BATCH_PATIENCE / 2).unwrap()();
        // Past it: one part goes first, then singles again until the patience passes anew.
        let late = start + BATCH_PATIENCE;
        queues.next(late).unwrap()();
        queues.next(late).unwrap()();
        queues.next(late + BATCH_PATIENCE).unwrap()();
        queues.next(late + BATCH_PATIENCE).unwrap()();
        assert!(queues.next(late + BATCH_PATIENCE).is_none());
        assert_eq!(
            *ran.lock().unwrap(),
            ["single", "part 1", "single", "part 2", "single"]
        );
    }

    #[tokio::test]
    async fn work_is_answered_by_the_pool_threads_short_estimates_by_the_prompt_ones() {
        let pool = pool(2);
        for (kind, prefix) in [
            (Work::Estimate, "gpucast-now-"),
            (Work::LongEstimate, "gpucast-cpu-"),
            (Work::Batch, "gpucast-cpu-"),
        ] {
            let name = pool
                .run(kind, Deadline::NONE, || {
                    Ok(std::thread::current().name().map(str::to_owned))
                })
                .await
                .unwrap();
            assert!(name.unwrap().starts_with(prefix), "{kind:?}");
        }
    }

    #[tokio::test]
    async fn a_short_estimate_is_answered_while_bulk_work_takes_every_bulk_thread() {
        let pool = pool(1);
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let busy = pool.run(Work::Batch, Deadline::NONE, move || {
            hold.recv().ok();
            Ok(())
        });
        assert_eq!(
            pool.run(Work::Estimate, Deadline::NONE, || Ok(7))
                .await
                .unwrap(),
            7
        );
        release.send(()).unwrap();
        busy.await.unwrap();
    }

    #[tokio::test]
    async fn work_past_its_deadline_is_not_started_and_counted_cancelled() {
        let pool = pool(1);
        let passed = Deadline::at(Instant::now() - Duration::from_millis(1));
        let outcome = pool
            .run(Work::Batch, passed, || -> Result<(), ApiError> {
                panic!("must not start")
            })
            .await;
        assert!(matches!(outcome, Err(ApiError::Timeout)));
        let metrics = pool.metrics.render();
        assert!(
            metrics.contains(r#"gpucast_cancelled_total{stage="queued",work="batch"} 1"#),
            "{metrics}"
        );
    }

    #[tokio::test]
    async fn work_whose_caller_stopped_waiting_stops_at_its_next_check() {
        let pool = pool(1);
        let deadline = Deadline::at(Instant::now() + Duration::from_secs(60));
        let (started, running) = std::sync::mpsc::channel::<()>();
        let (stopped, stop) = std::sync::mpsc::channel::<bool>();
        let work = deadline.clone();
        let waiting = pool.run(Work::Batch, deadline, move || {
            started.send(()).unwrap();
            // A long loop, checking its deadline at every step.
            let outcome: Result<(), ApiError> = loop {
                if let Err(error) = work.check() {
                    break Err(error);
                }
                std::thread::sleep(Duration::from_millis(1));
            };
            stopped
                .send(matches!(outcome, Err(ApiError::Timeout)))
                .unwrap();
            outcome
        });
        // Polled once, so that it is a future that waits; then dropped, as at a timeout.
        let mut waiting = Box::pin(waiting);
        assert!(futures_poll_once(waiting.as_mut()).await.is_none());
        running.recv().unwrap();
        drop(waiting);
        assert!(stop.recv_timeout(Duration::from_secs(5)).unwrap());
        // Counted once the work has returned, just after.
        let counted = Instant::now();
        let line = r#"gpucast_cancelled_total{stage="running",work="batch"} 1"#;
        while !pool.metrics.render().contains(line) {
            assert!(counted.elapsed() < Duration::from_secs(5), "not counted");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// One poll of `future`: its output if ready.
    async fn futures_poll_once<F: Future + Unpin>(future: F) -> Option<F::Output> {
        let mut future = future;
        std::future::poll_fn(|context| {
            std::task::Poll::Ready(match std::pin::Pin::new(&mut future).poll(context) {
                std::task::Poll::Ready(output) => Some(output),
                std::task::Poll::Pending => None,
            })
        })
        .await
    }

    #[tokio::test]
    async fn a_panic_is_an_internal_error_and_the_thread_serves_on() {
        let pool = pool(1);
        let outcome = pool
            .run(
                Work::Estimate,
                Deadline::NONE,
                || -> Result<(), ApiError> { panic!("boom") },
            )
            .await;
        assert!(matches!(outcome, Err(ApiError::Internal(_))));
        assert_eq!(
            pool.run(Work::Estimate, Deadline::NONE, || Ok(7))
                .await
                .unwrap(),
            7
        );
    }

    #[tokio::test]
    async fn a_waiting_long_estimate_goes_before_waiting_batch_parts() {
        let pool = pool(1);
        let order = Arc::new(Mutex::new(Vec::new()));
        // Holds the one thread while the others queue.
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let busy = pool.run(Work::Batch, Deadline::NONE, move || {
            hold.recv().ok();
            Ok(())
        });
        let mut waiting = Vec::new();
        for (kind, label) in [
            (Work::Batch, "batch 1"),
            (Work::Batch, "batch 2"),
            (Work::LongEstimate, "single"),
        ] {
            let order = Arc::clone(&order);
            waiting.push(pool.run(kind, Deadline::NONE, move || {
                order.lock().unwrap().push(label);
                Ok(())
            }));
        }
        release.send(()).unwrap();
        busy.await.unwrap();
        for done in waiting {
            done.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["single", "batch 1", "batch 2"]);
    }
}
