"""report.md and plots from run directories (synthetic captures, no model needed)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from osdn_diag.capture import CaptureWriter, KernelCall
from osdn_diag.cli import main
from osdn_diag.math import deltanet, gated_deltanet
from osdn_diag.pipeline import replay_run
from osdn_diag.report import write_report


def _run(path, seed: int, gated: bool, task: str, kernels: str | None = None):
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V = 1, 24, 2, 8, 8
    q, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, V, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    beta = torch.rand(B, T, H, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 0.1 if gated else None
    ref = (gated_deltanet(q, k, v, beta, g) if gated else deltanet(q, k, v, beta)).o
    w = CaptureWriter(path)
    w.begin({"model": {"spec": f"synthetic-{seed}"}, "prompts_source": "test",
             "prompts": [{"id": 0, "task": task, "length": T, "repeat_start": 12}]})
    for layer in range(2):
        w.write(0, [0], KernelCall(layer=layer, layer_name=f"layers.{layer}", family="x", kernel="x",
                                   q=q, k=k, v=v, beta=beta, g=g, o=ref, scale=K**-0.5,
                                   flags={} if kernels is None else {"kernels": kernels}))
    w.finish({"kernels": [kernels or "fla"]})
    replay_run(path, progress=False)
    return path


def test_single_run_report(tmp_path):
    run = _run(tmp_path / "a", 0, gated=True, task="mqar-twice")
    report = write_report([run])
    text = report.read_text()
    assert report == run / "report.md"
    assert "| model | q_geo ↓ | q_arith ↓ | mqar-twice q_geo ↓ | n |" in text
    assert "post-decay" in text and "0.50 (mqar-twice)" in text
    for name in ("contraction", "q_geo", "by_layer", "layer_head"):
        assert (run / "plots" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (run / "plots" / f"{name}.pdf").read_bytes()[:5] == b"%PDF-"
        assert f"plots/{name}.png" in text


def test_side_by_side(tmp_path):
    a = _run(tmp_path / "a", 1, gated=False, task="t1")
    b = _run(tmp_path / "b", 2, gated=False, task="t1")
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "cmp"), "--labels", "DeltaNet", "OSDN"]) == 0
    text = (tmp_path / "cmp" / "report.md").read_text()
    assert "| DeltaNet |" in text and "| OSDN |" in text and "t1 q_geo" in text
    assert "post-decay" not in text


def test_fidelity_is_not_claimed_without_a_live_kernel(tmp_path, capsys):
    """A run whose kernels were the package's own reference has no kernel output to check the replay
    against: summary, report and the command line say "not measured", never a fidelity of 0."""
    ref = _run(tmp_path / "ref", 1, gated=False, task="t1", kernels="reference")
    live = _run(tmp_path / "live", 1, gated=False, task="t1", kernels="fla")
    fid = json.loads((ref / "summary.json").read_text())["fidelity"]
    assert fid["measured"] is False and fid["max_rel_error"] is None
    assert fid["against_by_layer"] == {"000": "reference", "001": "reference"}
    fid = json.loads((live / "summary.json").read_text())["fidelity"]
    assert fid["measured"] is True and fid["max_rel_error"] == max(fid["by_layer"].values()) <= 1e-5
    text = write_report([ref, live], tmp_path / "cmp", ["ref", "live"]).read_text()
    ref_row = next(line for line in text.splitlines() if line.startswith("| ref |") and "reference" in line)
    live_row = next(line for line in text.splitlines() if line.startswith("| live |") and "fla" in line)
    assert ref_row.count("not measured (reference kernels)") == 2  # output and final state
    assert "not measured" not in live_row and re.search(r"\| \d\.\de[+-]\d\d \|", live_row), live_row
    assert main(["replay", str(ref)]) == 0
    assert "fidelity: not measured (reference kernels" in capsys.readouterr().out


def test_runs_on_different_prompts_are_not_compared(tmp_path):
    a = _run(tmp_path / "a", 1, gated=False, task="t1")
    b = _run(tmp_path / "b", 2, gated=False, task="t2")
    with pytest.raises(ValueError, match="different prompts \\(prompt 0: task 't1' vs 't2'\\)"):
        write_report([a, b], tmp_path / "cmp")


def test_the_first_difference_between_two_runs_prompts_is_named():
    from osdn_diag.report.markdown import _prompt_difference

    a = [("t", 8, -1), ("t", 8, -1)]
    assert _prompt_difference(a, a[:1]) == "2 vs 1 prompts"
    assert _prompt_difference(a, [("t", 8, -1), ("t", 16, 8)]) == "prompt 1: length 8 vs 16, repeat start -1 vs 8"


def test_missing_column_is_named(tmp_path):
    import pyarrow.parquet as pq

    a = _run(tmp_path / "a", 1, gated=False, task="t1")
    table = pq.read_table(a / "residuals.parquet").drop_columns(["write_gain"])
    pq.write_table(table, a / "residuals.parquet")
    with pytest.raises(ValueError, match="missing column\\(s\\) write_gain"):
        write_report([a])


def test_report_errors(tmp_path):
    a = _run(tmp_path / "a", 3, gated=False, task="t")
    with pytest.raises(ValueError, match="'out_dir'"):
        write_report([a, a])
    with pytest.raises(ValueError, match="expected 1 labels"):
        write_report([a], labels=["x", "y"])
    (a / "summary.json").unlink()
    with pytest.raises(FileNotFoundError, match="summary.json"):
        write_report([a])


@pytest.mark.parametrize("blocker", ["plots/q_geo.png/", "report.md/", "plots"])
def test_a_refused_report_leaves_the_run_and_its_report_as_they_were(tmp_path, blocker):
    """A name the report cannot write (a directory where a figure or report.md goes, a file where plots/
    goes) is refused before the old report is removed or the report stage started."""
    run = _run(tmp_path / "a", 4, gated=False, task="t")
    write_report([run])
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is True
    target = run / blocker.rstrip("/")
    if target.is_dir():
        import shutil

        shutil.rmtree(target)
    else:
        target.unlink(missing_ok=True)
    if blocker.endswith("/"):
        (target / "mine").mkdir(parents=True)
    else:
        target.write_text("mine")
    before = {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    with pytest.raises((IsADirectoryError, NotADirectoryError), match=f"{target}: (a directory|not a directory)"):
        write_report([run])
    assert json.loads((run / "manifest.json").read_text()) == manifest  # still complete, report stage done
    after = {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    assert after == before


def test_d_trajectory_of_a_chosen_head(tmp_path):
    from osdn_diag.math import osdn, osdn_phase1

    gen = torch.Generator().manual_seed(5)
    B, T, H, K = 1, 16, 2, 4
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    q, v, beta = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen), torch.rand(B, T, H, generator=gen)
    d = osdn_phase1(k, beta, eta=0.5).d
    w = CaptureWriter(tmp_path / "r")
    w.begin({"prompts": [{"id": 0, "task": "t", "length": T, "repeat_start": -1}]})
    for layer in range(2):
        w.write(0, [0], KernelCall(layer=layer, layer_name=f"l{layer}", family="osdn", kernel="x", q=q, k=k,
                                   v=v, beta=beta, d=d, o=osdn(q, k, v, beta, d).o, scale=K**-0.5))
    w.finish()
    replay_run(tmp_path / "r", progress=False)
    assert main(["report", str(tmp_path / "r"), "--d-head", "1.1"]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert "plots/d_trajectory.png" in text and (tmp_path / "r" / "plots" / "d_trajectory.png").is_file()
    with pytest.raises(ValueError, match="'d_head': layer 1 has 2 heads"):
        write_report([tmp_path / "r"], d_head=(1, 5))
    with pytest.raises(ValueError, match="LAYER.HEAD"):  # a user error: one line and status 2 from the CLI
        main(["report", str(tmp_path / "r"), "--d-head", "x"])


def test_labels_no_font_has_are_named_once_and_a_font_that_has_them_is_used(tmp_path, capsys, monkeypatch):
    """Run labels in a script the default font lacks (CJK here, where no CJK font is installed): the
    report says once which characters show as boxes and what to install, instead of one matplotlib
    warning per character and file; with a font installed that has them (STIXGeneral stands in, for
    symbols DejaVu Sans lacks) it is used and nothing is said."""
    import warnings

    from osdn_diag.report import plots

    a = _run(tmp_path / "a", 1, gated=False, task="t1")
    monkeypatch.setenv("OSDN_DIAG_REPORT_WORKERS", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a glyph warning of matplotlib's own would fail the report
        assert main(["report", str(a), str(a), "--out", str(tmp_path / "cmp"), "--labels", "中文", "x⌒"]) == 0
    err = capsys.readouterr().err
    assert err.count("note: ") == 1 and "3 characters of the plots' labels (⌒, 中, 文)" in err, err
    assert "fonts-noto-cjk" in err
    monkeypatch.setattr(plots, "FALLBACK_FONTS", ("STIXGeneral",))
    assert main(["report", str(a), str(a), "--out", str(tmp_path / "cmp2"), "--labels", "y⌒", "x⌒"]) == 0
    assert "note: " not in capsys.readouterr().err
    missing: set[str] = set()
    monkeypatch.setattr(plots, "FALLBACK_FONTS", ())
    with plots.label_fonts(missing):
        plots.save_as(plots.plot_q_bars([("x⌒", json.loads((a / "summary.json").read_text()))]), tmp_path / "q.png")
    assert missing == {"⌒"}
