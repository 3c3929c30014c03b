"""What a run measured, as content (:mod:`osdn_diag.identity`): the prompts' digest covers every field
the model reads or the run scores, a model directory's identity its config and weights, and
:func:`identity_change` names the first difference. The end-to-end refusal of a resume is in
tests/pipeline/test_resume_identity.py."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from types import SimpleNamespace

import pytest

from osdn_diag import identity
from osdn_diag.identity import identity_change, model_identity, prompts_digest, run_identity
from osdn_diag.prompts.base import Prompt

PROMPTS = [Prompt(0, "recall", [5, 6, 7, 8], 2, {"answers": [7], "answer_positions": [1]}),
           Prompt(1, "plain", [1, 2, 3])]


@pytest.mark.parametrize("change", [
    dict(id=9), dict(task="other"), dict(input_ids=[5, 6, 7, 9]), dict(repeat_start=1),
    dict(meta={"answers": [8], "answer_positions": [1]}), dict(meta={"answers": [7], "answer_positions": [2]}),
])
def test_the_prompts_digest_changes_with_every_field(change):
    changed = [replace(PROMPTS[0], **change), PROMPTS[1]]
    assert prompts_digest(changed) != prompts_digest(PROMPTS)
    assert prompts_digest(list(PROMPTS)) == prompts_digest(PROMPTS)


def _loaded(directory, hub=None):
    return SimpleNamespace(source="hub" if hub else "directory", spec="m", directory=str(directory), hub=hub)


def test_a_directory_is_identified_by_its_config_and_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    got = model_identity(_loaded(tmp_path), seed=0, device_type="cpu", hash_weights=None)
    assert got == {"source": "directory", "config_sha256": hashlib.sha256(b"{}").hexdigest(),
                   "weights": {"model.safetensors": {"size": 7, "sha256": hashlib.sha256(b"weights").hexdigest()}}}
    # weights over the threshold are hashed only when asked (several processes), their sizes always
    big = model_identity(_loaded(tmp_path), seed=0, device_type="cpu", hash_weights=False)
    assert big["weights"]["model.safetensors"] == {"size": 7, "sha256": None}


def test_weights_are_hashed_up_to_the_threshold_in_one_process(tmp_path, monkeypatch):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    for limit, hashed in ((10, True), (9, False)):
        monkeypatch.setattr(identity, "HASH_ALWAYS_BYTES", limit)
        got = model_identity(_loaded(tmp_path), seed=0, device_type="cpu", hash_weights=None)
        assert (got["weights"]["model.safetensors"]["sha256"] is not None) == hashed, limit


def test_a_hub_model_records_the_commit_it_resolved_to(tmp_path):
    commit = "c" * 40
    got = model_identity(_loaded(tmp_path, hub={"revision": "main", "commit": commit}), seed=0,
                         device_type="cpu", hash_weights=None)
    assert got["commit"] == commit


def test_identity_change_names_the_first_difference(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    loaded = _loaded(tmp_path)
    versions = {"osdn-diag": "1", "torch": "2"}
    old = run_identity(loaded, PROMPTS, seed=0, device_type="cpu", versions=versions, hash_weights=None)
    assert identity_change(old, old) is None
    assert "prompts changed" in identity_change(old, {**old, "prompts": {**old["prompts"], "count": 3}})
    assert identity_change(old, {**old, "versions": {**versions, "torch": "3"}}) == \
        "the installed versions changed (torch)"
    assert identity_change(old, {**old, "model": {**old["model"], "config_sha256": "0"}}) == \
        "the model's config.json changed"
    assert "not recorded" in identity_change(None, old)
