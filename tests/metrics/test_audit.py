"""The assumption audit flags exactly the hypotheses a captured layer breaks."""

from __future__ import annotations

import torch

from osdn_diag.capture import KernelCall
from osdn_diag.metrics.audit import AuditAccumulator


def _call(k, beta, d=None, g=None):
    B, T, H, K = k.shape
    zeros = torch.zeros(B, T, H, K)
    return KernelCall(layer=0, layer_name="l", family="x", kernel="x", q=zeros, k=k, v=zeros,
                      beta=beta, o=zeros, scale=1.0, d=d, g=g)


def test_audit_of_a_clean_layer_and_of_broken_hypotheses():
    gen = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(1, 10, 2, 4, generator=gen), dim=-1)
    beta = torch.full((1, 10, 2), 0.7)
    loss = torch.ones(1, 10, 2)
    loss[0, 3, 1] = 0.0
    ok = torch.ones(1, 10, 2, dtype=torch.bool)
    acc = AuditAccumulator(box=(0.5, 2.0))
    acc.add(_call(k, beta), loss, ok)
    s = acc.summary()
    assert s["theorem_d7_hypotheses_hold"] and s["unit_keys"] and s["max_unit_dev"] < 1e-6
    assert s["share_zero_residual"] == 1 / 20 and s["share_newton_infeasible"] == 0.0
    assert s["by_head"]["000.001"]["share_zero_residual"] == 1 / 10

    cases = {
        "unit_keys": _call(2 * k, beta),
        "beta_in_open_unit_interval": _call(k, torch.ones(1, 10, 2)),
        "d_in_box": _call(k, beta, d=torch.full((1, 10, 2, 4), 3.0)),
    }
    for flag, call in cases.items():
        acc = AuditAccumulator()
        acc.add(call, loss, ok)
        s = acc.summary()
        assert not s[flag] and not s["theorem_d7_hypotheses_hold"], flag
    acc = AuditAccumulator()
    acc.add(_call(k, torch.full((1, 10, 2), 0.3), g=torch.zeros(1, 10, 2)), loss, ok)
    s = acc.summary()
    assert s["decay"] and not s["theorem_d7_hypotheses_hold"] and s["share_newton_infeasible"] == 1.0


def test_nonfinite_tokens_are_not_audited():
    k = torch.nn.functional.normalize(torch.ones(1, 4, 1, 2), dim=-1)
    beta = torch.tensor([[[0.5], [0.5], [7.0], [0.5]]]).reshape(1, 4, 1)
    ok = torch.tensor([True, True, False, True]).reshape(1, 4, 1)
    acc = AuditAccumulator()
    acc.add(_call(k, beta), torch.ones(1, 4, 1), ok)
    assert acc.summary()["beta_max"] == 0.5 and acc.summary()["n"] == 3
