"""Residual contraction across scale: DeltaNet and OSDN trained in lockstep at a chosen size, watched
by osdn_diag.monitor, resumable across commands.

    python examples/scale_study.py prepare --data data/scale
    python examples/scale_study.py train --data data/scale --out runs/scale-512 --preset h512 \\
        --time-budget 540                      # repeat the same command until it prints "done"
    python examples/scale_study.py report runs/scale-256 runs/scale-512 --out runs/report

``prepare`` builds an offline corpus from Python sources already on the machine: the running
interpreter's standard library (PSF License) and the installed packages named by ``--packages``
(default: transformers, sympy, numpy, scipy, networkx, fla — Apache-2.0, BSD, BSD-3-Clause, BSD-3-Clause,
BSD-3-Clause, MIT), each package's ``.py`` files split into train and held-out by the hash of their path
as the built-in corpus is (:func:`osdn_diag.prompts.corpus.split_of`), files whose text repeats an
earlier one dropped. ``corpus.json`` records each source's directory, version, licence as its metadata
states it, file and character counts; a package that is not installed is left out and listed as such.
The tokenizer and files are those of ``examples/train_lm.py prepare`` (byte-level BPE, ``--vocab``
4096). With Python 3.11.7, transformers 5.25.0, sympy 1.14.0, numpy 2.4.6, scipy 1.17.1, networkx 3.6.1
and fla 0.6.0 it read 8,232 train and 439 held-out files (145 M and 8.4 M characters): 45.8 M train
tokens (train.bin 92 MB) and 2.69 M held-out, in about 20 minutes on two busy CPU cores (most of it
the tokenizer's training). ``--tokenizer FILE`` encodes with a ``tokenizer.json`` an earlier
``prepare`` wrote instead of training one — the built-in language models' own,
``osdn_diag/builtin/lm-corpus/``, makes every size share their vocabulary — so that a GPU machine
that cannot receive ``train.bin`` builds the corpus from its own installed sources in the time the
encoding takes (corpus.json records the tokenizer's sha256 and every source's version): with the
built-in one, the same sources gave 51.9 M train and 3.0 M held-out tokens in 195 s on two busy CPU
cores (8.4 GB of memory at its peak).

``train`` trains ``deltanet`` and ``osdn`` at ``--eta`` (the paper's 0.003), plus one OSDN model per
``--sweep`` step size, on the same batches in the same order with the same optimiser and schedule
(train_lm.py's: AdamW, warm-up, cosine; bf16 autocast on a GPU). A preset fixes the size:

    h256   hidden 256,  4 layers,  4 heads, MLP 512   (the built-in lm-* models)
    h512   hidden 512,  8 layers,  8 heads, MLP 1024
    h768  hidden 768, 12 layers, 12 heads, MLP 2048
    h1024  hidden 1024, 12 layers, 16 heads, MLP 2816

(``--hidden/--layers/--heads/--intermediate`` override a preset's fields). Every ``--monitor-every``
steps each model is probed on ``--monitor-windows`` held-out windows (``OUT/monitor.parquet``). Every
``--save-every`` steps, when ``--time-budget`` seconds have passed, and at ``--stop-after`` steps of
this command, the whole state — every model and optimiser, the batch generator, the logs, the monitors'
rows and timings — goes to ``OUT/state.pt`` (written atomically); the same command run again resumes
from it and continues exactly as an uninterrupted run would (the batches, the schedule, the probes).
A resume that reads another corpus or tokenizer is refused, and so is a second command on the same
``OUT`` while one runs (its lock). A killed command loses only the steps since the last save. At the last step it measures each model's held-out perplexity (single and
twice, as train_lm.py), q_geo on the held-out windows as written (*single*) and on the second copy of
each window repeated (*twice*), and writes ``OUT/results.json``:

    {"preset", "config", "seed", "parameters", "tokens", "models": {name: {"heldout_ppl", "heldout_ppl_twice",
     "q_geo_single", "q_geo_twice", "q_arith_single", "d", ...}}, "gap": {"q_geo_single", "q_geo_twice",
     "heldout_ppl"}}      # gap: OSDN at --eta minus DeltaNet

Before its first step ``train`` writes ``OUT/run.json`` (the size, the schedule, each model's step size
and parameters), so that a run stopped before its last step can still be reported (below).

``--device cpu`` runs the loop with the reference recurrences: only for a smoke test at a tiny size.

``report RUN... [--out DIR]`` prints the finished sizes side by side, ordered by parameters: every
model's held-out perplexity (single, twice), q_geo (single, twice) and OSDN's mean d, then the
OSDN − DeltaNet gap by size, at ``--eta`` and at the step size of lowest held-out perplexity among
those trained (*best η*: ``--eta`` and the ``--sweep``); ``--out`` writes that table as ``scale.md`` and
``scale.png`` (q_geo and both gaps against parameters). A size may be named once per ``--seed`` it was
trained from: each run keeps its rows, and the size gets a further row, the gaps' mean over its
finished seeds (a stopped one is probed at an earlier step), which the figure's lines join (each
seed's value drawn beside them). A ``train --out`` without ``results.json`` (stopped by
its budget, or its machine taken back) is reported from ``run.json`` and ``monitor.parquet``: each model's
q_geo and d at the last step every model was probed at, perplexity and *twice* as ``—``, and a line
saying at which step it was last probed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import importlib.util
import json
import math
import re
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from osdn_diag.capture.store import atomic_write_text
from osdn_diag.monitor import Monitor
from osdn_diag.prompts import corpus

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_lm  # noqa: E402
from train_mqar import d_statistics, kernels  # noqa: E402

PRESETS = {
    "h256": dict(hidden=256, layers=4, heads=4, intermediate=512),
    "h512": dict(hidden=512, layers=8, heads=8, intermediate=1024),
    "h768": dict(hidden=768, layers=12, heads=12, intermediate=2048),
    "h1024": dict(hidden=1024, layers=12, heads=16, intermediate=2816),
}
#: import name -> distribution name (for the version and licence in corpus.json).
PACKAGES = {"transformers": "transformers", "sympy": "sympy", "numpy": "numpy", "scipy": "scipy",
            "networkx": "networkx", "fla": "flash-linear-attention"}
STATE = "state.pt"
#: Written by train before its first step: the size, the schedule and the models (see run_description).
RUN = "run.json"


# ----------------------------------------------------------------------------------------------- prepare
def _licence(dist: str) -> str:
    try:
        meta = metadata.metadata(dist)
    except metadata.PackageNotFoundError:
        return "unknown (no distribution metadata)"
    expr = meta.get("License-Expression")
    if expr:
        return expr
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return "; ".join(classifiers)
    first = (meta.get("License") or "").strip().splitlines()
    return first[0][:120] if first else "unknown (not stated in the metadata)"


def prepare(a: argparse.Namespace) -> dict:
    if a.vocab > 32768:
        raise SystemExit(f"argument --vocab: expected at most 32768 (held-out ids are int16), got {a.vocab}")
    docs: dict[str, list[tuple[str, str]]] = {"train": [], "heldout": []}
    seen: set[str] = set()
    sources = []

    def add(name: str, root: Path, licence: str, version: str) -> None:
        found = corpus.stdlib_documents(root)
        counts = {"train": 0, "heldout": 0}
        chars = 0
        for split in ("train", "heldout"):
            for rel, text in found[split]:
                digest = hashlib.sha256(text.encode()).hexdigest()
                if digest in seen or not text.strip():  # vendored and generated copies: once
                    continue
                seen.add(digest)
                docs[split].append((f"{name}/{rel}", text))
                counts[split] += 1
                chars += len(text)
        sources.append({"name": name, "directory": str(root), "version": version, "license": licence,
                        "files": counts, "characters": chars})

    add("stdlib", corpus.stdlib_root(), "PSF License Version 2", sys.version.split()[0])
    missing = []
    for name in a.packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            missing.append(name)
            continue
        dist = PACKAGES.get(name, name)
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "unknown"
        add(name, Path(list(spec.submodule_search_locations)[0]), _licence(dist), version)
    data = Path(a.data)
    info = {"source": "Python source files of the standard library and of installed packages",
            "sources": sources, "not_installed": missing,
            **train_lm.write_corpus(docs, data, a.vocab, a.tokenizer)}
    atomic_write_text(data / "corpus.json", json.dumps(info, indent=2) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k != "tokenizer"}, indent=2))
    return info


# ------------------------------------------------------------------------------------------------- train
def _specs(a) -> list[tuple[str, str, float | None]]:
    specs = [("deltanet", "deltanet", None), (f"osdn-eta{a.eta:g}", "osdn", a.eta)]
    specs += [(f"osdn-eta{e:g}", "osdn", e) for e in a.sweep if e != a.eta]
    return specs


def _size(a) -> dict:
    size = dict(PRESETS[a.preset])
    for key in size:
        if getattr(a, key) is not None:
            size[key] = getattr(a, key)
    return size


def _twice_q(model, windows: torch.Tensor, amp) -> tuple[float, float]:
    """q_geo and q_arith of the writes on the second copy of each window repeated (``[w, w]``), from
    the package's capture and fp32 replay (the replay's rows at positions >= the window's length)."""
    import pyarrow.compute as pc

    import osdn_diag
    from osdn_diag.metrics.ratios import RatioStats

    seq = windows.shape[1]
    was = model.training
    model.eval()
    stats = RatioStats()
    try:
        for chunk in windows.split(4):
            with torch.no_grad(), amp(), osdn_diag.capture(model) as cap:
                model(input_ids=torch.cat([chunk, chunk], dim=1))
            table = osdn_diag.replay(cap, dtype=torch.float32, comparator=False).table
            keep = pc.and_(pc.greater_equal(table["pos"], seq), table["finite"])
            q = table.filter(keep)["residual_ratio"].to_numpy(zero_copy_only=False)
            stats += RatioStats.of(torch.from_numpy(np.asarray(q, dtype=np.float64)))
    finally:
        model.train(was)
    return stats.q_geo, stats.q_arith


