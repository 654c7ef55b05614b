//! GPT-2: learned positions, LayerNorm, a fused qkv projection (`c_attn`), GELU MLP.

use super::{dropout, Body, Builder, Head, Saved, Shapes};
use crate::job::validated::LayerKind;

/// The embeddings and the blocks (the head follows in [`super::build`]).
pub(super) fn body(b: &mut Builder, s: &Shapes, outside: &mut Saved) -> Body {
    let Shapes {
        c,
        h,
        i_size,
        q,
        math,
        attention_flops,
        layer_norm,
        ..
    } = *s;
    let mut blocks = Saved::default();
    b.push(
        "transformer.wte".into(),
        LayerKind::Embedding,
        c.vocab * c.hidden,
        c.hidden,
        0,
    );
    b.push(
        "transformer.wpe".into(),
        LayerKind::Embedding,
        c.positions * c.hidden,
        c.hidden,
        0,
    );
    b.push(
        "transformer.drop".into(),
        LayerKind::Dropout,
        0,
        c.hidden,
        0,
    );
    let resid = dropout(c.hidden_dropout);
    outside.mask += resid * h;
    for i in 0..c.layers {
        let p = b.prefix(|| format!("transformer.h.{i}"));
        b.layer_norm(b.name(&p, "ln_1"), c.hidden);
        b.push(
            b.name(&p, "attn"),
            LayerKind::Attention,
            0,
            c.hidden,
            attention_flops,
        );
        b.linear(
            b.name(&p, "attn.c_attn"),
            c.hidden,
            3 * c.hidden,
            true,
            true,
        );
        b.linear(b.name(&p, "attn.c_proj"), c.hidden, c.hidden, true, true);
        b.push(
            b.name(&p, "attn.resid_dropout"),
            LayerKind::Dropout,
            0,
            c.hidden,
            0,
        );
        b.layer_norm(b.name(&p, "ln_2"), c.hidden);
        b.linear(b.name(&p, "mlp.c_fc"), c.hidden, c.intermediate, true, true);
        b.push(b.name(&p, "mlp.act"), LayerKind::Gelu, 0, c.intermediate, 0);
        b.linear(
            b.name(&p, "mlp.c_proj"),
            c.intermediate,
            c.hidden,
            true,
            true,
        );
        b.push(
            b.name(&p, "mlp.dropout"),
            LayerKind::Dropout,
            0,
            c.hidden,
            0,
        );
        let mut block = layer_norm;
        // The fused qkv output, the kernel's contiguous q, k and v, the output.
        let mut attention = s.attention_saved(q);
        if !math {
            attention.compute += 3.0 * h - q;
        }
        block.add(attention);
        block.add(layer_norm);
        block.add(Saved {
            compute: if c.python_gelu { 5.0 } else { 2.0 } * i_size,
            mask: 2.0 * resid * h,
            ..Default::default()
        });
        blocks.add(block);
    }
    b.layer_norm("transformer.ln_f".into(), c.hidden);
    outside.add(layer_norm);
    let head = Head::LanguageModel("lm_head", false);
    let block_count = c.layers;
    Body {
        blocks,
        block_count,
        head,
    }
}
