//! Printouts without annotations (`print(model)`, Keras tables): parameters derived from the
//! constructor arguments, sizes carried from the input.

use super::*;

// torchvision's resnet18 as `print(model)` shows it: no counts, only constructor arguments.
const RESNET18_PRINT: &str = include_str!("../../../tests/fixtures/summaries/resnet18_print.txt");

fn image(shape: &[u64]) -> SampleShape<'_> {
    SampleShape {
        seq_len: None,
        input_shape: Some(shape),
    }
}

fn warned(parsed: &ParsedSummary, needle: &str) -> bool {
    parsed.warnings.iter().any(|w| w.contains(needle))
}

#[test]
fn a_plain_resnet_print_derives_its_parameters_and_carries_the_image_through_its_layers() {
    let parsed = parse_summary(
        SummaryFormat::ModulePrint,
        RESNET18_PRINT,
        8,
        image(&[3, 224, 224]),
    )
    .unwrap();
    let layers = &parsed.layers;
    assert_eq!(total_params(layers), 11_689_512, "torchvision's count");
    assert_eq!(layers[0], layer(LayerKind::Conv2d, 64 * 112 * 112, 9_408));
    assert_eq!(layers[1], layer(LayerKind::BatchNorm, 64 * 112 * 112, 128));
    assert_eq!(layers[3], layer(LayerKind::MaxPool, 64 * 56 * 56, 0));
    // layer2's first block: the shortcut reads the block's input, not conv2's output.
    let downsample = layers
        .iter()
        .position(|l| l.params == 64 * 128)
        .expect("the 1x1 shortcut");
    assert_eq!(layers[downsample].output_size, 128 * 28 * 28);
    assert_eq!(
        layers[layers.len() - 2],
        layer(LayerKind::AdaptiveAvgPool, 512, 0)
    );
    assert_eq!(
        layers[layers.len() - 1],
        layer(LayerKind::Linear, 1000, 513_000)
    );
    assert!(warned(
        &parsed,
        "derived from the printed constructor arguments"
    ));
    assert!(warned(&parsed, "input_shape [3, 224, 224]"));
    // Without input_shape, an ImageNet image is assumed and said.
    let assumed =
        parse_summary(SummaryFormat::ModulePrint, RESNET18_PRINT, 8, tokens(None)).unwrap();
    assert_eq!(assumed.layers, parsed.layers);
    assert!(warned(&assumed, "assumed [3, 224, 224]"));
}

const TRANSFORMER_LAYER: &str = "\
TransformerEncoderLayer(
  (self_attn): MultiheadAttention(
    (out_proj): NonDynamicallyQuantizableLinear(in_features=512, out_features=512, bias=True)
  )
  (linear1): Linear(in_features=512, out_features=2048, bias=True)
  (dropout): Dropout(p=0.1, inplace=False)
  (linear2): Linear(in_features=2048, out_features=512, bias=True)
  (norm1): LayerNorm((512,), eps=1e-05, elementwise_affine=True)
  (norm2): LayerNorm((512,), eps=1e-05, elementwise_affine=True)
  (dropout1): Dropout(p=0.1, inplace=False)
  (dropout2): Dropout(p=0.1, inplace=False)
)";

#[test]
fn a_plain_transformer_print_counts_the_attention_input_projection_it_does_not_print() {
    let parsed = parse_summary(
        SummaryFormat::ModulePrint,
        TRANSFORMER_LAYER,
        8,
        tokens(Some(10)),
    )
    .unwrap();
    assert_eq!(total_params(&parsed.layers), 3_152_384, "torch's count");
    assert_eq!(
        parsed.layers.last(),
        Some(&layer(LayerKind::Other, 0, 3 * 512 * 512 + 3 * 512))
    );
    assert_eq!(parsed.layers[1], layer(LayerKind::Attention, 10 * 512, 0));
    assert_eq!(
        parsed.layers[2],
        layer(LayerKind::Linear, 10 * 2048, 1_050_624)
    );
    let err = parse_summary(
        SummaryFormat::ModulePrint,
        TRANSFORMER_LAYER,
        8,
        tokens(None),
    )
    .unwrap_err();
    assert!(err.to_string().starts_with("seq_len: "), "{err}");
}

