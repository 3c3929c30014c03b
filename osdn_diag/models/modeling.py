"""OSDN / OSGDN language models: fla's DeltaNet / Gated DeltaNet models with our layers as mixers.

Everything except the token mixer is fla's: the blocks subclass fla's ``DeltaNetBlock`` /
``GatedDeltaNetBlock`` (norms, MLP, residual and attention-residual paths, forward) and swap
``block.attn`` for :class:`osdn_diag.layers.OSDN` / :class:`osdn_diag.layers.OSGDN` built from the same
config fields plus the phase-1 ones; the models are built like ``DeltaNetModel`` /
``GatedDeltaNetModel`` and run ``FLAModel.forward`` / ``FLAForCausalLM.forward``, so embeddings, loss
(fused cross-entropy, ``logits_to_keep``), generation and fla's ``Cache`` behave as in fla. Layers that
an fla ``attn`` config assigns to standard attention stay standard attention.

One deliberate difference: the causal LMs also take the cache as ``cache=``, the name transformers 5's
``generate()`` uses. fla 0.6.0's models read only ``past_key_values``, so under transformers 5 their
``generate()`` decodes every new token from an empty state; ours continue the cached ``(S, d)``.

Weights: the OSDN layers' state dicts are fla's plus ``r_proj`` (APF) and ``d0`` (learned initial d),
so with ``eta = 0`` an ``OSDNForCausalLM`` loads a ``DeltaNetForCausalLM`` state dict (and an
``OSGDNForCausalLM`` a ``GatedDeltaNetForCausalLM`` one) and computes the same logits.

Initialisation: fla's ``_init_weights`` re-draws every ``nn.Linear`` (weights normal, biases zero),
which would turn APF's retention into sigmoid(0) = 0.5. ``_init_weights`` here restores the layers'
intended values afterwards (transformers visits a module's children before the module): ``r_proj``
weight 0 and bias logit(0.999), ``d0`` = 1 clamped into the box. It uses transformers' guarded init
functions, so weights loaded by ``from_pretrained`` are never overwritten.

Importing this module imports fla and registers the configs and models with transformers'
``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM`` (``exist_ok=True``); see
:func:`osdn_diag.models.register`.
"""

from __future__ import annotations

import inspect
import math

import torch.nn as nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers import initialization as hf_init

from fla.layers.delta_net import DeltaNet
from fla.layers.gated_deltanet import GatedDeltaNet
from fla.models.delta_net.modeling_delta_net import DeltaNetBlock, DeltaNetPreTrainedModel
from fla.models.gated_deltanet.modeling_gated_deltanet import GatedDeltaNetBlock, GatedDeltaNetPreTrainedModel
from fla.models.generation_utils import FLAUnsupportedCacheGenerationMixin
from fla.models.modeling_utils import FLAForCausalLM, FLAModel
from fla.modules import RMSNorm

from ..layers._common import APF_INIT_RETENTION
from ..layers.osdn import OSDN
from ..layers.osgdn import OSGDN
from .configuration import OSDNConfig, OSGDNConfig, osdn_layer_kwargs

__all__ = [
    "OSDNBlock",
    "OSDNForCausalLM",
    "OSDNModel",
    "OSDNPreTrainedModel",
    "OSGDNBlock",
    "OSGDNForCausalLM",
    "OSGDNModel",
    "OSGDNPreTrainedModel",
]


def init_retention_gate(linear: nn.Linear) -> None:
    """APF's gate to r ≈ 0.999 everywhere: weight 0, bias logit(0.999)."""
    hf_init.zeros_(linear.weight)
    hf_init.constant_(linear.bias, math.log(APF_INIT_RETENTION / (1 - APF_INIT_RETENTION)))


def init_osdn_parameters(layer: OSDN | OSGDN) -> None:
    """APF to r ≈ 0.999 and d0 to 1 clamped into the box; parameters flagged as loaded
    (``_is_hf_initialized``) are left alone."""
    if layer.apf:
        init_retention_gate(layer.r_proj)
    if layer.learn_d0:
        hf_init.constant_(layer.d0, min(max(1.0, layer.d_min), layer.d_max))


def _init_osdn_module(module: nn.Module) -> None:
    """What ``_init_weights`` adds to fla's for ``module``. The gate is recognised by itself
    (``_osdn_retention_gate``): transformers calls ``_init_weights`` only on modules that hold
    parameters of their own, which an OSDN layer without ``d0`` does not."""
    if isinstance(module, (OSDN, OSGDN)):
        init_osdn_parameters(module)
    elif getattr(module, "_osdn_retention_gate", False):
        init_retention_gate(module)


# --- blocks ---------------------------------------------------------------------------------------
# fla's block __init__ builds its own mixer (DeltaNet / GatedDeltaNet) inline; it is replaced right
# away. Rebuilding the block here instead would copy fla's norm/MLP/attention-residual set-up.


