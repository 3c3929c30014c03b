"""Inputs and comparisons the replay kernels' tests share (``test_replay_kernel.py``, the token-by-token
replay; ``test_replay_chunk.py``, the chunked one): both are held to the fp64 reference recurrence."""

from __future__ import annotations

import torch

#: Every field of a replay's result, as the reference names them.
FIELDS = ("o", "final_state", "loss_before", "loss_after", "loss_before_decayed", "write_gain")


def replay_inputs(seed, B, T, H, K, V, *, gate, asym, h0):
    """``(q, k, v, beta, kwargs)`` in fp64 on the CPU: random queries and values; unit keys but one zero
    key; β in (0, 1) with β = 1e-6 and 1 − 1e-6 at the first and last head; with ``asym`` a write key
    scaled per channel; ``gate`` ``"head"`` or ``"channel"``: a log decay in (−1, 0]; with ``h0`` an
    initial state."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1)
    k[:, 0, 0] = 0.0  # a zero key
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    beta[..., 0] = 1e-6
    beta[..., -1] = 1 - 1e-6
    kw = {}
    if asym:
        kw["write_key"] = (0.5 + 1.5 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)) * k
    if gate == "head":
        kw["g"] = -torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    elif gate == "channel":
        kw["g"] = -torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    if h0:
        kw["initial_state"] = rnd(B, H, V, K)
    return rnd(B, T, H, K), k, rnd(B, T, H, V), beta, kw


def assert_close(got, ref, name, tol):
    """``got`` finite, of ``ref``'s shape, within ``tol`` of it in relative Frobenius norm."""
    assert got.shape == ref.shape, name
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = ((got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-300)).item()
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"


def assert_fields_close(got, ref, tol):
    """Every field of the replay against the reference's; a field the reference leaves out (no gate:
    ``loss_before_decayed``) is left out of the replay too."""
    for name in FIELDS:
        r = getattr(ref, name)
        if r is None:
            assert getattr(got, name) is None, name
        else:
            assert_close(getattr(got, name), r, name, tol)


def assert_fp32_fields_close(got, ref, tol=1e-5):
    """Every field of a Triton replay within ``tol`` of the fp64 reference's, and in fp32 (the only
    precision the chunked replays have)."""
    for name in FIELDS:
        x = getattr(got, name)
        assert x is None or x.dtype == torch.float32, name
    assert_fields_close(got, ref, tol)


def to_device(kw: dict, device) -> dict:
    """``kw`` with its tensors moved to ``device``."""
    return {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}

