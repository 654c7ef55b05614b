//! What a GPU model can do per second: the figures the roofline performance model
//! ([`crate::physics::perf`]) needs. Dense (no sparsity) peaks from the vendor's data sheets.

/// Peak throughput and shape of one GPU model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuPerformance {
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Resident warps one SM holds at most (64 on V100/A100/H100/B200, 48 on GA10x/AD10x, 32 on
    /// Turing): the denominator of SM occupancy.
    pub max_warps_per_sm: u32,
    /// Boost clock, MHz.
    pub boost_clock_mhz: u32,
    /// DRAM bandwidth, 10^9 bytes/s.
    pub memory_bandwidth_gb_s: f64,
    /// fp32 on the CUDA cores (no tensor cores), 10^12 FLOP/s.
    pub fp32_tflops: f64,
    /// TF32 on tensor cores, dense; `None` before Ampere.
    pub tf32_tflops: Option<f64>,
    /// fp16 on tensor cores (fp32 accumulate), dense.
    pub fp16_tflops: f64,
    /// bf16 on tensor cores, dense; `None` before Ampere.
    pub bf16_tflops: Option<f64>,
    /// fp8 on tensor cores, dense; `None` before Ada/Hopper.
    pub fp8_tflops: Option<f64>,
    /// GPU-to-GPU bandwidth each way within a node, 10^9 bytes/s: NVLink where the card has
    /// it, else its PCIe link ([`DEFAULT_INTERCONNECT_GB_S`] when unknown). Data-parallel
    /// collectives run on it.
    pub interconnect_gb_s: f64,
}

/// PCIe 4.0 x16, each way: the link of a card whose interconnect is not known.
pub const DEFAULT_INTERCONNECT_GB_S: f64 = 32.0;