def run_description(a: argparse.Namespace, size: dict, specs, models: dict, command: str) -> dict:
    """``OUT/run.json``: ``{"command", "preset", "config", "seed", "seq", "batch", "steps" (the run's last step),
    "models": {name: {"arch", "eta", "parameters"}}}`` — what report needs of a run stopped before its
    last step, beside its ``monitor.parquet``."""
    return {"command": command, "preset": a.preset, "config": size, "seed": a.seed, "seq": a.seq, "batch": a.batch,
            "steps": a.steps,
            "models": {name: {"arch": base, "eta": eta, "parameters": sum(p.numel() for p in models[name].parameters())}
                       for name, base, eta in specs}}


def train(a: argparse.Namespace) -> dict:
    """Train one size in lockstep into ``--out``, holding its lock (train_lm.holding): a second command on
    the same directory is refused at once."""
    train_lm.check_time_budget(a.time_budget)
    with train_lm.holding(Path(a.out)):
        return _train(a)


def _train(a: argparse.Namespace) -> dict:
    command = train_lm.recipe_command(sys.argv[1:], "examples/scale_study.py")
    data = Path(a.data)
    info = corpus.corpus_info(data)
    reads = train_lm.corpus_identity(data, info)
    size = _size(a)
    ns = argparse.Namespace(**{**vars(a), **size, "vocab_size": info["vocab_size"]})
    specs = _specs(a)
    names = [n for n, _, _ in specs]

    from osdn_diag.runtime import prepare as prepare_device

    device = prepare_device(a.device)
    import osdn_diag.models  # noqa: F401

    on_gpu = device.type == "cuda"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_gpu else nullcontext
    stream = torch.from_numpy(np.fromfile(data / "train.bin", dtype="<u2").astype(np.int64))
    windows = train_lm.eval_windows(data, a.seq, a.eval_windows).to(device)

    models, opts = train_lm.build_models(specs, a, ns, device)
    lr_at = train_lm.lr_schedule(a)

    out = Path(a.out)
    # what the run is, before its first step: report reads an unfinished run from it and monitor.parquet
    described = run_description(a, size, specs, models, command)
    atomic_write_text(out / RUN, json.dumps(described, indent=2) + "\n")
    gen = torch.Generator().manual_seed(a.seed)
    step, elapsed, logs = 0, 0.0, {n: [] for n in names}
    state_path = out / STATE
    state = None
    if state_path.exists():
        # onto the CPU: the batch generator's state must be a CPU tensor (load_state_dict moves the
        # models' and optimisers' tensors to their parameters' device)
        state = torch.load(state_path, map_location="cpu", weights_only=True)
        if state["names"] != names or state["size"] != size or state["steps"] != a.steps:
            raise SystemExit(f"{state_path}: saved by a run of other models, size or --steps "
                             f"({state['names']}, {state['size']}, {state['steps']} steps); choose another --out")
        train_lm.check_reads(state_path, state, reads, data)
        for n in names:
            models[n].load_state_dict(state["models"][n])
            opts[n].load_state_dict(state["optimizers"][n])
        gen.set_state(state["generator"])
        step, elapsed, logs = state["step"], state["elapsed"], state["logs"]
        print(f"[scale] resumed {out} at step {step} of {a.steps}", file=sys.stderr)
    monitors = {n: Monitor(m, windows[:a.monitor_windows], every=a.monitor_every, out=out / "monitor.parquet",
                           name=n, autocast=torch.bfloat16 if on_gpu else None)
                for n, m in models.items()} if a.monitor_every else {}
    for n, mon in monitors.items():  # their rows and probe timings so far: results.json's share covers every command
        if state is not None and n in state.get("monitors", {}):
            mon.restore(state["monitors"][n])

    def save() -> None:
        train_lm.save_training_state(state_path, {
            "names": names, "size": size, "steps": a.steps, "reads": reads, "step": step,
            "elapsed": elapsed + time.perf_counter() - start, "logs": logs, "generator": gen.get_state(),
            "monitors": {n: m.state() for n, m in monitors.items()},
            "models": {n: m.state_dict() for n, m in models.items()},
            "optimizers": {n: o.state_dict() for n, o in opts.items()},
        })

    start = time.perf_counter()
    done_here = 0
    loss = {}
    if step < a.steps:  # the first step may take minutes with nothing else printed until --log-every
        print(f"[scale] {len(models)} models from step {step} of {a.steps}"
              + ("; the first step compiles fla's kernels (minutes on a fresh machine)" if on_gpu else ""),
              file=sys.stderr)
    while step < a.steps:
        starts = torch.randint(0, len(stream) - a.seq - 1, (a.batch,), generator=gen)
        batch = torch.stack([stream[s:s + a.seq] for s in starts.tolist()]).to(device)
        lr = lr_at(step)
        for n, model in models.items():
            for group in opts[n].param_groups:
                group["lr"] = lr
            with amp(), kernels(model):
                out_loss = model(input_ids=batch, labels=batch).loss
            opts[n].zero_grad(set_to_none=True)
            out_loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opts[n].step()
            loss[n] = out_loss.detach()
        step += 1
        done_here += 1
        if done_here == 1:
            if on_gpu:  # once: the figure is the step's, not its launches'
                torch.cuda.synchronize()
            print(f"[scale] step {step}/{a.steps} took {time.perf_counter() - start:.1f} s", file=sys.stderr)
        for mon in monitors.values():
            if mon.step(step) is None and step == a.steps:
                mon.probe(step)
        if step % a.log_every == 0 or step == a.steps:
            now = elapsed + time.perf_counter() - start
            for n in names:
                value = float(loss[n])
                if not math.isfinite(value):
                    raise FloatingPointError(f"{n}: non-finite training loss {value} at step {step}")
                logs[n].append({"step": step, "lr": lr, "loss": value, "seconds": now})
            rate = (time.perf_counter() - start) / done_here
            print(f"[scale] step {step}/{a.steps}: " + ", ".join(f"{n} {float(v):.3f}" for n, v in loss.items())
                  + f"; {rate:.3f} s/step, about {rate * (a.steps - step) / 60:.1f} min to go", file=sys.stderr)
        if step == a.steps:
            break
        over = a.time_budget is not None and time.perf_counter() - start > a.time_budget
        stop = a.stop_after is not None and done_here >= a.stop_after
        if over or stop or (a.save_every and step % a.save_every == 0):
            save()
        if over or stop:
            print(f"[scale] saved at step {step} of {a.steps}; run the same command again to go on",
                  file=sys.stderr)
            return {"step": step, "done": False}
    save()
    seconds = elapsed + time.perf_counter() - start

    results = {}
    for (name, base, eta), model in zip(specs, models.values()):
        single, twice = train_lm.heldout_nll(model, windows, amp)
        q_twice, qa_twice = _twice_q(model, windows[:a.monitor_windows], amp)
        whole = [r for r in (monitors[name].rows if monitors else []) if r["layer"] == -1 and r["step"] == step]
        if not whole:  # no monitor on this run: measure the single copy here
            probe = Monitor(model, windows[:a.monitor_windows], name=name, autocast=torch.bfloat16 if on_gpu else None)
            whole = [r for r in probe.probe(step) if r["layer"] == -1]
        res = {"arch": base, "eta": eta, "parameters": described["models"][name]["parameters"],
               "loss": float(loss[name]) if loss else logs[name][-1]["loss"],
               "heldout_nll": single, "heldout_nll_twice": twice,
               "heldout_ppl": math.exp(single), "heldout_ppl_twice": math.exp(twice),
               "q_geo_single": whole[0]["q_geo"], "q_arith_single": whole[0]["q_arith"],
               "q_geo_twice": q_twice, "q_arith_twice": qa_twice}
        if base == "osdn":
            res["d"] = d_statistics(model, windows[:8], amp, a.d_min, a.d_max)
        if monitors:
            res["monitor"] = monitors[name].overhead(seconds)
        results[name] = res
    paper = results[f"osdn-eta{a.eta:g}"]
    delta = results["deltanet"]
    summary = {
        "command": command, "preset": a.preset, "config": size, "seed": a.seed, "seq": a.seq, "batch": a.batch,
        "steps": step,
        "tokens": step * a.batch * a.seq, "seconds": seconds,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu", "corpus": {
            k: info[k] for k in ("sources", "train_tokens", "heldout_tokens", "vocab_size") if k in info},
        "models": results,
        "gap": {"q_geo_single": paper["q_geo_single"] - delta["q_geo_single"],
                "q_geo_twice": paper["q_geo_twice"] - delta["q_geo_twice"],
                "heldout_ppl": paper["heldout_ppl"] - delta["heldout_ppl"]},
    }
    atomic_write_text(out / "results.json", json.dumps(summary, indent=2) + "\n")
    for n, r in results.items():
        print(f"[scale] {n}: {r['parameters'] / 1e6:.1f} M parameters, held-out perplexity {r['heldout_ppl']:.3f} "
              f"(twice {r['heldout_ppl_twice']:.3f}), q_geo {r['q_geo_single']:.4f} (twice {r['q_geo_twice']:.4f})")
    print(f"[scale] done: {out / 'results.json'}")
    return {"step": step, "done": True, **summary}


