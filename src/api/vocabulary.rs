//! The names each setup field takes, as one document: `gpucast vocabulary` prints it from the
//! enums that parse the fields, and the committed `python/src/gpucast/vocabulary.json` is that
//! output (tests/api/docs.rs holds it to it): the client's package data, and describe's too
//! through `describe/gpucast_describe/vocabulary.json`, a symbolic link to it (a built package
//! holds the file itself). The client, describe and the docs read their lists from it rather
//! than typing the names again.

use std::collections::BTreeMap;

use crate::calibration::label::Stack;
use crate::parsers::files::ATTENTION_KERNELS;
use crate::parsers::transformer::AttentionKernel;

/// What `estimators` takes: the figures' estimators alone, or the memory classifiers too.
pub const ESTIMATOR_CHOICES: [&str; 2] = ["figures", "all"];

/// The committed [`setup_vocabulary`] and the link to it, from the repository's root.
pub const COMMITTED: [&str; 2] = [
    "python/src/gpucast/vocabulary.json",
    "describe/gpucast_describe/vocabulary.json",
];

/// Request field (a dotted path for a nested one) -> the canonical names it takes, in the order
/// the docs list them: the setup's own ([`crate::job::setup::named_values`]), the attention
/// kernel of a config job and the load's, the stacks and the estimators asked for. Other spellings the service also reads (`mixed16`,
/// `adamw8bit`, Lightning's precision strings) are not listed: a client sends these.
pub fn setup_vocabulary() -> BTreeMap<&'static str, Vec<&'static str>> {
    let mut vocabulary: BTreeMap<_, _> = crate::job::setup::named_values().into_iter().collect();
    vocabulary.insert("attention", AttentionKernel::NAMES.to_vec());
    vocabulary.insert("load.attn_implementation", ATTENTION_KERNELS.to_vec());
    vocabulary.insert("stack", Stack::NAMES.to_vec());
    vocabulary.insert("estimators", ESTIMATOR_CHOICES.to_vec());
    vocabulary
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::setup::{
        BaseWeights, ExpertLayout, LossImplementation, OptimizerImplementation, Precision, Strategy,
    };

    #[test]
    fn every_name_is_listed_once_and_parses_as_itself() {
        for (field, names) in setup_vocabulary() {
            let mut seen = std::collections::HashSet::new();
            assert!(names.iter().all(|name| seen.insert(name)), "{field}");
        }
        for precision in Precision::ALL {
            assert_eq!(Precision::parse(precision.as_str()), Some(precision));
        }
        for implementation in OptimizerImplementation::ALL {
            assert_eq!(
                OptimizerImplementation::parse(implementation.as_str()),
                Some(implementation)
            );
        }
        for strategy in Strategy::ALL {
            assert_eq!(Strategy::parse(strategy.as_str()), Some(strategy));
        }
        for base in BaseWeights::ALL {
            assert_eq!(BaseWeights::parse(base.as_str()), Some(base));
        }
        for layout in ExpertLayout::ALL {
            assert_eq!(ExpertLayout::parse(layout.as_str()), Some(layout));
        }
        for name in AttentionKernel::NAMES {
            assert!(AttentionKernel::parse(Some(name)).is_ok(), "{name}");
        }
        for loss in LossImplementation::ALL {
            assert_eq!(
                crate::parsers::transformer::parse_loss_implementation(Some(loss.as_str())),
                Ok(loss)
            );
        }
    }
}
