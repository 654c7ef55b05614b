//! The step's timeline: a host issuing ops one after another and a GPU running each when it is
//! issued and the previous one is done, in closed form for runs of kernels and repeated blocks.

use crate::devices::performance::GpuPerformance;
use crate::job::setup::Precision;

use super::*;

/// (host, done) after issuing `n` kernels of `duration` us, each `host_op` us of host work
/// after the last: the closed form of `host += host_op; done = max(done, host) + duration`
/// repeated `n` times, so that a job's cost follows its layers, not its parameter count (a
/// foreach optimizer over 10^16 elements is 10^10 launches). Unrolled, the last kernel ends at
/// `max(done + n d, max over j of host + j h + (n - j + 1) d)`, linear in j, so the inner
/// maximum sits at j = 1 or j = n.
pub(super) fn issue(host: f64, done: f64, host_op: f64, duration: f64, n: f64) -> (f64, f64) {
    if n < 1.0 {
        return (host, done);
    }
    let done = (done + n * duration)
        .max(host + host_op + n * duration)
        .max(host + n * host_op + duration);
    (host + n * host_op, done)
}

/// The step's timeline: the host issues ops one after another; the GPU runs each as soon as
/// it is issued and the previous one is done.
pub(super) struct Timeline<'a> {
    pub(super) gpu: &'a GpuPerformance,
    pub(super) constants: &'a Constants,
    pub(super) precision: Precision,
    /// When the host has issued the last op, and when the GPU finishes it (us).
    pub(super) host: f64,
    pub(super) done: f64,
    /// Kernel time bound by compute, by memory; SM-time share busy; warp-time share.
    pub(super) compute_us: f64,
    pub(super) memory_us: f64,
    pub(super) sm_busy: f64,
    pub(super) warps: f64,
    pub(super) flops: f64,
    pub(super) bytes: f64,
    /// Per kernel, precomputed once: SMs and their warps, the achievable FLOP rate per
    /// [`Unit`] (FLOP/us) and byte rate (B/us). A large model runs thousands of kernels.
    pub(super) sms: f64,
    pub(super) max_warps: f64,
    pub(super) compute_rate: [f64; 3],
    pub(super) memory_rate: f64,
}

impl<'a> Timeline<'a> {
    pub(super) fn new(
        gpu: &'a GpuPerformance,
        constants: &'a Constants,
        precision: Precision,
    ) -> Self {
        let rate = |unit| peak_tflops(gpu, precision, unit) * 1e6 * constants.compute_efficiency;
        Timeline {
            gpu,
            constants,
            precision,
            sms: f64::from(gpu.sm_count),
            max_warps: f64::from(gpu.max_warps_per_sm),
            compute_rate: [rate(Unit::Matmul), rate(Unit::Conv), rate(Unit::Vector)],
            memory_rate: gpu.memory_bandwidth_gb_s * 1e3 * constants.memory_efficiency,
            host: 0.0,
            done: 0.0,
            compute_us: 0.0,
            memory_us: 0.0,
            sm_busy: 0.0,
            warps: 0.0,
            flops: 0.0,
            bytes: 0.0,
        }
    }

    /// Peak FLOP/s (10^12) of a unit at the job's precision.
    /// Issues `count` copies of `kernel`.
    pub(super) fn run(&mut self, kernel: Kernel, count: usize) {
        let sms = self.sms;
        let active = (kernel.blocks / sms).min(1.0);
        let compute = kernel.flops / (self.compute_rate[kernel.unit as usize] * active);
        let memory = kernel.bytes / (self.memory_rate * active);
        let duration = compute.max(memory).max(KERNEL_MIN_US);
        // Warps resident on an active SM, over the most it holds.
        let per_sm = (kernel.blocks / (active * sms)).min(kernel.blocks_per_sm);
        let occupancy = (per_sm * kernel.warps_per_block / self.max_warps).min(1.0);
        let n = count as f64;
        (self.host, self.done) = issue(
            self.host,
            self.done,
            self.constants.host_us_per_op,
            duration,
            n,
        );
        if compute >= memory {
            self.compute_us += n * duration;
        } else {
            self.memory_us += n * duration;
        }
        self.sm_busy += n * duration * active;
        self.warps += n * duration * active * occupancy;
        self.flops += n * kernel.flops;
        self.bytes += n * kernel.bytes;
    }