# ------------------------------------------------------------------------------------------------ report
def _read_json(f: Path) -> dict:
    def refuse(constant):
        raise SystemExit(f"{f}: holds {constant}, which is not JSON")

    try:
        return json.loads(f.read_text(), parse_constant=refuse)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{f}: not readable as JSON ({exc})") from None


def _results(path: str) -> tuple[Path, dict]:
    """One ``results.json`` (or the ``train --out`` directory holding it), read strictly; for a directory
    without one, the unfinished run's :func:`_unfinished` results."""
    f = Path(path)
    if f.is_dir() and not (f / "results.json").exists() and (f / RUN).is_file():
        return f / RUN, _unfinished(f)
    f = f / "results.json" if f.is_dir() else f
    if not f.is_file():
        raise SystemExit(f"{path}: no results.json (a run not yet finished, or not a scale_study.py train --out)")
    res = _read_json(f)
    if not {"models", "gap", "config", "tokens"} <= set(res) or "deltanet" not in res["models"]:
        raise SystemExit(f"{f}: not a scale_study.py results.json (expected models with deltanet, gap, config, tokens)")
    _check_seed(f, res)
    return f, res


def _check_seed(f: Path, res: dict) -> None:
    """Refuse a ``"seed"`` that is not an integer (a hand-edited file), naming the file."""
    seed = res.get("seed")
    # bool is an int to Python; "1" or 1.5 is not what train writes.
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise SystemExit(f"{f}: \"seed\" is {seed!r}, not an integer (only scale_study.py train writes this file: "
                         "restore it or train again)")