class OSDNBlock(DeltaNetBlock):
    """fla's ``DeltaNetBlock`` with :class:`~osdn_diag.layers.OSDN` as its mixer."""

    def __init__(self, config: OSDNConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if isinstance(self.attn, DeltaNet):
            self.attn = OSDN(
                mode=config.attn_mode,
                hidden_size=config.hidden_size,
                expand_k=config.expand_k,
                expand_v=config.expand_v,
                num_heads=config.num_heads,
                use_gate=config.use_gate,
                use_beta=config.use_beta,
                use_short_conv=config.use_short_conv,
                allow_neg_eigval=config.allow_neg_eigval,
                conv_size=config.conv_size,
                qk_norm=config.qk_norm,
                qk_activation=config.qk_activation,
                norm_eps=config.norm_eps,
                layer_idx=layer_idx,
                **osdn_layer_kwargs(config),
            )


class OSGDNBlock(GatedDeltaNetBlock):
    """fla's ``GatedDeltaNetBlock`` with :class:`~osdn_diag.layers.OSGDN` as its mixer."""

    def __init__(self, config: OSGDNConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if isinstance(self.attn, GatedDeltaNet):
            self.attn = OSGDN(
                hidden_size=config.hidden_size,
                expand_v=config.expand_v,
                head_dim=config.head_dim,
                num_heads=config.num_heads,
                num_v_heads=config.num_v_heads,
                mode=config.attn_mode,
                use_gate=config.use_gate,
                use_short_conv=config.use_short_conv,
                allow_neg_eigval=config.allow_neg_eigval,
                conv_size=config.conv_size,
                layer_idx=layer_idx,
                norm_eps=config.norm_eps,
                output_gate_activation=config.output_gate_activation,
                **osdn_layer_kwargs(config),
            )


# --- models ---------------------------------------------------------------------------------------


class _CacheArgument:
    """Accept the cache under transformers 5's name, ``cache=``, as well as ``past_key_values=``.

    transformers 5's ``generate()`` hands the cache to ``forward`` as ``cache=``; fla 0.6.0's
    ``FLAForCausalLM.forward`` reads only ``past_key_values``, so the cache would land unused in
    ``**kwargs`` and every decoding step would start from an empty state (fla's own models decode so
    under transformers 5). Here it is passed on as ``past_key_values``; an explicit
    ``past_key_values`` wins.
    """

    def forward(self, *args, cache=None, **kwargs):
        if cache is not None and kwargs.get("past_key_values") is None and len(args) < 4:
            kwargs["past_key_values"] = cache
        return super().forward(*args, **kwargs)


def _signature_with_cache(forward) -> inspect.Signature:
    """``forward``'s signature plus a keyword-only ``cache=None`` (before ``**kwargs``)."""
    sig = inspect.signature(forward)
    params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
    rest = [p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD]
    cache = inspect.Parameter("cache", inspect.Parameter.KEYWORD_ONLY, default=None)
    return sig.replace(parameters=[*params, cache, *rest])


# generate() inspects forward's parameters (attention_mask, logits_to_keep): show fla's, not *args.
_CacheArgument.forward.__signature__ = _signature_with_cache(FLAForCausalLM.forward)


def _build_backbone(model, config, block_cls) -> None:
    """The body of fla's ``DeltaNetModel.__init__`` / ``GatedDeltaNetModel.__init__`` with our block
    (what ``FLAModel.forward`` reads: ``embeddings``, ``layers``, ``norm``, ``use_attnres``, ...)."""
    model.padding_idx = config.pad_token_id
    model.vocab_size = config.vocab_size
    model.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, model.padding_idx)
    model.layers = nn.ModuleList([block_cls(config, i) for i in range(config.num_hidden_layers)])
    model.norm = (RMSNorm if config.fuse_norm else nn.RMSNorm)(config.hidden_size, eps=config.norm_eps)
    model.use_attnres = config.attnres_block_size is not None
    if model.use_attnres:
        model.res_proj = nn.Linear(config.hidden_size, 1, bias=False)
        model.res_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        model.res_proj._is_attnres_proj = True
    model.gradient_checkpointing = False


class OSDNPreTrainedModel(DeltaNetPreTrainedModel):
    config_class = OSDNConfig
    _no_split_modules = ["OSDNBlock"]

    def _init_weights(self, module, *args, **kwargs):
        super()._init_weights(module, *args, **kwargs)
        _init_osdn_module(module)


class OSDNModel(OSDNPreTrainedModel, FLAModel):
    """fla's ``DeltaNetModel`` with :class:`OSDNBlock` s."""

    def __init__(self, config: OSDNConfig):
        super().__init__(config)
        _build_backbone(self, config, OSDNBlock)
        self.post_init()


class OSDNForCausalLM(_CacheArgument, OSDNPreTrainedModel, FLAForCausalLM, FLAUnsupportedCacheGenerationMixin):
    """fla's ``DeltaNetForCausalLM`` over :class:`OSDNModel`."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: OSDNConfig):
        super().__init__(config)
        self.model = OSDNModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.criterion = None
        self.post_init()


class OSGDNPreTrainedModel(GatedDeltaNetPreTrainedModel):
    config_class = OSGDNConfig
    _no_split_modules = ["OSGDNBlock"]

    def _init_weights(self, module, *args, **kwargs):
        # OSGDN is a GatedDeltaNet: the parent initialises its A_log / dt_bias as fla does.
        super()._init_weights(module, *args, **kwargs)
        _init_osdn_module(module)


class OSGDNModel(OSGDNPreTrainedModel, FLAModel):
    """fla's ``GatedDeltaNetModel`` with :class:`OSGDNBlock` s."""

    def __init__(self, config: OSGDNConfig):
        super().__init__(config)
        _build_backbone(self, config, OSGDNBlock)
        self.post_init()


class OSGDNForCausalLM(_CacheArgument, OSGDNPreTrainedModel, FLAForCausalLM, FLAUnsupportedCacheGenerationMixin):
    """fla's ``GatedDeltaNetForCausalLM`` over :class:`OSGDNModel`."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: OSGDNConfig):
        super().__init__(config)
        self.model = OSGDNModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.criterion = None
        self.post_init()


for _config, _model, _lm in ((OSDNConfig, OSDNModel, OSDNForCausalLM), (OSGDNConfig, OSGDNModel, OSGDNForCausalLM)):
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _model, exist_ok=True)
    AutoModelForCausalLM.register(_config, _lm, exist_ok=True)
del _config, _model, _lm
