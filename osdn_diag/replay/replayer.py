"""Replay of captured calls into the per-token table and the run's statistics.

:class:`Replayer` takes stored calls one at a time: it replays each (:func:`osdn_diag.replay.call.replay_call`),
returns the call's rows of the per-token table — one row per (prompt, layer, head, position) with the
columns a run directory promises (:data:`CONTRACT_COLUMNS`; docs/run-directory.md defines each):
``prompt, task, layer, head, pos, rel_pos, repeat_start, beta, key_sqnorm, write_gain, loss_before,
loss_after, residual_ratio``, ``finite``, and the columns only some layers fill (a decay's
``loss_before_decayed`` and ``residual_ratio_post``, a family's own: :func:`optional_columns`, null on
the rows of other layers; a run's table leaves out those none of its layers fills) — and keeps every
accumulator of the summary (ratios, audit, comparator, retention). Run directories use it through :func:`osdn_diag.pipeline.replay_run`, in-memory captures through :func:`osdn_diag.replay`.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import torch

from ..runtime.device import check_device
from ..runtime.host import from_host
from ..capture.record import KernelCall
from ..capture.store import StoredCall, to_device
from ..metrics.audit import AuditAccumulator
from ..metrics.hypotheses import HYPOTHESES, key_norm_tol
from ..metrics.hypotheses import count as count_hypotheses
from ..metrics.ratios import RatioAccumulator, RatioStats
from ..metrics.retention import RetentionAccumulator, probe_positions, retrieval_errors
from . import families
from .call import ZERO_RESIDUAL, replay_call, working_precision
from .runs import CONTRACT_COLUMNS, VALUE_COLUMNS

__all__ = ["CONTRACT_COLUMNS", "Replayer", "comparator_summary", "repeat_boundaries"]

#: Key entries (``P·L·K``, doubled when d is captured) of comparator problems solved together.
THEOREM_BATCH_ELEMS = 1 << 28
_VALUE_COLUMNS = VALUE_COLUMNS
_GATED_COLUMNS = ("loss_before_decayed", "residual_ratio_post")


def _schema(value_type: pa.DataType) -> pa.Schema:
    return pa.schema(
        [
            ("prompt", pa.int32()),
            ("task", pa.string()),
            ("layer", pa.int16()),
            ("head", pa.int16()),
            ("pos", pa.int32()),
            ("rel_pos", pa.float32()),
            ("repeat_start", pa.int32()),
            # where a generated stream's decoded tokens start (its prompt's length), -1 otherwise
            ("decode_start", pa.int32()),
            *[(c, value_type) for c in _VALUE_COLUMNS + _GATED_COLUMNS],
            ("finite", pa.bool_()),
            # the further families' own per-token values (replay/families), null for the others; a
            # run's file leaves out the optional columns none of its layers fills (filled_schema)
            *[(c, _column_type(c, value_type)) for c in families.columns()],
        ]
    )


def optional_columns() -> tuple[str, ...]:
    """The per-token table's columns that only some layers fill: a decay's (``_GATED_COLUMNS``) and
    the further families' own (:func:`families.columns`). A run's table holds those its layers fill
    and leaves the others out (:func:`filled_schema`)."""
    return _GATED_COLUMNS + families.columns()


def table_kind(call) -> tuple[str, bool]:
    """What decides which :func:`optional_columns` a call's rows fill: its kernel family and whether
    it decays, of a :class:`KernelCall` or of a manifest's ``layers`` entry (which records both)."""
    if isinstance(call, dict):
        return str(call.get("family", "")), bool(call.get("gated"))
    return call.family, bool(call.gated)


def filled_schema(schema: pa.Schema, tables) -> pa.Schema:
    """``schema`` without the :func:`optional_columns` that are null on every row of ``tables`` (with
    ``schema``'s metadata). Encoding a column of nulls costs about what a column of values does: at
    paper scale the other families' 14 null columns were a third of the table's encoding time."""
    optional = set(optional_columns())
    filled = set()
    for table in tables:
        filled.update(c for c in optional - filled
                      if c in table.column_names and table.column(c).null_count < table.num_rows)
    return pa.schema([f for f in schema if f.name not in optional or f.name in filled], metadata=schema.metadata)


def _column_type(name: str, value_type: pa.DataType) -> pa.DataType:
    """A family column's arrow type: the one its ``COLUMNS`` entry declares, else the value type."""
    declared = families.column_types().get(name)
    return value_type if declared is None else pa.type_for_alias(declared)