def _unfinished(out: Path) -> dict:
    """A run stopped before its last step (its state.pt, or a machine taken back), as results: each model's
    q_geo on the held-out windows (*single*) and the preconditioner's mean d at the last step every model
    was probed at (``monitor.parquet``, whole-model rows), its size and parameters from ``run.json``;
    perplexity and the *twice* measures, taken only at the last step, are absent (None). ``"stopped"``
    is that step; ``"tokens"`` those seen by then."""
    import pyarrow.parquet as pq

    run = _read_json(out / RUN)
    if not {"preset", "config", "seq", "batch", "steps", "models"} <= set(run) or "deltanet" not in run["models"]:
        raise SystemExit(f"{out / RUN}: not a scale_study.py run.json (expected preset, config, seq, batch, steps "
                         "and models with deltanet)")
    _check_seed(out / RUN, run)
    if not (out / "monitor.parquet").is_file():
        raise SystemExit(f"{out}: an unfinished run without monitor.parquet: nothing measured to report")
    rows = [r for r in pq.read_table(out / "monitor.parquet").to_pylist() if r["layer"] == -1]
    steps = [{r["step"] for r in rows if r["model"] == n} for n in run["models"]]
    common = set.intersection(*steps) if steps else set()
    if not common:
        raise SystemExit(f"{out}: its monitor has no step at which every model ({', '.join(run['models'])}) was probed")
    step = max(common)
    at = {r["model"]: r for r in rows if r["step"] == step}
    models = {}
    for name, m in run["models"].items():
        r = at[name]
        models[name] = {**m, "heldout_ppl": None, "heldout_ppl_twice": None, "q_geo_single": r["q_geo"],
                        "q_arith_single": r["q_arith"], "q_geo_twice": None, "q_arith_twice": None,
                        **({"d": {"mean": r["d_mean"]}} if r.get("d_mean") is not None else {})}
    paper = next(n for n, m in run["models"].items() if m["arch"] == "osdn")  # the first OSDN: --eta
    return {"preset": run["preset"], "config": run["config"], "seed": seed_of(run), "steps": step, "stopped": step,
            "of": run["steps"],
            "tokens": step * run["batch"] * run["seq"], "models": models,
            "gap": {"q_geo_single": models[paper]["q_geo_single"] - models["deltanet"]["q_geo_single"],
                    "q_geo_twice": None, "heldout_ppl": None}}


