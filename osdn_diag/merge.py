"""``osdn-diag merge DIR... --out OUT``: one run directory from the nodes' directories of a run made
under ``torchrun --nnodes N`` without a shared file system.

Each node wrote its ranks' parts under its own ``--out``: capture shards, ``residuals.parquet/part-RRRRR``
and ``ranks/rank-RRRRR.json``; rank 0's directory also holds the manifest (``"merge_needed": true``,
never complete), ``summary.json`` and ``comparator.parquet``, reduced through the process group.
Merging checks, before writing anything, that exactly one ``DIR`` holds the manifest, that every
key of it has the type osdn-diag writes (:func:`~osdn_diag.runtime.schema.check_manifest`), that its
capture and replay finished, that every rank of its world size left a record of this run id, and
that every file the manifest lists (every rank's shards and table parts) is in some ``DIR`` with the
size and sha256 recorded; a file of another run, a missing one or a changed one is refused, naming
it. Every name read from the manifest and the records must be one osdn-diag writes
(:func:`~osdn_diag.rundir.check_file_name`): a copy never lands outside ``OUT``.

``OUT`` is written under its lock (:func:`~osdn_diag.rundir.output_lock`), refused (a run there
without ``--overwrite``, a link, a foreign file in ``capture/``) before anything is written. Every
file is first copied, through a temporary name, into a hidden directory in ``OUT``
(``.osdn-diag-merge.XXXXXXXX``) beside the run ``OUT`` may hold, which stays whole meanwhile: Ctrl-C
or SIGTERM until the last copy removes the copies and leaves ``OUT`` as it was. Then, with both
signals held back (:func:`~osdn_diag.runtime.signals.signals_held`), the new manifest takes the old
one's place with no stage done, the old run's own files go, the copies are renamed in and the
manifest says capture and replay are done; the report then makes it complete. A merge killed outright
(SIGKILL) leaves the old run, or a run that says it is not complete (which ``--overwrite`` replaces),
and its copies, which the next merge into ``OUT`` removes, as does a command that writes a new run there
(``run``, ``capture``, ``what-if``: :func:`~osdn_diag.rundir.prepare_output`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .runtime.atomic import atomic_path, fsync_directory, real_directory, refuse_link
from .runtime.schema import check_manifest, check_summary
from .runtime.signals import signals_held
from .capture.store import IncompleteRunError
from .rundir import (
    MANIFEST,
    MERGE_STAGING_PREFIX,
    RANKS_DIR,
    UNREADABLE,
    RunDirectoryError,
    check_file_name,
    check_output,
    finish_stage,
    output_lock,
    reading_lock,
    read_rank_record,
    remove_merge_staging,
    remove_run_files,
    run_manifest,
    stage_done,
    table_run_ids,
    verify_files,
)

__all__ = ["merge_runs"]

_COPIED_FROM_RANK0 = ("summary.json", "comparator.parquet")


def merge_runs(dirs: list[str | os.PathLike], out: str | os.PathLike, *, overwrite: bool = False,
               report: bool = True) -> Path:
    """Assemble the run whose parts lie in ``dirs`` into ``out`` (see the module docstring); with
    ``overwrite`` a run ``out`` holds is replaced. Returns ``out``."""
    dirs = [Path(d) for d in dirs]
    out = Path(out)
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"{d}: no such directory; give the --out directory of each node")
        if d.resolve() == out.resolve():
            raise RunDirectoryError(f"--out {out}: one of the directories to merge; choose another --out")
    with reading_lock(*dirs):  # read, checked and copied with no command writing into them meanwhile
        return _merge(dirs, out, overwrite=overwrite, report=report)


def _merge(dirs: list[Path], out: Path, *, overwrite: bool, report: bool) -> Path:
    holders = [d for d in dirs if run_manifest(d) is not None]
    if len(holders) != 1:
        raise RunDirectoryError(
            f"{', '.join(map(str, holders or dirs))}: {'none' if not holders else len(holders)} of the "
            "directories holds a run's manifest.json; give rank 0's --out once, with the other nodes' --out"
        )
    src = holders[0]
    manifest = run_manifest(src)
    run_id, path = manifest["run_id"], src / MANIFEST
    # Every key read below has the type osdn-diag writes, refused naming this node's manifest (not OUT's,
    # after a copy) before anything is written.
    check_manifest(manifest, path, again="rerun the run")
    for stage in ("capture", "replay"):
        if stage in manifest["stages"] and not stage_done(manifest, stage):
            raise IncompleteRunError(f"{path}: the run did not finish (stages.{stage} is not true); rerun the "
                                     "same torchrun command to resume it, then merge")
    world = manifest.get("world_size")
    if not isinstance(world, int) or world < 2:
        raise RunDirectoryError(f"{path}: not a run of several processes (world_size {world}); nothing to merge")
    records: dict[int, Path] = {}
    for d in dirs:
        for record_path in sorted((d / RANKS_DIR).glob("rank-*.json")):
            record = read_rank_record(record_path)
            if record is None:
                raise RunDirectoryError(f"{record_path}: not a readable rank record; rerun the run")
            if record["run_id"] != run_id:
                raise RunDirectoryError(
                    f"{record_path}: of run {record['run_id']}, not of {run_id} ({path}): that directory "
                    "holds another run; leave it out and give this run's nodes' --out"
                )
            records.setdefault(record["rank"], record_path)
    for rank in range(world):
        if rank not in records:
            raise RunDirectoryError(
                f"rank {rank}: no {RANKS_DIR}/rank-{rank:05d}.json of run {run_id} in {', '.join(map(str, dirs))}; "
                "give the --out directory of the node it ran on"
            )
    files = {**manifest.get("shards", {}), **manifest.get("parts", {})}
    for name in files:  # before any path is made of it
        check_file_name(name, path)
    files.update(_tokens_file(manifest))  # a fixed name, written by rank 0 beside the manifest
    where: dict[str, Path] = {}
    for name, entry in sorted(files.items()):
        found = [d for d in dirs if (d / name).is_file()]
        if not found:
            raise RunDirectoryError(f"{name}: in none of {', '.join(map(str, dirs))} ({path} lists it); give "
                                    "the --out directory of every node")
        good = [d for d in found if verify_files(d, {name: entry}) is None]
        if not good:
            raise RunDirectoryError(f"{found[0] / name}: its size or sha256 differs from the one {path} "
                                    "records (changed, or of another run); rerun the run")
        where[name] = good[0]
    recorded = manifest.get("files") or {}
    for name in _COPIED_FROM_RANK0:
        if name != "comparator.parquet" and not (src / name).is_file():
            raise RunDirectoryError(f"{src / name}: missing; rerun the run")
        if name in recorded and verify_files(src, {name: recorded[name]}) is not None:
            # Checked here, not only by the report of OUT: an edited summary is never assembled into a run.
            raise RunDirectoryError(f"{src / name}: its size or sha256 differs from the one {path} records "
                                    "(changed after the run wrote it); rerun the run")
    _check_summary(src / "summary.json", run_id, path)  # read by OUT's report: refused here, naming rank 0's
    if (src / "comparator.parquet").is_file():
        for table, found in table_run_ids(src / "comparator.parquet"):
            if found is not UNREADABLE and found != run_id:
                raise RunDirectoryError(f"{table}: of run {found}, not of {run_id} ({path}): copied or left "
                                        "there; rerun the run")

    with output_lock(out):
        # Refused (a run there without --overwrite, a link, a file in capture/ that is not a shard)
        # before anything is written.
        check_output(out, overwrite=overwrite)
        merged = {**manifest, "merge_needed": False, "merged_from": [str(d) for d in dirs]}
        stages = dict(merged["stages"])
        staging = _new_staging(out)
        try:
            # Copied beside OUT's run, which a signal (Ctrl-C, SIGTERM) until the last copy leaves as it was.
            for name, d in where.items():
                _copy(d / name, staging, name)
            for rank, record_path in sorted(records.items()):
                _copy(record_path, staging, f"{RANKS_DIR}/{record_path.name}")
            for name in _COPIED_FROM_RANK0:
                if (src / name).is_file():
                    _copy(src / name, staging, name)
            with signals_held():  # the old run (or none) to the new one, never stopped half way
                merged["stages"] = dict.fromkeys(stages, False)
                finish_stage(out, merged)  # first, no stage done: a merge killed now is no complete run
                remove_run_files(out)  # the old run's own files
                _move_in(staging, out)
                finish_stage(out, merged, *(stage for stage in stages if stage != "report"))  # last
        finally:
            with signals_held():
                shutil.rmtree(staging, ignore_errors=True)
        if report and "report" in stages:
            from .report import write_report

            write_report([out])
    return out


def _new_staging(out: Path) -> Path:
    """A new, empty directory in ``out`` for the merged files, after removing those of killed merges
    (under OUT's lock: nobody else's; a command that writes a new run into OUT removes them too)."""
    remove_merge_staging(out)
    return Path(tempfile.mkdtemp(prefix=MERGE_STAGING_PREFIX, dir=out))


def _move_in(staging: Path, out: Path) -> None:
    """Every file below ``staging`` to the same name below ``out``, renamed (no link on the way), each
    directory's new entries flushed to disk."""
    directories = set()
    for path in sorted(p for p in staging.rglob("*") if p.is_file() and not p.is_symlink()):
        target = out / path.relative_to(staging)
        real_directory(out, target.parent)
        refuse_link(target)
        os.replace(path, target)
        directories.add(target.parent)
    for directory in sorted(directories):
        fsync_directory(directory)


