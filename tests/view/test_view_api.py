"""The view from Python and the command line: ``osdn_diag.view`` (callable module), ``Results.view()``,
inline display in Jupyter (``_repr_html_``), saving (atomic, never through a link), ``osdn-diag view``
and its one-line errors (exit 2), and the static report without plotly."""

from __future__ import annotations

import html as htmlmod
import sys

import pytest

import osdn_diag
from _page import page_data
from osdn_diag.cli import entry


def test_view_is_self_contained_and_displays_inline(lm_run, tmp_path):
    v = osdn_diag.view(lm_run)
    page = v.html
    from plotly.offline import get_plotlyjs

    assert get_plotlyjs() in page  # plotly.js itself, inlined
    ours = page.replace(get_plotlyjs(), "")
    assert page.startswith("<!DOCTYPE html>") and "<script src=" not in ours and "<link" not in ours
    assert "http://" not in ours and "https://" not in ours  # nothing fetched
    frame = v._repr_html_()
    assert frame.startswith("<iframe srcdoc=") and htmlmod.escape(page[:200], quote=True) in frame
    assert v.save(tmp_path / "v.html").read_text() == page
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_results_view_in_memory(lm_run):
    res = osdn_diag.Results.load(lm_run)
    data = page_data(res.view(label="mine", strips=1).html)
    assert data["runs"][0]["label"] == "mine" and [s["id"] for s in data["runs"][0]["strips"]] == [0]


def test_save_refuses_a_link_and_a_directory(lm_run, tmp_path):
    v = osdn_diag.view(lm_run, strips=0)
    target = tmp_path / "elsewhere.html"
    target.write_text("theirs")
    (tmp_path / "link.html").symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        v.save(tmp_path / "link.html")
    assert target.read_text() == "theirs"
    with pytest.raises(IsADirectoryError, match="a directory"):
        v.save(tmp_path)


def test_cli_writes_the_view(lm_run, tmp_path, capsys):
    out = tmp_path / "cmp.html"
    assert entry(["view", str(lm_run), str(lm_run), "--labels", "A", "B", "--out", str(out),
                  "--strip-prompts", "1"]) == 0
    assert capsys.readouterr().out.strip() == f"view: {out}"
    data = page_data(out.read_text())
    assert [r["label"] for r in data["runs"]] == ["A", "B"]
    assert [s["id"] for s in data["runs"][0]["strips"]] == [1]


