//! The GPU layout: the strategy and degrees, DeepSpeed ZeRO's buffers, what is offloaded to
//! the CPU; parsed from the request.

use super::*;
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Strategy {
    #[default]
    None,
    Ddp,
    Fsdp,
    Zero1,
    Zero2,
    Zero3,
}

impl Strategy {
    pub const ALL: [Strategy; 6] = [
        Strategy::None,
        Strategy::Ddp,
        Strategy::Fsdp,
        Strategy::Zero1,
        Strategy::Zero2,
        Strategy::Zero3,
    ];

    pub fn parse(raw: &str) -> Option<Strategy> {
        match raw.to_ascii_lowercase().replace(['-', ' '], "_").as_str() {
            "none" | "single" => Some(Strategy::None),
            "ddp" => Some(Strategy::Ddp),
            "fsdp" | "fsdp2" | "full_shard" => Some(Strategy::Fsdp),
            "zero1" | "zero_1" => Some(Strategy::Zero1),
            "zero2" | "zero_2" => Some(Strategy::Zero2),
            "zero3" | "zero_3" => Some(Strategy::Zero3),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::None => "none",
            Strategy::Ddp => "ddp",
            Strategy::Fsdp => "fsdp",
            Strategy::Zero1 => "zero1",
            Strategy::Zero2 => "zero2",
            Strategy::Zero3 => "zero3",
        }
    }

    /// (optimizer state, gradients, weights) sharded across the data-parallel ranks.
    pub fn shards(self) -> (bool, bool, bool) {
        match self {
            Strategy::None | Strategy::Ddp => (false, false, false),
            Strategy::Zero1 => (true, false, false),
            Strategy::Zero2 => (true, true, false),
            Strategy::Fsdp | Strategy::Zero3 => (true, true, true),
        }
    }
}

/// The GPU layout: `world_size = data x tensor x pipeline x context` degrees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallelism {
    pub strategy: Strategy,
    pub world_size: u64,
    pub tensor: u64,
    pub pipeline: u64,
    pub context: u64,
    /// Tensor parallelism splits the norms' and first linears' inputs along the sequence too.
    pub sequence_parallel: bool,
}

impl Default for Parallelism {
    fn default() -> Parallelism {
        Parallelism {
            strategy: Strategy::None,
            world_size: 1,
            tensor: 1,
            pipeline: 1,
            context: 1,
            sequence_parallel: false,
        }
    }
}

impl Parallelism {
    /// The data-parallel degree: the ranks that hold the same layers.
    pub fn data(self) -> u64 {
        self.world_size / (self.tensor * self.pipeline * self.context)
    }

    pub fn is_single_gpu(self) -> bool {
        self.world_size == 1
    }
}

/// Largest element count a ZeRO buffer setting may state (DeepSpeed's own defaults are at most
/// 1e12: `sub_group_size` in stage3.py's signature).
pub const MAX_ZERO_ELEMENTS: u64 = 1_000_000_000_000_000;

/// DeepSpeed ZeRO's buffer settings, in elements (`zero_optimization` of its config). Each
/// defaults to DeepSpeed's own (`DeepSpeedZeroConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZeroBuffers {
    /// `reduce_bucket_size`: the contiguous gradient bucket, allocated whole at start-up.
    pub reduce_bucket: u64,
    /// `stage3_prefetch_bucket_size`: parameters gathered ahead of their use.
    pub prefetch_bucket: u64,
    /// `stage3_max_live_parameters`: no prefetch past this many gathered.
    pub max_live_parameters: u64,
    /// `stage3_max_reuse_distance`: a gathered parameter used again within this many
    /// elements of the trace stays gathered.
    pub max_reuse_distance: u64,
    /// `stage3_param_persistence_threshold`: parameters this small are never partitioned.
    pub persistence_threshold: u64,
    /// `sub_group_size`: the optimizer steps its partition in groups this large.
    pub sub_group: u64,
}

impl Default for ZeroBuffers {
    fn default() -> ZeroBuffers {
        ZeroBuffers {
            reduce_bucket: 500_000_000,
            prefetch_bucket: 50_000_000,
            max_live_parameters: 1_000_000_000,
            max_reuse_distance: 1_000_000_000,
            persistence_threshold: 100_000,
            sub_group: 1_000_000_000,
        }
    }
}

/// What lives in CPU memory instead of the GPU's (DeepSpeed ZeRO-Offload, FSDP's
/// `CPUOffload(offload_params=True)`, torchao's `CPUOffloadOptimizer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Offload {
    /// The optimizer's state, and its step, run on the CPU.
    pub optimizer_state: bool,
    /// Each gradient is copied to the CPU as backward produces it (accumulated there).
    pub gradients: bool,
    /// The weights live on the CPU; each unit (a repeated block) is brought in for its
    /// forward and backward. Implies the gradients and the optimizer state (FSDP and ZeRO-3
    /// offload them with the parameters).
    pub parameters: bool,
}

impl Offload {
    pub fn any(self) -> bool {
        self.optimizer_state || self.gradients || self.parameters
    }
}

pub(super) fn degree(field: &str, raw: Option<u64>) -> Result<u64, SetupError> {
    match raw {
        None => Ok(1),
        Some(d) if (1..=MAX_WORLD_SIZE).contains(&d) => Ok(d),
        Some(d) => Err(SetupError::new(
            field,
            format!("must be between 1 and {MAX_WORLD_SIZE}, got {d}"),
        )),
    }
}