class Replayer:
    """Replays captured calls one at a time and accumulates every statistic of the summary.

    ``add(stored)`` returns the call's rows of the per-token table (a pyarrow Table); ``summary()``
    returns the summary dictionary. Used by :func:`replay_run` (files) and :func:`osdn_diag.replay`
    (in memory).
    """

    def __init__(
        self,
        prompts: dict[int, dict],
        *,
        backend: str = "auto",
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        tolerance: float | None = None,
        transform: Callable[[KernelCall], KernelCall] | None = None,
        retained: bool = False,
        comparator: bool = True,
        box: tuple[float, float] = (0.5, 2.0),
        theorem_batch_elems: int = THEOREM_BATCH_ELEMS,
        zero_residual: str = "drop",
    ):
        self.prompts = prompts
        self.device = check_device(device) or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if tolerance is not None and not (isinstance(tolerance, (int, float)) and tolerance > 0):
            raise ValueError(f"argument 'tolerance': expected a relative error > 0 (math.inf: no check), "
                             f"got {tolerance!r}")
        self.backend = ("triton" if self.device.type == "cuda" else "torch") if backend == "auto" else backend
        self.dtype = dtype
        self.tolerance = tolerance
        if zero_residual not in ZERO_RESIDUAL:
            raise ValueError(f"argument 'zero_residual': expected one of {ZERO_RESIDUAL}, got {zero_residual!r}")
        self.zero_residual = zero_residual
        self.transform = transform
        self.schema = _schema(pa.float64() if dtype == torch.float64 else pa.float32())
        self.np_dtype = "float64" if dtype == torch.float64 else "float32"
        self.ratios = RatioAccumulator("residual_ratio")
        self.post = RatioAccumulator("residual_ratio_post")
        # A micro-step family's one ratio per token (token_ratio on its step-0 rows), for the summary's
        # per-token q_geo; every other family's per-token ratio is its residual_ratio, already in
        # self.ratios / self.post (see _per_token), so only micro-step calls are accumulated here.
        self.tokens = RatioAccumulator("token_ratio")
        self.tokens_post = RatioAccumulator("token_ratio_post")
        # A family's own summary figures (families.figures()): name -> (column, post-decay column)'s
        # accumulators, fed by the calls whose replay returns the column.
        self.figures = {name: (RatioAccumulator(col), RatioAccumulator(post))
                        for name, (col, post) in families.figures().items()}
        self.audit = AuditAccumulator()
        # Generated streams: their prompt's tokens (prefill) and the tokens decoded after it, apart.
        self.phases = {"prefill": RatioStats(), "decode": RatioStats()}
        self.retention = RetentionAccumulator() if retained else None
        self.box = box
        self.comparator_tables: list[pa.Table] | None = [] if comparator else None
        self.theorem_batch_elems = theorem_batch_elems
        self._pending: list[_Problems] = []  # comparator problems not yet solved, all of one shape
        self._solving: _Solve | None = None  # the batch being solved beside the replay (on a GPU)
        # Solve beside the replay on a GPU; on the CPU the solver would take the replay's own cores.
        self.solve_beside = self.device.type == "cuda"
        self.fidelity: dict[int, float] = defaultdict(float)
        # What each layer's output was compared with: "fla" (a live kernel) or "reference" (the
        # package's own recurrence stood in for it, so agreement measures nothing about a kernel).
        self.against: dict[int, str] = {}
        self.families: dict[int, str] = {}  # layer -> the kernel family of its calls (summary's by_family)
        self.kernels: dict[int, str] = {}  # layer -> what replayed its calls (CallReplay.kernel)
        self.tolerances: dict[int, float] = {}
        self.nonfinite: dict[int, int] = defaultdict(int)
        # (prompt, layer, head) streams left out for NaN/Inf inputs, and how many streams there were.
        self.excluded_streams: set[tuple[int, int, int]] = set()
        self.streams = 0
        # Final state against the kernel's, per layer: largest relative error, its tolerance, the
        # same error in units of the working precision's rounding, and that precision.
        self.state_fidelity: dict[int, float] = {}
        self.state_meta: dict[int, tuple[float, float, str]] = {}

    def add(self, stored: StoredCall, *, table: bool = True) -> pa.Table | Callable[[], pa.Table]:
        """Replay one call into every accumulator and return its rows of the per-token table; with
        ``table=False`` a function that builds them instead, from host data only, so that a writer
        thread can build them while the next call replays (the rows are the same either way)."""
        call = to_device(stored.call, self.device)
        if self.transform is not None:
            call = self.transform(call)
        res = replay_call(call, backend=self.backend, dtype=self.dtype, tolerance=self.tolerance,
                          zero_residual=self.zero_residual)
        self.fidelity[call.layer] = max(self.fidelity[call.layer], res.fidelity)
        self._add_against(call.layer, call.flags.get("kernels", "fla"))
        self.families[call.layer] = call.family
        self.kernels[call.layer] = res.kernel
        self.tolerances[call.layer] = res.tolerance
        self.nonfinite[call.layer] += res.nonfinite
        self.streams += len(res.sequence_lengths) * call.num_heads
        for seq, head in res.nonfinite_streams:
            self.excluded_streams.add((int(stored.prompts[seq]), call.layer, head))
        if res.state_fidelity is not None:
            self._add_state(call.layer, res.state_fidelity, res.state_tolerance, res.state_rounding_units,
                            working_precision(call))
        tasks = [str(self.prompts.get(p, {}).get("task", "")) for p in stored.prompts]
        # The rows' layout: the table's sequence, head and pos columns are a function of it (the
        # ratio statistics find each row's cell once per layout; every layer of a batch shares it).
        layout = (tuple(map(tuple, res.segments)), call.num_heads, int(call.flags.get("micro_steps", 1)))
        for acc in (self.ratios, self.post):
            acc.add(call.layer, res.device_columns, tasks, res.sequence_lengths, call.num_heads, layout=layout)
        if "step" in res.device_columns:  # a micro-step family: its token rows, apart
            first = {k: v[res.device_columns["step"] == 0] for k, v in res.device_columns.items()}
            for acc in (self.tokens, self.tokens_post):
                acc.add(call.layer, first, tasks, res.sequence_lengths, call.num_heads)
        for accs in self.figures.values():
            for acc in accs:
                if acc.column in res.device_columns:
                    # A figure's value may be undefined (NaN) on a finite token: left out, and counted.
                    cols = dict(res.device_columns)
                    cols["finite"] = cols["finite"].bool() & torch.isfinite(cols[acc.column])
                    acc.add(call.layer, cols, tasks, res.sequence_lengths, call.num_heads, layout=layout)
        self.audit.add(call, res.grid["loss_before"], res.grid["finite"], res.grid["theorem_valid"],
                       segments=res.segments)
        decode_start = _decode_start(call)
        if decode_start >= 0:
            _add_phases(self.phases, res.device_columns, decode_start)
        if self.retention is not None:
            _add_retention(self.retention, call, stored.prompts, self.prompts, res.sequence_lengths)
        if self.comparator_tables is not None:
            self._queue_problems(_Problems.of(stored, call, res, self.prompts))
        rows = functools.partial(_arrow_table, list(stored.prompts), call.layer, res.columns, res.sequence_lengths,
                                 self.prompts, self.schema, self.np_dtype, decode_start)
        rows.kind = table_kind(call)  # for the writer, which decides the file's columns by kind
        return rows() if table else rows

    def _add_state(self, layer: int, err: float, tol: float, units: float, precision: str) -> None:
        if err >= self.state_fidelity.get(layer, -1.0):
            self.state_fidelity[layer] = err
            self.state_meta[layer] = (tol, units, precision)

    def _queue_problems(self, problems: _Problems) -> None:
        """Theorem D.7's comparator is solved for many problems at once (its cost is per solver
        iteration, nearly independent of the number of problems): calls wait until a batch of about
        ``theorem_batch_elems`` key entries of one shape is together."""
        if self._pending and self._pending[0].shape != problems.shape:
            self._solve_pending()
        self._pending.append(problems)
        if sum(p.elems for p in self._pending) >= self.theorem_batch_elems:
            self._solve_pending()

    def _solve_pending(self) -> None:
        """Start solving the waiting comparator problems. On a GPU the batch is solved on a thread and
        a CUDA stream of its own while the replay goes on (the solver waits on its own small
        synchronisations, one per iteration, which would otherwise hold the replay up); at most one
        batch is solved at a time, so the earlier one is finished first. On the CPU it is solved here."""
        if not self._pending:
            return
        self._finish_solving()  # first: its batch freed before this one is put together
        batch, self._pending = _Problems.cat(self._pending), []
        if self.solve_beside:
            self._solving = _Solve(batch, self.box)
        else:
            self.comparator_tables.append(batch.solve(self.box))

    def _finish_solving(self) -> None:
        """Wait for the batch being solved beside the replay and add its rows (or raise its error)."""
        solving, self._solving = self._solving, None
        if solving is not None:
            self.comparator_tables.append(solving.result())

    def flush(self) -> None:
        """Solve the waiting comparator problems into ``comparator_tables`` (in the order of the
        calls), waiting for every batch."""
        self._solve_pending()
        self._finish_solving()

    def comparator_table(self) -> pa.Table | None:
        """``comparator.parquet``'s rows so far (``None`` without the comparator or problems)."""
        if self.comparator_tables is None:
            return None
        self.flush()
        return pa.concat_tables(self.comparator_tables) if self.comparator_tables else None

    def merge(self, other: Replayer) -> None:
        """Add another replayer's statistics (e.g. another rank's): exact, by sufficient statistics."""
        self.flush()
        self.ratios.merge(other.ratios)
        self.post.merge(other.post)
        self.tokens.merge(other.tokens)
        self.tokens_post.merge(other.tokens_post)
        for name, accs in getattr(other, "figures", {}).items():
            for mine, theirs in zip(self.figures[name], accs):
                mine.merge(theirs)
        self.audit.merge(other.audit)
        for phase, stats in other.phases.items():
            self.phases[phase] += stats
        if self.retention is not None and other.retention is not None:
            self.retention.merge(other.retention)
        for layer, err in other.fidelity.items():
            self.fidelity[layer] = max(self.fidelity[layer], err)
        for layer, kernels in other.against.items():
            self._add_against(layer, kernels)
        self.families.update(other.families)
        self.tolerances.update(other.tolerances)
        for layer, err in other.state_fidelity.items():
            self._add_state(layer, err, *other.state_meta[layer])
        for layer, n in other.nonfinite.items():
            self.nonfinite[layer] += n
        self.excluded_streams |= other.excluded_streams
        self.streams += other.streams
        if self.comparator_tables is not None and other.comparator_tables:
            self.comparator_tables.extend(other.comparator_tables)

    def state(self) -> dict:
        """What :meth:`merge` needs, picklable (sent between ranks)."""
        self.flush()
        return {name: getattr(self, name) for name in (
            "ratios", "post", "tokens", "tokens_post", "figures", "audit", "phases", "retention", "fidelity", "against", "families", "tolerances", "nonfinite",
            "excluded_streams", "streams", "state_fidelity", "state_meta", "comparator_tables")}

    def _add_against(self, layer: int, kernels: str) -> None:
        # A layer measured against fla in one call and the stand-in in another says "mixed".
        seen = self.against.get(layer)
        self.against[layer] = kernels if seen in (None, kernels) else "mixed"

    def nonfinite_summary(self) -> dict:
        """The (prompt, layer, head) streams left out because their kernel inputs held NaN/Inf:
        ``streams`` of ``of_streams``, the ``tokens`` they hold, per layer, and the prompts they
        belong to (the rows of ``residuals.parquet`` say which, with ``finite = false``)."""
        by_layer: dict[str, int] = defaultdict(int)
        for _, layer, _ in self.excluded_streams:
            by_layer[f"{layer:03d}"] += 1
        return {
            "streams": len(self.excluded_streams),
            "of_streams": self.streams,
            "tokens": self.ratios.excluded_nonfinite,
            "by_layer": dict(sorted(by_layer.items())),
            "prompts": sorted({p for p, _, _ in self.excluded_streams}),
        }

    def summary(self) -> dict:
        boundary = repeat_boundaries(self.prompts.values())
        summary = self.ratios.summary(boundary, self.families)
        _add_per_token(summary, _per_token(self.ratios, self.tokens, self.families))
        if self.post.cells:
            summary["post_decay"] = self.post.summary(boundary, self.families)
            _add_per_token(summary["post_decay"], _per_token(self.post, self.tokens_post, self.families))
        for name, (acc, post) in self.figures.items():
            _add_figure(summary, name, acc, self.families)
            if "post_decay" in summary:
                _add_figure(summary["post_decay"], name, post, self.families)
        # The headline error counts only layers checked against a live kernel: replaying the stand-in
        # reproduces it by construction, so its agreement is no evidence (null when no kernel ran).
        live = [v for k, v in self.fidelity.items() if self.against.get(k, "fla") != "reference"]
        summary["fidelity"] = {
            "measured": bool(live),
            "max_rel_error": max(live) if live else None,
            "by_layer": {f"{k:03d}": v for k, v in sorted(self.fidelity.items())},
            "against_by_layer": {f"{k:03d}": v for k, v in sorted(self.against.items())},
            "tolerance_by_layer": {f"{k:03d}": v for k, v in sorted(self.tolerances.items())},
        }
        layers = sorted(k for k in self.state_fidelity if self.against.get(k, "fla") != "reference")
        if layers:
            summary["fidelity"]["state"] = {
                "max_rel_error": max(self.state_fidelity[k] for k in layers),
                "max_rounding_units": max(self.state_meta[k][1] for k in layers),
                "by_layer": {
                    f"{k:03d}": {
                        "rel_error": self.state_fidelity[k],
                        "tolerance": self.state_meta[k][0],
                        "rounding_units": self.state_meta[k][1],
                        "working_precision": self.state_meta[k][2],
                    }
                    for k in layers
                },
            }
        if self.phases["decode"].n or self.phases["prefill"].n:
            # Generated streams only: q_geo of the prompts' tokens and of the decoded ones.
            summary["by_phase"] = {phase: stats.as_dict() for phase, stats in self.phases.items()}
        summary["assumptions"] = self.audit.summary()
        summary["nonfinite_heads_by_layer"] = {
            f"{k:03d}": v for k, v in sorted(self.nonfinite.items()) if v
        }
        summary["nonfinite"] = self.nonfinite_summary()
        summary["replay"] = {
            "backend": self.backend,
            # layer -> what replayed it: "chunk"/"fused" (Triton), "torch" or "family" (CallReplay.kernel)
            "kernels": {f"{k:03d}": v for k, v in sorted(self.kernels.items())},
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
            "zero_residual": self.zero_residual,
        }
        if self.retention is not None:
            summary["retained"] = self.retention.summary()
        table = self.comparator_table()
        if table is not None:
            summary["comparator"] = comparator_summary(table, self.box)
        return summary


