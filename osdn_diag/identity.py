"""What a run measured, as content rather than names: the identity a resumed run must match.

A run's settings name its inputs (a model spec, a prompt file's path); the files behind those names
can change between a preempted job and its rerun. Resuming on names alone kept the captures of the
old inputs beside those of the new ones and published the mix as one complete run. The identity
recorded in ``manifest.json`` (``identity``) and in every rank record ties a run to what it read:

* ``prompts``: the sha256 of the loaded prompts — every prompt's id, task, token ids, repeat position
  and answers — so that it covers a prompt file, its tokenizer and the built-in suites alike;
* ``model``: for a directory (or a Hub snapshot, a built-in model) the sha256 of ``config.json`` and,
  per ``*.safetensors`` file, its size and sha256; a Hub model also its commit; ``random:PRESET`` the
  preset, the seed and the device type its weights were drawn on (the package version is in
  ``versions``);
* ``versions``: osdn-diag, torch, triton, fla and transformers.

Hashing a 340M model's 700 MB of weights takes about a second (sha256 at ~700 MB/s on one core), so
the weights are hashed where resuming can happen — under several processes — and, in one process,
only when they are small (:data:`HASH_ALWAYS_BYTES`); otherwise their sizes are recorded and their
``sha256`` is ``null``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from .rundir import sha256_file

__all__ = ["HASH_ALWAYS_BYTES", "identity_change", "model_identity", "prompts_digest", "run_identity"]

#: Weights up to this many bytes are hashed in one process too (well under 0.1 s).
HASH_ALWAYS_BYTES = 64 << 20


def prompts_digest(prompts) -> str:
    """The sha256 of the prompts as the model reads them: per prompt its id, task, repeat position
    and extra fields (answers) as canonical JSON, then its token ids as little-endian int64."""
    digest = hashlib.sha256()
    for p in prompts:
        head = json.dumps([p.id, p.task, p.repeat_start, p.meta, len(p.input_ids)], sort_keys=True,
                          separators=(",", ":"), default=str)
        digest.update(struct.pack("<Q", len(head)) + head.encode())
        digest.update(struct.pack(f"<{len(p.input_ids)}q", *p.input_ids))
    return digest.hexdigest()


def _files_identity(directory: Path, hash_weights: bool | None) -> dict:
    """``config.json``'s sha256 and every ``*.safetensors`` file's size and sha256 (``None`` when
    not hashed). ``hash_weights`` ``None``: hash them if they total at most :data:`HASH_ALWAYS_BYTES`."""
    weights = sorted(directory.glob("*.safetensors"))
    sizes = {w.name: w.stat().st_size for w in weights}
    if hash_weights is None:
        hash_weights = sum(sizes.values()) <= HASH_ALWAYS_BYTES
    config = directory / "config.json"
    return {"config_sha256": sha256_file(config) if config.is_file() else None,
            "weights": {w.name: {"size": sizes[w.name], "sha256": sha256_file(w) if hash_weights else None}
                        for w in weights}}


def model_identity(loaded, *, seed: int, device_type: str, hash_weights: bool | None) -> dict:
    """The identity of a loaded model (a :class:`~osdn_diag.models.LoadedModel`)."""
    if loaded.source == "random" or loaded.directory is None:
        return {"source": loaded.source, "spec": loaded.spec, "seed": seed, "device_type": device_type}
    out = {"source": loaded.source, **_files_identity(Path(loaded.directory), hash_weights)}
    if loaded.hub:
        out["commit"] = loaded.hub.get("commit")
    return out


def run_identity(loaded, prompts, *, seed: int, device_type: str, versions: dict,
                 hash_weights: bool | None) -> dict:
    """The manifest's ``identity``: prompts, model and versions (see the module docstring)."""
    return {"prompts": {"sha256": prompts_digest(prompts), "count": len(prompts),
                        "tokens": sum(len(p) for p in prompts)},
            "model": model_identity(loaded, seed=seed, device_type=device_type, hash_weights=hash_weights),
            "versions": versions}


def identity_change(old, new: dict) -> str | None:
    """What differs between a recorded identity ``old`` and this command's ``new``, in words (the
    first difference), or ``None`` when they are the same."""
    if not isinstance(old, dict):
        return "its inputs are not recorded (written by an earlier osdn-diag)"
    if old.get("prompts") != new["prompts"]:
        return "the prompts changed (their token ids, tasks or answers)"
    before, now = old.get("model") or {}, new["model"]
    if before != now:
        if before.get("config_sha256") != now.get("config_sha256"):
            return "the model's config.json changed"
        for name in sorted(set(before.get("weights") or {}) | set(now.get("weights") or {})):
            if (before.get("weights") or {}).get(name) != (now.get("weights") or {}).get(name):
                return f"the model's weights changed ({name})"
        return "the model changed"
    if old.get("versions") != new["versions"]:
        changed = sorted(k for k in set(old.get("versions") or {}) | set(new["versions"])
                         if (old.get("versions") or {}).get(k) != new["versions"].get(k))
        return f"the installed versions changed ({', '.join(changed)})"
    return None