pub(super) fn parallelism(
    raw: Option<UncheckedParallelism<'_>>,
) -> Result<Parallelism, SetupError> {
    let Some(raw) = raw else {
        return Ok(Parallelism::default());
    };
    let strategy = match raw.strategy {
        None => Strategy::None,
        Some(name) => Strategy::parse(name).ok_or_else(|| {
            SetupError::new(
                "parallelism.strategy",
                format!(
                    "unknown strategy '{}' (known: {})",
                    echo(name),
                    known(&Strategy::ALL, Strategy::as_str)
                ),
            )
        })?,
    };
    let tensor = degree("parallelism.tensor_parallel", raw.tensor_parallel)?;
    let pipeline = degree("parallelism.pipeline_parallel", raw.pipeline_parallel)?;
    let context = degree("parallelism.context_parallel", raw.context_parallel)?;
    let model_parallel = tensor * pipeline * context;
    let world_size = match raw.world_size {
        Some(0) => {
            return Err(SetupError::new(
                "parallelism.world_size",
                "must be at least 1, got 0",
            ))
        }
        Some(w) if w > MAX_WORLD_SIZE => {
            return Err(SetupError::new(
                "parallelism.world_size",
                format!("must be at most {MAX_WORLD_SIZE}, got {w}"),
            ))
        }
        Some(w) => w,
        None if matches!(strategy, Strategy::None | Strategy::Ddp) => model_parallel,
        None => {
            return Err(SetupError::new(
                "parallelism.world_size",
                format!(
                    "{} shards across the data-parallel ranks: give the world size",
                    strategy.as_str()
                ),
            ))
        }
    };
    if model_parallel > MAX_WORLD_SIZE || !world_size.is_multiple_of(model_parallel) {
        return Err(SetupError::new(
            "parallelism.world_size",
            format!(
                "{world_size} GPUs cannot be split into tensor x pipeline x context = \
                 {tensor} x {pipeline} x {context} groups"
            ),
        ));
    }
    if strategy == Strategy::None && world_size / model_parallel > 1 {
        return Err(SetupError::new(
            "parallelism.strategy",
            format!(
                "{} data-parallel ranks need a strategy (ddp, fsdp, zero1, zero2, zero3)",
                world_size / model_parallel
            ),
        ));
    }
    Ok(Parallelism {
        strategy,
        world_size,
        tensor,
        pipeline,
        context,
        sequence_parallel: raw.sequence_parallel.unwrap_or(false),
    })
}

/// What is offloaded. Parameters go with their gradients and optimizer state (as FSDP's
/// `CPUOffload(offload_params=True)` and ZeRO-3's `offload_param` do), and only where the
/// weights are sharded by units (`fsdp`, `zero3`; one GPU may run ZeRO-3 alone).
pub(super) fn offload(
    raw: Option<UncheckedOffload>,
    parallelism: Parallelism,
) -> Result<Offload, SetupError> {
    let Some(raw) = raw else {
        return Ok(Offload::default());
    };
    let parameters = raw.parameters.unwrap_or(false);
    if parameters {
        if raw.gradients == Some(false) || raw.optimizer_state == Some(false) {
            return Err(SetupError::new(
                "offload.parameters",
                "offloaded parameters take their gradients and optimizer state with them \
                 (FSDP CPUOffload, ZeRO-3 offload_param): leave those out or true",
            ));
        }
        if !matches!(parallelism.strategy, Strategy::Fsdp | Strategy::Zero3) {
            return Err(SetupError::new(
                "offload.parameters",
                "parameters are offloaded unit by unit by FSDP or ZeRO-3: set \
                 parallelism.strategy to fsdp or zero3 (world_size 1 is allowed)",
            ));
        }
    }
    Ok(Offload {
        optimizer_state: parameters || raw.optimizer_state.unwrap_or(false),
        gradients: parameters || raw.gradients.unwrap_or(false),
        parameters,
    })
}

/// ZeRO's buffer settings: given ones in range, the rest DeepSpeed's defaults; only under a
/// ZeRO strategy (nothing else reads them).
pub(super) fn zero(
    raw: Option<UncheckedZero>,
    parallelism: Parallelism,
) -> Result<ZeroBuffers, SetupError> {
    let defaults = ZeroBuffers::default();
    let Some(raw) = raw else {
        return Ok(defaults);
    };
    if !matches!(
        parallelism.strategy,
        Strategy::Zero1 | Strategy::Zero2 | Strategy::Zero3
    ) {
        return Err(SetupError::new(
            "zero",
            "DeepSpeed ZeRO's buffers go with parallelism.strategy zero1, zero2 or zero3",
        ));
    }
    // A bucket holds at least one element; the other settings may be 0 (no prefetch, no
    // reuse, nothing persistent).
    let read = |field: &str, given: Option<u64>, default: u64, least: u64| match given {
        None => Ok(default),
        Some(n) if (least..=MAX_ZERO_ELEMENTS).contains(&n) => Ok(n),
        Some(n) => Err(SetupError::new(
            format!("zero.{field}"),
            format!("must be between {least} and {MAX_ZERO_ELEMENTS} elements, got {n}"),
        )),
    };
    Ok(ZeroBuffers {
        reduce_bucket: read(
            "reduce_bucket_size",
            raw.reduce_bucket_size,
            defaults.reduce_bucket,
            1,
        )?,
        prefetch_bucket: read(
            "prefetch_bucket_size",
            raw.prefetch_bucket_size,
            defaults.prefetch_bucket,
            0,
        )?,
        max_live_parameters: read(
            "max_live_parameters",
            raw.max_live_parameters,
            defaults.max_live_parameters,
            0,
        )?,
        max_reuse_distance: read(
            "max_reuse_distance",
            raw.max_reuse_distance,
            defaults.max_reuse_distance,
            0,
        )?,
        persistence_threshold: read(
            "param_persistence_threshold",
            raw.param_persistence_threshold,
            defaults.persistence_threshold,
            0,
        )?,
        sub_group: read("sub_group_size", raw.sub_group_size, defaults.sub_group, 1)?,
    })
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
