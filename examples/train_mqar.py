"""Train small delta-rule language models on multi-query associative recall (MQAR), in lockstep.

    python examples/train_mqar.py --out checkpoints/ --arch deltanet osdn osdn-apf

Every architecture named in ``--arch`` is trained in the same process on the *same* batches, in the
same order, with the same optimiser, schedule and seed, and all stop at the same step (``--steps``,
or earlier when ``--time-budget`` seconds have passed — they still stop together). Each batch is half
MQAR (context, then queries) and half MQAR-twice (the context repeated before the queries), the
single rows right-padded to the twice length so that every step has one shape.

For each architecture ``OUT/mqar-<arch>/`` receives a Hugging Face checkpoint (``config.json``,
``model.safetensors``, fp32), ``train_log.jsonl`` (loss every ``--log-every`` steps, held-out recall
accuracy single / twice every ``--eval-every``) and ``README.md``, a model card with the
configuration, the data, the final accuracy and the command that made it. OSDN models also report
where their preconditioner ``d`` ended up (captured from the kernels on the held-out batch).

Progress goes to stderr: at a terminal as a tqdm bar; elsewhere (nohup, a batch job, output to a file,
where the bar is off) as lines, flushed as they are printed: one after the first step with its seconds
(on a GPU the first step compiles the kernels), then one every ``--log-every`` steps and at the last
with each model's training loss, the seconds so far and the seconds per step since the line before
(and one when ``--time-budget`` stops the run). The checkpoints and ``train_summary.json`` are written at the end.

On a GPU this takes minutes. ``--device cpu`` runs the same loop on a CPU (the delta-rule kernels are
replaced by the differentiable reference recurrences; everything else runs under Triton's
interpreter): only useful for a smoke test at a handful of steps.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm import tqdm

from osdn_diag.capture.store import atomic_write_text

ARCHS = ("deltanet", "osdn", "osdn-apf", "gated-deltanet", "osgdn")


def build_config(arch: str, a: argparse.Namespace):
    common = dict(
        hidden_size=a.hidden, num_hidden_layers=a.layers, num_heads=a.heads, vocab_size=a.vocab,
        max_position_embeddings=4096, fuse_cross_entropy=False, tie_word_embeddings=False,
    )
    osdn = dict(eta=a.eta, d_min=a.d_min, d_max=a.d_max)
    if arch == "deltanet":
        from fla.models import DeltaNetConfig

        return DeltaNetConfig(**common)
    if arch == "gated-deltanet":
        from fla.models import GatedDeltaNetConfig

        return GatedDeltaNetConfig(**common, head_dim=a.hidden // a.heads, expand_v=1.0)
    if arch in ("osdn", "osdn-apf"):
        from osdn_diag.models import OSDNConfig

        return OSDNConfig(**common, **osdn, apf=arch == "osdn-apf")
    if arch == "osgdn":
        from osdn_diag.models import OSGDNConfig

        return OSGDNConfig(**common, **osdn, head_dim=a.hidden // a.heads, expand_v=1.0)
    raise ValueError(f"argument '--arch': unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")


def mixed_batch(spec, batch_size: int, generator: torch.Generator, device):
    """Half MQAR, half MQAR-twice, one shape ``[batch_size, spec.length(twice=True)]``; the single rows
    are right-padded with token 0 (labels −100), which a causal model never attends to."""
    from osdn_diag.prompts.mqar import IGNORE_INDEX, mqar_batch

    half = batch_size // 2
    ids1, lab1 = mqar_batch(spec, half, twice=False, generator=generator)
    ids2, lab2 = mqar_batch(spec, batch_size - half, twice=True, generator=generator)
    pad = ids2.shape[1] - ids1.shape[1]
    ids1 = torch.nn.functional.pad(ids1, (0, pad), value=0)
    lab1 = torch.nn.functional.pad(lab1, (0, pad), value=IGNORE_INDEX)
    return torch.cat([ids1, ids2]).to(device), torch.cat([lab1, lab2]).to(device)


def kernels(model):
    """On a CPU the differentiable reference recurrences stand in for the Triton delta-rule kernels
    (capture with ``kernels="reference"``, records dropped); on a GPU fla's kernels run untouched."""
    if next(model.parameters()).device.type == "cuda":
        return nullcontext()
    import osdn_diag

    return osdn_diag.capture(model, kernels="reference", sink=lambda call: None)


