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

What is a run, and what ``--overwrite`` removes:

* A directory is a run only if its ``manifest.json`` is a JSON object with a ``run_id`` and
  ``stages`` (what osdn-diag writes). A directory that is not a run but holds any name a run would
  write (:data:`RUN_FILES`: ``report.md``, ``plots/``, ``capture/``, …) is refused as an output, with
  or without ``--overwrite``: those files are someone else's. A comparison report directory
  (``report A B --out CMP``) has a manifest with ``"kind": "report"`` and no run id: it is not a run.
* A command writes into a run only when told to (``--overwrite``), and only after its own inputs have
  loaded. It then removes that run's own files and nothing else: the manifest first (a failure
  leaves the old run or nothing that looks like one), the shards the manifest lists (then empty
  ``capture/batch_*`` and ``capture/``), ``residuals.parquet`` (a file, or a directory of
  ``part-RRRRR.parquet``), ``comparator.parquet``, ``summary.json``, ``tokens.parquet``, ``report.md`` and, in ``plots/``,
  the files of :data:`PLOT_FILES` (then ``plots/`` if empty). Other files stay where they are.
* Under ``torchrun`` every rank records its parts in ``ranks/rank-RRRRR.json`` (:func:`write_rank_record`:
  run id, rank, world size, its shards and its table part with their sha256). An unfinished run of
  the same command and world size is resumed rather than refused (see ``osdn_diag.pipeline``), each
  rank's record checked with :func:`verify_files` before its capture is kept.
* Every command that writes into a directory holds :func:`output_lock` on it for as long as it runs
  (``DIR/.osdn-diag.lock``, an exclusive ``flock``; on rank 0 only under ``torchrun``, a process of
  its own being rank 0 whatever ``RANK`` says: :mod:`osdn_diag.runtime.launcher`): a second
  command on the same directory fails at once instead of interleaving its files with the first's. A
  lock path that is not a regular file of a single name (a link, a directory, a hard link) is refused.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .runtime.atomic import atomic_write_text, is_temporary, refuse_link, remove_stale_temporaries
from .runtime.strict_json import dumps as strict_json

__all__ = [
    "IncompleteRunError",
    "LOCK_FILE",
    "MANIFEST",
    "PLOT_FILES",
    "RUN_FILES",
    "RANKS_DIR",
    "RUN_ID_KEY",
    "STAGES",
    "RunDirectoryError",
    "read_manifest",
    "require_stage",
    "check_capture_files",
    "check_file_name",
    "check_table_files",
    "check_links",
    "check_output",
    "check_file_placement",
    "check_placement",
    "check_regular",
    "check_table_run_ids",
    "enclosing_runs",
    "existing_run_files",
    "finish_stage",
    "foreign_capture_files",
    "is_report_dir",
    "new_run_id",
    "out_inside_input",
    "output_lock",
    "prepare_output",
    "rank_record_path",
    "read_rank_record",
    "reading_lock",
    "write_rank_record",
    "verify_files",
    "wait_for_lock",
    "remove_merge_staging",
    "remove_rank_records",
    "remove_report_files",
    "remove_run_files",
    "run_manifest",
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
             "plots", "ranks", "tokens.parquet")
#: the directory of the per-rank records of a run made by several processes
RANKS_DIR = "ranks"
#: the files a report writes into ``plots/`` (each figure as PNG and PDF); nothing else there is ours
PLOT_FILES = tuple(f"{name}.{ext}" for name in ("contraction", "q_geo", "by_layer", "layer_head", "retained",
                                                 "eps_vs_q", "d_trajectory") for ext in ("png", "pdf"))
#: the lock file of a directory a command is writing into (not a run file: never removed by
#: ``--overwrite``; removed by the command holding it when it finishes)
LOCK_FILE = ".osdn-diag.lock"
#: the parquet schema-metadata key of the run id
RUN_ID_KEY = b"osdn_diag.run_id"
_CHUNK = 1 << 20


class RunDirectoryError(ValueError):
    """A run directory that cannot be used as asked (it holds another run, its files do not belong
    together, or the command would write over its own input)."""


def new_run_id() -> str:
    return uuid.uuid4().hex


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of a regular file, read in chunks (memory stays at one chunk). Anything else at
    ``path`` (a FIFO, a device, a socket, a link to one) is refused (:class:`RunDirectoryError`)
    without waiting for a writer that may never come: it is opened without blocking and checked."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RunDirectoryError(_not_regular(path))
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as fh:
            fd = -1
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    finally:
        if fd >= 0:
            os.close(fd)
    return digest.hexdigest()


