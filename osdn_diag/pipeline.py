"""Run-directory pipeline: capture directory → ``residuals.parquet`` + ``summary.json``.

The per-token table has one row per (prompt, layer, head, position) with the columns of the
interface contract (DESIGN.md): ``prompt, task, layer, head, pos, rel_pos, repeat_start, beta,
key_sqnorm, write_gain, loss_before, loss_after, residual_ratio``, plus ``loss_before_decayed`` and
``residual_ratio_post`` (null for ungated layers) and ``finite``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from .capture.record import KernelCall
from .capture.store import CaptureReader, CaptureWriter, StoredCall, atomic_write_text, to_device
from .metrics.audit import AuditAccumulator
from .metrics.ratios import RatioAccumulator
from .metrics.retention import RetentionAccumulator, probe_positions, retrieval_errors
from .replay import replay_call

__all__ = [
    "COMPARATOR",
    "CONTRACT_COLUMNS",
    "RESIDUALS",
    "SUMMARY",
    "Replayer",
    "capture_run",
    "replay_run",
]

RESIDUALS = "residuals.parquet"
COMPARATOR = "comparator.parquet"
SUMMARY = "summary.json"

_VALUE_COLUMNS = ("beta", "key_sqnorm", "write_gain", "loss_before", "loss_after", "residual_ratio")
_GATED_COLUMNS = ("loss_before_decayed", "residual_ratio_post")
#: The per-token table's columns that the interface contract guarantees.
CONTRACT_COLUMNS = ("prompt", "task", "layer", "head", "pos", "rel_pos", "repeat_start", *_VALUE_COLUMNS)


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
            *[(c, value_type) for c in _VALUE_COLUMNS + _GATED_COLUMNS],
            ("finite", pa.bool_()),
        ]
    )


def _progress(iterable, total: int, enabled: bool, desc: str, unit: str):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("osdn-diag", "torch", "triton", "flash-linear-attention", "fla-core", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _batches(prompts, batch_size: int):
    for i in range(0, len(prompts), batch_size):
        yield i // batch_size, prompts[i : i + batch_size]


def _inputs(batch, device):
    """``input_ids`` (right-padded) and, when lengths differ, the ``attention_mask`` fla unpads with
    (the kernels then see the batch packed as ``cu_seqlens``, sequences in batch order)."""
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, p in enumerate(batch):
        ids[row, : len(p)] = torch.tensor(p.input_ids)
        mask[row, : len(p)] = 1
    if bool(mask.all()):
        return ids.to(device), None
    return ids.to(device), mask.to(device)


def capture_run(
    model_spec: str,
    prompts_spec: str,
    out_dir: str | os.PathLike,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    kernels: str = "auto",
    batch_size: int = 1,
    twice: bool = False,
    num_prompts: int = 8,
    length: int = 512,
    seed: int = 0,
    progress: bool = True,
) -> Path:
    """Load the model, run every prompt through it under :func:`osdn_diag.capture.capture`, and stream
    the captured calls to ``out_dir/capture``. The manifest says ``"complete": true`` only at the end.

    ``dtype`` defaults to bf16 on CUDA (fla's chunk kernels refuse fp32 DeltaNet inputs) and fp32 on
    the CPU. Returns ``out_dir``.
    """
    from . import distributed, runtime
    from .capture.context import capture
    from .models import load_model
    from .prompts import load_prompts

    if batch_size < 1:
        raise ValueError(f"argument 'batch_size': expected >= 1, got {batch_size}")
    ranks = distributed.current()
    device = runtime.prepare(device or ranks.device())
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    out_dir = Path(out_dir)
    writer = CaptureWriter(out_dir)
    if ranks.is_main:
        writer.begin({"versions": _versions(), "model": {"spec": model_spec}, "prompts_source": prompts_spec})
    ranks.barrier()
    loaded = load_model(model_spec, device=device, dtype=dtype, seed=seed)
    tokenize = _tokenizer(loaded.directory)
    prompts = load_prompts(
        prompts_spec, vocab_size=loaded.config["vocab_size"], tokenize=tokenize, twice=twice,
        num_prompts=num_prompts, length=length, seed=seed,
    )
    batches = [(i, b) for i, b in _batches(prompts, batch_size) if ranks.owns(i)]
    hits: dict[int, tuple[int, int]] = {}  # prompt id -> (answers right, queries), recall prompts only
    with capture(loaded.model, kernels=kernels) as cap, torch.inference_mode():
        for batch_idx, batch in _progress(batches, len(batches), progress and ranks.is_main, "capture", "batch"):
            ids, mask = _inputs(batch, device)
            out = loaded.model(input_ids=ids, attention_mask=mask, use_cache=False)
            for call in cap.calls:
                writer.write(batch_idx, [p.id for p in batch], call)
            cap.calls.clear()
            hits.update(_recall_hits(batch, getattr(out, "logits", None)))
    for layers in ranks.gather(writer.layers):  # a rank may have had no batch: take every rank's
        for index, entry in layers.items():
            writer.layers.setdefault(index, entry)
    for part in ranks.gather(hits):
        hits.update(part)
    kernels_used = sorted({layer["flags"].get("kernels", kernels) for layer in writer.layers.values()})
    ranks.barrier()  # every rank's shards are on disk before the manifest says complete
    if ranks.is_main:
        _finish_capture(writer, loaded, prompts, model_spec, device, dtype, kernels_used, batch_size,
                        twice, seed, ranks.world, hits)
    ranks.barrier()  # and no rank goes on before it does
    return out_dir


def _recall_hits(batch, logits: torch.Tensor | None) -> dict[int, tuple[int, int]]:
    """``{prompt id: (correct answers, queries)}`` for the recall prompts of a batch (those whose
    ``meta`` names ``answer_positions`` and ``answers``): the argmax at each query position against
    the answer that follows it."""
    out = {}
    for row, p in enumerate(batch):
        pos, ans = p.meta.get("answer_positions"), p.meta.get("answers")
        if logits is None or not pos:
            continue
        pred = logits[row, torch.as_tensor(pos, device=logits.device)].argmax(-1).cpu()
        out[p.id] = (int((pred == torch.as_tensor(ans)).sum()), len(pos))
    return out


def recall_table(manifest: dict) -> dict[str, dict]:
    """Recall accuracy per task from a capture manifest: ``{task: {"accuracy", "correct", "queries",
    "prompts"}}`` (query-weighted), for the prompts that carry answers; empty when none do."""
    per_task: dict[str, list[int]] = {}
    for p in manifest.get("prompts", []):
        if "recall_correct" in p:
            acc = per_task.setdefault(p["task"], [0, 0, 0])
            acc[0] += int(p["recall_correct"])
            acc[1] += int(p["recall_queries"])
            acc[2] += 1
    return {
        task: {"accuracy": c / q if q else float("nan"), "correct": c, "queries": q, "prompts": n}
        for task, (c, q, n) in per_task.items()
    }


def _finish_capture(writer, loaded, prompts, model_spec, device, dtype, kernels_used, batch_size,
                    twice, seed, world, hits) -> None:
    entries = []
    for p in prompts:
        entry = p.manifest_entry()
        if p.id in hits:
            entry["recall_correct"], entry["recall_queries"] = hits[p.id]
        entries.append(entry)
    writer.finish(
        {
            "model": {
                "spec": model_spec,
                "source": loaded.source,
                "model_type": loaded.config.get("model_type"),
                "hidden_size": loaded.config.get("hidden_size"),
                "num_hidden_layers": loaded.config.get("num_hidden_layers"),
                "num_heads": loaded.config.get("num_heads"),
                "vocab_size": loaded.config.get("vocab_size"),
            },
            "prompts": entries,
            "twice": twice,
            "seed": seed,
            "device": str(device),
            "dtype": str(dtype).removeprefix("torch."),
            "kernels": kernels_used,
            "batch_size": batch_size,
            "world_size": world,
        }
    )


def _tokenizer(directory: Path | None):
    """The model directory's own tokenizer, from local files only; ``None`` when it has none."""
    if directory is None or not any(directory.glob("tokenizer*")):
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


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
    ):
        self.prompts = prompts
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.backend = ("triton" if self.device.type == "cuda" else "torch") if backend == "auto" else backend
        self.dtype = dtype
        self.tolerance = tolerance
        self.transform = transform
        self.schema = _schema(pa.float64() if dtype == torch.float64 else pa.float32())
        self.np_dtype = "float64" if dtype == torch.float64 else "float32"
        self.ratios = RatioAccumulator("residual_ratio")
        self.post = RatioAccumulator("residual_ratio_post")
        self.audit = AuditAccumulator()
        self.retention = RetentionAccumulator() if retained else None
        self.box = box
        self.comparator_tables: list[pa.Table] | None = [] if comparator else None
        self.fidelity: dict[int, float] = defaultdict(float)
        self.tolerances: dict[int, float] = {}
        self.nonfinite: dict[int, int] = defaultdict(int)

    def add(self, stored: StoredCall) -> pa.Table:
        call = to_device(stored.call, self.device)
        if self.transform is not None:
            call = self.transform(call)
        res = replay_call(call, backend=self.backend, dtype=self.dtype, tolerance=self.tolerance)
        self.fidelity[call.layer] = max(self.fidelity[call.layer], res.fidelity)
        self.tolerances[call.layer] = res.tolerance
        self.nonfinite[call.layer] += res.nonfinite
        tasks = [str(self.prompts.get(p, {}).get("task", "")) for p in stored.prompts]
        self.ratios.add(call.layer, res.columns, tasks, res.sequence_lengths)
        self.post.add(call.layer, res.columns, tasks, res.sequence_lengths)
        self.audit.add(call, res.grid["loss_before"], res.grid["finite"])
        if self.retention is not None:
            _add_retention(self.retention, call, stored.prompts, self.prompts, res.sequence_lengths)
        if self.comparator_tables is not None:
            self.comparator_tables.append(self._theorem(stored, call, res))
        return _arrow_table(stored, res, self.prompts, self.schema, self.np_dtype)

    def merge(self, other: Replayer) -> None:
        """Add another replayer's statistics (e.g. another rank's): exact, by sufficient statistics."""
        self.ratios.merge(other.ratios)
        self.post.merge(other.post)
        self.audit.merge(other.audit)
        if self.retention is not None and other.retention is not None:
            self.retention.merge(other.retention)
        for layer, err in other.fidelity.items():
            self.fidelity[layer] = max(self.fidelity[layer], err)
        self.tolerances.update(other.tolerances)
        for layer, n in other.nonfinite.items():
            self.nonfinite[layer] += n
        if self.comparator_tables is not None and other.comparator_tables:
            self.comparator_tables.extend(other.comparator_tables)

    def state(self) -> dict:
        """What :meth:`merge` needs, picklable (sent between ranks)."""
        return {name: getattr(self, name) for name in (
            "ratios", "post", "audit", "retention", "fidelity", "tolerances", "nonfinite",
            "comparator_tables")}

    def summary(self) -> dict:
        boundary = repeat_boundaries(self.prompts.values())
        summary = self.ratios.summary(boundary)
        if self.post.cells:
            summary["post_decay"] = self.post.summary(boundary)
        summary["fidelity"] = {
            "max_rel_error": max(self.fidelity.values(), default=0.0),
            "by_layer": {f"{k:03d}": v for k, v in sorted(self.fidelity.items())},
            "tolerance_by_layer": {f"{k:03d}": v for k, v in sorted(self.tolerances.items())},
        }
        summary["assumptions"] = self.audit.summary()
        summary["nonfinite_heads_by_layer"] = {
            f"{k:03d}": v for k, v in sorted(self.nonfinite.items()) if v
        }
        summary["replay"] = {
            "backend": self.backend,
            "dtype": str(self.dtype).removeprefix("torch."),
            "device": str(self.device),
        }
        if self.retention is not None:
            summary["retained"] = self.retention.summary()
        if self.comparator_tables:
            summary["comparator"] = comparator_summary(pa.concat_tables(self.comparator_tables), self.box)
        return summary

    def _theorem(self, stored: StoredCall, call: KernelCall, res) -> pa.Table:
        """Theorem D.7's quantities for every (sequence, head) stream of the call: one row each."""
        from .math.closed_forms import residual_ratio
        from .metrics.theorem import theorem_d7

        H, K = call.num_heads, call.head_k_dim
        segs = call.segments()
        L = max((e - s for _, s, e in segs), default=0)
        P = len(segs) * H
        dev = call.k.device
        k = torch.zeros(P, L, K, device=dev)
        beta = torch.zeros(P, L, device=dev)
        d = None if call.d is None else torch.ones(P, L, K, device=dev)
        q = torch.ones(P, L, device=dev, dtype=torch.float64)
        valid = torch.zeros(P, L, dtype=torch.bool, device=dev)
        ratio = residual_ratio(res.grid["loss_after"], res.grid["loss_before"])
        ok = res.grid["finite"] & (res.grid["loss_before"] > 0)
        for i, (row, start, end) in enumerate(segs):
            n, sl = end - start, slice(start, end)
            for h in range(H):
                p = i * H + h
                k[p, :n] = call.k[row, sl, h].float()
                beta[p, :n] = call.beta[row, sl, h].float()
                if d is not None:
                    d[p, :n] = call.d[row, sl, h].float()
                    d[p, n:] = d[p, n - 1] if n else 1.0  # eps_at_final_d reads the last position
                q[p, :n] = ratio[row, sl, h].double()
                valid[p, :n] = ok[row, sl, h]
        cols = theorem_d7(
            torch.nan_to_num(k), torch.nan_to_num(beta), d, q, valid,
            d_min=self.box[0], d_max=self.box[1], gated=call.g is not None,
        )
        seq = torch.arange(len(segs)).repeat_interleave(H)
        prompt_ids = [stored.prompts[int(s)] for s in seq]
        data = {
            "prompt": pa.array(prompt_ids, pa.int32()),
            "task": pa.array([str(self.prompts.get(p, {}).get("task", "")) for p in prompt_ids]),
            "layer": pa.array([call.layer] * P, pa.int16()),
            "head": pa.array(torch.arange(H).repeat(len(segs)).numpy(), pa.int16()),
        }
        for name, x in cols.items():
            data[name] = pa.array(x.cpu().numpy())
        return pa.table(data)


