//! Both parsers on real printouts and on hostile text.

use super::*;

fn kinds(layers: &[Layer]) -> Vec<&'static str> {
    layers.iter().map(|l| l.kind.as_str()).collect()
}

fn total_params(layers: &[Layer]) -> u64 {
    layers.iter().map(|l| l.params).sum()
}

fn layer(kind: LayerKind, output_size: u64, params: u64) -> Layer {
    Layer {
        kind,
        output_size,
        params,
    }
}

fn tokens(seq_len: Option<u64>) -> SampleShape<'static> {
    SampleShape {
        seq_len,
        input_shape: None,
    }
}

fn error_line(format: SummaryFormat, text: &str, seq_len: Option<u64>) -> usize {
    match parse_summary(format, text, 8, tokens(seq_len)) {
        Ok(parsed) => panic!("expected an error, got {} layers", parsed.layers.len()),
        Err(err) => err
            .line()
            .unwrap_or_else(|| panic!("not a text error: {err}")),
    }
}

const TINY_LM: &str = include_str!("../../../tests/fixtures/summaries/tiny_lm_module_print.txt");

// resnet18 as `torchsummary.summary(model, (3, 224, 224))` prints it, abridged after the
// first block (rows 12-66 removed).
const RESNET18_TORCHSUMMARY: &str =
    include_str!("../../../tests/fixtures/summaries/resnet18_torchsummary.txt");

// resnet18 as `torchinfo.summary(model, (1, 3, 224, 224))` prints it, abridged.
const RESNET18_TORCHINFO: &str =
    include_str!("../../../tests/fixtures/summaries/resnet18_torchinfo.txt");

// bert-base-uncased, printed with `, N params` per module (embeddings and encoder intact,
// the classifier-free pooler at the end). 12 x BertLayer of 7,087,872 parameters each.
const BERT_BASE: &str =
    include_str!("../../../tests/fixtures/summaries/bert_base_module_print.txt");

// gpt2 (GPT2LMHeadModel): lm_head shares wte's weight, so the total counts it once.
const GPT2: &str = include_str!("../../../tests/fixtures/summaries/gpt2_module_print.txt");

#[test]
fn the_tiny_lm_print_yields_its_leaves_sized_by_seq_len() {
    let layers = parse_summary(SummaryFormat::ModulePrint, TINY_LM, 8, tokens(Some(128)))
        .unwrap()
        .layers;
    assert_eq!(
        layers,
        vec![
            layer(LayerKind::Embedding, 128 * 64, 64_000),
            layer(LayerKind::Linear, 128 * 192, 12_480),
            layer(LayerKind::LayerNorm, 128 * 64, 128),
            layer(LayerKind::Dropout, 128 * 64, 0),
        ]
    );
    assert_eq!(total_params(&layers), 76_608);
}

#[test]
fn a_torchsummary_table_yields_its_rows_without_batch_dim_and_block_rows() {
    let layers = parse_summary(
        SummaryFormat::Torchsummary,
        RESNET18_TORCHSUMMARY,
        8,
        tokens(None),
    )
    .unwrap()
    .layers;
    assert_eq!(
        kinds(&layers),
        [
            "conv2d",
            "batch_norm",
            "relu",
            "max_pool",
            "conv2d",
            "batch_norm",
            "relu",
            "conv2d",
            "batch_norm",
            "relu",
            "adaptive_avg_pool",
            "linear"
        ]
    );
    assert_eq!(layers[0], layer(LayerKind::Conv2d, 64 * 112 * 112, 9_408));
    assert_eq!(layers[3], layer(LayerKind::MaxPool, 64 * 56 * 56, 0));
    assert_eq!(layers[10], layer(LayerKind::AdaptiveAvgPool, 512, 0));
    assert_eq!(layers[11], layer(LayerKind::Linear, 1000, 513_000));
    assert_eq!(
        total_params(&layers),
        9_408 + 128 + 2 * (36_864 + 128) + 513_000
    );
}

#[test]
fn a_torchinfo_table_keeps_leaf_rows_and_reads_dashes_as_zero() {
    let layers = parse_summary(
        SummaryFormat::Torchsummary,
        RESNET18_TORCHINFO,
        8,
        tokens(None),
    )
    .unwrap()
    .layers;
    let from_torchsummary = parse_summary(
        SummaryFormat::Torchsummary,
        RESNET18_TORCHSUMMARY,
        8,
        tokens(None),
    )
    .unwrap()
    .layers;
    assert_eq!(layers, from_torchsummary);
}

