//! An answered figure by category: the one breakdown physics, the uncertainty, calibration
//! and the wire all read.

/// An answered figure by category, MiB. The categories sum to the figure. Serialised as an
/// object of the nine categories (the calibration store keeps each observation's).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct Breakdown {
    pub parameters: f64,
    pub gradients: f64,
    pub optimizer_state: f64,
    pub activations: f64,
    /// Workspaces and intermediates live at the peak (and, for a simulated job, whatever a
    /// learned correction adds: what the simulation cannot see).
    pub temporaries: f64,
    /// DDP's gradient buckets, FSDP/ZeRO's gather and reduce buffers.
    pub collective_buffers: f64,
    /// A paged optimizer's state: CUDA unified memory beside the allocator's segments.
    pub paged_optimizer_state: f64,
    /// Segments the caching allocator holds beyond the allocated bytes.
    pub allocator_cache: f64,
    /// CUDA context and cuBLAS/cuDNN handles: what every process pays outside the allocator.
    pub cuda_context: f64,
}

impl Breakdown {
    pub(crate) fn values(self) -> [f64; 9] {
        [
            self.parameters,
            self.gradients,
            self.optimizer_state,
            self.activations,
            self.temporaries,
            self.collective_buffers,
            self.paged_optimizer_state,
            self.allocator_cache,
            self.cuda_context,
        ]
    }

    fn from_values(v: [f64; 9]) -> Breakdown {
        Breakdown {
            parameters: v[0],
            gradients: v[1],
            optimizer_state: v[2],
            activations: v[3],
            temporaries: v[4],
            collective_buffers: v[5],
            paged_optimizer_state: v[6],
            allocator_cache: v[7],
            cuda_context: v[8],
        }
    }

    pub fn total(self) -> f64 {
        self.values().iter().sum()
    }

    /// Rounded to 0.1 MiB so that the rounded categories sum exactly to `total_mib` rounded
    /// to 0.1: each category is rounded down, and the tenths still missing go to the
    /// categories that lost the most in rounding (the largest-remainder method), so no
    /// category moves by more than 0.1.
    pub fn rounded(self, total_mib: f64) -> Breakdown {
        let exact = self.values().map(|v| v.max(0.0) * 10.0);
        let mut tenths = exact.map(f64::floor);
        let mut missing = (total_mib * 10.0).round() - tenths.iter().sum::<f64>();
        let mut by_remainder: Vec<usize> = (0..tenths.len()).collect();
        by_remainder.sort_by(|&a, &b| (exact[b] - tenths[b]).total_cmp(&(exact[a] - tenths[a])));
        for &i in by_remainder.iter().cycle().take(4 * tenths.len()) {
            if missing < 0.5 {
                break;
            }
            tenths[i] += 1.0;
            missing -= 1.0;
        }
        // Only when `total_mib` is below the categories' sum (a caller's mistake): take the
        // excess from the largest categories rather than answer a sum that is off.
        while missing <= -0.5 {
            let largest = (0..tenths.len())
                .max_by(|&a, &b| tenths[a].total_cmp(&tenths[b]))
                .expect("nine categories");
            if tenths[largest] < 1.0 {
                break;
            }
            tenths[largest] -= 1.0;
            missing += 1.0;
        }
        Breakdown::from_values(tenths.map(|t| t / 10.0))
    }
}

/// Where a breakdown's categories come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakdownSource {
    /// The job's whole-step simulation.
    Simulation,
    /// The analytic per-parameter bytes and the activations (traced or layer outputs).
    Analytic,
    /// The analytic training step of the job's setup on its most loaded GPU
    /// ([`super::step`]): jobs outside the setups the learned models know, without a simulation.
    Step,
}

impl BreakdownSource {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakdownSource::Simulation => "simulation",
            BreakdownSource::Analytic => "analytic",
            BreakdownSource::Step => "training_step",
        }
    }
}