def _check_summary(path: Path, run_id: str, manifest_path: Path) -> None:
    """Refuse rank 0's ``summary.json`` unless it is JSON of the types osdn-diag writes
    (:func:`~osdn_diag.runtime.schema.check_summary`) and of the run ``run_id``, naming it."""
    import json

    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise RunDirectoryError(f"{path}: not valid JSON ({err}); rerun the run") from None
    check_summary(summary, path, again="rerun the run")
    if summary.get("run_id") != run_id:
        raise RunDirectoryError(f"{path}: of run {summary.get('run_id')}, not of {run_id} ({manifest_path}): "
                                "copied or left there; rerun the run")


def _tokens_file(manifest: dict) -> dict:
    """``{"tokens.parquet": {"sha256", "size"}}`` where the run has one (rank 0 wrote it beside the
    manifest; checked and copied like the files the ranks wrote), else ``{}``."""
    entry = manifest.get("tokens")
    if not isinstance(entry, dict) or "sha256" not in entry:
        return {}
    return {"tokens.parquet": {"sha256": entry["sha256"], "size": entry["size"]}}


def _copy(src: Path, root: Path, name: str) -> None:
    """``src`` to ``root/name`` through a temporary file and a rename, no link on the way
    (``name`` is one osdn-diag writes, checked by the caller)."""
    with atomic_path(root / name, root=root) as tmp:
        shutil.copyfile(src, tmp)
