"""Modules on the meta device: what the layer walk (:mod:`.walker`) and the simulated training
step (:mod:`.simulate`) run on."""

from __future__ import annotations

import copy

import torch.nn as nn


def on_meta(module: nn.Module) -> nn.Module:
    """The module itself when all its tensors are on the meta device, else a meta copy."""
    tensors = list(module.parameters()) + list(module.buffers())
    if all(t.is_meta for t in tensors):
        return module
    return copy.deepcopy(module).to("meta")
