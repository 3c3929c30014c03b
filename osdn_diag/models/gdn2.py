"""A minimal Gated DeltaNet-2 language model: fla 0.6.0 ships the layer (``fla.layers.gdn2.GatedDeltaNet2``)
and its kernels, but no model class.

Everything except the token mixer is fla's KDA model: :class:`GDN2Block` subclasses fla's ``KDABlock``
(norms, gated MLP, attention-residual paths, forward) and swaps ``block.attn`` for a
``GatedDeltaNet2`` built from the same config fields; :class:`GDN2Model` / :class:`GDN2ForCausalLM` are
built like ``KDAModel`` / ``KDAForCausalLM`` and run ``FLAModel.forward`` / ``FLAForCausalLM.forward``.
Layers that an fla ``attn`` config assigns to standard attention stay standard attention.

:class:`GDN2Config` is fla's :class:`~fla.models.KDAConfig` (model type ``"gdn2"``); the KDA-only
``safe_gate`` / ``lower_bound`` are refused, since the GDN-2 layer has no such options.

Initialisation follows KDA's: ``A_log = log U(1, 16)`` per head, ``dt_bias`` the inverse softplus of
a log-uniform step in [1e-3, 0.1] per key channel — the values the layer itself draws — with weights
that ``from_pretrained`` loaded left alone. Importing this module registers the config and models
with transformers' ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM``, so a saved model loads
with ``AutoModelForCausalLM.from_pretrained(dir)`` (safetensors) and ``random:gdn2-*`` presets build.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from fla.layers.gdn2 import GatedDeltaNet2
from fla.layers.kda import KimiDeltaAttention
from fla.models.generation_utils import FLAUnsupportedCacheGenerationMixin
from fla.models.kda.configuration_kda import KDAConfig
from fla.models.kda.modeling_kda import KDABlock, KDAPreTrainedModel
from fla.models.modeling_utils import FLAForCausalLM, FLAModel

from .modeling import _build_backbone

__all__ = ["GDN2Block", "GDN2Config", "GDN2ForCausalLM", "GDN2Model", "GDN2PreTrainedModel"]


class GDN2Config(KDAConfig):
    """fla's ``KDAConfig`` for a model of ``GatedDeltaNet2`` layers (``model_type = "gdn2"``)."""

    model_type = "gdn2"

    def __init__(self, **kwargs):
        if kwargs.get("safe_gate") or kwargs.get("lower_bound") is not None:
            raise ValueError("GDN2Config: 'safe_gate' and 'lower_bound' are KDA options the GDN-2 layer does not take")
        super().__init__(**kwargs)


class GDN2Block(KDABlock):
    """fla's ``KDABlock`` with ``GatedDeltaNet2`` as its mixer."""

    def __init__(self, config: GDN2Config, layer_idx: int):
        super().__init__(config, layer_idx)
        if isinstance(self.attn, KimiDeltaAttention):
            self.attn = GatedDeltaNet2(
                hidden_size=config.hidden_size,
                expand_v=config.expand_v,
                head_dim=config.head_dim,
                num_heads=config.num_heads,
                num_v_heads=config.num_v_heads,
                mode=config.attn_mode,
                use_short_conv=config.use_short_conv,
                allow_neg_eigval=config.allow_neg_eigval,
                conv_size=config.conv_size,
                norm_eps=config.norm_eps,
                layer_idx=layer_idx,
            )


def _init_gdn2(module: GatedDeltaNet2) -> None:
    """The layer's own draws of ``A_log`` and ``dt_bias``, unless they were loaded."""
    if next(module.parameters()).device.type == "meta":
        return
    with torch.no_grad():
        if not getattr(module.A_log, "_is_hf_initialized", False):
            module.A_log.copy_(nn.init.uniform_(torch.empty_like(module.A_log), a=1, b=16).log())
        if not getattr(module.dt_bias, "_is_hf_initialized", False):
            dt = torch.exp(
                torch.rand_like(module.dt_bias) * (math.log(0.1) - math.log(0.001)) + math.log(0.001)
            ).clamp(min=1e-4)
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    module.A_log._is_hf_initialized = True
    module.dt_bias._is_hf_initialized = True


class GDN2PreTrainedModel(KDAPreTrainedModel):
    config_class = GDN2Config
    _no_split_modules = ["GDN2Block"]

    def _init_weights(self, module, *args, **kwargs):
        super()._init_weights(module, *args, **kwargs)
        if isinstance(module, GatedDeltaNet2):
            _init_gdn2(module)


class GDN2Model(GDN2PreTrainedModel, FLAModel):
    """fla's ``KDAModel`` with :class:`GDN2Block` s."""

    def __init__(self, config: GDN2Config):
        super().__init__(config)
        _build_backbone(self, config, GDN2Block)
        self.post_init()


class GDN2ForCausalLM(GDN2PreTrainedModel, FLAForCausalLM, FLAUnsupportedCacheGenerationMixin):
    """fla's ``KDAForCausalLM`` over :class:`GDN2Model`."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: GDN2Config):
        super().__init__(config)
        self.model = GDN2Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.criterion = None
        self.post_init()


AutoConfig.register(GDN2Config.model_type, GDN2Config, exist_ok=True)
AutoModel.register(GDN2Config, GDN2Model, exist_ok=True)
AutoModelForCausalLM.register(GDN2Config, GDN2ForCausalLM, exist_ok=True)
