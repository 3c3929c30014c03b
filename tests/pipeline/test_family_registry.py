"""The plug-in point for kernel families whose recurrence is not the delta rule's.

A family registers a replay function and its further per-token columns
(:mod:`osdn_diag.replay.families`); its adapter records further inputs in ``KernelCall.extra``. Here a
toy family — the delta rule with its target scaled by a per-token ``gain`` held in ``extra`` — is
registered for the test only, and checked end to end against a plain fp64 loop written here:

* ``extra`` tensors survive a capture shard (``extra.NAME`` keys) and a device move;
* ``replay_call`` routes the family to its replay, and its column reaches the per-token table, null
  for the families that do not fill it;
* a non-finite ``extra`` input excludes its stream, as a non-finite key does.
"""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch

from osdn_diag.capture.record import KernelCall
from osdn_diag.capture.store import StoredCall, to_device
from osdn_diag.math.recurrence import RecurrenceResult
from osdn_diag.replay import call as call_mod
from osdn_diag.replay import families
from osdn_diag.replay.replayer import Replayer

B, T, H, K, V = 2, 7, 2, 4, 3


def _toy_loop(k, v, beta, gain):
    """fp64: S_t = S_{t-1} + β_t (gain_t v_t − S_{t−1} k_t) k_tᵀ, o_t = S_t k_t; loss on the scaled target."""
    o = torch.zeros(B, T, H, V, dtype=torch.float64)
    before = torch.zeros(B, T, H, dtype=torch.float64)
    after = torch.zeros(B, T, H, dtype=torch.float64)
    final = torch.zeros(B, H, V, K, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(V, K, dtype=torch.float64)
            for t in range(T):
                kt, target = k[b, t, h].double(), gain[b, t, h].double() * v[b, t, h].double()
                before[b, t, h] = 0.5 * float(((S @ kt - target) ** 2).sum())
                S = S + float(beta[b, t, h]) * torch.outer(target - S @ kt, kt)
                after[b, t, h] = 0.5 * float(((S @ kt - target) ** 2).sum())
                o[b, t, h] = S @ kt
            final[b, h] = S
    return o, final, before, after


def _toy_replay(call, *, dtype, bad, backend):
    k, v, beta = (call_mod.zero_nonfinite(x, bad) if bad is not None else x for x in (call.k, call.v, call.beta))
    gain = call.extra["gain"]
    if bad is not None:
        gain = call_mod.zero_nonfinite(gain, bad)
    o, final, before, after = _toy_loop(k, v, beta, gain)
    return RecurrenceResult(
        o=o.to(dtype), final_state=final.to(dtype), loss_before=before.to(dtype), loss_after=after.to(dtype),
        write_gain=(beta * k.square().sum(-1)).to(dtype), columns={"toy_twice_before": 2 * before.to(dtype)},
    )


@pytest.fixture
def toy_family(monkeypatch):
    monkeypatch.setattr(families, "replays", lambda: {"toy": _toy_replay})
    monkeypatch.setattr(families, "columns", lambda: ("toy_twice_before",))


def _toy_call(gen):
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    gain = 0.5 + torch.rand(B, T, H, generator=gen)
    o, final, _, _ = _toy_loop(k, v, beta, gain)
    return KernelCall(
        layer=0, layer_name="toy", family="toy", kernel="toy_kernel", q=k.clone(), k=k, v=v, beta=beta,
        o=o.float(), scale=1.0, final_state=final.float(), extra={"gain": gain},
        flags={"kernels": "fla", "device": "cpu", "path": "fused_recurrent"},
    )


def test_extra_tensors_survive_a_shard_and_a_device_move():
    call = _toy_call(torch.Generator().manual_seed(0))
    tensors = call.tensors()
    assert "extra.gain" in tensors
    back = KernelCall.from_parts(call.metadata(), tensors)
    assert set(back.extra) == {"gain"}
    assert torch.equal(back.extra["gain"], call.extra["gain"])
    moved = to_device(back, "cpu")
    assert torch.equal(moved.extra["gain"], call.extra["gain"])


def test_a_registered_family_replays_with_its_own_recurrence_and_column(toy_family):
    call = _toy_call(torch.Generator().manual_seed(1))
    _, _, before, after = _toy_loop(call.k, call.v, call.beta, call.extra["gain"])
    rp = Replayer({0: {"task": "t"}, 1: {"task": "t"}}, backend="torch", device="cpu", comparator=False)
    table = rp.add(StoredCall(batch=0, prompts=[0, 1], call=call))
    assert "toy_twice_before" in table.column_names
    rows = table.to_pylist()
    assert len(rows) == B * T * H
    for r in rows:
        b, h, t = r["prompt"], r["head"], r["pos"]
        assert math.isclose(r["loss_before"], float(before[b, t, h]), rel_tol=1e-5, abs_tol=1e-7)
        assert math.isclose(r["toy_twice_before"], 2 * float(before[b, t, h]), rel_tol=1e-5, abs_tol=1e-7)
        expected_q = 1.0 if before[b, t, h] == 0 else float(after[b, t, h] / before[b, t, h])
        assert math.isclose(r["residual_ratio"], expected_q, rel_tol=1e-5, abs_tol=1e-7)
    assert rp.fidelity[0] < 1e-6


def test_other_families_leave_the_column_null(toy_family):
    rp = Replayer({0: {}}, backend="torch", device="cpu", comparator=False)
    assert rp.schema.field("toy_twice_before").type == pa.float32()
    call = _toy_call(torch.Generator().manual_seed(2))
    from osdn_diag.math.recurrence import delta_rule_recurrence

    res = delta_rule_recurrence(call.q, call.k, call.v, call.beta, scale=1.0, dtype=torch.float32)
    plain = KernelCall(layer=1, layer_name="dn", family="delta_rule", kernel="fused_recurrent_delta_rule",
                       q=call.q, k=call.k, v=call.v, beta=call.beta, o=res.o, scale=1.0,
                       flags={"kernels": "fla", "device": "cpu", "path": "fused_recurrent"})
    table = Replayer({0: {}, 1: {}}, backend="torch", device="cpu", comparator=False).add(
        StoredCall(batch=0, prompts=[0, 1], call=plain))
    assert table.column("toy_twice_before").null_count == table.num_rows


def test_a_nonfinite_extra_input_excludes_its_stream(toy_family):
    call = _toy_call(torch.Generator().manual_seed(3))
    call.extra["gain"][1, 3, 0] = float("nan")
    res = call_mod.replay_call(call, backend="torch")
    assert res.nonfinite == 1 and res.nonfinite_streams == [(1, 0)]
