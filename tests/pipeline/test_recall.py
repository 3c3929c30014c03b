"""Recall accuracy of recall prompts, measured on the captured forward pass (Table 7's column).

Kernels: the default ``kernels="auto"``, so on a CPU the reference recurrence stands in for fla's kernel;
test_fla_kernels_e2e.py runs fla's own kernels end to end.
"""

from __future__ import annotations

import json

import pytest
import torch

from osdn_diag.cli import main
from osdn_diag.pipeline import _recall_hits, recall_table
from osdn_diag.prompts import MQARSpec, mqar_pair_prompts


def _one_hot_logits(prompts, vocab, shift=0):
    """Logits whose argmax at every query position is the answer (+ ``shift``, mod vocab)."""
    width = max(len(p) for p in prompts)
    logits = torch.zeros(len(prompts), width, vocab)
    for row, p in enumerate(prompts):
        for pos, ans in zip(p.meta["answer_positions"], p.meta["answers"]):
            logits[row, pos, (ans + shift) % vocab] = 1.0
    return logits


def test_hits_count_oracle_and_wrong_answers():
    spec = MQARSpec(vocab_size=64, num_pairs=6, num_queries=4)
    prompts = mqar_pair_prompts(spec, num_prompts=3, seed=0)
    assert _recall_hits(prompts, _one_hot_logits(prompts, 64)) == {p.id: (4, 4, 0) for p in prompts}
    assert _recall_hits(prompts, _one_hot_logits(prompts, 64, shift=1)) == {p.id: (0, 4, 0) for p in prompts}
    # One wrong answer in one prompt: 3 of 4.
    logits = _one_hot_logits(prompts, 64)
    p = prompts[1]
    pos, ans = p.meta["answer_positions"][2], p.meta["answers"][2]
    logits[1, pos, ans] = 0.0
    logits[1, pos, (ans + 5) % 64] = 1.0
    assert _recall_hits(prompts, logits)[p.id] == (3, 4, 0)
    # NaN logits at a query: excluded, neither right nor wrong (NaN would win the argmax).
    logits[1, pos, (ans + 5) % 64] = float("nan")
    logits[1, p.meta["answer_positions"][0], 3] = float("inf")
    assert _recall_hits(prompts, logits)[p.id] == (2, 2, 2)


def test_prompts_without_answers_are_skipped():
    from osdn_diag.prompts import random_suite

    prompts = random_suite(num_prompts=2, length=10, vocab_size=32, seed=0, twice=False)
    assert _recall_hits(prompts, torch.zeros(2, 10, 32)) == {}
    assert recall_table({"prompts": [p.manifest_entry() for p in prompts]}) == {}


def test_table_is_query_weighted_per_task():
    manifest = {"prompts": [
        {"task": "mqar", "recall_correct": 1, "recall_queries": 4},
        {"task": "mqar", "recall_correct": 4, "recall_queries": 4},
        {"task": "mqar-twice", "recall_correct": 0, "recall_queries": 2},
    ]}
    table = recall_table(manifest)
    assert table["mqar"] == {"accuracy": 5 / 8, "correct": 5, "queries": 8, "excluded_nonfinite": 0,
                             "prompts": 2}
    assert table["mqar-twice"]["accuracy"] == 0.0


def test_no_accuracy_without_a_finite_query():
    manifest = {"prompts": [{"task": "mqar", "recall_correct": 0, "recall_queries": 0, "recall_excluded": 4},
                            {"task": "mqar-twice", "recall_correct": 1, "recall_queries": 2, "recall_excluded": 2}]}
    table = recall_table(manifest)
    assert table["mqar"]["accuracy"] is None and table["mqar"]["excluded_nonfinite"] == 4
    assert table["mqar-twice"]["accuracy"] == 0.5 and table["mqar-twice"]["excluded_nonfinite"] == 2


def test_run_on_mqar_pair_reports_recall_per_task(tmp_path):
    argv = ["run", "random:deltanet-tiny", "--prompts", "mqar-pair", "--num-prompts", "2",
            "--length", "16", "--batch-size", "2", "--out", str(tmp_path), "-q"]
    assert main(argv) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [p["task"] for p in manifest["prompts"]] == ["mqar", "mqar", "mqar-twice", "mqar-twice"]
    assert all(p["recall_queries"] == 4 for p in manifest["prompts"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["recall"]) == {"mqar", "mqar-twice"}
    for task, row in summary["recall"].items():
        assert row["queries"] == 8 and 0.0 <= row["accuracy"] <= 1.0
        assert row["accuracy"] == pytest.approx(row["correct"] / 8)
    report = (tmp_path / "report.md").read_text()
    assert "## Recall accuracy (the paper's Table 7 layout)" in report


def test_jsonl_prompts_with_answers_report_recall(tmp_path, fla_interpreter):
    """A user's JSONL prompts carrying answers get recall accuracy, once and ``--twice``. The answers
    are written from the model's own next-token argmax (a forward pass of the same seeded model
    without capture, here) — right at some positions, one id off at others — so the count of right
    answers is known before the run."""
    from osdn_diag.models import load_model

    model = load_model("random:deltanet-tiny").model
    vocab = model.config.vocab_size
    prompts = [([3, 7, 11, 19, 23, 5], [7, 19], [6, 7, 2], [True, False, True]),
               ([2, 4, 6, 8], [], [0, 1], [False, True])]
    for twice in (False, True):
        rows = []
        for ctx, query, positions, right in prompts:
            ids, shift = (ctx + ctx + query, len(ctx)) if twice else (ctx + query, 0)
            with torch.no_grad():
                pred = model(torch.tensor([ids])).logits[0].argmax(-1)
            answers = [int(pred[p + shift]) if ok else (int(pred[p + shift]) + 1) % vocab
                       for p, ok in zip(positions, right)]
            rows.append({"input_ids": ctx, "query_ids": query, "answer_positions": positions,
                         "answers": answers, "task": "kv"})
        path = tmp_path / f"kv-{twice}.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        out = tmp_path / f"run-{twice}"
        assert main(["run", "random:deltanet-tiny", "--prompts", str(path), "--out", str(out), "-q",
                     *(["--twice"] if twice else [])]) == 0
        recall = json.loads((out / "summary.json").read_text())["recall"]
        assert recall["kv"]["queries"] == 5 and recall["kv"]["correct"] == 3, recall
        assert recall["kv"]["accuracy"] == pytest.approx(3 / 5)
