"""``--zero-residual drop|continuous``: tokens whose residual is zero, where the ratio is 0/0.

The stream is the claims ledger's (App. D.4): K = V = 1, k = 1, β = 1/4, d = 2 (so a_t = 1/2),
S_0 = 0 and v = (0, 0, 1, 1). The first two residuals are exactly zero.

* ``drop``: q = (1, 1, 1/4, 1/4) in the table; Theorem D.7 runs over the last two tokens
  (n_valid = 2), where it holds with equality.
* ``continuous``: q = (1/4, 1/4, 1/4, 1/4), the ratio's continuous extension (1 − a)²; the theorem
  keeps all four tokens (n_valid = 4) and holds with the original T.

For a gated layer only the post-decay ratio has that extension: the pre-decay ratio keeps q = 1 and
its zero-residual tokens stay out of the theorem. Expected values are computed here by an fp64 loop.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from osdn_diag.capture.record import KernelCall
from osdn_diag.capture.store import StoredCall
from osdn_diag.cli import main
from osdn_diag.replay.call import replay_call
from osdn_diag.replay.replayer import Replayer

V_TARGETS = (0.0, 0.0, 1.0, 1.0)
BETA, D = 0.25, 2.0


def _loop(alphas):
    """fp64: o_t and the final state of S_t = α_t S_{t−1} + β (v_t − α_t S_{t−1}) (d k), k = 1."""
    S, outs = 0.0, []
    for v, a in zip(V_TARGETS, alphas):
        S = a * S
        S = S + BETA * (v - S) * D
        outs.append(S)
    return outs, S


def _call(gated: bool) -> KernelCall:
    T = len(V_TARGETS)
    alphas = [0.5] * T if gated else [1.0] * T
    outs, final = _loop(alphas)
    one = torch.ones(1, T, 1, 1)
    return KernelCall(
        layer=0, layer_name="toy", family="osgdn" if gated else "osdn", kernel="chunk_osdn",
        q=one, k=one, v=torch.tensor(V_TARGETS).reshape(1, T, 1, 1), beta=torch.full((1, T, 1), BETA),
        o=torch.tensor(outs).reshape(1, T, 1, 1), scale=1.0, d=torch.full((1, T, 1, 1), D),
        g=torch.full((1, T, 1), math.log(0.5)) if gated else None,
        final_state=torch.tensor([[[[final]]]]),
        flags={"kernels": "fla", "device": "cpu", "path": "chunk"},
    )


@pytest.mark.parametrize("mode, ratios, n_valid", [
    ("drop", [1.0, 1.0, 0.25, 0.25], 2),
    ("continuous", [0.25, 0.25, 0.25, 0.25], 4),
])
def test_ungated_zero_residual_tokens(mode, ratios, n_valid):
    rp = Replayer({0: {"task": "t", "length": 4}}, backend="torch", device="cpu", zero_residual=mode)
    table = rp.add(StoredCall(batch=0, prompts=[0], call=_call(gated=False)))
    assert table.column("loss_before").to_pylist()[:2] == [0.0, 0.0]
    assert table.column("residual_ratio").to_pylist() == pytest.approx(ratios, abs=1e-7)
    (row,) = rp.comparator_table().to_pylist()
    summary = rp.summary()
    assert summary["replay"]["zero_residual"] == mode
    assert summary["assumptions"]["share_zero_residual"] == 0.5
    assert summary["q_arith"] == pytest.approx(sum(ratios) / 4, rel=1e-6)
    assert row["n_valid"] == n_valid and row["hypotheses_hold"]
    # Both repairs make Theorem D.7 hold, with equality: the kept ratios are all equal.
    assert row["log_prod_q"] == pytest.approx(n_valid * math.log(0.25), rel=1e-6)
    assert row["slack"] == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("mode", ["drop", "continuous"])
def test_gated_layers_extend_only_the_post_decay_ratio(mode):
    call = _call(gated=True)
    res = replay_call(call, zero_residual=mode)
    before = res.columns["loss_before"].tolist()
    after_decay = res.columns["loss_before_decayed"].tolist()
    assert before[:2] == [0.0, 0.0] and after_decay[:2] == [0.0, 0.0]
    # Pre-decay ratio: q = 1 at the zero-residual tokens in both modes.
    assert res.columns["residual_ratio"].tolist()[:2] == [1.0, 1.0]
    post = res.columns["residual_ratio_post"].tolist()
    assert post[:2] == ([1.0, 1.0] if mode == "drop" else pytest.approx([0.25, 0.25], abs=1e-7))
    assert post[2:] == pytest.approx([0.25, 0.25], abs=1e-7)  # (1 − a)² wherever u ≠ 0
    assert res.grid["theorem_valid"].flatten().tolist() == [False, False, True, True]


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="zero_residual"):
        replay_call(_call(gated=False), zero_residual="ignore")
    with pytest.raises(ValueError, match="zero_residual"):
        Replayer({}, device="cpu", zero_residual="ignore")


def test_the_command_line_records_the_mode(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "random:deltanet-tiny", "--prompts", "random", "--num-prompts", "1", "--length", "16",
            "--out", str(out), "-q"]
    assert main([*args, "--zero-residual", "continuous"]) == 0
    assert json.loads((out / "summary.json").read_text())["replay"]["zero_residual"] == "continuous"
    assert main(["replay", str(out), "-q"]) == 0
    assert json.loads((out / "summary.json").read_text())["replay"]["zero_residual"] == "drop"
    with pytest.raises(SystemExit) as err:
        main(["replay", str(out), "--zero-residual", "ignore"])
    assert err.value.code == 2
    assert "--zero-residual" in capsys.readouterr().err
