"""Run directories: :func:`capture_run` (model + prompts → ``capture/`` + ``manifest.json``) and
:func:`replay_run` (→ ``residuals.parquet``, ``comparator.parquet``, ``summary.json``), or both in one
pass without storing the capture, :func:`stream_run`.

The replay itself — the per-token table and the summary's accumulators — is
:class:`osdn_diag.replay.Replayer`; this module handles files, ranks and the manifest.
"""

from __future__ import annotations

import math
import os
import queue
import re
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ._atomic import atomic_path, remove_stale_temporaries
from ._json import dumps as strict_json
from .capture.store import CaptureReader, CaptureWriter, StoredCall, atomic_write_text, layer_entry
from .rundir import (
    MANIFEST,
    RANKS_DIR,
    RUN_ID_KEY,
    RunDirectoryError,
    check_capture_files,
    check_links,
    check_placement,
    existing_run_files,
    finish_stage,
    new_run_id,
    output_lock,
    prepare_output,
    rank_record_path,
    read_rank_record,
    remove_run_files,
    run_manifest,
    sha256_file,
    stage_done,
    start_stage,
    verify_files,
    write_rank_record,
)
from .replay import CONTRACT_COLUMNS, Replayer

_check_links = check_links  # _rank_reader's parameter of that name shadows it

__all__ = [
    "COMPARATOR",
    "CONTRACT_COLUMNS",
    "RESIDUALS",
    "SUMMARY",
    "Replayer",
    "capture_run",
    "replay_run",
    "stream_run",
]

RESIDUALS = "residuals.parquet"
COMPARATOR = "comparator.parquet"
SUMMARY = "summary.json"


#: Printed (unless ``--quiet``) before a run's first batch on a GPU whose Triton cache holds no compiled
#: kernel yet: fla's kernels compile and autotune on their first call, minutes of silence otherwise.
COMPILE_NOTICE = ("osdn-diag: fla compiles and autotunes its Triton kernels on their first call on this "
                  "machine: the first batch may take minutes (once; they are kept in {cache}, which "
                  "TRITON_CACHE_DIR sets; `osdn-diag warmup MODEL` does this ahead of runs)")


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels (and fla its autotuning results), as triton 3.x's
    ``knobs.cache.dir`` finds it without importing triton: ``TRITON_CACHE_DIR``, else
    ``$TRITON_HOME/.triton/cache`` with ``TRITON_HOME`` defaulting to the home directory."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    return Path(os.environ.get("TRITON_HOME", os.path.expanduser("~/")), ".triton", "cache")


def has_compiled_kernels(cache: Path) -> bool:
    """Whether Triton's cache ``cache`` holds a compiled kernel: a ``.cubin`` (NVIDIA) or ``.hsaco``
    (AMD) in one of its per-kernel folders (the launcher stubs Triton also caches there are not
    kernels). Stops at the first one found."""
    try:
        with os.scandir(cache) as folders:
            for folder in folders:
                if folder.is_dir():
                    with os.scandir(folder.path) as files:
                        if any(f.name.endswith((".cubin", ".hsaco")) for f in files):
                            return True
    except OSError:  # no cache yet
        return False
    return False