/// A published scheduler's workload files keep a torchinfo table with the user's notes after
/// it: the table is read, the notes are ignored and said to be.
#[test]
fn notes_after_a_tables_footer_are_ignored_with_a_warning() {
    for (table, format) in [
        (RESNET18_TORCHINFO, SummaryFormat::Torchsummary),
        (RESNET18_TORCHSUMMARY, SummaryFormat::Torchsummary),
        (RESNET18_TORCHINFO, SummaryFormat::Auto),
    ] {
        let plain = parse_summary(format, table, 8, tokens(None)).unwrap();
        let noted = format!(
            "{table}\nNotes: trained with SGD, lr 0.1, on 4 GPUs.\nMeasured: 5.1 GB (nvidia-smi)\n"
        );
        let read = parse_summary(format, &noted, 8, tokens(None)).unwrap();
        assert_eq!(read.layers, plain.layers);
        let first = table.lines().count() + 2;
        let said = format!("summary.text lines {first}-{}:", first + 1);
        assert!(
            read.warnings
                .iter()
                .any(|w| w.starts_with(&said) && w.contains("ignored")),
            "{:?}",
            read.warnings
        );
        assert_eq!(read.warnings.len(), plain.warnings.len() + 1);
    }
    // A stray line among the rows, before any footer, is still an error naming it.
    let broken = RESNET18_TORCHINFO.replacen("Conv2d", "Notes: Conv2d", 1);
    assert!(parse_summary(SummaryFormat::Torchsummary, &broken, 8, tokens(None)).is_err());
}

#[test]
fn torchinfo_attention_containers_leftover_params_and_extra_columns_are_understood() {
    let text = "\
==========================================================================================================
Layer (type (var_name):depth-idx)        Input Shape          Output Shape         Param #      Trainable
==========================================================================================================
VisionTransformer (VisionTransformer)    [4, 3, 32, 32]       [4, 10]              --           True
├─Conv2d (conv_proj): 1-1                [4, 3, 32, 32]       [4, 64, 4, 4]        12,352       True
├─Encoder (encoder): 1-2                 [4, 17, 64]          [4, 17, 64]          1,088        True
│    └─Dropout (dropout): 2-1            [4, 17, 64]          [4, 17, 64]          --           --
│    └─EncoderBlock (0): 2-2             [4, 17, 64]          [4, 17, 64]          --           True
│    │    └─LayerNorm (ln_1): 3-1        [4, 17, 64]          [4, 17, 64]          128          True
│    │    └─MultiheadAttention (self_attention): 3-2  [4, 17, 64]  [4, 17, 64]    12,480       True
│    │    │    └─NonDynamicallyQuantizableLinear (out_proj): 4-1  --  --          4,160        True
│    │    └─ReLU (act): 3-3              [4, 17, 64]          [4, 17, 64]          --           --
│    │    └─ReLU (act): 3-4              [4, 17, 64]          [4, 17, 64]          (recursive)  --
│    │    └─Frobnicator (frob): 3-5      [4, 17, 64]          [[4, 17, 64], [4, 2]]  (256)      False
├─Linear (heads): 1-3                    [4, 64]              [4, 10]              650          True
==========================================================================================================
Total params: 31,114
";
    let layers = parse_summary(SummaryFormat::Torchsummary, text, 4, tokens(None))
        .unwrap()
        .layers;
    assert_eq!(
        layers,
        vec![
            layer(LayerKind::Conv2d, 64 * 4 * 4, 12_352),
            layer(LayerKind::Other, 0, 1_088),
            layer(LayerKind::Dropout, 17 * 64, 0),
            layer(LayerKind::LayerNorm, 17 * 64, 128),
            layer(LayerKind::Attention, 17 * 64, 12_480),
            layer(LayerKind::Linear, 0, 4_160),
            layer(LayerKind::Relu, 17 * 64, 0),
            layer(LayerKind::Relu, 17 * 64, 0),
            layer(LayerKind::Other, 17 * 64 + 2, 256),
            layer(LayerKind::Linear, 10, 650),
        ]
    );
    assert_eq!(total_params(&layers), 31_114);
}

