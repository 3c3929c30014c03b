"""A finished run's files as the report reads them: :func:`load_run` and the per-token table's
:data:`CONTRACT_COLUMNS`. No torch here: ``osdn-diag report`` of a run without a stored capture reads
JSON and parquet only (a stored capture is checked by :class:`osdn_diag.capture.store.CaptureReader`,
which does import torch)."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path

__all__ = ["CONTRACT_COLUMNS", "VALUE_COLUMNS", "load_run", "read_table", "table_columns"]

#: The per-token table's float columns of every family (docs/run-directory.md).
VALUE_COLUMNS = ("beta", "key_sqnorm", "write_gain", "loss_before", "loss_after", "residual_ratio")
#: The per-token table's columns that the interface contract guarantees.
CONTRACT_COLUMNS = ("prompt", "task", "layer", "head", "pos", "rel_pos", "repeat_start", *VALUE_COLUMNS)


def _again(table: Path) -> str:
    """What to do about a run's table that cannot be read: write it again, with the command that
    wrote it (the replay; the whole run for its tokens, a what-if or a run that stored no capture)."""
    from ..rundir import run_manifest

    run_dir = table.parent.parent if table.parent.name == "residuals.parquet" else table.parent
    manifest = run_manifest(run_dir) or {}
    if manifest.get("counterfactual"):
        return "run the what-if again"
    if table.name == "tokens.parquet" or manifest.get("capture_stored") is False:
        return "run it again"
    return f"run `osdn-diag replay {run_dir}` again"


@contextmanager
def _naming(path: Path, again: str | None):
    """A table that pyarrow cannot read (a damaged page, a truncated file, not parquet at all) raised
    as :class:`~osdn_diag.rundir.RunDirectoryError` naming it and saying what to do; pyarrow's own
    message (``Corrupt snappy compressed data.``) names no file."""
    import pyarrow as pa

    try:
        yield
    except FileNotFoundError:
        raise
    except (OSError, pa.ArrowException) as err:
        from ..rundir import RunDirectoryError

        reason = " ".join(str(err).split()) or type(err).__name__
        raise RunDirectoryError(f"{path}: damaged, cannot be read ({reason}); "
                                f"{again or _again(Path(path))}") from None


def read_table(path: str | os.PathLike, *, again: str | None = None, **kwargs):
    """``pyarrow.parquet.read_table(path, **kwargs)`` of one of a run's tables (a file, or a directory
    of parts): every table a command reads of a run comes through here, so that one that cannot be
    read is refused naming it (``again``: what to do; by default, run the command that wrote it)."""
    import pyarrow.parquet as pq

    with _naming(Path(path), again):
        return pq.read_table(path, **kwargs)


def table_columns(path: str | os.PathLike, *, again: str | None = None) -> list[str]:
    """The column names of one of a run's tables (a file, or a directory of parts), as :func:`read_table`
    refuses one that cannot be read."""
    import pyarrow.parquet as pq

    with _naming(Path(path), again):
        return pq.ParquetDataset(path).schema.names


def _check_result_files(run_dir: Path, manifest: dict, again: str) -> None:
    """``summary.json`` and ``comparator.parquet`` are the bytes the replay wrote: their sha256 and size
    as ``manifest.json`` records them (``files``; runs written before it was recorded are not checked)."""
    from ..rundir import RunDirectoryError, verify_files

    problem = verify_files(run_dir, manifest.get("files") or {})
    if problem is not None:
        raise RunDirectoryError(f"{problem.replace('its record says', 'manifest.json records')}: the file "
                                f"was changed after the run wrote it; {again}")


def load_run(run_dir: str | os.PathLike) -> tuple[dict, dict]:
    """``(manifest, summary)`` of a run whose replay finished; errors name the file that is missing or
    wrong, or that another run wrote (its run id differs from the manifest's)."""
    from ..rundir import check_table_run_ids, read_manifest, require_stage

    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    require_stage(run_dir, manifest, "replay")
    if manifest.get("merge_needed"):
        from ..rundir import RunDirectoryError

        raise RunDirectoryError(
            f"{run_dir / 'manifest.json'}: rank 0's part of a run whose other ranks wrote under their own "
            f"nodes' --out (merge_needed); assemble it with `osdn-diag merge {run_dir} NODE_DIR... --out "
            "MERGED` and use MERGED"
        )
    from ..rundir import check_regular

    for name in ("summary.json", "residuals.parquet", "comparator.parquet", "tokens.parquet"):
        check_regular(run_dir / name, table=name == "residuals.parquet")
    path = run_dir / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no summary.json — run `osdn-diag replay {run_dir}` first")
    again = f"run `osdn-diag replay {run_dir}` again"
    try:
        summary = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err}); {again}") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read; {again}") from None
    from ..runtime.schema import check_summary

    again = again if not manifest.get("counterfactual") else "run the what-if again"
    check_summary(summary, path, again)
    table = run_dir / "residuals.parquet"
    if not table.exists():
        raise FileNotFoundError(f"{table}: no per-token table — run `osdn-diag replay {run_dir}` first")
    names = table_columns(table)  # a file, or a directory of parts
    missing = [c for c in CONTRACT_COLUMNS if c not in names]
    if missing:
        raise ValueError(f"{table}: missing column(s) {', '.join(missing)} of the per-token table")
    check_table_run_ids(run_dir, manifest, summary)  # another run's file, said as such, first
    _check_result_files(run_dir, manifest, again)
    if manifest.get("shards") and (run_dir / "capture").is_dir():
        # The capture the tables came from is still the one the manifest lists (names and sizes here;
        # the d plot hashes the shards it reads). A deleted capture/ is a run without one, not damage.
        from ..capture.store import CaptureReader

        CaptureReader(run_dir)
    return manifest, summary