def _compiles_kernels(device: torch.device) -> bool:
    """Whether the model's forward passes on ``device`` compile Triton kernels (fla's layers on a GPU;
    on the CPU they run interpreted)."""
    return device.type == "cuda"


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
    device_map: str | dict | None = None,
    overwrite: bool = False,
    then: tuple[str, ...] = (),
    generate: int = 0,
) -> Path:
    """Load the model, run every prompt through it under :func:`osdn_diag.capture.capture`, and stream
    the captured calls to ``out_dir/capture``. The manifest says ``"complete": true`` only at the end,
    and only if ``then`` (later stages the caller sets out to do, e.g. ``("replay", "report")``) is
    empty; those stages mark it complete when they finish.

    ``out_dir`` holding a run is refused unless ``overwrite`` (then its files are removed), and
    either only once the model and the prompts have loaded (see :mod:`osdn_diag.rundir`).

    ``model_spec`` is a model spec (a directory, ``builtin:NAME``, ``random:PRESET``) or a model
    :func:`osdn_diag.models.load_model` already loaded (then its device and dtype are the defaults).
    ``dtype`` defaults to bf16 on CUDA (fla's chunk kernels refuse fp32 DeltaNet inputs) and fp32 on
    the CPU. ``device_map`` spreads a model too large for one GPU over the machine's GPUs (see
    :func:`osdn_diag.models.load_model`; one process only). ``generate`` > 0 has the model greedily
    generate that many tokens after each prompt (one prompt at a time): the prompt's prefill and every
    decoding step are captured as one stream per layer (:mod:`osdn_diag.capture.generation`), whose
    decoded tokens the manifest lists (``generated_ids``) and the table marks (``decode_start``).
    Returns ``out_dir``.
    """
    with output_lock(out_dir):
        session = _CaptureSession(model_spec, prompts_spec, out_dir, device=device, dtype=dtype, kernels=kernels,
                                  batch_size=batch_size, twice=twice, num_prompts=num_prompts, length=length,
                                  seed=seed, device_map=device_map, overwrite=overwrite,
                                  stages=("capture", *then), generate=generate)
        session.run(lambda stored: session.writer.write(stored.batch, stored.prompts, stored.call), progress)
        session.finish()
    return session.out_dir


def stream_run(
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
    device_map: str | dict | None = None,
    replay_dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
    then: tuple[str, ...] = (),
    generate: int = 0,
    **replay_kw,
) -> dict:
    """Capture and replay in one pass, storing no capture: every call is replayed on the device as
    soon as its forward batch has run, and only its rows of the per-token table leave the device.

    Writes ``manifest.json`` (with ``"capture_stored": false``), ``residuals.parquet``,
    ``comparator.parquet`` and ``summary.json`` — the same files and numbers as
    :func:`capture_run` followed by :func:`replay_run`, without ``capture/`` (so neither ``replay``
    nor ``what-if`` can run on the directory later). Host memory stays bounded by one call's rows,
    and nothing is written to disk but the results. Arguments as for :func:`capture_run` (``dtype`` is
    the model's), ``replay_dtype`` the replay's (fp32 or fp64), ``overwrite`` and ``then`` as for
    :func:`capture_run` (the capture and replay stages finish together), ``replay_kw`` as for
    :func:`replay_run`. Returns the summary (``{}`` on ranks other than 0).
    """
    with output_lock(out_dir):
        return _stream(model_spec, prompts_spec, out_dir, device=device, dtype=dtype, kernels=kernels,
                       batch_size=batch_size, twice=twice, num_prompts=num_prompts, length=length, seed=seed,
                       progress=progress, device_map=device_map, replay_dtype=replay_dtype, overwrite=overwrite,
                       then=then, generate=generate, **replay_kw)


def _stream(model_spec, prompts_spec, out_dir, *, device, dtype, kernels, batch_size, twice, num_prompts, length,
            seed, progress, device_map, replay_dtype, overwrite, then, generate=0, **replay_kw) -> dict:
    session = _CaptureSession(model_spec, prompts_spec, out_dir, device=device, dtype=dtype, kernels=kernels,
                              batch_size=batch_size, twice=twice, num_prompts=num_prompts, length=length,
                              seed=seed, stored=False, device_map=device_map, overwrite=overwrite,
                              stages=("capture", "replay", *then), generate=generate)
    replay_kw.setdefault("device", session.replay_device)
    replayer = Replayer({p.id: p.manifest_entry() for p in session.prompts}, dtype=replay_dtype, **replay_kw)
    with _residuals_writer(session.out_dir, replayer.schema, session.ranks, session.run_id) as residuals:
        def replay_now(stored: StoredCall) -> None:
            session.writer.layers.setdefault(stored.call.layer, layer_entry(stored.call))
            residuals.write(replayer.add(stored, table=False))  # its rows built on the writer's rows thread

        session.run(replay_now, progress)
    parts = dict(residuals.part)
    if session.ranks.world > 1:
        session.write_record(residuals=parts)
    entries = session.manifest_prompts()
    # With --generate a prompt's stream is longer than the prompt the replayer was made with: the
    # summary's repeat boundaries are relative to the stream, as a replay of the stored run's are.
    replayer.prompts = {e["id"]: e for e in entries}
    summary = _finish_replay(replayer, session.ranks, session.out_dir, entries,
                             run_id=session.run_id, parts=parts)
    if session.ranks.world > 1:
        session.writer.manifest["parts"] = dict(sorted(parts.items()))
    if session.ranks.is_main:
        record_result_files(session.out_dir, session.writer.manifest)
    session.finish(done=("capture", "replay"))
    return summary


