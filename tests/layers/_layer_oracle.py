"""An fp64 oracle for the OSDN-style layers, built from a layer's parameters and its constructor
arguments alone.

Nothing here calls the layer's methods or anything in ``osdn_diag``: the input side (projections,
causal depthwise short convolutions, q/k activation and normalisation, β, the APF retention, the
Gated DeltaNet decay), the two phases (the preconditioner sweep of the paper's Algorithm 1 / Eq. (7)
and the delta rule that reads with ``k`` and writes with ``d ⊙ k``) and the output side (RMS norm,
optional output gate, ``o_proj``) are written out below in plain torch from the documented contract
(``osdn_diag/layers/osdn.py`` and ``osgdn.py`` module docstrings, the paper's Section 4). The oracle is
differentiable: gradients flow back to the layer's parameters (cast to fp64 on the way in) and to the
input.

Conventions: hidden states ``x [B, T, hidden]``; per head the state ``S`` is ``V×K`` and starts at 0;
``d`` starts at the learned ``d0`` (clamped into the box) or at ones clamped into the box.
"""

from __future__ import annotations

import math

import torch

__all__ = ["OSDN_DEFAULTS", "OSGDN_DEFAULTS", "osdn_oracle", "osgdn_oracle", "relative_error"]

F64 = torch.float64

# The documented defaults of the constructors (their signatures and docstrings), written out so that
# a changed default shows up as a mismatch rather than being followed silently.
_PHASE1_DEFAULTS = dict(eta=0.003, d_min=0.5, d_max=2.0, beta_aware=True, apf=False, learn_d0=False,
                        phase1_eps=1e-6, norm_eps=1e-5, conv_bias=False, allow_neg_eigval=False)
OSDN_DEFAULTS = dict(_PHASE1_DEFAULTS, num_heads=4, use_beta=True, use_gate=False, use_short_conv=True,
                     qk_activation="silu", qk_norm="l2")
OSGDN_DEFAULTS = dict(_PHASE1_DEFAULTS, num_heads=6, num_v_heads=None, use_gate=True, use_short_conv=True,
                      output_gate_activation="swish")

