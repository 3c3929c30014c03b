"""Zero conventions: q = 1 where there is nothing to contract, zero keys write nothing, and nothing is NaN."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from osdn_strategies import (
    KEY_KINDS,
    WRAPPERS,
    array,
    betas,
    dims,
    floats_in,
    gaussians,
    keys,
    preconditioners,
    run_wrapper,
    states,
    wrapper_inputs,
)

from osdn_diag.math import (
    osdn,
    osdn_phase1,
    residual_ratio,
    surrogate,
    surrogate_grad,
    surrogate_hessian,
)

F64 = torch.float64


@given(st.data())
def test_residual_ratio_is_one_exactly_where_loss_before_is_zero(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    before = data.draw(array(shape, st.one_of(st.just(0.0), floats_in(1e-300, 1e3))))
    after = data.draw(array(shape, st.one_of(st.just(0.0), floats_in(1e-300, 1e3))))
    q = residual_ratio(after, before)
    zero = before == 0
    assert (q[zero] == 1).all()
    assert torch.equal(q[~zero], after[~zero] / before[~zero])
    assert torch.isfinite(q).all()


# The wrapper is drawn (not parametrized): these properties are cheap to state and the suite's time goes
# where the algebra is (packing and the gated write are parametrized over every wrapper).
@given(data=st.data())
def test_zero_values_on_zero_state_never_move(data):
    """v ≡ 0 from S_0 = 0: every residual is exactly 0, so loss_after = 0, q = 1, and the state stays 0."""
    name = data.draw(st.sampled_from(WRAPPERS), label="wrapper")
    x, D = data.draw(wrapper_inputs())
    x = dict(x, v=torch.zeros_like(x["v"]))
    res = run_wrapper(name, **x)
    assert (res.loss_before == 0).all() and (res.loss_after == 0).all()
    assert (residual_ratio(res.loss_after, res.loss_before) == 1).all()
    assert (res.final_state == 0).all() and (res.o == 0).all()


@given(st.data())
def test_repeating_an_exactly_stored_token_has_zero_residual(data):
    """An exact write (β = 1, d = 1, one-hot key, from S_0 = 0) stores v; repeating the same (k, v) — with
    any β, d afterwards — finds a zero residual: loss_before = loss_after = 0 and q = 1."""
    H, K, V = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4))
    reps = data.draw(st.integers(1, 8), label="repeats")
    T = reps + 1
    k1 = data.draw(keys((1, 1, H, K), kinds=("onehot",)))
    v1 = data.draw(gaussians((1, 1, H, V)))
    k, v = k1.expand(1, T, H, K).clone(), v1.expand(1, T, H, V).clone()
    beta = torch.cat([torch.ones(1, 1, H, dtype=F64), data.draw(betas((1, reps, H), hi=2.0))], dim=1)
    d_rest = data.draw(preconditioners((1, reps, H, K), 1e-3, 4.0))
    d = torch.cat([torch.ones(1, 1, H, K, dtype=F64), d_rest], dim=1)
    res = osdn(k, k, v, beta, d)
    assert (res.loss_after == 0).all()
    assert (res.loss_before[:, 1:] == 0).all()
    q = residual_ratio(res.loss_after, res.loss_before)
    assert (q[:, 1:] == 1).all()
    assert (q[:, 0] == 0).all()


@given(data=st.data())
def test_zero_keys_have_zero_gain_and_leave_the_loss_unchanged(data):
    name = data.draw(st.sampled_from(WRAPPERS), label="wrapper")
    x, D = data.draw(wrapper_inputs())
    S0 = data.draw(states((D.B, D.H, D.V, D.K)), label="initial_state")
    zero_tok = data.draw(array((D.B, D.T, D.H), st.sampled_from([0.0, 1.0])), label="zero tokens") == 1.0
    x = dict(x, k=torch.where(zero_tok[..., None], 0.0, x["k"]))
    if name == "generic":
        x["write_key"] = torch.where(zero_tok[..., None], 0.0, x["write_key"])
    res = run_wrapper(name, **x, initial_state=S0)
    assert (res.write_gain[zero_tok] == 0).all()
    assert torch.equal(res.loss_after[zero_tok], res.loss_before[zero_tok])
    assert (residual_ratio(res.loss_after, res.loss_before)[zero_tok] == 1).all()
    for f in ("o", "final_state", "loss_before", "loss_after", "write_gain"):
        assert torch.isfinite(getattr(res, f)).all(), f


@given(st.data())
def test_zero_and_tiny_keys_produce_no_nan_through_phase1_and_phase2(data):
    D = data.draw(dims())
    B, T, H, K, V = D.B, D.T, D.H, D.K, D.V
    kinds = data.draw(st.sampled_from([("zero",), ("zero", "tiny"), KEY_KINDS]), label="key kinds")
    k = data.draw(keys((B, T, H, K), kinds=kinds))
    beta = data.draw(betas((B, T, H), hi=1.0))
    eta = data.draw(floats_in(0.0, 10.0, (0.0, 1.0, 10.0)), label="eta")
    ph1 = osdn_phase1(k, beta, eta=eta)
    for t in (ph1.d, ph1.d_final, ph1.write_key):
        assert torch.isfinite(t).all()
    zero = (k == 0).all(-1)
    # A zero key leaves d where it was (the ε floor keeps 0 / 0 away).
    nxt = torch.cat([ph1.d[:, 1:], ph1.d_final[:, None]], dim=1)
    assert torch.equal(nxt[zero], ph1.d[zero])
    v = torch.randn(B, T, H, V, dtype=F64, generator=torch.Generator().manual_seed(T))
    res = osdn(k, k, v, beta, ph1.d)
    for f in ("o", "final_state", "loss_before", "loss_after", "write_gain"):
        assert torch.isfinite(getattr(res, f)).all(), f
    assert torch.isfinite(residual_ratio(res.loss_after, res.loss_before)).all()
    # The floored closed forms are finite at k = 0 too, with zero gradient and Hessian there.
    for eps in (1e-6, 1e-3):
        h = surrogate(ph1.d, k, beta, eps=eps)
        g = surrogate_grad(ph1.d, k, beta, eps=eps)
        hess = surrogate_hessian(k, beta, eps=eps)
        for t in (h, g, hess):
            assert torch.isfinite(t).all()
        assert (g[zero] == 0).all() and (hess[zero] == 0).all() and (h[zero] == 0).all()