class _CaptureSession:
    """What :func:`capture_run` and :func:`stream_run` share: this rank's device and dtype, the model,
    the prompts, the forward batches this rank owns, and the manifest (written incomplete once the
    model and the prompts have loaded, its stages marked done by :meth:`finish` once every rank is
    done)."""

    def __init__(self, model_spec, prompts_spec, out_dir, *, device, dtype, kernels, batch_size, twice,
                 num_prompts, length, seed, stored: bool = True, device_map=None, overwrite: bool = False,
                 stages: tuple[str, ...] = ("capture",), generate: int = 0):
        from . import distributed, runtime
        from .prompts import load_prompts

        if batch_size < 1:
            raise ValueError(f"argument 'batch_size': expected >= 1, got {batch_size}")
        _check_generate(generate, batch_size)
        self.generate = generate
        self.generated: dict[int, list[int]] = {}  # prompt id -> the tokens generated after it
        self.ranks = distributed.current()
        if device_map is not None and self.ranks.world > 1:
            raise ValueError("argument 'device_map': spreads one model over every GPU of the machine, "
                             "so it runs in one process, not under torchrun with several")
        preloaded = None if isinstance(model_spec, (str, os.PathLike)) else model_spec  # a LoadedModel
        if preloaded is not None:  # already on its device, in its dtype
            param = next(preloaded.model.parameters())
            device, dtype, model_spec = device or param.device, dtype or param.dtype, preloaded.spec
        # Before osdn_diag.models (which imports fla): on the CPU, fla must be imported interpreted.
        self.device = runtime.prepare(device or self.ranks.device())
        from .models import load_model

        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.out_dir = Path(out_dir)
        self.model_spec, self.kernels, self.batch_size = model_spec, kernels, batch_size
        self.twice, self.seed, self.stored = twice, seed, stored
        # The model and the prompts first: a checkpoint or prompt file that cannot be used fails the
        # run before its directory is created.
        self.loaded = preloaded or load_model(model_spec, device=self.device, dtype=self.dtype, seed=seed,
                                              device_map=device_map)
        # Inputs go where the embedding is; replay runs on the requested (or default) device, to which
        # every call is moved (a model spread over several GPUs has calls on each of them).
        self.replay_device = self.device
        self.device = self.loaded.model.get_input_embeddings().weight.device
        # The tokenizer, if the model has one: it tokenises text prompts and gives tokens.parquet its text.
        self.tokenizer, tokenize = _session_tokenizer(self.loaded.directory)
        self.prompts = load_prompts(
            prompts_spec, vocab_size=self.loaded.config["vocab_size"], tokenize=tokenize,
            twice=twice, num_prompts=num_prompts, length=length, seed=seed,
        )
        _check_batches_fit(self.loaded.config, self.prompts, batch_size)
        # prompt id -> (answers right, queries, queries excluded, summed nll), recall prompts
        self.hits: dict[int, tuple] = {}
        self.skipped: list[dict] = []  # decoder layers capture does not record (see Capture.skipped)
        # Only now, with the model and the prompts loaded, is an existing run in out_dir replaced: a
        # command that fails on its inputs leaves it as it was. Rank 0 decides; every rank raises.
        # An unfinished run of the same command and world size (several processes) is resumed instead.
        self.settings = {"model": str(model_spec), "prompts": str(prompts_spec), "num_prompts": num_prompts,
                         "length": length, "seed": seed, "twice": twice, "batch_size": batch_size,
                         "kernels": kernels, "dtype": str(self.dtype).removeprefix("torch."),
                         "capture_stored": stored, "stages": list(stages), "generate": generate}
        refusal, decision = None, None
        if self.ranks.is_main:
            try:
                check_links(self.out_dir)  # also where a run is resumed, which prepare_output does not see
                self.identity = self._identity()
                resumed = None if overwrite else _resumable(self.out_dir, self.settings, self.ranks.world,
                                                            self.identity)
                run_id = resumed["run_id"] if resumed else new_run_id()
                if resumed is None:
                    prepare_output(self.out_dir, overwrite=overwrite)
                self.writer = CaptureWriter(self.out_dir, run_id)
                # ``attempt``: new for every command, also one that resumes (the run id stays), so that
                # a rank seeing a manifest with it sees this command's manifest, not an older copy.
                attempt = new_run_id()
                several = {"settings": self.settings, "world_size": self.ranks.world, "attempt": attempt}
                self.writer.begin({"versions": self.identity["versions"], "model": {"spec": model_spec},
                                   "prompts_source": prompts_spec, "capture_stored": stored,
                                   "identity": self.identity,
                                   **(several if self.ranks.world > 1 else {})}, stages)
                decision = (run_id, resumed is not None, attempt, self.identity)
            except (ValueError, OSError) as err:
                refusal = err
        if self.ranks.world > 1:
            message, decision = self.ranks.broadcast((None if refusal is None else str(refusal), decision))
            if message is not None and refusal is None:
                raise ValueError(message)
        if refusal is not None:
            raise refusal
        self.run_id, self.resumed, self.attempt, self.identity = decision
        if not self.ranks.is_main:
            self.writer = CaptureWriter(self.out_dir, self.run_id)
        #: whether every rank's --out is rank 0's (a shared file system): it sees rank 0's manifest
        self.shared = True
        self.reused: dict | None = None  # this rank's verified record of an earlier attempt (resume)
        if self.ranks.world > 1:
            self._join_nodes(overwrite)

    def _identity(self) -> dict:
        """What this run reads, as content (:mod:`osdn_diag.identity`): the weights are hashed where
        a run can be resumed, under several processes (one process: only small weights)."""
        from .identity import run_identity

        return run_identity(self.loaded, self.prompts, seed=self.seed, device_type=self.device.type,
                            versions=_versions(), hash_weights=True if self.ranks.world > 1 else None)

    def _check_same_prompts(self) -> None:
        """Under several processes every rank loads the prompts itself (from its own machine's file,
        without a shared file system): refuse a rank whose prompts are not rank 0's, on every rank."""
        from .identity import prompts_digest

        digests = self.ranks.gather(prompts_digest(self.prompts))
        for rank, digest in enumerate(digests):
            if digest != self.identity["prompts"]["sha256"]:
                raise RunDirectoryError(f"rank {rank}: its prompts ({self.settings['prompts']} on its machine) "
                                        "differ from rank 0's; give every node the same prompts")

    def _join_nodes(self, overwrite: bool) -> None:
        """Under several processes: find out whether ``--out`` is shared, make a node's own ``--out``
        ready where it is not (rank 0 did that where it is), and, resuming, verify this rank's record
        of the earlier attempt. Every rank raises the first refusal of any."""
        self._check_same_prompts()
        seen = (run_manifest(self.out_dir) or {}).get("attempt") == self.attempt
        self.shared = all(self.ranks.gather(seen))
        refusal = None
        try:
            if not seen and self.ranks.local_rank == 0:  # this node's --out is its own
                _prepare_node_output(self.out_dir, self.run_id, overwrite=overwrite, resume=self.resumed)
        except (ValueError, OSError) as err:
            refusal = f"rank {self.ranks.rank}: {err}"
        refusals = [m for m in self.ranks.gather(refusal) if m is not None]
        if refusals:
            raise RunDirectoryError(refusals[0])
        if self.resumed and self.stored:
            self.reused, why = _verified_record(self.out_dir, self.ranks, self.run_id, self.identity)
            if self.reused is None:
                print(f"osdn-diag: rank {self.ranks.rank}: capturing its batches again ({why})", file=sys.stderr)
            else:
                print(f"osdn-diag: rank {self.ranks.rank}: its {len(self.reused['shards'])} shards are "
                      "complete and verified; not captured again", file=sys.stderr)
        if not self.shared and self.ranks.is_main:
            self.writer.manifest["merge_needed"] = True

    def run(self, on_call, progress: bool) -> None:
        """Run this rank's forward batches under capture; hand every captured call to ``on_call`` (a
        :class:`StoredCall`) as soon as its batch has run, then drop it."""
        from . import distributed
        from .capture.context import capture
        from .capture.generation import generate as generate_stream

        batches = [(i, b) for i, b in _batches(self.prompts, self.batch_size) if self.ranks.owns(i)]
        show = progress and self.ranks.is_main
        if self.reused is not None:  # resuming, this rank's capture complete and verified
            self.writer.shards.update(self.reused["shards"])
            self.writer.layers.update({int(k): v for k, v in self.reused["layers"].items()})
            self.hits.update({int(k): tuple(v) for k, v in self.reused["hits"].items()})
            self.generated.update({int(k): list(v) for k, v in self.reused.get("generated", {}).items()})
            self.skipped = self.reused["skipped"]
            batches = []
        if show and batches and _compiles_kernels(self.device) and not has_compiled_kernels(triton_cache_dir()):
            print(COMPILE_NOTICE.format(cache=triton_cache_dir()), file=sys.stderr, flush=True)
        with capture(self.loaded.model, kernels=self.kernels) as cap, torch.inference_mode():
            for batch_idx, batch in _progress(batches, len(batches), show, "capture", "batch"):
                ids, mask = _inputs(batch, self.device)
                if self.generate:  # one prompt (batch_size 1): its prefill and decoding, one stream
                    done = generate_stream(cap, ids, self.generate)
                    calls, logits = done.calls, done.logits
                    self.generated[batch[0].id] = done.tokens[0].tolist()
                else:
                    out = self.loaded.model(input_ids=ids, attention_mask=mask, use_cache=False)
                    calls, logits = cap.calls, getattr(out, "logits", None)
                prompt_ids = [p.id for p in batch]
                for call in calls:
                    on_call(StoredCall(batch=batch_idx, prompts=prompt_ids, call=call))
                cap.calls.clear()
                self.hits.update(_recall_hits(batch, logits))
            if self.reused is None:
                self.skipped = cap.skipped  # a transformers model's full-attention layers
        # This rank's own parts, before the other ranks' are gathered into the same dictionaries.
        self.own = (dict(self.writer.shards), dict(self.writer.layers), dict(self.hits), dict(self.generated))
        if self.ranks.world > 1 and self.stored:
            self.write_record()
        distributed.fault_point("captured")
        for layers in self.ranks.gather(self.writer.layers):  # a rank may have had no batch
            for index, entry in layers.items():
                self.writer.layers.setdefault(index, entry)
        for shards in self.ranks.gather(self.writer.shards):
            self.writer.shards.update(shards)
        for part in self.ranks.gather(self.hits):
            self.hits.update(part)
        for part in self.ranks.gather(self.generated):
            self.generated.update(part)

    def write_record(self, residuals: dict | None = None) -> None:
        """This rank's record of its parts (``ranks/rank-RRRRR.json`` under its own ``--out``): its
        shards with their sha256, what the manifest needs of its capture, and (``residuals``) its part
        of ``residuals.parquet``. Written after the files it lists."""
        shards, layers, hits, generated = self.own
        record = {"run_id": self.run_id, "rank": self.ranks.rank, "world_size": self.ranks.world,
                  "settings": self.settings, "identity": self.identity,
                  "shards": {n: shards[n] for n in sorted(shards)},
                  "layers": {str(k): v for k, v in sorted(layers.items())},
                  "hits": {str(k): list(v) for k, v in sorted(hits.items())},
                  "generated": {str(k): v for k, v in sorted(generated.items())},
                  "skipped": self.skipped}
        if residuals is not None:
            record["residuals"] = residuals
        write_rank_record(self.out_dir, self.ranks.rank, record)

    def manifest_prompts(self) -> list[dict]:
        """The manifest's prompt entries, with recall where the prompts carry answers."""
        entries = []
        for p in self.prompts:
            entry = p.manifest_entry()
            if p.id in self.generated:  # the stream is the prompt and the tokens generated after it
                tokens = self.generated[p.id]
                entry.update(length=len(p) + len(tokens), prompt_length=len(p), decode_start=len(p),
                             generated_ids=tokens)
            if p.id in self.hits:
                # a rank record of an earlier version (resumed) has no nll: three numbers
                entry["recall_correct"], entry["recall_queries"], excluded, *nll = self.hits[p.id]
                if excluded:
                    entry["recall_excluded"] = excluded
                if nll:
                    entry["recall_nll"] = nll[0]
            entries.append(entry)
        return entries

    def token_ids(self) -> dict[int, list[int]]:
        """Every prompt's token ids as the model read them, by prompt id (``tokens.parquet``'s rows):
        with ``generate``, the prompt's and then the tokens generated after it."""
        return {p.id: list(p.input_ids) + self.generated.get(p.id, []) for p in self.prompts}

    def write_tokens(self) -> dict:
        """Write ``tokens.parquet`` (ids, and their text where the model has a tokenizer) and return
        the manifest's ``tokens`` entry."""
        from .prompts.text import TokenText
        from .replay.tokens import token_table, tokens_entry, write_tokens

        text = None if self.tokenizer is None else TokenText(self.tokenizer, self.loaded.directory)
        table = token_table(self.token_ids(), text)
        return tokens_entry(write_tokens(self.out_dir, table, self.run_id), None if text is None else text.info)

    def finish(self, done: tuple[str, ...] = ("capture",)) -> None:
        """Mark the stages ``done`` in the manifest once every rank's files are on disk."""
        kernels_used = sorted({layer["flags"].get("kernels", self.kernels) for layer in self.writer.layers.values()})
        self.ranks.barrier()  # every rank's shards are on disk before the manifest says complete
        if self.ranks.is_main:
            cfg = self.loaded.config
            tokens = self.write_tokens()
            self.writer.finish(
                {
                    "model": {
                        "spec": self.model_spec,
                        "source": self.loaded.source,
                        "model_type": cfg.get("model_type"),
                        "hidden_size": cfg.get("hidden_size"),
                        "num_hidden_layers": cfg.get("num_hidden_layers"),
                        "num_heads": cfg.get("num_heads"),
                        "vocab_size": cfg.get("vocab_size"),
                        **({"hub": self.loaded.hub} if self.loaded.hub else {}),
                        # parameters and buffers loaded in another dtype than the model's (fp32)
                        "kept_dtypes": self.loaded.kept_dtypes or {},
                    },
                    "prompts": self.manifest_prompts(),
                    # tokens.parquet: its sha256, and whether (and from which tokenizer) it has text
                    "tokens": tokens,
                    # decoder layers not captured (a hybrid model's full attention), by index
                    "layers_skipped": self.skipped,
                    "twice": self.twice,
                    "seed": self.seed,
                    "device": str(self.device),
                    # {module: device} where the model is spread over several devices, else null
                    "device_map": getattr(self.loaded.model, "hf_device_map", None),
                    "dtype": str(self.dtype).removeprefix("torch."),
                    "kernels": kernels_used,
                    "batch_size": self.batch_size,
                    # tokens greedily generated after each prompt, captured with it (0: none)
                    "generate": self.generate,
                    "world_size": self.ranks.world,
                    # whether every rank wrote under this directory (false: parts on other machines)
                    **({"shared_out": self.shared} if self.ranks.world > 1 else {}),
                },
                done,
            )
        self.ranks.barrier()  # and no rank goes on before it does


