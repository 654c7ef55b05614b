//! Phi-1/Phi-2: one LayerNorm read by attention and MLP in parallel, GELU MLP, biased head.

use super::{dropout, Body, Builder, Head, Saved, Shapes};
use crate::job::validated::LayerKind;

/// The embeddings and the blocks (the head follows in [`super::build`]).
pub(super) fn body(b: &mut Builder, s: &Shapes, outside: &mut Saved) -> Body {
    let Shapes {
        c,
        h,
        i_size,
        q,
        kv,
        sixteen,
        attention_flops,
        layer_norm,
        ..
    } = *s;
    let mut blocks = Saved::default();
    b.push(
        "model.embed_tokens".into(),
        LayerKind::Embedding,
        c.vocab * c.hidden,
        c.hidden,
        0,
    );
    let resid = dropout(c.hidden_dropout);
    outside.mask += resid * h;
    for i in 0..c.layers {
        let p = b.prefix(|| format!("model.layers.{i}"));
        b.layer_norm(b.name(&p, "input_layernorm"), c.hidden);
        b.push(
            b.name(&p, "self_attn"),
            LayerKind::Attention,
            0,
            c.hidden,
            attention_flops,
        );
        let (qd, kvd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        b.linear(b.name(&p, "self_attn.q_proj"), c.hidden, qd, true, true);
        b.linear(b.name(&p, "self_attn.k_proj"), c.hidden, kvd, true, true);
        b.linear(b.name(&p, "self_attn.v_proj"), c.hidden, kvd, true, true);
        b.linear(b.name(&p, "self_attn.dense"), qd, c.hidden, true, true);
        b.linear(b.name(&p, "mlp.fc1"), c.hidden, c.intermediate, true, true);
        b.push(
            b.name(&p, "mlp.activation_fn"),
            LayerKind::Gelu,
            0,
            c.intermediate,
            0,
        );
        b.linear(b.name(&p, "mlp.fc2"), c.intermediate, c.hidden, true, true);
        let mut block = layer_norm;
        block.autocast_copies += 3.0 * h;
        block.add(s.attention_saved(if sixteen { kv } else { q }));
        block.add(Saved {
            compute: if c.python_gelu { 5.0 } else { 2.0 } * i_size,
            mask: resid * h,
            ..Default::default()
        });
        blocks.add(block);
    }
    b.layer_norm("model.final_layernorm".into(), c.hidden);
    outside.add(layer_norm);
    let head = Head::LanguageModel("lm_head", true);
    let block_count = c.layers;
    Body {
        blocks,
        block_count,
        head,
    }
}