#: fla's l2-norm epsilon, inside the square root (osdn_diag.layers.osdn.l2_normalize's default).
L2_EPS = 1e-6
#: the sum normalisation's floor on ‖x‖₁ (``F.normalize(p=1, eps=1e-6)`` in DeltaNet's ``sum_norm``).
L1_EPS = 1e-6


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``‖got − want‖ / ‖want‖`` in fp64 over all entries (NaN if either holds a NaN)."""
    got, want = got.detach().to(F64), want.detach().to(F64)
    return float((got - want).norm() / want.norm())


# ------------------------------------------------------------------------------------ elementwise maps


def _sigmoid(x):
    return 1.0 / (1.0 + torch.exp(-x))


def _silu(x):
    return x * _sigmoid(x)


def _softplus(x):
    return torch.logaddexp(x, torch.zeros_like(x))  # log(1 + eˣ), without overflow


def _elu_plus_one(x):
    return torch.where(x > 0, x + 1.0, torch.exp(torch.clamp(x, max=0.0)))


def _l2_normalise(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _l1_normalise(x):
    return x / x.abs().sum(-1, keepdim=True).clamp_min(L1_EPS)


# ------------------------------------------------------------------------------------------ input side


def _params(layer) -> dict[str, torch.Tensor]:
    return {name: p.to(F64) for name, p in layer.named_parameters()}


def _linear(P, name, x):
    y = x @ P[f"{name}.weight"].T
    bias = P.get(f"{name}.bias")
    return y if bias is None else y + bias


def _causal_conv(x, weight, bias):
    """Depthwise causal convolution: ``y_t[c] = Σ_j w[c, j] · x_{t − (W−1) + j}[c] (+ b[c])`` with
    zeros before the first token. ``x [B, T, C]``, ``weight [C, 1, W]``."""
    W = weight.shape[-1]
    T = x.shape[1]
    padded = torch.cat([x.new_zeros(x.shape[0], W - 1, x.shape[2]), x], dim=1)
    y = sum(padded[:, j:j + T] * weight[:, 0, j] for j in range(W))
    return y if bias is None else y + bias


def _heads(x, dim):
    return x.reshape(*x.shape[:-1], x.shape[-1] // dim, dim)


def _initial_d(P, cfg, heads, K):
    lo, hi = cfg["d_min"], cfg["d_max"]
    if cfg["learn_d0"]:
        return P["d0"].clamp(lo, hi)
    return torch.full((heads, K), min(max(1.0, lo), hi), dtype=F64, device=P["q_proj.weight"].device)


# -------------------------------------------------------------------------------------------- phases


def osdn_recurrence(q, k, v, beta, *, g, retention, d0, eta, d_min, d_max, beta_aware, eps, scale):
    """Both phases, token by token, in the dtype of the inputs.

    q, k ``[B, T, H, K]``; v ``[B, T, H, V]``; beta, g (log decay or ``None``), retention (or
    ``None``: r ≡ 1) ``[B, T, H]``; d0 ``[H, K]``. Per token, with ``s = k ⊙ k``::

        k̃ = d ⊙ k                                  (write key, from d before its update)
        S ← exp(g) S;  S ← S + β (v − S k) k̃ᵀ;  o = S q · scale
        d ← clamp(r d + η β' (1 − β'⟨d, s⟩) / max(‖k‖², eps) · s, d_min, d_max),  β' = β or 1

    Returns ``(o [B, T, H, V], d [B, T, H, K])`` (d as used by each token's write).
    """
    B, T, H, K = k.shape
    S = k.new_zeros(B, H, v.shape[-1], K)
    d = d0.expand(B, H, K)
    outs, ds = [], []
    for t in range(T):
        kt, bt = k[:, t], beta[:, t]
        if g is not None:
            S = S * torch.exp(g[:, t])[..., None, None]
        ds.append(d)
        u = v[:, t] - (S * kt[:, :, None, :]).sum(-1)
        S = S + bt[..., None, None] * u[..., :, None] * (d * kt)[..., None, :]
        outs.append((S * q[:, t, :, None, :]).sum(-1) * scale)
        s = kt * kt
        bp = bt if beta_aware else torch.ones_like(bt)
        step = eta * bp * (1.0 - bp * (d * s).sum(-1)) / (s.sum(-1).clamp_min(eps))
        r = 1.0 if retention is None else retention[:, t, :, None]
        d = (r * d + step[..., None] * s).clamp(d_min, d_max)
    return torch.stack(outs, 1), torch.stack(ds, 1)


def _output_side(P, cfg, o, x, head_v_dim, activation):
    """RMS norm over each head's V (weight ``o_norm.weight``), times ``act(g_proj x)`` with the output
    gate, then ``o_proj``."""
    o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + cfg["norm_eps"]) * P["o_norm.weight"]
    if cfg["use_gate"]:
        gate = _heads(_linear(P, "g_proj", x), head_v_dim)
        if activation in ("swish", "silu"):
            o = o * _silu(gate)
        elif activation == "sigmoid":
            o = o * _sigmoid(gate)
        else:
            raise ValueError(f"output gate activation {activation!r}: the oracle knows swish/silu and sigmoid")
    return _linear(P, "o_proj", o.flatten(-2))


# ---------------------------------------------------------------------------------------------- layers


def osdn_oracle(layer, x, **kw):
    """The :class:`osdn_diag.layers.OSDN` layer built with ``kw`` (beyond ``hidden_size``), on ``x``.

    Returns ``(out [B, T, hidden], d [B, T, H, K], parts)``; ``parts`` holds the fp64 ``q, k, v, beta,
    retention`` fed to the recurrence.
    """
    cfg = {**OSDN_DEFAULTS, **kw}
    P = _params(layer)
    x = x.to(F64)
    H = cfg["num_heads"]
    K = P["q_proj.weight"].shape[0] // H
    Vd = P["v_proj.weight"].shape[0] // H
    q, k, v = (_linear(P, f"{n}_proj", x) for n in "qkv")
    if cfg["use_short_conv"]:
        q, k, v = (_causal_conv(y, P[f"{n}_conv1d.weight"], P.get(f"{n}_conv1d.bias")) for y, n in
                   ((q, "q"), (k, "k"), (v, "v")))
        if cfg["qk_activation"] == "silu":  # the q/k convolutions carry the SiLU only then
            q, k = _silu(q), _silu(k)
        v = _silu(v)
    else:
        if cfg["qk_activation"] == "silu":
            q, k = _silu(q), _silu(k)
        v = _silu(v)
    q, k, v = _heads(q, K), _heads(k, K), _heads(v, Vd)
    if cfg["qk_activation"] == "relu":
        q, k = q.clamp_min(0), k.clamp_min(0)
    elif cfg["qk_activation"] == "elu":
        q, k = _elu_plus_one(q), _elu_plus_one(k)
    norm = _l2_normalise if cfg["qk_norm"] == "l2" else _l1_normalise
    q, k = norm(q), norm(k)
    beta = _sigmoid(_linear(P, "b_proj", x)) if cfg["use_beta"] else torch.ones_like(q[..., 0])
    if cfg["allow_neg_eigval"]:
        beta = 2.0 * beta
    r = _sigmoid(_linear(P, "r_proj", x)) if cfg["apf"] else None
    o, d = osdn_recurrence(
        q, k, v, beta, g=None, retention=r, d0=_initial_d(P, cfg, H, K), eta=cfg["eta"], d_min=cfg["d_min"],
        d_max=cfg["d_max"], beta_aware=cfg["beta_aware"], eps=cfg["phase1_eps"], scale=1.0 / math.sqrt(K),
    )
    out = _output_side(P, cfg, o, x, Vd, "swish")
    return out, d, dict(q=q, k=k, v=v, beta=beta, retention=r)


def osgdn_oracle(layer, x, **kw):
    """The :class:`osdn_diag.layers.OSGDN` layer built with ``kw`` (beyond ``hidden_size``,
    ``num_heads``, ``head_dim``, ``expand_v``), on ``x``.

    Grouped value heads: value head ``i`` reads key head ``i // G``, ``G = num_v_heads / num_heads``.
    Decay ``g = −exp(A_log) · softplus(a_proj x + dt_bias)`` per value head. Returns ``(out, d, parts)``
    as :func:`osdn_oracle`, ``parts`` also holding ``g``.
    """
    cfg = {**OSGDN_DEFAULTS, **kw}
    P = _params(layer)
    x = x.to(F64)
    H = cfg["num_heads"]
    HV = H if cfg["num_v_heads"] is None else cfg["num_v_heads"]
    K = P["q_proj.weight"].shape[0] // H
    Vd = P["v_proj.weight"].shape[0] // HV
    q, k, v = (_linear(P, f"{n}_proj", x) for n in "qkv")
    if cfg["use_short_conv"]:
        q, k, v = (_causal_conv(y, P[f"{n}_conv1d.weight"], P.get(f"{n}_conv1d.bias")) for y, n in
                   ((q, "q"), (k, "k"), (v, "v")))
    q, k, v = _silu(q), _silu(k), _silu(v)
    q, k, v = _l2_normalise(_heads(q, K)), _l2_normalise(_heads(k, K)), _heads(v, Vd)
    key_head = torch.arange(HV, device=x.device) // (HV // H)
    q, k = q[:, :, key_head], k[:, :, key_head]
    beta = _sigmoid(_linear(P, "b_proj", x))
    if cfg["allow_neg_eigval"]:
        beta = 2.0 * beta
    g = -torch.exp(P["A_log"]) * _softplus(_linear(P, "a_proj", x) + P["dt_bias"])
    r = _sigmoid(_linear(P, "r_proj", x)) if cfg["apf"] else None
    o, d = osdn_recurrence(
        q, k, v, beta, g=g, retention=r, d0=_initial_d(P, cfg, HV, K), eta=cfg["eta"], d_min=cfg["d_min"],
        d_max=cfg["d_max"], beta_aware=cfg["beta_aware"], eps=cfg["phase1_eps"], scale=1.0 / math.sqrt(K),
    )
    out = _output_side(P, cfg, o, x, Vd, cfg["output_gate_activation"])
    return out, d, dict(q=q, k=k, v=v, beta=beta, retention=r, g=g)
