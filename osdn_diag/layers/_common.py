"""What the OSDN-style layers (:class:`~osdn_diag.layers.OSDN`, :class:`~osdn_diag.layers.OSGDN`)
share: their argument checks and their state update.

The checks run before any module is built, so that a bad box or step size is a ``ValueError`` naming
the argument rather than a failure deep inside phase 1.

The state update picks one of two paths, as fla's layers pick between their chunk and
fused-recurrent kernels: short inputs at inference (decoding, ``q_len <= FUSED_MAX_LEN``, or
``mode='fused_recurrent'``) take :func:`~osdn_diag.ops.osdn_recurrent.fused_recurrent_osdn`, both
phases in one launch; everything else — and anything that needs a gradient — takes phase 1
(:func:`~osdn_diag.ops.phase1.osdn_precondition`) then the chunked phase 2
(:func:`~osdn_diag.ops.osdn_chunk.chunk_osdn`). Capture intercepts the three kernels by their names
in this module.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from einops import rearrange
from fla.layers.utils import get_layer_cache, repad_hidden_states, unpad_hidden_states, update_layer_cache

from ..runtime.checks import check_box
from ..ops.osdn_chunk import chunk_osdn
from ..ops.osdn_recurrent import fused_recurrent_osdn
from ..ops.phase1 import METHODS, osdn_precondition

if TYPE_CHECKING:
    from fla.models.utils import Cache

__all__ = ["APF_INIT_RETENTION", "FUSED_MAX_LEN", "OSDNLayerMixin", "check_osdn_args", "osdn_state_update"]

#: Inputs up to this many tokens (per sequence) take the fused recurrent kernel at inference.
FUSED_MAX_LEN = 64

#: APF's retention at initialisation: d is almost fully kept until training says otherwise.
APF_INIT_RETENTION = 0.999


def _is_number(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float))


def check_osdn_args(*, eta: object, d_min: object, d_max: object, phase1_eps: object,
                    phase1_method: object = "auto") -> None:
    """Check the phase-1 hyper-parameters; raise ``ValueError`` naming the first bad one.

    * ``eta``: a finite number ``>= 0``;
    * ``d_min``, ``d_max``: finite numbers with ``0 < d_min <= d_max`` (the layers need a box);
    * ``phase1_eps``: a number ``> 0``;
    * ``phase1_method``: one of :data:`osdn_diag.ops.phase1.METHODS`.
    """
    if not _is_number(eta) or not math.isfinite(eta) or eta < 0:
        raise ValueError(f"argument 'eta': expected a finite number >= 0, got {eta!r}")
    for name, val in (("d_min", d_min), ("d_max", d_max)):
        if not _is_number(val) or not math.isfinite(val):
            raise ValueError(f"argument {name!r}: expected a finite number, got {val!r}")
    check_box(d_min, d_max)  # 'd_min' > 0, 'd_max' >= d_min
    if not (isinstance(phase1_eps, (int, float)) and phase1_eps > 0):
        raise ValueError(f"argument 'phase1_eps': expected a number > 0, got {phase1_eps!r}")
    if phase1_method not in METHODS:
        raise ValueError(f"argument 'phase1_method': expected one of {', '.join(METHODS)}, got {phase1_method!r}")


def osdn_state_update(layer, q, k, v, beta, *, g, retention, d0, initial_state, cu_seqlens,
                      q_len: int, use_cache: bool):
    """Both OSDN phases for ``layer`` (which holds ``eta, d_min, d_max, beta_aware, phase1_eps,
    phase1_method, mode, training, head_k_dim``).

    Args:
        q, k: ``[B, T, H, K]`` normalised; v: ``[B, T, H, V]``; beta: ``[B, T, H]``.
        g: ``[B, T, H]`` log decay or ``None``; retention: ``[B, T, H]`` or ``None``.
        d0: the initial preconditioner (``[H, K]``, ``[N, H, K]`` or ``None``: ones).
        initial_state: ``[N, H, V, K]`` or ``None``.
        q_len: the length of the padded input (the fused path's threshold applies to it).

    Returns ``(o [B, T, H, V], final_state [N, H, V, K] | None, d_final [N, H, K] | None)``, the last
    two only with ``use_cache``.
    """
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, beta, g, retention, d0)
    )
    fused = not layer.training and not needs_grad and (
        layer.mode == "fused_recurrent" or q_len <= FUSED_MAX_LEN
    )
    phase1 = dict(eta=layer.eta, d_min=layer.d_min, d_max=layer.d_max, beta_aware=layer.beta_aware,
                  eps=layer.phase1_eps)
    scale = layer.head_k_dim ** -0.5
    if fused:
        res = fused_recurrent_osdn(
            q, k, v, beta, g=g, retention=retention, d0=d0, **phase1, scale=scale,
            initial_state=initial_state, output_final_state=use_cache, cu_seqlens=cu_seqlens,
            validate=False,
        )
        return res.o, res.final_state, (res.d_final if use_cache else None)
    p1 = osdn_precondition(
        k, beta, retention=retention, d0=d0, **phase1, cu_seqlens=cu_seqlens,
        return_trajectory=use_cache, validate=False, method=layer.phase1_method,
    )
    write_key, d_final = (p1.write_key, p1.d_final) if use_cache else (p1, None)
    o, final_state = chunk_osdn(
        q, k, v, beta, write_key, g=g, scale=scale, initial_state=initial_state,
        output_final_state=use_cache, cu_seqlens=cu_seqlens, validate=False,
    )
    return o, final_state, d_final


class OSDNLayerMixin:
    """``initial_d`` and ``forward`` of the OSDN-style layers, which differ only in their input side.

    A layer provides ``_update_inputs(hidden_states, conv_states, use_cache, cu_seqlens)`` →
    ``(q, k, v, beta, g, retention, conv_states)`` (``g = None`` when ungated) and
    ``_state_heads``, the number of heads that carry a state (value heads).
    """

    def _short_conv_qkv(self, hidden_states, conv_states, use_cache, cu_seqlens):
        """The q/k/v projections through their short convolutions (fla's layers' own input side):
        ``(q, k, v, conv_states)`` with q, k, v flat (``[..., heads · dim]``), activated as the
        convolutions were built to."""
        conv_q, conv_k, conv_v = conv_states if conv_states is not None else (None,) * 3
        q, conv_q = self.q_conv1d(x=self.q_proj(hidden_states), cache=conv_q,
                                  output_final_state=use_cache, cu_seqlens=cu_seqlens)
        k, conv_k = self.k_conv1d(x=self.k_proj(hidden_states), cache=conv_k,
                                  output_final_state=use_cache, cu_seqlens=cu_seqlens)
        v, conv_v = self.v_conv1d(x=self.v_proj(hidden_states), cache=conv_v,
                                  output_final_state=use_cache, cu_seqlens=cu_seqlens)
        return q, k, v, (conv_q, conv_k, conv_v)

    def _build_osdn_parameters(self, hidden_size: int, heads: int) -> None:
        """APF's retention gate ``r_proj`` (hidden → one retention per state head) and the learned
        ``d0 [heads, K]``, as the flags ask, initialised by :meth:`reset_osdn_parameters`."""
        if self.apf:
            self.r_proj = nn.Linear(hidden_size, heads, bias=True)
            self.r_proj.bias._no_reinit = True  # the flag fla's (Mamba) _init_weights honour
            self.r_proj._osdn_retention_gate = True  # recognised by the models' _init_weights
        if self.learn_d0:
            self.d0 = nn.Parameter(torch.empty(heads, self.head_k_dim))
            self.d0._no_reinit = True
        self.reset_osdn_parameters()

    def reset_osdn_parameters(self) -> None:
        """(Re)initialise the OSDN-only parameters: APF to r ≈ 0.999 everywhere, d0 to 1 (in the box).

        Goes through ``torch.nn.init``, which transformers guards while it initialises a model, so a
        parameter already loaded from a checkpoint is left alone there.
        """
        with torch.no_grad():
            if self.apf:
                nn.init.zeros_(self.r_proj.weight)
                nn.init.constant_(self.r_proj.bias, math.log(APF_INIT_RETENTION / (1 - APF_INIT_RETENTION)))
            if self.learn_d0:
                nn.init.constant_(self.d0, min(max(1.0, self.d_min), self.d_max))

    def initial_d(self) -> torch.Tensor | None:
        """The initial preconditioner ``[heads, K]``: learned ``d0`` clamped into the box, ones
        (clamped into the box) or ``None`` (phase 1's own default, ones, when 1 lies in the box)."""
        if self.learn_d0:
            return self.d0.float().clamp(self.d_min, self.d_max)
        if not (self.d_min <= 1.0 <= self.d_max):
            return torch.full((self._state_heads, self.head_k_dim), min(max(1.0, self.d_min), self.d_max),
                              device=self.q_proj.weight.device, dtype=torch.float32)
        return None

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        output_attentions: bool | None = False,
        **kwargs,
    ) -> tuple[torch.Tensor, None, Cache | None]:
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError(
                "argument 'attention_mask': expected a 0-1 matrix [batch_size, seq_len] for padding "
                f"(0 = padding); got shape {tuple(attention_mask.shape)}"
            )
        batch_size, q_len, _ = hidden_states.shape
        last_state = get_layer_cache(self, past_key_values)
        cu_seqlens = kwargs.get('cu_seqlens')
        hidden_states, indices, cu_seqlens = unpad_hidden_states(hidden_states, cu_seqlens, attention_mask, q_len)

        conv_states = last_state['conv_state'] if (last_state is not None and self.use_short_conv) else None
        q, k, v, beta, g, retention, conv_states = self._update_inputs(
            hidden_states, conv_states, use_cache, cu_seqlens
        )
        S0, d0 = None, self.initial_d()
        if last_state is not None and last_state.get('recurrent_state') is not None:
            S0, d0 = last_state['recurrent_state']  # the state and d after the previous call

        o, S_final, d_final = osdn_state_update(
            self, q, k, v, beta, g=g, retention=retention, d0=d0, initial_state=S0,
            cu_seqlens=cu_seqlens, q_len=q_len, use_cache=bool(use_cache),
        )
        update_layer_cache(
            self,
            past_key_values,
            recurrent_state=(S_final, d_final) if use_cache else None,
            conv_state=conv_states if self.use_short_conv else None,
            offset=q_len,
        )

        if self.use_gate:
            gate = rearrange(self.g_proj(hidden_states), '... (h d) -> ... h d', d=self.head_v_dim)
            o = self.o_norm(o, gate)
        else:
            o = self.o_norm(o)
        o = self.o_proj(rearrange(o, 'b t h d -> b t (h d)'))
        o = repad_hidden_states(o, indices, batch_size, q_len)
        return o, None, past_key_values
