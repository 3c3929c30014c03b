"""what-if: OSDN's phase 1 over a capture's keys, replayed (counterfactual, clearly labelled).

Kernels: none run here; the captures are written by hand.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from osdn_diag.capture import CaptureReader, CaptureWriter, KernelCall
from osdn_diag.cli import main
from osdn_diag.math import deltanet, osdn, osdn_phase1
from osdn_diag.pipeline import replay_run
from osdn_diag.whatif import WhatIf


@pytest.fixture
def run_dir(tmp_path):
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 40, 2, 8, 8
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    beta = torch.rand(B, T, H, generator=gen)
    cu = torch.tensor([0, 25, 40])
    w = CaptureWriter(tmp_path / "run")
    # Recall prompts, as measured on the captured forward pass (3 of 4 and 2 of 2 right).
    recall = {"answer_positions": [1], "answers": [2]}
    w.begin({"model": {"spec": "synthetic"}, "prompts": [
        {"id": 0, "task": "a", "length": 25, "repeat_start": -1, **recall, "recall_correct": 3, "recall_queries": 4},
        {"id": 1, "task": "a", "length": 15, "repeat_start": -1, **recall, "recall_correct": 2, "recall_queries": 2}]})
    w.write(0, [0, 1], KernelCall(layer=0, layer_name="l0", family="delta_rule", kernel="x", q=q, k=k,
                                  v=v, beta=beta, o=deltanet(q, k, v, beta, cu_seqlens=cu).o, scale=K**-0.5,
                                  cu_seqlens=cu))
    w.finish()
    replay_run(tmp_path / "run", progress=False)
    return tmp_path / "run"


def test_what_if_replays_osdn_writes(run_dir):
    settings = WhatIf(eta=0.5, d_min=0.5, d_max=2.0)
    assert main(["what-if", str(run_dir), "--eta", "0.5", "-q", "--backend", "torch"]) == 0
    out = run_dir / settings.name()
    manifest = json.loads((out / "manifest.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert manifest["counterfactual"] is True and summary["counterfactual"] is True
    assert manifest["what_if"]["eta"] == 0.5 and "what-if" in manifest["model"]["spec"]
    assert "counterfactual" in (out / "report.md").read_text()
    # The same numbers by hand: phase 1 per packed sequence, then the OSDN recurrence.
    call = next(iter(CaptureReader(run_dir))).call
    pre = osdn_phase1(call.k, call.beta, eta=0.5, cu_seqlens=call.cu_seqlens)
    ref = osdn(call.q, call.k, call.v, call.beta, pre.d, cu_seqlens=call.cu_seqlens)
    table = pq.read_table(out / "residuals.parquet").to_pydict()
    got = torch.tensor(table["loss_after"])  # rows in (sequence, head, pos) order
    want = torch.cat([ref.loss_after[0, s:e].T.reshape(-1) for s, e in ((0, 25), (25, 40))])
    assert torch.allclose(got, want.float(), rtol=1e-5, atol=1e-7)


def test_eta_zero_is_the_captured_model(run_dir):
    """η = 0 keeps d ≡ 1: the what-if equals the original replay exactly."""
    out = run_dir / "eta0"
    assert main(["what-if", str(run_dir), "--eta", "0", "--out", str(out), "-q"]) == 0
    a = pq.read_table(run_dir / "residuals.parquet").to_pydict()
    b = pq.read_table(out / "residuals.parquet").to_pydict()
    assert a["residual_ratio"] == b["residual_ratio"]


def test_what_if_reports_no_recall(run_dir):
    """No forward pass ran with OSDN's d: the what-if has no recall of its own, and does not copy the
    captured run's (its summary and manifest carry none; the report says why it has none)."""
    assert json.loads((run_dir / "summary.json").read_text())["recall"]["a"]["accuracy"] == 5 / 6
    out = run_dir / "wi"
    assert main(["what-if", str(run_dir), "--eta", "0.5", "--out", str(out), "-q"]) == 0
    assert "recall" not in json.loads((out / "summary.json").read_text())
    manifest = json.loads((out / "manifest.json").read_text())
    assert not [k for p in manifest["prompts"] for k in p if k.startswith("recall")]
    report = (out / "report.md").read_text()
    table = report[report.index("## Recall accuracy"):report.index("## By relative position")]
    assert "as captured" in table and "with OSDN d (what-if) |" not in table
    assert "No recall accuracy for with OSDN d (what-if): a what-if replays" in table


def test_what_if_names_its_source_by_absolute_path_and_refuses_an_out_in_another_run(run_dir, monkeypatch, tmp_path):
    """``source_run`` is absolute (the output is read from other working directories); an --out inside
    a run other than the one what-if reads is refused before anything is written."""
    from osdn_diag.rundir import RunDirectoryError
    from osdn_diag.whatif import what_if_out

    monkeypatch.chdir(run_dir.parent)
    assert main(["what-if", "run", "--eta", "0", "--out", "eta0", "-q"]) == 0
    manifest = json.loads((tmp_path / "eta0" / "manifest.json").read_text())
    assert manifest["source_run"] == str(run_dir.resolve()) and manifest["source_run_id"]
    with pytest.raises(RunDirectoryError, match=r"--out .*inside the run .*eta0, which what-if does not read"):
        what_if_out(run_dir, WhatIf(), tmp_path / "eta0" / "x")


