//! Llama-style decoders (Llama, Mistral, Qwen2/3, Gemma, Phi-3, Mixtral and Qwen MoE, OLMo,
//! Granite, InternLM2): pre-RMSNorm, rotary, gated MLP or routed experts.

use super::{Body, Builder, Head, Saved, Shapes};
use crate::job::names::Experts;
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
        rms,
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
    for i in 0..c.layers {
        let p = b.prefix(|| format!("model.layers.{i}"));
        b.rms_norm(b.name(&p, "input_layernorm"), c.hidden);
        b.push(
            b.name(&p, "self_attn"),
            LayerKind::Attention,
            0,
            c.hidden,
            attention_flops,
        );
        let (qd, kvd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        if c.fused {
            b.linear(
                b.name(&p, "self_attn.qkv_proj"),
                c.hidden,
                qd + 2 * kvd,
                c.qkv_bias,
                true,
            );
        } else {
            b.linear(
                b.name(&p, "self_attn.q_proj"),
                c.hidden,
                qd,
                c.qkv_bias,
                true,
            );
            b.linear(
                b.name(&p, "self_attn.k_proj"),
                c.hidden,
                kvd,
                c.qkv_bias,
                true,
            );
            b.linear(
                b.name(&p, "self_attn.v_proj"),
                c.hidden,
                kvd,
                c.qkv_bias,
                true,
            );
        }
        b.linear(b.name(&p, "self_attn.o_proj"), qd, c.hidden, false, true);
        b.rms_norm(b.name(&p, "post_attention_layernorm"), c.hidden);
        let mut block = rms;
        block.add(s.attention_saved(if sixteen { kv } else { q }));
        block.add(rms);
        // q, k and v (gate and up) read the same norm output: cast three (two) times.
        if !c.fused {
            block.autocast_copies += 2.0 * h + if c.experts > 0 { 0.0 } else { h };
        }
        if c.experts > 0 {
            let (e, k) = (c.experts, c.experts_per_token);
            b.linear(b.name(&p, "mlp.gate"), c.hidden, e, false, true);
            b.experts(
                b.name(&p, "mlp.experts"),
                Experts {
                    count: e,
                    hidden: c.hidden,
                    intermediate: c.intermediate,
                },
                k,
            );
            b.push(
                b.name(&p, "mlp.experts.act_fn"),
                LayerKind::Silu,
                0,
                k * c.intermediate,
                0,
            );
            let (e, k) = (e as f64, k as f64);
            // Router probabilities and weights, the routed copies of each token, the
            // experts' gate-up outputs, activation and product, their outputs.
            block.add(Saved {
                compute: k * (2.0 * h + 4.0 * i_size),
                fp32: e + 1.0 + 2.0 * k,
                int64: 4.0 * k,
                ..Default::default()
            });
        } else {
            let act = if c.model_type.starts_with("gemma") {
                LayerKind::Gelu
            } else {
                LayerKind::Silu
            };
            if c.fused {
                b.linear(
                    b.name(&p, "mlp.gate_up_proj"),
                    c.hidden,
                    2 * c.intermediate,
                    c.mlp_bias,
                    true,
                );
                b.push(b.name(&p, "mlp.activation_fn"), act, 0, c.intermediate, 0);
            } else {
                b.linear(
                    b.name(&p, "mlp.gate_proj"),
                    c.hidden,
                    c.intermediate,
                    c.mlp_bias,
                    true,
                );
                b.push(b.name(&p, "mlp.act_fn"), act, 0, c.intermediate, 0);
                b.linear(
                    b.name(&p, "mlp.up_proj"),
                    c.hidden,
                    c.intermediate,
                    c.mlp_bias,
                    true,
                );
            }
            b.linear(
                b.name(&p, "mlp.down_proj"),
                c.intermediate,
                c.hidden,
                c.mlp_bias,
                true,
            );
            // Gate output, activation output, up output, their product.
            block.add(Saved {
                compute: 4.0 * i_size,
                ..Default::default()
            });
        }
        blocks.add(block);
    }
    b.rms_norm("model.norm".into(), c.hidden);
    outside.add(rms);
    let head = Head::LanguageModel("lm_head", false);
    let block_count = c.layers;
    Body {
        blocks,
        block_count,
        head,
    }
}