#[test]
fn torchsummary_tuple_outputs_and_custom_batch_sizes_are_per_sample() {
    let text = "\
    Layer (type)               Output Shape         Param #
================================================================
     Embedding-1              [16, 10, 64]          64,000
MultiheadAttention-2  [[-1, 10, 64], [-1, 10, 10]]               0
     LayerNorm-3              [16, 10, 64]             128
";
    let layers = parse_summary(SummaryFormat::Torchsummary, text, 16, tokens(None))
        .unwrap()
        .layers;
    assert_eq!(
        layers,
        vec![
            layer(LayerKind::Embedding, 640, 64_000),
            layer(LayerKind::Attention, 640 + 100, 0),
            layer(LayerKind::LayerNorm, 640, 128),
        ]
    );
}

#[test]
fn a_bert_print_repeats_its_twelve_layers_and_adds_one_attention_per_layer() {
    let layers = parse_summary(SummaryFormat::ModulePrint, BERT_BASE, 8, tokens(Some(128)))
        .unwrap()
        .layers;
    // 5 embedding leaves, 12 x (12 leaves + 1 attention), 2 pooler leaves.
    assert_eq!(layers.len(), 5 + 12 * 13 + 2);
    assert_eq!(total_params(&layers), 109_482_240);
    let attention: Vec<_> = layers
        .iter()
        .filter(|l| l.kind == LayerKind::Attention)
        .collect();
    assert_eq!(
        attention.len(),
        12,
        "BertAttention wraps BertSelfAttention: counted once"
    );
    assert!(attention
        .iter()
        .all(|l| l.output_size == 128 * 768 && l.params == 0));
    assert_eq!(
        kinds(&layers[5..18]),
        [
            "linear",
            "linear",
            "linear",
            "dropout",
            "attention",
            "linear",
            "layer_norm",
            "dropout",
            "linear",
            "gelu",
            "linear",
            "layer_norm",
            "dropout"
        ]
    );
    assert_eq!(
        kinds(&layers[5..18]),
        kinds(&layers[148..161]),
        "the last block repeats the first"
    );
    assert_eq!(
        layers[8].output_size,
        128 * 768,
        "dropout keeps the value projection's size"
    );
    assert_eq!(layers[13].output_size, 128 * 3072);
    assert_eq!(layers[14].kind, LayerKind::Gelu);
    assert_eq!(layers[14].output_size, 128 * 3072);
    assert_eq!(
        layers[0],
        layer(LayerKind::Embedding, 128 * 768, 23_440_896)
    );
    assert_eq!(layers.last(), Some(&layer(LayerKind::Tanh, 128 * 768, 0)));
}

#[test]
fn a_gpt2_print_reads_conv1d_as_linear_and_drops_the_tied_lm_head_copy() {
    let layers = parse_summary(SummaryFormat::ModulePrint, GPT2, 8, tokens(Some(1024)))
        .unwrap()
        .layers;
    // 3 embedding leaves, 12 x (10 leaves + 1 attention), ln_f, lm_head.
    assert_eq!(layers.len(), 3 + 12 * 11 + 2);
    assert_eq!(total_params(&layers), 124_439_808);
    assert_eq!(layers[4], layer(LayerKind::Linear, 1024 * 2304, 1_771_776));
    assert_eq!(layers[8], layer(LayerKind::Attention, 1024 * 768, 0));
    assert_eq!(layers[12], layer(LayerKind::Gelu, 1024 * 768, 0));
    let lm_head = layers.last().unwrap();
    assert_eq!(*lm_head, layer(LayerKind::Linear, 1024 * 50_257, 0));
}

#[test]
fn parameters_owned_by_containers_go_into_one_other_layer() {
    let text = "\
Encoder(
  (self_attn): MultiheadAttention(
(out_proj): NonDynamicallyQuantizableLinear(in_features=64, out_features=64, bias=True), 4,160 params
  ), 16,640 params
  (act): ReLU(), 0 params
), 16,640 params
";
    let layers = parse_summary(SummaryFormat::ModulePrint, text, 8, tokens(Some(10)))
        .unwrap()
        .layers;
    assert_eq!(
        layers,
        vec![
            layer(LayerKind::Linear, 640, 4_160),
            layer(LayerKind::Attention, 640, 0),
            layer(LayerKind::Relu, 640, 0),
            layer(LayerKind::Other, 0, 12_480),
        ]
    );
}

