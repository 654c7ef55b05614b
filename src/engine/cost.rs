//! What a request costs, priced from its sizes before any of it runs (issue 34): an estimate's
//! work grows with the job's layers, the cards a `gpu` list ranks, the classifiers
//! (`estimators: all`), the bytes of module names, and a batch's items. A request priced above
//! the budget (`--max-request-cost`) is refused with 422 naming the fields that make it
//! expensive, before it is validated or answered.
//!
//! The price is in work units of about one layer answered on one card. The weights are what a
//! release build spent on each, and a unit came to about 0.1 us of CPU on the 2-core machine
//! they were measured on (scripts/request-cpu.py: Llama-3-8B's config ranked on 16 cards,
//! 12,356 units, 1.3 ms; the hostile layer list of tests/api/cost.rs, 123,677 units, 15 ms;
//! the README's first example, 790 units, 0.3 ms with its HTTP). Every loop over request data
//! is linear in its sizes (module names are matched once a job, not per card or pair:
//! [`crate::job::names`]), so the price is a sum of the sizes' products below.

use crate::api::types::{EstimateRequest, NamesRequest};
use crate::error::ApiError;
use crate::job::validated::MAX_LAYERS;
use crate::parsers;
use crate::parsers::transformer::{language_model, TransformerConfig};

/// Each job: parsing, validating and answering it, whatever its size.
const JOB_UNITS: u64 = 500;
/// Each card a job is answered on: the estimators' calls, the placement, a ranking's row.
const CARD_UNITS: u64 = 200;
/// Each card more with `estimators: all`: the memory classifiers' calls.
const CLASSIFIER_CARD_UNITS: u64 = 2_000;
/// Each layer, once a job: validation, the estimators' features, the repeated blocks.
const LAYER_UNITS: u64 = 8;
/// Each layer on each card: the memory step (and each unstated field's alternative), the
/// roofline.
const LAYER_CARD_UNITS: u64 = 1;
/// Each layer on each card more with `estimators: all`: the classifiers read every layer.
const CLASSIFIER_LAYER_CARD_UNITS: u64 = 5;
/// Bytes of module names (the layers' and the lists') a unit pays for: read, matched once a
/// list, copied.
const NAME_BYTES_PER_UNIT: u64 = 16;

/// The fields a price is read from, as a set (bit `i` is `FIELDS[i]`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Fields(u16);

const FIELDS: [&str; 11] = [
    "items",
    "layers",
    "summary",
    "transformer_config",
    "gpu",
    "estimators",
    "layers[].name",
    "lora.target_modules",
    "lora.modules_to_save",
    "trainable.modules",
    "activation_checkpointing",
];
const ITEMS: Fields = Fields(1);
const LAYERS: Fields = Fields(1 << 1);
const SUMMARY: Fields = Fields(1 << 2);
const CONFIG: Fields = Fields(1 << 3);
const GPU: Fields = Fields(1 << 4);
const ESTIMATORS: Fields = Fields(1 << 5);
const LAYER_NAMES: Fields = Fields(1 << 6);
const TARGETS: Fields = Fields(1 << 7);
const SAVED: Fields = Fields(1 << 8);
const TRAINABLE: Fields = Fields(1 << 9);
const CHECKPOINTED: Fields = Fields(1 << 10);

impl Fields {
    fn with(self, other: Fields) -> Fields {
        Fields(self.0 | other.0)
    }

    fn names(self) -> Vec<&'static str> {
        FIELDS
            .iter()
            .enumerate()
            .filter(|&(i, _)| self.0 & (1 << i) != 0)
            .map(|(_, &name)| name)
            .collect()
    }
}

/// A request's price, by what scales it. A batch's is the sum of its items'.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cost {
    /// Units of each part of the price, by [`Part`].
    units: [u64; PARTS],
    /// Jobs priced.
    jobs: u64,
    /// The sizes behind them: layers in all and the most of one job, the most cards of one
    /// job, bytes of names in all, whether any job runs the classifiers.
    layers: u64,
    most_layers: u64,
    most_cards: u64,
    name_bytes: u64,
    classifiers: bool,
    /// Where the layers came from (`layers`, `summary`, `transformer_config`) and the names.
    layers_from: Fields,
    names_from: Fields,
}

