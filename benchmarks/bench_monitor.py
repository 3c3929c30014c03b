"""What ``osdn_diag.monitor`` costs a training run: the built-in language-model recipe trained with and
without the monitor, in one process, from the same initial weights on the same batches.

    python benchmarks/bench_monitor.py [--arch deltanet osdn] [--steps 300] [--every 100] [--json FILE]

The recipe is ``examples/train_lm.py``'s (hidden 256, 4 layers, 4 heads, MLP 512, vocabulary 4096,
batch 32 × 512 tokens, AdamW, bf16 autocast on a GPU); the batches are uniform random token ids, since
only time is measured. For each architecture: ``--warmup`` steps and one probe first (fla's kernels and
the capture's compile here, not in the timed part), then the timed passes in the order baseline,
monitored, baseline — each from the same weights and optimiser state, so the two baselines bracket the
monitored pass and their spread is the noise floor. The monitor probes ``--windows`` windows every
``--every`` steps, as train_lm.py's ``--monitor-every`` does. Printed per architecture: seconds per
step without and with the monitor, the overhead ``monitored / mean(baselines) − 1`` (target ≤ 2 % at
every = 100), and the monitor's own account of its probes' share (:meth:`Monitor.overhead`).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def _recipe(a) -> argparse.Namespace:
    return argparse.Namespace(hidden=256, layers=4, heads=4, intermediate=512, vocab_size=4096, seq=a.seq,
                              d_min=0.5, d_max=2.0, seed=0, lr=3e-3, weight_decay=0.1)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _train(model, opt, batches, amp, device, monitor=None) -> float:
    """Train on ``batches`` (a list of [B, T] id tensors); wall seconds, the GPU synchronised."""
    from train_mqar import kernels

    _sync(device)
    start = time.perf_counter()
    for step, ids in enumerate(batches, 1):
        with amp(), kernels(model):  # on a CPU the reference recurrences (train_lm.py's choice)
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if monitor is not None:
            monitor.step(step)
    _sync(device)
    return time.perf_counter() - start


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", default=["deltanet", "osdn"], choices=["deltanet", "osdn", "osdn-apf"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--device", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    import train_lm

    from osdn_diag.monitor import Monitor
    from osdn_diag.runtime import prepare

    device = prepare(a.device)
    on_gpu = device.type == "cuda"
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_gpu else nullcontext
    recipe = _recipe(a)
    gen = torch.Generator().manual_seed(1)
    draw = lambda n: [torch.randint(0, recipe.vocab_size, (a.batch, a.seq), generator=gen).to(device)  # noqa: E731
                      for _ in range(n)]
    warm, timed = draw(a.warmup), draw(a.steps)
    probe = torch.randint(0, recipe.vocab_size, (a.windows, a.seq), generator=gen).to(device)
    results = {}
    for arch in a.arch:
        eta = 0.003 if arch.startswith("osdn") else None
        models, opts = train_lm.build_models([(arch, arch, eta)], recipe, recipe, device)
        model, opt = models[arch], opts[arch]
        _train(model, opt, warm, amp, device)
        Monitor(model, probe, every=1, autocast=torch.bfloat16 if on_gpu else None).probe(0)  # compile
        start_model, start_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())

        def fresh():
            model.load_state_dict(start_model)
            opt.load_state_dict(start_opt)

        fresh()
        base_1 = _train(model, opt, timed, amp, device)
        fresh()
        mon = Monitor(model, probe, every=a.every, autocast=torch.bfloat16 if on_gpu else None)
        monitored = _train(model, opt, timed, amp, device, monitor=mon)
        own = mon.overhead(monitored)
        fresh()
        base_2 = _train(model, opt, timed, amp, device)
        base = (base_1 + base_2) / 2
        results[arch] = {
            "baseline_s_per_step": [base_1 / a.steps, base_2 / a.steps],
            "monitored_s_per_step": monitored / a.steps, "overhead": monitored / base - 1,
            "baseline_spread": abs(base_1 - base_2) / base, "probes": own["probes"],
            "probe_seconds": own["probe_seconds"], "probe_share": own["fraction"],
        }
        r = results[arch]
        print(f"[bench_monitor] {arch}: {a.steps} steps, every {a.every}: baseline {base_1 / a.steps * 1e3:.1f} / "
              f"{base_2 / a.steps * 1e3:.1f} ms/step, monitored {r['monitored_s_per_step'] * 1e3:.1f} ms/step; "
              f"overhead {r['overhead']:+.2%} (baselines differ by {r['baseline_spread']:.2%}); "
              f"{r['probes']} probes, {r['probe_seconds']:.3f} s = {r['probe_share']:.2%} of the monitored pass",
              flush=True)
        del models, opts, model, opt
    record = {"device": torch.cuda.get_device_name() if on_gpu else "cpu", "steps": a.steps, "every": a.every,
              "batch": a.batch, "seq": a.seq, "windows": a.windows, "results": results}
    if a.json:
        Path(a.json).write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    main()
