"""Train small delta-rule language models on the Python standard library's sources, in lockstep.

    python examples/train_lm.py prepare --data data/lm [--ship]
    python examples/train_lm.py train --data data/lm --out checkpoints/lm \\
        --arch deltanet osdn:0.003 osdn:0.03 osdn:0.3 osdn-apf gated-deltanet osgdn
    python examples/train_lm.py ship --runs checkpoints/lm --paper-eta 0.003

``prepare`` reads the running interpreter's standard library, or the directory ``--stdlib`` names
(:mod:`osdn_diag.prompts.corpus`: every ``.py`` file, split into train and held-out by a hash of its
path relative to that directory), trains a byte-level BPE tokenizer on the train split and writes ``DATA/``: ``tokenizer.json`` and ``tokenizer_config.json``,
``train.bin`` (the train split's token ids as little-endian uint16, documents separated by
``<|endoftext|>``), ``heldout.safetensors`` and ``corpus.json``. ``--ship`` also copies what the
diagnostic needs (tokenizer, held-out tokens, corpus.json) into the package's
``osdn_diag/builtin/lm-corpus/``.

``train`` trains every architecture of ``--arch`` in one process on the *same* batches in the same
order (random windows of ``--seq`` tokens from ``train.bin``, drawn from ``--seed``), with the same
optimiser, schedule and seed, all stopping at the same step. An OSDN architecture may name its step
size, ``osdn:ETA``; ``osdn`` alone takes ``--eta``. Every ``--eval-every`` steps each model's
held-out loss is measured on fixed windows of the held-out split, once as written (*single*) and once
with the window repeated before it (*twice*: the loss on the second copy, the same target tokens after
the context was seen once). Every ``--monitor-every`` steps (and at the last step) :mod:`osdn_diag.monitor`
probes each model on the first ``--monitor-windows`` of those windows: q_geo and q_arith by layer and the
preconditioner's d, in fp32, appended to ``OUT/monitor.parquet``; its share of the training time is
printed. ``OUT/lm-<arch>/`` receives a bf16 Hugging Face checkpoint with the tokenizer,
``train_log.jsonl``, its own ``monitor.parquet`` and a model card (with q_geo by step);
``OUT/train_summary.json`` the final numbers.

``ship`` copies the checkpoints into ``osdn_diag/builtin/`` as the package's built-in language
models: ``lm-deltanet``, ``lm-osdn`` (``--paper-eta``), ``lm-osdn-tuned`` (the OSDN step size of
lowest held-out loss among those trained, when it is not the paper's), ``lm-osdn-apf``, ``lm-gdn``,
``lm-osgdn`` — those that were trained.

``train`` reports its progress on stderr: at a terminal as a tqdm bar; elsewhere (nohup, a batch job,
output to a file, where the bar is off) as lines, flushed as they are printed: one after the first step
with its seconds (on a GPU the first step compiles the kernels), then one every ``--log-every`` steps and
at the last with each model's training loss, the seconds so far and the seconds per step since the line
before, and with the monitor on, its probes' seconds so far and their share of the time (and one when
``--time-budget`` stops the run). The checkpoints, their ``train_log.jsonl`` and ``train_summary.json``
are written at the end.

A run longer than one command can take (a GPU lent for ten minutes at a time): ``--time-budget SECONDS``
or ``--stop-after STEPS`` stops this command before the last step and saves the whole training state —
every model and optimiser, the batch generator, the logs, the monitors' rows and timings — to
``OUT/state.pt`` (written atomically; ``--save-every N`` also saves it every N steps, so a killed
command loses only the steps since). The same command run again resumes from it and continues as the
uninterrupted run would (the same batches, schedule and probes); an option that changes the training
(anything but ``--data``, ``--out``, ``--device``, the stopping options, ``--time-each``, and ``--eta``
where every ``--arch`` entry names its own step size) is refused,
and so is a ``--data`` whose corpus or tokenizer is not the one the run started on (the directory may
move). A stopped command still writes its checkpoints and summary as they stand (``steps`` in
``train_summary.json`` says how far; ``ship`` refuses them while ``state.pt`` is there); the run's last
command saves the state before its final evaluation and checkpoints, so that a failure there loses no
step, and removes ``state.pt`` once they are written. A new run starts in a new or empty ``--out``: a
finished run's directory is refused, not trained over. While a command runs it holds ``--out``'s lock;
a second command on the same directory is refused at once. The cards and the summary quote the
command without its stopping options.

On a GPU ``train`` takes minutes. ``--device cpu`` runs the same loop with the differentiable
reference recurrences: only useful as a smoke test at a handful of steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from osdn_diag.capture.store import atomic_write_text
from osdn_diag.rundir import sha256_file
from osdn_diag.runtime.atomic import atomic_path
from osdn_diag.monitor import Monitor
from osdn_diag.prompts import corpus

# The MQAR script beside this one: its CPU stand-in for the kernels and its d statistics serve here too.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_mqar import ProgressLines, d_statistics, kernels  # noqa: E402

#: ``--arch`` name -> the built-in name ``ship`` gives it (OSDN step sizes are handled apart).
SHIP_NAMES = {"deltanet": "lm-deltanet", "osdn-apf": "lm-osdn-apf", "gated-deltanet": "lm-gdn", "osgdn": "lm-osgdn"}
BASE_ARCHS = ("deltanet", "osdn", "osdn-apf", "gated-deltanet", "osgdn")
#: The training state a stopped ``train`` leaves in ``--out`` and the same command resumes from.
STATE = "state.pt"


# ----------------------------------------------------------------------------------------------- prepare
def prepare(a: argparse.Namespace) -> dict:
    if a.vocab > 32768:  # heldout.safetensors holds the ids as int16
        raise SystemExit(f"argument --vocab: the held-out tokens are stored as int16; expected --vocab <= 32768, "
                         f"got {a.vocab}")
    root = corpus.stdlib_root() if a.stdlib is None else Path(a.stdlib)
    docs = corpus.stdlib_documents(root)
    data = Path(a.data)
    info = {
        "source": "the Python standard library's .py files (site-packages excluded)",
        "license": "PSF License Version 2 (the Python Software Foundation License)",
        "python": sys.version.split()[0],
        "stdlib": str(root),
        **write_corpus(docs, data, a.vocab),
    }
    atomic_write_text(data / "corpus.json", json.dumps(info, indent=2) + "\n")
    if a.ship:
        dest = corpus.CORPUS_DIR
        dest.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "heldout.safetensors", "corpus.json"):
            shutil.copy2(data / name, dest / name)
    print(json.dumps(info, indent=2))
    return info


def write_corpus(docs: dict[str, list[tuple[str, str]]], data: Path, vocab: int,
                 tokenizer: Path | None = None) -> dict:
    """Train the tokenizer on ``docs["train"]`` (``(path, text)`` pairs) — or take the one ``tokenizer``
    names (a ``tokenizer.json`` this function wrote before, or the directory holding it) — and write
    ``data/``'s tokenizer, ``train.bin`` and ``heldout.safetensors``; returns corpus.json's fields that
    describe them."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if tokenizer is None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab, special_tokens=[corpus.END_OF_TEXT], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator((text for _, text in docs["train"]), trainer)
        kind = "byte-level BPE (Hugging Face tokenizers), trained on the train split"
    else:
        tok, kind = _reused_tokenizer(Path(tokenizer))
    eot = tok.token_to_id(corpus.END_OF_TEXT)
    assert eot == 0, eot

    data = Path(data)
    data.mkdir(parents=True, exist_ok=True)
    tok.save(str(data / "tokenizer.json"))
    # The class name every transformers release resolves (4.x and 5.x alike), no code of ours.
    (data / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": corpus.END_OF_TEXT, "model_max_length": 1 << 20,
    }, indent=2) + "\n")

    def encode(split):
        return [e.ids for e in tok.encode_batch([text for _, text in docs[split]])]

    train = encode("train")
    stream = np.fromiter((t for ids in train for t in [*ids, eot]), dtype=np.uint16)
    (data / "train.bin").write_bytes(stream.astype("<u2").tobytes())
    held = encode("heldout")
    offsets = np.cumsum([0] + [len(x) for x in held]).astype(np.int64)
    save_file({"tokens": np.concatenate([np.asarray(x, dtype=np.int16) for x in held]),
               "offsets": offsets}, str(data / "heldout.safetensors"))
    (data / "heldout.safetensors").chmod(0o644)  # safetensors writes 0600; shipped files are 0644

    import hashlib

    digest = hashlib.sha256()
    for split in ("train", "heldout"):
        for rel, text in docs[split]:
            digest.update(rel.encode() + b"\0" + text.encode() + b"\0")
    return {
        "sha256": digest.hexdigest(),
        "split": f"held out: files whose path's sha256 starts with a byte < {corpus.HELDOUT_BYTE}",
        "files": {split: len(docs[split]) for split in docs},
        "characters": {split: sum(len(t) for _, t in docs[split]) for split in docs},
        "tokenizer": {"kind": kind,
                      "vocab_size": tok.get_vocab_size(), "end_of_text": corpus.END_OF_TEXT, "end_of_text_id": eot},
        "vocab_size": tok.get_vocab_size(),
        "train_tokens": int(len(stream)),
        "heldout_tokens": int(offsets[-1]),
        "heldout_documents": len(held),
    }


