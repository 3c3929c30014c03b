"""Token-by-token write recurrences of the delta-rule family, with per-token regression losses.

This is the plain reference every kernel and every fast path in the package is compared with. It
loops over time in torch, batched over batch and heads, and runs in whatever precision it is given
(fp64 for tests, fp32 for replay).

Conventions (shared with the rest of the package):

* Inputs are laid out ``[B, T, H, ·]``: ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``,
  ``beta: [B, T, H]``.
* The state is ``S ∈ R^{V×K}`` (DeltaNet convention), stored ``[N, H, V, K]``. KDA's native ``K×V``
  state is accepted and returned in its own layout by :func:`kda` / :func:`oskda` and transposed
  internally.
* ``g`` is the *log* decay, as fla passes it: ``α_t = exp(g_t)``; ``g: [B, T, H]`` for a scalar head
  gate (Gated DeltaNet), ``g: [B, T, H, K]`` for a key-channel gate (KDA). The decayed state is
  ``S̄_{t−1} = α_t S_{t−1}`` or ``S_{t−1} Diag(α_t)``.
* One token: residual ``u_t = v_t − S̄_{t−1} k_t``; write ``S_t = S̄_{t−1} + β_t u_t k̃_tᵀ`` with write key
  ``k̃_t`` (``k_t`` unless a ``write_key`` is given, ``d_t ⊙ k_t`` for OSDN); read-out
  ``o_t = S_t (scale · q_t)`` with fla's default ``scale = K^{-1/2}``.
* Token-local loss ``f_t(S) = ½‖S k_t − v_t‖²``. ``loss_before`` is ``f_t(S_{t−1})`` (the paper's
  pre-decay denominator), ``loss_before_decayed`` is ``f_t(S̄_{t−1}) = ½‖u_t‖²`` (only for gated
  recurrences), ``loss_after`` is ``f_t(S_t)``.
* ``cu_seqlens`` packs several sequences along ``T`` (``B`` must be 1); the state restarts from its
  initial value at every boundary and ``final_state`` has one entry per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..runtime.checks import check_cu_seqlens, check_finite, check_recurrence_inputs, check_shape, check_tensor

__all__ = [
    "RecurrenceResult",
    "delta_rule_recurrence",
    "deltanet",
    "gated_deltanet",
    "kda",
    "osdn",
    "osgdn",
    "oskda",
]


@dataclass
class RecurrenceResult:
    """What a reference recurrence returns (shapes for ``N`` sequences of total length ``T``).

    Attributes:
        o: ``[B, T, H, V]`` read-outs ``S_t (scale · q_t)``.
        final_state: ``[N, H, V, K]`` (``[N, H, K, V]`` for the KDA wrappers).
        loss_before: ``[B, T, H]`` — ``f_t(S_{t−1})``, against the state before the layer's decay.
        loss_after: ``[B, T, H]`` — ``f_t(S_t)``.
        write_gain: ``[B, T, H]`` — ``a_t = β_t ⟨k̃_t, k_t⟩`` (= ``β_t⟨d_t, k_t⊙k_t⟩`` for OSDN).
        loss_before_decayed: ``[B, T, H]`` — ``f_t(S̄_{t−1})``; ``None`` for ungated recurrences, where
            it equals ``loss_before``.
        columns: further per-token values ``[B, T, H]`` by column name, for the families whose
            recurrence is not the delta rule's (:mod:`osdn_diag.replay.families`); empty here.
    """

    o: torch.Tensor
    final_state: torch.Tensor
    loss_before: torch.Tensor
    loss_after: torch.Tensor
    write_gain: torch.Tensor
    loss_before_decayed: torch.Tensor | None = None
    columns: dict[str, torch.Tensor] = field(default_factory=dict)


def _compute_dtype(dtype: torch.dtype | None, *xs: torch.Tensor | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    if any(x is not None and x.dtype == torch.float64 for x in xs):
        return torch.float64
    return torch.float32


def _validate(q, k, v, beta, write_key, g, initial_state, cu_seqlens, allow_nonfinite=False):
    B, T, H, K, V = check_recurrence_inputs(q, k, v, beta, write_key, g)
    named = [(n, x) for n, x in (("q", q), ("k", k), ("v", v), ("beta", beta), ("write_key", write_key), ("g", g))
             if x is not None]
    offsets = [0, T] if cu_seqlens is None else check_cu_seqlens(cu_seqlens, B, T)
    N = B if cu_seqlens is None else len(offsets) - 1
    if initial_state is not None:
        check_tensor("initial_state", initial_state)
        check_shape("initial_state", initial_state, [N, H, V, K], "[N, H, V, K]")
        named.append(("initial_state", initial_state))
    if not allow_nonfinite:
        for name, x in named:
            check_finite(name, x)
    return offsets


def _apply(S: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``S x`` per (row, head): ``[B, H, V, K] × [B, H, K] → [B, H, V]``. A batched matmul, each row's
    product computed alone, so that a row's result does not depend on the other rows of the batch
    (``einsum`` reshapes the batch into one product whose rounding does: with it, prompts run
    ``--batch-size 2`` differed from the same prompts run one by one in the last bits)."""
    return torch.matmul(S, x[..., None])[..., 0]