def _not_regular(path) -> str:
    return (f"{path}: not a regular file (a FIFO, a device, a socket or a link to one), where osdn-diag "
            "reads a file it wrote; it is left alone: remove it, and run the command that writes it again")


def check_regular(path: str | os.PathLike, *, table: bool = False) -> None:
    """Refuse (:class:`RunDirectoryError`) ``path`` if something is there that is not a regular file —
    a FIFO, a device, a socket, a link to one —: a reader would wait on it forever (pyarrow retries an
    interrupted open, so not even SIGTERM ends the wait) or read without end. With ``table``, a
    directory of ``*.parquet`` parts is fine if each part is a regular file. Nothing there: fine (the
    caller says what is missing). Reading follows links as usual."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if table and stat.S_ISDIR(mode):
        for part in path.glob("*.parquet"):
            check_regular(part)
        return
    if not stat.S_ISREG(mode):
        raise RunDirectoryError(_not_regular(path))


def existing_run_files(out_dir: str | os.PathLike) -> list[str]:
    """The names of :data:`RUN_FILES` present in ``out_dir``."""
    out_dir = Path(out_dir)
    return [name for name in RUN_FILES if (out_dir / name).exists() or (out_dir / name).is_symlink()]


def _read_json_object(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def run_manifest(directory: str | os.PathLike) -> dict | None:
    """``directory``'s manifest if the directory is a run (a manifest with a run id and stages, as
    osdn-diag writes it), else ``None``."""
    path = Path(directory) / MANIFEST
    manifest = _read_json_object(path) if path.is_file() and not path.is_symlink() else None
    if manifest is None or not isinstance(manifest.get("run_id"), str) or not isinstance(manifest.get("stages"), dict):
        return None
    return manifest


def is_report_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` is a comparison report that osdn-diag wrote (its manifest says
    ``"kind": "report"``)."""
    path = Path(directory) / MANIFEST
    manifest = _read_json_object(path) if path.is_file() and not path.is_symlink() else None
    return manifest is not None and manifest.get("kind") == "report" and "run_id" not in manifest


def enclosing_runs(path: str | os.PathLike) -> list[Path]:
    """The runs ``path`` lies inside (its ancestors that are runs, nearest first; not ``path``)."""
    return [parent for parent in Path(path).resolve().parents if run_manifest(parent) is not None]


def check_placement(out_dir: str | os.PathLike) -> None:
    """Refuse ``out_dir`` inside the files of a run (``B/capture``, ``B/plots/x``, …)."""
    out_dir = Path(out_dir)
    for run in enclosing_runs(out_dir)[:1]:
        if out_dir.resolve().relative_to(run).parts[0] in RUN_FILES:
            raise RunDirectoryError(f"--out {out_dir}: inside the files of the run {run}; choose another --out")


#: What a comparison report directory (``report A B --out CMP``) holds of its own.
REPORT_DIR_FILES = (MANIFEST, "report.md", "plots")


def check_file_placement(path: str | os.PathLike, what: str = "--out") -> None:
    """Refuse (:class:`RunDirectoryError`) ``path`` as a file a command writes on its own (``view``'s
    page, ``prove``'s ledger) where it is one of the files of a run or of a comparison report — a name
    of :data:`RUN_FILES` (or :data:`REPORT_DIR_FILES`) in such a directory, something below one, or its
    lock file —: the page would replace them (``summary.json``, a capture shard), or add a file to
    ``capture/`` that every later replay refuses. A new file beside them (``RUN/view.html``) is fine.
    Writes nothing."""
    path = Path(path)
    resolved = path.resolve()
    for directory in resolved.parents:
        if run_manifest(directory) is not None:
            kind, names = "run", RUN_FILES
        elif is_report_dir(directory):
            kind, names = "comparison report", REPORT_DIR_FILES
        else:
            continue
        parts = resolved.relative_to(directory).parts
        first = parts[0]
        if first in names or first == LOCK_FILE:
            where = "one of the files" if len(parts) == 1 else f"inside {first}/"
            raise RunDirectoryError(f"{what} {path}: {where} of the {kind} {directory}, which writing it would "
                                    "replace or damage; give a path beside them or elsewhere")


