//! GPT-NeoX (Pythia, StableLM alpha): LayerNorm, fused `query_key_value`, parallel
//! residual by default.

use super::{dropout, Body, Builder, Head, Saved, Shapes};
use crate::job::validated::LayerKind;

/// The embeddings and the blocks (the head follows in [`super::build`]).
pub(super) fn body(b: &mut Builder, s: &Shapes, outside: &mut Saved) -> Body {
    let Shapes {
        c,
        h,
        i_size,
        q,
        attention_flops,
        layer_norm,
        ..
    } = *s;
    let mut blocks = Saved::default();
    b.push(
        "gpt_neox.embed_in".into(),
        LayerKind::Embedding,
        c.vocab * c.hidden,
        c.hidden,
        0,
    );
    let resid = dropout(c.hidden_dropout);
    outside.mask += resid * h;
    for i in 0..c.layers {
        let p = b.prefix(|| format!("gpt_neox.layers.{i}"));
        b.layer_norm(b.name(&p, "input_layernorm"), c.hidden);
        b.push(
            b.name(&p, "attention"),
            LayerKind::Attention,
            0,
            c.hidden,
            attention_flops,
        );
        b.linear(
            b.name(&p, "attention.query_key_value"),
            c.hidden,
            3 * c.hidden,
            true,
            true,
        );
        b.linear(
            b.name(&p, "attention.dense"),
            c.hidden,
            c.hidden,
            true,
            true,
        );
        b.layer_norm(b.name(&p, "post_attention_layernorm"), c.hidden);
        b.linear(
            b.name(&p, "mlp.dense_h_to_4h"),
            c.hidden,
            c.intermediate,
            true,
            true,
        );
        b.push(b.name(&p, "mlp.act"), LayerKind::Gelu, 0, c.intermediate, 0);
        b.linear(
            b.name(&p, "mlp.dense_4h_to_h"),
            c.intermediate,
            c.hidden,
            true,
            true,
        );
        let mut block = layer_norm;
        block.add(s.attention_saved(q));
        if c.parallel_residual {
            // The second norm reads the same input.
            block.add(Saved {
                fp32: 2.0,
                compute: h,
                ..Default::default()
            });
        } else {
            block.add(layer_norm);
        }
        block.add(Saved {
            compute: 2.0 * i_size,
            mask: 2.0 * resid * h,
            ..Default::default()
        });
        blocks.add(block);
    }
    b.layer_norm("gpt_neox.final_layer_norm".into(), c.hidden);
    outside.add(layer_norm);
    let head = Head::LanguageModel("embed_out", false);
    let block_count = c.layers;
    Body {
        blocks,
        block_count,
        head,
    }
}