def _reused_tokenizer(path: Path):
    """``(tokenizer, its corpus.json description)`` from a ``tokenizer.json`` (or a directory holding one)
    that :func:`write_corpus` wrote: refused in one line if it is missing, unreadable, or has no
    end-of-text token at id 0 or a vocabulary beyond int16 (the held-out ids are int16)."""
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as err:  # missing, not JSON, not a tokenizer
        raise SystemExit(f"argument --tokenizer: {file} is not a readable tokenizer.json ({err})") from err
    if tok.token_to_id(corpus.END_OF_TEXT) != 0 or tok.get_vocab_size() > 32768:
        raise SystemExit(f"argument --tokenizer: {file} is not one that prepare wrote ({corpus.END_OF_TEXT} at id 0, "
                         "at most 32768 tokens)")
    digest = sha256_file(file)
    return tok, f"byte-level BPE (Hugging Face tokenizers), reused: {file.name} of sha256 {digest}"


# ------------------------------------------------------------------------------------------------- train
def parse_arch(spec: str, default_eta: float) -> tuple[str, str, float | None]:
    """``(name, base architecture, eta)`` of an ``--arch`` entry: ``osdn:0.03`` -> ``("osdn-eta0.03", "osdn", 0.03)``."""
    base, _, eta = spec.partition(":")
    if base not in BASE_ARCHS:
        raise SystemExit(f"argument --arch: unknown architecture {base!r}; choose from {', '.join(BASE_ARCHS)}")
    if eta and base not in ("osdn", "osdn-apf", "osgdn"):
        raise SystemExit(f"argument --arch: {base!r} has no step size (only osdn, osdn-apf and osgdn take :ETA)")
    if not eta:
        return base, base, (default_eta if base in ("osdn", "osdn-apf", "osgdn") else None)
    try:
        value = float(eta)
    except ValueError:
        raise SystemExit(f"argument --arch: {spec!r}: the step size after ':' must be a number") from None
    return f"{base}-eta{eta}", base, value