def check_output(out_dir: str | os.PathLike, *, overwrite: bool) -> dict | None:
    """Refuse ``out_dir`` as the directory of a new run — it is not a run but holds names a run writes,
    or it holds a run and not ``overwrite``, or it lies inside a run's own files — and return the
    manifest of the run it holds (``None``: nothing to replace). Writes nothing."""
    out_dir = Path(out_dir)
    check_placement(out_dir)
    found = existing_run_files(out_dir)
    if not found:
        return None
    manifest = run_manifest(out_dir)
    if manifest is None:
        raise RunDirectoryError(
            f"{out_dir}: not an osdn-diag run directory, but it holds {', '.join(found)}, which a run "
            "would write; choose another --out"
        )
    if not overwrite:
        raise RunDirectoryError(
            f"{out_dir}: already holds a run ({', '.join(found)}); pass --overwrite to replace it, or "
            "choose another --out"
        )
    # Everything that would refuse the directory is checked here, before prepare_output removes a file.
    check_links(out_dir)
    check_capture_files(out_dir)
    check_table_files(out_dir)
    return manifest


def check_links(out_dir: str | os.PathLike, names=RUN_FILES) -> None:
    """Refuse ``out_dir`` (:class:`~osdn_diag.runtime.atomic.LinkError`) if a name a command writes there is
    a symbolic link: one of ``names``, and below them the package's own names (anything in
    ``capture/``, ``ranks/`` and a ``residuals.parquet/`` directory; :data:`PLOT_FILES` in ``plots/``).
    Writing through a link would change files outside the run, and replacing one would break what
    the user linked it for: the link is the user's to remove. Writes nothing."""
    out_dir = Path(out_dir)
    for path in _own_paths(out_dir, names):
        refuse_link(path)


def _own_paths(out_dir: Path, names):
    """``out_dir/name`` for each of ``names``, and what the package writes below those that are real
    directories (see :func:`check_links`)."""
    for name in names:
        path = out_dir / name
        yield path
        if not _real_dir(path):
            continue
        if name == "plots":
            yield from (path / plot for plot in PLOT_FILES)
        elif name in ("capture", RANKS_DIR, "residuals.parquet"):
            for entry in path.iterdir():
                yield entry
                if name == "capture" and _real_dir(entry):
                    yield from entry.iterdir()


def check_capture_files(out_dir: str | os.PathLike) -> None:
    """Refuse ``out_dir`` if its ``capture/`` holds anything osdn-diag does not write there
    (:func:`foreign_capture_files`), naming the first: a run's capture is exactly its listed shards,
    so a capture written beside it would be refused at its replay, every time. Writes nothing."""
    foreign = foreign_capture_files(out_dir)
    if foreign:
        raise RunDirectoryError(
            f"{foreign[0]}: not a file osdn-diag writes, in capture/ (which holds only its "
            "batch_BBBBB/layer_LLL.safetensors shards), where a new capture would not replay beside it; move "
            f"it out of {Path(out_dir) / 'capture'}, or choose another --out"
        )


def foreign_capture_files(out_dir: str | os.PathLike) -> list[Path]:
    """What ``out_dir/capture`` holds that osdn-diag does not write there, sorted: anything but
    ``batch_BBBBB`` directories holding ``layer_LLL[_callN].safetensors`` shards and the temporaries
    of killed writers (a link is foreign, whatever its name)."""
    capture = Path(out_dir) / "capture"
    if not _real_dir(capture):
        return []
    foreign = []
    for batch in capture.iterdir():
        if not (_BATCH.fullmatch(batch.name) and _real_dir(batch)):
            foreign.append(batch)
            continue
        foreign += [f for f in batch.iterdir() if f.is_symlink() or not f.is_file()
                    or not (_SHARD_FILE.fullmatch(f.name) or is_temporary(f.name))]
    return sorted(foreign)


def check_table_files(out_dir: str | os.PathLike) -> None:
    """Refuse ``out_dir`` if a ``residuals.parquet/`` directory (the table of a run under several
    processes) holds anything but its ``part-RRRRR.parquet`` files and temporaries, naming the first:
    a new table replaces that directory, which cannot be removed with a file of the user's in it.
    Writes nothing."""
    table = Path(out_dir) / "residuals.parquet"
    if not _real_dir(table):
        return
    foreign = sorted(f for f in table.iterdir() if f.is_symlink() or not f.is_file()
                     or not (_PART.fullmatch(f.name) or is_temporary(f.name)))
    if foreign:
        raise RunDirectoryError(
            f"{foreign[0]}: not a file osdn-diag writes, in residuals.parquet/ (which holds only its "
            f"part-RRRRR.parquet files), which a new table replaces; move it out of {table}")