def replay_run(
    run_dir: str | os.PathLike,
    *,
    progress: bool = True,
    out_dir: str | os.PathLike | None = None,
    extra: dict | None = None,
    **replay_kw,
) -> dict:
    """Replay every captured call of ``run_dir`` and write ``residuals.parquet`` and ``summary.json``.

    Args:
        run_dir: a complete capture directory (``manifest.json`` with ``"complete": true``).
        progress: show a progress bar.
        out_dir: where to write (default ``run_dir``).
        extra: entries added to the summary.
        replay_kw: :class:`Replayer` options — ``backend`` (``"torch"``, ``"triton"`` or ``"auto"``:
            Triton on CUDA, torch otherwise), ``dtype`` (fp32 or fp64), ``device`` (default CUDA when
            available), ``tolerance`` (fidelity; default per kernel and dtype), ``transform`` (applied
            to every call before replay, e.g. the what-if preconditioner), ``retained`` (also measure
            retained associations).

    Returns the summary dictionary that was written to ``summary.json`` (on rank 0 of several
    processes; ``{}`` on the others, see :mod:`osdn_diag.distributed`).
    """
    from . import distributed

    ranks = distributed.current()
    run_dir = Path(run_dir)
    reader = CaptureReader(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = {int(p["id"]): p for p in reader.manifest.get("prompts", [])}
    replay_kw.setdefault("device", ranks.device())
    replayer = Replayer(prompts, **replay_kw)
    target = out_dir / RESIDUALS
    if ranks.world > 1:  # a partitioned table: one part per rank
        if ranks.is_main:
            _remove(target)
            target.mkdir()
        ranks.barrier()
        target = target / f"part-{ranks.rank:05d}.parquet"
    elif target.is_dir():  # left by an earlier run with several processes
        _remove(target)
    shards = [p for p in reader.shards() if ranks.owns(int(p.parent.name.removeprefix("batch_")))]
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with pq.ParquetWriter(tmp, replayer.schema) as writer:
            for path in _progress(shards, len(shards), progress and ranks.is_main, "replay", "call"):
                writer.write_table(replayer.add(reader.load(path)))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    states = ranks.gather(replayer.state())
    if not ranks.is_main:
        ranks.barrier()
        return {}
    for state in states[1:]:
        other = Replayer.__new__(Replayer)
        other.__dict__.update(state)
        replayer.merge(other)
    if replayer.comparator_tables:
        _atomic_parquet(pa.concat_tables(replayer.comparator_tables), out_dir / COMPARATOR)
    summary = replayer.summary()
    recall = recall_table(reader.manifest)
    if recall:
        summary["recall"] = recall
    summary.update(extra or {})
    if ranks.world > 1:
        summary["world_size"] = ranks.world
    atomic_write_text(out_dir / SUMMARY, json.dumps(summary, indent=2))
    ranks.barrier()
    return summary


def _remove(path: Path) -> None:
    if path.is_dir():
        for part in path.iterdir():
            part.unlink()
        path.rmdir()
    elif path.exists():
        path.unlink()


def _atomic_parquet(table: pa.Table, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def comparator_summary(table: pa.Table, box: tuple[float, float]) -> dict:
    """Aggregates of ``comparator.parquet``: means over problems, and the Theorem D.7 check over the
    problems whose hypotheses hold (the bound's slack is reported only there)."""
    cols = {name: torch.tensor(table.column(name).to_numpy(zero_copy_only=False)) for name in
            ("eps_diag", "eps_at_ones", "eps_at_final_d", "regret", "slack", "kkt_residual", "gap",
             "hypotheses_hold", "n_valid", "share_newton_infeasible")}
    hold = cols["hypotheses_hold"].bool()
    has = cols["n_valid"] > 0

    def mean(x, sel):
        x = x[sel].double()
        return float(x.mean()) if x.numel() else None

    slack = cols["slack"][hold].double()
    return {
        "box": list(box),
        "problems": int(len(hold)),
        "eps_diag_mean": mean(cols["eps_diag"], has),
        "eps_diag_median": float(cols["eps_diag"][has].double().median()) if bool(has.any()) else None,
        "eps_at_ones_mean": mean(cols["eps_at_ones"], has),
        "eps_at_final_d_mean": mean(cols["eps_at_final_d"], has),
        "regret_mean": mean(cols["regret"], has),
        "share_newton_infeasible_mean": mean(cols["share_newton_infeasible"], has),
        "max_kkt_residual": float(cols["kkt_residual"].max()) if len(hold) else None,
        "max_gap": float(cols["gap"].max()) if len(hold) else None,
        "hypotheses_hold": int(hold.sum()),
        "bound_holds": int((slack >= -1e-6).sum()),
        "slack_min": float(slack.min()) if slack.numel() else None,
        "slack_mean": float(slack.mean()) if slack.numel() else None,
    }


def _add_retention(acc, call, prompt_ids, prompts, lengths) -> None:
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


def _arrow_table(stored, res, prompts: dict, schema: pa.Schema, np_dtype: str) -> pa.Table:
    """The rows of one replayed call; sequence ``i`` of the call is prompt ``stored.prompts[i]``."""
    cols = res.columns
    seq = cols["sequence"].numpy()
    info = [prompts.get(int(p), {}) for p in stored.prompts]
    per_seq = {
        "prompt": np.asarray(stored.prompts, dtype=np.int32),
        "task": np.asarray([str(i.get("task", "")) for i in info], dtype=object),
        "repeat_start": np.asarray([int(i.get("repeat_start", -1)) for i in info], dtype=np.int32),
        "length": np.asarray(res.sequence_lengths, dtype=np.float32),
    }
    pos = cols["pos"].numpy()
    n = len(seq)
    data = {
        "prompt": per_seq["prompt"][seq],
        "task": per_seq["task"][seq],
        "layer": np.full(n, stored.call.layer, dtype=np.int16),
        "head": cols["head"].numpy().astype(np.int16),
        "pos": pos,
        "rel_pos": pos / per_seq["length"][seq],
        "repeat_start": per_seq["repeat_start"][seq],
        "finite": cols["finite"].numpy(),
    }
    arrays = []
    for f in schema:
        if f.name in data:
            arrays.append(pa.array(data[f.name], f.type))
        elif f.name in cols:
            arrays.append(pa.array(cols[f.name].numpy().astype(np_dtype), f.type))
        else:
            arrays.append(pa.nulls(n, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)
