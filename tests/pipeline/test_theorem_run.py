"""Theorem D.7 end to end: it holds on OSDN captures, and visibly fails when a hypothesis is broken.

Kernels: none run here; the captures are written by hand (from the package's fp64 OSDN reference).
"""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import torch

from osdn_diag.capture import CaptureWriter, KernelCall
from osdn_diag.math import osdn, osdn_phase1
from osdn_diag.pipeline import replay_run


def _osdn_run(path, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V = 1, 64, 4, 8, 8
    k = torch.nn.functional.normalize(
        torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    q, v = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    beta = 0.05 + 0.9 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    d = osdn_phase1(k, beta, eta=0.3).d
    o = osdn(q, k, v, beta, d).o
    w = CaptureWriter(path)
    w.begin({"prompts": [{"id": 0, "task": "t", "length": T, "repeat_start": -1}]})
    w.write(0, [0], KernelCall(layer=0, layer_name="l", family="osdn", kernel="x", q=q.float(), k=k.float(),
                               v=v.float(), beta=beta.float(), d=d.float(), o=o.float(), scale=K**-0.5))
    w.finish()
    summary = replay_run(path, progress=False, dtype=torch.float64)
    return summary, pq.read_table(path / "comparator.parquet").to_pydict()


def test_bound_holds_on_osdn_capture(tmp_path):
    summary, rows = _osdn_run(tmp_path / "ok")
    c = summary["comparator"]
    assert c["problems"] == 4 and c["hypotheses_hold"] == 4 and c["bound_holds"] == 4
    assert c["slack_min"] >= -1e-9
    assert all(r <= 1e-8 for r in rows["kkt_residual"]) and all(e >= 0 for e in rows["eps_diag"])
    assert all(e <= o + 1e-12 for e, o in zip(rows["eps_diag"], rows["eps_at_ones"]))
    assert json.loads((tmp_path / "ok" / "summary.json").read_text())["comparator"] == c


def test_bound_visibly_fails_without_unit_keys(tmp_path):
    """K = 1, k_t = 2 (‖k‖² = 4), β = 0.3, d ≡ 1: every q_t = (1 − 1.2)² = 0.04, while the comparator
    d* = 1/1.2 gives ε_T = 0 and R_T = 0.005·T, so the formula's right-hand side is 0.01^T < 0.04^T:
    outside its unit-key hypothesis the bound is violated by T·log 4 — and flagged as such."""
    T = 32
    k = torch.full((1, T, 1, 1), 2.0, dtype=torch.float64)
    v = torch.randn(1, T, 1, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    beta = torch.full((1, T, 1), 0.3, dtype=torch.float64)
    d = torch.ones_like(k)
    o = osdn(k, k, v, beta, d).o
    w = CaptureWriter(tmp_path / "bad")
    w.begin({"prompts": [{"id": 0, "task": "t", "length": T, "repeat_start": -1}]})
    w.write(0, [0], KernelCall(layer=0, layer_name="l", family="osdn", kernel="x", q=k.float(), k=k.float(),
                               v=v.float(), beta=beta.float(), d=d.float(), o=o.float(), scale=1.0))
    w.finish()
    summary = replay_run(tmp_path / "bad", progress=False, dtype=torch.float64)
    rows = pq.read_table(tmp_path / "bad" / "comparator.parquet").to_pydict()
    assert summary["comparator"]["hypotheses_hold"] == 0 and summary["comparator"]["slack_min"] is None
    assert rows["eps_diag"][0] < 1e-12
    assert abs(rows["slack"][0] - (-T * math.log(4.0))) < 1e-6 * T
