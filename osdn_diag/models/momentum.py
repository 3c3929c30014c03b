"""A causal language model around fla 0.6.0's ``MomentumDeltaNet`` layer, which fla ships without one.

fla 0.6.0 has the layer (``fla.layers.MomentumDeltaNet``) and its kernels but no config or model
class, so ``random:momentum-deltanet-*`` presets and saved models of the family need one:
:class:`MomentumDeltaNetConfig` is fla's :class:`~fla.models.DeltaNetConfig` plus the layer's own
arguments (defaults: the layer's — 4 heads of 256, value expansion 2, output gate), and the model is
fla's DeltaNet model with ``block.attn`` replaced by ``MomentumDeltaNet`` (norms, MLP, embeddings,
loss and cache as in fla), as :mod:`osdn_diag.models.modeling` does for the OSDN layers.

The layer takes no ``attention_mask`` and no ``cu_seqlens`` (fla raises NotImplementedError), so a
batch of prompts of different lengths cannot be run through it: run such models one prompt at a
time (``--batch-size 1``).
"""

from __future__ import annotations

import torch.nn as nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from fla.layers.delta_net import DeltaNet
from fla.layers.momentum_deltanet import MomentumDeltaNet
from fla.models.delta_net.configuration_delta_net import DeltaNetConfig
from fla.models.delta_net.modeling_delta_net import DeltaNetBlock, DeltaNetPreTrainedModel
from fla.models.generation_utils import FLAUnsupportedCacheGenerationMixin
from fla.models.modeling_utils import FLAForCausalLM, FLAModel

from .modeling import _build_backbone, _CacheArgument

__all__ = ["MomentumDeltaNetBlock", "MomentumDeltaNetConfig", "MomentumDeltaNetForCausalLM", "MomentumDeltaNetModel"]

#: The layer's own arguments a config carries (with the layer's defaults).
MOMENTUM_ARGS = dict(head_dim=256, num_v_heads=None, use_p_times_alpha=True, use_output_correction=True,
                     min_log_mu=-2.0, tau_factor=1)


class MomentumDeltaNetConfig(DeltaNetConfig):
    """:class:`~fla.models.DeltaNetConfig` with ``MomentumDeltaNet``'s arguments and defaults."""

    model_type = "momentum_deltanet"

    def __init__(self, num_heads: int = 4, expand_v: float = 2.0, use_gate: bool = True, **kwargs):
        for name, default in MOMENTUM_ARGS.items():
            setattr(self, name, kwargs.pop(name, default))
        super().__init__(num_heads=num_heads, expand_v=expand_v, use_gate=use_gate, **kwargs)


class MomentumDeltaNetBlock(DeltaNetBlock):
    """fla's ``DeltaNetBlock`` with fla's ``MomentumDeltaNet`` as its mixer."""

    def __init__(self, config: MomentumDeltaNetConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if isinstance(self.attn, DeltaNet):  # layers an ``attn`` config makes full attention stay so
            self.attn = MomentumDeltaNet(
                mode=config.attn_mode, hidden_size=config.hidden_size, expand_k=config.expand_k,
                expand_v=config.expand_v, num_heads=config.num_heads, use_beta=config.use_beta,
                use_gate=config.use_gate, use_short_conv=config.use_short_conv, conv_size=config.conv_size,
                allow_neg_eigval=config.allow_neg_eigval, layer_idx=layer_idx,
                qk_activation=config.qk_activation, qk_norm=config.qk_norm, norm_eps=config.norm_eps,
                **{name: getattr(config, name) for name in MOMENTUM_ARGS},
            )


class MomentumDeltaNetPreTrainedModel(DeltaNetPreTrainedModel):
    config_class = MomentumDeltaNetConfig
    _no_split_modules = ["MomentumDeltaNetBlock"]


class MomentumDeltaNetModel(MomentumDeltaNetPreTrainedModel, FLAModel):
    """fla's ``DeltaNetModel`` with :class:`MomentumDeltaNetBlock` s."""

    def __init__(self, config: MomentumDeltaNetConfig):
        super().__init__(config)
        _build_backbone(self, config, MomentumDeltaNetBlock)
        self.post_init()


class MomentumDeltaNetForCausalLM(_CacheArgument, MomentumDeltaNetPreTrainedModel, FLAForCausalLM,
                                  FLAUnsupportedCacheGenerationMixin):
    """fla's ``DeltaNetForCausalLM`` over :class:`MomentumDeltaNetModel`."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: MomentumDeltaNetConfig):
        super().__init__(config)
        self.model = MomentumDeltaNetModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.criterion = None
        self.post_init()


AutoConfig.register(MomentumDeltaNetConfig.model_type, MomentumDeltaNetConfig, exist_ok=True)
AutoModel.register(MomentumDeltaNetConfig, MomentumDeltaNetModel, exist_ok=True)
AutoModelForCausalLM.register(MomentumDeltaNetConfig, MomentumDeltaNetForCausalLM, exist_ok=True)