    /// Waits for the GPU (a phase boundary the host synchronises on); returns the time.
    pub(super) fn sync(&mut self) -> f64 {
        self.host = self.done;
        self.done
    }

    /// A timeline that records what a run of kernels does to any starting point ([`Span`]):
    /// its host starts at 0 and its GPU at minus infinity, so that `done` ends as the part
    /// the host's start bounds and `host` as the host's own advance.
    pub(super) fn recording(&self) -> Timeline<'a> {
        Timeline {
            host: 0.0,
            done: f64::NEG_INFINITY,
            compute_us: 0.0,
            memory_us: 0.0,
            sm_busy: 0.0,
            warps: 0.0,
            flops: 0.0,
            bytes: 0.0,
            ..*self
        }
    }

    /// What this recording timeline's kernels do to a timeline they are issued on.
    pub(super) fn span(&self) -> Span {
        Span {
            // Every kernel's duration is in one of the two sums: their total is how far the
            // GPU's end moves when it, not the host, bounds each kernel.
            after_done: self.compute_us + self.memory_us,
            after_host: self.done,
            host: self.host,
            sums: Sums::of(self),
        }
    }

    /// Issues `span`'s kernels `count` times over.
    pub(super) fn repeat(&mut self, span: &Span, count: usize) {
        for _ in 0..count {
            self.done = (self.done + span.after_done).max(self.host + span.after_host);
            self.host += span.host;
        }
        let sums = Sums::of(self).plus(span.sums.times(count as f64));
        (self.compute_us, self.memory_us, self.sm_busy) =
            (sums.compute_us, sums.memory_us, sums.sm_busy);
        (self.warps, self.flops, self.bytes) = (sums.warps, sums.flops, sums.bytes);
    }
}

/// What issuing a run of kernels does to a timeline, whatever its start: [`issue`] is
/// `done' = max(done + a, host + b)`, `host' = host + c`, and a run of such steps is one of
/// the same form (max-plus algebra), so a block repeated 80 times is timed once and applied
/// 80 times: `done' = max(done + after_done, host + after_host)`, `host' = host + host`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Span {
    pub(super) after_done: f64,
    pub(super) after_host: f64,
    pub(super) host: f64,
    pub(super) sums: Sums,
}

/// A timeline's sums.
#[derive(Debug, Clone, Copy)]
pub(super) struct Sums {
    pub(super) compute_us: f64,
    pub(super) memory_us: f64,
    pub(super) sm_busy: f64,
    pub(super) warps: f64,
    pub(super) flops: f64,
    pub(super) bytes: f64,
}

impl Sums {
    pub(super) fn of(t: &Timeline) -> Sums {
        Sums {
            compute_us: t.compute_us,
            memory_us: t.memory_us,
            sm_busy: t.sm_busy,
            warps: t.warps,
            flops: t.flops,
            bytes: t.bytes,
        }
    }

    pub(super) fn times(self, k: f64) -> Sums {
        Sums {
            compute_us: self.compute_us * k,
            memory_us: self.memory_us * k,
            sm_busy: self.sm_busy * k,
            warps: self.warps * k,
            flops: self.flops * k,
            bytes: self.bytes * k,
        }
    }

    pub(super) fn plus(self, o: Sums) -> Sums {
        Sums {
            compute_us: self.compute_us + o.compute_us,
            memory_us: self.memory_us + o.memory_us,
            sm_busy: self.sm_busy + o.sm_busy,
            warps: self.warps + o.warps,
            flops: self.flops + o.flops,
            bytes: self.bytes + o.bytes,
        }
    }
}
