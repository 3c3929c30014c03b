"""Results of a replay: in memory (:func:`replay` of what :func:`osdn_diag.capture` recorded) or read
back from a finished run directory (:meth:`Results.load`, :func:`load_run`).

    with osdn_diag.capture(model) as cap:
        model(input_ids)
    res = osdn_diag.replay(cap)
    res.summary["q_geo"]; res.to_pandas()      # one row per (prompt, layer, head, pos)

Every sequence of every forward pass is one "prompt", numbered in order (give ``prompts`` to attach
tasks and repeat positions).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from ..capture.record import KernelCall
from ..capture.store import StoredCall
from ..prompts import Prompt
from .replayer import Replayer
from .runs import load_run

__all__ = ["Results", "load_run", "replay"]


@dataclass(repr=False)
class Results:
    """Replayed per-token table (pyarrow; one row per (prompt, layer, head, pos), the columns of
    ``residuals.parquet``) and its summary (the ``summary.json`` dictionary).

    From memory (:func:`replay`) or from a finished run directory (:meth:`load`); plot either with
    :mod:`osdn_diag.plot`.
    """

    table: pa.Table
    summary: dict

    @classmethod
    def load(cls, run_dir) -> Results:
        """A finished run directory's ``residuals.parquet`` and ``summary.json`` (errors name what is
        missing, or a file another run wrote)."""
        import pyarrow.parquet as pq

        _, summary = load_run(run_dir)
        return cls(pq.read_table(Path(run_dir) / "residuals.parquet"), summary)

    def __repr__(self) -> str:
        s = self.summary
        layers, tasks = len(s.get("by_layer", {})), sorted(s.get("by_task", {}))

        def g(x):
            return "null" if x is None else f"{x:.4g}"

        fid = s.get("fidelity", {})
        if s.get("counterfactual"):
            check = "counterfactual"
        elif fid.get("max_rel_error") is None:
            check = "fidelity not measured (reference kernels)"
        else:
            check = f"fidelity {fid['max_rel_error']:.1e}"
        return (f"Results(q_geo={g(s.get('q_geo'))}, q_arith={g(s.get('q_arith'))}, n={s.get('n', 0):,} "
                f"measurements over {layers} layer{'s' * (layers != 1)}, tasks {tasks or '-'}, {check}; "
                f".table: {self.table.num_rows:,} rows × {self.table.num_columns} columns)")

    def to_pandas(self):
        try:
            import pandas  # noqa: F401
        except ImportError as err:
            raise ImportError("Results.to_pandas() needs pandas: pip install pandas") from err
        return self.table.to_pandas()


def replay(
    capture: Iterable[KernelCall],
    *,
    prompts: Sequence[Prompt] | None = None,
    **replay_kw,
) -> Results:
    """Replay captured calls (a :class:`~osdn_diag.capture.context.Capture` or a list of
    :class:`KernelCall`) in fp32; options as :class:`osdn_diag.replay.Replayer`."""
    calls = list(getattr(capture, "calls", capture))
    if not calls:
        raise ValueError("argument 'capture': no calls were captured (did the model run inside it?)")
    forwards = sorted({c.forward for c in calls})
    offsets, infos, next_id = {}, {}, 0
    for f in forwards:
        first = next(c for c in calls if c.forward == f)
        segments = first.segments()
        offsets[f] = next_id
        for i, (_, start, end) in enumerate(segments):
            pid = next_id + i
            p = prompts[pid] if prompts is not None and pid < len(prompts) else None
            infos[pid] = {
                "id": pid,
                "task": p.task if p else "",
                "length": end - start,
                "repeat_start": p.repeat_start if p else -1,
            }
        next_id += len(segments)
    replayer = Replayer(infos, **replay_kw)
    tables = []
    for call in calls:
        n = len(call.segments())
        ids = list(range(offsets[call.forward], offsets[call.forward] + n))
        tables.append(replayer.add(StoredCall(batch=call.forward, prompts=ids, call=call)))
    return Results(table=pa.concat_tables(tables), summary=replayer.summary())