#[test]
fn norms_that_print_no_width_take_their_neighbours_and_unknown_modules_are_named() {
    let text = "\
T5Stack(
  (embed_tokens): Embedding(32128, 512)
  (block): ModuleList(
    (0-5): 6 x T5Block(
      (layer): ModuleList(
        (0): T5LayerSelfAttention(
          (SelfAttention): T5Attention(
            (q): Linear(in_features=512, out_features=512, bias=False)
            (k): Linear(in_features=512, out_features=512, bias=False)
            (v): Linear(in_features=512, out_features=512, bias=False)
            (o): Linear(in_features=512, out_features=512, bias=False)
          )
          (layer_norm): T5LayerNorm()
          (dropout): Dropout(p=0.1, inplace=False)
        )
        (1): T5LayerFF(
          (DenseReluDense): T5DenseActDense(
            (wi): Linear(in_features=512, out_features=2048, bias=False)
            (wo): Linear(in_features=2048, out_features=512, bias=False)
            (dropout): Dropout(p=0.1, inplace=False)
            (act): ReLU()
          )
          (layer_norm): T5LayerNorm()
          (dropout): Dropout(p=0.1, inplace=False)
        )
      )
    )
  )
  (final_layer_norm): T5LayerNorm()
  (frob): Frobnicator()
  (dropout): Dropout(p=0.1, inplace=False)
)";
    let parsed = parse_summary(SummaryFormat::ModulePrint, text, 8, tokens(Some(64))).unwrap();
    assert_eq!(
        total_params(&parsed.layers),
        35_330_560,
        "transformers' count"
    );
    assert!(
        warned(&parsed, "layer_norm (T5LayerNorm) (512)"),
        "{:?}",
        parsed.warnings
    );
    assert!(warned(&parsed, "frob (Frobnicator): counted as 0"));
}

#[test]
fn an_annotated_data_parallel_print_is_read_through_its_wrapper() {
    let text = format!(
        "DataParallel(\n  (module): {}\n), 76,608 params\n",
        TINY_LM
            .lines()
            .take_while(|l| !l.starts_with('='))
            .collect::<Vec<_>>()
            .join("\n  ")
    );
    let parsed = parse_summary(SummaryFormat::Auto, &text, 8, tokens(Some(128))).unwrap();
    let direct = parse_summary(SummaryFormat::ModulePrint, TINY_LM, 8, tokens(Some(128))).unwrap();
    assert_eq!(parsed.layers, direct.layers);
    assert!(warned(&parsed, "DataParallel wrapper was ignored"));
}

#[test]
fn a_closing_line_below_its_modules_without_a_tied_copy_is_a_warning() {
    let text = "\
M(
  (a): Linear(in_features=4, out_features=4, bias=True), 20 params
  (b): Linear(in_features=4, out_features=2, bias=True), 10 params
), 25 params
Total params: 25
";
    let parsed = parse_summary(SummaryFormat::ModulePrint, text, 8, tokens(None)).unwrap();
    assert_eq!(total_params(&parsed.layers), 30, "the lines are used");
    assert!(warned(
        &parsed,
        "says 25 parameters, its modules add up to 30"
    ));
    assert_eq!(
        parsed.layers[1],
        layer(LayerKind::Linear, 2, 10),
        "one vector"
    );
}

#[test]
fn a_container_that_prints_its_own_arguments_counts_them() {
    let text = "\
Stem(
  (conv): Conv2d(3, 32, kernel_size=(3, 3), stride=(2, 2), padding=(1, 1), bias=False)
  (bn): BatchNormAct2d(
    32, eps=1e-05, momentum=0.1, affine=True, track_running_stats=True
    (drop): Identity()
    (act): SiLU(inplace=True)
  )
  (se): SqueezeExcite(
    (conv_reduce): Conv2d(32, 8, kernel_size=(1, 1), stride=(1, 1))
    (act1): SiLU(inplace=True)
    (conv_expand): Conv2d(8, 32, kernel_size=(1, 1), stride=(1, 1))
    (gate): Sigmoid()
  )
  (pool): AvgPool2d(kernel_size=2, stride=2, padding=0)
)";
    let parsed = parse_summary(SummaryFormat::ModulePrint, text, 8, image(&[3, 64, 64])).unwrap();
    let layers = &parsed.layers;
    assert_eq!(layers[1], layer(LayerKind::BatchNorm, 32 * 32 * 32, 64));
    assert_eq!(total_params(layers), 864 + 64 + (256 + 8) + (256 + 32));
    assert_eq!(
        layers.last(),
        Some(&layer(LayerKind::AvgPool, 32 * 16 * 16, 0)),
        "the gate scales its input: the map goes on unchanged"
    );
}