def _check_generate(generate, batch_size: int) -> None:
    """``generate``: an int >= 0; decoding runs one prompt at a time (``batch_size`` 1)."""
    if isinstance(generate, bool) or not isinstance(generate, int) or generate < 0:
        raise ValueError(f"argument 'generate': expected an int >= 0 (tokens to generate per prompt), got {generate!r}")
    if generate and batch_size != 1:
        raise ValueError(f"argument 'generate': decoding is captured one prompt at a time, so it needs "
                         f"--batch-size 1 (got {batch_size})")


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
    from .identity import identity_change

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


def _recall_hits(batch, logits: torch.Tensor | None) -> dict[int, tuple[int, int, int, float]]:
    """``{prompt id: (correct answers, queries, queries excluded, nll)}`` for the recall prompts of a
    batch (those whose ``meta`` names ``answer_positions`` and ``answers``): the argmax at each query
    position against the answer that follows it, and ``nll``, the summed negative log-likelihood of
    the answers, ``Σ −log softmax(logits[p])[answer]`` in nats (a log-softmax of the answer positions'
    logits only, in fp32, summed in fp64). A query whose logits hold NaN/Inf has no argmax worth the
    name (NaN counts as the largest value) and no likelihood: it is excluded, neither right nor wrong
    and not in ``nll``, and ``queries`` counts only the others."""
    out = {}
    for row, p in enumerate(batch):
        pos, ans = p.meta.get("answer_positions"), p.meta.get("answers")
        if logits is None or not pos:
            continue
        at = logits[row, torch.as_tensor(pos, device=logits.device)]
        answers = torch.as_tensor(ans, device=logits.device)
        finite_dev = torch.isfinite(at).all(-1)
        finite = finite_dev.cpu()
        hit = (at.argmax(-1).cpu() == answers.cpu()) & finite
        n_ok = int(finite.sum())
        ok = at[finite_dev].float()
        nll = -ok.log_softmax(-1).gather(-1, answers[finite_dev, None]).squeeze(-1)
        out[p.id] = (int(hit.sum()), n_ok, len(pos) - n_ok, float(nll.double().sum()))
    return out