#: The run's own files at the top of its directory that a manifest lists with their sha256
#: (``files``: the replay's results; ``tokens``: the prompts' tokens).
HASHED_RESULT_FILES = frozenset({"summary.json", "comparator.parquet", "tokens.parquet", "residuals.parquet"})


def check_file_name(name, listed_in: str | os.PathLike, *, shard: bool = False) -> str:
    """``name`` if it is the name of a file a run lists as osdn-diag writes it — a capture shard
    (``capture/batch_BBBBB/layer_LLL[_callN].safetensors``) or, unless ``shard``, a part of the
    per-token table (``residuals.parquet/part-RRRRR.parquet``) or one of :data:`HASHED_RESULT_FILES` —, else :class:`RunDirectoryError`
    naming ``listed_in``, the manifest or rank record that lists it: any other name (absolute, with
    ``..``) could point outside the run, for a command to read, copy or remove."""
    if isinstance(name, str) and (_SHARD.fullmatch(name) or (not shard and (
            _PART_NAME.fullmatch(name) or name in HASHED_RESULT_FILES))):
        return name
    kinds = "capture/batch_BBBBB/layer_LLL.safetensors" + ("" if shard else ", residuals.parquet/part-RRRRR.parquet, "
                                                           + ", ".join(sorted(HASHED_RESULT_FILES)))
    raise RunDirectoryError(f"{listed_in}: lists {name!r}, not the name of a file osdn-diag writes ({kinds}): "
                            "it is damaged, or not osdn-diag's; run the run again")


def prepare_output(out_dir: str | os.PathLike, *, overwrite: bool) -> None:
    """Make ``out_dir`` ready for a new run: refuse it as :func:`check_output` does, and remove the
    run it holds (with ``overwrite``): that run's own files only, and the copies a merge killed
    outright left there (:func:`remove_merge_staging`). Call only once the new run's inputs have
    loaded, holding :func:`output_lock`.

    The manifest first says the run is not complete and lists no shard, and goes last: a command
    killed on the way (even by SIGKILL) leaves a run that says it is unfinished, which
    ``--overwrite`` replaces, never a directory of a run's files and no manifest (refused as "not a
    run" even with ``--overwrite``) nor a manifest that says complete over missing files."""
    out_dir = Path(out_dir)
    manifest = check_output(out_dir, overwrite=overwrite)
    if manifest is not None:
        stages = manifest.get("stages")
        _write(out_dir, {**manifest, "stages": dict.fromkeys(stages if isinstance(stages, dict) else (), False),
                         "shards": {}, "complete": False})
        remove_run_files(out_dir)
        (out_dir / MANIFEST).unlink()
    remove_merge_staging(out_dir)


#: The prefix of the hidden directory in OUT that ``merge`` copies a run's files into before they
#: replace the run there (:mod:`osdn_diag.merge`); ``tempfile.mkdtemp`` adds 8 characters of [a-z0-9_].
MERGE_STAGING_PREFIX = ".osdn-diag-merge."
_MERGE_STAGING = re.compile(re.escape(MERGE_STAGING_PREFIX) + r"[a-z0-9_]{8}")


def remove_merge_staging(out_dir: str | os.PathLike) -> list[Path]:
    """Remove the copies that merges killed outright (SIGKILL) left in ``out_dir`` — directories of the
    package's staging name (:data:`MERGE_STAGING_PREFIX` and 8 random characters), never a link nor
    anything below one —, and return them. Only while this process holds ``out_dir``'s
    :func:`output_lock` (a merge writing into it holds that lock: what is found then is no running
    merge's); otherwise, as on a rank that does not lock, nothing is removed."""
    out_dir = Path(out_dir)
    if out_dir.resolve() not in _HELD or not out_dir.is_dir():
        return []
    removed = []
    for entry in sorted(out_dir.iterdir()):
        if _MERGE_STAGING.fullmatch(entry.name) and _real_dir(entry):
            shutil.rmtree(entry)  # unlinks the links below it, never follows them
            removed.append(entry)
    return removed


