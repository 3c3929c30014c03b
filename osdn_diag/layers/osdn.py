"""OSDN layer: fla's DeltaNet layer with the online diagonal preconditioner on the write key.

The layer is fla's :class:`fla.layers.delta_net.DeltaNet` (same projections, short convolutions,
q/k activation and normalisation, β = sigmoid(b_proj) (×2 with ``allow_neg_eigval``), output norm /
gate and ``o_proj``), with the state update done in two phases:

1. :func:`osdn_diag.ops.phase1.osdn_precondition` sweeps the preconditioner ``d`` over the sequence
   and emits the write keys ``k̃_t = d_t ⊙ k_t``;
2. :func:`osdn_diag.ops.osdn_chunk.chunk_osdn` runs the chunked delta rule that writes with ``k̃``
   and reads with ``k``.

With ``eta=0`` and ``d0 = 1`` the write key is ``k`` and the layer is DeltaNet exactly.

Extra constructor arguments (beyond DeltaNet's):

* ``eta``, ``d_min``, ``d_max``, ``beta_aware``: phase 1's step size, box and β' choice.
* ``apf``: a learned retention ``r_t = sigmoid(W x_t + b)`` per token and head (adaptive
  preconditioner forgetting), with ``W = 0`` and ``b = logit(0.999)`` at initialisation.
* ``learn_d0``: a learned initial ``d`` per head and channel (``[H, K]``), initialised to 1 (clamped
  into the box). It is clamped into ``[d_min, d_max]`` on every forward, so it can never leave the
  box the kernel requires.

Cache: the layer's ``recurrent_state`` in fla's cache is the pair ``(S [N, H, V, K], d [N, H, K])``
— the state *and* the preconditioner after the last token — so a prefill followed by another call
with ``past_key_values`` continues both. Like fla's layers, short inputs at inference (decoding,
``q_len <= 64``, or ``mode='fused_recurrent'``) take a fused recurrent kernel that runs both phases
in one launch; training and longer inputs take the two chunked phases
(:func:`osdn_diag.layers._common.osdn_state_update`).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn
from einops import rearrange
from torch.nn import functional as F

from fla.modules import FusedRMSNormGated, RMSNorm, ShortConvolution
from fla.modules.activations import elu_p1
from fla.modules.l2norm import l2norm as fla_l2norm

from ._common import OSDNLayerMixin, check_osdn_args

__all__ = ["OSDN", "l2_normalize", "sum_norm"]



def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σx² + eps)`` over the last dim, computed in fp32 (fla's ``l2norm`` formula).

    On a GPU this is fla's fused kernel (with its own backward), as in fla's DeltaNet; the torch form,
    several passes over the tensor, elsewhere."""
    if x.is_cuda:
        return fla_l2norm(x, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def sum_norm(x: torch.Tensor) -> torch.Tensor:
    return F.normalize(x, p=1, dim=-1, eps=1e-6).to(x)


class OSDN(OSDNLayerMixin, nn.Module):
    r"""Online-scaled DeltaNet layer (fla DeltaNet-compatible constructor and forward signature).

    Args (DeltaNet's): mode, d_model, hidden_size, expand_k, expand_v, num_heads, use_beta, use_gate,
        use_short_conv, conv_size, conv_bias, allow_neg_eigval, layer_idx, qk_activation, qk_norm,
        norm_eps — as :class:`fla.layers.delta_net.DeltaNet`.
    Args (OSDN's):
        eta: phase-1 step size η ≥ 0 (0 freezes ``d`` at ``d0``). Default 0.003.
        d_min, d_max: the box ``0 < d_min ≤ d_max``. Defaults 0.5, 2.0.
        beta_aware: β'_t = β_t (True) or 1 (the paper's 1.3B form).
        apf: learned token/head-wise retention ``r = sigmoid(Linear(hidden → num_heads))``.
        learn_d0: learned ``[H, K]`` initial preconditioner.
        phase1_eps: floor on ‖k_t‖² in phase 1.
        phase1_method: phase 1's forward kernel, as ``osdn_precondition(method=)``: ``"auto"``
            (:data:`osdn_diag.ops.phase1.AUTO_METHOD`), ``"sequential"`` or ``"parallel"``.

    Forward returns ``(o, None, past_key_values)`` like DeltaNet.
    """

    def __init__(
        self,
        mode: str = 'chunk',
        d_model: int | None = None,
        hidden_size: int = 1024,
        expand_k: float = 1.0,
        expand_v: float = 1.0,
        num_heads: int = 4,
        use_beta: bool = True,
        use_gate: bool = False,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        allow_neg_eigval: bool = False,
        layer_idx: int | None = None,
        qk_activation: str = 'silu',
        qk_norm: str = 'l2',
        norm_eps: float = 1e-5,
        eta: float = 0.003,
        d_min: float = 0.5,
        d_max: float = 2.0,
        beta_aware: bool = True,
        apf: bool = False,
        learn_d0: bool = False,
        phase1_eps: float = 1e-6,
        phase1_method: str = "auto",
        **kwargs,
    ) -> None:
        super().__init__()

        # OSDN arguments first: a bad box / step size is a ValueError naming the argument.
        check_osdn_args(eta=eta, d_min=d_min, d_max=d_max, phase1_eps=phase1_eps, phase1_method=phase1_method)
        if mode == 'fused_chunk':
            raise NotImplementedError("fused_chunk is deprecated in fla; use `chunk`.")
        if mode not in ('chunk', 'fused_recurrent'):
            raise ValueError(f"argument 'mode': expected 'chunk' or 'fused_recurrent', got {mode!r}")
        if qk_activation not in ('silu', 'relu', 'elu', 'identity'):
            raise ValueError(f"argument 'qk_activation': expected silu/relu/elu/identity, got {qk_activation!r}")
        if qk_norm not in ('l2', 'sum'):
            raise ValueError(f"argument 'qk_norm': expected 'l2' or 'sum', got {qk_norm!r}")

        self.mode = mode
        self.qk_activation = qk_activation
        self.qk_norm = qk_norm
        self.eta = float(eta)
        self.d_min = float(d_min)
        self.d_max = float(d_max)
        self.beta_aware = bool(beta_aware)
        self.apf = bool(apf)
        self.learn_d0 = bool(learn_d0)
        self.phase1_eps = float(phase1_eps)
        self.phase1_method = phase1_method

        if d_model is not None:
            hidden_size = d_model
        self.hidden_size = hidden_size
        self.expand_k = expand_k
        self.expand_v = expand_v
        self.num_heads = num_heads
        self.use_gate = use_gate
        self.use_short_conv = use_short_conv
        self.conv_size = conv_size
        self.conv_bias = conv_bias
        self.allow_neg_eigval = allow_neg_eigval

        key_dim, value_dim = hidden_size * expand_k, hidden_size * expand_v
        self.key_dim, self.value_dim = round(key_dim), round(value_dim)
        if not math.isclose(key_dim, self.key_dim):
            raise ValueError(f"argument 'expand_k': hidden_size * expand_k must be an integer, got {key_dim}")
        if not math.isclose(value_dim, self.value_dim):
            raise ValueError(f"argument 'expand_v': hidden_size * expand_v must be an integer, got {value_dim}")
        if self.key_dim % num_heads or self.value_dim % num_heads:
            raise ValueError(f"argument 'num_heads': key/value dims ({self.key_dim}, {self.value_dim}) "
                             f"must be divisible by num_heads = {num_heads}")
        self.head_k_dim = self.key_dim // num_heads
        self.head_v_dim = self.value_dim // num_heads
        self.layer_idx = layer_idx

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)

        self.use_beta = use_beta
        if self.use_beta:
            self.b_proj = nn.Linear(hidden_size, self.num_heads, bias=False)
        if use_short_conv:
            act = 'silu' if qk_activation == 'silu' else None
            self.q_conv1d = ShortConvolution(hidden_size=self.key_dim, kernel_size=conv_size, bias=conv_bias,
                                             activation=act)
            self.k_conv1d = ShortConvolution(hidden_size=self.key_dim, kernel_size=conv_size, bias=conv_bias,
                                             activation=act)
            self.v_conv1d = ShortConvolution(hidden_size=self.value_dim, kernel_size=conv_size, bias=conv_bias,
                                             activation='silu')
        else:
            warnings.warn(
                "ShortConvolution is crucial to the performance. "
                "Do not turn it off, i.e., setting `use_short_conv=False` unless you know what you are doing.",
            )
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = FusedRMSNormGated(self.head_v_dim, eps=norm_eps)
        else:
            self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps, dtype=torch.float32)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

        self._build_osdn_parameters(hidden_size, self.num_heads)

    def extra_repr(self) -> str:
        return (f"eta={self.eta}, box=[{self.d_min}, {self.d_max}], beta_aware={self.beta_aware}, "
                f"apf={self.apf}, learn_d0={self.learn_d0}, phase1_method={self.phase1_method!r}")

    # ------------------------------------------------------------------------------------------------
    def project(self, hidden_states, conv_states=None, use_cache=False, cu_seqlens=None):
        """DeltaNet's input side: ``(q, k, v, beta, retention, conv_states)``.

        ``q``/``k`` ``[B, T, H, K]`` are activated and normalised exactly as the state reads them
        (l2 or sum norm), ``v`` ``[B, T, H, V]``, ``beta`` ``[B, T, H]`` (×2 with
        ``allow_neg_eigval``), ``retention`` ``[B, T, H]`` fp32 or ``None`` (no APF). Works on
        already unpadded ``hidden_states`` (``cu_seqlens`` as fla's layers use it).
        """
        if self.use_short_conv:
            q, k, v, conv_states = self._short_conv_qkv(hidden_states, conv_states, use_cache, cu_seqlens)
        else:
            q = self.q_proj(hidden_states)
            k = self.k_proj(hidden_states)
            if self.qk_activation == 'silu':
                q, k = F.silu(q), F.silu(k)
            v = F.silu(self.v_proj(hidden_states))
            conv_states = None

        q, k = (rearrange(x, '... (h d) -> ... h d', d=self.head_k_dim) for x in (q, k))
        v = rearrange(v, '... (h d) -> ... h d', d=self.head_v_dim)
        if self.qk_activation == 'relu':
            q, k = q.relu(), k.relu()
        elif self.qk_activation == 'elu':
            q, k = elu_p1(q), elu_p1(k)

        if self.qk_norm == 'l2':
            q, k = l2_normalize(q), l2_normalize(k)
        else:
            q, k = sum_norm(q), sum_norm(k)

        if self.use_beta:
            beta = self.b_proj(hidden_states).sigmoid()
        else:
            beta = torch.ones_like(q[..., 0])
        if self.allow_neg_eigval:
            beta = beta * 2.

        retention = self.r_proj(hidden_states).float().sigmoid() if self.apf else None
        return q, k, v, beta, retention, conv_states

    @property
    def _state_heads(self) -> int:
        return self.num_heads

    def _update_inputs(self, hidden_states, conv_states, use_cache, cu_seqlens):
        q, k, v, beta, retention, conv_states = self.project(hidden_states, conv_states, use_cache, cu_seqlens)
        return q, k, v, beta, None, retention, conv_states