#[test]
fn a_vit_print_turns_its_patch_grid_into_tokens_with_a_class_token() {
    let text = "\
VisionTransformer(
  (conv_proj): Conv2d(3, 192, kernel_size=(16, 16), stride=(16, 16))
  (encoder): Encoder(
    (layers): Sequential(
      (encoder_layer_0): EncoderBlock(
        (ln_1): LayerNorm((192,), eps=1e-06, elementwise_affine=True)
        (self_attention): MultiheadAttention(
          (out_proj): NonDynamicallyQuantizableLinear(in_features=192, out_features=192, bias=True)
        )
        (mlp): MLPBlock(
          (0): Linear(in_features=192, out_features=768, bias=True)
          (1): GELU(approximate='none')
          (3): Linear(in_features=768, out_features=192, bias=True)
        )
      )
    )
  )
)";
    let parsed = parse_summary(SummaryFormat::ModulePrint, text, 8, image(&[3, 224, 224])).unwrap();
    let layers = &parsed.layers;
    assert_eq!(layers[0], layer(LayerKind::Conv2d, 192 * 14 * 14, 147_648));
    assert_eq!(layers[2].kind, LayerKind::Linear);
    assert_eq!(
        layers[2].output_size,
        197 * 192,
        "196 patches and the class token"
    );
    assert_eq!(layers[4].output_size, 197 * 768);
    assert!(warned(
        &parsed,
        "estimated from the 196 patches of width 192 as 38016"
    ));
    assert_eq!(
        layers.last(),
        Some(&layer(
            LayerKind::Other,
            0,
            (196 + 1) * 192 + 192 + 3 * 192 * 192 + 3 * 192
        )),
        "the position embedding, the class token and the attention's input projection"
    );
}

