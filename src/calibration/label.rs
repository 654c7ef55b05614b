//! The environment label of an observation or estimate: which software stack (driver, CUDA,
//! PyTorch, cuDNN) a job runs under, e.g. `torch2.5-cu124`. The same card needs different
//! amounts under different stacks (context size, lazy loading, workspaces), so profiles are
//! kept per GPU and per GPU and environment.

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

#[cfg(test)]
mod tests {
    use super::*;

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
