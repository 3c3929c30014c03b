"""Held-out text runs (``lm-heldout-pair``): every number summary.json and report.md state about them —
per-prompt ``recall_nll``, per-task ``nll``, ``perplexity`` and next-token ``accuracy`` — recomputed
here from a forward pass of the same model outside capture and ``torch.nn.functional.cross_entropy``.

The corpus is synthetic (written by this file, the shipped format of osdn_diag/prompts/corpus.py), and
the suite is pointed at it by replacing ``corpus.CORPUS_DIR``. The targets are taken from the
definition, not from the prompts' meta: a single prompt is the window ``w`` and its logits at
``0 … L-2`` predict ``w[1:]``; a twice prompt is ``w + w`` and its logits at ``L … 2L-2`` predict
``w[1:]``. Kernels: the run keeps ``kernels="auto"`` (on a CPU the reference recurrence stands in for
fla's kernel), the forward pass here runs fla's kernels under Triton's interpreter, so the two agree to
fp32 rounding, not exactly: the likelihoods are compared to 1e-4 relative.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.numpy import save_file

from osdn_diag.cli import main
from osdn_diag.prompts import corpus
from osdn_diag.report.markdown import _recall_table, _text_table
from _markdown import table_after as _table_after

MODELS = {"dn": "random:deltanet-tiny", "gdn": "random:gated-deltanet-tiny"}
VOCAB = 256  # the tiny presets' vocabulary (osdn_diag/catalog/presets.py)
NUM_PROMPTS, LENGTH = 2, 12
HEADING = "Held-out text: perplexity and next-token accuracy (the paper's Table 7 layout)"


def _corpus(directory):
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, VOCAB, n).tolist() for n in (40, 9, 25, 16, 60, 30)]
    directory.mkdir()
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(d) for d in docs])
    save_file({"tokens": np.concatenate([np.asarray(d, dtype=np.int16) for d in docs]), "offsets": offsets},
              str(directory / "heldout.safetensors"))
    (directory / "corpus.json").write_text(json.dumps({"vocab_size": VOCAB, "heldout_tokens": int(offsets[-1])}))
    return docs


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fla_interpreter):
    root = tmp_path_factory.mktemp("text_report")
    docs = _corpus(root / "lm-corpus")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus, "CORPUS_DIR", root / "lm-corpus")
        for name, model in MODELS.items():
            run_dir = root / name
            assert main(["run", model, "--prompts", "lm-heldout-pair", "--num-prompts", str(NUM_PROMPTS),
                         "--length", str(LENGTH), "--batch-size", "2", "--out", str(run_dir), "-q"]) == 0
            out[name] = {"dir": run_dir, "manifest": json.loads((run_dir / "manifest.json").read_text()),
                         "summary": json.loads((run_dir / "summary.json").read_text()),
                         "report": (run_dir / "report.md").read_text(), "label": model}
    compare = root / "compare"
    assert main(["report", *(str(out[n]["dir"]) for n in MODELS), "--out", str(compare),
                 "--labels", *MODELS]) == 0
    return docs, out, (compare / "report.md").read_text()


def _expected(docs, run) -> tuple[dict, dict]:
    """Per prompt ``(nll sum, right, tokens)``, and per task ``{nll, perplexity, accuracy, correct,
    queries}``, from the model's own forward pass (the prompts of one task in one batch: they have
    one length, so nothing is padded)."""
    from osdn_diag.models import load_model

    model = load_model(run["label"]).model
    per_prompt, per_task = {}, {}
    for task in ("lm-heldout", "lm-heldout-twice"):
        prompts = [p for p in run["manifest"]["prompts"] if p["task"] == task]
        windows = [docs[p["document"]][p["start"]:p["start"] + LENGTH] for p in prompts]
        twice = task == "lm-heldout-twice"
        with torch.no_grad():
            logits = model(torch.tensor([w + w if twice else w for w in windows])).logits.double()
        for p, window, row in zip(prompts, windows, logits):
            at = row[LENGTH:2 * LENGTH - 1] if twice else row[:LENGTH - 1]
            targets = torch.tensor(window[1:])
            nll = F.cross_entropy(at, targets, reduction="sum").item()
            right = int((at.argmax(-1) == targets).sum())
            per_prompt[p["id"]] = (nll, right, LENGTH - 1)
            acc = per_task.setdefault(task, [0.0, 0, 0])
            acc[0] += nll
            acc[1] += right
            acc[2] += LENGTH - 1
    tasks = {t: {"nll": s / n, "perplexity": math.exp(s / n), "accuracy": c / n, "correct": c, "queries": n}
             for t, (s, c, n) in per_task.items()}
    return per_prompt, tasks


@pytest.fixture(scope="module")
def expected(runs):
    docs, out, _ = runs
    return {name: _expected(docs, run) for name, run in out.items()}


def _printed(cell: str, reported: float, expected: float, digits: int) -> None:
    """The cell is the summary's value rounded, and within a rounding step of the recomputed one."""
    assert cell == f"{reported:.{digits}f}", (cell, reported)
    assert abs(float(cell) - expected) <= 0.51 * 10 ** -digits + 1e-4 * abs(expected), (cell, expected)