@torch.no_grad()
def recall(model, ids: torch.Tensor, labels: torch.Tensor, amp) -> float:
    """Fraction of answer tokens predicted by the argmax one position earlier (eval mode)."""
    was_training = model.training
    model.eval()
    with amp(), kernels(model):
        logits = model(input_ids=ids).logits
    model.train(was_training)
    pred = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    mask = target != -100
    return float((pred[mask] == target[mask]).float().mean())


def d_statistics(model, ids: torch.Tensor, amp, d_min: float, d_max: float) -> dict | None:
    """Where phase 1's ``d`` went on a held-out batch (OSDN models only), read from the live kernels."""
    import osdn_diag

    with torch.no_grad(), osdn_diag.capture(model, offload=True) as cap, amp():
        model(input_ids=ids)
    ds = [c.d.flatten() for c in cap.calls if c.d is not None]
    if not ds:
        return None
    d = torch.cat(ds).double()
    tol = 1e-6
    return {
        "mean": float(d.mean()), "min": float(d.min()), "max": float(d.max()), "std": float(d.std()),
        "fraction_at_d_min": float((d <= d_min + tol).double().mean()),
        "fraction_at_d_max": float((d >= d_max - tol).double().mean()),
        "fraction_moved": float(((d - 1).abs() > 1e-3).double().mean()),
    }


class ProgressLines:
    """A training loop's progress as lines on stderr where its tqdm bar is off (``disable=None`` turns
    it off when stderr is not a terminal: nohup, a batch job, output to a file), so that a run stopped
    by a time limit has said how far it got. ``on`` follows the bar: at a terminal the bar alone reports
    and nothing is printed here. ``start`` is the loop's ``time.perf_counter()`` at its start; a loop
    resumed at step ``initial`` passes the clock reading at which this command began as ``resumed_at``,
    so that its first line's seconds per step are this command's steps', not the run's average."""

    def __init__(self, bar, total: int, start: float, *, initial: int = 0, resumed_at: float | None = None):
        self.on = bool(bar.disable)
        self.total = total
        self.start = start
        self._step, self._time = initial, start if resumed_at is None else resumed_at

    def _print(self, text: str) -> None:
        print(f"[train] {text}", file=sys.stderr, flush=True)

    def first_step(self, on_gpu: bool) -> None:
        """After step 1: its seconds (on a GPU the first step compiles the kernels, which can look like
        a hang). The GPU is synchronised for the figure once, and only when the line is printed."""
        if not self.on:
            return
        if on_gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self.start
        self._print(f"step 1/{self.total} took {seconds:.1f} s"
                    + (" (the first step compiles the GPU kernels; the next ones are faster)" if on_gpu else ""))

    def step(self, step: int, losses: dict[str, float], monitors=()) -> None:
        """A logged step: each model's loss (floats the loop has already read, so no GPU
        synchronisation here), the seconds so far and per step since the line before, and where
        ``monitors`` (:class:`osdn_diag.monitor.Monitor`) are on, their probes' seconds so far and
        share of those seconds (:meth:`~osdn_diag.monitor.Monitor.overhead`, summed over the models)."""
        if not self.on:
            return
        now = time.perf_counter()
        elapsed = now - self.start
        steps = step - self._step
        rate = (now - self._time) / steps
        self._step, self._time = step, now
        text = (f"step {step}/{self.total}: " + ", ".join(f"{n} {v:.3f}" for n, v in losses.items())
                + f" · {elapsed:.1f} s, {rate:.2f} s/step (last {steps})")
        overheads = [m.overhead(elapsed) for m in monitors]
        if overheads:
            seconds = sum(o["probe_seconds"] for o in overheads)
            share = sum(o["fraction"] for o in overheads)  # each over the same elapsed seconds
            text += f" · monitor {seconds:.2f} s ({100 * share:.1f} %)"
        self._print(text)

    def stopped(self, step: int, budget: float) -> None:
        """The loop stopped at ``--time-budget`` before its last step."""
        if self.on:
            self._print(f"--time-budget of {budget:g} s reached after step {step} of {self.total}")


