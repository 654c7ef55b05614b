//! BERT-style encoders (BERT, RoBERTa, XLM-R): post-norm, its masked-LM prediction head, or
//! the pooler and `classifier` of a sequence classifier.

use super::{dropout, product, Body, Builder, Head, Saved, Shapes};
use crate::job::validated::LayerKind;

/// The embeddings and the blocks (the head follows in [`super::build`]).
pub(super) fn body(b: &mut Builder, s: &Shapes, outside: &mut Saved) -> Body {
    let Shapes {
        c,
        seq,
        h,
        i_size,
        q,
        attention_flops,
        layer_norm,
        lm_loss,
        head_params,
        ..
    } = *s;
    let mut blocks = Saved::default();
    b.push(
        "bert.embeddings.word_embeddings".into(),
        LayerKind::Embedding,
        c.vocab * c.hidden,
        c.hidden,
        0,
    );
    b.push(
        "bert.embeddings.position_embeddings".into(),
        LayerKind::Embedding,
        c.positions * c.hidden,
        c.hidden,
        0,
    );
    b.push(
        "bert.embeddings.token_type_embeddings".into(),
        LayerKind::Embedding,
        c.type_vocab * c.hidden,
        c.hidden,
        0,
    );
    b.layer_norm("bert.embeddings.LayerNorm".into(), c.hidden);
    b.push(
        "bert.embeddings.dropout".into(),
        LayerKind::Dropout,
        0,
        c.hidden,
        0,
    );
    let resid = dropout(c.hidden_dropout);
    // Post-norm: each norm's input is a fresh sum; its output feeds the next matmuls.
    let post_norm = Saved {
        norm: h,
        fp32: 2.0,
        compute: h,
        mask: resid * h,
        ..Default::default()
    };
    outside.add(post_norm);
    for i in 0..c.layers {
        let p = b.prefix(|| format!("bert.encoder.layer.{i}"));
        b.push(
            b.name(&p, "attention.self"),
            LayerKind::Attention,
            0,
            c.hidden,
            attention_flops,
        );
        b.linear(
            b.name(&p, "attention.self.query"),
            c.hidden,
            c.hidden,
            true,
            true,
        );
        b.linear(
            b.name(&p, "attention.self.key"),
            c.hidden,
            c.hidden,
            true,
            true,
        );
        b.linear(
            b.name(&p, "attention.self.value"),
            c.hidden,
            c.hidden,
            true,
            true,
        );
        b.linear(
            b.name(&p, "attention.output.dense"),
            c.hidden,
            c.hidden,
            true,
            true,
        );
        b.layer_norm(b.name(&p, "attention.output.LayerNorm"), c.hidden);
        b.linear(
            b.name(&p, "intermediate.dense"),
            c.hidden,
            c.intermediate,
            true,
            true,
        );
        b.push(
            b.name(&p, "intermediate.intermediate_act_fn"),
            LayerKind::Gelu,
            0,
            c.intermediate,
            0,
        );
        b.linear(
            b.name(&p, "output.dense"),
            c.intermediate,
            c.hidden,
            true,
            true,
        );
        b.layer_norm(b.name(&p, "output.LayerNorm"), c.hidden);
        let mut block = s.attention_saved(q);
        block.autocast_copies += 2.0 * h;
        block.add(post_norm);
        block.add(Saved {
            compute: 2.0 * i_size,
            ..Default::default()
        });
        block.add(post_norm);
        blocks.add(block);
    }
    if let Some(labels) = c.classifier_labels {
        // The pooler reads the first token only; the loss is over a few labels.
        b.linear("bert.pooler.dense".into(), c.hidden, c.hidden, true, true);
        b.push(
            "bert.pooler.activation".into(),
            LayerKind::Tanh,
            0,
            c.hidden,
            0,
        );
        b.linear("classifier".into(), c.hidden, labels, true, true);
        let first = b.layers.len() - 3;
        for layer in &mut b.layers[first..] {
            layer.output_size /= seq.max(1);
        }
        return Body {
            blocks,
            block_count: c.layers,
            head: Head::Classifier,
        };
    }
    b.linear(
        "cls.predictions.transform.dense".into(),
        c.hidden,
        c.hidden,
        true,
        true,
    );
    b.push(
        "cls.predictions.transform.transform_act_fn".into(),
        LayerKind::Gelu,
        0,
        c.hidden,
        0,
    );
    b.layer_norm("cls.predictions.transform.LayerNorm".into(), c.hidden);
    // The decoder's bias is its own even when the weight is tied.
    let decoder_params = if head_params { c.hidden * c.vocab } else { 0 } + c.vocab;
    b.push(
        "cls.predictions.decoder".into(),
        LayerKind::Linear,
        decoder_params,
        c.vocab,
        product(&[2, c.hidden, c.vocab, seq]),
    );
    if let Some(d) = b.details.last_mut() {
        d.in_features = Some(c.hidden);
        d.out_features = Some(c.vocab);
    }
    outside.add(Saved {
        compute: h,
        ..Default::default()
    });
    outside.add(layer_norm);
    outside.add(lm_loss);
    let head = Head::Own;
    let block_count = c.layers;
    Body {
        blocks,
        block_count,
        head,
    }
}