def _scan(q, k, v, beta, wk, alpha, S):
    """Run one packed segment. Shapes: q, k, wk ``[B, L, H, K]``, v ``[B, L, H, V]``, beta ``[B, L, H]``,
    alpha ``None`` | ``[B, L, H, 1, 1]`` | ``[B, L, H, 1, K]``, S ``[B, H, V, K]`` the initial state."""
    B, L, H, _ = k.shape
    o = q.new_empty(B, L, H, v.shape[-1])
    before = q.new_empty(B, L, H)
    before_decayed = q.new_empty(B, L, H) if alpha is not None else None
    after = q.new_empty(B, L, H)
    for t in range(L):
        kt, vt = k[:, t], v[:, t]
        # Pre-decay loss: the paper's denominator f_t(S_{t-1}).
        err_before = _apply(S, kt) - vt
        before[:, t] = 0.5 * err_before.square().sum(-1)
        if alpha is not None:
            S = S * alpha[:, t]
            u = vt - _apply(S, kt)
            before_decayed[:, t] = 0.5 * u.square().sum(-1)
        else:
            u = -err_before
        S = S + beta[:, t, :, None, None] * u[..., :, None] * wk[:, t, :, None, :]
        err_after = _apply(S, kt) - vt
        after[:, t] = 0.5 * err_after.square().sum(-1)
        o[:, t] = _apply(S, q[:, t])
    return o, S, before, before_decayed, after


def delta_rule_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    write_key: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.LongTensor | None = None,
    dtype: torch.dtype | None = None,
    allow_nonfinite: bool = False,
) -> RecurrenceResult:
    """The generic (gated, asymmetric) delta rule in the ``V×K`` convention; see the module docstring.

    Args:
        q, k: ``[B, T, H, K]`` read-out queries and read keys (used as given: no normalisation).
        v: ``[B, T, H, V]`` values.
        beta: ``[B, T, H]`` write strengths β_t.
        write_key: ``[B, T, H, K]`` write keys k̃_t; ``None`` means ``k`` (plain DeltaNet).
        g: log decay, ``[B, T, H]`` (scalar gate) or ``[B, T, H, K]`` (key-channel gate); ``None``
            for no decay.
        scale: multiplies ``q`` in the read-out; ``None`` means ``K ** -0.5`` (fla's default).
        initial_state: ``[N, H, V, K]``; zeros when ``None``.
        cu_seqlens: ``[N + 1]`` offsets of packed sequences (``B == 1``).
        dtype: compute dtype; default fp64 if any input is fp64, else fp32.
        allow_nonfinite: accept NaN/Inf inputs and let them propagate as a kernel would (a NaN at
            token t makes that sequence's and head's state, outputs and losses NaN from t on); by
            default they are an error, since a reference computation on them measures nothing.
    """
    offsets = _validate(q, k, v, beta, write_key, g, initial_state, cu_seqlens, allow_nonfinite)
    B, T, H, K = k.shape
    V = v.shape[-1]
    cdt = _compute_dtype(dtype, q, k, v, beta, write_key, g, initial_state)
    q, k, v, beta = (x.to(cdt) for x in (q, k, v, beta))
    q = q * (K**-0.5 if scale is None else scale)
    wk = k if write_key is None else write_key.to(cdt)
    alpha = None
    if g is not None:
        a = g.to(cdt).exp()
        alpha = a[..., None, None] if a.dim() == 3 else a[..., None, :]

    n_seq = len(offsets) - 1 if cu_seqlens is not None else B
    if initial_state is None:
        init = q.new_zeros(n_seq, H, V, K)
    else:
        init = initial_state.to(cdt)

    if cu_seqlens is None:
        o, S, before, before_dec, after = _scan(q, k, v, beta, wk, alpha, init.clone())
        final = S
    else:
        parts, finals = [], []
        for n, (bos, eos) in enumerate(zip(offsets[:-1], offsets[1:])):
            sl = slice(bos, eos)
            parts.append(
                _scan(
                    q[:, sl], k[:, sl], v[:, sl], beta[:, sl], wk[:, sl],
                    None if alpha is None else alpha[:, sl],
                    init[n : n + 1].clone(),
                )
            )
            finals.append(parts[-1][1])
        o = torch.cat([p[0] for p in parts], dim=1)
        before = torch.cat([p[2] for p in parts], dim=1)
        before_dec = None if alpha is None else torch.cat([p[3] for p in parts], dim=1)
        after = torch.cat([p[4] for p in parts], dim=1)
        final = torch.cat(finals, dim=0)

    gain = beta * (wk * k).sum(-1)
    return RecurrenceResult(
        o=o,
        final_state=final,
        loss_before=before,
        loss_after=after,
        write_gain=gain,
        loss_before_decayed=before_dec,
    )


