"""The replay stage: :func:`replay_run` reads a run's stored capture (every rank's shards) and
writes ``residuals.parquet``, ``comparator.parquet`` and ``summary.json``; the replay itself is
:class:`osdn_diag.replay.Replayer`."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


from ..runtime.atomic import remove_stale_temporaries
from ..runtime.strict_json import dumps as strict_json
from ..capture.store import CaptureReader, StoredCall, atomic_write_text
from ..rundir import (
    MANIFEST,
    RANKS_DIR,
    RunDirectoryError,
    check_links,
    check_table_files,
    finish_stage,
    output_lock,
    rank_record_path,
    read_rank_record,
    run_manifest,
    sha256_file,
    start_stage,
    write_rank_record,
)
from ..replay import Replayer
from ..replay.replayer import table_kind
from .inputs import _progress
from .recall import recall_table
from .writers import COMPARATOR, RESIDUALS, SUMMARY, _atomic_parquet, _residuals_writer, _with_run_id


_check_links = check_links  # _rank_reader's parameter of that name shadows it


def replay_run(
    run_dir: str | os.PathLike,
    *,
    progress: bool = True,
    out_dir: str | os.PathLike | None = None,
    extra: dict | None = None,
    run_id: str | None = None,
    recall: bool = True,
    **replay_kw,
) -> dict:
    """Replay every captured call of ``run_dir`` and write ``residuals.parquet`` and ``summary.json``.

    Into ``run_dir`` itself (the default) this is the run's replay stage: the manifest says it has
    started before any table is written and finished after the summary. A directory whose capture
    cannot be replayed (see :class:`~osdn_diag.capture.store.CaptureReader`) is refused before
    anything is written, its tables untouched.

    Args:
        run_dir: a capture directory whose capture stage finished.
        progress: show a progress bar.
        out_dir: where to write (default ``run_dir``); its manifest, if it needs one, is the caller's.
        extra: entries added to the summary.
        run_id: the run id the tables carry (default ``run_dir``'s; a what-if output's is its own).
        recall: report the recall accuracy measured on the captured forward pass (a counterfactual
            replay has none of its own, so what-if turns it off).
        replay_kw: :class:`Replayer` options — ``backend`` (``"torch"``, ``"triton"`` or ``"auto"``:
            Triton on CUDA, torch otherwise), ``dtype`` (fp32 or fp64), ``device`` (default CUDA when
            available), ``tolerance`` (fidelity; default per kernel and dtype), ``transform`` (applied
            to every call before replay, e.g. the what-if preconditioner), ``retained`` (also measure
            retained associations).

    Returns the summary dictionary that was written to ``summary.json`` (on rank 0 of several
    processes; ``{}`` on the others, see :mod:`osdn_diag.distributed`).
    """
    run_dir = Path(run_dir)
    with output_lock(run_dir if out_dir is None else out_dir):
        return _replay(run_dir, progress=progress, out_dir=out_dir, extra=extra, run_id=run_id, recall=recall,
                       **replay_kw)


def _replay(run_dir: Path, *, progress, out_dir, extra, run_id, recall, **replay_kw) -> dict:
    from .. import distributed

    ranks = distributed.current()
    # Every shard is where the manifest says, with its size, before the manifest is touched; each one's
    # sha256 is checked as it is read, below.
    in_place = out_dir is None or Path(out_dir).resolve() == run_dir.resolve()
    reader = _rank_reader(run_dir, ranks, check_links=in_place)
    out_dir = run_dir if in_place else Path(out_dir)
    run_id = run_id or reader.manifest.get("run_id")
    out_dir.mkdir(parents=True, exist_ok=True)
    before = dict(reader.manifest.get("stages", {}))
    # Until _finish_replay the run's tables are its old ones (residuals.parquet is replaced by a rename
    # at the end), except where rank 0 removes a directory of parts first: then they are gone.
    tables_kept = ranks.world == 1 and not (out_dir / RESIDUALS).is_dir()
    if ranks.is_main:  # the other ranks write only into residuals.parquet/, which rank 0 recreates
        remove_stale_temporaries(out_dir)
        if in_place:
            start_stage(run_dir, reader.manifest, "replay")
    try:
        prompts = {int(p["id"]): p for p in reader.manifest.get("prompts", [])}
        replay_kw.setdefault("device", ranks.device())
        replayer = Replayer(prompts, **replay_kw)
        shards = [p for p in reader.shards() if ranks.owns(int(p.parent.name.removeprefix("batch_")))]
        with _residuals_writer(out_dir, replayer.schema, ranks, run_id) as residuals:
            residuals.expect(table_kind(layer) for layer in reader.manifest.get("layers", []))
            for stored in _progress(_read_ahead(reader, shards), len(shards), progress and ranks.is_main,
                                    "replay", "call"):
                residuals.write(replayer.add(stored, table=False))  # its rows built on the writer's rows thread
    except BaseException:
        # Nothing of this replay took a name (a changed shard, a failure, Ctrl-C): the tables are still
        # the ones the manifest described, so its stages go back to what they were.
        if in_place and ranks.is_main and tables_kept:
            reader.manifest["stages"] = before
            finish_stage(run_dir, reader.manifest)
        raise
    prompt_entries = reader.manifest.get("prompts", []) if recall else []
    parts = dict(residuals.part)
    if ranks.world > 1 and in_place:
        path = rank_record_path(run_dir, ranks.rank)
        record = read_rank_record(path)
        if record is None or record["run_id"] != run_id:
            record = {"run_id": run_id, "rank": ranks.rank, "world_size": ranks.world}
        write_rank_record(run_dir, ranks.rank, {**record, "residuals": parts})
    summary = _finish_replay(replayer, ranks, out_dir, prompt_entries, extra, run_id=run_id, parts=parts)
    if in_place and ranks.is_main:
        if ranks.world > 1:
            reader.manifest["parts"] = dict(sorted(parts.items()))
        record_result_files(run_dir, reader.manifest)
        finish_stage(run_dir, reader.manifest, "replay")
    return summary


def record_result_files(out_dir: Path, manifest: dict) -> None:
    """Record in ``manifest`` (``files``) the sha256 and size of the replay's ``summary.json`` and
    ``comparator.parquet``, as the shards' are (an edited summary would otherwise be reported and
    merged as the run's), and the size and row count of a ``residuals.parquet`` file. Called just before the replay stage is marked done; checked on read
    (:func:`osdn_diag.replay.load_run`)."""
    manifest["files"] = {name: {"sha256": sha256_file(Path(out_dir) / name),
                                "size": (Path(out_dir) / name).stat().st_size}
                         for name in (SUMMARY, COMPARATOR) if (Path(out_dir) / name).is_file()}
    table = Path(out_dir) / RESIDUALS
    if table.is_file():
        # The per-token table (a file: one process wrote it) by its size and row count, read from its
        # footer: an edited or filtered table is refused on read, at no cost. Hashing it would read
        # every byte twice (0.44 GB at paper scale) on the command's path and on every report.
        import pyarrow.parquet as pq

        manifest["files"][RESIDUALS] = {"size": table.stat().st_size, "rows": pq.ParquetFile(table).metadata.num_rows}


#: what a replay writes into the run it replays (a link at any of these names is refused)
_REPLAY_FILES = (MANIFEST, RESIDUALS, COMPARATOR, SUMMARY, RANKS_DIR)


def _rank_reader(run_dir: Path, ranks, check_links: bool = False) -> CaptureReader:
    """The capture reader of this rank: under several processes rank 0 reads the manifest (and checks
    the whole capture where every rank's shards are in its directory) and hands it to every rank,
    which checks and reads only its own batches' shards, in its own directory (another machine's,
    without a shared file system). A refusal on rank 0 is raised on every rank. ``check_links``: the
    replay writes into ``run_dir``, where rank 0 first refuses a link at a name it writes."""
    if ranks.world == 1:
        if check_links:
            _check_links(run_dir, _REPLAY_FILES)
            check_table_files(run_dir)  # else its old table directory cannot be replaced
        return CaptureReader(run_dir)
    reader, message = None, None
    if ranks.is_main:
        try:
            if check_links:
                _check_links(run_dir, _REPLAY_FILES)
                check_table_files(run_dir)
            manifest = run_manifest(run_dir)
            shared = manifest is None or manifest.get("shared_out", True)
            reader = CaptureReader(run_dir, batches=None if shared else ranks.owns)
        except (ValueError, OSError, RuntimeError) as err:
            message = str(err)
            ranks.broadcast((message, None))
            raise
    message, manifest = ranks.broadcast((message, None if reader is None else reader.manifest))
    if message is not None:
        raise RunDirectoryError(f"rank 0: {message}")
    return reader or CaptureReader(run_dir, manifest=manifest, batches=ranks.owns)


def _read_ahead(reader: CaptureReader, paths: list[Path]) -> Iterator[StoredCall]:
    """The shards, each read, hashed and checked on a thread while the one before it is replayed (file
    reads and sha256 release the GIL), so that verifying the capture costs little wall time. At most
    two shards are in memory."""
    from concurrent.futures import ThreadPoolExecutor

    if not paths:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-reader") as pool:
        pending = pool.submit(reader.load, paths[0])
        for following in [*paths[1:], None]:
            stored = pending.result()
            if following is not None:
                pending = pool.submit(reader.load, following)
            yield stored


def _finish_replay(replayer: Replayer, ranks, out_dir: Path, prompt_entries: list[dict],
                   extra: dict | None = None, *, run_id: str | None = None, parts: dict | None = None) -> dict:
    """Reduce every rank's statistics on rank 0 and write ``comparator.parquet`` and ``summary.json``
    there, both carrying ``run_id``; returns the summary on rank 0, ``{}`` on the others. ``parts``:
    this rank's part of ``residuals.parquet`` (see :func:`_residuals_writer`); every rank's are
    gathered into ``parts`` on rank 0 (the caller records them in the manifest)."""
    from .. import distributed

    distributed.fault_point("replayed")
    states = ranks.gather((replayer.state(), dict(parts or {})))
    if parts is not None:
        for _, part in states:
            parts.update(part)
    states = [state for state, _ in states]
    if not ranks.is_main:
        ranks.barrier()
        return {}
    for state in states[1:]:
        other = Replayer.__new__(Replayer)
        other.__dict__.update(state)
        replayer.merge(other)
    comparator = replayer.comparator_table()
    if comparator is not None:
        _atomic_parquet(comparator.replace_schema_metadata(_with_run_id(comparator.schema, run_id).metadata),
                        out_dir / COMPARATOR, root=out_dir)
    summary = {"run_id": run_id, **replayer.summary()}
    recall = recall_table({"prompts": prompt_entries})
    if recall:
        summary["recall"] = recall
    summary.update(extra or {})
    if ranks.world > 1:
        summary["world_size"] = ranks.world
    atomic_write_text(out_dir / SUMMARY, strict_json(summary, indent=2), root=out_dir)
    ranks.barrier()
    return summary
