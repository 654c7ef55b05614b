//! T5-style encoder-decoders (T5, mT5, UMT5): RMSNorm, relative position bias, cross-attention.

use super::{dropout, Body, Builder, Head, Saved, Shapes};
use crate::job::validated::LayerKind;

/// The embeddings and the blocks (the head follows in [`super::build`]).
pub(super) fn body(b: &mut Builder, s: &Shapes, outside: &mut Saved) -> Body {
    let Shapes {
        c,
        seq,
        h,
        l,
        i_size,
        q,
        heads,
        attention_flops,
        ..
    } = *s;
    let mut blocks = Saved::default();
    b.push(
        "shared".into(),
        LayerKind::Embedding,
        c.vocab * c.hidden,
        c.hidden,
        0,
    );
    let resid = dropout(c.hidden_dropout);
    let t5_norm = Saved {
        norm: 2.0 * h,
        fp32: 1.0,
        compute: h,
        ..Default::default()
    };
    // T5 attention: the relative-position bias, expanded to the batch, is an additive
    // mask the kernel keeps (once per stack: every layer reads the same tensor).
    let bias = Saved {
        norm: heads * l,
        ..Default::default()
    };
    let ffn = Saved {
        compute: if c.gated { 4.0 } else { 2.0 } * i_size,
        mask: resid * (i_size + h),
        ..Default::default()
    };
    let mut attention = s.attention_saved(q);
    attention.mask += resid * h;
    let (qd, ff) = (c.heads * c.head_dim, c.intermediate);
    let stack = |b: &mut Builder, stack: &str, count: u64, cross: bool| {
        for i in 0..count {
            let p = b.prefix(|| format!("{stack}.block.{i}.layer"));
            b.rms_norm(b.name(&p, "0.layer_norm"), c.hidden);
            b.push(
                b.name(&p, "0.SelfAttention"),
                LayerKind::Attention,
                0,
                c.hidden,
                attention_flops,
            );
            for proj in [
                "0.SelfAttention.q",
                "0.SelfAttention.k",
                "0.SelfAttention.v",
            ] {
                b.linear(b.name(&p, proj), c.hidden, qd, false, true);
            }
            if i == 0 {
                b.push(
                    b.name(&p, "0.SelfAttention.relative_attention_bias"),
                    LayerKind::Embedding,
                    c.relative_buckets * c.heads,
                    c.heads * seq,
                    0,
                );
            }
            b.linear(b.name(&p, "0.SelfAttention.o"), qd, c.hidden, false, true);
            // The feed-forward sublayer follows the attention sublayers.
            let ffn = b.name(&p, if cross { "2" } else { "1" });
            if cross {
                b.rms_norm(b.name(&p, "1.layer_norm"), c.hidden);
                b.push(
                    b.name(&p, "1.EncDecAttention"),
                    LayerKind::Attention,
                    0,
                    c.hidden,
                    attention_flops,
                );
                for proj in [
                    "1.EncDecAttention.q",
                    "1.EncDecAttention.k",
                    "1.EncDecAttention.v",
                ] {
                    b.linear(b.name(&p, proj), c.hidden, qd, false, true);
                }
                b.linear(b.name(&p, "1.EncDecAttention.o"), qd, c.hidden, false, true);
            }
            b.rms_norm(b.name(&ffn, "layer_norm"), c.hidden);
            if c.gated {
                b.linear(
                    b.name(&ffn, "DenseReluDense.wi_0"),
                    c.hidden,
                    ff,
                    false,
                    true,
                );
                b.linear(
                    b.name(&ffn, "DenseReluDense.wi_1"),
                    c.hidden,
                    ff,
                    false,
                    true,
                );
            } else {
                b.linear(b.name(&ffn, "DenseReluDense.wi"), c.hidden, ff, false, true);
            }
            b.push(
                b.name(&ffn, "DenseReluDense.act"),
                LayerKind::Relu,
                0,
                ff,
                0,
            );
            b.linear(b.name(&ffn, "DenseReluDense.wo"), ff, c.hidden, false, true);
        }
        b.rms_norm(b.name(stack, "final_layer_norm"), c.hidden);
    };
    stack(b, "encoder", c.layers, false);
    stack(b, "decoder", c.decoder_layers, true);
    let mut encoder_block = t5_norm;
    encoder_block.autocast_copies += 2.0 * h;
    encoder_block.add(attention);
    encoder_block.add(t5_norm);
    encoder_block.add(ffn);
    let mut decoder_block = encoder_block;
    // Cross-attention: its norm, the encoder output's copy for k and v, the kernel.
    decoder_block.add(t5_norm);
    decoder_block.add(Saved {
        compute: h,
        autocast_copies: 3.0 * h,
        ..Default::default()
    });
    decoder_block.add(attention);
    blocks.add(encoder_block.scaled(c.layers as f64));
    blocks.add(decoder_block.scaled(c.decoder_layers as f64));
    // Embedding dropout of both stacks, the two biases (self and cross), the final
    // norms with their dropout, the head's input copy, the loss.
    outside.add(Saved {
        mask: 4.0 * resid * h,
        norm: 4.0 * h + 2.0 * heads * l,
        fp32: 2.0,
        compute: h,
        ..Default::default()
    });
    let _ = bias;
    let head = Head::LanguageModel("lm_head", false);
    let block_count = c.layers + c.decoder_layers;
    Body {
        blocks,
        block_count,
        head,
    }
}
