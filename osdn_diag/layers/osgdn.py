"""OSGDN layer: fla's Gated DeltaNet layer with the online diagonal preconditioner on the write key.

:class:`OSGDN` subclasses :class:`fla.layers.gated_deltanet.GatedDeltaNet`, so it has exactly its
parameters (q/k/v/a/b projections, ``A_log``, ``dt_bias``, short convolutions, output norm / gate,
``o_proj``; a GatedDeltaNet ``state_dict`` loads into it unchanged) and its input side: SiLU short
convolutions, q/k l2-normalised (``x / sqrt(Σx² + 1e-6)``, fp32), ``β = sigmoid(b_proj x)`` (×2 with
``allow_neg_eigval``) and the log decay ``g = −exp(A_log) · softplus(a_proj x + dt_bias)`` (fp32). Only
the state update differs; it runs in two phases:

1. :func:`osdn_diag.ops.phase1.osdn_precondition` sweeps the preconditioner ``d`` over the sequence
   and emits the write keys ``k̃_t = d_t ⊙ k_t``;
2. :func:`osdn_diag.ops.osdn_chunk.chunk_osdn` runs the gated chunked delta rule that decays with
   ``exp(g_t)``, writes with ``k̃`` and reads with ``k``::

       S̄_{t−1} = exp(g_t) S_{t−1},   S_t = S̄_{t−1} + β_t (v_t − S̄_{t−1} k_t) k̃_tᵀ,   o_t = S_t (q_t / √K)

   with ``S`` ``V×K`` per (sequence, value head).

With ``eta=0`` and ``d0 = 1`` the write key is ``k`` and the layer is GatedDeltaNet exactly. The decay
acts on ``S`` only: ``d`` has no forgetting of its own except APF's retention.

**Grouped value heads** (``num_v_heads = G · num_heads``, G > 1). fla's kernels let value head ``i``
read key head ``i // G`` (q/k are not copied there). There is one state per *value* head, and the
preconditioner belongs to the state: phase 1's step uses that head's β (``beta_aware``) and
retention, so ``d`` is per value head even though the keys are shared. The layer therefore expands
q and k to the value heads first (``repeat_interleave(G, dim=2)``: the same mapping ``i → i // G``)
and runs both phases on ``[B, T, num_v_heads, K]``. The result is the kernel's GVA recurrence
exactly (with ``eta=0``) at the price of G copies of q/k in memory; gradients of the copies are
summed back onto the shared key heads by autograd. ``num_v_heads`` must be a multiple of
``num_heads``.

Extra constructor arguments (beyond GatedDeltaNet's), as for :class:`osdn_diag.layers.OSDN`:

* ``eta``, ``d_min``, ``d_max``, ``beta_aware``, ``phase1_eps``: phase 1's step size, box, β' choice
  and floor on ``‖k_t‖²``.
* ``apf``: a learned retention ``r_t = sigmoid(W x_t + b)`` per token and value head, with ``W = 0``
  and ``b = logit(0.999)`` at initialisation.
* ``learn_d0``: a learned initial ``d`` per value head and key channel (``[num_v_heads, K]``),
  initialised to 1 (clamped into the box) and clamped into ``[d_min, d_max]`` on every forward.

Cache: the layer's ``recurrent_state`` in fla's cache is the pair ``(S [N, HV, V, K], d [N, HV, K])``
(``HV = num_v_heads``; fla 0.6.0's ``state_v_first`` layout, which is our ``V×K`` convention), so a
prefill followed by calls with ``past_key_values`` continues both. Every call, whatever its length
and mode, runs the two chunked phases; GatedDeltaNet's ``fused_recurrent`` path and its fused q/k/v
convolution are not used (the three convolutions are depthwise, so running them separately gives
the same values).
"""

from __future__ import annotations


from einops import rearrange
from torch.nn import functional as F

from fla.layers.gated_deltanet import GatedDeltaNet

from ._common import OSDNLayerMixin, check_osdn_args
from .osdn import l2_normalize

__all__ = ["OSGDN"]


