//! ChatGLM2/3 and GLM-4 as THUDM's remote code builds them (`model_type: chatglm`): pre-RMSNorm,
//! one fused `query_key_value` (multi-query groups), a fused SwiGLU `dense_h_to_4h`, and an
//! output layer of its own over the padded vocabulary.

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
        rms,
        layer_norm,
        ..
    } = *s;
    // `rmsnorm: false` (a few GLM variants) is LayerNorm.
    let norm = if c.layer_norm { layer_norm } else { rms };
    let push_norm = |b: &mut Builder, name: String| {
        if c.layer_norm {
            b.layer_norm(name, c.hidden)
        } else {
            b.rms_norm(name, c.hidden)
        }
    };
    let mut blocks = Saved::default();
    b.push(
        "transformer.embedding.word_embeddings".into(),
        LayerKind::Embedding,
        c.vocab * c.hidden,
        c.hidden,
        0,
    );
    let resid = dropout(c.hidden_dropout);
    let (qd, kvd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    for i in 0..c.layers {
        let p = b.prefix(|| format!("transformer.encoder.layers.{i}"));
        push_norm(b, b.name(&p, "input_layernorm"));
        b.push(
            b.name(&p, "self_attention.core_attention"),
            LayerKind::Attention,
            0,
            c.hidden,
            attention_flops,
        );
        b.linear(
            b.name(&p, "self_attention.query_key_value"),
            c.hidden,
            qd + 2 * kvd,
            c.qkv_bias,
            true,
        );
        b.linear(
            b.name(&p, "self_attention.dense"),
            qd,
            c.hidden,
            c.mlp_bias,
            true,
        );
        push_norm(b, b.name(&p, "post_attention_layernorm"));
        b.linear(
            b.name(&p, "mlp.dense_h_to_4h"),
            c.hidden,
            2 * c.intermediate,
            c.mlp_bias,
            true,
        );
        b.push(
            b.name(&p, "mlp.activation_func"),
            LayerKind::Silu,
            0,
            c.intermediate,
            0,
        );
        b.linear(
            b.name(&p, "mlp.dense_4h_to_h"),
            c.intermediate,
            c.hidden,
            c.mlp_bias,
            true,
        );
        let mut block = norm;
        // The multi-query keys and values are expanded to every head (made contiguous) before
        // the kernel, which keeps them at the query's width.
        block.add(s.attention_saved(q));
        block.add(norm);
        // The fused gate-up output, the SiLU of its first half, the product; the dropouts
        // after attention and MLP where on.
        block.add(Saved {
            compute: 4.0 * i_size,
            mask: 2.0 * resid * h,
            ..Default::default()
        });
        blocks.add(block);
    }
    push_norm(b, "transformer.encoder.final_layernorm".into());
    outside.add(norm);
    let head = Head::LanguageModel("transformer.output_layer", false);
    let block_count = c.layers;
    Body {
        blocks,
        block_count,
        head,
    }
}
