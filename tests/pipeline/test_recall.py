"""Recall accuracy of recall prompts, and the negative log-likelihood of their answers, measured on the
captured forward pass (Table 7's column). The likelihood is checked against
``torch.nn.functional.cross_entropy`` in fp64 on logits this file builds.

Kernels: the default ``kernels="auto"``, so on a CPU the reference recurrence stands in for fla's kernel;
test_fla_kernels_e2e.py runs fla's own kernels end to end.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from osdn_diag.cli import main
from osdn_diag.pipeline.recall import _recall_hits, recall_table
from osdn_diag.prompts import MQARSpec, mqar_pair_prompts


def _one_hot_logits(prompts, vocab, shift=0):
    """Logits whose argmax at every query position is the answer (+ ``shift``, mod vocab)."""
    width = max(len(p) for p in prompts)
    logits = torch.zeros(len(prompts), width, vocab)
    for row, p in enumerate(prompts):
        for pos, ans in zip(p.meta["answer_positions"], p.meta["answers"]):
            logits[row, pos, (ans + shift) % vocab] = 1.0
    return logits


def _counts(hits):
    """``(correct, queries, excluded)`` of every prompt, without the nll."""
    return {k: v[:3] for k, v in hits.items()}


def test_hits_count_oracle_and_wrong_answers():
    spec = MQARSpec(vocab_size=64, num_pairs=6, num_queries=4)
    prompts = mqar_pair_prompts(spec, num_prompts=3, seed=0)
    assert _counts(_recall_hits(prompts, _one_hot_logits(prompts, 64))) == {p.id: (4, 4, 0) for p in prompts}
    assert _counts(_recall_hits(prompts, _one_hot_logits(prompts, 64, shift=1))) == {p.id: (0, 4, 0) for p in prompts}
    # One wrong answer in one prompt: 3 of 4.
    logits = _one_hot_logits(prompts, 64)
    p = prompts[1]
    pos, ans = p.meta["answer_positions"][2], p.meta["answers"][2]
    logits[1, pos, ans] = 0.0
    logits[1, pos, (ans + 5) % 64] = 1.0
    assert _recall_hits(prompts, logits)[p.id][:3] == (3, 4, 0)
    # NaN logits at a query: excluded, neither right nor wrong (NaN would win the argmax).
    logits[1, pos, (ans + 5) % 64] = float("nan")
    logits[1, p.meta["answer_positions"][0], 3] = float("inf")
    assert _recall_hits(prompts, logits)[p.id][:3] == (2, 2, 2)


def test_prompts_without_answers_are_skipped():
    from osdn_diag.prompts import random_suite

    prompts = random_suite(num_prompts=2, length=10, vocab_size=32, seed=0, twice=False)
    assert _recall_hits(prompts, torch.zeros(2, 10, 32)) == {}
    assert recall_table({"prompts": [p.manifest_entry() for p in prompts]}) == {}


def _expected_nll(logits_row: torch.Tensor, prompt) -> float:
    """Σ −log softmax at the answer positions whose logits are all finite, by torch's cross entropy in
    fp64."""
    at = logits_row[prompt.meta["answer_positions"]].double()
    keep = torch.isfinite(at).all(-1)
    answers = torch.tensor(prompt.meta["answers"])[keep]
    return F.cross_entropy(at[keep], answers, reduction="sum").item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nll_is_the_cross_entropy_of_the_answers(dtype):
    spec = MQARSpec(vocab_size=64, num_pairs=6, num_queries=5)
    prompts = mqar_pair_prompts(spec, num_prompts=2, seed=1)
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(len(prompts), max(len(p) for p in prompts), 64, generator=gen)).to(dtype)
    # NaN and Inf at two queries of prompt 1, NaN at a position that is not a query of prompt 0.
    logits[1, prompts[1].meta["answer_positions"][0], 7] = float("nan")
    logits[1, prompts[1].meta["answer_positions"][3], 2] = float("-inf")
    logits[0, 0, 0] = float("nan")
    hits = _recall_hits(prompts, logits)
    for row, p in enumerate(prompts):
        expected = _expected_nll(logits[row], p)
        assert expected > 0
        assert hits[p.id][3] == pytest.approx(expected, rel=1e-6, abs=0), p.id
    assert hits[prompts[1].id][1:3] == (3, 2)
    # A sure right answer costs nothing; a sure wrong one its logit gap.
    sure = _one_hot_logits(prompts, 64) * 100.0
    assert all(v[3] == pytest.approx(0.0, abs=1e-30) for v in _recall_hits(prompts, sure).values())
    wrong = _recall_hits(prompts, _one_hot_logits(prompts, 64, shift=1) * 30.0)
    for p in prompts:  # -log(e^0 / (e^30 + 63 e^0)) per query
        assert wrong[p.id][3] == pytest.approx(len(p.meta["answers"]) * math.log(math.exp(30.0) + 63), rel=1e-6)


def test_table_is_query_weighted_per_task():
    manifest = {"prompts": [
        {"task": "mqar", "recall_correct": 1, "recall_queries": 4, "recall_nll": 2.0},
        {"task": "mqar", "recall_correct": 4, "recall_queries": 4, "recall_nll": 1.5},
        {"task": "mqar-twice", "recall_correct": 0, "recall_queries": 2, "recall_nll": 9.0},
        {"task": "text", "recall_correct": 3, "recall_queries": 7, "recall_excluded": 1, "recall_nll": 21.0,
         "scoring": "next-token"},
    ]}
    table = recall_table(manifest)
    assert table["mqar"] == {"accuracy": 5 / 8, "correct": 5, "queries": 8, "excluded_nonfinite": 0,
                             "prompts": 2, "nll": 3.5 / 8, "perplexity": math.exp(3.5 / 8), "scoring": "recall"}
    assert table["mqar-twice"]["accuracy"] == 0.0 and table["mqar-twice"]["nll"] == 4.5
    assert table["text"] == {"accuracy": 3 / 7, "correct": 3, "queries": 7, "excluded_nonfinite": 1,
                             "prompts": 1, "nll": 3.0, "perplexity": math.exp(3.0), "scoring": "next-token"}


def test_older_manifests_have_no_nll():
    """A manifest written before ``recall_nll`` was recorded reads as before, nll and perplexity None;
    a task where only some prompts have it too (its mean would be over part of the queries)."""
    table = recall_table({"prompts": [
        {"task": "mqar", "recall_correct": 1, "recall_queries": 4},
        {"task": "mix", "recall_correct": 1, "recall_queries": 4, "recall_nll": 1.0},
        {"task": "mix", "recall_correct": 1, "recall_queries": 4}]})
    assert table["mqar"] == {"accuracy": 0.25, "correct": 1, "queries": 4, "excluded_nonfinite": 0, "prompts": 1,
                             "nll": None, "perplexity": None, "scoring": "recall"}
    assert table["mix"]["nll"] is None and table["mix"]["perplexity"] is None
    # A huge mean nll: the perplexity overflows a double, and is written null.
    big = recall_table({"prompts": [{"task": "t", "recall_correct": 0, "recall_queries": 1, "recall_nll": 800.0}]})
    assert big["t"]["nll"] == 800.0 and big["t"]["perplexity"] == math.inf


def test_manifest_entries_carry_the_nll_and_read_older_rank_records():
    """The manifest's prompt entries get ``recall_nll``; hits of three numbers (a rank record written
    before the nll was recorded, read back when a run resumes) give entries without it."""
    from osdn_diag.pipeline.session import _CaptureSession

    spec = MQARSpec(vocab_size=64, num_pairs=3, num_queries=2)
    session = _CaptureSession.__new__(_CaptureSession)
    session.prompts = mqar_pair_prompts(spec, num_prompts=1, seed=0)
    session.hits = {0: (1, 2, 0, 0.75), 1: (2, 2, 0)}
    session.generated = {}
    first, second = session.manifest_prompts()
    assert (first["recall_correct"], first["recall_queries"], first["recall_nll"]) == (1, 2, 0.75)
    assert "recall_nll" not in second and second["recall_correct"] == 2
    assert recall_table({"prompts": [first]})["mqar"]["nll"] == 0.375
    assert recall_table({"prompts": [second]})["mqar-twice"]["nll"] is None


def test_no_accuracy_without_a_finite_query():
    manifest = {"prompts": [{"task": "mqar", "recall_correct": 0, "recall_queries": 0, "recall_excluded": 4,
                             "recall_nll": 0.0},
                            {"task": "mqar-twice", "recall_correct": 1, "recall_queries": 2, "recall_excluded": 2,
                             "recall_nll": 1.0}]}
    table = recall_table(manifest)
    assert table["mqar"]["accuracy"] is None and table["mqar"]["excluded_nonfinite"] == 4
    assert table["mqar"]["nll"] is None and table["mqar"]["perplexity"] is None
    assert table["mqar-twice"]["accuracy"] == 0.5 and table["mqar-twice"]["excluded_nonfinite"] == 2
    assert table["mqar-twice"]["nll"] == 0.5


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