class OSGDN(OSDNLayerMixin, GatedDeltaNet):
    r"""Online-scaled Gated DeltaNet layer (fla GatedDeltaNet-compatible constructor and forward).

    Args (GatedDeltaNet's): hidden_size, expand_v, head_dim, num_heads, num_v_heads, mode, use_gate,
        use_short_conv, allow_neg_eigval, conv_size, conv_bias, layer_idx, norm_eps,
        output_gate_activation — as :class:`fla.layers.gated_deltanet.GatedDeltaNet`.
    Args (OSDN's):
        eta: phase-1 step size η ≥ 0 (0 freezes ``d`` at ``d0``). Default 0.003.
        d_min, d_max: the box ``0 < d_min ≤ d_max``. Defaults 0.5, 2.0.
        beta_aware: β'_t = β_t (True) or 1.
        apf: learned token/value-head-wise retention ``r = sigmoid(Linear(hidden → num_v_heads))``.
        learn_d0: learned ``[num_v_heads, head_dim]`` initial preconditioner.
        phase1_eps: floor on ‖k_t‖² in phase 1.
        phase1_method: phase 1's forward kernel, as ``osdn_precondition(method=)``: ``"auto"``
            (:data:`osdn_diag.ops.phase1.AUTO_METHOD`), ``"sequential"`` or ``"parallel"``.

    Forward returns ``(o, None, past_key_values)`` like GatedDeltaNet.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 2,
        head_dim: int = 256,
        num_heads: int = 6,
        num_v_heads: int | None = None,
        mode: str = 'chunk',
        use_gate: bool = True,
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        output_gate_activation: str = 'swish',
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
        # Checked before GatedDeltaNet builds anything, so that each is a ValueError naming it
        # (GatedDeltaNet itself asserts on `mode` and lets a bad head grouping through to the kernel).
        check_osdn_args(eta=eta, d_min=d_min, d_max=d_max, phase1_eps=phase1_eps, phase1_method=phase1_method)
        if mode not in ('chunk', 'fused_recurrent'):
            raise ValueError(f"argument 'mode': expected 'chunk' or 'fused_recurrent', got {mode!r}")
        hv = num_heads if num_v_heads is None else num_v_heads
        if not (isinstance(hv, int) and hv > 0 and hv % num_heads == 0):
            raise ValueError(
                f"argument 'num_v_heads': expected a positive multiple of num_heads = {num_heads} "
                f"(each key head serves num_v_heads / num_heads value heads), got {num_v_heads!r}"
            )
        super().__init__(
            hidden_size=hidden_size, expand_v=expand_v, head_dim=head_dim, num_heads=num_heads,
            num_v_heads=num_v_heads, mode=mode, use_gate=use_gate, use_short_conv=use_short_conv,
            allow_neg_eigval=allow_neg_eigval, conv_size=conv_size, conv_bias=conv_bias,
            layer_idx=layer_idx, norm_eps=norm_eps, output_gate_activation=output_gate_activation,
            **kwargs,
        )
        self.eta = float(eta)
        self.d_min = float(d_min)
        self.d_max = float(d_max)
        self.beta_aware = bool(beta_aware)
        self.apf = bool(apf)
        self.learn_d0 = bool(learn_d0)
        self.phase1_eps = float(phase1_eps)
        self.phase1_method = phase1_method
        self.num_groups = self.num_v_heads // self.num_heads

        self._build_osdn_parameters(hidden_size, self.num_v_heads)

    def extra_repr(self) -> str:
        return (f"eta={self.eta}, box=[{self.d_min}, {self.d_max}], beta_aware={self.beta_aware}, "
                f"apf={self.apf}, learn_d0={self.learn_d0}, num_v_heads={self.num_v_heads}, "
                f"phase1_method={self.phase1_method!r}")

    # ------------------------------------------------------------------------------------------------
    def project(self, hidden_states, conv_states=None, use_cache=False, cu_seqlens=None):
        """GatedDeltaNet's input side: ``(q, k, v, beta, g, retention, conv_states)``.

        ``q``/``k`` ``[B, T, HV, K]``: l2-normalised and already expanded to the value heads (value
        head ``i`` reads key head ``i // G``), i.e. exactly as the state reads them; ``v``
        ``[B, T, HV, V]``; ``beta`` ``[B, T, HV]`` (×2 with ``allow_neg_eigval``); ``g`` ``[B, T, HV]``
        fp32 log decay; ``retention`` ``[B, T, HV]`` fp32 or ``None`` (no APF). Works on already
        unpadded ``hidden_states`` (``cu_seqlens`` as fla's layers use it).
        """
        if self.use_short_conv:
            q, k, v, conv_states = self._short_conv_qkv(hidden_states, conv_states, use_cache, cu_seqlens)
        else:
            q = F.silu(self.q_proj(hidden_states))
            k = F.silu(self.k_proj(hidden_states))
            v = F.silu(self.v_proj(hidden_states))
            conv_states = None

        q, k = (rearrange(x, '... (h d) -> ... h d', d=self.head_k_dim) for x in (q, k))
        v = rearrange(v, '... (h d) -> ... h d', d=self.head_v_dim)
        q, k = l2_normalize(q), l2_normalize(k)
        if self.num_groups > 1:
            q, k = (x.repeat_interleave(self.num_groups, dim=2) for x in (q, k))

        beta = self.b_proj(hidden_states).sigmoid()
        if self.allow_neg_eigval:
            beta = beta * 2.
        a = self.a_proj(hidden_states).float() + self.dt_bias.float()
        g = -self.A_log.float().exp() * F.softplus(a)

        retention = self.r_proj(hidden_states).float().sigmoid() if self.apf else None
        return q, k, v, beta, g, retention, conv_states

    @property
    def _state_heads(self) -> int:
        return self.num_v_heads

    def _update_inputs(self, hidden_states, conv_states, use_cache, cu_seqlens):
        return self.project(hidden_states, conv_states, use_cache, cu_seqlens)
