"""``osdn-diag demo --lm``: the built-in language models on held-out text, shortened to one window of 64
tokens per model (single and twice; ~13 s on a CPU), and the demo's refusals around ``--lm``.

Every number of the printed table is recomputed here from the run directories' own files:
``residuals.parquet`` for q (docs/metrics.md, "Aggregates": over the finite rows, q_geo =
exp(mean log max(q, 1e-30)), q_arith = mean q) and the manifest's prompt entries for perplexity
(docs/metrics.md, "Recall accuracy": per task exp(Σ recall_nll / Σ recall_queries)).
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest

from osdn_diag.cli import entry, main
from osdn_diag.demo import run_demo
from osdn_diag.prompts.lm import heldout_windows
from _demo_table import printed_table

# Spelled out (not imported from osdn_diag.demo) so that the test fails if the demo's models change.
MODELS = {"lm-deltanet": "DeltaNet", "lm-osdn": "OSDN", "lm-osdn-apf": "OSDN-APF"}
TASKS = ["lm-heldout", "lm-heldout-twice"]
LENGTH = 64
FLOOR = 1e-30


@pytest.fixture(scope="module")
def demo(tmp_path_factory, fla_interpreter):
    """``osdn-diag demo --lm --num-prompts 1 --length 64 -q`` once: (out dir, exit code, stdout)."""
    out = tmp_path_factory.mktemp("demo-lm")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["demo", "--lm", "--out", str(out), "--num-prompts", "1", "--length", str(LENGTH), "-q"])
    return out, rc, buf.getvalue()


def _manifest(run_dir):
    return json.loads((run_dir / "manifest.json").read_text())


def _q_geo(q: np.ndarray) -> float:
    return math.exp(float(np.mean(np.log(np.maximum(q, FLOOR)))))


def _recomputed(run_dir) -> dict:
    """The table's numbers of one run, from residuals.parquet and the manifest alone."""
    t = pq.read_table(run_dir / "residuals.parquet").to_pydict()
    q = np.asarray(t["residual_ratio"], dtype=np.float64)
    task = np.asarray(t["task"])
    keep = np.asarray(t["finite"], dtype=bool) if "finite" in t else np.ones(len(q), dtype=bool)
    row = {"q_geo": _q_geo(q[keep]), "q_arith": float(np.mean(q[keep]))}
    for name in TASKS:
        row[f"q_geo {name}"] = _q_geo(q[keep & (task == name)])
    prompts = _manifest(run_dir)["prompts"]
    for name in TASKS:
        mine = [p for p in prompts if p["task"] == name]
        row[f"ppl {name}"] = math.exp(sum(p["recall_nll"] for p in mine) / sum(p["recall_queries"] for p in mine))
    return row


def test_demo_lm_runs_every_language_model_on_the_same_heldout_window(demo):
    out, rc, _ = demo
    assert rc == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted([*MODELS, "report"])
    (doc, start, window), = heldout_windows(num_prompts=1, length=LENGTH, seed=0)
    for name in MODELS:
        manifest = _manifest(out / name)
        assert manifest["complete"] is True and manifest["model"]["spec"] == f"builtin:{name}"
        assert manifest["prompts_source"] == "lm-heldout-pair"
        single, twice = manifest["prompts"]
        assert (single["task"], single["length"], single["repeat_start"]) == ("lm-heldout", LENGTH, -1)
        assert (twice["task"], twice["length"], twice["repeat_start"]) == ("lm-heldout-twice", 2 * LENGTH, LENGTH)
        for p in (single, twice):
            assert (p["document"], p["start"], p["answers"]) == (doc, start, window[1:])
            assert p["scoring"] == "next-token" and p["recall_queries"] == LENGTH - 1
        summary = json.loads((out / name / "summary.json").read_text())
        assert {t: v["scoring"] for t, v in summary["recall"].items()} == dict.fromkeys(TASKS, "next-token")


def test_demo_lm_printed_table_is_recomputed_from_the_run_files(demo):
    out, _, stdout = demo
    head, body = printed_table(stdout)
    columns = ["q_geo", "q_arith", *(f"q_geo {t}" for t in TASKS), *(f"ppl {t}" for t in TASKS)]
    assert head.split() == ["model", *" ".join(columns).split()]
    assert [r[0] for r in body] == list(MODELS.values())
    for row, name in zip(body, MODELS):
        want = _recomputed(out / name)
        got = dict(zip(columns, map(float, row[1:]), strict=True))
        for col in columns:
            # printed with 4 decimals (q) or 2 (ppl): half a unit of the last digit, and a little more
            tol = 6e-3 if col.startswith("ppl") else 6e-5
            assert got[col] == pytest.approx(want[col], abs=tol), (name, col)
        # repeating the window helps every trained model: the twice perplexity is the lower one
        assert want["ppl lm-heldout-twice"] < want["ppl lm-heldout"], name
    lines = stdout.splitlines()
    assert any("ppl: held-out perplexity" in ln for ln in lines)
    assert f"report: {out / 'report' / 'report.md'}" in lines
    assert not any(ln.startswith("[lm-") for ln in lines)  # -q: no progress lines


def test_demo_lm_refuses_length_without_lm(tmp_path, capsys):
    assert entry(["demo", "--length", "64", "--out", str(tmp_path / "d"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("osdn-diag: error:")
    assert "--length" in err and "--lm" in err
    assert not (tmp_path / "d").exists()
    with pytest.raises(ValueError, match="length"):
        run_demo(tmp_path / "d", length=64, progress=False)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("n", ["0", "-2"])
def test_demo_lm_refuses_num_prompts_below_one(tmp_path, capsys, n):
    assert entry(["demo", "--lm", "--num-prompts", n, "--out", str(tmp_path / "d"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--num-prompts" in err
    with pytest.raises(ValueError, match="num_prompts"):
        run_demo(tmp_path / "d", lm=True, num_prompts=int(n), progress=False)
    assert not (tmp_path / "d").exists()


def test_demo_lm_refuses_a_length_below_two(tmp_path, capsys):
    assert entry(["demo", "--lm", "--length", "1", "--out", str(tmp_path / "d"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--length" in err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("args, model, says", [
    (["--lm"], "mqar-osdn", ["suite 'mqar'", "expected 'lm-heldout'", "lm-*"]),
    ([], "lm-osdn", ["suite 'lm-heldout'", "expected 'mqar'", "--lm"]),
], ids=["mqar-model-to-lm-demo", "lm-model-to-mqar-demo"])
def test_demo_refuses_a_model_of_the_other_suite(tmp_path, capsys, args, model, says):
    assert entry(["demo", *args, "--models", model, "--out", str(tmp_path / "d"), "--num-prompts", "1", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("osdn-diag: error:")
    assert model in err
    for text in says:
        assert text in err, (text, err)
    assert not (tmp_path / "d").exists()  # refused before any model ran


@pytest.mark.parametrize("args, out", [(["--lm"], "osdn-demo-lm"), ([], "osdn-demo")])
def test_demo_default_out(tmp_path, monkeypatch, args, out):
    """The default --out (no demo is run: run_demo is replaced by a stand-in that records its call)."""
    import osdn_diag.demo

    calls = []

    def record(out_dir, **kw):
        calls.append((out_dir, kw))
        return tmp_path / out_dir / "report" / "report.md", []

    monkeypatch.setattr(osdn_diag.demo, "run_demo", record)
    monkeypatch.chdir(tmp_path)
    assert main(["demo", *args, "-q"]) == 0
    (out_dir, kw), = calls
    assert out_dir == out and kw["lm"] is bool(args) and kw["length"] is None
