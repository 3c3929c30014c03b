"""The result files' names and writers: the per-token table encoded on a thread of its own while
the GPU works, each file written atomically."""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..runtime.atomic import atomic_path, remove_stale_temporaries
from ..rundir import (
    RUN_ID_KEY,
    sha256_file,
)


RESIDUALS = "residuals.parquet"


COMPARATOR = "comparator.parquet"


SUMMARY = "summary.json"


def _with_run_id(schema: pa.Schema, run_id: str | None) -> pa.Schema:
    return schema if run_id is None else schema.with_metadata({**(schema.metadata or {}), RUN_ID_KEY: run_id})


@contextmanager
def _residuals_writer(out_dir: Path, schema: pa.Schema, ranks, run_id: str | None = None) -> Iterator[_ParquetEncoder]:
    """``residuals.parquet``, written atomically, carrying ``run_id`` in its schema metadata; under
    several processes a directory with one ``part-RRRRR.parquet`` per rank (read as one table)."""
    schema = _with_run_id(schema, run_id)
    target = Path(out_dir) / RESIDUALS
    if ranks.world > 1:
        if ranks.is_main:
            _remove(target)
            target.mkdir(parents=True)
        ranks.barrier()
        target = target / f"part-{ranks.rank:05d}.parquet"
    elif target.is_dir():  # left by an earlier run with several processes
        _remove(target)
    with atomic_path(target, root=out_dir) as tmp:
        encoder = _ParquetEncoder(tmp, schema, target)
        try:
            yield encoder
        except BaseException:
            encoder.close(check=False)
            raise
        encoder.close()
    if ranks.world > 1:  # {name under the run directory: sha256 and size} of this rank's part
        encoder.part = {target.relative_to(out_dir).as_posix(): {"sha256": sha256_file(target),
                                                                 "size": target.stat().st_size}}