@pytest.mark.parametrize("name", list(MODELS))
def test_manifest_and_summary_numbers(runs, expected, name):
    run = runs[1][name]
    per_prompt, tasks = expected[name]
    for p in run["manifest"]["prompts"]:
        nll, right, n = per_prompt[p["id"]]
        assert p["scoring"] == "next-token"
        assert p["recall_queries"] == n and "recall_excluded" not in p
        assert p["recall_correct"] == right, p["id"]
        assert p["recall_nll"] == pytest.approx(nll, rel=1e-4), p["id"]
    recall = run["summary"]["recall"]
    assert set(recall) == {"lm-heldout", "lm-heldout-twice"}
    for task, exp in tasks.items():
        got = recall[task]
        assert got["scoring"] == "next-token" and got["prompts"] == NUM_PROMPTS
        assert (got["correct"], got["queries"], got["excluded_nonfinite"]) == (exp["correct"], exp["queries"], 0)
        assert got["accuracy"] == pytest.approx(exp["accuracy"], rel=1e-12)
        assert got["nll"] == pytest.approx(exp["nll"], rel=1e-4)
        assert got["perplexity"] == pytest.approx(exp["perplexity"], rel=1e-4)
        assert got["perplexity"] == pytest.approx(math.exp(got["nll"]), rel=1e-12)
    # a random model on random tokens: about as unsure as uniform over its vocabulary
    assert 0.5 * VOCAB < recall["lm-heldout"]["perplexity"] < 2 * VOCAB


def _check_text_table(report, labels, expected_by_label, summaries):
    header, rows = _table_after(report, HEADING)
    tasks = ["lm-heldout", "lm-heldout-twice"]
    assert header == ["model", *[f"{t} perplexity ↓" for t in tasks], *[f"{t} accuracy ↑" for t in tasks], "tokens"]
    assert [r[0] for r in rows] == labels
    for row, label in zip(rows, labels):
        exp, rec = expected_by_label[label], summaries[label]["recall"]
        for i, t in enumerate(tasks):
            _printed(row[1 + i], rec[t]["perplexity"], exp[t]["perplexity"], 2)
            _printed(row[3 + i], rec[t]["accuracy"], exp[t]["accuracy"], 3)
        assert row[5] == f"{2 * NUM_PROMPTS * (LENGTH - 1):,}"


def test_report_prints_those_numbers(runs, expected):
    _, out, compare = runs
    for name, run in out.items():
        _check_text_table(run["report"], [run["label"]], {run["label"]: expected[name][1]},
                          {run["label"]: run["summary"]})
        # no recall task: no recall table
        assert "## Recall accuracy" not in run["report"]
    # the comparison: one row per model, under its label
    _check_text_table(compare, list(MODELS), {n: expected[n][1] for n in MODELS},
                      {n: out[n]["summary"] for n in MODELS})


def test_tables_split_text_from_recall_tasks():
    """A summary's recall tasks go to the recall table, its text tasks to the text table; a summary
    written before ``scoring`` and ``nll`` existed is a recall one; "–" where nothing was scored."""
    old = {"recall": {"mqar": {"accuracy": 0.5, "correct": 2, "queries": 4, "excluded_nonfinite": 0, "prompts": 1}}}
    text = {"recall": {
        "lm-heldout": {"accuracy": 0.25, "correct": 1, "queries": 4, "excluded_nonfinite": 0, "prompts": 1,
                       "nll": 2.0, "perplexity": math.exp(2.0), "scoring": "next-token"},
        "lm-heldout-twice": {"accuracy": None, "correct": 0, "queries": 0, "excluded_nonfinite": 4, "prompts": 1,
                             "nll": None, "perplexity": None, "scoring": "next-token"}}}
    runs = [("old", {}, old), ("new", {}, text)]
    assert _recall_table(runs).splitlines() == [
        "| model | mqar accuracy ↑ | queries |", "|---|---|---|", "| old | 0.500 | 4 |", "| new | – | 0 |"]
    assert _text_table(runs).splitlines() == [
        "| model | lm-heldout perplexity ↓ | lm-heldout-twice perplexity ↓ | lm-heldout accuracy ↑ | "
        "lm-heldout-twice accuracy ↑ | tokens |",
        "|---|---|---|---|---|---|",
        "| old | – | – | – | – | 0 |",
        "| new | 7.39 | – | 0.250 | – | 4 (+4 excluded: NaN/Inf logits) |"]
    assert _text_table([("old", {}, old)]) is None
    assert _recall_table([("new", {}, text)]) is None
