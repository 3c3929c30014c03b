"""The token-parallel phase-1 kernel (:mod:`osdn_diag.ops.phase1_parallel`;
``tests/ops/test_phase1_kernel.py`` runs it through ``osdn_precondition`` and its backward) against
the fp64 sequential sweep (:func:`osdn_diag.math.phase1.osdn_phase1`): trajectory, write keys and
final d, with the clamp active (large η), retention per head-token and per channel, every d0 form, no
box, the non-beta-aware form, zero keys, β at 0 and 1, variable lengths and T not a multiple of the
chunk; the Picard rounds answering, the sequential kernel answering for the pairs they leave, and
both in one call.

CPU: Triton's interpreter, fp32 (its bf16 arithmetic is not the GPU's); GPU: compiled, fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from osdn_diag.math import osdn_phase1
from osdn_diag.math.phase1 import Phase1Result
from osdn_diag.ops.phase1_parallel import parallel_fwd


def _parallel(k, beta, *, chunk, rounds=32, settled="all", stats=None, **kw):
    """The token-parallel kernel (the entry point picks a chunk of ``CHUNK`` tokens: these tests call
    the launcher directly so that chunks and sequences cross at awkward places). ``settled``: which
    (sequence, head) pairs the Picard rounds must have answered — ``"all"``, ``"none"`` or ``"some"``
    (the rest: the sequential kernel)."""
    cu = kw.get("cu_seqlens")
    N = k.shape[0] if cu is None else cu.numel() - 1
    stats = {} if stats is None else stats
    wk, dt, dfin = parallel_fwd(k, beta, kw.get("retention"), kw.get("d0"), cu, N, kw.get("eta", 0.003),
                                kw.get("d_min", 0.5), kw.get("d_max", 2.0), kw.get("beta_aware", True),
                                1e-6, True, chunk=chunk, rounds=rounds, stats=stats)
    pairs = N * k.shape[2]
    expected = {"all": stats["settled"] == pairs, "none": stats["sequential"] == pairs,
                "some": 0 < stats["settled"] < pairs}[settled]
    assert expected and stats["settled"] + stats["sequential"] == pairs, (settled, stats)
    return Phase1Result(write_key=wk, d=dt, d_final=dfin)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64
# The documented settling tolerance of the token-parallel phase 1 (README, "OSDN layers and models";
# docs/design-notes.md, note 15): a settled trajectory is within 1e-5 of phase 1's in every entry.
TOL_D = 1e-5
TOL = 2e-6  # fp32 against fp64: rounding over a few hundred steps


def _rel(a, b) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    assert torch.isfinite(a).all(), "NaN/Inf in the kernel's output"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _case(seed, B, T, H, K, *, ret=None, d0=None, N=None, awkward=False):
    g = torch.Generator().manual_seed(seed)
    N = B if N is None else N
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=F64), dim=-1)
    beta = torch.rand(B, T, H, generator=g, dtype=F64)
    if awkward:
        k[:, 2] = 0
        beta[:, 4] = 0
        beta[:, 5] = 1
        k[:, 6:9] = 0
        k[:, 6:9, :, 0] = 1  # a spike: channel 0 is driven into the box's edge
    r = {None: None, "head": 0.8 + 0.2 * torch.rand(B, T, H, generator=g, dtype=F64),
         "channel": 0.8 + 0.2 * torch.rand(B, T, H, K, generator=g, dtype=F64)}[ret]
    if ret == "head":
        r[:, 3] = 0.0  # retention 0: d forgets itself entirely
    dd0 = {None: None, "shared": 0.6 + torch.rand(H, K, generator=g, dtype=F64),
           "per_seq": 0.6 + torch.rand(N, H, K, generator=g, dtype=F64)}[d0]
    return k, beta, dict(retention=r, d0=dd0)


def _dev(x, dtype=torch.float32):
    return None if x is None else x.to(DEVICE, dtype)


CASES = [
    # B, T, H, K, retention, d0, eta, chunk, awkward
    (2, 40, 2, 16, None, None, 0.5, 32, False),           # two chunks, the second partial
    (2, 40, 2, 16, None, None, 0.5, 32, True),
    (1, 100, 1, 12, "head", "shared", 3.0, 16, True),     # K not a power of 2; the clamp busy
    (2, 33, 2, 32, "channel", "per_seq", 1.0, 64, False),  # one partial block
    (1, 130, 2, 16, "head", None, 0.003, 64, False),
    (1, 40, 1, 16, "channel", None, 0.5, 16, True),
    # 67 chunks (the last of 2 tokens): more than the carry's largest block of 64, so it scans them
    # in two blocks and carries d from one to the next. Chunks of 8 tokens reach that count at a
    # sequence half as long as chunks of 16 (Triton's interpreter walks every token in Python).
    (1, 530, 1, 16, "channel", "shared", 0.05, 8, False),
]


@pytest.mark.parametrize("B,T,H,K,ret,d0,eta,chunk,awkward", CASES)
def test_matches_the_sequential_sweep(fla_kernels, B, T, H, K, ret, d0, eta, chunk, awkward):
    k, beta, kw = _case(1, B, T, H, K, ret=ret, d0=d0, awkward=awkward)
    eta = max(eta, 3.0) if awkward else eta  # large enough for the spike to reach the box
    ref = osdn_phase1(k, beta, **kw, eta=eta)
    got = _parallel(_dev(k), _dev(beta), retention=_dev(kw["retention"]), d0=_dev(kw["d0"]),
                    eta=eta, chunk=chunk)
    assert _rel(got.d, ref.d) <= TOL
    assert _rel(got.write_key, ref.write_key) <= TOL
    assert _rel(got.d_final, ref.d_final) <= TOL
    if awkward:
        assert bool(((ref.d == 0.5) | (ref.d == 2.0)).any())  # the clamp was exercised


def test_variable_lengths_restart_d(fla_kernels):
    cu = torch.tensor([0, 5, 5, 26, 50])  # an empty sequence too; the others cross chunks unaligned
    k, beta, kw = _case(2, 1, 50, 2, 16, ret="channel", d0="per_seq", N=4)
    ref = osdn_phase1(k, beta, **kw, eta=2.0, cu_seqlens=cu)
    got = _parallel(_dev(k), _dev(beta), retention=_dev(kw["retention"]), d0=_dev(kw["d0"]),
                    eta=2.0, cu_seqlens=cu.to(DEVICE), chunk=16)
    assert _rel(got.d, ref.d) <= TOL and _rel(got.d_final, ref.d_final) <= TOL


@pytest.mark.parametrize("beta_aware", [True, False])
def test_no_box_and_beta_awareness(fla_kernels, beta_aware):
    k, beta, _ = _case(3, 2, 34, 1, 16)  # two chunks and a partial one
    d0 = torch.full((1, 16), 2.5, dtype=F64)  # outside [0.5, 2]: only legal without a box
    kw = dict(d0=d0, eta=1.5, d_min=None, d_max=None, beta_aware=beta_aware)
    ref = osdn_phase1(k, beta, **kw)
    got = _parallel(_dev(k), _dev(beta), **{**kw, "d0": _dev(d0)}, chunk=16)
    assert _rel(got.d, ref.d) <= TOL and _rel(got.d_final, ref.d_final) <= TOL


def test_the_sequential_kernel_answers_for_pairs_the_rounds_leave(fla_kernels):
    """One round at a large η settles no pair: the guarded sequential kernel computes them all."""
    k, beta, kw = _case(5, 1, 90, 2, 16, ret="head", awkward=True)
    ref = osdn_phase1(k, beta, **kw, eta=3.0)
    got = _parallel(_dev(k), _dev(beta), retention=_dev(kw["retention"]), eta=3.0, chunk=16, rounds=1,
                    settled="none")
    assert _rel(got.d, ref.d) <= TOL and _rel(got.d_final, ref.d_final) <= TOL
    assert _rel(got.write_key, ref.write_key) <= TOL


def test_settled_and_unsettled_pairs_in_one_call(fla_kernels):
    """Head 0's keys are zero (d never moves: settled in the first round that may), head 1's drive the clamp at
    a large η (unsettled after two rounds): each pair keeps the answer of whichever kernel computed it,
    and the guard keeps the sequential kernel off the settled one."""
    k, beta, kw = _case(6, 2, 90, 2, 16, awkward=True)
    k[:, :, 0] = 0
    ref = osdn_phase1(k, beta, eta=3.0)
    got = _parallel(_dev(k), _dev(beta), eta=3.0, chunk=16, rounds=2, settled="some")
    assert _rel(got.d, ref.d) <= TOL and _rel(got.d_final, ref.d_final) <= TOL
    assert _rel(got.write_key, ref.write_key) <= TOL


def _settling_round(k, beta, eta):
    """The first round whose trajectory the kernel's criterion accepts, by the same rounds in fp64
    (``benchmarks/picard_convergence.py``): twice the drift estimate's largest entry ≤ ``TOL_D``. Box
    [0.5, 2], d0 = 1, beta-aware; one sequence and head."""
    s, b = (k * k)[0, :, 0], beta[0, :, 0]                    # [T, K], [T]
    alpha = eta * b / s.sum(-1).clamp_min(1e-6)
    gam = alpha * b
    c = alpha - gam * s.sum(-1)
    for r in range(1, 20):
        d, walk = torch.ones(s.shape[1], dtype=F64), []
        for t in range(s.shape[0]):
            walk.append(d)
            d = (d + c[t] * s[t]).clamp(0.5, 2.0)
        c_next = alpha - gam * (torch.stack(walk) * s).sum(-1)
        if 2 * float(torch.cumsum((c_next - c).abs()[:, None] * s, 0).max()) <= TOL_D:
            return r
        c = c_next
    raise AssertionError("no round settles")


def test_a_pair_settles_once_its_trajectory_is_within_tol_d(fla_kernels):
    """The verdict is the trajectory's estimated error, not the step sizes' movement: the kernel stops
    at the round the fp64 rounds predict (here the 4th, with a margin of 2x on either side of the
    threshold), and what it emits is within ``TOL_D`` of phase 1 in every entry."""
    k, beta, _ = _case(8, 1, 512, 1, 16)
    expected = _settling_round(k, beta, 0.02)
    assert expected == 4
    ref = osdn_phase1(k, beta, eta=0.02)
    stats = {}
    got = _parallel(_dev(k), _dev(beta), eta=0.02, chunk=64, rounds=6, stats=stats)
    assert stats["rounds"] == expected
    assert float((got.d.double().cpu() - ref.d).abs().max()) <= TOL_D
    assert float((got.d_final.double().cpu() - ref.d_final).abs().max()) <= TOL_D


def _allocations_filled_with(monkeypatch, fill: float) -> None:
    """``torch.empty``/``empty_like`` return tensors filled with ``fill`` (integers: 0) for the rest
    of the test: a kernel that reads a buffer nobody wrote then answers differently per fill."""
    real_empty, real_like = torch.empty, torch.empty_like

    def filled(t):
        return t.fill_(fill) if t.is_floating_point() else t.zero_()

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: filled(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: filled(real_like(*a, **kw)))


@pytest.mark.parametrize("fill", [0.0, float("nan")])
@pytest.mark.parametrize("emit_from", [1, 2, 3])
def test_rounds_before_emit_from_never_settle(fla_kernels, monkeypatch, emit_from, fill):
    """Zero keys: d never moves and every round's verdict is "settled"; the first verdict given is on
    round ``emit_from`` (the rounds before it write no k̃ and no drift), and the answer is the same —
    whatever the unwritten buffers hold (a verdict on a round that wrote no drift would read zeros
    as "settled" and leave k̃ unwritten)."""
    k, beta, _ = _case(9, 1, 70, 2, 16)
    k[:, :, 1] = 0
    ref = osdn_phase1(k, beta, eta=0.003)
    k, beta = _dev(k), _dev(beta)
    _allocations_filled_with(monkeypatch, fill)
    stats = {}
    wk, dt, dfin = parallel_fwd(k, beta, None, None, None, 1, 0.003, 0.5, 2.0, True, 1e-6, True,
                                chunk=16, rounds=3, emit_from=emit_from, stats=stats)
    assert stats["settled"] == 2 and stats["rounds"] >= emit_from
    assert _rel(dt, ref.d) <= TOL and _rel(wk, ref.write_key) <= TOL and _rel(dfin, ref.d_final) <= TOL


def test_bad_arguments():
    k = torch.nn.functional.normalize(torch.randn(1, 8, 1, 4), dim=-1)
    b = torch.rand(1, 8, 1)
    with pytest.raises(ValueError, match="fp64"):
        parallel_fwd(k.double(), b.double(), None, None, None, 1, 0.003, 0.5, 2.0, True, 1e-6, False)
    with pytest.raises(ValueError, match="rounds"):
        parallel_fwd(k, b, None, None, None, 1, 0.003, 0.5, 2.0, True, 1e-6, False, rounds=0)
    with pytest.raises(ValueError, match="emit_from"):
        parallel_fwd(k, b, None, None, None, 1, 0.003, 0.5, 2.0, True, 1e-6, False, rounds=2, emit_from=3)


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter's bf16 arithmetic is not the GPU's")
def test_bf16_at_a_real_shape(fla_kernels):
    k, beta, kw = _case(4, 2, 4096, 4, 128, ret="head")
    # bf16 inputs: compare with the sweep over the same rounded inputs.
    ref = osdn_phase1(k.bfloat16().double(), beta.bfloat16().double(), **kw, eta=0.003)
    got = _parallel(_dev(k, torch.bfloat16), _dev(beta, torch.bfloat16), retention=_dev(kw["retention"]),
                    eta=0.003, chunk=64, rounds=4)
    assert _rel(got.d, ref.d) <= 1e-5 and _rel(got.write_key, ref.write_key) <= 1e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="host synchronisation is a CUDA notion")
def test_the_host_never_waits(fla_kernels):
    """No call in the launch waits for the GPU (CUDA's sync debug mode raises on any that does)."""
    k, beta, _ = _case(7, 2, 256, 2, 64)
    args = (_dev(k, torch.bfloat16), _dev(beta, torch.bfloat16), None, None, None, 2, 0.003, 0.5, 2.0,
            True, 1e-6, True)
    parallel_fwd(*args)  # compiles, and caches the scalars' tensor
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        parallel_fwd(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_sequential_kernel_leaves_skipped_pairs_alone(fla_kernels):
    """``skip`` (the token-parallel kernel's verdicts) keeps the sequential kernel off the pairs marked
    nonzero: their outputs keep what was there; the others are computed."""
    from osdn_diag.ops.phase1_sequential import sequential_fwd

    k, beta, _ = _case(8, 1, 20, 2, 16)
    ref = osdn_phase1(k, beta, eta=0.5)
    k, beta = _dev(k), _dev(beta)
    out = (torch.full_like(k, 7.0), torch.full_like(k, 7.0), torch.full((1, 2, 16), 7.0, device=DEVICE))
    skip = torch.tensor([1, 0], dtype=torch.int32, device=DEVICE)
    wk, dt, dfin = sequential_fwd(k, beta, None, None, None, 1, 0.5, 0.5, 2.0, True, 1e-6, out=out, skip=skip)
    assert (wk[:, :, 0] == 7).all() and (dt[:, :, 0] == 7).all() and (dfin[:, 0] == 7).all()
    assert _rel(dt[:, :, 1], ref.d[:, :, 1]) <= TOL and _rel(wk[:, :, 1], ref.write_key[:, :, 1]) <= TOL
    assert _rel(dfin[:, 1], ref.d_final[:, 1]) <= TOL