/// What a part of the price pays for.
#[derive(Debug, Clone, Copy)]
enum Part {
    /// The jobs themselves.
    Jobs,
    /// Their cards.
    Cards,
    /// Their layers, once a job.
    Layers,
    /// Each layer on each card.
    LayerCards,
    /// The bytes of module names.
    Names,
}

const PARTS: usize = 5;

impl Cost {
    /// The price of one job, from its sizes alone (nothing is validated or built).
    pub fn of(request: &EstimateRequest) -> Cost {
        // A list, printout or configuration of more layers than a job may hold is refused as
        // soon as it is read: nothing is priced past that. A printout is priced at the most
        // layers its lines can be read as; a configuration at the modules its blocks give.
        let most = MAX_LAYERS as u64;
        let (layers, layers_from) = match (
            &request.layers,
            &request.summary,
            &request.transformer_config,
        ) {
            (Some(list), _, _) => ((list.len() as u64).min(most), LAYERS),
            (None, Some(summary), _) => (parsers::layers_bound(&summary.text).min(most), SUMMARY),
            (None, None, Some(config)) => (
                // The config built: a multimodal config's language model.
                TransformerConfig::parse(language_model(config).0)
                    .map_or(0, |c| (c.modules_hint() as u64).min(most)),
                CONFIG,
            ),
            (None, None, None) => (0, Fields::default()),
        };
        // The layers' work: a printout's convolutions weigh more than its other layers.
        let work = match (&request.layers, &request.summary) {
            (None, Some(summary)) => {
                // Less what the cap on layers took off the plain count.
                let capped_off = parsers::layers_bound(&summary.text).saturating_sub(layers);
                parsers::layers_work_bound(&summary.text)
                    .saturating_sub(capped_off)
                    .clamp(layers, most * parsers::CONVOLUTION_WEIGHT)
            }
            _ => layers,
        };
        let cards = request.gpu.as_ref().map_or(1, |g| g.cards().len() as u64);
        let classifiers = request.estimators.as_deref() == Some("all");
        let mut name_bytes = 0;
        let mut names_from = Fields::default();
        let mut names = |field: Fields, bytes: u64| {
            if bytes > 0 {
                name_bytes += bytes;
                names_from = names_from.with(field);
            }
        };
        let listed = |list: &[String]| list.iter().map(|n| n.len() as u64).sum::<u64>();
        if let Some(list) = &request.layers {
            let bytes = list
                .iter()
                .filter_map(|l| l.name.as_ref())
                .map(|n| n.len() as u64)
                .sum();
            names(LAYER_NAMES, bytes);
        }
        if let Some(lora) = &request.lora {
            if let NamesRequest::Names(list) = &lora.target_modules {
                names(TARGETS, listed(list));
            }
            names(SAVED, lora.modules_to_save.as_deref().map_or(0, listed));
        }
        if let Some(modules) = request.trainable.as_ref().and_then(|t| t.modules.as_ref()) {
            names(TRAINABLE, listed(modules));
        }
        if let Some(NamesRequest::Names(list)) = &request.activation_checkpointing {
            names(CHECKPOINTED, listed(list));
        }
        let (card_units, layer_card_units) = if classifiers {
            (
                CARD_UNITS + CLASSIFIER_CARD_UNITS,
                LAYER_CARD_UNITS + CLASSIFIER_LAYER_CARD_UNITS,
            )
        } else {
            (CARD_UNITS, LAYER_CARD_UNITS)
        };
        let mut units = [0; PARTS];
        units[Part::Jobs as usize] = JOB_UNITS;
        units[Part::Cards as usize] = cards * card_units;
        units[Part::Layers as usize] = work * LAYER_UNITS;
        units[Part::LayerCards as usize] = work * cards * layer_card_units;
        units[Part::Names as usize] = name_bytes.div_ceil(NAME_BYTES_PER_UNIT);
        Cost {
            units,
            jobs: 1,
            layers,
            most_layers: layers,
            most_cards: cards,
            name_bytes,
            classifiers,
            layers_from,
            names_from,
        }
    }

