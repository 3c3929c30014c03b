"""Resuming an unfinished run: which earlier attempt can be continued, the refusal when its inputs
changed, and each rank's verified record of what it already captured (several processes)."""

from __future__ import annotations

from pathlib import Path


from ..runtime.atomic import remove_stale_temporaries
from ..runtime.strict_json import dumps as strict_json
from ..rundir import (
    MANIFEST,
    RANKS_DIR,
    RunDirectoryError,
    check_capture_files,
    check_table_files,
    check_links,
    check_placement,
    existing_run_files,
    prepare_output,
    rank_record_path,
    read_rank_record,
    remove_run_files,
    run_manifest,
    stage_done,
    verify_files,
)
from .writers import COMPARATOR, RESIDUALS, SUMMARY


def _resumable(out_dir: Path, settings: dict, world: int, identity: dict | None = None) -> dict | None:
    """The manifest of the unfinished run in ``out_dir`` that this command resumes, else ``None``.

    A run made by several processes is resumed by the same command (the same ``settings``) when it
    did not finish; it must be rerun with as many processes as it had (``--nnodes`` ×
    ``--nproc-per-node``), since which rank owns which batch depends on it: otherwise it is refused,
    saying so. A finished run, a run of other settings, or one of a single process is not resumed
    (:func:`~osdn_diag.rundir.prepare_output` then refuses it without ``--overwrite``).

    Settings name the inputs; ``identity`` (:mod:`osdn_diag.identity`) is what those names held. A
    run of the same settings whose inputs changed since (a prompt file edited, weights replaced,
    another torch) is refused, saying what changed: resuming it would publish the old inputs'
    captures, or a mix of old and new, as one complete run."""
    manifest = run_manifest(out_dir)
    if manifest is None and world > 1:
        manifest = _node_parts(out_dir)
    if manifest is None or manifest.get("complete") or manifest.get("settings") != settings:
        return None
    if manifest.get("merge_needed") and stage_done(manifest, "replay"):
        return None  # finished, its parts on several machines: `osdn-diag merge` is what is left
    had = manifest.get("world_size")
    if had == world == 1 or not isinstance(had, int):
        return None
    if had != world:
        raise RunDirectoryError(
            f"{out_dir}: holds an unfinished run of this command made by {had} processes (--nnodes × "
            f"--nproc-per-node), and this one has {world}: resume it with {had} processes, or pass "
            "--overwrite to start again"
        )
    if identity is not None:
        _refuse_changed_inputs(out_dir, manifest.get("identity"), identity)
    return manifest


def _refuse_changed_inputs(out_dir: Path, recorded, identity: dict) -> None:
    """Refuse to resume the unfinished run in ``out_dir`` when what it read (``recorded``) is not what
    this command reads (``identity``): one line saying what changed and what to do."""
    from ..identity import identity_change

    change = identity_change(recorded, identity)
    if change is not None:
        raise RunDirectoryError(
            f"{out_dir}: holds an unfinished run of this command, but {change} since it started: "
            "resuming would mix captures of other inputs into this run; pass --overwrite to start "
            "again, or choose another --out"
        )


def _node_parts(out_dir: Path) -> dict | None:
    """What a node's own ``--out`` (no manifest: rank 0 was on another node) says of the run its parts
    belong to, ``{"run_id", "settings", "world_size"}`` from its rank records when they all agree, else
    ``None``. Rank 0 moves between nodes from one launch to the next under the c10d rendezvous."""
    records = [read_rank_record(p) for p in sorted((out_dir / RANKS_DIR).glob("rank-*.json"))]
    if not records or any(r is None for r in records):
        return None
    keys = {(r["run_id"], strict_json(r.get("settings")), r.get("world_size"), strict_json(r.get("identity")))
            for r in records}
    if len(keys) != 1:
        return None
    return {"run_id": records[0]["run_id"], "settings": records[0].get("settings"),
            "world_size": records[0].get("world_size"), "identity": records[0].get("identity")}


def _prepare_node_output(out_dir: Path, run_id: str, *, overwrite: bool, resume: bool) -> None:
    """Make ready a node's own ``--out`` (one where rank 0's manifest is not: no shared file system).
    Resuming, the parts this node wrote for the same run stay (each rank verifies its own); anything
    else of a run is refused, or removed with ``overwrite`` (that run's own files only)."""
    check_placement(out_dir)
    found = existing_run_files(out_dir)
    if not found:
        return
    check_links(out_dir)
    records = [read_rank_record(p) for p in sorted((out_dir / RANKS_DIR).glob("rank-*.json"))]
    manifest = run_manifest(out_dir)
    if resume and manifest is not None and manifest["run_id"] == run_id:
        # Rank 0's files of an earlier attempt at this run, when rank 0 was on this node: rank 0 is now
        # on another one, which writes them. The parts stay.
        for name in (MANIFEST, SUMMARY, COMPARATOR):
            (out_dir / name).unlink(missing_ok=True)
        manifest = None
    if resume and manifest is None and all(r is not None and r["run_id"] == run_id for r in records):
        # Temporaries of the ranks killed here (rank 0's begin removed those where --out is shared).
        for directory in (out_dir, out_dir / RANKS_DIR, out_dir / RESIDUALS, *sorted((out_dir / "capture").glob("batch_*"))):
            if directory.is_dir():
                remove_stale_temporaries(directory)
        return
    if not overwrite:
        raise RunDirectoryError(f"{out_dir}: already holds files of another run ({', '.join(found)}); pass "
                                "--overwrite to replace them, or choose another --out")
    if manifest is not None:
        prepare_output(out_dir, overwrite=True)
    else:
        check_capture_files(out_dir)  # before anything is removed
        check_table_files(out_dir)
        remove_run_files(out_dir)


def _verified_record(out_dir: Path, ranks, run_id: str, identity: dict | None = None) -> tuple[dict | None, str]:
    """This rank's record of an earlier attempt at run ``run_id`` if it is that rank's, of the same world
    size and inputs (``identity``), and every shard it lists is under ``out_dir`` with its size and
    sha256; else ``None`` and why."""
    path = rank_record_path(out_dir, ranks.rank)
    record = read_rank_record(path)
    if record is None:
        return None, f"no readable {path}"
    if record["run_id"] != run_id or record["rank"] != ranks.rank or record.get("world_size") != ranks.world:
        return None, f"{path} is of run {record['run_id']} rank {record['rank']} of {record.get('world_size')}"
    if identity is not None and record.get("identity") != identity:
        return None, f"{path} records other inputs than this command's"
    problem = verify_files(out_dir, record.get("shards", {}))
    if problem is not None:
        return None, problem
    if not all(isinstance(record.get(k), dict) for k in ("layers", "hits")):
        return None, f"{path}: damaged"
    return record, ""