def recall_table(manifest: dict) -> dict[str, dict]:
    """Recall accuracy per task from a capture manifest: ``{task: {"accuracy", "correct", "queries",
    "excluded_nonfinite", "prompts", "nll", "perplexity", "scoring"}}`` (query-weighted), for the
    prompts that carry answers; empty when none do. ``queries`` counts the queries measured;
    ``excluded_nonfinite`` those whose logits held NaN/Inf. ``accuracy`` is ``None`` when no query was
    measured. ``nll`` is the mean negative log-likelihood per measured query (nats; the sum of the
    prompts' ``recall_nll`` over ``queries``) and ``perplexity`` = exp(``nll``); both ``None`` when no
    query was measured or a prompt of the task has no ``recall_nll`` (a manifest written before it
    was recorded). ``scoring`` is the prompts' ``scoring`` (``"next-token"`` for held-out text),
    ``"recall"`` where they name none."""
    per_task: dict[str, list] = {}
    for p in manifest.get("prompts", []):
        if "recall_correct" in p:
            acc = per_task.setdefault(p["task"], [0, 0, 0, 0, 0.0, set()])
            acc[0] += int(p["recall_correct"])
            acc[1] += int(p["recall_queries"])
            acc[2] += int(p.get("recall_excluded", 0))
            acc[3] += 1
            nll = p.get("recall_nll")
            acc[4] = None if acc[4] is None or nll is None else acc[4] + float(nll)
            acc[5].add(p.get("scoring", "recall"))
    table = {}
    for task, (c, q, x, n, nll, scoring) in per_task.items():
        mean = nll / q if q and nll is not None else None
        table[task] = {"accuracy": c / q if q else None, "correct": c, "queries": q, "excluded_nonfinite": x,
                       "prompts": n, "nll": mean, "perplexity": None if mean is None else _exp(mean),
                       "scoring": "/".join(sorted(scoring))}
    return table