    /// Adds another job's price (a batch's items are priced together).
    pub fn add(&mut self, other: &Cost) {
        for (part, more) in self.units.iter_mut().zip(other.units) {
            *part += more;
        }
        self.jobs += other.jobs;
        self.layers += other.layers;
        self.most_layers = self.most_layers.max(other.most_layers);
        self.most_cards = self.most_cards.max(other.most_cards);
        self.name_bytes += other.name_bytes;
        self.classifiers |= other.classifiers;
        self.layers_from = self.layers_from.with(other.layers_from);
        self.names_from = self.names_from.with(other.names_from);
    }

    /// The price of `n` answers of this request (a plan's estimates, each priced as the job).
    pub fn times(&self, n: u64) -> Cost {
        let mut units = self.units;
        for part in units.iter_mut() {
            *part = part.saturating_mul(n);
        }
        Cost {
            units,
            jobs: self.jobs.saturating_mul(n),
            layers: self.layers.saturating_mul(n),
            name_bytes: self.name_bytes.saturating_mul(n),
            ..*self
        }
    }

    /// The price in work units.
    pub fn units(&self) -> u64 {
        self.units.iter().sum()
    }

    fn part(&self, part: Part) -> u64 {
        self.units[part as usize]
    }

    /// Refuses a price above `budget`: 422, naming the fields that make the request expensive
    /// and what each costs. `items`: the price is a batch's, of that many items.
    pub fn check(&self, budget: u64, items: Option<usize>) -> Result<(), ApiError> {
        let units = self.units();
        if units <= budget {
            return Ok(());
        }
        let estimators = if self.classifiers {
            ESTIMATORS
        } else {
            Fields::default()
        };
        let with_classifiers = if self.classifiers {
            " with the classifiers (estimators: all)"
        } else {
            ""
        };
        let list = |fields: Fields| fields.names().join(", ");
        let mut terms = [
            (
                self.part(Part::LayerCards),
                self.layers_from.with(GPU).with(estimators),
                format!(
                    "{} layers ({}) on {} cards (gpu){with_classifiers}",
                    grouped(self.most_layers),
                    list(self.layers_from),
                    self.most_cards
                ),
            ),
            (
                self.part(Part::Cards),
                GPU.with(estimators),
                format!("{} cards (gpu){with_classifiers}", self.most_cards),
            ),
            (
                self.part(Part::Layers),
                self.layers_from,
                format!(
                    "{} layers in all ({})",
                    grouped(self.layers),
                    list(self.layers_from)
                ),
            ),
            (
                self.part(Part::Names),
                self.names_from,
                format!(
                    "{} bytes of module names ({})",
                    grouped(self.name_bytes),
                    list(self.names_from)
                ),
            ),
            (
                self.part(Part::Jobs),
                ITEMS,
                format!("{} jobs (items)", self.jobs),
            ),
        ];
        terms.sort_by_key(|t| std::cmp::Reverse(t.0));
        // The largest part, and any other of at least a quarter of the price.
        let expensive: Vec<&(u64, Fields, String)> = terms
            .iter()
            .enumerate()
            .filter(|&(i, t)| i == 0 || t.0 * 4 >= units)
            .map(|(_, t)| t)
            .collect();
        let mut fields = match items {
            Some(_) => ITEMS,
            None => Fields::default(),
        };
        for (_, f, _) in &expensive {
            fields = fields.with(*f);
        }
        let parts: Vec<String> = expensive
            .iter()
            .map(|(u, _, what)| format!("{what}: {}", grouped(*u)))
            .collect();
        let whole = match items {
            Some(n) => format!("the batch's {n} items cost"),
            None => "the request costs".to_string(),
        };
        Err(ApiError::InvalidInput(format!(
            "{}: {whole} {} units of work, above the budget of {} (--max-request-cost); {}; \
             ask for fewer of them{}",
            fields.names().join(", "),
            grouped(units),
            grouped(budget),
            parts.join("; "),
            if items.is_some() {
                " or split the batch"
            } else {
                ""
            },
        )))
    }
}

