"""One definition of "Theorem D.7's hypotheses hold" for a (prompt, layer, head) stream: the audit and
theorem_d7 (comparator.parquet) decide every stream alike, and both agree with a computation here in
numpy from the stream's tensors, including keys within the bf16 rounding of a unit vector."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from osdn_diag.capture import KernelCall
from osdn_diag.metrics.audit import AuditAccumulator
from osdn_diag.metrics.hypotheses import HYPOTHESES, KEY_NORM_BASE_TOL, check, key_norm_tol
from osdn_diag.metrics.theorem import theorem_d7

BF16_BOUND = (1 + 2.0**-8) ** 2 - 1  # rounding a unit key to bf16 moves ‖k‖² by at most this


def test_key_norm_tolerance_is_the_base_plus_the_dtypes_rounding():
    assert KEY_NORM_BASE_TOL == 1e-3
    assert key_norm_tol("bfloat16") == 1e-3 + BF16_BOUND
    assert key_norm_tol("float32") == 1e-3 + ((1 + 2.0**-24) ** 2 - 1)
    assert key_norm_tol("float16") == 1e-3 + ((1 + 2.0**-11) ** 2 - 1)
    # Unit keys rounded to bf16 stay within the bound, and come near it: rounding, not the model.
    k = torch.nn.functional.normalize(torch.randn(20000, 2, generator=torch.Generator().manual_seed(0),
                                                  dtype=torch.float64), dim=-1)
    dev = (k.to(torch.bfloat16).double().square().sum(-1) - 1).abs().max().item()
    assert BF16_BOUND / 2 < dev <= BF16_BOUND


def test_check_each_hypothesis_and_streams_without_valid_tokens():
    f = check(n_valid=torch.tensor([3, 3, 3, 3, 3, 0]),
              max_unit_dev=torch.tensor([0.0, 0.02, 0.0, 0.0, 0.0, float("nan")]),
              beta_min=torch.tensor([0.5, 0.5, 0.0, 0.5, 0.5, float("nan")]),
              beta_max=torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, float("nan")]),
              d_in_box=torch.tensor([True, True, True, False, True, True]),
              decay=torch.tensor([False, False, False, False, True, False]), tol=0.01)
    assert list(f) == [*HYPOTHESES, "hypotheses_hold"]
    assert f["hypotheses_hold"].tolist() == [True, False, False, False, False, False]
    # Each failing stream fails exactly one check: a stream without valid tokens only "has_valid_token".
    failing = [[name for name in HYPOTHESES if not f[name][i]] for i in range(6)]
    assert failing == [[], ["unit_keys"], ["beta_in_open_unit_interval"], ["d_in_box"], ["no_decay"],
                       ["has_valid_token"]]


def _streams(B=2, T=7, H=3, K=4, seed=0):
    """A call of B sequences × H heads whose streams break the hypotheses in chosen ways."""
    g = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=torch.float64), dim=-1)
    beta = 0.1 + 0.8 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    d = torch.ones(B, T, H, K, dtype=torch.float64)
    k[0, 2, 0] *= (1 + 5e-3) ** 0.5   # ‖k‖² = 1.005: within bf16's tolerance, outside fp32's
    k[0, 3, 1] *= (1 + 2e-2) ** 0.5   # ‖k‖² = 1.02: not unit in any dtype
    k[1, 4, 1] *= 3.0                 # on a token that is not valid (below): ignored
    beta[1, 1, 2] = 1.0               # β outside (0, 1)
    d[1, 5, 0, 3] = 2.5               # d outside [0.5, 2]
    loss = torch.ones(B, T, H)
    loss[1, 4, 1] = 0.0               # a zero residual: not a valid token
    loss[0, :, 2] = 0.0               # a stream without any valid token
    return k.float(), beta.float(), d.float(), loss


def _numpy_flags(k, beta, d, valid, tol, decay, box=(0.5, 2.0)):
    """Per stream (sequence b, head h) -> problem b·H + h, from the tensors in numpy."""
    k, beta, d, valid = (x.double().numpy() for x in (k, beta, d, valid))
    B, T, H = beta.shape
    out = {name: [] for name in (*HYPOTHESES, "hypotheses_hold")}
    for b in range(B):
        for h in range(H):
            m = valid[b, :, h].astype(bool)
            n2 = (k[b, m, h] ** 2).sum(-1)
            be, dd = beta[b, m, h], d[b, m, h]
            flags = {
                "unit_keys": bool(np.all(np.abs(n2 - 1) <= tol)),
                "beta_in_open_unit_interval": bool(np.all((be > 0) & (be < 1))),
                "d_in_box": bool(np.all((dd >= box[0]) & (dd <= box[1]))),
                "no_decay": not decay,
                "has_valid_token": bool(m.any()),
            }
            flags["hypotheses_hold"] = all(flags.values())
            for name, v in flags.items():
                out[name].append(v)
    return {name: np.array(v) for name, v in out.items()}


@pytest.mark.parametrize("read_as", ["bfloat16", "float32"])
@pytest.mark.parametrize("gated", [False, True])
def test_audit_and_theorem_d7_decide_every_stream_alike(read_as, gated):
    k, beta, d, loss = _streams()
    B, T, H, K = k.shape
    zeros = torch.zeros(B, T, H, K)
    g = torch.zeros(B, T, H) if gated else None
    call = KernelCall(layer=0, layer_name="l", family="x", kernel="x", q=zeros, k=k, v=zeros,
                      beta=beta, o=zeros, scale=1.0, d=d, g=g)
    call.flags["qk_read_as"] = read_as
    finite = torch.ones(B, T, H, dtype=torch.bool)
    valid = finite & (loss > 0)
    tol = 1e-3 + ((1 + (2.0**-8 if read_as == "bfloat16" else 2.0**-24)) ** 2 - 1)
    exp = _numpy_flags(k, beta, d, valid, tol, gated)

    acc = AuditAccumulator()
    acc.add(call, loss, finite, valid)
    s = acc.summary()

    def problems(x):  # [B, T, H, ...] -> [B·H, T, ...]
        return x.transpose(1, 2).reshape(B * H, T, *x.shape[3:])

    out = theorem_d7(problems(k), problems(beta), problems(d), torch.ones(B * H, T), problems(valid),
                     gated=gated, unit_tol=torch.full((B * H,), key_norm_tol(read_as), dtype=torch.float64))
    for name in ("unit_keys", "beta_in_open_unit_interval", "d_in_box", "no_decay", "hypotheses_hold"):
        np.testing.assert_array_equal(out[name].numpy(), exp[name], err_msg=name)
    np.testing.assert_array_equal((out["n_valid"] > 0).numpy(), exp["has_valid_token"])
    assert torch.all(out["key_norm_tol"] == tol)

    assert s["streams"] == B * H
    assert s["hypotheses_hold"] == int(exp["hypotheses_hold"].sum())
    assert s["hypotheses_failed"] == {name: int((~exp[name]).sum()) for name in HYPOTHESES}
    for h in range(H):  # per head: the streams of that head in every sequence
        head = s["by_head"][f"000.{h:03d}"]
        sel = np.arange(B) * H + h
        assert head["streams"] == B and head["hypotheses_hold"] == int(exp["hypotheses_hold"][sel].sum())
        assert head["hypotheses_failed"] == {name: int((~exp[name][sel]).sum()) for name in HYPOTHESES}
    # The case is informative: the stream with ‖k‖² = 1.005 holds under bf16 only, and without decay
    # some streams hold and others fail each of the checks.
    assert bool(exp["unit_keys"][0]) is (read_as == "bfloat16")
    if not gated:
        assert 0 < s["hypotheses_hold"] < B * H
        assert all(s["hypotheses_failed"][name] for name in HYPOTHESES if name != "no_decay")


def test_packed_sequences_are_streams_of_their_own():
    """cu_seqlens: one batch row, three sequences; a non-unit key in the second fails only its streams."""
    k = torch.nn.functional.normalize(torch.randn(1, 9, 2, 4, generator=torch.Generator().manual_seed(1)), dim=-1)
    k[0, 4, 1] *= 1.1
    zeros = torch.zeros_like(k)
    call = KernelCall(layer=3, layer_name="l", family="x", kernel="x", q=zeros, k=k, v=zeros,
                      beta=torch.full((1, 9, 2), 0.5), o=zeros, scale=1.0, cu_seqlens=torch.tensor([0, 3, 5, 9]))
    acc = AuditAccumulator()
    ok = torch.ones(1, 9, 2, dtype=torch.bool)
    acc.add(call, torch.ones(1, 9, 2), ok, ok)
    s = acc.summary()
    assert (s["streams"], s["hypotheses_hold"], s["hypotheses_failed"]["unit_keys"]) == (6, 5, 1)
    assert s["by_head"]["003.001"]["hypotheses_failed"]["unit_keys"] == 1
    assert s["by_layer"]["003"]["streams"] == 6


# ------------------------------------------------------------------------------------- the contract

DOCS = __import__("pathlib").Path(__file__).resolve().parents[2] / "docs"


def _documented(page: str, heading: str) -> list[str]:
    """The backticked names in the first column of the first table whose header is ``| column |``,
    ``| key |`` or ``| check |`` under ``heading`` of ``docs/page``."""
    text = (DOCS / page).read_text()
    section = text[text.index(heading):]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(("| column |", "| key |", "| check |")))
    names = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        first = line.split("|")[1]
        names += first.split("`")[1::2]
    return names


def test_documented_comparator_columns_and_audit_keys_are_those_written():
    from osdn_diag.metrics.theorem import COLUMNS

    columns = _documented("run-directory.md", "## comparator.parquet")
    assert columns == ["prompt", "task", "layer", "head", *COLUMNS]
    assert COLUMNS[-5:] == ("key_norm_tol", "unit_keys", "beta_in_open_unit_interval", "no_decay",
                            "hypotheses_hold")
    checks = _documented("metrics.md", "**The Theorem D.7 hypotheses hold for a stream**")
    assert checks == list(HYPOTHESES)
    from osdn_diag.report.markdown import HYPOTHESIS_WORDS  # the report names every check, in order

    assert list(HYPOTHESIS_WORDS) == list(HYPOTHESES)
    acc = AuditAccumulator()
    k = torch.nn.functional.normalize(torch.ones(1, 3, 1, 2), dim=-1)
    zeros = torch.zeros_like(k)
    acc.add(KernelCall(layer=0, layer_name="l", family="x", kernel="x", q=zeros, k=k, v=zeros,
                       beta=torch.full((1, 3, 1), 0.5), o=zeros, scale=1.0), torch.ones(1, 3, 1),
            torch.ones(1, 3, 1, dtype=torch.bool))
    keys = [key for key in acc.summary()["by_head"]["000.000"]]
    text = (DOCS / "metrics.md").read_text()
    audit = text[text.index("| `streams` |"):text.index("## Comparator gap")]
    documented = [name for line in audit.splitlines() if line.startswith("| `")
                  for name in line.split("|")[1].split("`")[1::2]]
    assert documented == keys


def test_a_replayed_bf16_capture_counts_keys_within_its_rounding_as_unit(tmp_path):
    """End to end: a capture whose kernel read its keys in bf16. Head 0's keys have ‖k‖² = 1.005
    (within bf16's rounding of a unit key: unit), head 1's 1.02 (not unit in any dtype). comparator.parquet,
    its summary counts and the audit's say the same, stream by stream."""
    import json

    import pyarrow.parquet as pq

    from osdn_diag.capture import CaptureWriter
    from osdn_diag.math import deltanet
    from osdn_diag.pipeline import replay_run

    gen = torch.Generator().manual_seed(3)
    B, T, H, K = 2, 12, 2, 8
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k[:, :, 0] *= 1.005**0.5
    k[:, :, 1] *= 1.02**0.5
    k = k.float()
    beta = 0.2 + 0.6 * torch.rand(B, T, H, generator=gen)
    w = CaptureWriter(tmp_path)
    w.begin({"model": {"spec": "synthetic"}, "prompts_source": "test",
             "prompts": [{"id": i, "task": "t", "length": T, "repeat_start": -1} for i in range(B)]})
    w.write(0, list(range(B)), KernelCall(layer=0, layer_name="layers.0", family="x", kernel="x", q=q, k=k, v=v,
                                          beta=beta, o=deltanet(q, k, v, beta).o, scale=K**-0.5,
                                          flags={"qk_read_as": "bfloat16"}))
    w.finish({"kernels": ["fla"]})
    replay_run(tmp_path, progress=False)
    table = pq.read_table(tmp_path / "comparator.parquet")
    c = {name: table.column(name).to_pylist() for name in table.column_names}
    assert c["head"] == [0, 1, 0, 1]
    assert c["unit_keys"] == [True, False, True, False] and c["hypotheses_hold"] == [True, False, True, False]
    assert c["key_norm_tol"] == [key_norm_tol("bfloat16")] * 4
    s = json.loads((tmp_path / "summary.json").read_text())
    expected = {"streams": 4, "hypotheses_hold": 2,
                "hypotheses_failed": {name: 2 if name == "unit_keys" else 0 for name in HYPOTHESES}}
    assert {key: s["assumptions"][key] for key in expected} == expected
    assert s["comparator"]["problems"] == 4 and s["comparator"]["hypotheses_hold"] == 2
    assert s["comparator"]["hypotheses_failed"] == expected["hypotheses_failed"]
    assert s["assumptions"]["by_head"]["000.000"]["hypotheses_hold"] == 2
    # With the realised regret the bound is AM–GM: it holds on the two streams, keys 5e-3 off unit.
    assert s["comparator"]["bound_holds"] == 2
