"""Bad input raises ValueError whose message names the offending argument."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from osdn_diag.math import (
    chunk_delta_rule,
    deltanet,
    gated_deltanet,
    kda,
    osdn,
    osdn_phase1,
    osgdn,
    oskda,
)

F64 = torch.float64
B, T, H, K, V = 1, 5, 2, 3, 2


def _inputs():
    g = torch.Generator().manual_seed(0)
    return dict(
        q=torch.randn(B, T, H, K, generator=g, dtype=F64),
        k=torch.randn(B, T, H, K, generator=g, dtype=F64),
        v=torch.randn(B, T, H, V, generator=g, dtype=F64),
        beta=torch.rand(B, T, H, generator=g, dtype=F64),
        g=-torch.rand(B, T, H, generator=g, dtype=F64),
        gk=-torch.rand(B, T, H, K, generator=g, dtype=F64),
        d=torch.ones(B, T, H, K, dtype=F64),
        S=torch.zeros(B, H, V, K, dtype=F64),
    )


def _cu(*offs, dtype=torch.int64):
    return torch.tensor(offs, dtype=dtype)


def _phase1(**over):
    x = _inputs()
    kw = dict(k=x["k"], beta=x["beta"])
    kw.update(over)
    k, beta = kw.pop("k"), kw.pop("beta")
    return osdn_phase1(k, beta, **kw)


def _rec(fn="deltanet", **over):
    x = _inputs()
    x.update(over)
    kw = {n: x.pop(n) for n in ("initial_state", "cu_seqlens", "scale") if n in x}
    args = {
        "deltanet": lambda: deltanet(x["q"], x["k"], x["v"], x["beta"], **kw),
        "osdn": lambda: osdn(x["q"], x["k"], x["v"], x["beta"], x["d"], **kw),
        "gated_deltanet": lambda: gated_deltanet(x["q"], x["k"], x["v"], x["beta"], x["g"], **kw),
        "osgdn": lambda: osgdn(x["q"], x["k"], x["v"], x["beta"], x["g"], x["d"], **kw),
        "kda": lambda: kda(x["q"], x["k"], x["v"], x["beta"], x["gk"], **kw),
        "oskda": lambda: oskda(x["q"], x["k"], x["v"], x["beta"], x["gk"], x["d"], **kw),
    }
    return args[fn]()


X = _inputs()
NAN = float("nan")
INF = float("inf")

RECURRENCE_CASES = [
    # shapes
    ("k", dict(k=X["k"][0])),
    ("k", dict(k=X["k"][..., None])),
    ("k", dict(k=[[1.0]])),
    ("q", dict(q=X["q"][:, :-1])),
    ("beta", dict(beta=X["beta"][..., None])),
    ("beta", dict(beta=X["beta"][:, :-1])),
    ("v", dict(v=X["v"][:, :-1])),
    ("v", dict(v=X["v"][..., 0])),
    ("beta", dict(beta=(X["beta"] > 0.5))),
    ("initial_state", dict(initial_state=torch.zeros(B, H, K + 1, V, dtype=F64))),
    ("initial_state", dict(initial_state=torch.zeros(2, H, V, K, dtype=F64))),
    # packed offsets
    ("cu_seqlens", dict(cu_seqlens=_cu(1, 3, T))),
    ("cu_seqlens", dict(cu_seqlens=_cu(0, 4, 2, T))),
    ("cu_seqlens", dict(cu_seqlens=_cu(0, 2, T - 1))),
    ("cu_seqlens", dict(cu_seqlens=_cu(0, 2, T + 1))),
    ("cu_seqlens", dict(cu_seqlens=_cu(0))),
    ("cu_seqlens", dict(cu_seqlens=torch.tensor([0.0, float(T)]))),
    ("cu_seqlens", dict(cu_seqlens=_cu(0, T).reshape(1, 2))),
    ("cu_seqlens", dict(cu_seqlens=[0, T])),
]


@pytest.mark.parametrize("fn", ["deltanet", "osdn", "gated_deltanet", "osgdn", "kda", "oskda"])
@pytest.mark.parametrize(
    ("arg", "over"), RECURRENCE_CASES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(RECURRENCE_CASES)]
)
def test_recurrence_rejects_bad_input(fn, arg, over):
    if fn in ("kda", "oskda") and arg == "initial_state":
        over = {"initial_state": over["initial_state"].transpose(-1, -2)}
    with pytest.raises(ValueError, match=f"'{arg}'"):
        _rec(fn, **over)


def test_packing_needs_batch_size_one():
    x = _inputs()
    x2 = {n: torch.cat([t, t]) if n not in ("S",) else t for n, t in x.items()}
    with pytest.raises(ValueError, match="'cu_seqlens'"):
        deltanet(x2["q"], x2["k"], x2["v"], x2["beta"], cu_seqlens=_cu(0, 2, T))
    with pytest.raises(ValueError, match="'cu_seqlens'"):
        osdn_phase1(x2["k"], x2["beta"], cu_seqlens=_cu(0, 2, T))


@pytest.mark.parametrize(
    ("fn", "arg", "over"),
    [
        ("gated_deltanet", "g", dict(g=X["gk"])),
        ("osgdn", "g", dict(g=X["g"][:, :-1])),
        ("kda", "g", dict(gk=X["g"])),
        ("oskda", "g", dict(gk=X["gk"][..., :-1])),
        ("gated_deltanet", "g", dict(g=None)),
        ("osdn", "d", dict(d=X["d"][0])),
        ("osdn", "d", dict(d=None)),
        ("osdn", "d", dict(d=X["d"][..., :1])),  # would broadcast silently
        ("osgdn", "d", dict(d=X["d"][..., :1])),
        ("oskda", "d", dict(d=X["d"][..., :1])),
        ("osdn", "d", dict(d=torch.cat([X["d"], X["d"]]))),
    ],
)
def test_wrapper_specific_arguments_are_checked(fn, arg, over):
    with pytest.raises(ValueError, match=f"'{arg}'"):
        _rec(fn, **over)


# Which argument receives a non-finite entry, for each function family.
FINITE_REC = {
    "deltanet": ("q", "k", "v", "beta", "initial_state"),
    "osdn": ("q", "k", "v", "beta", "d", "initial_state"),
    "gated_deltanet": ("q", "k", "v", "beta", "g", "initial_state"),
    "osgdn": ("q", "k", "v", "beta", "g", "d", "initial_state"),
    "kda": ("q", "k", "v", "beta", "g", "initial_state"),
    "oskda": ("q", "k", "v", "beta", "g", "d", "initial_state"),
}


@given(data=st.data())
def test_non_finite_recurrence_input_is_named(data):
    fn = data.draw(st.sampled_from(sorted(FINITE_REC)), label="function")
    arg = data.draw(st.sampled_from(FINITE_REC[fn]), label="argument")
    bad = data.draw(st.sampled_from([NAN, INF, -INF]), label="value")
    x = _inputs()
    key = {"initial_state": "S", "g": "gk" if fn in ("kda", "oskda") else "g"}.get(arg, arg)
    t = x[key].clone()
    flat = t.view(-1)
    flat[data.draw(st.integers(0, flat.numel() - 1), label="position")] = bad
    if arg == "initial_state":
        over = {"initial_state": t.transpose(-1, -2) if fn in ("kda", "oskda") else t}
    else:
        over = {key: t}
    with pytest.raises(ValueError, match=f"'{arg}'"):
        _rec(fn, **over)


@given(data=st.data())
def test_non_finite_phase1_input_is_named(data):
    arg = data.draw(st.sampled_from(["k", "beta", "d0", "retention"]), label="argument")
    bad = data.draw(st.sampled_from([NAN, INF, -INF]), label="value")
    x = _inputs()
    t = {
        "k": x["k"],
        "beta": x["beta"],
        "d0": torch.ones(H, K, dtype=F64),
        "retention": torch.ones(B, T, H, dtype=F64),
    }[arg].clone()
    flat = t.view(-1)
    flat[data.draw(st.integers(0, flat.numel() - 1), label="position")] = bad
    with pytest.raises(ValueError, match=f"'{arg}'"):
        _phase1(**{arg: t})


PHASE1_CASES = [
    ("k", dict(k=X["k"][0])),
    ("k", dict(k=X["k"].to(torch.int64))),
    ("beta", dict(beta=X["beta"][..., None])),
    ("beta", dict(beta=X["beta"][:, :-1])),
    ("d0", dict(d0=torch.full((H, K), 3.0, dtype=F64))),
    ("d0", dict(d0=torch.full((H, K), 0.25, dtype=F64))),
    ("d0", dict(d0=torch.ones(H, K + 1, dtype=F64))),
    ("d0", dict(d0=torch.ones(2, H, K, dtype=F64))),
    ("d0", dict(d0=torch.zeros(H, K, dtype=F64), d_min=None, d_max=None)),
    ("d0", dict(d_min=1.5, d_max=3.0)),  # the default d0 = 1 is outside the box
    ("d0", dict(d_min=0.1, d_max=0.5)),
    ("d_min", dict(d_min=0.0)),
    ("d_min", dict(d_min=-1.0, d_max=2.0)),
    ("d_min", dict(d_min=NAN)),
    ("d_max", dict(d_min=1.0, d_max=0.5)),
    ("d_max", dict(d_max=NAN)),
    ("d_min", dict(d_min=None)),  # only one bound
    ("d_max", dict(d_max=None)),
    ("retention", dict(retention=torch.full((B, T, H), -0.1, dtype=F64))),
    ("retention", dict(retention=torch.full((B, T, H, K), 1.5, dtype=F64))),
    ("retention", dict(retention=torch.ones(B, T, H, K + 1, dtype=F64))),
    ("retention", dict(retention=torch.ones(B, T, dtype=F64))),
    ("eta", dict(eta=-1e-3)),
    ("eta", dict(eta=NAN)),
    ("eta", dict(eta=INF)),
    ("eta", dict(eta="0.1")),
    ("eps", dict(eps=0.0)),
    ("eps", dict(eps=-1.0)),
    ("cu_seqlens", dict(cu_seqlens=_cu(1, T))),
    ("cu_seqlens", dict(cu_seqlens=_cu(0, 3, 1, T))),
    ("cu_seqlens", dict(cu_seqlens=_cu(0, 2))),
    ("cu_seqlens", dict(cu_seqlens=torch.tensor([0.0, T]))),
    ("cu_seqlens", dict(cu_seqlens=[0, T])),
]


@pytest.mark.parametrize(
    ("arg", "over"), PHASE1_CASES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(PHASE1_CASES)]
)
def test_phase1_rejects_bad_input(arg, over):
    with pytest.raises(ValueError, match=f"'{arg}'"):
        _phase1(**over)


def test_phase1_accepts_the_edges_of_what_is_legal():
    """The checks are not over-eager: a degenerate box, η = 0, retention in {0, 1}, no box at all."""
    _phase1(d_min=1.0, d_max=1.0)
    _phase1(eta=0.0, retention=torch.zeros(B, T, H, dtype=F64))
    _phase1(d_min=None, d_max=None, d0=torch.full((H, K), 10.0, dtype=F64))
    _phase1(d0=torch.full((H, K), 0.5, dtype=F64), d_min=0.5, d_max=0.5)
    _phase1(cu_seqlens=_cu(0, 0, T, T, dtype=torch.int32))
    assert math.isfinite(float(_phase1(eta=1e6).d.abs().max()))


@pytest.mark.parametrize(
    ("arg", "over"),
    [
        ("k", dict(k=X["k"][0])),
        ("q", dict(q=X["q"][:, :-1])),
        ("v", dict(v=X["v"][:, :-1])),
        ("beta", dict(beta=X["beta"][..., None])),
        ("g", dict(g=X["gk"])),
        ("chunk_size", dict(chunk_size=0)),
        ("chunk_size", dict(chunk_size=2.0)),
    ],
)
def test_chunk_form_rejects_bad_input(arg, over):
    x = _inputs()
    kw = dict(q=x["q"], k=x["k"], v=x["v"], beta=x["beta"])
    kw.update(over)
    with pytest.raises(ValueError, match=f"'{arg}'"):
        chunk_delta_rule(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("beta"), **kw)