/// `1234567` as `1,234,567`.
fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn request(body: serde_json::Value) -> EstimateRequest {
        serde_json::from_value(body).unwrap()
    }

    fn layers(n: usize, name: impl Fn(usize) -> Option<String>) -> serde_json::Value {
        (0..n)
            .map(|i| json!({"kind": "linear", "output_size": 10, "params": 110, "name": name(i)}))
            .collect()
    }

    #[test]
    fn a_job_is_priced_by_its_layers_cards_classifiers_and_names() {
        let plain = request(json!({"batch_size": 8, "layers": layers(3, |_| None)}));
        assert_eq!(Cost::of(&plain).units(), 500 + 200 + 3 * 8 + 3);
        let cards = ["a100-40gb", "h100-80gb", "l4", "t4"];
        let ranked = request(json!({"batch_size": 8, "layers": layers(3, |_| None),
            "gpu": cards, "estimators": "all"}));
        assert_eq!(
            Cost::of(&ranked).units(),
            500 + 4 * 2_200 + 3 * 8 + 3 * 4 * 6
        );
        // 32 bytes of layer names, 16 of module lists: 3 units.
        let named = request(json!({"batch_size": 8,
            "layers": layers(2, |i| Some(format!("{i}{}", "n".repeat(15)))),
            "lora": {"rank": 4, "target_modules": ["abcd"], "modules_to_save": ["abcd", "abcd"]},
            "trainable": null, "activation_checkpointing": ["abcd"]}));
        assert_eq!(Cost::of(&named).units(), 500 + 200 + 2 * 8 + 2 + 3);
        // A printout at the most layers its lines can be; a configuration at its modules.
        let printout = request(json!({"batch_size": 8, "summary": {"text":
            "Net(\n  (0-4094): 4095 x Linear(in_features=3, out_features=3, bias=True)\n)"}}));
        assert_eq!(Cost::of(&printout).units(), 500 + 200 + 4_096 * 9);
        let config = request(
            json!({"batch_size": 8, "seq_len": 128, "transformer_config": {
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}}),
        );
        assert_eq!(Cost::of(&config).units(), 500 + 200 + 26 * 9);
        // Convolutions at four times a linear layer's work, each repeat counted (to the cap:
        // 4,096 layers, of which 4,095 of the 4,096 read are convolutions).
        let convolutions = request(json!({"batch_size": 8, "summary": {"text":
            "Net(\n  (0-4094): 4095 x Conv2d(64, 64, kernel_size=(3, 3))\n  (fc): Linear(in_features=3, out_features=3, bias=True)\n)"}}));
        assert_eq!(Cost::of(&convolutions).units(), 500 + 200 + 16_383 * 9);
        // A multimodal config at the language model it is built from, not its wrapper.
        let wrapped = request(
            json!({"batch_size": 8, "seq_len": 128, "transformer_config": {
            "model_type": "llava", "text_config": {
            "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}}}),
        );
        assert_eq!(Cost::of(&wrapped).units(), 500 + 200 + 26 * 9);
    }

    #[test]
    fn a_price_above_the_budget_names_the_fields_that_make_it() {
        let cards: Vec<String> = (0..16).map(|i| format!("card{i}")).collect();
        let big = request(json!({"batch_size": 8, "layers": layers(4_096, |_| None),
            "gpu": cards}));
        let cost = Cost::of(&big);
        assert_eq!(cost.units(), 500 + 16 * 200 + 4_096 * 8 + 4_096 * 16);
        assert!(cost.check(cost.units(), None).is_ok());
        let refused = cost.check(100_000, None).unwrap_err();
        assert_eq!(
            refused.status(),
            axum::http::StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(
            refused.to_string(),
            "layers, gpu: the request costs 102,004 units of work, above the budget of \
             100,000 (--max-request-cost); 4,096 layers (layers) on 16 cards (gpu): 65,536; \
             4,096 layers in all (layers): 32,768; ask for fewer of them"
        );
        // A batch: the items' prices add up, and the items are named.
        let mut batch = Cost::default();
        for _ in 0..3 {
            batch.add(&cost);
        }
        assert_eq!(batch.units(), 3 * cost.units());
        let refused = batch.check(cost.units(), Some(3)).unwrap_err().to_string();
        assert!(
            refused.starts_with("items, layers, gpu: the batch's 3 items cost 306,012 units")
                && refused.ends_with("or split the batch"),
            "{refused}"
        );
    }

    #[test]
    fn numbers_are_grouped_by_thousands() {
        for (n, text) in [
            (0, "0"),
            (999, "999"),
            (1_000, "1,000"),
            (118_217_728, "118,217,728"),
        ] {
            assert_eq!(grouped(n), text);
        }
    }
}
