"""The capture stage: :func:`capture_run` (model + prompts -> ``capture/`` + ``manifest.json``) and
:func:`stream_run` (capture and replay in one pass, nothing stored), both built on one capture
session: this rank's model, prompts and forward batches, and the manifest."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from ..capture.store import CaptureWriter, StoredCall, layer_entry
from ..rundir import (
    RunDirectoryError,
    check_links,
    new_run_id,
    output_lock,
    prepare_output,
    run_manifest,
    write_rank_record,
)
from ..replay import Replayer
from ..replay.replayer import table_kind
from .inputs import _batches, _check_batches_fit, _check_generate, _inputs, _progress, _session_tokenizer, _versions
from .kernels import COMPILE_NOTICE, _compiles_kernels, has_compiled_kernels, triton_cache_dir
from .recall import _recall_hits
from . import replaying
from .replaying import record_result_files
from .resume import _prepare_node_output, _resumable, _verified_record
from .writers import _residuals_writer




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

        def first_batch(calls) -> None:  # every layer's kind, before its first call is replayed
            if residuals.expected is None:
                residuals.expect(table_kind(call) for call in calls)

        session.run(replay_now, progress, on_batch=first_batch)
    parts = dict(residuals.part)
    if session.ranks.world > 1:
        session.write_record(residuals=parts)
    entries = session.manifest_prompts()
    # With --generate a prompt's stream is longer than the prompt the replayer was made with: the
    # summary's repeat boundaries are relative to the stream, as a replay of the stored run's are.
    replayer.prompts = {e["id"]: e for e in entries}
    # replaying._finish_replay looked up at call time, where bench_e2e --stages times it
    summary = replaying._finish_replay(replayer, session.ranks, session.out_dir, entries,
                                       run_id=session.run_id, parts=parts)
    if session.ranks.world > 1:
        session.writer.manifest["parts"] = dict(sorted(parts.items()))
    if session.ranks.is_main:
        record_result_files(session.out_dir, session.writer.manifest)
    session.finish(done=("capture", "replay"))
    return summary


def _note_default_dtype(loaded, dtype: torch.dtype) -> None:
    """Say so where the default dtype (bf16 on a GPU, fp32 on the CPU) is not the one the checkpoint's
    ``config.json`` stores, which ``from_pretrained(DIR)`` without a dtype would load it in."""
    directory = getattr(loaded, "directory", None)
    if directory is None:
        return
    try:
        config = json.loads((Path(directory) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    stored = config.get("dtype", config.get("torch_dtype")) if isinstance(config, dict) else None
    if not isinstance(stored, str) or stored not in ("float32", "bfloat16", "float16"):
        return
    chosen = str(dtype).removeprefix("torch.")
    if stored != chosen:
        where = "on a GPU" if chosen == "bfloat16" else "on the CPU"
        print(f"note: {directory / 'config.json'} stores the model in {stored}; it runs in {chosen}, the default "
              f"{where} (--dtype {stored} runs it as stored)", file=sys.stderr)


class _CaptureSession:
    """What :func:`capture_run` and :func:`stream_run` share: this rank's device and dtype, the model,
    the prompts, the forward batches this rank owns, and the manifest (written incomplete once the
    model and the prompts have loaded, its stages marked done by :meth:`finish` once every rank is
    done)."""

    def __init__(self, model_spec, prompts_spec, out_dir, *, device, dtype, kernels, batch_size, twice,
                 num_prompts, length, seed, stored: bool = True, device_map=None, overwrite: bool = False,
                 stages: tuple[str, ...] = ("capture",), generate: int = 0):
        from .. import distributed, runtime
        from ..prompts import load_prompts

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
        from ..models import load_model

        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.out_dir = Path(out_dir)
        self.model_spec, self.kernels, self.batch_size = model_spec, kernels, batch_size
        self.twice, self.seed, self.stored = twice, seed, stored
        # The model and the prompts first: a checkpoint or prompt file that cannot be used fails the
        # run before its directory is created.
        self.loaded = preloaded or load_model(model_spec, device=self.device, dtype=self.dtype, seed=seed,
                                              device_map=device_map)
        if dtype is None and self.ranks.is_main:
            _note_default_dtype(self.loaded, self.dtype)
        # Inputs go where the embedding is; replay runs on the requested (or default) device, to which
        # every call is moved (a model spread over several GPUs has calls on each of them).
        self.replay_device = self.device
        self.device = self.loaded.model.get_input_embeddings().weight.device
        # The tokenizer, if the model has one: it tokenises text prompts and gives tokens.parquet its text.
        self.tokenizer, tokenize, self.tokenizer_problem = _session_tokenizer(self.loaded.directory)
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
        from ..identity import run_identity

        return run_identity(self.loaded, self.prompts, seed=self.seed, device_type=self.device.type,
                            versions=_versions(), hash_weights=True if self.ranks.world > 1 else None)

    def _check_same_prompts(self) -> None:
        """Under several processes every rank loads the prompts itself (from its own machine's file,
        without a shared file system): refuse a rank whose prompts are not rank 0's, on every rank."""
        from ..identity import prompts_digest

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

    def run(self, on_call, progress: bool, on_batch=None) -> None:
        """Run this rank's forward batches under capture; hand every captured call to ``on_call`` (a
        :class:`StoredCall`) as soon as its batch has run, then drop it; ``on_batch``: given each
        batch's list of calls (:class:`KernelCall`) first."""
        from .. import distributed
        from ..capture.context import capture
        from ..capture.generation import generate as generate_stream

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
                if on_batch is not None:
                    on_batch(calls)
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
        for layers in self.ranks.gather(self.writer.layers):  # a rank may have had no batch
            for index, entry in layers.items():
                self.writer.layers.setdefault(index, entry)
        # After the first collective: every rank has written its record by then, whichever is slower.
        distributed.fault_point("captured")
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
        from ..prompts.text import TokenText
        from ..replay.tokens import token_table, tokens_entry, write_tokens

        text = None if self.tokenizer is None else TokenText(self.tokenizer, self.loaded.directory)
        table = token_table(self.token_ids(), text)
        return tokens_entry(write_tokens(self.out_dir, table, self.run_id), None if text is None else text.info,
                            self.tokenizer_problem)

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
