"""MODEL as a Hugging Face Hub id, offline: a cache laid out as the Hub client writes it
(``models--ORG--NAME/{blobs, refs, snapshots/COMMIT}``, snapshot files linked to content-addressed
blobs), with ``HF_HUB_OFFLINE`` on — no network in tests.

Checked: ``ORG/NAME`` resolves through ``refs/main`` and ``ORG/NAME@COMMIT`` directly; the weights
loaded are the ones in the cache; the commit is recorded in the run's manifest; unknown ids and
revisions fail naming them; a pickled-only repository is refused; a local path of the same name wins.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from osdn_diag.cli import main
from osdn_diag.models import load_model
from osdn_diag.catalog.hub import is_hub_id

COMMIT = "3f9a1c2b4d5e6f708192a3b4c5d6e7f8091a2b3c"


def _publish(cache, repo: str, files: dict[str, bytes], commit: str = COMMIT, ref: str = "main"):
    """Lay ``files`` out in ``cache`` as the Hub client does after a download of ``repo``."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / name)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, fla_kernels):
    """An offline Hub cache holding ``acme/tiny-deltanet`` (the tiny DeltaNet preset, saved)."""
    import huggingface_hub.constants as constants

    saved = tmp_path / "saved"
    load_model("random:deltanet-tiny", seed=7).model.save_pretrained(saved, safe_serialization=True)
    cache = tmp_path / "hub"
    _publish(cache, "acme/tiny-deltanet", {p.name: p.read_bytes() for p in saved.iterdir()})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # relative names below are looked for here first
    return cache, saved


def test_hub_id_loads_the_cached_weights(hub_cache):
    from safetensors.torch import load_file

    _, saved = hub_cache
    for spec in ("acme/tiny-deltanet", f"acme/tiny-deltanet@{COMMIT}"):
        loaded = load_model(spec)
        assert loaded.source == "hub"
        assert loaded.hub["repo_id"] == "acme/tiny-deltanet" and loaded.hub["commit"] == COMMIT
        assert loaded.hub["revision"] == (None if "@" not in spec else COMMIT)
        want = load_file(saved / "model.safetensors")
        got = loaded.model.state_dict()
        assert all(torch.equal(got[name], tensor) for name, tensor in want.items())


def test_run_records_the_commit(hub_cache, tmp_path):
    out = tmp_path / "run"
    assert main(["run", "acme/tiny-deltanet", "--prompts", "random", "--num-prompts", "1", "--length", "8",
                 "--out", str(out), "-q"]) == 0
    model = json.loads((out / "manifest.json").read_text())["model"]
    assert model["spec"] == "acme/tiny-deltanet" and model["source"] == "hub"
    assert model["hub"]["commit"] == COMMIT and model["hub"]["revision"] is None


@pytest.mark.parametrize("spec,message", [
    ("acme/nothing", "not in the local cache while the Hub cannot be reached"),
    ("acme/tiny-deltanet@v9", "not in the local cache while the Hub cannot be reached"),
])
def test_unresolvable_ids_are_named(hub_cache, spec, message):
    with pytest.raises(FileNotFoundError, match=f"MODEL '{spec}': .*{message}"):
        load_model(spec)


def test_unresolvable_id_from_the_command_line(hub_cache, tmp_path, capsys):
    from osdn_diag.cli import entry

    assert entry(["run", "acme/nothing", "--prompts", "random", "--out", str(tmp_path / "o"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "MODEL 'acme/nothing'" in err and "Traceback" not in err


def test_pickled_weights_are_never_loaded(hub_cache):
    cache, saved = hub_cache
    _publish(cache, "acme/pickled", {"config.json": (saved / "config.json").read_bytes(),
                                     "pytorch_model.bin": b"not fetched, not loaded"})
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        load_model("acme/pickled")


def test_a_local_path_wins(hub_cache, tmp_path):
    _, saved = hub_cache
    assert is_hub_id("acme/tiny-deltanet")
    (tmp_path / "acme").mkdir()
    os.symlink(saved, tmp_path / "acme" / "tiny-deltanet")
    assert not is_hub_id("acme/tiny-deltanet")
    assert load_model("acme/tiny-deltanet").source == "directory"
    assert not is_hub_id("/abs/path") and not is_hub_id("random:deltanet-tiny") and not is_hub_id("a/b/c")


def test_a_revision_that_walks_out_of_the_cache_is_refused(hub_cache):
    """``@../../x`` was joined to the cache's paths: it loaded any directory holding a model and recorded
    the directory's name as the Hub commit."""
    from osdn_diag.catalog import hub

    cache, saved = hub_cache
    elsewhere = cache / "models--acme--tiny-deltanet" / "x"  # snapshots/../../x from the revision's view
    elsewhere.mkdir()
    for f in saved.iterdir():
        (elsewhere / f.name).write_bytes(f.read_bytes())
    for spec in ("acme/tiny-deltanet@../x", "acme/tiny-deltanet@../../models--acme--tiny-deltanet/x",
                 "acme/tiny-deltanet@a//b"):
        with pytest.raises(ValueError, match="is not a branch, tag or commit name"):
            load_model(spec)
    with pytest.raises(ValueError, match="which is not a snapshot of the Hub cache"):
        hub._check_snapshot("acme/tiny-deltanet", elsewhere)
    hub._check_snapshot("acme/tiny-deltanet", cache / "models--acme--tiny-deltanet" / "snapshots" / COMMIT)


@pytest.mark.parametrize("ref", ["main", "v1.0"])
def test_a_branch_or_tag_is_recorded_with_the_commit_it_resolved_to(hub_cache, ref):
    """The source says which weights were measured: the commit, whatever name was asked for (a branch
    or tag moves; the commit does not)."""
    from osdn_diag.catalog import hub

    cache, saved = hub_cache
    if ref != "main":
        (cache / "models--acme--tiny-deltanet" / "refs" / ref).write_text(COMMIT)
    snapshot, source = hub.resolve(f"acme/tiny-deltanet@{ref}")
    assert source.revision == ref and source.commit == COMMIT and snapshot.name == COMMIT
    assert source.snapshot == str(snapshot) and snapshot.parent.name == "snapshots"


def test_a_commit_named_directory_outside_the_snapshots_is_refused(hub_cache, tmp_path, monkeypatch):
    """What resolves must be ``snapshots/<commit>`` of the cache, not any directory named like a commit."""
    import huggingface_hub

    from osdn_diag.catalog import hub

    _, saved = hub_cache
    stray = tmp_path / "elsewhere" / COMMIT
    stray.mkdir(parents=True)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(stray))
    with pytest.raises(ValueError, match=f"resolved to {stray}, which is not a snapshot of the Hub cache"):
        hub.resolve("acme/tiny-deltanet")
