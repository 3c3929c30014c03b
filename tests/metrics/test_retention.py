"""Retained associations: exact on constructed streams."""

from __future__ import annotations

import math

import pytest
import torch

from osdn_diag.capture import KernelCall
from osdn_diag.metrics.retention import RetentionAccumulator, probe_positions, retrieval_errors


def _call(k, v, beta):
    return KernelCall(layer=0, layer_name="l", family="x", kernel="x", q=torch.zeros_like(k), k=k, v=v,
                      beta=beta, o=torch.zeros_like(v), scale=1.0)


def test_probes():
    assert probe_positions(10, 5) == [4, 9]
    assert probe_positions(10, -1) == [9]


def test_counterexample_forgets_every_other_write():
    """K = V = 1, k = 1, v_t = (−1)^t, exact writes: only writes of the last sign are retrievable."""
    T = 9
    k = torch.ones(1, T, 1, 1)
    v = torch.tensor([(-1.0) ** t for t in range(T)]).reshape(1, T, 1, 1)
    cols = retrieval_errors(_call(k, v, torch.ones(1, T, 1)), 0, [T - 1])
    expect = torch.tensor([0.0 if (T - 1 - j) % 2 == 0 else 4.0 for j in range(T)])
    assert torch.equal(cols["j"], torch.arange(T))
    assert torch.allclose(cols["error"], expect)
    acc = RetentionAccumulator()
    acc.add("pm1", cols, T, -1)
    s = acc.summary()["pm1"]
    assert abs(s["mean_error_at_last_token"] - 16 / 9) < 1e-9
    assert s["distance_bins"][0] == [0, 1] and s["mean_error"][0] == 0.0  # the last write itself
    assert s["mean_error"][1] == 4.0  # distance 1


def test_orthogonal_exact_writes_are_all_retained():
    T = K = 6
    k = torch.eye(K).reshape(1, T, 1, K)
    v = torch.randn(1, T, 1, 3, generator=torch.Generator().manual_seed(0))
    cols = retrieval_errors(_call(k, v, torch.ones(1, T, 1)), 0, [2, T - 1])
    assert cols["error"].abs().max() < 1e-12
    assert (cols["probe"] == 2).sum() == 3 and (cols["probe"] == T - 1).sum() == T


def test_first_copy_statistic_and_zero_values():
    T = 8
    k = torch.nn.functional.normalize(torch.randn(1, T, 2, 4, generator=torch.Generator().manual_seed(1)), dim=-1)
    v = torch.randn(1, T, 2, 3, generator=torch.Generator().manual_seed(2))
    v[0, 2] = 0.0  # a zero value carries no association: skipped
    cols = retrieval_errors(_call(k, v, torch.full((1, T, 2), 0.5)), 0, probe_positions(T, 4))
    assert not ((cols["j"] == 2).any())
    acc = RetentionAccumulator()
    acc.add("t", cols, T, 4)
    last = (cols["probe"] == T - 1) & (cols["j"] < 4)
    s = acc.summary()["t"]
    assert abs(s["mean_error_of_first_copy_at_last_token"] - float(cols["error"][last].double().mean())) < 1e-9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_call_on_the_gpu_gives_the_cpu_columns():
    """`run --retained` on a GPU: the call's tensors are on the GPU, the columns come back on the CPU
    and equal those of the same call on the CPU (the recurrence in fp32 on either device)."""
    T = 24
    gen = torch.Generator().manual_seed(3)
    k = torch.nn.functional.normalize(torch.randn(1, T, 2, 8, generator=gen), dim=-1)
    v = torch.randn(1, T, 2, 4, generator=gen)
    v[0, 5] = 0.0
    beta = torch.rand(1, T, 2, generator=gen)
    on_cpu = retrieval_errors(_call(k, v, beta), 0, probe_positions(T, 12))
    on_gpu = retrieval_errors(_call(k.cuda(), v.cuda(), beta.cuda()), 0, probe_positions(T, 12))
    assert on_gpu.keys() == on_cpu.keys()
    for name, col in on_cpu.items():
        assert on_gpu[name].device.type == "cpu", name
        if name == "error":
            assert torch.allclose(on_gpu[name], col, rtol=1e-4, atol=1e-6), name
        else:
            assert torch.equal(on_gpu[name], col), name


def test_a_head_with_nonfinite_inputs_is_left_out_as_the_replay_leaves_its_stream_out():
    """The other head's errors are those of a replay of that head alone; the NaN head has none."""
    T = 8
    gen = torch.Generator().manual_seed(3)
    k = torch.nn.functional.normalize(torch.randn(1, T, 2, 4, generator=gen), dim=-1)
    v = torch.randn(1, T, 2, 3, generator=gen)
    beta = torch.full((1, T, 2), 0.7)
    clean = retrieval_errors(_call(k[:, :, :1], v[:, :, :1], beta[:, :, :1]), 0, [3, T - 1])
    for name in ("k", "v", "beta"):
        bad = {"k": k.clone(), "v": v.clone(), "beta": beta.clone()}
        bad[name][0, 5, 1] = float("nan")
        cols = retrieval_errors(_call(bad["k"], bad["v"], bad["beta"]), 0, [3, T - 1])
        assert torch.equal(cols["head"], torch.zeros_like(cols["head"])), name  # head 1 left out at both probes
        assert torch.equal(cols["j"], clean["j"]) and torch.equal(cols["error"], clean["error"]), name


def test_retained_replay_of_a_call_with_a_nonfinite_stream_runs():
    import osdn_diag

    T = 8
    gen = torch.Generator().manual_seed(4)
    k = torch.nn.functional.normalize(torch.randn(2, T, 2, 4, generator=gen), dim=-1)
    k[1, 5, 1, 2] = float("nan")
    v, beta = torch.randn(2, T, 2, 4, generator=gen), torch.full((2, T, 2), 0.5)
    call = KernelCall(layer=0, layer_name="l0", family="delta_rule", kernel="fused_recurrent_delta_rule",
                      q=k.nan_to_num(), k=k, v=v, beta=beta, o=torch.zeros_like(v), scale=0.5,
                      flags={"kernels": "reference", "device": "cpu"})
    res = osdn_diag.replay([call], retained=True, tolerance=float("inf"))
    assert res.summary["nonfinite"]["streams"] == 1
    retained = res.summary["retained"]
    task = retained[""]
    assert all(math.isfinite(x) for x in _numbers([task["mean_error"], task["mean_error_at_last_token"]]))


def _numbers(x):
    if isinstance(x, dict):
        return [n for v in x.values() for n in _numbers(v)]
    if isinstance(x, (list, tuple)):
        return [n for v in x for n in _numbers(v)]
    return [float(x)] if isinstance(x, (int, float)) and not isinstance(x, bool) else []