def seed_of(res: dict) -> int:
    """The seed a run was trained from: its ``"seed"``, or for a run written before that field, the
    ``--seed`` of its recorded command (0, the default, when absent)."""
    if res.get("seed") is not None:
        return int(res["seed"])
    found = re.search(r"--seed[ =](\d+)", res.get("command", ""))
    return int(found.group(1)) if found else 0


def _size_label(res: dict) -> str:
    c = res["config"]
    return f"{res.get('preset', '?')} ({c['hidden']}×{c['layers']})"


def _label(res: dict) -> str:
    return f"{_size_label(res)}, seed {seed_of(res)}"


def best_osdn(res: dict) -> tuple[str, dict] | None:
    """The OSDN model of ``res`` with the lowest held-out perplexity (single) among the step sizes trained —
    the paper's ``--eta`` and every ``--sweep`` entry; the first named wins a tie. Returns (name, model),
    or None for a run stopped before its perplexities were measured."""
    osdn = [(n, m) for n, m in res["models"].items() if m.get("arch") == "osdn"]
    if not osdn:
        raise SystemExit(f"{_label(res)}: no OSDN model in its results.json")
    if any(m["heldout_ppl"] is None for _, m in osdn):
        return None
    return min(osdn, key=lambda nm: nm[1]["heldout_ppl"])