def _per_token(writes: RatioAccumulator, tokens: RatioAccumulator, layer_families: dict[int, str]) -> dict:
    """The per-token statistics (:meth:`RatioAccumulator.per_token`): a micro-step family's layers
    from ``tokens`` (their ``token_ratio``, the product of each token's micro-step ratios), every other
    layer from ``writes`` (one write per token: its ratio is the token's)."""
    combined = RatioAccumulator(tokens.column, writes.num_bins)
    for key, stats in writes.cells.items():
        if layer_families.get(key[0]) not in families.MICRO_STEP_FAMILIES:
            combined.cells[key] += stats
    combined.merge(tokens)
    return combined.per_token(layer_families)


def _add_per_token(summary: dict, per_token: dict) -> None:
    """Add the per-token statistics to a summary (or its ``post_decay``): ``q_geo_per_token`` and
    ``n_tokens`` overall and in every ``by_family`` entry, and there the ``unit`` of the entry's
    ``q_geo``, ``q_arith`` and ``n`` — ``"micro-step"`` for a family of several writes per token
    (:data:`families.MICRO_STEP_FAMILIES`), else ``"token"`` (where the two statistics coincide)."""
    summary["q_geo_per_token"] = per_token["all"]["q_geo"]
    summary["n_tokens"] = per_token["all"]["n"]
    for family, entry in summary.get("by_family", {}).items():
        stats = per_token["by_family"].get(family, {"q_geo": float("nan"), "n": 0})
        entry["unit"] = "micro-step" if family in families.MICRO_STEP_FAMILIES else "token"
        entry["q_geo_per_token"] = stats["q_geo"]
        entry["n_tokens"] = stats["n"]


