//! The environment label of an observation or estimate: which software stack (driver, CUDA,
//! PyTorch, cuDNN) a job runs under, e.g. `torch2.5-cu124`. The same card needs different
//! amounts under different stacks (context size, lazy loading, workspaces), so profiles are
//! kept per GPU and per GPU and environment. Beside it, the training stack a request says its
//! job runs on ([`Stack`]), which says whether the bound's held-out errors were measured on
//! jobs like it.

/// Longest environment label.
pub const MAX_ENVIRONMENT_CHARS: usize = 64;

/// A label of 1 to 64 characters of `[A-Za-z0-9._+-]`, kept as given (case matters:
/// `torch2.5-cu124` and `Torch2.5-CU124` are two environments; callers should name theirs
/// consistently, as the probe does).
pub fn parse_environment(raw: &str) -> Result<String, String> {
    let ok = (1..=MAX_ENVIRONMENT_CHARS).contains(&raw.len())
        && raw
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'+' | b'-'));
    if ok {
        Ok(raw.to_string())
    } else {
        Err(format!(
            "environment: must be 1 to {MAX_ENVIRONMENT_CHARS} of letters, digits, `.`, `_`, `+`, `-`, got `{}`",
            crate::job::echo(raw)
        ))
    }
}

/// The training stack a job runs on, as a request states it (`stack`): the framework and
/// launcher that hold its memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stack {
    /// Hugging Face transformers (Trainer, TRL, or a custom loop) and PEFT on PyTorch: the
    /// stack the physics follows and the held-out errors were measured on.
    Transformers,
    /// The same models through accelerate (FSDP or DeepSpeed plugins).
    Accelerate,
    /// transformers with DeepSpeed ZeRO.
    Deepspeed,
    Megatron,
    Litgpt,
    Torchtitan,
    Torchtune,
    /// Any other framework with its own engine (InternEvo, mmengine, ...).
    Other,
}

impl Stack {
    /// Every name, in the order the docs list them.
    pub const NAMES: [&'static str; 8] = [
        "transformers",
        "accelerate",
        "deepspeed",
        "megatron",
        "litgpt",
        "torchtitan",
        "torchtune",
        "other",
    ];
    const ALL: [Stack; 8] = [
        Stack::Transformers,
        Stack::Accelerate,
        Stack::Deepspeed,
        Stack::Megatron,
        Stack::Litgpt,
        Stack::Torchtitan,
        Stack::Torchtune,
        Stack::Other,
    ];

    pub fn parse(raw: &str) -> Result<Stack, String> {
        let name = raw.to_ascii_lowercase();
        Stack::ALL
            .into_iter()
            .find(|s| s.as_str() == name)
            .ok_or_else(|| {
                format!(
                    "stack: unknown '{}' (known: {})",
                    crate::job::echo(raw),
                    Stack::NAMES.join(", ")
                )
            })
    }

    pub fn as_str(self) -> &'static str {
        Stack::NAMES[self as usize]
    }

    /// Whether the physics follows this stack and the held-out errors were measured on it:
    /// another stack's jobs may lie outside the held-out bound by the spread between stacks.
    pub fn is_modelled(self) -> bool {
        matches!(
            self,
            Stack::Transformers | Stack::Accelerate | Stack::Deepspeed
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stacks_parse_by_name_and_only_the_hugging_face_ones_are_modelled() {
        for name in Stack::NAMES {
            assert_eq!(Stack::parse(name).unwrap().as_str(), name);
        }
        assert_eq!(Stack::parse("LitGPT"), Ok(Stack::Litgpt));
        assert!(Stack::parse("internevo").is_err());
        let modelled: Vec<&str> = Stack::ALL
            .into_iter()
            .filter(|s| s.is_modelled())
            .map(Stack::as_str)
            .collect();
        assert_eq!(modelled, ["transformers", "accelerate", "deepspeed"]);
    }

    #[test]
    fn labels_are_short_and_plain() {
        assert_eq!(
            parse_environment("torch2.5-cu124").unwrap(),
            "torch2.5-cu124"
        );
        assert!(parse_environment("torch_2.5+cu124").is_ok());
        for bad in ["", "a b", "torch/2.5", "é", &"x".repeat(65), "a\nb"] {
            assert!(parse_environment(bad).is_err(), "{bad:?}");
        }
    }
}