def _require(name: str, x: torch.Tensor | None, ndim: int, layout: str) -> torch.Tensor:
    if x is None:
        raise ValueError(f"argument {name!r}: required, expected a tensor {layout}")
    check_tensor(name, x)
    if x.dim() != ndim:
        check_shape(name, x, [None] * ndim, layout)
    return x


def _write_key(d: torch.Tensor | None, k: torch.Tensor) -> torch.Tensor:
    """``d ⊙ k`` for the online-scaled wrappers, with ``k`` and ``d`` checked by name first (``d`` must
    match ``k``'s shape exactly: a broadcastable ``d`` would silently change the model)."""
    k = _require("k", k, 4, "[B, T, H, K]")
    d = _require("d", d, 4, "[B, T, H, K]")
    check_shape("d", d, list(k.shape), "[B, T, H, K]")
    check_finite("d", d)
    return d * k


def deltanet(q, k, v, beta, **kw) -> RecurrenceResult:
    """DeltaNet: ``S_t = S_{t−1} + β_t u_t k_tᵀ`` (Table 3). Keyword arguments as
    :func:`delta_rule_recurrence` (``scale``, ``initial_state``, ``cu_seqlens``, ``dtype``)."""
    return delta_rule_recurrence(q, k, v, beta, **kw)


def osdn(q, k, v, beta, d, **kw) -> RecurrenceResult:
    """OSDN given its preconditioner trajectory ``d: [B, T, H, K]``: write key ``d_t ⊙ k_t``, read key
    ``k_t`` (Eq. 2/5). ``d`` is the value *used at* token t (Algorithm 1's ``d_t``)."""
    return delta_rule_recurrence(q, k, v, beta, write_key=_write_key(d, k), **kw)


def gated_deltanet(q, k, v, beta, g, **kw) -> RecurrenceResult:
    """Gated DeltaNet with scalar log decay ``g: [B, T, H]``: ``S_t = α_t S_{t−1} + β_t u_t k_tᵀ`` with the
    post-gate residual ``u_t = v_t − α_t S_{t−1} k_t``."""
    g = _require("g", g, 3, "[B, T, H]")
    return delta_rule_recurrence(q, k, v, beta, g=g, **kw)


def osgdn(q, k, v, beta, g, d, **kw) -> RecurrenceResult:
    """Online-scaled Gated DeltaNet (App. B.1): Gated DeltaNet with write key ``d_t ⊙ k_t``."""
    g = _require("g", g, 3, "[B, T, H]")
    return delta_rule_recurrence(q, k, v, beta, write_key=_write_key(d, k), g=g, **kw)


def _kda(q, k, v, beta, g, write_key, initial_state=None, **kw) -> RecurrenceResult:
    g = _require("g", g, 4, "[B, T, H, K]")
    # KDA's K×V state S' satisfies S'ᵀ = S in the V×K convention: the channel gate Diag(α) acting on
    # the left of S' is S Diag(α) on the key side, and the write k̃ uᵀ becomes u k̃ᵀ.
    if initial_state is not None:
        check_tensor("initial_state", initial_state)
        if initial_state.dim() != 4:
            check_shape("initial_state", initial_state, [None] * 4, "[N, H, K, V]")
        initial_state = initial_state.transpose(-1, -2)
    res = delta_rule_recurrence(
        q, k, v, beta, write_key=write_key, g=g, initial_state=initial_state, **kw
    )
    res.final_state = res.final_state.transpose(-1, -2)
    return res


def kda(q, k, v, beta, g, **kw) -> RecurrenceResult:
    """KDA in its native ``K×V`` convention (App. B.2): ``S_t = (I − β_t k_t k_tᵀ) Diag(α_t) S_{t−1} +
    β_t k_t v_tᵀ``, ``o_t = S_tᵀ q_t``; channel log decay ``g: [B, T, H, K]``. ``initial_state`` and
    ``final_state`` are ``[N, H, K, V]``."""
    return _kda(q, k, v, beta, g, None, **kw)


def oskda(q, k, v, beta, g, d, **kw) -> RecurrenceResult:
    """Online-scaled KDA: the left (storage) key becomes ``d_t ⊙ k_t``; the read key stays ``k_t``."""
    return _kda(q, k, v, beta, g, _write_key(d, k), **kw)
