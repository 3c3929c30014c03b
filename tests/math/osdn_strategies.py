"""Shared hypothesis strategies and small helpers for the reference-mathematics suites.

Everything is fp64 and small (B 1–2, T 1–12 — 0 for empty packed segments — H 1–2, K 1–5, V 1–4)
so that the Python-loop references stay fast. Random tensors come from hypothesis-drawn seeds (cheap,
shrink to seed 0); everything that makes a case awkward — which tokens have zero, tiny, unit or one-hot
keys, β near 0 or 1, gates, the box, segment lengths — is drawn by hypothesis itself, so that it shrinks
to the smallest failing structure.

This module is imported as a top-level module (pytest's default ``prepend`` import mode puts
``tests/math`` on ``sys.path``); its name is deliberately unlike any other test helper's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

F64 = torch.float64
BETA_LO, BETA_HI = 1e-6, 1.0 - 1e-6

seeds = st.integers(0, 2**32 - 1)


def rng(seed: int, salt: int = 0) -> torch.Generator:
    """A generator for a drawn seed; ``salt`` keeps the streams of different roles (keys, values, states)
    apart when hypothesis shrinks all their seeds to the same number."""
    return torch.Generator().manual_seed((seed + 1_000_003 * salt) % 2**63)


# --------------------------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Dims:
    B: int
    T: int
    H: int
    K: int
    V: int


def dims(B=(1, 2), T=(1, 12), H=(1, 2), K=(1, 5), V=(1, 4)) -> st.SearchStrategy[Dims]:
    return st.builds(
        Dims, st.integers(*B), st.integers(*T), st.integers(*H), st.integers(*K), st.integers(*V)
    )


# ------------------------------------------------------------------------------------------- numbers


@functools.lru_cache(maxsize=None)
def floats_in(lo: float, hi: float, special: tuple[float, ...] = ()) -> st.SearchStrategy[float]:
    """Finite normal floats in ``[lo, hi]``, with the ``special`` values drawn often."""
    base = st.floats(lo, hi, allow_nan=False, allow_infinity=False, allow_subnormal=False)
    special = tuple(x for x in special if lo <= x <= hi)
    return st.one_of(st.sampled_from(special), base) if special else base


def array(shape, elements: st.SearchStrategy[float]) -> st.SearchStrategy[torch.Tensor]:
    """An fp64 torch tensor of ``shape`` whose entries hypothesis draws one by one (small arrays)."""
    return hnp.arrays(np.float64, tuple(shape), elements=elements).map(
        lambda a: torch.from_numpy(np.array(a, dtype=np.float64))
    )


@st.composite
def uniform_array(draw, shape, lo: float, hi: float, special: tuple[float, ...] = ()) -> torch.Tensor:
    """An fp64 tensor in ``[lo, hi]``, cheap to draw for larger shapes. Hypothesis picks one of:

    * ``constant`` — every entry one drawn value (e.g. all on a face of the box);
    * ``seeded`` — uniform from a drawn seed, with up to 6 entries overwritten by drawn special values.
    """
    shape = tuple(shape)
    special = tuple(x for x in special if lo <= x <= hi)
    if draw(st.booleans(), label="constant"):
        return torch.full(shape, draw(floats_in(lo, hi, special)), dtype=F64)
    x = lo + (hi - lo) * torch.rand(shape, generator=rng(draw(seeds), salt=5), dtype=F64)
    n = x.numel()
    if n and special:
        flat = x.view(-1)
        for i, val in draw(_pokes(n, special)):
            flat[i] = val
    return x.clamp(lo, hi)


def betas(shape, lo: float = BETA_LO, hi: float = BETA_HI) -> st.SearchStrategy[torch.Tensor]:
    """Write strengths in ``[lo, hi]`` (default ``(0, 1)``), including ``1e-6`` and ``1 − 1e-6``."""
    return uniform_array(shape, lo, hi, (lo, hi, BETA_LO, BETA_HI, 0.5))


def preconditioners(shape, lo: float, hi: float) -> st.SearchStrategy[torch.Tensor]:
    """Positive ``d`` in ``[lo, hi]``, hitting both faces of the box and 1."""
    return uniform_array(shape, lo, hi, (lo, hi, 1.0))


def log_decays(shape, lo: float = -3.0) -> st.SearchStrategy[torch.Tensor]:
    """Log decay ``g ≤ 0`` (``α = exp(g) ∈ (0, 1]``), including exactly 0 (no decay)."""
    return uniform_array(shape, lo, 0.0, (0.0, -1e-6, lo))


@st.composite
def token_choice(draw, lead, n_choices: int) -> torch.Tensor:
    """An integer in ``[0, n_choices)`` per token: one choice for all tokens, or a seeded random mix."""
    lead = tuple(lead)
    if draw(st.booleans(), label="mixed"):
        return torch.randint(n_choices, lead, generator=rng(draw(seeds), salt=6))
    return torch.full(lead, draw(_index(n_choices)), dtype=torch.int64)


@functools.lru_cache(maxsize=None)
def _index(n: int) -> st.SearchStrategy[int]:
    return st.integers(0, n - 1)


@functools.lru_cache(maxsize=None)
def _pokes(n: int, special: tuple[float, ...]) -> st.SearchStrategy[list[tuple[int, float]]]:
    return st.lists(st.tuples(_index(n), st.sampled_from(special)), max_size=min(n, 6))


# ---------------------------------------------------------------------------------------------- keys

KEY_KINDS = ("random", "unit", "onehot", "zero", "tiny")
UNIT_KINDS = ("unit", "onehot")
NONZERO_KINDS = ("random", "unit", "onehot", "tiny")


@st.composite
def keys(draw, shape, kinds: tuple[str, ...] = KEY_KINDS, scale: float = 1.0) -> torch.Tensor:
    """Keys ``[..., K]``; hypothesis picks each token's kind:

    * ``random`` — Gaussian times ``scale`` (non-unit norm);
    * ``unit`` — a Gaussian direction, normalised (norm 1 up to rounding);
    * ``onehot`` — ``±e_i`` (norm exactly 1, most channels exactly 0);
    * ``zero`` — the exact zero key;
    * ``tiny`` — a unit direction times ``1e-7`` (``‖k‖² = 1e-14``, below phase 1's ε floor).
    """
    *lead, K = shape
    lead = tuple(lead)
    g = rng(draw(seeds), salt=1)
    x = torch.randn(*lead, K, generator=g, dtype=F64)
    unit = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    idx = torch.randint(K, lead, generator=g)
    sign = torch.where(torch.rand(lead, generator=g, dtype=F64) < 0.5, -1.0, 1.0).to(F64)
    onehot = torch.nn.functional.one_hot(idx, K).to(F64) * sign[..., None]
    table = {
        "random": x * scale,
        "unit": unit,
        "onehot": onehot,
        "zero": torch.zeros_like(x),
        "tiny": unit * 1e-7,
    }
    which = draw(token_choice(lead, len(kinds)))
    out = torch.zeros_like(x)
    for i, kind in enumerate(kinds):
        out = torch.where((which == i)[..., None], table[kind], out)
    return out


@st.composite
def gaussians(draw, shape, scale: float = 1.0, salt: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=rng(draw(seeds), salt), dtype=F64) * scale


@st.composite
def values(draw, shape, zero_tokens: bool = False) -> torch.Tensor:
    """Values ``[..., V]``, Gaussian; with ``zero_tokens`` hypothesis zeroes some tokens exactly."""
    v = draw(gaussians(shape, salt=2))
    if zero_tokens:
        v[draw(token_choice(shape[:-1], 2)) == 1] = 0.0
    return v


@st.composite
def states(draw, shape, allow_zero: bool = True) -> torch.Tensor:
    """An initial state (Gaussian, or exactly zero when hypothesis says so)."""
    if allow_zero and draw(st.booleans()):
        return torch.zeros(*shape, dtype=F64)
    return draw(gaussians(shape, salt=3))


# ----------------------------------------------------------------------------------- packed sequences


@st.composite
def segment_lengths(draw, n_segments=(2, 3), max_len: int = 5, min_total: int = 0) -> list[int]:
    """2–3 segment lengths, each 0..max_len (lengths 0 and 1 are drawn often)."""
    n = draw(st.integers(*n_segments))
    length = st.one_of(st.sampled_from([0, 1]), st.integers(0, max_len))
    lens = draw(st.lists(length, min_size=n, max_size=n).filter(lambda ls: sum(ls) >= min_total))
    return lens


def cu_seqlens_of(lengths: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=dtype)


# --------------------------------------------------------------------------------------------- helpers


def prefix_states(run, T: int) -> list[torch.Tensor]:
    """``[S_0, S_1, ..., S_T]`` read off a recurrence: ``run(t)`` must return the final state after the
    first ``t`` tokens (the library's own state, not a re-implementation of it)."""
    return [run(t) for t in range(T + 1)]


def well_posed(loss_before: torch.Tensor, scale: torch.Tensor, rel: float = 1e-4) -> torch.Tensor:
    """Tokens whose residual ``‖u‖ = sqrt(2 f)`` is not a rounding artefact: ``‖u‖ > rel · scale``, where
    ``scale`` bounds the magnitudes that cancelled to produce ``u`` (e.g. ``‖v‖ + ‖S‖‖k‖``)."""
    return (2.0 * loss_before).sqrt() > rel * scale


# ------------------------------------------------------------------------------ the recurrence wrappers

WRAPPERS = ("deltanet", "osdn", "gated_deltanet", "osgdn", "kda", "oskda", "generic")
GATED = ("gated_deltanet", "osgdn", "kda", "oskda", "generic")
KXV = ("kda", "oskda")  # native K×V state layout


def run_wrapper(name, q, k, v, beta, *, g_scalar, g_channel, d, write_key, initial_state=None, **kw):
    """Call one wrapper with its own arguments; ``initial_state`` and the returned ``final_state`` are in
    the V×K convention whatever the wrapper's native layout (K×V for KDA is transposed here)."""
    from osdn_diag.math import recurrence as R

    if name in KXV and initial_state is not None:
        initial_state = initial_state.transpose(-1, -2)
    kw = dict(kw, initial_state=initial_state)
    if name == "deltanet":
        res = R.deltanet(q, k, v, beta, **kw)
    elif name == "osdn":
        res = R.osdn(q, k, v, beta, d, **kw)
    elif name == "gated_deltanet":
        res = R.gated_deltanet(q, k, v, beta, g_scalar, **kw)
    elif name == "osgdn":
        res = R.osgdn(q, k, v, beta, g_scalar, d, **kw)
    elif name == "kda":
        res = R.kda(q, k, v, beta, g_channel, **kw)
    elif name == "oskda":
        res = R.oskda(q, k, v, beta, g_channel, d, **kw)
    elif name == "generic":
        res = R.delta_rule_recurrence(q, k, v, beta, write_key=write_key, g=g_channel, **kw)
    else:
        raise AssertionError(name)
    if name in KXV:
        res.final_state = res.final_state.transpose(-1, -2)
    return res


def wrapper_write_key(name, k, d, write_key):
    return {"osdn": d * k, "osgdn": d * k, "oskda": d * k, "generic": write_key}.get(name, k)


def wrapper_decay(name, g_scalar, g_channel):
    """α_t as a multiplier of the V×K state: ``[B, T, H, 1, 1]``, ``[B, T, H, 1, K]`` or ``None``."""
    if name in ("gated_deltanet", "osgdn"):
        return g_scalar.exp()[..., None, None]
    if name in ("kda", "oskda", "generic"):
        return g_channel.exp()[..., None, :]
    return None


@st.composite
def wrapper_inputs(draw, B=(1, 2), T=(1, 12), kinds=KEY_KINDS, T_fixed: int | None = None):
    """A full problem for any wrapper: q, k, v, beta, both gates, d, a free write key, a V×K state."""
    D = draw(dims(B=B, T=T if T_fixed is None else (T_fixed, T_fixed)))
    B, T, H, K, V = D.B, D.T, D.H, D.K, D.V
    return dict(
        q=draw(gaussians((B, T, H, K), salt=4)),
        k=draw(keys((B, T, H, K), kinds=kinds)),
        v=draw(values((B, T, H, V), zero_tokens=True)),
        beta=draw(betas((B, T, H))),
        g_scalar=draw(log_decays((B, T, H))),
        g_channel=draw(log_decays((B, T, H, K))),
        d=draw(preconditioners((B, T, H, K), 0.5, 2.0)),
        write_key=draw(keys((B, T, H, K), kinds=kinds)),
    ), D
