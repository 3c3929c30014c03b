"""The on-disk capture: safetensors shards plus ``manifest.json``.

Layout of a run directory::

    DIR/manifest.json                              written first with "complete": false,
                                                   rewritten with "complete": true last
    DIR/capture/batch_BBBBB/layer_LLL.safetensors  one shard per (forward batch, layer call)

A forward batch holds one or more prompts (``prompts`` in the shard's metadata lists them in the
order of the call's sequences; ``run_id`` names the run). The manifest lists every shard with its
size and sha256 (``shards``), and the reader accepts exactly those files (see
:mod:`osdn_diag.rundir`). Every file is written to a temporary name and renamed into place, so a crash
never leaves a file that looks complete. Shards are loaded with safetensors only — nothing in a run
directory is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from ..runtime.atomic import atomic_path, atomic_write_text, remove_stale_temporaries
from ..runtime.strict_json import dumps as strict_json
from ..rundir import (  # noqa: F401 - IncompleteRunError, read_manifest, require_stage: re-exported
    MANIFEST, IncompleteRunError, RunDirectoryError, check_file_name, finish_stage, new_run_id, read_manifest,
    require_stage, sha256_file,
)
from .record import TENSOR_FIELDS, KernelCall

__all__ = [
    "IncompleteRunError",
    "CaptureReader",
    "CaptureWriter",
    "StoredCall",
    "atomic_write_text",
    "read_manifest",
    "require_stage",
    "to_device",
]



@dataclass
class StoredCall:
    """A captured call as read back: the call, its forward batch and the prompt ids of its sequences."""

    batch: int
    prompts: list[int]
    call: KernelCall


class CaptureWriter:
    """Streams captured calls to ``DIR/capture`` and keeps the manifest.

    Use as ``writer.begin(manifest)``, then ``writer.write(batch, prompts, call)`` for each call, then
    ``writer.finish(extra)``, which lists the shards in the manifest and marks the capture stage done.
    ``run_id`` is the run's id (new by default; under several processes every rank's writer gets rank
    0's); ``shards`` maps each shard this writer wrote to its sha256 and size.
    """

    def __init__(self, run_dir: str | os.PathLike, run_id: str | None = None):
        self.run_dir = Path(run_dir)
        self.run_id = run_id or new_run_id()
        self.manifest: dict = {}
        self.layers: dict[int, dict] = {}
        self.shards: dict[str, dict] = {}
        self._count: dict[tuple[int, int], int] = {}

    def begin(self, manifest: dict, stages: tuple[str, ...] = ("capture",)) -> None:
        """Write the manifest, not complete: ``stages`` are the stages the run sets out to do (the
        capture and what follows it in the same command)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Temporaries of a writer killed in an earlier run into this directory (no one else writes
        # here now: begin runs before any shard of this run is written).
        capture = self.run_dir / "capture"
        batches = sorted(capture.glob("batch_*")) if capture.is_dir() and not capture.is_symlink() else []
        for directory in (self.run_dir, *batches):
            remove_stale_temporaries(directory)
        self.manifest = {"run_id": self.run_id, **manifest, "stages": dict.fromkeys(stages, False),
                         "complete": False}
        atomic_write_text(self.run_dir / MANIFEST, strict_json(self.manifest, indent=2), root=self.run_dir)

    def write(self, batch: int, prompts: list[int], call: KernelCall) -> Path:
        n = self._count.get((batch, call.layer), 0)
        self._count[(batch, call.layer)] = n + 1
        name = f"layer_{call.layer:03d}" + (f"_call{n}" if n else "") + ".safetensors"
        path = self.run_dir / "capture" / f"batch_{batch:05d}" / name
        meta = {"call": json.dumps(call.metadata()), "prompts": json.dumps(list(prompts)), "run_id": self.run_id}
        with atomic_path(path, root=self.run_dir) as tmp:  # capture/ and its batch directory: no links
            save_file(call.tensors(), tmp, metadata=meta)
            # Hashed before the rename, while the file just written is in the page cache: the
            # manifest records exactly the bytes that take the shard's name.
            entry = {"sha256": sha256_file(tmp), "size": os.path.getsize(tmp)}
        self.shards[path.relative_to(self.run_dir).as_posix()] = entry
        self.layers.setdefault(call.layer, layer_entry(call))
        return path

    def finish(self, extra: dict | None = None, done: tuple[str, ...] = ("capture",)) -> None:
        """Rewrite the manifest with ``extra``, the layers and the shards, and mark ``done`` finished
        (complete if no other stage is set out)."""
        self.manifest.update(extra or {})
        self.manifest["layers"] = [self.layers[i] for i in sorted(self.layers)]
        self.manifest["shards"] = {name: self.shards[name] for name in sorted(self.shards)}
        finish_stage(self.run_dir, self.manifest, *done)


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
    """Reads a run directory's capture back, shard by shard (never all at once).

    Opening it refuses, before anything is written anywhere, a directory whose capture cannot be
    replayed — saying why: the run stored none (``--stream``), it is a what-if output, its capture did
    not finish, was deleted, or is not the set of shards the manifest lists (a file missing, one more,
    or a size that differs). :meth:`load` checks each shard's sha256 and run id as it reads it."""

    def __init__(self, run_dir: str | os.PathLike, manifest: dict | None = None, batches=None):
        """``manifest``: the run's manifest when it is not in ``run_dir`` (a rank on another machine
        gets rank 0's); ``batches``: a predicate on batch indices, to check and read only the shards of
        those batches (one rank's, whose directory may hold no others)."""
        self.run_dir = Path(run_dir)
        self.manifest = manifest = read_manifest(run_dir) if manifest is None else manifest
        self.run_id: str = manifest["run_id"]
        untouched = "its files are untouched"
        if manifest.get("counterfactual"):
            raise RunDirectoryError(
                f"{run_dir}: a what-if output (a counterfactual replay of {manifest.get('source_run')}), "
                f"which stores no capture of its own; {untouched}. Run what-if on the source run instead"
            )
        if manifest.get("merge_needed") and batches is None:
            # Rank 0's directory of a multi-node run without a shared file system: the other nodes'
            # shards are in their own --out, so the capture here is not damaged, only partial.
            raise RunDirectoryError(
                f"{run_dir}: rank 0's part of a run whose other ranks wrote under their own nodes' --out "
                f"(merge_needed); {untouched}. Assemble it with `osdn-diag merge {run_dir} NODE_DIR... "
                "--out MERGED` and use MERGED"
            )
        require_stage(run_dir, manifest, "capture")
        if manifest.get("capture_stored") is False:
            raise RunDirectoryError(
                f"{run_dir}: this run stored no capture (it was made with `run --stream`), so it cannot be "
                f"replayed again; {untouched}. Capture the model again without --stream"
            )
        self.expected: dict[str, dict] = manifest.get("shards", {})
        for name in self.expected:  # only the capture's own layout: nothing outside it is read
            check_file_name(name, self.run_dir / MANIFEST, shard=True)
        if batches is not None:
            self.expected = {n: e for n, e in self.expected.items() if batches(_batch_of(n))}
        root = self.run_dir / "capture"
        if self.expected and not root.is_dir():
            raise RunDirectoryError(
                f"{root}: the capture was deleted (manifest.json lists {len(self.expected)} shards); "
                f"{untouched}. Capture the model again to replay it"
            )
        found = {p.relative_to(self.run_dir).as_posix() for p in root.rglob("*")
                 if p.is_file() or p.is_symlink()} if root.is_dir() else set()
        if batches is not None:
            found = {n for n in found if (b := _batch_of(n)) is None or batches(b)}
        for name in sorted(set(self.expected) - found):
            raise RunDirectoryError(f"{self.run_dir / name}: missing (manifest.json lists it): the capture "
                                    f"is damaged; {untouched}. Capture the model again")
        for name in sorted(found - set(self.expected)):
            raise RunDirectoryError(f"{self.run_dir / name}: not part of this run (manifest.json does not "
                                    f"list it); remove it, or capture again; {untouched}")
        for name, entry in sorted(self.expected.items()):
            size = (self.run_dir / name).stat().st_size
            if size != entry["size"]:
                raise RunDirectoryError(f"{self.run_dir / name}: {size} bytes, manifest.json says "
                                        f"{entry['size']}: the shard was changed; capture again")

    def shards(self) -> list[Path]:
        """The manifest's shards, in (batch, layer) order."""
        return [self.run_dir / name for name in sorted(self.expected)]

    def __len__(self) -> int:
        return len(self.expected)

    def __iter__(self) -> Iterator[StoredCall]:
        for path in self.shards():
            yield self.load(path)

    def load(self, path: Path) -> StoredCall:
        """Read one shard, in one pass that also hashes it; refuse it if its sha256 or its run id is
        not what the manifest says."""
        path = Path(path)
        entry = self.expected.get(path.relative_to(self.run_dir).as_posix())
        if entry is None:
            raise RunDirectoryError(f"{path}: not part of this run (manifest.json does not list it)")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise RunDirectoryError(f"{path}: its sha256 differs from the one manifest.json records: the "
                                    "shard was changed or copied in from another run; capture again")
        try:
            meta = _safetensors_metadata(data)
            tensors = load_safetensors(data)
            call_meta = json.loads(meta["call"])
            prompts = [int(p) for p in json.loads(meta["prompts"])]
        except (KeyError, ValueError, OSError, SafetensorError) as err:
            raise ValueError(f"{path}: not a readable capture shard ({err}); capture the run again") from err
        if meta.get("run_id") != self.run_id:
            raise RunDirectoryError(f"{path}: belongs to run {meta.get('run_id')}, not to this run "
                                    f"({self.run_id}); capture again")
        batch = int(path.parent.name.removeprefix("batch_"))
        return StoredCall(batch=batch, prompts=prompts, call=KernelCall.from_parts(call_meta, tensors))


def _batch_of(name: str) -> int | None:
    """The batch index of ``capture/batch_BBBBB/...``, ``None`` for a name outside a batch directory."""
    parts = name.split("/")
    if len(parts) >= 3 and parts[1].startswith("batch_") and parts[1][6:].isdigit():
        return int(parts[1][6:])
    return None


def _safetensors_metadata(data: bytes) -> dict:
    """The ``__metadata__`` of a safetensors file's header: an 8-byte little-endian length, then JSON."""
    size = int.from_bytes(data[:8], "little")
    if len(data) < 8 or size > len(data) - 8:
        raise ValueError("truncated header")
    return json.loads(data[8 : 8 + size]).get("__metadata__") or {}


def to_device(call: KernelCall, device: torch.device | str) -> KernelCall:
    """A copy of ``call`` with every tensor on ``device``."""
    moved = {n: getattr(call, n).to(device) for n in TENSOR_FIELDS if getattr(call, n) is not None}
    return replace(call, **moved, extra={n: x.to(device) for n, x in call.extra.items()})