def remove_run_files(out_dir: str | os.PathLike) -> None:
    """Remove a run's own files but its manifest: every capture shard (those the manifest lists, and
    those a capture interrupted before listing them left: the names are the package's own, in its
    own directories; then empty batch directories and ``capture/``), the tables, the summary, the rank
    records and the report. Nothing below a link: what it points to is not the run's."""
    out_dir = Path(out_dir)
    capture = out_dir / "capture"
    if _real_dir(capture):
        for batch in sorted(capture.iterdir()):
            if _BATCH.fullmatch(batch.name) and _real_dir(batch):
                for shard in batch.iterdir():
                    if _SHARD_FILE.fullmatch(shard.name) and not shard.is_dir():
                        shard.unlink()
                remove_stale_temporaries(batch)
                _rmdir_if_empty(batch)
        _rmdir_if_empty(capture)
    residuals = out_dir / "residuals.parquet"
    if residuals.is_dir() and not residuals.is_symlink():
        for part in residuals.iterdir():
            if _PART.fullmatch(part.name) and (part.is_file() or part.is_symlink()):
                part.unlink()
        remove_stale_temporaries(residuals)
        _rmdir_if_empty(residuals)
    for name in ("residuals.parquet", "comparator.parquet", "summary.json", "tokens.parquet"):
        _unlink_file(out_dir / name)
    remove_rank_records(out_dir)
    remove_report_files(out_dir)


def remove_rank_records(out_dir: str | os.PathLike) -> None:
    """Remove ``ranks/rank-RRRRR.json`` (and ``ranks/`` if then empty); nothing else."""
    ranks = Path(out_dir) / RANKS_DIR
    if ranks.is_dir() and not ranks.is_symlink():
        for record in ranks.iterdir():
            if _RECORD.fullmatch(record.name) and (record.is_file() or record.is_symlink()):
                record.unlink()
        remove_stale_temporaries(ranks)
        _rmdir_if_empty(ranks)


def remove_report_files(out_dir: str | os.PathLike) -> None:
    """Remove what a report wrote into ``out_dir``: ``report.md`` and :data:`PLOT_FILES` (then
    ``plots/`` if empty); nothing else."""
    out_dir = Path(out_dir)
    _unlink_file(out_dir / "report.md")
    plots = out_dir / "plots"
    if plots.is_dir() and not plots.is_symlink():
        for name in PLOT_FILES:
            _unlink_file(plots / name)
        remove_stale_temporaries(plots)
        _rmdir_if_empty(plots)


# The names the package writes ([0-9], not \d, which matches other scripts' digits too).
_BATCH = re.compile(r"batch_[0-9]+")
_SHARD_FILE = re.compile(r"layer_[0-9]+(_call[0-9]+)?\.safetensors")
_SHARD = re.compile(r"capture/batch_[0-9]+/layer_[0-9]+(_call[0-9]+)?\.safetensors")
_PART = re.compile(r"part-[0-9]+\.parquet")
_PART_NAME = re.compile(r"residuals\.parquet/part-[0-9]+\.parquet")
_RECORD = re.compile(r"rank-[0-9]+\.json")


def _real_dir(path: Path) -> bool:
    """A directory, not a link to one."""
    return path.is_dir() and not path.is_symlink()