def _exp(x: float) -> float:
    """exp(x), ``inf`` where it overflows a double (written ``null``)."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf


#: Model types whose delta-rule layer takes no attention mask (fla raises NotImplementedError on one):
#: a batch of prompts of different lengths, which needs a mask, cannot run through them.
NO_MASK_MODEL_TYPES = {"momentum_deltanet": "MomentumDeltaNet"}


def _check_batches_fit(config: dict, prompts, batch_size: int) -> None:
    """Refuse, before the run directory is touched, forward batches the model cannot run: prompts of
    different lengths in one batch of a model whose layer takes no attention mask."""
    layer = NO_MASK_MODEL_TYPES.get(config.get("model_type"))
    if layer is None or batch_size == 1:
        return
    for index, batch in _batches(prompts, batch_size):
        lengths = sorted({len(p) for p in batch})
        if len(lengths) > 1:
            raise ValueError(f"argument --batch-size: {layer} takes no attention mask, so prompts of different "
                             f"lengths cannot share a batch (batch {index}: prompts {batch[0].id}-{batch[-1].id}, "
                             f"{lengths[0]} to {lengths[-1]} tokens); use --batch-size 1")


def _load_tokenizer(directory: Path | None):
    """The model directory's own tokenizer, from local files only and never with the directory's own
    code (:func:`~osdn_diag.models.load_model` has refused an ``auto_map`` already); ``None`` when it
    has none."""
    if directory is None or not any(directory.glob("tokenizer*")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError, RecursionError) as err:  # a damaged file's many faces
        files = ", ".join(sorted(p.name for p in directory.glob("tokenizer*")))
        message = " ".join(str(err).split()) or type(err).__name__
        raise ValueError(f"the tokenizer in {directory} ({files}) cannot be loaded ({message[:300]}); repair or "
                         "replace those files, or remove them to run the model on token ids only") from err


def _session_tokenizer(directory: Path | None, quiet: bool = False):
    """``(tokenizer, tokenize)`` for a run: the directory's tokenizer and ``text -> ids`` with it. An
    unreadable tokenizer fails only prompts that need it (``tokenize`` raises its error, naming the
    files); prompts of token ids run without token text, and a line says so."""
    try:
        tok = _load_tokenizer(directory)
    except ValueError as err:
        message = str(err)

        def unreadable(text):
            raise ValueError(f"text prompts need the model's tokenizer, and {message}")

        if not quiet:
            print(f"osdn-diag: {message}; token text is not stored for this run", file=sys.stderr)
        return None, unreadable
    return tok, _tokenize(tok)


def _tokenize(tok):
    """``text -> ids`` with tokenizer ``tok`` (no special tokens added); ``None`` without one."""
    if tok is None:
        return None
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


def _tokenizer(directory: Path | None):
    """``text -> ids`` with the model directory's own tokenizer (:func:`_load_tokenizer`); ``None`` when
    it has none."""
    return _tokenize(_load_tokenizer(directory))


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
    from . import distributed

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
    ``comparator.parquet``, as the shards' are: an edited summary would otherwise be reported and
    merged as the run's. Called just before the replay stage is marked done; checked on read
    (:func:`osdn_diag.replay.load_run`)."""
    manifest["files"] = {name: {"sha256": sha256_file(Path(out_dir) / name),
                                "size": (Path(out_dir) / name).stat().st_size}
                         for name in (SUMMARY, COMPARATOR) if (Path(out_dir) / name).is_file()}


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
        return CaptureReader(run_dir)
    reader, message = None, None
    if ranks.is_main:
        try:
            if check_links:
                _check_links(run_dir, _REPLAY_FILES)
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
    the two). At most ``QUEUE`` items wait at each step. Dictionary encoding is asked for only where
    values repeat: on the float columns it is tried and abandoned for every page, which triples the
    time to write. A failure on either thread is raised, naming ``target``, by the next
    :meth:`write` or by :meth:`close`."""

    QUEUE = 4
    DICTIONARY_COLUMNS = ["prompt", "task", "layer", "head", "repeat_start", "decode_start", "finite"]

    def __init__(self, path: str, schema: pa.Schema, target: Path):
        self.target = target
        self.part: dict = {}  # set on leaving _residuals_writer under several processes
        self.writer = pq.ParquetWriter(path, schema, use_dictionary=self.DICTIONARY_COLUMNS)
        self.error: BaseException | None = None
        self.queue: queue.Queue = queue.Queue(maxsize=self.QUEUE)  # tables or builders, to the rows thread
        self.built: queue.Queue = queue.Queue(maxsize=self.QUEUE)  # tables, to the encoding thread
        self.rows_thread = threading.Thread(target=self._build, name="residuals-rows", daemon=True)
        self.thread = threading.Thread(target=self._drain, name="residuals-writer", daemon=True)
        self.rows_thread.start()
        self.thread.start()

    def _build(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is None and callable(item):
                try:
                    item = item()
                except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                    self.error = err  # the encoder then skips this item, and every later one
            self.built.put(item)
        self.built.put(None)

    def _drain(self) -> None:
        while (table := self.built.get()) is not None:
            if self.error is None:  # after a failure keep taking tables, so that write() never blocks
                try:
                    self.writer.write_table(table)
                except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                    self.error = err

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
        self.writer.close()
        if check:
            self._check()


def _finish_replay(replayer: Replayer, ranks, out_dir: Path, prompt_entries: list[dict],
                   extra: dict | None = None, *, run_id: str | None = None, parts: dict | None = None) -> dict:
    """Reduce every rank's statistics on rank 0 and write ``comparator.parquet`` and ``summary.json``
    there, both carrying ``run_id``; returns the summary on rank 0, ``{}`` on the others. ``parts``:
    this rank's part of ``residuals.parquet`` (see :func:`_residuals_writer`); every rank's are
    gathered into ``parts`` on rank 0 (the caller records them in the manifest)."""
    from . import distributed

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
