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
    assert (s["streams"], s["hypotheses_hold"]) == (2, 2) and s["max_unit_dev"] < 1e-6
    assert not any(s["hypotheses_failed"].values())
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
        assert s["hypotheses_hold"] == 0 and s["streams"] == 2, flag
        assert s["hypotheses_failed"] == {name: 2 if name == flag else 0 for name in s["hypotheses_failed"]}, flag
    acc = AuditAccumulator()
    acc.add(_call(k, torch.full((1, 10, 2), 0.3), g=torch.zeros(1, 10, 2)), loss, ok)
    s = acc.summary()
    assert s["decay"] and s["hypotheses_hold"] == 0 and s["hypotheses_failed"]["no_decay"] == 2
    assert s["share_newton_infeasible"] == 1.0


def test_stream_checks_read_only_the_valid_tokens():
    """A stream's hypotheses are checked over its tokens with a residual: a zero-residual token whose β,
    key and d break every hypothesis leaves the stream's checks holding (the head's own extremes, over
    every finite token, still show it)."""
    k = torch.nn.functional.normalize(torch.ones(1, 10, 2, 4), dim=-1)
    beta = torch.full((1, 10, 2), 0.7)
    d = torch.ones(1, 10, 2, 4)
    loss = torch.ones(1, 10, 2)
    k[0, 3, 1], beta[0, 3, 1], d[0, 3, 1], loss[0, 3, 1] = 3.0, 5.0, 9.0, 0.0
    acc = AuditAccumulator(box=(0.5, 2.0))
    acc.add(_call(k, beta, d=d), loss, torch.ones(1, 10, 2, dtype=torch.bool))
    s = acc.summary()
    assert (s["streams"], s["hypotheses_hold"]) == (2, 2) and not any(s["hypotheses_failed"].values())
    assert s["beta_max"] == 5.0 and s["d_max"] == 9.0


def test_nonfinite_tokens_are_not_audited():
    k = torch.nn.functional.normalize(torch.ones(1, 4, 1, 2), dim=-1)
    beta = torch.tensor([[[0.5], [0.5], [7.0], [0.5]]]).reshape(1, 4, 1)
    ok = torch.tensor([True, True, False, True]).reshape(1, 4, 1)
    acc = AuditAccumulator()
    acc.add(_call(k, beta), torch.ones(1, 4, 1), ok)
    assert acc.summary()["beta_max"] == 0.5 and acc.summary()["n"] == 3


def test_keys_count_as_unit_up_to_the_rounding_of_the_dtype_the_kernel_read_them_in():
    """A bf16 chunk kernel reads bf16-rounded unit keys: ‖k‖² up to (1 + 2⁻⁸)² − 1 = 7.8e-3 from 1 is
    rounding, not the model; the same deviation in keys read in fp32 is not."""
    k = torch.zeros(1, 4, 1, 4)
    k[..., 0] = (1 + 3e-3) ** 0.5  # ‖k‖² = 1.003: within bf16 rounding, far outside fp32's
    beta = torch.full((1, 4, 1), 0.5)
    loss, ok = torch.ones(1, 4, 1), torch.ones(1, 4, 1, dtype=torch.bool)
    bf16_bound = (1 + 2.0**-8) ** 2 - 1
    for read_as, unit, bound in (("bfloat16", True, bf16_bound), ("float32", False, (1 + 2.0**-24) ** 2 - 1)):
        call = _call(k, beta)
        call.flags["qk_read_as"] = read_as
        acc = AuditAccumulator(unit_tol=1e-3)
        acc.add(call, loss, ok)
        s = acc.summary()
        assert abs(s["max_unit_dev"] - 3e-3) < 1e-6
        assert s["keys_read_as"] == [read_as]
        assert s["key_rounding_bound"] == bound and s["key_norm_tol"] == 1e-3 + bound
        assert s["hypotheses_hold"] == int(unit) and s["hypotheses_failed"]["unit_keys"] == int(not unit)
        assert s["by_layer"]["000"]["keys_read_as"] == [read_as]