#[test]
fn class_names_map_to_kinds_beyond_the_canonical_spellings() {
    for (class, kind) in [
        ("Conv1D", LayerKind::Linear),
        ("Conv1d", LayerKind::Conv1d),
        ("LazyConv3d", LayerKind::Conv3d),
        ("MaxPool1d", LayerKind::MaxPool),
        ("Dropout2d", LayerKind::Dropout),
        ("NewGELUActivation", LayerKind::Gelu),
        ("SiLUActivation", LayerKind::Silu),
        ("LlamaRMSNorm", LayerKind::RmsNorm),
        ("FrozenBatchNorm2d", LayerKind::BatchNorm),
        ("LlamaFlashAttention2", LayerKind::Attention),
        ("BertSelfAttention", LayerKind::Attention),
        ("NonDynamicallyQuantizableLinear", LayerKind::Linear),
        ("ConvTranspose1d", LayerKind::ConvTranspose2d),
        ("LlamaRotaryEmbedding", LayerKind::Other),
        ("Frobnicator", LayerKind::Other),
    ] {
        assert_eq!(kind_for_class(class), kind, "{class}");
    }
}

#[test]
fn a_garbage_line_is_reported_on_its_own_line() {
    let mut table: Vec<&str> = RESNET18_TORCHSUMMARY.lines().collect();
    table.insert(6, "this is not a layer row");
    assert_eq!(
        error_line(SummaryFormat::Torchsummary, &table.join("\n"), None),
        7
    );
    let mut print: Vec<&str> = TINY_LM.lines().collect();
    print.insert(3, "    what is this?");
    assert_eq!(
        error_line(SummaryFormat::ModulePrint, &print.join("\n"), Some(128)),
        4
    );
    let err = parse_summary(SummaryFormat::Torchsummary, "hello", 8, tokens(None)).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("summary.text line 1: not a layer row"),
        "{err}"
    );
}

#[test]
fn a_module_print_with_token_layers_needs_seq_len_named_first() {
    let err = parse_summary(SummaryFormat::ModulePrint, TINY_LM, 8, tokens(None)).unwrap_err();
    assert!(err.to_string().starts_with("seq_len: required"), "{err}");
    assert_eq!(err.line(), None);
}

#[test]
fn empty_and_oversized_texts_are_rejected() {
    assert_eq!(error_line(SummaryFormat::Torchsummary, "", None), 1);
    assert_eq!(error_line(SummaryFormat::ModulePrint, " \n\n", Some(1)), 1);
    let huge = "x\n".repeat(MAX_SUMMARY_BYTES / 2 + 1);
    assert_eq!(
        error_line(SummaryFormat::Torchsummary, &huge, None),
        MAX_SUMMARY_BYTES / 2 + 1
    );
}

#[test]
fn the_layer_after_the_limit_is_reported() {
    let rows = "Linear-1  [-1, 10]  110\n".repeat(MAX_LAYERS + 1);
    assert_eq!(
        error_line(SummaryFormat::Torchsummary, &rows, None),
        MAX_LAYERS + 1
    );
    let repeated =
        "M(\n  (0-99999999999): 99999999999 x B(\n    (a): ReLU(), 0 params\n  )\n), 0 params\n";
    assert_eq!(error_line(SummaryFormat::ModulePrint, repeated, Some(4)), 3);
    let empty_blocks =
        "M(\n  (0-99999999999): 99999999999 x B(\n  )\n  (a): ReLU(), 0 params\n), 0 params\n";
    assert_eq!(
        parse_summary(SummaryFormat::ModulePrint, empty_blocks, 8, tokens(Some(4)))
            .unwrap()
            .layers
            .len(),
        1
    );
}

#[test]
fn deep_or_unbalanced_nesting_is_rejected() {
    let deep = "(m): M(\n".repeat(MAX_NESTING + 1);
    assert_eq!(
        error_line(SummaryFormat::ModulePrint, &deep, Some(4)),
        MAX_NESTING + 1
    );
    let unclosed = "M(\n  (a): N(\n    (b): ReLU(), 0 params\n";
    assert_eq!(error_line(SummaryFormat::ModulePrint, unclosed, Some(4)), 2);
    let extra_close = "M(\n  (b): ReLU(), 0 params\n), 0 params\n), 0 params\n";
    assert_eq!(
        error_line(SummaryFormat::ModulePrint, extra_close, Some(4)),
        4
    );
    let bad_args = "M(\n  (b): Linear((((((out_features=3), 0 params\n), 0 params\n";
    assert_eq!(error_line(SummaryFormat::ModulePrint, bad_args, Some(4)), 2);
    let bad_shape = "Conv2d-1  [[[[-1, 3]]]  9\n";
    assert_eq!(error_line(SummaryFormat::Torchsummary, bad_shape, None), 1);
    let nested_shape = format!(
        "Conv2d-1  {}-1{}  9\n",
        "[".repeat(10_000),
        "]".repeat(10_000)
    );
    assert_eq!(
        error_line(SummaryFormat::Torchsummary, &nested_shape, None),
        1
    );
}

