"""What autocast keeps of the traced fp32 saved tensors: the constant AUTOCAST_KEPT_SHARE of the
service's analytic training step (src/physics/step.rs), the median of `amp / traced` over these
five models. For each, describe's simulated step in fp32 and in fp16 autocast at batch 8:
prints the traced saved bytes, the simulated activations at the peak and their ratios.

    cd describe && ../.venv-describe/bin/python -m scripts.autocast_kept_share
"""

import torch

from gpucast_describe import describe_module


class LossOf(torch.nn.Module):
    """A causal LM whose forward returns its own loss on the input ids."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, labels=ids).loss


def llama():
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=1024,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2816,
        vocab_size=32000,
    )
    return LossOf(transformers.LlamaForCausalLM(config))


def gpt2():
    import transformers

    return LossOf(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=768, n_layer=4, n_head=12)))


def timm_model(name):
    import timm

    return lambda: timm.create_model(name)


CASES = [
    ("llama (4 layers)", llama, [512], torch.int64),
    ("gpt2 (4 layers)", gpt2, [512], torch.int64),
    ("vit_base_patch16_224", timm_model("vit_base_patch16_224"), [3, 224, 224], torch.float32),
    ("resnet50", timm_model("resnet50"), [3, 224, 224], torch.float32),
    ("convnext_tiny", timm_model("convnext_tiny"), [3, 224, 224], torch.float32),
]


def main():
    torch.set_num_threads(1)
    for name, factory, shape, dtype in CASES:
        with torch.device("meta"):
            module = factory()
        peaks = {}
        for precision in ("fp32", "amp_fp16"):
            description = describe_module(module, shape, 8, input_dtype=dtype, precision=precision)
            peaks[precision] = description["simulation"]["breakdown_at_peak"]["activations"]
        saved = description["saved_tensors"]
        traced = saved["per_sample_bytes"] * 8 + saved["fixed_bytes"]
        # The constant scales the traced fp32 bytes: amp / traced is the share it stands for.
        print(
            f"{name}: traced {traced >> 20} MiB, simulated activations fp32 {peaks['fp32'] >> 20} MiB, "
            f"amp_fp16 {peaks['amp_fp16'] >> 20} MiB; amp / traced {peaks['amp_fp16'] / traced:.3f}, "
            f"amp / fp32 {peaks['amp_fp16'] / peaks['fp32']:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