def _add_figure(summary: dict, name: str, acc: RatioAccumulator, layer_families: dict[int, str]) -> None:
    """A family's own figure (:func:`families.figures`) in the ``by_family`` entries of the families
    whose layers fed it: ``q_geo_<name>`` and ``n_<name>``."""
    if not acc.cells:
        return
    stats = acc.per_token(layer_families)["by_family"]
    for family, entry in summary.get("by_family", {}).items():
        if family in stats:
            entry[f"q_geo_{name}"] = stats[family]["q_geo"]
            entry[f"n_{name}"] = stats[family]["n"]


class _Solve:
    """One batch of comparator problems solved on a thread of its own — on a GPU, on a CUDA stream of
    its own that first waits for the work which produced the batch on the caller's stream. The solution does
    not depend on the thread: the same operations run in the same order as :meth:`_Problems.solve`
    would run them on the caller's thread."""

    def __init__(self, batch: _Problems, box: tuple[float, float]):
        device = batch.k.device
        stream = produced = None
        if device.type == "cuda":
            stream = torch.cuda.Stream(device)
            produced = torch.cuda.current_stream(device).record_event()
            for t in (batch.k, batch.beta, batch.d, batch.q, batch.valid, batch.gated, batch.tol):
                if t is not None:  # the caller's stream may reuse their memory only after the solve's use
                    t.record_stream(stream)
        self.table: pa.Table | None = None
        self.error: BaseException | None = None

        def solve():
            try:
                if stream is None:
                    self.table = batch.solve(box)
                    return
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    stream.wait_event(produced)
                    self.table = batch.solve(box)
            except BaseException as err:  # raised on the caller's thread by result()
                self.error = err

        # A daemon: a run that fails while a batch is being solved exits without waiting for it.
        self.thread = threading.Thread(target=solve, name="comparator", daemon=True)
        self.thread.start()

    def result(self) -> pa.Table:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.table


