"""Watch residual contraction while a model trains.

    from osdn_diag.monitor import Monitor
    mon = Monitor(model, probe_ids, every=100, out="runs/train")     # probe_ids: [B, T] token ids
    for step in range(1, steps + 1):
        ...                                  # forward, backward, optimizer step
        mon.step(step)                       # every 100 steps: probe, replay, log, append
    mon.close()                              # prints the monitor's share of the training time

    # with a transformers Trainer (constructing the callback adds it to the trainer):
    from osdn_diag.monitor import MonitorCallback
    MonitorCallback(trainer, probe_ids, every=100, out=trainer.args.output_dir)

A *probe* runs the fixed batch ``probe_ids`` through the model once, in eval mode and under
``torch.no_grad()``, inside :func:`osdn_diag.capture`, and replays what the delta-rule kernels received in
fp32 with :func:`osdn_diag.replay` — the same computation as ``osdn-diag run`` of a checkpoint saved at
that step, on the same batch. It then restores every module's train/eval flag and the random-number
generators (torch CPU and CUDA, Python's ``random``, numpy's global one): a training loop that draws
batches or dropout masks from them goes on exactly as it would have without the monitor. Gradients,
parameters and the optimizer are not touched.

What it records per probe, one row per layer and one for the whole model (``layer = -1``): ``q_geo``,
``q_arith`` and ``n`` (the replay summary's ``by_layer`` entries and its overall ones), and for a
layer with a preconditioner ``d`` (the OSDN family) the mean, standard deviation, minimum and maximum of
its entries and the fraction that moved from 1 by more than 10⁻³. The rows go to ``monitor.parquet``
(rewritten atomically after each probe, under a lock beside it, so that monitors in several processes
may share the file; a probe at a step already in the file replaces that step's rows
of the same model, so a resumed run does not duplicate them), to :attr:`Monitor.rows`, and as scalars
to ``log`` (a custom loop's logger) or the Trainer's loggers (TensorBoard, W&B, CSV, ... through
``trainer.log``). The file's schema: docs/monitor.md.

Distributed training: only global rank 0 probes, logs and writes; the other ranks return at once. The
probe calls the bare module (``model.module`` of a ``DistributedDataParallel``), so no collective runs.

transformers is imported only by :class:`MonitorCallback`; this module itself needs torch and pyarrow.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

__all__ = ["SCHEMA_FIELDS", "Monitor", "MonitorCallback", "read"]

#: ``monitor.parquet``'s columns, in order (docs/monitor.md).
SCHEMA_FIELDS = ("model", "step", "layer", "q_geo", "q_arith", "n",
                 "d_mean", "d_std", "d_min", "d_max", "d_moved", "probe_seconds")

#: |d - 1| above which an entry of d counts as moved from its initial value 1.
D_MOVED = 1e-3


def _schema():
    import pyarrow as pa

    return pa.schema([
        ("model", pa.string()), ("step", pa.int64()), ("layer", pa.int32()),
        ("q_geo", pa.float64()), ("q_arith", pa.float64()), ("n", pa.int64()),
        ("d_mean", pa.float64()), ("d_std", pa.float64()), ("d_min", pa.float64()), ("d_max", pa.float64()),
        ("d_moved", pa.float64()), ("probe_seconds", pa.float64()),
    ])


def read(path: str | os.PathLike):
    """A ``monitor.parquet`` (or the directory holding one) as a pyarrow table."""
    import pyarrow.parquet as pq

    path = Path(path)
    if path.is_dir():
        path = path / "monitor.parquet"
    return pq.read_table(path)


def _rank() -> int:
    """This process's global rank (0 outside distributed training)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``.NAME.lock`` beside ``path`` while the block runs, waited for: the
    monitors of models trained side by side in several processes may share one ``monitor.parquet``,
    and each one's read, merge and rewrite of it must not lose another's rows. The lock file is taken
    as a run directory's is (:func:`osdn_diag.rundir.wait_for_lock`: never through a link, a FIFO or
    a hard link; refused with one line) and removed by its holder."""
    from .rundir import wait_for_lock

    lock = path.with_name(f".{path.name}.lock")
    path.parent.mkdir(parents=True, exist_ok=True)  # the first probe makes the directory, as it always did
    fd = wait_for_lock(lock)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)  # still held: a process waiting on this file starts again
        os.close(fd)


def _bare(model):
    """The module a data-parallel wrapper holds: its forward runs no collective."""
    import torch

    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while isinstance(model, wrappers):
        model = model.module
    return model


def _rng_states() -> tuple:
    import numpy as np
    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()


def _restore_rng(states: tuple) -> None:
    import numpy as np
    import torch

    cpu, cuda, py, npy = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    np.random.set_state(npy)


def _d_stats(ds: list) -> dict:
    import torch

    d = torch.cat([x.detach().reshape(-1).to("cpu", torch.float64) for x in ds])
    d = d[torch.isfinite(d)]
    if not d.numel():
        return {}
    return {"d_mean": float(d.mean()), "d_std": float(d.std()) if d.numel() > 1 else 0.0,
            "d_min": float(d.min()), "d_max": float(d.max()),
            "d_moved": float(((d - 1).abs() > D_MOVED).double().mean())}


#: The monitors of this process that write a file, by (file, name): two models under one name would
#: replace each other's rows at every step they both probe.
_WRITERS: "weakref.WeakValueDictionary[tuple[str, str], Monitor]" = weakref.WeakValueDictionary()


def _claim(monitor: "Monitor", bare, *, defaulted: bool) -> tuple[str, str]:
    """Refuse a monitor whose file and name a live monitor of another model of this process holds
    (a monitor made again for the same model, as a notebook cell run twice makes it, takes over);
    else register it and return the key it holds (for :func:`_release`)."""
    key = (str(monitor.path.resolve()), monitor.name)
    other = _WRITERS.get(key)
    if other is not None and _bare(other.model) is not bare:
        default = " (the default: the config's model_type)" if defaulted else ""
        raise ValueError(
            f"argument 'name': another Monitor of this process writes {monitor.path} for another model "
            f"under the name {monitor.name!r}{default}; each would replace the other's rows at every step "
            "both probe. Give each model its own name=")
    _WRITERS[key] = monitor
    return key


def _release(monitor: "Monitor") -> None:
    """Give up the file and name :func:`_claim` registered ``monitor`` under — by the key it returned,
    not one resolved again (the working directory may have changed) — unless another monitor took them
    over since."""
    key, monitor._claimed = monitor._claimed, None
    if key is not None and _WRITERS.get(key) is monitor:
        del _WRITERS[key]


class Monitor:
    """Probe a training model's contraction every ``every`` steps.

    Args:
        model: the model being trained (an fla model, an OSDN model of this package, a transformers
            model with delta-rule layers; a ``DistributedDataParallel`` wrapper is looked through).
        probe_batch: the fixed held-out batch: token ids ``[B, T]`` (a ``LongTensor``), or a mapping of
            the model's keyword arguments (``input_ids``, ``attention_mask``). Moved to the model's
            device once, on the first probe.
        every: probe when ``step % every == 0`` (:meth:`step`).
        out: a directory (the rows go to ``out/monitor.parquet``) or a ``.parquet`` path; ``None``
            keeps them in memory only (:attr:`rows`).
        name: the ``model`` column and the loggers' prefix (default: the config's ``model_type``, else
            the class name). Two models whose monitors write one file need names of their own: a
            second model's monitor under a name that a live one of this process writes is refused.
        log: ``log(scalars, step)`` after each probe, e.g. ``wandb.log`` or a TensorBoard writer's
            ``add_scalar`` loop; ``scalars`` maps ``"contraction/NAME/q_geo"``,
            ``".../q_geo/layer_000"``, ``".../q_arith/..."``, ``".../d_mean/..."`` to floats.
        autocast: a dtype (``torch.bfloat16``) to run the probe's forward under ``torch.autocast`` on
            the model's device, as training does; ``None`` runs it as the caller's context does.
            The replay is fp32 either way.
        kernels: what runs inside the hooked kernels (:func:`osdn_diag.capture`): ``"auto"`` — fla's
            kernels on a GPU, the reference recurrence on the CPU.
        replay_kw: more keywords for :func:`osdn_diag.replay` (``backend``, ``tolerance``, ...);
            ``comparator`` defaults to False here (the monitor reads no comparator figure).
        verbose: print a line per probe (rank 0).
    """

    #: The (file, name) key this monitor holds in the process's registry of writers, ``None`` if none.
    _claimed: tuple[str, str] | None = None

    def __init__(self, model, probe_batch, *, every: int = 100, out: str | os.PathLike | None = None,
                 name: str | None = None, log: Callable[[dict, int], None] | None = None,
                 autocast=None, kernels: str = "auto", replay_kw: Mapping | None = None, verbose: bool = False):
        import torch

        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"argument 'every': expected a whole number of steps >= 1, got {every!r}")
        if isinstance(probe_batch, torch.Tensor):
            if probe_batch.dim() != 2 or probe_batch.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"argument 'probe_batch': expected token ids [batch, time] (int64), got a "
                                 f"{probe_batch.dtype} tensor of shape {tuple(probe_batch.shape)}")
            probe_batch = {"input_ids": probe_batch}
        elif not isinstance(probe_batch, Mapping) or "input_ids" not in probe_batch:
            raise ValueError("argument 'probe_batch': expected token ids [batch, time] or a mapping with "
                             "'input_ids'")
        if autocast is not None and not isinstance(autocast, torch.dtype):
            raise ValueError(f"argument 'autocast': expected a torch dtype or None, got {autocast!r}")
        self.model = model
        self.every = every
        self.batch = dict(probe_batch)
        self._on_device = False
        bare = _bare(model)
        cfg = getattr(bare, "config", None)
        self.name = name or getattr(cfg, "model_type", None) or type(bare).__name__
        self.path = None if out is None else (
            Path(out) if str(out).endswith(".parquet") else Path(out) / "monitor.parquet")
        if self.path is not None:
            self._claimed = _claim(self, bare, defaulted=name is None)
        self.log = log
        self.autocast = autocast
        self.kernels = kernels
        self.replay_kw = {"comparator": False, **(replay_kw or {})}
        self.verbose = verbose
        #: Every row recorded by this monitor, as dictionaries with :data:`SCHEMA_FIELDS`.
        self.rows: list[dict] = []
        #: Probes run, and their seconds (forward, capture, replay, logging and writing); the first
        #: probe's alone, which compiles the kernels the probe runs at its shape (41.7 s on an H100 for
        #: the built-in LM recipe, where the later ones take 0.05–0.15 s).
        self.probes = 0
        self.seconds = 0.0
        self.first_seconds = 0.0
        self.started = time.perf_counter()

    # -- probing ---------------------------------------------------------------------------------
    def step(self, step: int) -> list[dict] | None:
        """Probe if ``step`` is a multiple of ``every`` (on rank 0); the rows, or None."""
        if step % self.every:
            return None
        return self.probe(step)

    def probe(self, step: int) -> list[dict] | None:
        """Probe now, recording the rows under ``step``; None on ranks other than 0."""
        if _rank() != 0:
            return None
        import torch

        clock = time.perf_counter()
        bare = _bare(self.model)
        param = next(bare.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            clock = time.perf_counter()
        res, ds = self._capture_replay(bare, device)
        rows = self._rows(step, res, ds)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - clock
        for row in rows:
            row["probe_seconds"] = seconds
        self.rows = [r for r in self.rows if r["step"] != step] + rows
        if self.path is not None:
            self._append(rows)
        if self.log is not None:
            self.log(self.scalars(rows), step)
        self.probes += 1
        spent = time.perf_counter() - clock
        self.seconds += spent
        if self.probes == 1:
            self.first_seconds = spent
        if self.verbose:
            whole = rows[-1]
            print(f"[monitor] {self.name} step {step}: q_geo {whole['q_geo']:.4f}, q_arith {whole['q_arith']:.4f} "
                  f"({seconds:.2f} s)", file=sys.stderr)
        return rows

    def _capture_replay(self, bare, device):
        import torch

        import osdn_diag

        if not self._on_device:
            self.batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.batch.items()}
            self._on_device = True
        modes = [(m, m.training) for m in bare.modules()]
        states = _rng_states()
        amp = (torch.autocast(device.type, dtype=self.autocast) if self.autocast is not None
               else _nothing())
        try:
            bare.eval()
            with torch.no_grad(), amp, osdn_diag.capture(bare, kernels=self.kernels) as cap:
                bare(**self.batch)
            calls = cap.calls
            ds: dict[int, list] = {}
            for c in calls:
                if c.d is not None:
                    ds.setdefault(c.layer, []).append(c.d)
            with torch.no_grad():
                res = osdn_diag.replay(calls, dtype=torch.float32, **self.replay_kw)
        finally:
            for m, flag in modes:  # each module's own flag: a frozen submodule kept in eval stays so
                m.training = flag
            _restore_rng(states)
        return res, ds

    def _rows(self, step: int, res, ds: dict) -> list[dict]:
        summary = res.summary
        empty = dict.fromkeys(("d_mean", "d_std", "d_min", "d_max", "d_moved"))
        rows = []
        for key, entry in sorted(summary["by_layer"].items(), key=lambda kv: int(kv[0])):
            layer = int(key)
            d = _d_stats(ds[layer]) if layer in ds else {}
            rows.append({"model": self.name, "step": int(step), "layer": layer, "q_geo": float(entry["q_geo"]),
                         "q_arith": float(entry["q_arith"]), "n": int(entry["n"]), **empty, **d})
        whole = _d_stats([x for v in ds.values() for x in v]) if ds else {}
        rows.append({"model": self.name, "step": int(step), "layer": -1, "q_geo": float(summary["q_geo"]),
                     "q_arith": float(summary["q_arith"]), "n": int(summary["n"]), **empty, **whole})
        return rows

    # -- outputs ---------------------------------------------------------------------------------
    def scalars(self, rows: list[dict]) -> dict[str, float]:
        """The loggers' scalars of one probe's rows: ``contraction/NAME/q_geo`` (all layers),
        ``contraction/NAME/q_geo/layer_000``, and likewise ``q_arith`` and the d statistics."""
        out: dict[str, float] = {}
        prefix = f"contraction/{self.name}"
        for row in rows:
            tail = "" if row["layer"] < 0 else f"/layer_{row['layer']:03d}"
            for key in ("q_geo", "q_arith", "d_mean", "d_min", "d_max", "d_moved"):
                if row.get(key) is not None:
                    out[f"{prefix}/{key}{tail}"] = row[key]
        return out

    def table(self):
        """This monitor's rows as a pyarrow table (``monitor.parquet``'s schema)."""
        import pyarrow as pa

        return pa.Table.from_pylist([{k: r.get(k) for k in SCHEMA_FIELDS} for r in self.rows], schema=_schema())

    def _append(self, rows: list[dict]) -> None:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        from .runtime.atomic import atomic_path, refuse_link

        refuse_link(self.path)
        step = rows[0]["step"]
        with _locked(self.path):  # other processes' monitors may share the file: read and rewrite it alone
            parts, recorded = [], set()
            if self.path.exists():
                old = pq.read_table(self.path).cast(_schema())
                mine = pc.equal(old["model"], self.name)
                parts.append(old.filter(pc.invert(pc.and_(mine, pc.equal(old["step"], step)))))
                recorded = set(old.filter(mine).column("step").to_pylist())
            # This monitor's earlier probes that the file lacks (it was deleted, or replaced by an older
            # copy) are written again from its rows, which a resumed run restores from its state.
            lost = [r for r in self.rows if r["step"] != step and r["step"] not in recorded]
            parts.append(pa.Table.from_pylist([{k: r.get(k) for k in SCHEMA_FIELDS} for r in lost + rows],
                                              schema=_schema()))
            with atomic_path(self.path, ".parquet") as tmp:
                pq.write_table(pa.concat_tables(parts), tmp)

    def overhead(self, total_seconds: float | None = None) -> dict:
        """``{"probes", "probe_seconds", "total_seconds", "fraction", "first_probe_seconds",
        "fraction_after_first"}``: the probes' share of ``total_seconds`` (default: the time since the
        monitor was made), and apart from it the first probe's seconds and the later probes' share of
        the time left without it — the recurring cost, where the first probe also pays a one-time
        compilation (``None`` before a second probe: the dictionary goes into JSON files as it is)."""
        total = time.perf_counter() - self.started if total_seconds is None else float(total_seconds)
        later, rest = self.seconds - self.first_seconds, total - self.first_seconds
        return {"probes": self.probes, "probe_seconds": self.seconds, "total_seconds": total,
                "fraction": self.seconds / total if total > 0 else math.nan,
                "first_probe_seconds": self.first_seconds,
                "fraction_after_first": later / rest if self.probes > 1 and rest > 0 else None}

    def state(self) -> dict:
        """What a training loop saves to resume this monitor in a later process (:meth:`restore`): its rows
        and probe timings, as plain Python values (``torch.load(..., weights_only=True)`` reads them)."""
        return {"rows": [dict(r) for r in self.rows], "probes": self.probes, "seconds": self.seconds,
                "first_seconds": self.first_seconds, "elapsed": time.perf_counter() - self.started}

    def restore(self, state: Mapping) -> None:
        """Take back a :meth:`state` saved by the same monitor in an earlier process: :attr:`rows` and the
        probes' count and seconds (:meth:`overhead`) go on from there. ``monitor.parquet`` already holds
        the rows; probes at steps already recorded replace them there. The monitor's clock goes on from
        the saved one too, so that :meth:`overhead` without ``total_seconds`` sets the probes of every
        process against the time of every process (the time between the processes left out)."""
        missing = [k for k in ("rows", "probes", "seconds", "first_seconds") if k not in state]
        if missing:
            raise ValueError(f"argument 'state': not a Monitor.state() (it lacks {', '.join(missing)})")
        self.rows = [dict(r) for r in state["rows"]]
        self.probes, self.seconds, self.first_seconds = state["probes"], state["seconds"], state["first_seconds"]
        self.started = time.perf_counter() - float(state.get("elapsed", 0.0))

    def close(self, total_seconds: float | None = None) -> dict:
        """Print the monitor's overhead on rank 0 (:meth:`overhead`) and return it. The monitor gives up
        its file and name: a monitor of another model may write them next (a stopped training command
        resumed in the same process makes its model anew)."""
        _release(self)
        o = self.overhead(total_seconds)
        if _rank() == 0:
            others = "the other" if o["probes"] == 2 else f"the {o['probes'] - 1} others"
            after = ("" if o["fraction_after_first"] is None else
                     f"; the first {o['first_probe_seconds']:.2f} s (it compiles the probe's kernels), "
                     f"{others} {100 * o['fraction_after_first']:.2f} % of the rest")
            print(f"[monitor] {self.name}: {o['probes']} probe{'s' if o['probes'] != 1 else ''} took "
                  f"{o['probe_seconds']:.2f} s, "
                  f"{100 * o['fraction']:.2f} % of {o['total_seconds']:.1f} s of training{after}", file=sys.stderr)
        return o


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def MonitorCallback(trainer, probe_batch, *, every: int = 100, out: str | os.PathLike | None = None,
                    name: str | None = None, **kw):
    """A :class:`transformers.TrainerCallback` that probes ``trainer``'s model every ``every``
    optimizer steps (``state.global_step``) and sends the scalars through ``trainer.log`` — every
    logger the Trainer reports to receives them — and the rows to ``out/monitor.parquet``. Making it
    adds it to the trainer; it is returned too (``.monitor`` is its :class:`Monitor`). Training in
    bf16/fp16 (``args.bf16``/``args.fp16``) probes under that autocast unless ``autocast=`` says
    otherwise; other keywords as :class:`Monitor`. At the end of training it prints its overhead."""
    from transformers import TrainerCallback

    args = trainer.args
    if "autocast" not in kw:
        import torch

        kw["autocast"] = torch.bfloat16 if getattr(args, "bf16", False) else (
            torch.float16 if getattr(args, "fp16", False) else None)

    class _Callback(TrainerCallback):
        def __init__(self):
            self.trainer = trainer
            self.monitor = Monitor(trainer.model, probe_batch, every=every, out=out, name=name, **kw)
            self._begin = None

        def on_train_begin(self, args, state, control, **kwargs):
            self._begin = time.perf_counter()
            self.monitor.started = self._begin

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % self.monitor.every or not state.is_world_process_zero:
                return control
            rows = self.monitor.probe(state.global_step)
            if rows:
                # Trainer.log ends with the callbacks' on_log, which marks this step's logging done
                # (should_log = False): the Trainer's own log (loss, learning rate) due at this step
                # would never be written. It is due all the same.
                due = control.should_log
                self.trainer.log(self.monitor.scalars(rows))
                control.should_log = self.trainer.control.should_log = due
            return control

        def on_train_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self.monitor.close()
            return control

    callback = _Callback()
    trainer.add_callback(callback)
    return callback