def _save(target: Path, model, log: list[dict], card: str, task: dict) -> None:
    """Write one checkpoint directory whole or not at all: everything goes to a hidden sibling that
    replaces ``target`` by a rename at the end, so an interrupted run never leaves a directory that
    looks like a finished checkpoint."""
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    model.float().save_pretrained(partial, safe_serialization=True)
    (partial / "train_log.jsonl").write_text("".join(json.dumps(row) + "\n" for row in log))
    (partial / "README.md").write_text(card)
    (partial / "task.json").write_text(json.dumps(task, indent=2) + "\n")
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def model_card(arch: str, config, a, result: dict, command: str) -> str:
    fields = {k: v for k, v in config.to_dict().items() if k in (
        "model_type", "hidden_size", "num_hidden_layers", "num_heads", "vocab_size", "eta", "d_min",
        "d_max", "apf", "beta_aware", "head_dim",
    )}
    d = result.get("d")
    d_line = "" if d is None else (
        f"- preconditioner d on the held-out batch: mean {d['mean']:.3f}, range [{d['min']:.3f}, "
        f"{d['max']:.3f}], {100 * d['fraction_moved']:.1f} % of entries moved from 1, "
        f"{100 * d['fraction_at_d_min']:.1f} % at d_min, {100 * d['fraction_at_d_max']:.1f} % at d_max\n"
    )
    return (
        f"# mqar-{arch}\n\n"
        f"A {a.layers}-layer, hidden-{a.hidden}, {a.heads}-head `{fields['model_type']}` language model trained "
        f"from scratch on multi-query associative recall (MQAR) for osdn-diag's built-in demo. It is a "
        f"diagnostic specimen, not a general-purpose model.\n\n"
        f"## Configuration\n\n```json\n{json.dumps(fields, indent=2)}\n```\n\n"
        f"## Training\n\n"
        f"- data: MQAR with {a.pairs} key-value pairs and {a.pairs} queries, vocabulary {a.vocab} (keys "
        f"in [1, {a.vocab // 2}), values in [{a.vocab // 2}, {a.vocab})); every batch half single, half "
        f"twice (context repeated), freshly drawn (seed {a.seed})\n"
        f"- {result['steps']} steps of batch {a.batch}, AdamW (lr {a.lr}, weight decay {a.weight_decay}, "
        f"{a.warmup} warm-up steps, cosine to {a.min_lr_ratio:g}× over {a.steps} steps), gradient clip 1.0, "
        f"{'bf16 autocast' if result['device'] != 'cpu' else 'fp32'} on {result['device']}, "
        f"{result['seconds']:.0f} s; trained in lockstep with "
        f"{', '.join(a.arch)} (same batches, same order)\n"
        f"- final training loss {result['loss']:.4f}\n\n"
        f"## Held-out recall accuracy ({a.eval_size} prompts each)\n\n"
        f"| suite | accuracy |\n|---|---|\n| MQAR | {result['accuracy_single']:.4f} |\n"
        f"| MQAR-twice | {result['accuracy_twice']:.4f} |\n\n"
        f"{d_line}"
        f"\n## Made by\n\n```\n{command}\n```\n"
    )


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory that receives one checkpoint per architecture")
    p.add_argument("--arch", nargs="+", default=["deltanet", "osdn", "osdn-apf"], choices=ARCHS)
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--pairs", type=int, default=32, help="key-value pairs per context (= queries)")
    p.add_argument("--eta", type=float, default=0.5, help="OSDN step size")
    p.add_argument("--d-min", type=float, default=0.5)
    p.add_argument("--d-max", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--time-budget", type=float, default=None, help="stop every model together after this many seconds")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-size", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--log-every", type=int, default=50)
    a = p.parse_args(argv)
    if a.log_every < 1 or a.eval_every < 1:
        p.error("argument --log-every/--eval-every: expected at least 1 (steps between lines, evaluations)")
    command = "python examples/train_mqar.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))

    from osdn_diag.runtime import prepare

    device = prepare(a.device)
    import osdn_diag.models  # noqa: F401  (registers the OSDN configs with transformers)
    from transformers import AutoModelForCausalLM

    from osdn_diag.prompts.mqar import MQARSpec

    spec = MQARSpec(vocab_size=a.vocab, num_pairs=a.pairs, num_queries=a.pairs)
    on_gpu = device.type == "cuda"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_gpu else nullcontext

    models, opts = {}, {}
    for arch in a.arch:
        torch.manual_seed(a.seed)
        models[arch] = AutoModelForCausalLM.from_config(build_config(arch, a)).to(device).train()
        decay = [p_ for n, p_ in models[arch].named_parameters() if p_.dim() >= 2 and "d0" not in n]
        rest = [p_ for n, p_ in models[arch].named_parameters() if not (p_.dim() >= 2 and "d0" not in n)]
        opts[arch] = torch.optim.AdamW(
            [{"params": decay, "weight_decay": a.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=a.lr, betas=(0.9, 0.95),
        )

    def lr_at(step: int) -> float:
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        t = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
        return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    eval_gen = torch.Generator().manual_seed(a.seed + 10_000)
    from osdn_diag.prompts.mqar import mqar_batch

    eval_single = [x.to(device) for x in mqar_batch(spec, a.eval_size, twice=False, generator=eval_gen)]
    eval_twice = [x.to(device) for x in mqar_batch(spec, a.eval_size, twice=True, generator=eval_gen)]

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = {arch: [] for arch in a.arch}
    gen = torch.Generator().manual_seed(a.seed)
    start = time.perf_counter()
    step, loss_val = 0, {}
    bar = tqdm(total=a.steps, desc="train " + "/".join(a.arch), unit="step", disable=None)
    progress = ProgressLines(bar, a.steps, start)  # lines on stderr where the bar is off
    while step < a.steps:
        if a.time_budget is not None and time.perf_counter() - start > a.time_budget:
            progress.stopped(step, a.time_budget)
            break
        ids, labels = mixed_batch(spec, a.batch, gen, device)
        lr = lr_at(step)
        for arch, model in models.items():
            for group in opts[arch].param_groups:
                group["lr"] = lr
            with amp(), kernels(model):
                loss = model(input_ids=ids, labels=labels).loss
            opts[arch].zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opts[arch].step()
            loss_val[arch] = loss.detach()
        step += 1
        bar.update(1)
        if step == 1:
            progress.first_step(on_gpu)
        last = step == a.steps
        logged = None
        if step % a.log_every == 0 or last:
            logged = {}
            for arch in a.arch:
                value = float(loss_val[arch])  # one host sync per log line, not per step
                if not math.isfinite(value):
                    raise FloatingPointError(f"{arch}: non-finite training loss {value} at step {step}")
                logs[arch].append({"step": step, "lr": lr, "loss": value, "seconds": time.perf_counter() - start})
                logged[arch] = value
            bar.set_postfix({arch: f"{float(v):.3f}" for arch, v in loss_val.items()})
        if step % a.eval_every == 0 or last:
            for arch, model in models.items():
                logs[arch].append({"step": step, "accuracy_single": recall(model, *eval_single, amp),
                                   "accuracy_twice": recall(model, *eval_twice, amp)})
        if logged is not None:
            progress.step(step, logged)
    bar.close()
    seconds = time.perf_counter() - start

    results = {}
    for arch, model in models.items():
        model.eval()
        res = {
            "arch": arch, "steps": step, "seconds": seconds, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "loss": float(loss_val[arch]) if loss_val else float("nan"),
            "first_loss": next((r["loss"] for r in logs[arch] if "loss" in r), float("nan")),
            "accuracy_single": recall(model, *eval_single, amp),
            "accuracy_twice": recall(model, *eval_twice, amp),
        }
        if arch.startswith("os"):
            res["d"] = d_statistics(model, eval_twice[0], amp, a.d_min, a.d_max)
        results[arch] = res
        task = {"suite": "mqar", "vocab_size": a.vocab, "num_pairs": a.pairs, "num_queries": a.pairs}
        _save(out / f"mqar-{arch}", model, logs[arch], model_card(arch, model.config, a, res, command), task)
        print(json.dumps(res))
    atomic_write_text(out / "train_summary.json", json.dumps({"command": command, "results": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
