//! The layers a setup's module lists name, matched once when a job's setup is set
//! ([`super::Job::with_setup`]): the memory step and the roofline read them for every card and
//! every alternative of an unstated field, instead of matching names again each time.

use std::ops::Range;

use super::names::{self, Matched, Rule};
use super::setup::{Checkpointing, LoraTargets, Setup, Trainable};

/// The layers each module list of a setup names, index for index with the job's layers. A list
/// the setup does not have names none.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct NamedLayers {
    /// `lora.target_modules` given as names: the layers they adapt (PEFT's target rule).
    targets: Vec<bool>,
    /// `lora.modules_to_save`: the layers inside a saved module.
    saved: Vec<bool>,
    /// `trainable.modules`: the layers inside a trained module.
    trainable: Vec<bool>,
    /// `activation_checkpointing` as names: each module's layers, first to last, in the list's
    /// order (a module named twice counts twice, as the step always counted it).
    checkpointed: Vec<Range<usize>>,
}

/// For each list that has names, whether each of them names a layer (in the list's order), for
/// the setup's checks ([`super::Job::with_setup`]).
#[derive(Debug, Default)]
pub struct Unnamed {
    pub checkpointed: Vec<bool>,
    pub trainable: Vec<bool>,
    pub saved: Vec<bool>,
    pub targets: Vec<bool>,
}

impl NamedLayers {
    /// Matches `setup`'s lists against `names` (each layer's name, `None` where it has none):
    /// each list in one pass over the names ([`names::match_layers`]).
    pub fn of(names: &[Option<&str>], setup: &Setup) -> (NamedLayers, Unnamed) {
        let mut named = NamedLayers::default();
        let mut found = Unnamed::default();
        // Each list's layers, and whether each of its names names one.
        let matched = |list: &[String], rule: Rule| {
            let Matched { layers, named } = names::match_layers(names, list, rule);
            (layers, named)
        };
        if let Checkpointing::Modules(modules) = &setup.checkpointing {
            let spans = names::module_spans(names, modules);
            found.checkpointed = spans.iter().map(Option::is_some).collect();
            named.checkpointed = spans.into_iter().flatten().collect();
        }
        if let Trainable::Modules(modules) = &setup.trainable {
            (named.trainable, found.trainable) = matched(modules, Rule::Within);
        }
        if let Some(lora) = &setup.lora {
            if !lora.modules_to_save.is_empty() {
                (named.saved, found.saved) = matched(&lora.modules_to_save, Rule::Inside);
            }
            if let LoraTargets::Names(targets) = &lora.targets {
                (named.targets, found.targets) = matched(targets, Rule::Target);
            }
        }
        (named, found)
    }

    /// Whether layer `i` is one of `lora.target_modules` (given as names).
    pub fn targeted(&self, i: usize) -> bool {
        self.targets.get(i).copied().unwrap_or(false)
    }

    /// Whether layer `i` is inside one of `lora.modules_to_save`.
    pub fn saved(&self, i: usize) -> bool {
        self.saved.get(i).copied().unwrap_or(false)
    }

    /// Whether layer `i` is inside one of `trainable.modules`.
    pub fn trainable(&self, i: usize) -> bool {
        self.trainable.get(i).copied().unwrap_or(false)
    }

    /// The checkpointed modules' layers (`activation_checkpointing` as names), one range per
    /// module that holds any, in the list's order.
    pub fn checkpointed(&self) -> &[Range<usize>] {
        &self.checkpointed
    }
}

/// Whether two setups name the same modules in every list matched against the layers: a setup
/// that differs from the job's own only elsewhere (an unstated field's alternative) reads the
/// job's matches.
pub fn same_lists(a: &Setup, b: &Setup) -> bool {
    type Lists<'a> = (
        Option<&'a Vec<String>>,
        Option<&'a Vec<String>>,
        Option<&'a Vec<String>>,
        Option<&'a Vec<String>>,
    );
    fn lists(s: &Setup) -> Lists<'_> {
        (
            match &s.checkpointing {
                Checkpointing::Modules(m) => Some(m),
                _ => None,
            },
            match &s.trainable {
                Trainable::Modules(m) => Some(m),
                _ => None,
            },
            s.lora.as_ref().map(|l| &l.modules_to_save),
            s.lora.as_ref().and_then(|l| match &l.targets {
                LoraTargets::Names(t) => Some(t),
                LoraTargets::AllLinear => None,
            }),
        )
    }
    std::ptr::eq(a, b) || lists(a) == lists(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::setup::{UncheckedLora, UncheckedNames, UncheckedSetup};

    fn setup(targets: &[String], saved: &[String], checkpointed: &[String]) -> Setup {
        Setup::parse(
            8,
            &UncheckedSetup {
                lora: Some(UncheckedLora {
                    rank: 4,
                    alpha: None,
                    dropout: None,
                    target_modules: UncheckedNames::Names(targets),
                    base_weights: None,
                    modules_to_save: (!saved.is_empty()).then_some(saved),
                    group_size: None,
                    expert_layout: None,
                }),
                activation_checkpointing: Some(UncheckedNames::Names(checkpointed)),
                ..Default::default()
            },
        )
        .unwrap()
    }

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn each_list_names_the_layers_its_rule_matches() {
        let names = [
            Some("model.layers.0.self_attn.q_proj"),
            Some("model.layers.0.self_attn.v_proj"),
            Some("model.layers.1.self_attn.q_proj"),
            None,
            Some("model.score.dense"),
            Some("model.scores"),
        ];
        let (named, found) = NamedLayers::of(
            &names,
            &setup(
                &strings(&["q_proj", "k_proj"]),
                &strings(&["score"]),
                &strings(&["model.layers.1", "model.layers.0", "model.layers.0"]),
            ),
        );
        assert_eq!(
            (0..6).map(|i| named.targeted(i)).collect::<Vec<_>>(),
            [true, false, true, false, false, false]
        );
        assert_eq!(
            (0..6).map(|i| named.saved(i)).collect::<Vec<_>>(),
            [false, false, false, false, true, false]
        );
        assert!(!named.trainable(0));
        // Each checkpointed module in the list's order, repeats kept.
        assert_eq!(named.checkpointed(), [2..3, 0..2, 0..2]);
        assert_eq!(found.targets, [true, false]);
        assert_eq!(found.saved, [true]);
        assert_eq!(found.checkpointed, [true, true, true]);
    }

    #[test]
    fn setups_that_differ_only_outside_their_lists_share_the_matches() {
        let a = setup(&strings(&["q_proj"]), &[], &strings(&["x"]));
        let mut b = a.clone();
        b.implementation = crate::job::setup::OptimizerImplementation::Fused;
        assert!(same_lists(&a, &b));
        let c = setup(&strings(&["v_proj"]), &[], &strings(&["x"]));
        assert!(!same_lists(&a, &c));
    }
}
