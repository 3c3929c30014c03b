"""The on-disk capture: safetensors shards plus ``manifest.json``.

Layout of a run directory::

    DIR/manifest.json                              written first with "complete": false,
                                                   rewritten with "complete": true last
    DIR/capture/batch_BBBBB/layer_LLL.safetensors  one shard per (forward batch, layer call)

A forward batch holds one or more prompts (``prompts`` in the shard's metadata lists them in the
order of the call's sequences). Every file is written to a temporary name and renamed into place, so
a crash never leaves a file that looks complete. Shards are loaded with safetensors only — nothing in
a run directory is ever unpickled.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .._atomic import atomic_path, atomic_write_text, remove_stale_temporaries
from .._json import dumps as strict_json
from .record import TENSOR_FIELDS, KernelCall

__all__ = [
    "IncompleteRunError",
    "CaptureReader",
    "CaptureWriter",
    "StoredCall",
    "atomic_write_text",
    "read_manifest",
    "to_device",
]

MANIFEST = "manifest.json"


class IncompleteRunError(RuntimeError):
    """A run directory whose manifest does not say ``"complete": true``."""


def read_manifest(run_dir: str | os.PathLike, *, require_complete: bool = True) -> dict:
    path = Path(run_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no manifest.json — is {run_dir} a capture directory?")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err}); the run directory is damaged, run it again") from None
    if require_complete and manifest.get("complete") is not True:
        raise IncompleteRunError(
            f"{path}: the capture is incomplete (\"complete\" is not true): the run that wrote it was "
            "interrupted or failed; run it again"
        )
    return manifest


@dataclass
class StoredCall:
    """A captured call as read back: the call, its forward batch and the prompt ids of its sequences."""

    batch: int
    prompts: list[int]
    call: KernelCall


class CaptureWriter:
    """Streams captured calls to ``DIR/capture`` and keeps the manifest.

    Use as ``writer.begin(manifest)``, then ``writer.write(batch, prompts, call)`` for each call, then
    ``writer.finish(extra)``, which rewrites the manifest with ``"complete": true``.
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.manifest: dict = {}
        self.layers: dict[int, dict] = {}
        self._count: dict[tuple[int, int], int] = {}

    def begin(self, manifest: dict) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Temporaries of a writer killed in an earlier run into this directory (no one else writes
        # here now: begin runs before any shard of this run is written).
        for directory in (self.run_dir, *sorted((self.run_dir / "capture").glob("batch_*"))):
            remove_stale_temporaries(directory)
        self.manifest = {**manifest, "complete": False}
        atomic_write_text(self.run_dir / MANIFEST, strict_json(self.manifest, indent=2))

    def write(self, batch: int, prompts: list[int], call: KernelCall) -> Path:
        n = self._count.get((batch, call.layer), 0)
        self._count[(batch, call.layer)] = n + 1
        name = f"layer_{call.layer:03d}" + (f"_call{n}" if n else "") + ".safetensors"
        path = self.run_dir / "capture" / f"batch_{batch:05d}" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"call": json.dumps(call.metadata()), "prompts": json.dumps(list(prompts))}
        with atomic_path(path) as tmp:
            save_file(call.tensors(), tmp, metadata=meta)
        self.layers.setdefault(call.layer, layer_entry(call))
        return path

    def finish(self, extra: dict | None = None) -> None:
        self.manifest.update(extra or {})
        self.manifest["layers"] = [self.layers[i] for i in sorted(self.layers)]
        self.manifest["complete"] = True
        atomic_write_text(self.run_dir / MANIFEST, strict_json(self.manifest, indent=2))


def layer_entry(call: KernelCall) -> dict:
    """The manifest's description of a captured layer."""
    return {
        "layer": call.layer,
        "name": call.layer_name,
        "family": call.family,
        "kernel": call.kernel,
        "heads": call.num_heads,
        "head_k_dim": call.head_k_dim,
        "head_v_dim": call.head_v_dim,
        "input_dtype": call.input_dtype,
        "gated": call.gated,
        "has_d": call.d is not None,
        "flags": call.flags,
    }


class CaptureReader:
    """Reads a run directory's capture back, shard by shard (never all at once)."""

    def __init__(self, run_dir: str | os.PathLike, *, require_complete: bool = True):
        self.run_dir = Path(run_dir)
        self.manifest = read_manifest(run_dir, require_complete=require_complete)

    def shards(self) -> list[Path]:
        root = self.run_dir / "capture"
        return sorted(root.glob("batch_*/layer_*.safetensors")) if root.is_dir() else []

    def __len__(self) -> int:
        return len(self.shards())

    def __iter__(self) -> Iterator[StoredCall]:
        for path in self.shards():
            yield self.load(path)

    @staticmethod
    def load(path: Path) -> StoredCall:
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                tensors = {name: fh.get_tensor(name) for name in fh.keys()}
            call_meta = json.loads(meta["call"])
            prompts = [int(p) for p in json.loads(meta["prompts"])]
        except (KeyError, ValueError, OSError, SafetensorError) as err:
            raise ValueError(f"{path}: not a readable capture shard ({err}); capture the run again") from err
        batch = int(path.parent.name.removeprefix("batch_"))
        return StoredCall(batch=batch, prompts=prompts, call=KernelCall.from_parts(call_meta, tensors))


def to_device(call: KernelCall, device: torch.device | str) -> KernelCall:
    """A copy of ``call`` with every tensor on ``device``."""
    moved = {n: getattr(call, n).to(device) for n in TENSOR_FIELDS if getattr(call, n) is not None}
    return replace(call, **moved)