def build_models(specs, a, config_args, device):
    """The models of ``specs`` (``(name, base, eta)``), each initialised from seed ``a.seed`` (so every
    architecture starts from the same draw), in train mode, and an AdamW per model: weight decay on
    matrices other than embeddings and the preconditioner's ``d0``. ``config_args`` sizes the configs
    (:func:`build_config`)."""
    import osdn_diag.models  # noqa: F401  (registers the OSDN configs with transformers)
    from transformers import AutoModelForCausalLM

    models, opts = {}, {}
    for name, base, eta in specs:
        torch.manual_seed(a.seed)
        models[name] = AutoModelForCausalLM.from_config(build_config(base, eta, config_args)).to(device).train()
        params = dict(models[name].named_parameters())
        decayed = {n for n, p in params.items() if p.dim() >= 2 and "d0" not in n and "embed" not in n}
        opts[name] = torch.optim.AdamW(
            [{"params": [params[n] for n in params if n in decayed], "weight_decay": a.weight_decay},
             {"params": [params[n] for n in params if n not in decayed], "weight_decay": 0.0}],
            lr=a.lr, betas=(0.9, 0.95))
    return models, opts


def lr_schedule(a):
    """Step -> learning rate: linear warm-up over ``a.warmup`` steps, then a cosine to
    ``a.min_lr_ratio`` of ``a.lr`` at ``a.steps``."""
    def lr_at(step: int) -> float:
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        t = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
        return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
    return lr_at