class _ParquetEncoder:
    """A parquet file whose tables are encoded by a background thread (pyarrow releases the GIL while
    it writes), so that encoding one call's rows overlaps the replay of the next. A table may also
    come as a function that builds it from host data: a second thread builds those, in order, ahead
    of the encoding (building the rows of the paper-scale run took 0.8 s, encoding them 3.5 s: on the
    replay's thread the first held every call up, on the encoder's it made the encoder the slower of
    the two). At most ``QUEUE`` items wait at each step.

    The file's columns are those of ``schema`` that the run's layers fill. Which of the columns only
    some layers fill (a decay's, a kernel family's own) a call's rows fill depends on its kind
    (:func:`~osdn_diag.replay.replayer.table_kind`: family, and whether it decays); given the kinds
    of the run's layers (:meth:`expect`, before the first write), the encoder holds tables only until
    it has one of each kind — the first, in a model whose layers are all of one kind — and then
    leaves out the columns null on all of them (:func:`~osdn_diag.replay.replayer.filled_schema`),
    which took a third of the encoding time at paper scale. Without :meth:`expect` it writes every
    column of ``schema``. A later table that fills a column left out is refused, naming its layer.
    Dictionary encoding is asked for only on the task names: on the float columns it is tried and
    abandoned for every page, which triples the time to write, and on the integer columns (prompt,
    layer, head, …) it saved 4 % of the paper-scale file for 12 % more encoding time
    (``benchmarks/bench_table_encoding.py``). A failure on either thread is raised, naming ``target``,
    by the next :meth:`write` or by :meth:`close`."""

    QUEUE = 4
    DICTIONARY_COLUMNS = ["task"]

    def __init__(self, path: str, schema: pa.Schema, target: Path):
        self.path = path
        self.target = target
        self.part: dict = {}  # set on leaving _residuals_writer under several processes
        self.schema = schema  # the columns every table comes with; the file's are decided by _open
        self.expected: frozenset | None = None  # the kinds of the run's layers (expect)
        self.writer: pq.ParquetWriter | None = None
        self.error: BaseException | None = None
        self.queue: queue.Queue = queue.Queue(maxsize=self.QUEUE)  # tables or builders, to the rows thread
        self.built: queue.Queue = queue.Queue(maxsize=self.QUEUE)  # (table, kind), to the encoding thread
        self.rows_thread = threading.Thread(target=self._build, name="residuals-rows", daemon=True)
        self.thread = threading.Thread(target=self._drain, name="residuals-writer", daemon=True)
        self.rows_thread.start()
        self.thread.start()

    def expect(self, kinds) -> None:
        """The kinds of the run's layers (:func:`~osdn_diag.replay.replayer.table_kind` of each), before
        the first :meth:`write`: the file's columns are decided once a table of each has come."""
        self.expected = frozenset(kinds)

    def _build(self) -> None:
        while (item := self.queue.get()) is not None:
            kind = getattr(item, "kind", None)
            if self.error is None and callable(item):
                try:
                    item = item()
                except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                    self.error = err  # the encoder then skips this item, and every later one
            self.built.put((item, kind))
        self.built.put(None)

    def _drain(self) -> None:
        held: list[pa.Table] = []  # until a table of every expected kind has come: they decide the columns
        kinds: set = set()
        while (entry := self.built.get()) is not None:
            if self.error is not None:  # after a failure keep taking tables, so that write() never blocks
                continue
            table, kind = entry
            try:
                if self.writer is None:
                    held.append(table)
                    kinds.add(kind)
                    if self.expected is None or self.expected <= kinds:
                        self._open(held)
                        held = []
                    continue
                self._write(table)
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                self.error = err
        if self.error is None and self.writer is None:
            try:
                self._open(held)
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                self.error = err

    def _open(self, held: list[pa.Table]) -> None:
        from ..replay.replayer import filled_schema

        self.file_schema = self.schema if self.expected is None else filled_schema(self.schema, held)
        self.writer = pq.ParquetWriter(self.path, self.file_schema, use_dictionary=self.DICTIONARY_COLUMNS)
        for table in held:
            self._write(table)

    def _write(self, table: pa.Table) -> None:
        names = set(self.file_schema.names)
        for column in table.column_names:
            if column not in names and table.column(column).null_count < table.num_rows:
                layer = table.column("layer")[0].as_py()
                raise ValueError(f"layer {layer}'s rows fill the column {column!r}, which the first calls of "
                                 f"the layer kinds the run announced ({sorted(self.expected or ())}) left "
                                 "null: the file was opened without it")
        self.writer.write_table(table if len(names) == table.num_columns else table.select(self.file_schema.names))

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"writing {self.target} failed") from self.error

    def write(self, table: pa.Table | Callable[[], pa.Table]) -> None:
        """Queue a table, or a function that builds one on the rows thread (from host data only)."""
        self._check()
        self.queue.put(table)

    def close(self, check: bool = True) -> None:
        """Wait for the queued tables and close the file; ``check``: raise the threads' failure."""
        self.queue.put(None)
        self.rows_thread.join()
        self.thread.join()
        if self.writer is not None:
            self.writer.close()
        if check:
            self._check()


def _remove(path: Path) -> None:
    """Remove ``residuals.parquet``: a file, or a directory of ``part-RRRRR.parquet`` (and temporaries
    of killed writers). A directory holding anything else is not removed (the rmdir fails, naming it)."""
    if path.is_dir() and not path.is_symlink():
        for part in path.iterdir():
            if re.fullmatch(r"part-\d+\.parquet", part.name) and not part.is_dir():
                part.unlink()
        remove_stale_temporaries(path)
        path.rmdir()
    elif path.exists() or path.is_symlink():
        path.unlink()


def _atomic_parquet(table: pa.Table, path: Path, root: Path | None = None) -> None:
    with atomic_path(path, root=root) as tmp:
        pq.write_table(table, tmp)