def _num(x: float | None, fmt: str) -> str:
    """A table cell: the number, or ``—`` where it was not measured."""
    return "—" if x is None else format(x, fmt)


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _eta(name: str, m: dict) -> str:
    return format(m["eta"], "g") if m.get("eta") is not None else name.removeprefix("osdn-eta")


def _mean(values: list[float | None]) -> float | None:
    """The mean of what was measured in every run, or None where any run did not measure it."""
    return None if not values or any(v is None for v in values) else sum(values) / len(values)


def by_size(runs: list[dict]) -> list[list[dict]]:
    """The runs grouped by size (their ``config``), in the order of their first appearance; within a
    size, by seed."""
    groups: dict[str, list[dict]] = {}
    for res in runs:
        groups.setdefault(json.dumps(res["config"], sort_keys=True), []).append(res)
    return [sorted(g, key=seed_of) for g in groups.values()]


def counted(group: list[dict]) -> list[bool]:
    """Whether each run of one size is among those its mean is taken over: the finished ones, or all of
    them where none finished (a run stopped early is probed at an earlier step: averaging it with
    finished runs would mix steps)."""
    finished = ["stopped" not in res for res in group]
    return finished if any(finished) else [True] * len(group)


def gaps(res: dict) -> dict:
    """One run's OSDN − DeltaNet differences: at the paper's step size (``q_geo_single``, ``q_geo_twice``,
    ``heldout_ppl``, from results.json's ``gap``) and at its best η (``best_*``, with ``best_eta``; None
    for a run stopped before its perplexities)."""
    delta, chosen = res["models"]["deltanet"], best_osdn(res)
    out = {k: res["gap"][k] for k in ("q_geo_single", "q_geo_twice", "heldout_ppl")}
    out["best_eta"] = _eta(*chosen) if chosen else None
    for k in ("q_geo_single", "q_geo_twice", "heldout_ppl"):
        out[f"best_{k}"] = _minus(chosen[1][k], delta[k]) if chosen else None
    return out


def _gap_row(label: str, params: float, g: dict) -> str:
    return (f"| {label} | {params / 1e6:.1f} M | {_num(g['q_geo_single'], '+.4f')} | {_num(g['q_geo_twice'], '+.4f')} "
            f"| {_num(g['heldout_ppl'], '+.3f')} | {g['best_eta'] or '—'} | {_num(g['best_q_geo_single'], '+.4f')} "
            f"| {_num(g['best_q_geo_twice'], '+.4f')} | {_num(g['best_heldout_ppl'], '+.3f')} |")