class _Problems:
    """Theorem D.7's inputs for the (sequence, head) streams of one or more calls, padded to one length:
    ``k [P, L, K]``, ``beta [P, L]``, ``d [P, L, K]`` or None, ``q [P, L]`` (fp64), ``valid [P, L]``,
    ``gated [P]``, ``tol [P]`` (the key-norm tolerance of the dtype the kernel read the keys in:
    ``k`` here is fp32 whatever that was), and per problem its prompt, task, layer and head."""

    def __init__(self, k, beta, d, q, valid, gated, tol, prompt, task, layer, head):
        self.k, self.beta, self.d, self.q, self.valid, self.gated = k, beta, d, q, valid, gated
        self.tol = tol
        self.prompt, self.task, self.layer, self.head = prompt, task, layer, head

    @property
    def shape(self) -> tuple:
        return (*self.k.shape[1:], self.d is not None)

    @property
    def elems(self) -> int:
        return self.k.numel() * (1 if self.d is None else 2)

    @classmethod
    def of(cls, stored: StoredCall, call: KernelCall, res, prompts: dict) -> _Problems:
        """The call's problems: problem ``i·H + h`` is head ``h`` of the call's ``i``-th sequence."""
        H = call.num_heads
        segs = res.segments
        dev = call.k.device
        S = len(segs)
        row, t, head, mask, started = _problem_layout(tuple(map(tuple, segs)), H, dev)

        def streams(x):  # [B, T, H, ...] → [S·H, L, ...]: one gather
            return x[row, t, head]

        k = torch.where(mask[..., None], streams(call.k).float(), 0.0)
        beta = torch.where(mask, streams(call.beta).float(), 0.0)
        d = None
        if call.d is not None:
            d = torch.where(started[:, None, None], streams(call.d).float(), 1.0)
        # The call's ratios and Theorem D.7's tokens, as the replay's zero-residual mode set them.
        q = torch.where(mask, streams(res.grid["residual_ratio"]).double(), 1.0)
        valid = mask & streams(res.grid["theorem_valid"])
        prompt_ids = [stored.prompts[i] for i in range(S) for _ in range(H)]
        return cls(
            torch.nan_to_num(k), torch.nan_to_num(beta), d, q, valid,
            torch.full((S * H,), call.g is not None, device=dev),
            torch.full((S * H,), key_norm_tol(str(call.flags.get("qk_read_as", "float32"))), dtype=torch.float64,
                       device=dev),
            prompt_ids, [str(prompts.get(p, {}).get("task", "")) for p in prompt_ids],
            [call.layer] * (S * H), list(range(H)) * S,
        )

    @classmethod
    def cat(cls, parts: list[_Problems]) -> _Problems:
        if len(parts) == 1:
            return parts[0]
        cat = lambda name: torch.cat([getattr(p, name) for p in parts])  # noqa: E731
        return cls(
            cat("k"), cat("beta"), None if parts[0].d is None else cat("d"), cat("q"), cat("valid"), cat("gated"),
            cat("tol"), *([x for p in parts for x in getattr(p, name)] for name in ("prompt", "task", "layer", "head")),
        )

    def solve(self, box: tuple[float, float]) -> pa.Table:
        """One row of ``comparator.parquet`` per problem."""
        from ..metrics.theorem import theorem_d7

        cols = theorem_d7(self.k, self.beta, self.d, self.q, self.valid,
                          d_min=box[0], d_max=box[1], gated=self.gated, unit_tol=self.tol)
        data = {
            "prompt": pa.array(self.prompt, pa.int32()),
            "task": pa.array(self.task, pa.string()),
            "layer": pa.array(self.layer, pa.int16()),
            "head": pa.array(self.head, pa.int16()),
        }
        for name, x in cols.items():
            data[name] = pa.array(x.cpu().numpy())
        return pa.table(data)


