//! The layer-kind vocabulary as one document: the canonical kinds in order, every accepted
//! spelling, and the groups the features count. `gpucast layer-kinds` prints it, the committed
//! `openapi/layer_kinds.json` is that output, and describe's and training's tests check their
//! own lists against the committed file, so the three never drift apart.

use std::collections::BTreeMap;

use serde::Serialize;

use super::CLASS_EXCEPTIONS;
use crate::job::{Family, LayerKind};

#[derive(Debug, Serialize)]
pub struct LayerVocabulary {
    /// The canonical names, in `LayerKind::ALL`'s order (the sequence models' vocabulary order).
    pub kinds: Vec<&'static str>,
    /// Normalised spelling (lower case, no `_`, `-` or spaces) -> canonical name.
    pub aliases: BTreeMap<&'static str, &'static str>,
    /// Class names a pasted summary reads exactly (case-sensitive), before the aliases.
    pub class_exceptions: BTreeMap<&'static str, &'static str>,
    /// The kinds each feature group counts, and the kinds that make a job a CNN.
    pub groups: BTreeMap<&'static str, Vec<&'static str>>,
    /// The model families, in the order the service groups jobs.
    pub families: Vec<&'static str>,
}

pub fn layer_vocabulary() -> LayerVocabulary {
    let group = |member: fn(LayerKind) -> bool| {
        LayerKind::ALL
            .into_iter()
            .filter(|&kind| member(kind))
            .map(LayerKind::as_str)
            .collect::<Vec<_>>()
    };
    LayerVocabulary {
        kinds: LayerKind::ALL.map(LayerKind::as_str).to_vec(),
        aliases: LayerKind::ALIASES
            .iter()
            .map(|&(alias, kind)| (alias, kind.as_str()))
            .collect(),
        class_exceptions: CLASS_EXCEPTIONS
            .iter()
            .map(|&(class, kind)| (class, kind.as_str()))
            .collect(),
        groups: BTreeMap::from([
            ("activation", group(LayerKind::is_activation)),
            ("convolution", group(LayerKind::is_convolution)),
            ("normalisation", group(LayerKind::is_normalisation)),
        ]),
        families: [Family::Mlp, Family::Cnn, Family::Transformer]
            .map(Family::as_str)
            .to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_alias_parses_to_its_kind_and_every_kind_has_its_own_name_as_alias() {
        let vocabulary = layer_vocabulary();
        for (alias, kind) in &vocabulary.aliases {
            assert_eq!(LayerKind::parse(alias).map(LayerKind::as_str), Some(*kind));
        }
        for kind in &vocabulary.kinds {
            let normalised = kind.replace('_', "");
            assert_eq!(vocabulary.aliases.get(normalised.as_str()), Some(kind));
        }
        assert_eq!(
            vocabulary.aliases.len(),
            LayerKind::ALIASES.len(),
            "no alias twice"
        );
    }
}
