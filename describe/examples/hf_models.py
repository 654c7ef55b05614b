"""Hugging Face transformers models built from their published configurations (no download),
for `python -m gpucast_describe module:hf_models:<factory>` run from this folder:

    cd describe/examples
    python -m gpucast_describe module:hf_models:gpt2_small --seq-len 1024 --batch-size 32

A model whose config.json is at hand needs no factory: `hf:<folder or cached model id>`.
"""

import transformers


def gpt2_small():
    """GPT-2 (124 M) with its LM head: token logits [B, L, 50257]."""
    return transformers.GPT2LMHeadModel(transformers.GPT2Config())


def gpt2_xl():
    """GPT-2 XL (1.56 B): 48 layers, width 1600, 25 heads."""
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=48, n_embd=1600, n_head=25))


def bert_base_mlm():
    """BERT-base (110 M) with its masked-LM head."""
    return transformers.BertForMaskedLM(transformers.BertConfig())


def bert_large_classifier():
    """BERT-large (336 M) with a 2-label sequence-classification head."""
    return transformers.BertForSequenceClassification(
        transformers.BertConfig(
            hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, num_labels=2
        )
    )


def tinyllama():
    """TinyLlama-1.1B's published configuration: 22 layers, width 2048, 32 heads sharing 4 KV heads."""
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            vocab_size=32000,
            max_position_embeddings=2048,
        )
    )


def t5_small():
    """T5-small (60 M) encoder-decoder; called with input ids only, which the decoder reads too."""
    model = transformers.T5ForConditionalGeneration(transformers.T5Config())
    forward = model.forward
    model.forward = lambda input_ids: forward(input_ids=input_ids, decoder_input_ids=input_ids)
    return model
