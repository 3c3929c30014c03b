"""Run directories: :func:`capture_run` (model + prompts → ``capture/`` + ``manifest.json``) and
:func:`replay_run` (→ ``residuals.parquet``, ``comparator.parquet``, ``summary.json``).

The replay itself — the per-token table and the summary's accumulators — is
:class:`osdn_diag.replayer.Replayer`; this module handles files, ranks and the manifest.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from .capture.store import CaptureReader, CaptureWriter, atomic_write_text
from .replayer import CONTRACT_COLUMNS, Replayer

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
