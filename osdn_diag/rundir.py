"""A run directory is a unit: what ties its files together, and what a command may do to it.

Conventions (``manifest.json``):

* ``run_id``: a uuid4 hex, new for every ``capture``, ``run`` and ``what-if``. Every capture shard
  carries it in its safetensors metadata (``run_id``), every table in its parquet schema metadata
  (``osdn_diag.run_id``) and ``summary.json`` as ``run_id``; files whose id differs from the
  manifest's belong to another run and are refused.
* ``shards``: ``{"capture/batch_BBBBB/layer_LLL.safetensors": {"sha256": hex, "size": bytes}}``. The
  capture is exactly these files: one missing, one more, or one whose size or sha256 differs is
  refused, naming the file. The hash is taken as the shard is written and checked as it is read.
* ``stages``: ``{stage: done}`` for the stages of :data:`STAGES` the run has set out to do. A stage
  that starts writes itself and every later stage ``false`` before it writes any file (their files
  derive from its), and ``true`` after its last file. ``"complete": true`` means every stage set out
  is done; it is written only after the last file of the last one.

A command writes into a directory that already holds a run (any of :data:`RUN_FILES`) only when told
to (``--overwrite``), and only after its own inputs have loaded; it then removes the old run's files,
the manifest first, so that a failure leaves the old run or nothing that looks like one. Files of
other names are left alone.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path

from ._atomic import atomic_write_text
from ._json import dumps as strict_json

__all__ = [
    "MANIFEST",
    "RUN_FILES",
    "RUN_ID_KEY",
    "STAGES",
    "RunDirectoryError",
    "check_table_run_ids",
    "existing_run_files",
    "finish_stage",
    "new_run_id",
    "out_inside_input",
    "prepare_output",
    "sha256_file",
    "stage_done",
    "start_stage",
    "table_run_ids",
]

MANIFEST = "manifest.json"
#: stages in the order a run does them; a stage's files derive from those of the stages before it
STAGES = ("capture", "replay", "report")
#: the names a run writes into its directory (what ``--overwrite`` removes, manifest first)
RUN_FILES = (MANIFEST, "capture", "residuals.parquet", "comparator.parquet", "summary.json", "report.md",
             "plots")
#: the parquet schema-metadata key of the run id
RUN_ID_KEY = b"osdn_diag.run_id"
_CHUNK = 1 << 20


class RunDirectoryError(ValueError):
    """A run directory that cannot be used as asked (it holds another run, its files do not belong
    together, or the command would write over its own input)."""


def new_run_id() -> str:
    return uuid.uuid4().hex


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of a file, read in chunks (memory stays at one chunk)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def existing_run_files(out_dir: str | os.PathLike) -> list[str]:
    """The names of :data:`RUN_FILES` present in ``out_dir``."""
    out_dir = Path(out_dir)
    return [name for name in RUN_FILES if (out_dir / name).exists() or (out_dir / name).is_symlink()]


def prepare_output(out_dir: str | os.PathLike, *, overwrite: bool) -> None:
    """Make ``out_dir`` ready for a new run: refuse one that holds a run unless ``overwrite``, and then
    remove that run's files (the manifest first). Call only once the new run's inputs have loaded."""
    out_dir = Path(out_dir)
    found = existing_run_files(out_dir)
    if not found:
        return
    if not overwrite:
        raise RunDirectoryError(
            f"{out_dir}: already holds a run ({', '.join(found)}); pass --overwrite to replace it, or "
            "choose another --out"
        )
    for name in found:  # RUN_FILES order: the manifest goes first
        path = out_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _write(run_dir: Path, manifest: dict) -> None:
    manifest["complete"] = all(manifest["stages"].values())
    atomic_write_text(run_dir / MANIFEST, strict_json(manifest, indent=2))


def start_stage(run_dir: str | os.PathLike, manifest: dict, stage: str) -> None:
    """Record in ``manifest`` (and on disk) that ``stage`` has started: it and every later stage are
    not done, so the run is not complete."""
    stages = manifest.setdefault("stages", {})
    later = STAGES[STAGES.index(stage):]
    stages[stage] = False
    for name in stages:
        if name in later:
            stages[name] = False
    _write(Path(run_dir), manifest)


def finish_stage(run_dir: str | os.PathLike, manifest: dict, *stages: str) -> None:
    """Record that ``stages`` are done, after their last file; the run is complete if every stage it
    set out to do is."""
    for stage in stages:
        manifest.setdefault("stages", {})[stage] = True
    _write(Path(run_dir), manifest)


def stage_done(manifest: dict, stage: str) -> bool:
    return manifest.get("stages", {}).get(stage) is True


def table_run_ids(path: Path) -> list[tuple[Path, str | None]]:
    """``(file, run id)`` of a parquet table, a file or a directory of parts."""
    import pyarrow.parquet as pq

    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    out = []
    for f in files:
        meta = pq.read_schema(f).metadata or {}
        value = meta.get(RUN_ID_KEY)
        out.append((f, value.decode() if value is not None else None))
    return out


def check_table_run_ids(run_dir: str | os.PathLike, manifest: dict, summary: dict) -> None:
    """Refuse results that another run wrote: ``summary.json``, ``residuals.parquet`` (every part) and
    ``comparator.parquet`` must carry the manifest's run id."""
    run_dir, run_id = Path(run_dir), manifest.get("run_id")

    def refuse(path: Path, found) -> None:
        raise RunDirectoryError(
            f"{path}: belongs to another run (run id {found}, manifest.json says {run_id}): it was copied "
            f"or left here; run `osdn-diag replay {run_dir}` (or the whole run) again"
        )

    if summary.get("run_id") != run_id:
        refuse(run_dir / "summary.json", summary.get("run_id"))
    for name in ("residuals.parquet", "comparator.parquet"):
        if (run_dir / name).exists():
            for f, found in table_run_ids(run_dir / name):
                if found != run_id:
                    refuse(f, found)


def out_inside_input(run_dir: str | os.PathLike, out_dir: str | os.PathLike) -> bool:
    """Whether writing a run into ``out_dir`` would write over ``run_dir``'s own files: ``out_dir`` is
    ``run_dir`` itself or lies inside one of its :data:`RUN_FILES` (``capture/``, ``plots/``, …). A
    fresh subdirectory of ``run_dir`` (``what-if``'s default) is fine."""
    src, out = Path(run_dir).resolve(), Path(out_dir).resolve()
    try:
        rel = out.relative_to(src)
    except ValueError:
        return False
    return not rel.parts or rel.parts[0] in RUN_FILES
