"""A torchrun run is resumed only with the inputs it started with: its manifest and rank records hold
what it read (the prompts' digest, config.json and weights' sha256, versions), not only their names.
An input changed between the preempted job and its rerun is refused, naming it; the same inputs
resume.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from osdn_diag.identity import identity_change, prompts_digest
from osdn_diag.pipeline.resume import _resumable
from osdn_diag.prompts import Prompt
from osdn_diag.rundir import RunDirectoryError

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(model: Path, prompts: Path, out: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """``osdn-diag run`` under torchrun, two gloo processes on the CPU."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "0", "-m", "osdn_diag", "run", str(model), "--prompts", str(prompts),
           "--out", str(out), "--device", "cpu", "-q"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _identity_now(model: Path, prompts: Path) -> dict:
    """The identity rank 0 of a rerun computes, in this process."""
    from osdn_diag.identity import run_identity
    from osdn_diag.models import load_model
    from osdn_diag.pipeline.inputs import _versions
    from osdn_diag.prompts import load_prompts

    loaded = load_model(str(model))
    return run_identity(loaded, load_prompts(str(prompts), vocab_size=256), seed=0, device_type="cpu",
                        versions=_versions(), hash_weights=True)


def _write_prompts(path: Path, seed: int) -> None:
    import random

    r = random.Random(seed)
    path.write_text("".join(json.dumps({"input_ids": [r.randrange(256) for _ in range(8)]}) + "\n" for _ in range(4)))


def test_a_changed_input_is_not_resumed(tmp_path):
    from osdn_diag.models import load_model

    model, other = tmp_path / "model", tmp_path / "other"
    load_model("random:deltanet-tiny", seed=0).model.save_pretrained(model)
    load_model("random:deltanet-tiny", seed=1).model.save_pretrained(other)
    prompts, run = tmp_path / "p.jsonl", tmp_path / "run"
    _write_prompts(prompts, 0)
    killed = _torchrun(model, prompts, run, {"OSDN_DIAG_FAULT": "1:captured"})
    assert killed.returncode != 0
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is False
    identity = manifest["identity"]
    assert identity["model"]["weights"]["model.safetensors"]["sha256"] is not None  # hashed under torchrun
    assert len(identity["prompts"]["sha256"]) == 64 and identity["versions"]["torch"]
    weights = (model / "model.safetensors").read_bytes()

    # The weights replaced: refused, naming them (rank 0's decision, taken here in one process).
    (model / "model.safetensors").write_bytes((other / "model.safetensors").read_bytes())
    with pytest.raises(RunDirectoryError, match=r"the model's weights changed \(model.safetensors\).*--overwrite"):
        _resumable(run, manifest["settings"], 2, _identity_now(model, prompts))
    (model / "model.safetensors").write_bytes(weights)
    assert _resumable(run, manifest["settings"], 2, _identity_now(model, prompts))["run_id"] == manifest["run_id"]

    # The prompt file edited: refused.
    _write_prompts(prompts, 1)
    done = _torchrun(model, prompts, run)
    assert done.returncode != 0 and "the prompts changed" in done.stderr, done.stderr[-2000:]
    assert json.loads((run / "manifest.json").read_text())["run_id"] == manifest["run_id"]

    # The inputs it started with: resumed, every rank's capture kept.
    _write_prompts(prompts, 0)
    done = _torchrun(model, prompts, run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("complete and verified; not captured again") == 2, done.stderr[-3000:]
    final = json.loads((run / "manifest.json").read_text())
    assert final["complete"] is True and final["identity"] == identity


def _prompt(ids, task="t"):
    return Prompt(id=0, task=task, input_ids=list(ids))


@pytest.mark.parametrize("change", ["ids", "task", "answers"])
def test_the_prompt_digest_covers_tokens_tasks_and_answers(change):
    base = _prompt([1, 2, 3])
    other = {"ids": _prompt([1, 2, 4]), "task": _prompt([1, 2, 3], "u"),
             "answers": Prompt(id=0, task="t", input_ids=[1, 2, 3], meta={"answers": [1]})}[change]
    assert prompts_digest([base]) != prompts_digest([other])
    assert prompts_digest([base]) == prompts_digest([_prompt([1, 2, 3])])


def test_identity_change_names_the_input():
    new = {"prompts": {"sha256": "a"}, "model": {"config_sha256": "c", "weights": {"m.safetensors": {"sha256": "w"}}},
           "versions": {"torch": "2"}}
    assert identity_change(new, new) is None
    assert "earlier osdn-diag" in identity_change(None, new)
    assert "config.json" in identity_change({**new, "model": {**new["model"], "config_sha256": "x"}}, new)
    assert "(torch)" in identity_change({**new, "versions": {"torch": "1"}}, new)