def report_table(runs: list[dict]) -> str:
    """The runs' results as two markdown tables: every model (held-out perplexity single and twice,
    q_geo single and twice, OSDN's mean d) and the OSDN − DeltaNet gap by run, at the paper's step size
    (``gap`` in results.json) and at the step size of lowest held-out perplexity (:func:`best_osdn`);
    a size with several runs that :func:`counted` keeps gets a further row, the mean over those seeds
    (its best η column lists each seed's). Rows by parameters, then seed."""
    lines = ["| size | parameters | tokens | model | perplexity | perplexity twice | q_geo single | q_geo twice "
             "| d mean |", "|---|---|---|---|---|---|---|---|---|"]
    for res in runs:
        for name, m in res["models"].items():
            d = m.get("d") or {}
            lines.append(f"| {_label(res)} | {m['parameters'] / 1e6:.1f} M | {res['tokens'] / 1e6:.1f} M | {name} "
                         f"| {_num(m['heldout_ppl'], '.3f')} | {_num(m['heldout_ppl_twice'], '.3f')} "
                         f"| {m['q_geo_single']:.4f} | {_num(m['q_geo_twice'], '.4f')} "
                         f"| {'' if 'mean' not in d else format(d['mean'], '.4f')} |")
    lines += ["", "| size | parameters | OSDN − DeltaNet q_geo single | q_geo twice | perplexity "
              "| best η | best − DeltaNet q_geo single | q_geo twice | perplexity |",
              "|---|---|---|---|---|---|---|---|---|"]
    for group in by_size(runs):
        params = group[0]["models"]["deltanet"]["parameters"]
        each = [gaps(res) for res in group]
        for res, g in zip(group, each):
            lines.append(_gap_row(_label(res), res["models"]["deltanet"]["parameters"], g))
        used = [g for g, c in zip(each, counted(group)) if c]
        if len(used) > 1:
            mean = {k: _mean([g[k] for g in used]) for k in used[0] if k != "best_eta"}
            etas = [g["best_eta"] for g in used]
            mean["best_eta"] = None if None in etas else "/".join(etas)
            lines.append(_gap_row(f"{_size_label(group[0])}, mean of {len(used)} seeds", params, mean))
    notes = [f"{_label(res)}: unfinished (no results.json); q_geo single and d from its monitor's probe at step "
             f"{res['stopped']} of {res['of']}; perplexity, twice and best η not measured" for res in runs if "stopped" in res]
    return "\n".join(lines) + "\n" + "".join(f"\n{n}\n" for n in notes)


#: How report_figure draws each measure: single as written (solid, dots), twice (dashed, squares).
LINES = (("q_geo_single", "-", "o"), ("q_geo_twice", "--", "s"))


def report_figure(runs: list[dict]):
    """q_geo (single: solid, dots; twice: dashed, squares) of every model name against DeltaNet's parameter
    count, and the OSDN − DeltaNet gap beside it (black: the paper's step size; red: the best η of each
    run); the lines join each size's mean over its :func:`counted` seeds, and a size with several seeds
    shows each seed's value as a small unjoined marker. Returns the matplotlib figure."""
    from osdn_diag.report.plots import _figure

    fig = _figure((11, 4.0), layout="constrained")
    ax, gap = fig.subplots(1, 2)
    groups = by_size(runs)
    x = [g[0]["models"]["deltanet"]["parameters"] for g in groups]
    names = list(dict.fromkeys(n for res in runs for n in res["models"]))

    def draw(axis, values, style: str, marker: str, **kw) -> None:
        """One line through the sizes' means over their :func:`counted` runs (what a run did not measure
        is left out), with each run's value beside it where a size has several. ``values``: per size,
        ``(value, counted)`` per run."""
        means = [_mean([y for y, c in v if c]) for v in values]
        got = [(p, m) for p, m in zip(x, means) if m is not None]
        axis.plot([p for p, _ in got], [m for _, m in got], style, marker=marker, **kw)
        seeds = [(p, y) for p, v in zip(x, values) if len(v) > 1 for y, _ in v if y is not None]
        if seeds:
            axis.plot([p for p, _ in seeds], [y for _, y in seeds], linestyle="none", marker=marker, ms=3,
                      alpha=0.5, color=kw["color"])

    used = [counted(g) for g in groups]
    for i, name in enumerate(names):
        for key, style, marker in LINES:
            draw(ax, [[(res["models"][name][key], c) for res, c in zip(g, u) if name in res["models"]]
                      for g, u in zip(groups, used)],
                 style, marker, color=f"C{i}", label=f"{name}, {key.split('_')[-1]}")
    each = [[gaps(res) for res in g] for g in groups]
    for key, style, marker in LINES:
        draw(gap, [[(g[key], c) for g, c in zip(e, u)] for e, u in zip(each, used)], style, marker, color="k",
             label=key.split("_")[-1])
    for key, style, marker in LINES:  # the step size of lowest held-out perplexity in each run
        draw(gap, [[(g[f"best_{key}"], c) for g, c in zip(e, u) if g["best_eta"] is not None]
                   for e, u in zip(each, used)], style, marker, color="C3", alpha=0.8,
             label=f"{key.split('_')[-1]}, best η")
    for res in runs:  # a stopped run's point says how far it got
        if "stopped" in res:
            gap.annotate(f"step {res['stopped']} of {res['of']}",
                         (res["models"]["deltanet"]["parameters"], res["gap"]["q_geo_single"]), fontsize=7,
                         textcoords="offset points", xytext=(-4, 6), ha="right")
    gap.axhline(0.0, color="0.6", lw=0.8)
    for a, title in ((ax, "$q_{geo}$ by model size"), (gap, "OSDN − DeltaNet $q_{geo}$")):
        a.set_xscale("log")
        a.set_xlabel("parameters (DeltaNet)")
        a.set_title(title)
        a.legend(fontsize=7)
    ax.set_ylabel("$q_{geo}$ (held-out)")
    return fig


