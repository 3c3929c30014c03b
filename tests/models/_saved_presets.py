"""What the loading tests of the CPU and the GPU share: every tiny preset built in fp32 and saved by
``save_pretrained`` (the directories users load), and a model's tensors by name."""

from __future__ import annotations

import torch

from osdn_diag.catalog.presets import PRESETS
from osdn_diag.models import load_model

TINY = sorted(name for name in PRESETS if name.endswith("-tiny"))


def save_tiny_presets(tmp_path_factory) -> dict:
    """``{preset: directory}`` for every preset of :data:`TINY`."""
    out = {}
    for name in TINY:
        directory = tmp_path_factory.mktemp(name)
        load_model(f"random:{name}", dtype=torch.float32).model.save_pretrained(directory)
        out[name] = directory
    return out


def tensors(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by name (tied parameters once)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}