@pytest.mark.parametrize("argv, message", [
    (["view", "{tmp}/missing"], "RUN '{tmp}/missing': no such directory"),
    (["view", "{run}", "{run}"], "argument --out: required for a view of 2 runs"),
    (["view", "{run}", "--labels", "a", "b"], "argument --labels: one label per run"),
    (["view", "{run}", "--strips", "-1"], "argument --strips: expected a number of prompts >= 0"),
    (["view", "{run}", "--strip-prompts", "1,x"], "argument --strip-prompts: expected prompt ids"),
    (["view", "{run}", "--strips", "2", "--strip-prompts", "1"], "either --strips N or --strip-prompts"),
    (["view", "{run}", "--strip-prompts", "7", "--out", "{tmp}/x.html"], "--strip-prompts): no prompt 7"),
    (["view", "{run}", "--out", "{tmp}"], "argument --out '{tmp}': is a directory"),
    (["view", "{run}", "--out", "{tmp}/link.html"], "a symbolic link"),
])
def test_cli_errors_are_one_line(lm_run, tmp_path, capsys, argv, message):
    (tmp_path / "link.html").symlink_to(tmp_path / "nowhere.html")
    fill = (lambda s: s.replace("{run}", str(lm_run)).replace("{tmp}", str(tmp_path)))
    assert entry([fill(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fill(message) in err, err
    assert not (tmp_path / "nowhere.html").exists() and not (tmp_path / "x.html").exists()


@pytest.mark.parametrize("name", ["summary.json", "manifest.json", "capture/batch_00000/layer_000.safetensors",
                                  "capture/batch_00000/notes.html", "plots/q_geo.png", ".osdn-diag.lock"])
def test_an_out_among_a_runs_own_files_is_refused_and_the_run_untouched(lm_run, tmp_path, capsys, name):
    """The page never replaces a file of the run it reads (or of any run), nor lands among them: the
    run stays whole (its replay and report still accept it), refused in one line before anything is
    written; a new file beside them is fine."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(lm_run, run)
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert entry(["view", str(run), "--out", str(run / name), "--strips", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"argument --out {run / name}: " in err, err
    assert f"of the run {run.resolve()}" in err, err
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    with pytest.raises(ValueError, match="of the run"):  # the Python API refuses it as well
        osdn_diag.view(run, strips=0).save(run / name)
    assert entry(["view", str(run), "--out", str(run / "mine.html"), "--strips", "0"]) == 0


def test_the_static_report_needs_no_plotly(lm_run, tmp_path, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "plotly" or m.startswith("plotly.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "plotly", None)  # import plotly now fails, as where it is not installed
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "plotly" else
                        _find_spec(name, *a))
    assert entry(["report", str(lm_run), "--out", str(tmp_path / "rep")]) == 0
    assert (tmp_path / "rep" / "report.md").is_file() and (tmp_path / "rep" / "plots" / "contraction.png").is_file()
    capsys.readouterr()
    assert entry(["view", str(lm_run), "--out", str(tmp_path / "v.html")]) == 2
    assert "needs plotly" in capsys.readouterr().err and not (tmp_path / "v.html").exists()
    with pytest.raises(ImportError, match="osdn-diag\\[view\\]"):
        osdn_diag.view(lm_run)


from importlib.util import find_spec as _find_spec  # noqa: E402  (the real one, kept before it is patched)


def test_a_nonfinite_stream_is_left_out_of_the_strips():
    import math

    import numpy as np
    import pyarrow as pa

    from _synthetic import synthetic_results

    res = synthetic_results(prompts=2, length=16, layers=2, heads=2)
    t = res.table
    col = (lambda name: t.column(name).to_numpy(zero_copy_only=False).copy())
    sel = (col("prompt") == 0) & (col("layer") == 0) & (col("pos") == 3)  # NaN inputs there
    q, lb, fin = col("residual_ratio"), col("loss_before"), col("finite")
    q[sel], lb[sel], fin[sel] = np.nan, np.nan, False
    for name, values in (("residual_ratio", q), ("loss_before", lb), ("finite", fin)):
        t = t.set_column(t.schema.get_field_index(name), name, pa.array(values))
    page = osdn_diag.Results(t, res.summary, res.tokens).view(strips=1).html
    strip = page_data(page)["runs"][0]["strips"][0]
    assert np.isnan(strip["v"]["q"][0, 3]) and np.isnan(strip["v"]["loss_before"][0, 3])  # layer 0: nothing
    keep = (col("prompt") == 0) & (col("pos") == 3) & ~sel  # pooled: layer 1's heads only
    want = math.exp(np.log(q[keep].astype(np.float64)).mean())
    assert strip["v"]["q"][2, 3] == pytest.approx(want, rel=1e-6)
    assert strip["v"]["loss_before"][2, 3] == pytest.approx(lb[keep].astype(np.float64).mean(), rel=1e-6)


def test_a_plotly_that_is_installed_but_does_not_import_is_one_line_and_the_demo_goes_on(lm_run, tmp_path,
                                                                                          monkeypatch, capsys):
    import importlib.util

    for name in [m for m in sys.modules if m == "plotly" or m.startswith("plotly.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "plotly", None)  # import plotly fails...
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "plotly" else
                        _find_spec(name, *a))  # ...where it is found (a broken install)
    assert entry(["view", str(lm_run), "--out", str(tmp_path / "v.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs plotly, which could not be imported" in err
    assert not (tmp_path / "v.html").exists()
    out = tmp_path / "demo"
    assert entry(["demo", "--models", "mqar-deltanet", "--num-prompts", "2", "--out", str(out), "-q"]) == 0
    assert "view.html not written: the interactive view needs plotly" in capsys.readouterr().err
    assert (out / "report" / "report.md").is_file() and not (out / "report" / "view.html").exists()
