"""The chunkwise outputs: the symbolic checks can fail, and the supporting fp64 sweeps are tight.

The reference here is a torch token recurrence written for this test (it shares no code with
:mod:`proofs._sweep` or :mod:`proofs.chunk_outputs`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from osdn_diag.proofs import _sweep, chunk_outputs

SWEPT = (
    "wy-chunk-asymmetric", "wy-chunk-gated", "wy-chunk-kda",
    "chunk-output-listing-1", "chunk-output-listing-2", "chunk-output-app-b2",
)


@pytest.mark.parametrize("claim_id", SWEPT)
def test_supporting_sweep_is_recorded_and_tight(ledger_json, claim_id):
    (record,) = [r for r in ledger_json["claims"] if r["id"] == claim_id]
    z = record["numbers"]["supporting_fp64_sweep"]
    assert z["C"][-1] == 64 and "not evidence" in z["kind"]
    assert 0 <= z["max_rel_err_state"] < 1e-12 and 0 <= z["max_rel_err_output"] < 1e-12
    assert all(e["kind"] != "supporting" for e in record["evidence"])  # numbers only, never evidence
    assert "Supporting, not evidence" in record["detail"]


def _torch_tokens(q, k, kt, v, beta, alpha, S, kind):
    q, k, kt, v, beta, alpha, S = (torch.as_tensor(x, dtype=torch.float64) for x in (q, k, kt, v, beta, alpha, S))
    out = []
    for i in range(k.shape[0]):
        if kind == "kda":
            S = torch.diag(alpha[i]) @ S
            S = S + beta[i] * torch.outer(kt[i], v[i] - S.T @ k[i])
            out.append(S.T @ q[i])
        else:
            S = (alpha[i] if kind == "gated" else 1.0) * S
            S = S + beta[i] * torch.outer(v[i] - S @ k[i], kt[i])
            out.append(S @ q[i])
    return S.numpy(), torch.stack(out).numpy()


@pytest.mark.parametrize("kind", ["plain", "gated", "kda"])
def test_sweep_chunk_form_against_torch_tokens(kind):
    rng = np.random.default_rng(5)
    for C in (1, 7, 64):
        data = _sweep._data(rng, C, kind)
        S_chunk, o_chunk = _sweep._chunk(*data, kind)
        S_ref, o_ref = _torch_tokens(*data, kind)
        np.testing.assert_allclose(S_chunk, S_ref, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(o_chunk, o_ref, rtol=1e-10, atol=1e-10)


def test_sweep_detects_a_wrong_chunk_form(monkeypatch):
    # a UT "inverse" that forgets the strictly-lower interactions
    monkeypatch.setattr(_sweep, "_unit_lower_solve", lambda A, B: B)
    z = _sweep.sweep("plain")
    assert z["max_rel_err_state"] > 1e-3 and z["max_rel_err_output"] > 1e-3


def test_symbolic_output_check_detects_a_strict_score(monkeypatch):
    # dropping the score's diagonal (token i not reading its own write) must fail the check
    monkeypatch.setattr(chunk_outputs, "_lower", chunk_outputs._strict_lower)
    outcome = chunk_outputs.check_plain()
    assert outcome.status == "failed"
    assert "Listing 1 output = token read-outs" in outcome.detail


def test_sweep_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind must be"):
        _sweep.sweep("dense")