def report(a: argparse.Namespace) -> str:
    """The finished runs named, side by side: ``--out`` gets ``scale.md`` (the tables) and ``scale.png``."""
    read = [_results(r) for r in a.runs]
    seen: dict[str, Path] = {}
    for f, res in read:
        key = json.dumps([res["config"], seed_of(res)], sort_keys=True)
        if key in seen:
            raise SystemExit(f"{f}: the same size and seed as {seen[key]}; name each run once")
        seen[key] = f
    runs = sorted((res for _, res in read), key=lambda res: (res["models"]["deltanet"]["parameters"], seed_of(res)))
    table = report_table(runs)
    print(table, end="")
    if a.out:
        from osdn_diag.report.plots import save_as

        out = Path(a.out)
        atomic_write_text(out / "scale.md", table)
        save_as(report_figure(runs), out / "scale.png")
        print(f"[scale] wrote {out / 'scale.md'} and {out / 'scale.png'}", file=sys.stderr)
    return table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="build the offline corpus, tokenizer and token files")
    pp.add_argument("--data", required=True)
    pp.add_argument("--vocab", type=int, default=4096)
    pp.add_argument("--packages", nargs="*", default=list(PACKAGES),
                    help="installed packages whose .py files join the standard library's")
    pp.add_argument("--tokenizer", default=None, metavar="FILE",
                    help="encode with this tokenizer.json (or a directory holding one) that an earlier prepare "
                         "wrote, e.g. osdn_diag/builtin/lm-corpus/, instead of training one (--vocab is then unused)")
    pt = sub.add_parser("train", help="train DeltaNet and OSDN in lockstep (resumable)")
    pt.add_argument("--data", required=True)
    pt.add_argument("--out", required=True)
    pt.add_argument("--preset", choices=sorted(PRESETS), default="h256")
    for key in ("hidden", "layers", "heads", "intermediate"):
        pt.add_argument(f"--{key}", type=int, default=None, help="overrides the preset's")
    pt.add_argument("--eta", type=float, default=0.003, help="OSDN step size (paper: 0.003)")
    pt.add_argument("--sweep", type=float, nargs="*", default=[], help="more OSDN step sizes, in lockstep")
    pt.add_argument("--device", default=None)
    pt.add_argument("--d-min", type=float, default=0.5)
    pt.add_argument("--d-max", type=float, default=2.0)
    pt.add_argument("--seq", type=int, default=512)
    pt.add_argument("--batch", type=int, default=32)
    pt.add_argument("--steps", type=int, default=3000)
    pt.add_argument("--lr", type=float, default=3e-3)
    pt.add_argument("--weight-decay", type=float, default=0.1)
    pt.add_argument("--warmup", type=int, default=100)
    pt.add_argument("--min-lr-ratio", type=float, default=0.1)
    pt.add_argument("--seed", type=int, default=0)
    pt.add_argument("--eval-windows", type=int, default=32)
    pt.add_argument("--monitor-every", type=int, default=100, help="probe every N steps (0: off)")
    pt.add_argument("--monitor-windows", type=int, default=4)
    pt.add_argument("--log-every", type=int, default=50)
    pt.add_argument("--save-every", type=int, default=500, help="save the state every N steps (0: only on stop)")
    pt.add_argument("--time-budget", type=float, default=None,
                    help="seconds of training in this command; then save and stop")
    pt.add_argument("--stop-after", type=int, default=None, help="steps in this command; then save and stop")
    pr = sub.add_parser("report", help="the finished sizes side by side: a table, and a plot with --out")
    pr.add_argument("runs", nargs="+", help="train --out directories (or their results.json)")
    pr.add_argument("--out", default=None, help="write scale.md and scale.png here")
    a = p.parse_args(argv)
    if a.command == "train" and (a.steps < 1 or a.monitor_every < 0 or a.monitor_windows < 1):
        p.error("expected --steps >= 1, --monitor-every >= 0 and --monitor-windows >= 1")
    return {"prepare": prepare, "train": train, "report": report}[a.command](a)


if __name__ == "__main__":
    main()