def build_config(base: str, eta: float | None, a: argparse.Namespace):
    common = dict(
        hidden_size=a.hidden, num_hidden_layers=a.layers, num_heads=a.heads, vocab_size=a.vocab_size,
        intermediate_size=a.intermediate, max_position_embeddings=4 * a.seq, fuse_cross_entropy=False,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    if base == "deltanet":
        from fla.models import DeltaNetConfig

        return DeltaNetConfig(**common)
    if base == "gated-deltanet":
        from fla.models import GatedDeltaNetConfig

        return GatedDeltaNetConfig(**common, head_dim=a.hidden // a.heads, expand_v=1.0)
    osdn = dict(eta=eta, d_min=a.d_min, d_max=a.d_max)
    if base in ("osdn", "osdn-apf"):
        from osdn_diag.models import OSDNConfig

        return OSDNConfig(**common, **osdn, apf=base == "osdn-apf")
    from osdn_diag.models import OSGDNConfig

    return OSGDNConfig(**common, **osdn, head_dim=a.hidden // a.heads, expand_v=1.0)


def eval_windows(data: Path, seq: int, count: int) -> torch.Tensor:
    """``[count, seq]`` fixed held-out windows: the first ``seq`` tokens of the ``count`` longest
    held-out documents of at least ``seq`` tokens (ties by path order)."""
    docs = corpus.heldout_documents(data)
    long = sorted((d for d in docs if len(d) >= seq), key=len, reverse=True)[:count]
    if not long:
        raise SystemExit(f"no held-out document has {seq} tokens")
    return torch.tensor([d[:seq] for d in long], dtype=torch.long)


@torch.no_grad()
def heldout_nll(model, windows: torch.Tensor, amp, batch: int = 16) -> tuple[float, float]:
    """Mean next-token NLL on ``windows[:, 1:]``: single (the window alone) and twice (the window
    repeated, scored on the second copy: the same targets, the context seen once)."""
    was = model.training
    model.eval()
    sums = [0.0, 0.0]
    count = 0
    L = windows.shape[1]
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        for j, ids in enumerate((w, torch.cat([w, w], dim=1))):
            with amp(), kernels(model):
                logits = model(input_ids=ids).logits.float()
            pred = logits[:, -L:-1] if j else logits[:, :L - 1]
            sums[j] += float(torch.nn.functional.cross_entropy(
                pred.reshape(-1, pred.shape[-1]), w[:, 1:].reshape(-1), reduction="sum"))
        count += w[:, 1:].numel()
    model.train(was)
    return sums[0] / count, sums[1] / count


#: The q_geo-by-step figure a checkpoint holds beside its monitor.parquet, shown by its model card.
CURVE = "q_geo_by_step.png"


def _curve_steps(rows: list[dict]) -> int:
    """Probed steps among the monitor's whole-model rows (``q_by_step``'s or ``Monitor.rows``')."""
    return len({r["step"] for r in rows if r.get("layer", -1) == -1})


def save_checkpoint(target: Path, model, data: Path, log: list[dict], card: str, seq: int,
                    monitor: Monitor | None = None) -> None:
    """Write one checkpoint directory whole or not at all (a hidden sibling renamed at the end)."""
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    model.to(torch.bfloat16).save_pretrained(partial, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(data / name, partial / name)
    (partial / "train_log.jsonl").write_text("".join(json.dumps(row) + "\n" for row in log))
    (partial / "README.md").write_text(card)
    (partial / "task.json").write_text(json.dumps({"suite": "lm-heldout", "length": seq}, indent=2) + "\n")
    if monitor is not None and monitor.rows:
        import pyarrow.parquet as pq

        pq.write_table(monitor.table(), partial / "monitor.parquet")
        if _curve_steps(monitor.rows) >= 2:  # the card shows the curve (model_card)
            _draw_curve(partial / CURVE, monitor.table())
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def _draw_curve(path: Path | str, table) -> None:
    """The q_geo-by-step figure of a monitor's table as a PNG at ``path``; the legend names the table's
    ``model``."""
    import matplotlib.pyplot as plt

    import osdn_diag.plot as odp

    fig = odp.training(table)
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def name_monitor(directory: Path, name: str) -> None:
    """A shipped checkpoint's ``monitor.parquet`` and curve under the name it ships as (``lm-osdn``, not the
    training run's ``osdn-eta0.003``): the ``model`` column rewritten, every other column kept, the curve
    drawn again; each file replaced whole (:func:`~osdn_diag.runtime.atomic.atomic_path`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = directory / "monitor.parquet"
    if not f.is_file():
        return
    table = pq.read_table(f)
    if set(table["model"].to_pylist()) == {name}:  # trained under that name already: nothing to redo
        return
    table = table.set_column(table.column_names.index("model"), "model",
                             pa.array([name] * table.num_rows, table.schema.field("model").type))
    with atomic_path(f, ".parquet") as tmp:
        pq.write_table(table, tmp)
    if (directory / CURVE).exists():  # drawn where the monitor probed two steps: renaming changes no step
        with atomic_path(directory / CURVE, ".png") as tmp:
            _draw_curve(tmp, table)


def model_card(name: str, config, a, res: dict, info: dict, command: str, lockstep: list[str]) -> str:
    fields = {k: v for k, v in config.to_dict().items() if k in (
        "model_type", "hidden_size", "num_hidden_layers", "num_heads", "vocab_size", "intermediate_size",
        "eta", "d_min", "d_max", "apf", "beta_aware", "head_dim", "tie_word_embeddings",
    )}
    d = res.get("d")
    d_line = "" if d is None else (
        f"- preconditioner d on held-out text: mean {d['mean']:.3f}, range [{d['min']:.3f}, {d['max']:.3f}], "
        f"{100 * d['fraction_moved']:.1f} % of entries moved from 1, {100 * d['fraction_at_d_min']:.1f} % at "
        f"d_min, {100 * d['fraction_at_d_max']:.1f} % at d_max\n"
    )
    curve = "\n".join(f"| {r['step']} | {r['heldout_nll']:.4f} | {math.exp(r['heldout_nll']):.2f} | "
                      f"{r['heldout_nll_twice']:.4f} |" for r in res["evals"])
    mon = res.get("monitor")
    contraction = "" if not mon or not mon["q_by_step"] else (
        f"\n## Contraction during training\n\n"
        f"q_geo and q_arith of every write (all layers and heads) on {a.monitor_windows} held-out windows of "
        f"{a.seq} tokens, measured every {a.monitor_every} steps by `osdn_diag.monitor` on the training "
        f"weights (fp32 replay; the checkpoint here holds them rounded to bf16). Per layer, and the "
        f"preconditioner's d, in `monitor.parquet` beside the weights; "
        f"`osdn_diag.plot.training(\"monitor.parquet\")` draws q_geo against step. The probes took "
        f"{100 * mon['fraction']:.2f} % of the training time"
        + ("" if mon["fraction_after_first"] is None else  # None before a second probe
           f": the first {mon['first_probe_seconds']:.2f} s (it compiles the probe's kernels), "
           f"{'the other' if mon['probes'] == 2 else 'the others'} "
           f"{100 * mon['fraction_after_first']:.2f} % of the rest")
        + ".\n\n"
        + (f"![q_geo by training step: the whole model thick, each layer thin]({CURVE})\n\n"
           if _curve_steps(mon["q_by_step"]) >= 2 else "")
        + f"| step | q_geo | q_arith |\n|---|---|---|\n"
        + "\n".join(f"| {r['step']} | {r['q_geo']:.4f} | {r['q_arith']:.4f} |" for r in mon["q_by_step"]) + "\n"
    )
    return (
        f"# {name}\n\n"
        f"A {a.layers}-layer, hidden-{a.hidden}, {a.heads}-head `{fields['model_type']}` language model trained from "
        f"scratch on the Python standard library's sources, for osdn-diag's diagnostic on text. It is a "
        f"diagnostic specimen at a small scale ({res['parameters'] / 1e6:.2f} M parameters), not a "
        f"general-purpose model.\n\n"
        f"## Configuration\n\n```json\n{json.dumps(fields, indent=2)}\n```\n\n"
        f"## Data\n\n"
        f"- text: {info['source']}, Python {info['python']}; license: {info['license']}\n"
        f"- split: {info['split']}: {info['files']['train']} train files, {info['files']['heldout']} held out "
        f"(sha256 of the corpus {info['sha256'][:16]}…)\n"
        f"- tokenizer: {info['tokenizer']['kind']}, {info['vocab_size']} tokens (shipped beside the weights); "
        f"{info['train_tokens']:,} train tokens, {info['heldout_tokens']:,} held out\n\n"
        f"## Training\n\n"
        f"- {res['steps']} steps of {a.batch} windows of {a.seq} tokens ({res['steps'] * a.batch * a.seq / 1e6:.1f} M "
        f"tokens), drawn at random from the train split (seed {a.seed}); AdamW (lr {a.lr}, weight decay "
        f"{a.weight_decay}, {a.warmup} warm-up steps, cosine to {a.min_lr_ratio:g}×), gradient clip 1.0, "
        f"{'bf16 autocast' if res['device'] != 'cpu' else 'fp32'} on {res['device']}, {res['seconds']:.0f} s for "
        f"all models together; trained in lockstep with {', '.join(lockstep)} (same batches, same order)\n"
        f"- final training loss {res['loss']:.4f}\n\n"
        f"## Held-out loss ({a.eval_windows} windows of {a.seq} tokens)\n\n"
        f"Next-token loss in nats per token on the windows' tokens 2…{a.seq}: *single* as written, *twice* on "
        f"the second copy of the window repeated (the same tokens, after the context was seen once).\n\n"
        f"| step | single NLL | single perplexity | twice NLL |\n|---|---|---|---|\n{curve}\n\n"
        f"Final: perplexity {math.exp(res['heldout_nll']):.2f} single, {math.exp(res['heldout_nll_twice']):.2f} "
        f"twice.\n\n"
        f"{d_line}"
        f"{contraction}"
        f"\n## Made by\n\n```\npython examples/train_lm.py prepare --data {a.data}\n{command}\n```\n"
    )


def _synchronized_clock(on_gpu: bool) -> float:
    """``time.perf_counter()`` once the GPU's queued work is done (for --time-each)."""
    if on_gpu:
        torch.cuda.synchronize()
    return time.perf_counter()


def train(a: argparse.Namespace) -> dict:
    """Train in lockstep into ``--out``, held by its lock for the whole command (a second command on the
    same directory is refused at once: two would resume from one state and overwrite each other)."""
    with holding(Path(a.out)):
        return _train(a)


@contextlib.contextmanager
def holding(out: Path):
    """``out``'s lock (:func:`osdn_diag.rundir.output_lock`) while the block runs, a refusal to take it as
    one line; the temporaries a killed save left there removed (nothing else writes into ``out`` while
    it is held)."""
    from osdn_diag.rundir import RunDirectoryError, output_lock
    from osdn_diag.runtime.atomic import remove_stale_temporaries

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(output_lock(out))
        except (RunDirectoryError, OSError) as err:
            raise SystemExit(f"--out {out}: {err}") from None
        remove_stale_temporaries(out)
        yield


def check_time_budget(seconds: float | None) -> None:
    """``--time-budget``: none, or a number of seconds > 0 (0 stopped every command before its first step)."""
    if seconds is not None and not (math.isfinite(seconds) and seconds > 0):
        raise SystemExit(f"argument --time-budget: expected a number of seconds > 0, got {seconds}")


def check_reads(path: Path, saved: dict, reads: dict, data) -> None:
    """Refuse, in one line, a state ``path`` saved by a run that read another corpus or tokenizer than
    ``reads`` (:func:`corpus_identity`) of ``--data data``."""
    if saved.get("reads") == reads:
        return
    what = [w for w, k in (("the corpus", "corpus_sha256"), ("the tokenizer", "tokenizer_sha256"))
            if (saved.get("reads") or {}).get(k) != reads[k]]
    raise SystemExit(f"{path}: saved by a run that read another corpus ({' and '.join(what)} of --data "
                     f"{data} differ); give the same --data to go on, or choose another --out")


def _check_fresh(out: Path) -> None:
    """A run that is not resumed starts in a new or empty ``out``: a finished run's checkpoints would be
    replaced by the first steps of another, and an earlier run's monitor rows would stay in
    ``monitor.parquet`` beside this one's."""
    from osdn_diag.rundir import LOCK_FILE

    held = sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE)
    if not held:
        return
    if (out / "train_summary.json").exists():
        raise SystemExit(f"--out {out}: holds a finished training run (train_summary.json, no {STATE} to go on "
                         "from); a new run needs a new or empty directory")
    raise SystemExit(f"--out {out}: not empty ({', '.join(held[:3])}{', …' if len(held) > 3 else ''}) and no "
                     f"stopped run's {STATE} to go on from; a new run needs a new or empty directory")


def corpus_identity(data: Path, info: dict) -> dict:
    """What a resumed run must read that the stopped one read: the corpus (its ``corpus.json`` digest)
    and the tokenizer (its file's sha256), wherever the directory now is."""
    return {"corpus_sha256": info.get("sha256"), "tokenizer_sha256": sha256_file(data / "tokenizer.json")}


#: Options that only say where this command stops; the recipe a card and the summary quote leaves them out.
STOP_OPTIONS = ("--time-budget", "--stop-after")


def recipe_command(argv: list[str], script: str = "examples/train_lm.py") -> str:
    """The command line that made a run, for its card and summary: ``python SCRIPT`` and ``argv`` without
    :data:`STOP_OPTIONS` (``--opt VALUE`` or ``--opt=VALUE``), which differ between the commands of one
    run and do not change what it trains (scale_study.py's resumable runs quote theirs the same way)."""
    kept, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in STOP_OPTIONS:
            skip = True
        elif not x.startswith(tuple(f"{o}=" for o in STOP_OPTIONS)):
            kept.append(x)
    return f"python {script} " + " ".join(shlex.quote(x) for x in kept)


def _train(a: argparse.Namespace) -> dict:
    command = recipe_command(sys.argv[1:])
    data = Path(a.data)
    info = corpus.corpus_info(data)
    a.vocab_size = info["vocab_size"]
    check_time_budget(a.time_budget)
    specs = [parse_arch(s, a.eta) for s in a.arch]
    names = [n for n, _, _ in specs]
    if len(set(names)) != len(names):
        raise SystemExit("argument --arch: an architecture is named twice")
    out = Path(a.out)
    # What this command writes into --out, checked before it trains: a link there is not ours to
    # replace or write through (found only at the end, it would fail after every step was trained).
    for name in (STATE, "monitor.parquet", "train_summary.json", *(f"lm-{n}" for n in names)):
        if (out / name).is_symlink():
            raise SystemExit(f"--out {out}: {name} is a link; this command writes {name} itself and does not "
                             "replace or write through a link: remove it, or choose another --out")
    state_path = out / STATE
    if not state_path.exists():
        _check_fresh(out)
    if a.log_every < 1 or a.eval_every < 1:
        raise SystemExit("argument --log-every/--eval-every: expected at least 1 (steps between lines, evaluations)")
    if (a.stop_after is not None and a.stop_after < 1) or a.save_every < 0:
        raise SystemExit("argument --stop-after/--save-every: expected --stop-after >= 1 and --save-every >= 0 "
                         "(0: only when stopped)")
    if a.monitor_every < 0 or a.monitor_windows < 1:
        raise SystemExit("argument --monitor-every/--monitor-windows: expected --monitor-every >= 0 (0: off) "
                         "and --monitor-windows >= 1")

    from osdn_diag.runtime import prepare as prepare_device

    device = prepare_device(a.device)
    import osdn_diag.models  # noqa: F401  (registers the OSDN configs with transformers)

    on_gpu = device.type == "cuda"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_gpu else nullcontext
    stream = torch.from_numpy(np.fromfile(data / "train.bin", dtype="<u2").astype(np.int64))
    windows = eval_windows(data, a.seq, a.eval_windows).to(device)

    models, opts = build_models(specs, a, a, device)
    lr_at = lr_schedule(a)

    monitors = {}
    if a.monitor_every:
        probe = windows[:a.monitor_windows]
        for n, model in models.items():  # one file for all models, a `model` column apart
            monitors[n] = Monitor(model, probe, every=a.monitor_every, out=out / "monitor.parquet",
                                  name=f"lm-{n}", autocast=torch.bfloat16 if on_gpu else None)
    logs = {n: [] for n in names}
    evals = {n: [] for n in names}
    gen = torch.Generator().manual_seed(a.seed)
    step, loss_val = 0, {}
    busy = {n: 0.0 for n in names}  # seconds of each model's steps, with --time-each
    earlier = 0.0  # seconds of training in the commands before this one (a resumed run)
    reads = corpus_identity(data, info)
    if state_path.exists():
        state = load_state(state_path, a, reads)
        for n in names:
            models[n].load_state_dict(state["models"][n])
            opts[n].load_state_dict(state["optimizers"][n])
            if n in monitors:
                monitors[n].restore(state["monitors"][n])
        gen.set_state(state["generator"])
        step, earlier, logs, evals, busy = state["step"], state["seconds"], state["logs"], state["evals"], state["busy"]
        loss_val = {n: torch.tensor(v) for n, v in state["loss"].items()}
        print(f"[train] resumed {out} at step {step} of {a.steps}", file=sys.stderr, flush=True)
    start = time.perf_counter() - earlier  # the run's clock: every seconds figure counts all its commands
    here = time.perf_counter()  # this command's own start (--time-budget)
    first = step

    def save_state() -> None:
        save_training_state(state_path, {
            "recipe": _recipe(a), "reads": reads, "step": step, "seconds": time.perf_counter() - start, "logs": logs,
            "evals": evals, "busy": busy, "loss": {n: float(v) for n, v in loss_val.items()},
            "generator": gen.get_state(), "models": {n: m.state_dict() for n, m in models.items()},
            "optimizers": {n: o.state_dict() for n, o in opts.items()},
            "monitors": {n: m.state() for n, m in monitors.items()},
        })

    def evaluate():
        for n, model in models.items():
            single, twice = heldout_nll(model, windows, amp)
            row = {"step": step, "heldout_nll": single, "heldout_nll_twice": twice,
                   "seconds": time.perf_counter() - start}
            logs[n].append(row)
            evals[n].append(row)

    bar = tqdm(total=a.steps, initial=step, desc="train " + "/".join(names), unit="step", disable=None)
    progress = ProgressLines(bar, a.steps, start, initial=step, resumed_at=here)  # lines where the bar is off
    stopped = False
    while step < a.steps:
        over = a.time_budget is not None and time.perf_counter() - here > a.time_budget
        if over or (a.stop_after is not None and step - first >= a.stop_after):
            if over:
                progress.stopped(step, a.time_budget)
            save_state()
            print(f"[train] stopped after step {step} of {a.steps}, its state in {state_path}: the same command "
                  "again goes on from there", file=sys.stderr, flush=True)
            stopped = True
            break
        starts = torch.randint(0, len(stream) - a.seq - 1, (a.batch,), generator=gen)
        batch = torch.stack([stream[s:s + a.seq] for s in starts.tolist()]).to(device)
        lr = lr_at(step)
        for n, model in models.items():
            if a.time_each:
                t0 = _synchronized_clock(on_gpu)
            for group in opts[n].param_groups:
                group["lr"] = lr
            with amp(), kernels(model):
                loss = model(input_ids=batch, labels=batch).loss
            opts[n].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opts[n].step()
            loss_val[n] = loss.detach()
            if a.time_each:
                busy[n] += _synchronized_clock(on_gpu) - t0
        step += 1
        bar.update(1)
        if step == 1:
            progress.first_step(on_gpu)
        last = step == a.steps
        logged = None
        if step % a.log_every == 0 or last:
            logged = {}
            for n in names:
                value = float(loss_val[n])
                if not math.isfinite(value):
                    raise FloatingPointError(f"{n}: non-finite training loss {value} at step {step}")
                logs[n].append({"step": step, "lr": lr, "loss": value, "seconds": time.perf_counter() - start})
                logged[n] = value
            bar.set_postfix({n: f"{float(v):.3f}" for n, v in loss_val.items()})
        for mon in monitors.values():
            if mon.step(step) is None and last:
                mon.probe(step)
        if step % a.eval_every == 0 or last:
            evaluate()
        if logged is not None:  # after this step's probes and evaluation: the seconds include them
            progress.step(step, logged, monitors.values())
        if a.save_every and step % a.save_every == 0 and step < a.steps:
            save_state()
    bar.close()
    if not stopped and step > first:
        # Saved before the wrap-up (evaluation, cards, checkpoints): a failure there — a full disk, a
        # path that cannot be written — leaves the trained steps to go on from, not the last save's.
        save_state()
    if not evals[names[0]] or evals[names[0]][-1]["step"] != step:
        evaluate()
    seconds = time.perf_counter() - start

    results = {}
    for (name, base, eta), model in zip(specs, models.values()):
        model.eval()
        last_eval = evals[name][-1]
        res = {
            "arch": base, "eta": eta, "steps": step, "seconds": seconds,
            "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "parameters": sum(p.numel() for p in model.parameters()),
            **({"seconds_own_steps": busy[name]} if a.time_each else {}),
            "loss": float(loss_val[name]) if loss_val else float("nan"),
            "heldout_nll": last_eval["heldout_nll"], "heldout_nll_twice": last_eval["heldout_nll_twice"],
            "evals": evals[name],
        }
        if base in ("osdn", "osdn-apf", "osgdn"):
            res["d"] = d_statistics(model, windows[:8], amp, a.d_min, a.d_max)
        mon = monitors.get(name)
        if mon is not None:
            o = mon.close(seconds)  # prints the probes' share of the training time
            res["monitor"] = {"every": a.monitor_every, "windows": a.monitor_windows, "probes": o["probes"],
                              "probe_seconds": o["probe_seconds"], "fraction": o["fraction"],
                              "first_probe_seconds": o["first_probe_seconds"],
                              "fraction_after_first": o["fraction_after_first"],
                              "q_by_step": [{k: r[k] for k in ("step", "q_geo", "q_arith")}
                                            for r in mon.rows if r["layer"] == -1]}
        results[name] = res
        card = model_card(f"lm-{name}", model.config, a, res, info, command, names)
        save_checkpoint(out / f"lm-{name}", model, data, logs[name], card, a.seq, mon)
        print(json.dumps({k: v for k, v in res.items() if k != "evals"}))
    summary = {"command": command, "corpus": info, "results": results}
    atomic_write_text(out / "train_summary.json", json.dumps(summary, indent=2) + "\n")
    if not stopped:  # the run is complete: nothing to resume
        state_path.unlink(missing_ok=True)
    return results


#: ``train``'s options that may change between the commands of one run resumed from ``OUT/state.pt``.
RESUME_FREE = ("command", "data", "out", "device", "time_budget", "stop_after", "save_every", "time_each",
               "vocab_size")  # the corpus's, not an option: the corpus itself is compared (corpus_identity)


def _recipe(a: argparse.Namespace) -> dict:
    """What a resumed run must share with the run that saved the state: every other option (``--eta``
    only where an ``--arch`` entry takes it, one of osdn, osdn-apf and osgdn named without ``:ETA``)."""
    eta_used = any(":" not in spec and spec in ("osdn", "osdn-apf", "osgdn") for spec in a.arch)
    return {k: v for k, v in sorted(vars(a).items()) if k not in RESUME_FREE and (k != "eta" or eta_used)}


def save_training_state(path: Path, state: dict) -> None:
    """Write the training state (models, optimisers, batch generator, logs, monitors) whole or not at all."""
    with atomic_path(path, ".pt") as tmp:
        torch.save(state, tmp)


def load_state(path: Path, a: argparse.Namespace, reads: dict | None = None) -> dict:
    """The state a stopped command saved, refused in one line if it was saved by another recipe. Read onto
    the CPU: the batch generator's state must be a CPU tensor, and ``load_state_dict`` moves the models'
    and optimisers' tensors to their parameters' device."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated, or not a state this script wrote
        first = (str(err).strip().splitlines() or [""])[0][:200]  # torch's later lines advise an unsafe load
        raise SystemExit(f"{path}: not a readable training state ({type(err).__name__}: {first}); "
                         "remove it to start over, or choose another --out") from None
    if not isinstance(state, dict) or "recipe" not in state:
        raise SystemExit(f"{path}: not a training state of this script; remove it or choose another --out")
    theirs, ours = state["recipe"], _recipe(a)
    differ = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
    if reads is not None:
        check_reads(path, state, reads, a.data)
    if differ:
        listed = "; ".join(f"--{k.replace('_', '-')} {theirs.get(k)!r} there, {ours.get(k)!r} here" for k in differ)
        raise SystemExit(f"{path}: saved by a run with other options ({listed}); give the same options to go on, "
                         "or choose another --out")
    return state


# -------------------------------------------------------------------------------------------------- ship
def ship(a: argparse.Namespace) -> dict:
    runs = Path(a.runs)
    if (runs / STATE).exists():
        raise SystemExit(f"--runs {runs}: a stopped run ({STATE}: its checkpoints are those of the step it "
                         "stopped at); run its train command again to finish it, then ship")
    summary = json.loads((runs / "train_summary.json").read_text())
    results = summary["results"]
    chosen: dict[str, str] = {}
    for name, res in results.items():
        if res["arch"] in SHIP_NAMES and res["eta"] in (None, a.paper_eta):
            chosen[SHIP_NAMES[res["arch"]]] = name
    osdn = {n: r for n, r in results.items() if r["arch"] == "osdn"}
    paper = [n for n, r in osdn.items() if r["eta"] == a.paper_eta]
    if paper:
        chosen["lm-osdn"] = paper[0]
    if osdn:
        best = min(osdn, key=lambda n: osdn[n]["heldout_nll"])
        if osdn[best]["eta"] != a.paper_eta:
            chosen["lm-osdn-tuned"] = best
    dest_root = Path(a.to)
    # What an earlier ship left that this training run does not replace (a tuned OSDN that is no longer
    # the best, a family not trained this time) would otherwise stay a built-in model without a line in
    # lm_train_summary.json: removed.
    for stale in sorted({"lm-osdn", "lm-osdn-tuned", *SHIP_NAMES.values()} - set(chosen)):
        shutil.rmtree(dest_root / stale, ignore_errors=True)
    for target, name in chosen.items():
        src, dest = runs / f"lm-{name}", dest_root / target
        card = (src / "README.md").read_text().replace(f"# lm-{name}\n", f"# {target}\n", 1)
        if target in ("lm-osdn", "lm-osdn-tuned") and len(osdn) > 1:
            sweep = ", ".join(f"η = {r['eta']:g}: {r['heldout_nll']:.4f}" for r in
                              sorted(osdn.values(), key=lambda r: r["eta"]))
            best_eta = osdn[best]["eta"]
            verdict = (f"η = {best_eta:g} had the lowest held-out NLL of the OSDN models trained in lockstep"
                       + (", the paper's own step size, so no separate tuned model ships" if best_eta == a.paper_eta
                          else f"; `lm-osdn` is the paper's η = {a.paper_eta:g}, `lm-osdn-tuned` this one"))
            card += f"\n## Step size\n\n{verdict} (held-out NLL by η: {sweep}).\n"
        shutil.rmtree(dest, ignore_errors=True)
        shutil.copytree(src, dest)
        (dest / "README.md").write_text(card)
        name_monitor(dest, target)
    table = {target: {"from": name, **{k: v for k, v in results[name].items() if k != "evals"}}
             for target, name in chosen.items()}
    atomic_write_text(dest_root / "lm_train_summary.json",
                      json.dumps({"command": summary["command"], "corpus": summary["corpus"], "models": table},
                                 indent=2) + "\n")
    print(json.dumps({t: n for t, n in chosen.items()}, indent=2))
    return chosen


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="build the corpus, tokenizer and token files")
    pp.add_argument("--data", required=True)
    pp.add_argument("--vocab", type=int, default=4096, help="tokenizer vocabulary (4096; at most 32768)")
    pp.add_argument("--stdlib", default=None, metavar="DIR",
                    help="the library to read (default: the running interpreter's standard library)")
    pp.add_argument("--ship", action="store_true", help="also copy tokenizer and held-out tokens into the package")
    pt = sub.add_parser("train", help="train the architectures in lockstep")
    pt.add_argument("--data", required=True)
    pt.add_argument("--out", required=True)
    pt.add_argument("--arch", nargs="+", default=["deltanet", "osdn", "osdn-apf"])
    pt.add_argument("--device", default=None)
    pt.add_argument("--hidden", type=int, default=256)
    pt.add_argument("--layers", type=int, default=4)
    pt.add_argument("--heads", type=int, default=4)
    pt.add_argument("--intermediate", type=int, default=512)
    pt.add_argument("--eta", type=float, default=0.003, help="OSDN step size where --arch names none (paper: 0.003)")
    pt.add_argument("--d-min", type=float, default=0.5)
    pt.add_argument("--d-max", type=float, default=2.0)
    pt.add_argument("--seq", type=int, default=512)
    pt.add_argument("--batch", type=int, default=32)
    pt.add_argument("--steps", type=int, default=1500)
    pt.add_argument("--time-budget", type=float, default=None,
                    help="stop once this command has trained this many seconds (> 0; loading, the final "
                         "evaluation and the checkpoints come on top), saving OUT/state.pt to go on from")
    pt.add_argument("--stop-after", type=int, default=None, metavar="N",
                    help="stop after N steps of this command, saving OUT/state.pt to go on from")
    pt.add_argument("--save-every", type=int, default=0, metavar="N",
                    help="also save OUT/state.pt every N steps (0: only when stopped before the last step)")
    pt.add_argument("--lr", type=float, default=3e-3)
    pt.add_argument("--weight-decay", type=float, default=0.1)
    pt.add_argument("--warmup", type=int, default=100)
    pt.add_argument("--min-lr-ratio", type=float, default=0.1)
    pt.add_argument("--seed", type=int, default=0)
    pt.add_argument("--eval-windows", type=int, default=64)
    pt.add_argument("--eval-every", type=int, default=250)
    pt.add_argument("--log-every", type=int, default=25)
    pt.add_argument("--time-each", action="store_true", help="time each model's steps apart (synchronises the GPU)")
    pt.add_argument("--monitor-every", type=int, default=100,
                    help="probe q_geo every N steps with osdn_diag.monitor (100; 0: off)")
    pt.add_argument("--monitor-windows", type=int, default=4, help="held-out windows the monitor probes (4)")
    ps = sub.add_parser("ship", help="copy trained checkpoints into the package as builtin:lm-*")
    ps.add_argument("--runs", required=True)
    ps.add_argument("--to", default=str(corpus.CORPUS_DIR.parent))
    ps.add_argument("--paper-eta", type=float, default=0.003)
    a = p.parse_args(argv)
    return {"prepare": prepare, "train": train, "ship": ship}[a.command](a)


if __name__ == "__main__":
    main()
