"""The scripts in examples/, run as a user would (subprocesses from the repository root, on the CPU).

Each subprocess pays fla's import (~5–10 s without bytecode caches), so every script runs once.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from osdn_diag.cli import main
from osdn_diag.models import load_model

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Spelled out here (not imported) so that the test fails if the contract's columns change.
CONTRACT_COLUMNS = {
    "prompt", "task", "layer", "head", "pos", "rel_pos", "repeat_start", "beta", "key_sqnorm",
    "write_gain", "loss_before", "loss_after", "residual_ratio",
}


def _script(name: str, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)  # CI (and anything else) passed through
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"  # fla on the CPU: Triton's interpreter, set before import
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *map(str, args)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


# --- train_mqar.py --------------------------------------------------------------------------------

ARCHS = {"deltanet": ("DeltaNetForCausalLM", "delta_net"), "osdn": ("OSDNForCausalLM", "osdn")}
TRAIN_ARGS = ["--device", "cpu", "--arch", "deltanet", "osdn", "--steps", "2", "--batch", "4",
              "--eval-size", "4", "--pairs", "4", "--vocab", "32", "--hidden", "32", "--heads", "2",
              "--log-every", "1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    proc = _script("train_mqar.py", *TRAIN_ARGS, "--out", out)
    return out, proc


def test_train_mqar_writes_loadable_checkpoints(trained):
    out, _ = trained
    # Each checkpoint is written aside and renamed into place: nothing half-written is left.
    assert sorted(p.name for p in out.iterdir()) == sorted([*(f"mqar-{a}" for a in ARCHS), "train_summary.json"])
    for arch, (cls, model_type) in ARCHS.items():
        d = out / f"mqar-{arch}"
        loaded = load_model(str(d))
        assert loaded.source == "directory" and loaded.directory == d
        assert type(loaded.model).__name__ == cls
        assert loaded.config["model_type"] == model_type
        assert (loaded.config["hidden_size"], loaded.config["num_heads"], loaded.config["vocab_size"]) == (32, 2, 32)
        assert (d / "model.safetensors").is_file()
        task = json.loads((d / "task.json").read_text())
        assert task == {"suite": "mqar", "vocab_size": 32, "num_pairs": 4, "num_queries": 4}
        card = (d / "README.md").read_text()
        assert card.startswith(f"# mqar-{arch}\n") and "## Made by" in card
        assert "python examples/train_mqar.py " + " ".join(TRAIN_ARGS) in card


def test_train_mqar_logs_and_summary(trained):
    out, proc = trained
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["command"].startswith("python examples/train_mqar.py --device cpu")
    assert set(summary["results"]) == set(ARCHS)
    steps = {}
    for arch in ARCHS:
        res = summary["results"][arch]
        assert res["steps"] == 2 and res["device"] == "cpu"
        assert math.isfinite(res["loss"]) and math.isfinite(res["first_loss"])
        assert 0.0 <= res["accuracy_single"] <= 1.0 and 0.0 <= res["accuracy_twice"] <= 1.0
        rows = [json.loads(x) for x in (out / f"mqar-{arch}" / "train_log.jsonl").read_text().splitlines()]
        losses = [r for r in rows if "loss" in r]
        evals = [r for r in rows if "accuracy_single" in r]
        assert losses and evals
        assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in losses)
        assert losses[-1]["step"] == 2 and losses[-1]["loss"] == res["loss"]
        assert evals[-1]["step"] == 2
        steps[arch] = [r["step"] for r in rows]
        # printed once per architecture, as JSON
        assert json.loads(next(ln for ln in proc.stdout.splitlines() if f'"arch": "{arch}"' in ln)) == res
    assert steps["deltanet"] == steps["osdn"]  # lockstep
    d = summary["results"]["osdn"]["d"]  # OSDN's preconditioner, read from the kernels
    assert d is not None and 0.5 - 1e-6 <= d["min"] <= d["mean"] <= d["max"] <= 2.0 + 1e-6
    assert "d" not in summary["results"]["deltanet"]


def test_train_mqar_prints_progress_lines_where_stderr_is_not_a_terminal(trained):
    """stderr to a pipe (as under nohup or a batch job): no tqdm bar but lines, flushed: the first
    step's seconds, then one per logged step (--log-every 1) with each model's loss as its
    train_log.jsonl records it, the seconds so far and per step since the line before."""
    out, proc = trained
    assert "train deltanet/osdn:" not in proc.stderr  # tqdm's bar (its desc) is off
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("[train] ")]
    assert lines, f"no progress lines on stderr:\n{proc.stderr[-2000:]}"
    assert re.fullmatch(r"\[train\] step 1/2 took \d+\.\d s", lines[0]), lines
    logged = {arch: {r["step"]: r["loss"] for r in map(json.loads, (out / f"mqar-{arch}" / "train_log.jsonl")
                                                           .read_text().splitlines()) if "loss" in r}
              for arch in ARCHS}
    before = 0.0
    assert len(lines) == 3
    for step, line in zip((1, 2), lines[1:]):
        m = re.fullmatch(r"\[train\] step (\d)/2: (.+) · (\d+\.\d) s, (\d+\.\d\d) s/step \(last 1\)", line)
        assert m and int(m[1]) == step, line  # no monitor in this script
        assert m[2] == ", ".join(f"{arch} {logged[arch][step]:.3f}" for arch in ARCHS)
        assert float(m[3]) >= before and abs(float(m[4]) - (float(m[3]) - before)) <= 0.11
        before = float(m[3])


# --- hook_your_model.py ---------------------------------------------------------------------------


def test_hook_your_model_writes_the_contract_table(tmp_path):
    out = tmp_path / "r.parquet"
    length = 32
    proc = _script("hook_your_model.py", "builtin:mqar-deltanet", "--out", out, "--length", length)
    table = pq.read_table(out)
    assert CONTRACT_COLUMNS <= set(table.column_names)
    layers, heads = 2, 2  # mqar-deltanet: 2 layers of 2 heads
    assert table.num_rows == 2 * layers * heads * length
    df = table.to_pydict()
    assert sorted(set(df["layer"])) == [0, 1] and sorted(set(df["head"])) == [0, 1]
    assert sorted(set(df["pos"])) == list(range(length))
    q = torch.tensor(df["residual_ratio"], dtype=torch.float64)
    assert bool(torch.isfinite(q).all()) and bool((q >= 0).all())
    q_geo = math.exp(q.clamp_min(1e-30).log().mean().item())
    first = proc.stdout.splitlines()[0]
    assert first.startswith(f"{table.num_rows:,} writes -> {out}")
    assert float(first.rsplit("q_geo = ", 1)[1]) == pytest.approx(q_geo, abs=1e-4)
    assert sum(ln.strip().startswith("layer ") for ln in proc.stdout.splitlines()) == layers


# --- compare_curves.py ----------------------------------------------------------------------------


def _quick_run(out, seed):
    assert main(["run", "random:deltanet-tiny", "--prompts", "random", "--num-prompts", "2", "--length", "20",
                 "--twice", "--seed", str(seed), "--out", str(out), "-q"]) == 0


def test_compare_curves_writes_a_png(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _quick_run(a, 0)
    _quick_run(b, 1)
    png = tmp_path / "c.png"
    proc = _script("compare_curves.py", a, b, "--labels", "seed 0", "seed 1", "--out", png)
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (11 * 150, 4 * 150)  # two panels, figsize (11, 4) at 150 dpi
    assert f"wrote {png}" in proc.stdout


# --- theorem_suites.py ----------------------------------------------------------------------------


def test_theorem_suites_prints_every_claim_and_a_status_summary():
    from osdn_diag.proofs import ledger

    proc = _script("theorem_suites.py", timeout=120)
    lines = proc.stdout.strip().splitlines()
    claims = [ln for ln in lines if ln.startswith(("ok ", "!! "))]
    assert len(claims) == len(ledger.CLAIMS)
    assert all(ln.startswith("ok ") for ln in claims), [ln for ln in claims if ln.startswith("!! ")]
    assert [ln.split()[1] for ln in claims] == [c.id for c in ledger.CLAIMS]
    summary = ast.literal_eval(lines[-1])
    assert summary == dict(Counter(c.expected for c in ledger.CLAIMS))


def test_train_mqar_refuses_zero_steps_between_lines():
    """--log-every 0 ended in a ZeroDivisionError traceback at the first step: refused by its parser."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "train_mqar.py"), "--log-every", "0",
                           "--out", "unused"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "argument --log-every/--eval-every: expected at least 1" in done.stderr
    assert "Traceback" not in done.stderr