def test_default_outputs_of_settings_that_differ_past_the_rounding_are_two_directories(run_dir):
    """The default --out was named from the settings rounded to 6 digits (``%g``): box bounds 2.0000001
    and 2.0000002 both went to ``what-if_eta0.003_box0.5-2_r1_ba``, the second what-if refused there
    (or, with --overwrite, replacing the first). Each exact setting has its own directory now; settings
    that ``%g`` writes exactly keep their short name."""
    assert WhatIf().name() == "what-if_eta0.003_box0.5-2_r1_ba"
    assert WhatIf(eta=1e-05, retention=0.5, beta_aware=False).name() == "what-if_eta1e-05_box0.5-2_r0.5_nba"
    from osdn_diag.whatif import what_if_run

    for d_max in (2.0000001, 2.0000002):  # `what-if RUN --d-max X` without --out, less the report
        what_if_run(run_dir, WhatIf(d_max=d_max), backend="torch", progress=False)
    outs = sorted(p for p in run_dir.iterdir() if p.name.startswith("what-if_"))
    assert [p.name for p in outs] == ["what-if_eta0.003_box0.5-2.0000001_r1_ba",
                                      "what-if_eta0.003_box0.5-2.0000002_r1_ba"]
    assert [json.loads((p / "manifest.json").read_text())["what_if"]["d_max"] for p in outs] == [2.0000001,
                                                                                                  2.0000002]
    # Exact past %g's 6 digits, and past any fixed count of them: no two settings share a name.
    close = [WhatIf(eta=0.003 + i * 2**-60) for i in range(3)]
    assert len({s.eta for s in close}) == 3 and len({s.name() for s in close}) == 3


def test_minus_zero_settings_have_the_default_output_of_zero():
    """``--retention -0.0`` (a float that equals 0) was named ``…_r-0_ba``, a second default directory
    for the settings of ``--retention 0`` (``…_r0_ba``); ``--eta -0.0`` likewise. Now -0.0 is named 0."""
    assert WhatIf(retention=-0.0).name() == WhatIf(retention=0.0).name() == "what-if_eta0.003_box0.5-2_r0_ba"
    assert WhatIf(eta=-0.0).name() == WhatIf(eta=0.0).name() == "what-if_eta0_box0.5-2_r1_ba"


def test_bad_settings():
    with pytest.raises(ValueError, match="'retention'"):
        WhatIf(retention=1.5)


@pytest.mark.parametrize("preset,family", [("comba-tiny", "comba"), ("gdn2-tiny", "gdn2"),
                                           ("momentum-deltanet-tiny", "momentum_delta_rule"),
                                           ("rwkv7-tiny", "rwkv7")])
def test_refused_for_families_whose_write_is_not_the_delta_rule(preset, family, tmp_path, capsys):
    """Comba, GDN-2, MomentumDeltaNet and RWKV-7 do not write along their read key: swapping in d ⊙ k
    is not their writes under OSDN's d (GDN-2's at η = 0 would not even be the model's own), so
    what-if refuses them on one line, before anything is written. (Reference kernels: a tiny run.)"""
    from osdn_diag.cli import entry

    run = tmp_path / "run"
    assert main(["run", f"random:{preset}", "--prompts", "random", "--num-prompts", "1", "--length", "8",
                 "--out", str(run), "--device", "cpu", "-q"]) == 0
    capsys.readouterr()
    out = tmp_path / "wi"
    assert entry(["what-if", str(run), "--eta", "0", "--out", str(out), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"family {family}" in err and "does not apply" in err, err
    assert not out.exists()


@pytest.mark.parametrize("preset,family", [("gdn2-tiny", "gdn2"), ("rwkv7-tiny", "rwkv7")])
def test_retained_refused_for_those_families(preset, family, tmp_path, capsys):
    """The retention probe replays delta-rule writes along the record's k: for these families that is
    another model's state, so `--retained` is refused on one line rather than reported."""
    from osdn_diag.cli import entry

    run = tmp_path / "run"
    assert main(["run", f"random:{preset}", "--prompts", "random", "--num-prompts", "1", "--length", "8",
                 "--out", str(run), "--device", "cpu", "-q"]) == 0
    capsys.readouterr()
    assert entry(["replay", str(run), "--retained", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"family {family}" in err and "--retained does not apply" in err, err


def test_a_failed_what_if_leaves_no_output_and_the_next_needs_no_overwrite(run_dir, monkeypatch, capsys):
    """A what-if whose replay fails (here after writing its tables) removes what it wrote, manifest
    included, and the directory it made: the next try runs without --overwrite. The source is untouched."""
    import osdn_diag.pipeline as pipeline
    from osdn_diag.cli import entry

    real = pipeline.replay_run
    source = {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

    def failing(*args, **kw):
        real(*args, **kw)
        raise ValueError("the replay refused a call (planted)")

    monkeypatch.setattr(pipeline, "replay_run", failing)
    out = run_dir / WhatIf(eta=0.5).name()
    assert entry(["what-if", str(run_dir), "--eta", "0.5", "-q", "--backend", "torch"]) == 2
    assert "planted" in capsys.readouterr().err
    assert not out.exists()
    assert {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == source
    monkeypatch.setattr(pipeline, "replay_run", real)
    assert main(["what-if", str(run_dir), "--eta", "0.5", "-q", "--backend", "torch"]) == 0
    assert json.loads((out / "manifest.json").read_text())["complete"] is True
