"""`osdn-diag run MODEL --generate N` end to end (CPU, fp32): the prompt and the tokens the model
generates after it are one stream per prompt in every file of the run.

Every number read here is recomputed from the run's own tables: the manifest's generated tokens are
the greedy continuation of the prompt recomputed without a cache; ``summary.json``'s ``by_phase`` and
the report's "Prefill and decoding" table equal q_geo over ``residuals.parquet``'s rows before and
from ``decode_start``; ``tokens.parquet`` holds the prompt's and the generated tokens, with their text.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from osdn_diag.cli import main

MODEL, LENGTH, N, PROMPTS = "builtin:lm-deltanet", 24, 6, 2


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "run"
    argv = ["run", MODEL, "--prompts", "lm-heldout", "--num-prompts", str(PROMPTS), "--length", str(LENGTH),
            "--generate", str(N), "--out", str(out), "-q"]
    assert main(argv) == 0
    return out


def _q_geo(q: np.ndarray) -> float:
    return math.exp(float(np.log(np.maximum(q.astype(np.float64), 1e-30)).mean()))


def test_manifest_lists_each_prompts_generated_tokens(run_dir):
    import osdn_diag
    from osdn_diag.models import load_model

    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["generate"] == N
    model = load_model(MODEL).model
    for p in manifest["prompts"]:
        assert p["prompt_length"] == p["decode_start"] == LENGTH and p["length"] == LENGTH + N
        assert len(p["generated_ids"]) == N
    tokens = pq.read_table(run_dir / "tokens.parquet").to_pydict()
    for p in manifest["prompts"]:
        ids = [t for pr, t in zip(tokens["prompt"], tokens["token_id"]) if pr == p["id"]]
        assert len(ids) == LENGTH + N and ids[LENGTH:] == p["generated_ids"]
        # greedy, recomputed from the whole sequence for every token: no cache, no decoding (under a
        # capture only so that the CPU runs the package's recurrence, not fla's interpreted kernels)
        seq = torch.tensor([ids[:LENGTH]])
        with osdn_diag.capture(model), torch.inference_mode():
            for _ in range(N):
                seq = torch.cat([seq, model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert seq[0, LENGTH:].tolist() == p["generated_ids"]
    text = [t for t in tokens["text"]]
    assert all(isinstance(t, str) for t in text)  # the built-in language model has a tokenizer


def test_summary_and_report_separate_prefill_from_decoding(run_dir):
    table = pq.read_table(run_dir / "residuals.parquet").to_pydict()
    pos, q = np.asarray(table["pos"]), np.asarray(table["residual_ratio"], dtype=np.float64)
    finite, start = np.asarray(table["finite"]), np.asarray(table["decode_start"])
    assert set(start) == {LENGTH} and pos.max() == LENGTH + N - 1
    summary = json.loads((run_dir / "summary.json").read_text())
    phases = summary["by_phase"]
    for phase, rows in (("prefill", finite & (pos < start)), ("decode", finite & (pos >= start))):
        assert phases[phase]["n"] == int(rows.sum())
        assert phases[phase]["q_geo"] == pytest.approx(_q_geo(q[rows]), rel=1e-9)
    assert phases["prefill"]["n"] + phases["decode"]["n"] == summary["n"]
    report = (run_dir / "report.md").read_text()
    section = report[report.index("## Prefill and decoding"):]
    row = next(line for line in section.splitlines() if line.startswith(f"| {MODEL} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == str(N)
    assert float(cells[2]) == pytest.approx(phases["prefill"]["q_geo"], abs=5e-4)  # printed to 3 decimals
    assert float(cells[3]) == pytest.approx(phases["decode"]["q_geo"], abs=5e-4)
    assert cells[4] == f"{phases['prefill']['n']:,}" and cells[5] == f"{phases['decode']['n']:,}"


def test_generate_needs_batches_of_one(tmp_path, capsys):
    from osdn_diag.cli import entry

    argv = ["run", MODEL, "--prompts", "lm-heldout", "--num-prompts", "2", "--length", "16", "--generate", "2",
            "--batch-size", "2", "--out", str(tmp_path / "run"), "-q"]
    assert entry(argv) == 2
    err = capsys.readouterr().err
    assert "--generate" in err and "--batch-size" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