def rank_record_path(out_dir: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` records its parts: ``DIR/ranks/rank-RRRRR.json``."""
    return Path(out_dir) / RANKS_DIR / f"rank-{rank:05d}.json"


def write_rank_record(out_dir: str | os.PathLike, rank: int, record: dict) -> None:
    """Write a rank's record atomically (a reader sees the old one or the new one, never half)."""
    atomic_write_text(rank_record_path(out_dir, rank), strict_json(record, indent=2), root=out_dir)


def read_rank_record(path: str | os.PathLike) -> dict | None:
    """A rank record (a JSON object with a run id and a rank), else ``None``."""
    record = _read_json_object(Path(path)) if Path(path).is_file() else None
    if record is None or not isinstance(record.get("run_id"), str) or not isinstance(record.get("rank"), int):
        return None
    return record


def verify_files(root: str | os.PathLike, entries: dict) -> str | None:
    """``None`` if every ``{relative name: {"sha256", "size"}}`` of ``entries`` is under ``root`` with
    that size and sha256 (a parquet file recorded by ``{"size", "rows"}``: that size and row count,
    from its footer), else what is wrong with the first file that is not (one line, naming it).
    A name not of the form osdn-diag writes (:func:`check_file_name`) is wrong: it is not looked at."""
    root = Path(root)
    for name, entry in sorted(entries.items(), key=lambda item: str(item[0])):
        try:
            check_file_name(name, "its record")
        except RunDirectoryError as err:
            return str(err)
        path = root / name
        if _link_below(root, name):
            return f"{path}: below a symbolic link, which osdn-diag does not follow"
        if not path.is_file():
            return f"{path}: missing"
        if path.stat().st_size != entry.get("size"):
            return f"{path}: {path.stat().st_size} bytes, its record says {entry.get('size')}"
        if name == "residuals.parquet" and "rows" in entry and "sha256" not in entry:
            import pyarrow.parquet as pq

            try:
                rows = pq.ParquetFile(path).metadata.num_rows
            except Exception as err:  # noqa: BLE001 - pyarrow's many ways to say "not a parquet file"
                return f"{path}: not a readable parquet file ({err})"
            if rows != entry["rows"]:
                return f"{path}: {rows:,} rows, its record says {entry['rows']:,}"
        elif sha256_file(path) != entry.get("sha256"):
            return f"{path}: its sha256 differs from the one its record says"
    return None


def _link_below(root: Path, name: str) -> bool:
    """Whether ``root/name`` or a directory between ``root`` and it is a link."""
    path = root
    for part in Path(name).parts:
        path = path / part
        if path.is_symlink():
            return True
    return False


def _unlink_file(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()


def _rmdir_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
            raise


# {resolved directory: [depth, fd, directories the lock created]} of the locks this process holds.
_HELD: dict[Path, list] = {}


def _is_rank0() -> bool:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    from .runtime.launcher import launched_rank  # torchrun's RANK, before the group exists; else 0

    return launched_rank() == 0


@contextmanager
def output_lock(directory: str | os.PathLike) -> Iterator[None]:
    """Hold the exclusive lock of ``directory`` (created if needed) while the block runs.

    Another process holding it is refused at once (:class:`RunDirectoryError` naming its pid where
    it is known, :func:`_in_use`);
    within one process the lock is re-entrant, so a command can hold it across the functions that
    take it again. The lock file (:data:`LOCK_FILE`, mode 0644, holding the pid) is removed when the
    outermost holder leaves, and so are the directories the lock created if nothing else was written
    into them. Under ``torchrun`` only rank 0 locks (the other ranks write where rank 0 told them)."""
    key = Path(directory).resolve()
    if key in _HELD or not _is_rank0():
        if key in _HELD:
            _HELD[key][0] += 1
        try:
            yield
        finally:
            if key in _HELD:
                _HELD[key][0] -= 1
        return
    created = [p for p in (key, *key.parents) if not p.exists()]
    key.mkdir(parents=True, exist_ok=True)
    try:
        fd = _acquire(key / LOCK_FILE, directory)
    except BaseException:
        for path in created:  # a refused command leaves no directory behind either
            _rmdir_if_empty(path)
        raise
    _HELD[key] = [1, fd, created]
    try:
        yield
    finally:
        _HELD[key][0] -= 1
        if _HELD[key][0] == 0:
            del _HELD[key]
            # Unlinked while still held: a process that opened it meanwhile finds, once it gets the
            # lock, that the name no longer points at its file, and starts again (see _acquire).
            (key / LOCK_FILE).unlink(missing_ok=True)
            os.close(fd)
            for path in created:  # deepest first
                _rmdir_if_empty(path)


@contextmanager
def reading_lock(*directories: str | os.PathLike) -> Iterator[None]:
    """Hold a shared lock on each of ``directories`` (runs a command reads but does not write: the
    runs of a comparison report, what-if's source, the runs of a view, merge's node directories) while
    the block runs, so that no command writes into them meanwhile (a ``replay`` replacing the tables a
    report is reading, a ``run --overwrite`` removing the capture a what-if reads): a writer that comes
    later is refused at once, and a directory a writer holds is refused here at once
    (:class:`RunDirectoryError`). Readers share the lock with one another. A directory this process
    already holds is not locked again. Where the lock file cannot be written (a read-only directory),
    the one there is locked through a read-only descriptor, after the same checks as a writer's (a
    link, a FIFO, a directory or a hard link is refused); where there is none, none is taken: no other
    command can write there either. The lock file is removed by the last holder."""
    from contextlib import ExitStack

    with ExitStack() as stack:
        seen = set()
        for directory in directories:
            key = Path(directory).resolve()
            if key in seen or key in _HELD:
                continue
            seen.add(key)
            fd = _acquire(key / LOCK_FILE, directory, shared=True)
            if fd is not None:
                stack.callback(_release_shared, key / LOCK_FILE, fd)
        yield


def _release_shared(path: Path, fd: int) -> None:
    """Let go of a shared lock; the last holder (the one that can then lock it exclusively) removes the
    file, as a writer does."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            if os.path.samestat(os.fstat(fd), os.lstat(path)):
                path.unlink()
        except OSError:  # gone already, or a read-only directory: left as it is
            pass
    except OSError:  # another reader still holds it: it removes the file when it leaves
        pass
    finally:
        os.close(fd)


def _acquire(path: Path, directory, *, shared: bool = False, wait: bool = False) -> int | None:
    """Lock ``path`` (``directory``'s lock file) and return the descriptor holding it: exclusively for
    a writer (:func:`output_lock`, which then writes its pid into the file), shared for a reader
    (:func:`reading_lock`). A lock held against it is refused at once (:class:`RunDirectoryError`),
    or waited for (``wait``: :func:`wait_for_lock`). Where the file cannot be opened for writing (a
    read-only directory), a reader locks it through a read-only descriptor, and takes no lock
    (``None``) if there is none."""
    import fcntl

    while True:
        try:
            fd, created = _open_lock(path)
        except OSError as err:
            if not shared or err.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            try:  # read-only: a lock file that is there can still be locked through a read-only descriptor
                fd, created = _open_lock(path, write=False)  # checked as any other (RunDirectoryError)
            except OSError:  # none there (nor can a writer make one), or not readable
                return None
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            try:
                message = _in_use(directory, fd, shared=shared)
            finally:
                os.close(fd)
            raise RunDirectoryError(message) from None
        try:  # lstat: a link put at the name meanwhile is not our file either
            same = os.path.samestat(os.fstat(fd), os.lstat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file before we got the lock: take the new one
    if shared:  # a reader writes nothing into the file
        return fd
    if created:  # a file found there (a killed command's) keeps its mode: it may not be ours to change
        try:
            os.fchmod(fd, 0o644)  # readable by whoever looks for the pid, whatever the umask
        except OSError:
            pass
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _in_use(directory, fd: int, *, shared: bool) -> str:
    """Why ``directory``'s lock, open on ``fd``, was refused: a writer holds it (``shared``: only a
    writer's lock refuses a reader's; else a shared lock refused too), named by its pid where that is
    known to be the holder's, or readers, who write no pid. The pid in the file alone is not enough:
    a killed writer's stays there under the readers and writers that come after it, and a writer
    that has just got the lock has not written its own yet."""
    import fcntl

    writing = shared
    if not shared:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            writing = True
        else:  # readers only
            fcntl.flock(fd, fcntl.LOCK_UN)
    if not writing:
        return f"{directory} is being read by another osdn-diag command; wait for it to finish"
    pid = _writer_pid(fd)
    who = "" if pid is None else f" (pid {pid})"
    return f"{directory} is in use by another osdn-diag command{who}, which is writing into it; wait for it to finish"


def _writer_pid(fd: int) -> int | None:
    """The pid the lock file open on ``fd`` holds, if that process holds the file's lock exclusively:
    as the kernel's table of locks (``/proc/locks``) says where it lists the file, else if a process
    of that pid is alive. ``None`` when the holder is not known."""
    text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    if re.fullmatch(r"[0-9]{1,10}", text) is None or int(text) <= 0:
        return None
    pid, info = int(text), os.fstat(fd)
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as table:
            lines = table.read().splitlines()
    except OSError:  # not Linux
        lines = []
    # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:2146337 0 EOF" (a lock still waited for has "->" after "1:")
    here = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    holders = [fields[4] for fields in map(str.split, lines)
               if len(fields) >= 6 and fields[1:4] == ["FLOCK", "ADVISORY", "WRITE"] and fields[5] == here]
    if holders:
        return pid if str(pid) in holders else None
    try:  # the table does not list it (another system, a file system whose numbers differ)
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:  # alive, another user's
        pass
    return pid


def _open_lock(path: Path, *, write: bool = True) -> tuple[int, bool]:
    """``(fd, created)``: the lock file opened for writing, created if missing (``write``), or opened
    read-only and never created (not ``write``: where this user cannot write it). One that is not a
    regular file of a single name (a link — even dangling —, a directory, a FIFO, a socket, a hard link
    to some other file) is refused and left as it is: writing the pid would truncate or create what it
    points to, and opening a FIFO could wait for a writer forever. O_NOFOLLOW and O_EXCL never follow a
    link, O_NONBLOCK never waits, and fstat checks what was opened, not the name."""
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    refused = RunDirectoryError(f"{path}: not a lock file osdn-diag made (a symbolic link, a directory, a FIFO, "
                                "or a file with other names); it is left alone: remove it, then run the command "
                                "again")
    while True:
        if write:
            try:
                return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
            except FileExistsError:
                pass
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            if not write:
                raise
            continue  # its holder removed it meanwhile: create it
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EMLINK):
                raise refused from None
            raise
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 0:
            os.close(fd)  # its holder removed it between the open and the fstat: create it (or find none)
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            raise refused
        return fd, False


def wait_for_lock(path: Path) -> int:
    """Wait for the exclusive lock of one of the package's other lock files (``monitor.parquet``'s) and
    return the descriptor holding it: opened, checked and locked as a run directory's is
    (:func:`_acquire`; a link, a FIFO or a hard link at ``path`` is refused), the pid written. Its
    holder removes the file, then closes the descriptor: a waiter then takes the new one."""
    return _acquire(path, path.parent, wait=True)


def _write(run_dir: Path, manifest: dict) -> None:
    # A run whose parts lie on several machines' disks (``"merge_needed": true``) is complete only once
    # ``osdn-diag merge`` has assembled them in one directory.
    manifest["complete"] = all(manifest["stages"].values()) and not manifest.get("merge_needed")
    atomic_write_text(run_dir / MANIFEST, strict_json(manifest, indent=2), root=run_dir)


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

    check_regular(path, table=True)
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    out = []
    for f in files:
        try:
            meta = pq.read_schema(f).metadata or {}
        except (OSError, ValueError):  # a damaged footer (ArrowInvalid is a ValueError): no id to read
            out.append((f, UNREADABLE))
            continue
        value = meta.get(RUN_ID_KEY)
        out.append((f, value.decode() if value is not None else None))
    return out


#: :func:`table_run_ids`'s id of a file whose schema cannot be read (a damaged file, not another run's).
UNREADABLE = object()


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
                # a damaged file is left to the checks that name damage (its sha256, its reader)
                if found is not UNREADABLE and found != run_id:
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


# --- reading a run's manifest (osdn_diag.capture.store re-exports these) ------------------------------

class IncompleteRunError(RuntimeError):
    """A run directory whose stage a command needs did not finish."""


def read_manifest(run_dir: str | os.PathLike) -> dict:
    """The manifest of a run directory written by this version (one with a run id)."""
    path = Path(run_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no manifest.json — is {run_dir} a run directory?")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON ({err}); the run directory is damaged, run it again") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read; the run directory is damaged, run it "
                         "again") from None
    if isinstance(manifest, dict) and manifest.get("kind") == "report" and "run_id" not in manifest:
        raise RunDirectoryError(f"{path}: a report of other runs (`osdn-diag report ... --out`), not a run; "
                                "give a run directory")
    if not isinstance(manifest, dict) or "run_id" not in manifest or "stages" not in manifest:
        raise RunDirectoryError(f"{path}: no run id (written by an earlier osdn-diag, or not by "
                                "osdn-diag): its files cannot be checked to belong together; run it again")
    _check_manifest_schema(manifest, path)
    return manifest


def _check_manifest_schema(manifest: dict, path: Path) -> None:
    """Every key a command reads of the manifest has the type osdn-diag writes (:mod:`osdn_diag.runtime.schema`):
    a damaged file is refused here, naming the key, instead of failing deep in a reader."""
    from .runtime.schema import check_manifest

    check_manifest(manifest, path)


def require_stage(run_dir: str | os.PathLike, manifest: dict, stage: str) -> None:
    """Refuse a run whose ``stage`` did not finish, saying what to do."""
    if stage_done(manifest, stage):
        return
    path = Path(run_dir) / MANIFEST
    if stage == "capture":
        raise IncompleteRunError(f"{path}: the capture is incomplete (stages.capture is not true): the run "
                                 "that wrote it was interrupted or failed; run it again")
    if (manifest.get("counterfactual") or manifest.get("capture_stored") is False or stage != "replay"
            or not stage_done(manifest, "capture")):
        again = "run it again"
    else:
        again = f"run `osdn-diag replay {run_dir}` (its capture is complete)"
    if stage not in manifest.get("stages", {}):
        raise IncompleteRunError(f"{path}: the run has no {stage} stage yet; {again}")
    raise IncompleteRunError(f"{path}: {stage} did not finish (stages.{stage} is not true): the command "
                             f"was interrupted or failed, and its results are not this run's; {again}")