const KERAS3_FUNCTIONAL: &str = "\
Model: \"resnet50\"
┏━━━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━┳━━━━━━━━━━━━┳━━━━━━━━━━━━━━━━━━━┓
┃ Layer (type)        ┃ Output Shape      ┃    Param # ┃ Connected to      ┃
┡━━━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━┩
│ input_layer         │ (None, 224, 224,  │          0 │ -                 │
│ (InputLayer)        │ 3)                │            │                   │
├─────────────────────┼───────────────────┼────────────┼───────────────────┤
│ conv1_pad           │ (None, 230, 230,  │          0 │ input_layer[0][0] │
│ (ZeroPadding2D)     │ 3)                │            │                   │
├─────────────────────┼───────────────────┼────────────┼───────────────────┤
│ conv1_conv (Conv2D) │ (None, 112, 112,  │      9,472 │ conv1_pad[0][0]   │
│                     │ 64)               │            │                   │
├─────────────────────┼───────────────────┼────────────┼───────────────────┤
│ conv1_bn            │ (None, 112, 112,  │        256 │ conv1_conv[0][0]  │
│ (BatchNormalizatio… │ 64)               │            │                   │
├─────────────────────┼───────────────────┼────────────┼───────────────────┤
│ add (Add)           │ (None, 112, 112,  │          0 │ conv1_bn[0][0],   │
│                     │ 64)               │            │ conv1_conv[0][0]  │
├─────────────────────┼───────────────────┼────────────┼───────────────────┤
│ avg_pool            │ (None, 64)        │          0 │ add[0][0]         │
│ (GlobalAveragePool… │                   │            │                   │
├─────────────────────┼───────────────────┼────────────┼───────────────────┤
│ predictions (Dense) │ (None, 1000)      │     65,000 │ avg_pool[0][0]    │
└─────────────────────┴───────────────────┴────────────┴───────────────────┘
 Total params: 74,728 (291.91 KB)
 Trainable params: 74,600 (291.41 KB)
 Non-trainable params: 128 (512.00 B)
";

const KERAS2_SEQUENTIAL: &str = "\
Model: \"sequential\"
_________________________________________________________________
 Layer (type)                Output Shape              Param #   
=================================================================
 conv2d (Conv2D)             (None, 26, 26, 32)        320       
                                                                 
 max_pooling2d (MaxPooling2  (None, 13, 13, 32)        0         
 D)                                                              
                                                                 
 flatten (Flatten)           (None, 5408)              0         
                                                                 
 dense (Dense)               (None, 10)                54090     
                                                                 
=================================================================
Total params: 54410 (212.54 KB)
Trainable params: 54410 (212.54 KB)
Non-trainable params: 0 (0.00 Byte)
_________________________________________________________________
";

#[test]
fn a_keras3_table_joins_wrapped_cells_and_skips_the_input() {
    let parsed = parse_summary(SummaryFormat::Keras, KERAS3_FUNCTIONAL, 8, tokens(None)).unwrap();
    assert_eq!(
        parsed.layers,
        vec![
            layer(LayerKind::Other, 230 * 230 * 3, 0),
            layer(LayerKind::Conv2d, 112 * 112 * 64, 9_472),
            layer(LayerKind::BatchNorm, 112 * 112 * 64, 256),
            layer(LayerKind::Other, 112 * 112 * 64, 0),
            layer(LayerKind::AdaptiveAvgPool, 64, 0),
            layer(LayerKind::Linear, 1000, 65_000),
        ]
    );
    assert!(parsed.warnings.is_empty(), "{:?}", parsed.warnings);
}

#[test]
fn a_keras2_table_is_read_by_its_header_columns() {
    let parsed = parse_summary(SummaryFormat::Keras, KERAS2_SEQUENTIAL, 8, tokens(None)).unwrap();
    assert_eq!(
        parsed.layers,
        vec![
            layer(LayerKind::Conv2d, 26 * 26 * 32, 320),
            layer(LayerKind::MaxPool, 13 * 13 * 32, 0),
            layer(LayerKind::Flatten, 5408, 0),
            layer(LayerKind::Linear, 10, 54_090),
        ]
    );
    let off = KERAS2_SEQUENTIAL.replace("Total params: 54410", "Total params: 54411");
    let parsed = parse_summary(SummaryFormat::Keras, &off, 8, tokens(None)).unwrap();
    assert!(warned(&parsed, "Total params 54411 differs from the 54410"));
}

#[test]
fn the_format_is_detected_from_the_text() {
    for (text, format) in [
        (KERAS3_FUNCTIONAL, SummaryFormat::Keras),
        (KERAS2_SEQUENTIAL, SummaryFormat::Keras),
        (RESNET18_TORCHSUMMARY, SummaryFormat::Torchsummary),
        (RESNET18_TORCHINFO, SummaryFormat::Torchsummary),
        (TINY_LM, SummaryFormat::ModulePrint),
        (RESNET18_PRINT, SummaryFormat::ModulePrint),
        ("hello", SummaryFormat::Torchsummary),
    ] {
        assert_eq!(SummaryFormat::detect(text), format, "{text:.40}");
    }
    let err = parse_summary(SummaryFormat::Auto, "hello", 8, tokens(None)).unwrap_err();
    assert!(
        err.to_string().starts_with("summary.text line 1: "),
        "{err}"
    );
}

#[test]
fn a_plain_gpt2_print_takes_the_lm_head_as_tied_to_the_vocabulary_embedding() {
    let plain: String = GPT2
        .lines()
        .map(split_params_for_test)
        .collect::<Vec<_>>()
        .join("\n");
    let parsed = parse_summary(SummaryFormat::Auto, &plain, 8, tokens(Some(1024))).unwrap();
    assert_eq!(
        total_params(&parsed.layers),
        124_439_808,
        "transformers' count"
    );
    assert!(warned(
        &parsed,
        "lm_head (Linear) repeat the vocabulary embedding's 50257 x 768"
    ));
}

/// A line without its `, N params`.
fn split_params_for_test(line: &str) -> &str {
    match line.rsplit_once(", ") {
        Some((body, count)) if count.ends_with("params") => body,
        _ => line,
    }
}

#[test]
fn a_timm_norm_act_listed_after_its_activation_runs_before_it() {
    // torchsummary of timm's cspresnet50 stem: BatchNormAct2d's hook fires after its `drop`
    // and `act` children; ConvNormAct (a container) is not a norm and stays.
    let text = "\
----------------------------------------------------------------
        Layer (type)               Output Shape         Param #
================================================================
            Conv2d-1         [-1, 64, 128, 128]           9,408
          Identity-2         [-1, 64, 128, 128]               0
         LeakyReLU-3         [-1, 64, 128, 128]               0
    BatchNormAct2d-4         [-1, 64, 128, 128]             128
       ConvNormAct-5         [-1, 64, 128, 128]               0
         MaxPool2d-6           [-1, 64, 64, 64]               0
================================================================
";
    let layers = parse_summary(SummaryFormat::Torchsummary, text, 8, tokens(None))
        .unwrap()
        .layers;
    assert_eq!(
        kinds(&layers),
        [
            "conv2d",
            "batch_norm",
            "identity",
            "leaky_relu",
            "other",
            "max_pool"
        ]
    );
    assert_eq!(layers[1].params, 128);
}

#[test]
fn a_tables_input_size_footer_and_first_output_give_the_input_image() {
    // torchsummary: 0.57 MiB of fp32 input per sample (batch -1), a first output 112 high.
    let parsed = parse_summary(
        SummaryFormat::Torchsummary,
        RESNET18_TORCHSUMMARY,
        8,
        tokens(None),
    )
    .unwrap();
    assert_eq!(parsed.input_shape, Some([3, 224, 224]));
    // The same printed at batch 32: the footer counts the batch's input.
    let batch_32 = RESNET18_TORCHSUMMARY
        .replace("[-1,", "[32,")
        .replace("Input size (MB): 0.57", "Input size (MB): 18.38");
    let parsed = parse_summary(SummaryFormat::Torchsummary, &batch_32, 32, tokens(None)).unwrap();
    assert_eq!(parsed.input_shape, Some([3, 224, 224]));
    // torchinfo counts megabytes of 10^6 bytes: 0.60 MB.
    let parsed = parse_summary(
        SummaryFormat::Torchsummary,
        RESNET18_TORCHINFO,
        8,
        tokens(None),
    )
    .unwrap();
    assert_eq!(parsed.input_shape, Some([3, 224, 224]));
    // A footer no square RGB image fits, or none at all: no shape.
    let odd = RESNET18_TORCHSUMMARY.replace("Input size (MB): 0.57", "Input size (MB): 0.40");
    let parsed = parse_summary(SummaryFormat::Torchsummary, &odd, 8, tokens(None)).unwrap();
    assert_eq!(parsed.input_shape, None);
    let none = RESNET18_TORCHSUMMARY.replace("Input size (MB): 0.57", "");
    let parsed = parse_summary(SummaryFormat::Torchsummary, &none, 8, tokens(None)).unwrap();
    assert_eq!(parsed.input_shape, None);
}

#[test]
fn a_printout_is_never_read_as_more_layers_than_its_price_bound() {
    let fixture = |name: &str| {
        std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/summaries")
                .join(name),
        )
        .unwrap()
    };
    let rgb = [3, 224, 224];
    for (name, sample) in [
        ("tiny_lm_module_print.txt", tokens(Some(16))),
        ("gpt2_module_print.txt", tokens(Some(64))),
        ("bert_base_module_print.txt", tokens(Some(64))),
        ("resnet18_print.txt", image(&rgb)),
        ("resnet18_torchinfo.txt", image(&rgb)),
        ("resnet18_torchsummary.txt", image(&rgb)),
    ] {
        let text = fixture(name);
        let parsed = parse_summary(SummaryFormat::Auto, &text, 8, sample).unwrap();
        let bound = layers_bound(&text);
        assert!(
            parsed.layers.len() as u64 <= bound,
            "{name}: {} layers, bound {bound}",
            parsed.layers.len()
        );
    }
    // Collapsed repeats count as their copies, nested ones multiply (2 for `Net(`, 2 x 3 for
    // the blocks, 2 x 6 for their linears), and the bound stops one past what a job holds.
    let nested = "Net(\n  (0-2): 3 x Block(\n    (0-1): 2 x Linear(in_features=2, \
                  out_features=2, bias=True)\n  )\n)";
    assert_eq!(layers_bound(nested), 20);
    let bomb = "Net(\n  (0-4094): 4095 x Linear(in_features=3, out_features=3, bias=True)\n)";
    assert_eq!(layers_bound(bomb), MAX_LAYERS as u64 + 1);
    assert_eq!(layers_bound(&"x\n".repeat(100_000)), MAX_LAYERS as u64 + 1);
}
