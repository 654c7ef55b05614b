"""Example models for describe's `module:` specs (`cd describe/examples && python -m gpucast_describe
module:hf_models:gpt2_small ...`), importable from describe/ as examples.hf_models."""
