//! Hugging Face `TrainingArguments.to_dict()`, as the Trainer saves it: the micro-batch, the
//! accumulation, checkpointing, the precision flags, `optim`, FSDP and the DeepSpeed entry.

use serde_json::{Map, Value};

use super::{boolean, count, place, present, shown, text, FileError, Read, MAX_MICRO_BATCH};
use crate::job::echo;
use crate::job::setup::{
    Optimizer, OptimizerImplementation, Precision, Strategy, MAX_ACCUMULATION,
};

/// What the Trainer's arguments state.
#[derive(Debug, Clone, Default)]
pub struct TrainingArguments<'a> {
    pub micro_batch_size: Option<Read<u64>>,
    pub accumulation: Option<Read<u64>>,
    pub checkpointing: Option<Read<bool>>,
    /// `bf16` / `fp16` (or their `_full_eval`): autocast over the model's weights.
    pub autocast: Option<Read<Precision>>,
    /// Without autocast: `tf32` or plain fp32.
    pub plain_precision: Option<Read<Precision>>,
    /// The raw flags, for DeepSpeed's `auto` (`bf16|bf16_full_eval`, `fp16|fp16_full_eval`).
    pub bf16: bool,
    pub fp16: bool,
    /// Whether the flags were stated at all (a bare dict of a few keys may leave them out).
    pub states_precision: bool,
    pub optimizer: Option<Read<Optimizer>>,
    pub implementation: Option<Read<OptimizerImplementation>>,
    pub fsdp: Option<Read<Strategy>>,
    pub fsdp_offload: Option<Read<bool>>,
    /// The `deepspeed` entry when it is the config itself (a dict).
    pub deepspeed: Option<&'a Map<String, Value>>,
    pub warnings: Vec<String>,
}

/// The Trainer's `optim` names the service models, and what each runs.
const OPTIM: &[(&str, Optimizer, OptimizerImplementation)] = {
    use Optimizer as O;
    use OptimizerImplementation as I;
    &[
        // torch.optim.AdamW with its defaults: foreach on a GPU.
        ("adamw_torch", O::AdamW, I::Foreach),
        ("adamw_torch_fused", O::AdamW, I::Fused),
        ("adamw_apex_fused", O::AdamW, I::Fused),
        // transformers' own AdamW and Adafactor step parameter by parameter.
        ("adamw_hf", O::AdamW, I::ForLoop),
        ("adafactor", O::Adafactor, I::ForLoop),
        ("sgd", O::Sgd, I::Foreach),
        // bitsandbytes: its own fused kernels.
        ("adamw_bnb_8bit", O::AdamW8bit, I::Fused),
        ("adamw_8bit", O::AdamW8bit, I::Fused),
        ("paged_adamw_8bit", O::PagedAdamW8bit, I::Fused),
        ("paged_adamw_32bit", O::PagedAdamW, I::Fused),
        ("paged_adamw", O::PagedAdamW, I::Fused),
    ]
};

/// The `optim` names read, for the error that lists them.
pub fn optim_names() -> String {
    OPTIM
        .iter()
        .map(|(name, ..)| *name)
        .collect::<Vec<_>>()
        .join(", ")
}

