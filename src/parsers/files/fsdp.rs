//! FSDP options as accelerate writes them: its config (`distributed_type: FSDP`, `fsdp_config`,
//! `mixed_precision`, `num_processes`) or the `fsdp_config` mapping alone, keys with or without
//! their `fsdp_` prefix (the Trainer's own `fsdp_config` drops it).

use serde_json::{Map, Value};

use super::{boolean, count, keyword, place, present, shown, FileError, Read};
use crate::job::echo;
use crate::job::setup::{Precision, Strategy, MAX_WORLD_SIZE};

/// What accelerate's FSDP options state.
#[derive(Debug, Clone, PartialEq)]
pub struct Fsdp {
    pub strategy: Read<Strategy>,
    pub offload_parameters: Option<Read<bool>>,
    pub checkpointing: Option<Read<bool>>,
    /// accelerate's `mixed_precision`: autocast over fp32 weights, as the Trainer's flags.
    pub autocast: Option<Read<Precision>>,
    /// accelerate's `num_processes`: the GPUs of the job, every machine's.
    pub world_size: Option<Read<u64>>,
}

/// `sharding_strategy`'s names and the numbers accelerate also takes (1 to 5).
const STRATEGIES: [&str; 5] = [
    "FULL_SHARD",
    "SHARD_GRAD_OP",
    "NO_SHARD",
    "HYBRID_SHARD",
    "HYBRID_SHARD_ZERO2",
];

impl Fsdp {
    pub fn read(map: &Map<String, Value>, prefix: &str) -> Result<Fsdp, FileError> {
        let at = |key: &str| place(prefix, key);
        // The whole accelerate config, or its `fsdp_config` alone.
        let (options, inner_prefix, outer) = match present(map, "fsdp_config") {
            Some(Value::Object(inner)) => (inner, at("fsdp_config"), Some(map)),
            Some(other) => {
                return Err(FileError::new(
                    at("fsdp_config"),
                    format!("expected an object, got {}", shown(other)),
                ))
            }
            None => (map, prefix.to_string(), None),
        };
        if let Some(kind) = outer.and_then(|m| present(m, "distributed_type")) {
            if kind.as_str() != Some("FSDP") {
                return Err(FileError::new(
                    at("distributed_type"),
                    format!(
                        "{} is not FSDP: give the config as its own field",
                        shown(kind)
                    ),
                ));
            }
        }
        // A key as accelerate writes it (`fsdp_offload_params`) or as the Trainer does.
        let key = |name: &'static str| -> (&'static str, String) {
            let prefixed = match name {
                "sharding_strategy" => "fsdp_sharding_strategy",
                "reshard_after_forward" => "fsdp_reshard_after_forward",
                "offload_params" => "fsdp_offload_params",
                "activation_checkpointing" => "fsdp_activation_checkpointing",
                _ => name,
            };
            if options.contains_key(prefixed) {
                (prefixed, place(&inner_prefix, prefixed))
            } else {
                (name, place(&inner_prefix, name))
            }
        };
        let (name, from) = key("sharding_strategy");
        let sharding = match present(options, name) {
            None => None,
            Some(Value::Number(n)) => {
                let index = n.as_u64().filter(|i| (1..=5).contains(i)).ok_or_else(|| {
                    FileError::new(
                        &from,
                        format!("expected 1 to 5, got {}", shown(&Value::Number(n.clone()))),
                    )
                })?;
                Some(STRATEGIES[index as usize - 1])
            }
            Some(_) => keyword(
                options,
                &inner_prefix,
                name,
                &STRATEGIES,
                "is not a sharding strategy",
            )?,
        };
        let strategy = match sharding {
            Some("FULL_SHARD") => Some(Read::new(Strategy::Fsdp, from)),
            Some("SHARD_GRAD_OP") => Some(Read::new(Strategy::Zero2, from)),
            Some("NO_SHARD") => Some(Read::new(Strategy::Ddp, from)),
            Some(hybrid) => {
                return Err(FileError::new(
                    from,
                    format!(
                        "{} shards within a node and replicates across them, which the layout \
                         cannot say: state parallelism for one node's share",
                        echo(hybrid)
                    ),
                ))
            }
            None => None,
        };
        // FSDP2 says it with `reshard_after_forward`: true shards as FULL_SHARD does.
        let (name, from) = key("reshard_after_forward");
        let reshard = boolean(options, &inner_prefix, name)?.map(|reshard| {
            let strategy = if reshard {
                Strategy::Fsdp
            } else {
                Strategy::Zero2
            };
            Read::new(strategy, from)
        });
        let strategy = match (strategy, reshard) {
            (Some(a), Some(b)) if a.value != b.value => {
                return Err(FileError::new(
                    b.from,
                    format!("differs from {} ({})", a.from, a.value),
                ))
            }
            (Some(a), _) | (None, Some(a)) => a,
            (None, None) => Read::new(
                Strategy::Fsdp,
                format!("{prefix} (accelerate's default, FULL_SHARD)"),
            ),
        };
        let (name, from) = key("offload_params");
        let offload_parameters =
            boolean(options, &inner_prefix, name)?.map(|on| Read::new(on, from));
        let (name, from) = key("activation_checkpointing");
        let checkpointing = boolean(options, &inner_prefix, name)?.map(|on| Read::new(on, from));
        let (mut autocast, mut world_size) = (None, None);
        if let Some(outer) = outer {
            autocast = keyword(
                outer,
                prefix,
                "mixed_precision",
                &["no", "fp16", "bf16"],
                "is not a precision the service models",
            )?
            .and_then(|word| {
                // `no` leaves the precision to the weights and the Trainer's flags.
                let precision = match word {
                    "bf16" => Precision::AmpBf16,
                    "fp16" => Precision::AmpFp16,
                    _ => return None,
                };
                Some(Read::new(precision, at("mixed_precision")))
            });
            world_size = count(outer, prefix, "num_processes", MAX_WORLD_SIZE)?
                .map(|n| Read::new(n, at("num_processes")));
        }
        Ok(Fsdp {
            strategy,
            offload_parameters,
            checkpointing,
            autocast,
            world_size,
        })
    }
}