@functools.lru_cache(maxsize=8)
def _problem_layout(segments: tuple, H: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Where the comparator's problems read a call's ``[B, T, H, ...]`` tensors, for ``segments``
    (``(row, start, end)`` of each sequence) and ``H`` heads: ``row, t, head`` ``[S·H, L]`` (``L`` the
    longest sequence; problem ``i·H + h`` is head ``h`` of sequence ``i``; padding reads the sequence's
    last token, as ``eps_at_final_d`` reads d at the last position), ``mask [S·H, L]`` (inside the
    sequence) and ``started [S·H]`` (the sequence has a token).

    Every layer of a forward batch has the same segments: built once and kept (an LRU of eight), which
    saves some twenty small operations per call. Shared between calls: not to be modified in place."""
    S = len(segments)
    L = max((e - s for _, s, e in segments), default=0)
    row, start, n = from_host([[r for r, _, _ in segments], [s for _, s, _ in segments],
                               [e - s for _, s, e in segments]], torch.long, device)
    pos = torch.arange(L, device=device)
    inside = pos[None, :] < n[:, None]  # [S, L]
    t = start[:, None] + torch.minimum(pos[None, :], (n - 1).clamp_min(0)[:, None])  # [S, L]
    per_problem = lambda x: x[:, None].expand(S, H, *x.shape[1:]).reshape(S * H, *x.shape[1:])  # noqa: E731
    head = torch.arange(H, device=device)[None, :, None].expand(S, H, L).reshape(S * H, L)
    return (per_problem(row)[:, None].expand(S * H, L), per_problem(t), head, per_problem(inside),
            per_problem(n > 0))


def comparator_summary(table: pa.Table, box: tuple[float, float]) -> dict:
    """Aggregates of ``comparator.parquet``: means over problems, and the Theorem D.7 check over the
    problems whose hypotheses hold (the bound's slack is reported only there)."""
    cols = {name: torch.tensor(table.column(name).to_numpy(zero_copy_only=False)) for name in
            ("eps_diag", "eps_at_ones", "eps_at_final_d", "regret", "slack", "kkt_residual", "gap",
             "hypotheses_hold", "n_valid", "share_newton_infeasible", "newton_feasible", "newton_feasible_box")}
    hold = cols["hypotheses_hold"].bool()
    # Each check of the hypotheses per stream, from its column (has_valid_token is n_valid > 0).
    flags = {name: torch.tensor(table.column(name).to_numpy(zero_copy_only=False)).bool()
             for name in HYPOTHESES if name != "has_valid_token"}
    flags["has_valid_token"] = cols["n_valid"] > 0
    flags["hypotheses_hold"] = hold
    has = cols["n_valid"] > 0

    def mean(x, sel):
        x = x[sel].double()
        return float(x.mean()) if x.numel() else None

    slack = cols["slack"][hold].double()
    return {
        "box": list(box),
        "problems": int(len(hold)),
        "eps_diag_mean": mean(cols["eps_diag"], has),
        # The mean of the two middle values for an even count (torch's median() takes the lower one).
        "eps_diag_median": float(np.median(cols["eps_diag"][has].double().numpy())) if bool(has.any()) else None,
        "eps_at_ones_mean": mean(cols["eps_at_ones"], has),
        "eps_at_final_d_mean": mean(cols["eps_at_final_d"], has),
        "regret_mean": mean(cols["regret"], has),
        "share_newton_infeasible_mean": mean(cols["share_newton_infeasible"], has),
        # Streams on which Theorem 5.2's gated Newton system is solvable (in R^K / in the box).
        "share_newton_feasible": mean(cols["newton_feasible"], has),
        "share_newton_feasible_box": mean(cols["newton_feasible_box"], has),
        "max_kkt_residual": float(cols["kkt_residual"].max()) if len(hold) else None,
        "max_gap": float(cols["gap"].max()) if len(hold) else None,
        "hypotheses_hold": int(hold.sum()),
        "hypotheses_failed": count_hypotheses(flags)["hypotheses_failed"],
        "bound_holds": int((slack >= -1e-6).sum()),
        "slack_min": float(slack.min()) if slack.numel() else None,
        "slack_mean": float(slack.mean()) if slack.numel() else None,
    }


def _add_retention(acc, call, prompt_ids, prompts, lengths) -> None:
    if call.family in families.NOT_APPLICABLE:
        # The probes recompute states with the delta rule along the record's k (d ⊙ k): not these
        # families' writes, so their numbers would describe another model.
        raise ValueError(
            f"layer {call.layer} ({call.layer_name}): --retained does not apply to the family "
            f"{call.family} ({families.NOT_APPLICABLE[call.family]}): its probes replay delta-rule writes "
            "(docs/families.md); replay without --retained"
        )
    for seq, (pid, length) in enumerate(zip(prompt_ids, lengths)):
        info = prompts.get(int(pid), {})
        repeat = int(info.get("repeat_start", -1))
        cols = retrieval_errors(call, seq, probe_positions(length, repeat))
        acc.add(str(info.get("task", "")), cols, length, repeat)


def repeat_boundaries(prompts) -> dict[str, float]:
    """Task → mean relative position where the repeated context starts (prompts with a repeat)."""
    acc: dict[str, list[float]] = defaultdict(list)
    for p in prompts:
        if int(p.get("repeat_start", -1)) >= 0 and p.get("length"):
            acc[str(p.get("task", ""))].append(int(p["repeat_start"]) / int(p["length"]))
    return {task: sum(v) / len(v) for task, v in sorted(acc.items())}


def _decode_start(call: KernelCall) -> int:
    """Where a generated stream's decoded tokens start in ``call`` (one sequence), else -1."""
    value = call.flags.get("decode_start")
    return -1 if value is None else int(value)


def _add_phases(phases: dict, cols: dict, decode_start: int) -> None:
    """Add a generated stream's finite ratios to ``phases["prefill"]`` (positions before
    ``decode_start``) and ``phases["decode"]`` (from it on)."""
    finite = cols["finite"].bool()
    decoded = cols["pos"] >= decode_start
    q = cols["residual_ratio"]
    phases["prefill"] += RatioStats.of(q[finite & ~decoded])
    phases["decode"] += RatioStats.of(q[finite & decoded])


def _arrow_table(prompt_ids: list[int], layer: int, cols: dict, lengths, prompts: dict, schema: pa.Schema,
                 np_dtype: str, decode_start: int = -1) -> pa.Table:
    """The rows of one replayed call of layer ``layer`` from its host columns ``cols`` (the replay's
    ``columns``); sequence ``i`` of the call is prompt ``prompt_ids[i]``, ``lengths[i]`` tokens long."""
    seq = cols["sequence"].numpy()
    info = [prompts.get(int(p), {}) for p in prompt_ids]
    per_seq = {
        "prompt": np.asarray(prompt_ids, dtype=np.int32),
        "task": np.asarray([str(i.get("task", "")) for i in info], dtype=object),
        "repeat_start": np.asarray([int(i.get("repeat_start", -1)) for i in info], dtype=np.int32),
        "length": np.asarray(lengths, dtype=np.float32),
    }
    pos = cols["pos"].numpy()
    n = len(seq)
    data = {
        "prompt": per_seq["prompt"][seq],
        "task": pa.array(per_seq["task"], pa.string()).take(pa.array(seq)),  # no per-row Python strings
        "layer": np.full(n, layer, dtype=np.int16),
        "head": cols["head"].numpy().astype(np.int16),
        "pos": pos,
        "rel_pos": pos / per_seq["length"][seq],
        "repeat_start": per_seq["repeat_start"][seq],
        "decode_start": np.full(n, decode_start, dtype=np.int32),
        "finite": cols["finite"].numpy(),
    }
    arrays = []
    for f in schema:
        if f.name in data:
            arrays.append(pa.array(data[f.name], f.type))
        elif f.name in cols:
            # A family column of a declared integer type (e.g. a micro-step index) is cast from the
            # replay's float values, which hold it exactly.
            kind = f.type.to_pandas_dtype() if pa.types.is_integer(f.type) else np_dtype
            arrays.append(pa.array(cols[f.name].numpy().astype(kind), f.type))
        else:
            arrays.append(pa.nulls(n, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)