impl<'a> TrainingArguments<'a> {
    pub fn read(map: &'a Map<String, Value>, prefix: &str) -> Result<Self, FileError> {
        let at = |key: &str| place(prefix, key);
        let mut args = TrainingArguments {
            micro_batch_size: count(map, prefix, "per_device_train_batch_size", MAX_MICRO_BATCH)?
                .map(|n| Read::new(n, at("per_device_train_batch_size"))),
            accumulation: count(map, prefix, "gradient_accumulation_steps", MAX_ACCUMULATION)?
                .map(|n| Read::new(n, at("gradient_accumulation_steps"))),
            checkpointing: boolean(map, prefix, "gradient_checkpointing")?
                .map(|b| Read::new(b, at("gradient_checkpointing"))),
            ..TrainingArguments::default()
        };
        let flag = |key: &str| boolean(map, prefix, key).map(|b| b.unwrap_or(false));
        args.bf16 = flag("bf16")? || flag("bf16_full_eval")?;
        args.fp16 = flag("fp16")? || flag("fp16_full_eval")?;
        args.states_precision = ["bf16", "fp16"].iter().any(|k| present(map, k).is_some());
        let (bf16, fp16) = (flag("bf16")?, flag("fp16")?);
        args.autocast = match (bf16, fp16) {
            (true, true) => {
                return Err(FileError::new(
                    at("bf16"),
                    format!("and {} are both true: give one", at("fp16")),
                ))
            }
            (true, false) => Some(Read::new(Precision::AmpBf16, at("bf16"))),
            (false, true) => Some(Read::new(Precision::AmpFp16, at("fp16"))),
            (false, false) => None,
        };
        if args.autocast.is_none() && args.states_precision {
            args.plain_precision = Some(if flag("tf32")? {
                Read::new(Precision::Tf32, at("tf32"))
            } else {
                Read::new(
                    Precision::Fp32,
                    format!("{} and {} false", at("bf16"), at("fp16")),
                )
            });
        }
        if let Some(name) = text(map, prefix, "optim")? {
            let key = name.trim().to_ascii_lowercase();
            let Some((_, optimizer, implementation)) = OPTIM.iter().find(|(n, ..)| *n == key)
            else {
                return Err(FileError::new(
                    at("optim"),
                    format!(
                        "'{}' is not an optimizer the service models (known: {})",
                        echo(name),
                        optim_names()
                    ),
                ));
            };
            args.optimizer = Some(Read::new(*optimizer, at("optim")));
            args.implementation = Some(Read::new(*implementation, at("optim")));
        }
        args.read_fsdp(map, prefix)?;
        match present(map, "deepspeed") {
            None => {}
            Some(Value::Object(inner)) => args.deepspeed = Some(inner),
            Some(Value::String(path)) => args.warnings.push(format!(
                "{}: '{}' is a path, not read: give the file's contents as `deepspeed`",
                at("deepspeed"),
                echo(path)
            )),
            Some(other) => {
                return Err(FileError::new(
                    at("deepspeed"),
                    format!(
                        "expected a DeepSpeed config (an object) or a path, got {}",
                        shown(other)
                    ),
                ))
            }
        }
        Ok(args)
    }

    /// `fsdp`: the Trainer's space-separated options (`"full_shard auto_wrap offload"`) or
    /// their list; empty is none.
    fn read_fsdp(&mut self, map: &Map<String, Value>, prefix: &str) -> Result<(), FileError> {
        let at = place(prefix, "fsdp");
        let options: Vec<String> = match present(map, "fsdp") {
            None | Some(Value::Bool(false)) => return Ok(()),
            Some(Value::String(s)) if s.len() <= 256 => {
                s.split_whitespace().map(str::to_ascii_lowercase).collect()
            }
            Some(list @ Value::Array(_)) => super::names(list, &at)?
                .iter()
                .map(|s| s.to_ascii_lowercase())
                .collect(),
            Some(other) => {
                return Err(FileError::new(
                    at,
                    format!(
                        "expected FSDP options (a string or a list), got {}",
                        shown(other)
                    ),
                ))
            }
        };
        if options.is_empty() {
            return Ok(());
        }
        for option in &options {
            match option.as_str() {
                "full_shard" => self.fsdp = Some(Read::new(Strategy::Fsdp, at.clone())),
                "shard_grad_op" => self.fsdp = Some(Read::new(Strategy::Zero2, at.clone())),
                "offload" => self.fsdp_offload = Some(Read::new(true, at.clone())),
                "auto_wrap" => {}
                "no_shard" => self.fsdp = Some(Read::new(Strategy::Ddp, at.clone())),
                other => {
                    return Err(FileError::new(
                        at,
                        format!(
                            "option '{}' is not one the service models (known: full_shard, \
                             shard_grad_op, no_shard, offload, auto_wrap; hybrid sharding \
                             shards within a node, which the layout cannot say)",
                            echo(other)
                        ),
                    ))
                }
            }
        }
        if self.fsdp.is_none() {
            return Err(FileError::new(
                at,
                "names no sharding strategy (full_shard, shard_grad_op, ...)",
            ));
        }
        Ok(())
    }
}