#[test]
fn numbers_beyond_64_bits_are_errors_not_panics() {
    let params = "Linear-1  [-1, 10]  99,999,999,999,999,999,999\n";
    assert_eq!(error_line(SummaryFormat::Torchsummary, params, None), 1);
    let shape = "Linear-1  [-1, 4294967296, 4294967296]  1\n";
    assert_eq!(error_line(SummaryFormat::Torchsummary, shape, None), 1);
    let dim = "Linear-1  [-1, 18446744073709551616]  1\n";
    assert_eq!(error_line(SummaryFormat::Torchsummary, dim, None), 1);
    let width = "M(\n  (a): Linear(in_features=1, out_features=18446744073709551615), 2 params\n\
                 ), 2 params\n";
    assert_eq!(error_line(SummaryFormat::ModulePrint, width, Some(2)), 2);
    let sum =
        "M(\n  (a): ReLU(), 18446744073709551615 params\n  (b): ReLU(), 1 params\n), 5 params\n";
    assert_eq!(error_line(SummaryFormat::ModulePrint, sum, Some(2)), 4);
}

#[test]
fn a_footer_total_that_contradicts_the_model_is_accepted_with_a_warning() {
    let text = TINY_LM.replace("Total params: 76,608", "Total params: 76,609");
    let parsed = parse_summary(SummaryFormat::ModulePrint, &text, 8, tokens(Some(128))).unwrap();
    assert_eq!(total_params(&parsed.layers), 76_608);
    assert!(
        parsed
            .warnings
            .iter()
            .any(|w| w.contains("76609") && w.contains("76608") && w.contains("line 12")),
        "{:?}",
        parsed.warnings
    );
}

/// xorshift64*: deterministic pseudo-random numbers without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn parse_all_ways(text: &str) {
    let formats = [
        SummaryFormat::Auto,
        SummaryFormat::Torchsummary,
        SummaryFormat::ModulePrint,
        SummaryFormat::Keras,
    ];
    let image: &[u64] = &[3, 32, 32];
    for format in formats {
        for seq_len in [None, Some(1), Some(u64::MAX)] {
            for input_shape in [None, Some(image)] {
                let sample = SampleShape {
                    seq_len,
                    input_shape,
                };
                if let Ok(ParsedSummary {
                    layers, warnings, ..
                }) = parse_summary(format, text, 8, sample)
                {
                    assert!(!layers.is_empty() && layers.len() <= MAX_LAYERS);
                    assert!(warnings.len() <= Warnings::MAX);
                }
            }
        }
    }
}

#[test]
fn random_bytes_and_shuffled_lines_never_panic() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let alphabet: Vec<char> = "([{}])-,:x =│├└─0123456789 params\nLinearConv2dReLU9,4-1é"
        .chars()
        .collect();
    for _ in 0..3_000 {
        let len = rng.below(120);
        let text: String = if rng.below(2) == 0 {
            let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        } else {
            (0..len)
                .map(|_| alphabet[rng.below(alphabet.len())])
                .collect()
        };
        parse_all_ways(&text);
    }
    let fixtures = [
        TINY_LM,
        RESNET18_TORCHSUMMARY,
        RESNET18_TORCHINFO,
        BERT_BASE,
        GPT2,
    ];
    for _ in 0..600 {
        let fixture = fixtures[rng.below(fixtures.len())];
        let mut lines: Vec<&str> = fixture.lines().collect();
        match rng.below(3) {
            0 => {
                for i in (1..lines.len()).rev() {
                    lines.swap(i, rng.below(i + 1));
                }
            }
            1 => {
                let i = rng.below(lines.len());
                lines.remove(i);
            }
            _ => {
                let (i, j) = (rng.below(lines.len()), rng.below(lines.len()));
                lines.insert(i, lines[j]);
            }
        }
        let mut text = lines.join("\n");
        // Cut at a random character boundary too.
        let cut = text
            .char_indices()
            .map(|(i, _)| i)
            .nth(rng.below(text.len() + 1));
        if let Some(cut) = cut.filter(|_| rng.below(3) == 0) {
            text.truncate(cut);
        }
        parse_all_ways(&text);
    }
}

// ---------------------------------------------------------------------------------------------
// Plain prints, wrappers, Keras, detection.

mod plain_prints;
