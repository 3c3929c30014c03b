"""What a notebook pays: the same diagnostic from Python twice in one process. The first pays the
imports, the model's loading and Triton's compilation (or its interpreter's set-up); the second
should cost only the diagnostic itself (capture, replay, summary).

    python benchmarks/bench_notebook.py [--model random:deltanet-340m] [--prompts 8] [--T 2048] [--batch 8]

Prints each phase's wall time (imports, load, first diagnostic, second, third) and the second's
ratio to the first, measured in this one process.
"""

from __future__ import annotations

import argparse
import json
import time

T0 = time.perf_counter()


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: random:deltanet-340m on a GPU, builtin:lm-deltanet on a CPU")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--json")
    a = p.parse_args(argv)

    t = time.perf_counter()
    import torch

    import osdn_diag
    import osdn_diag.models
    from osdn_diag.models import load_model

    times = {"imports": time.perf_counter() - t}
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    model_spec = a.model or ("random:deltanet-340m" if gpu else "builtin:lm-deltanet")
    t = time.perf_counter()
    loaded = load_model(model_spec, device=device, dtype=torch.bfloat16 if gpu else torch.float32)
    _sync()
    times["load"] = time.perf_counter() - t
    model = loaded.model
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (a.prompts, a.T), generator=torch.Generator().manual_seed(0)).to(device)

    def diagnostic():
        with torch.no_grad(), osdn_diag.capture(model) as cap:
            for i in range(0, a.prompts, a.batch):
                model(ids[i:i + a.batch])
        res = osdn_diag.replay(cap, comparator=False)
        _sync()
        return res

    q = []
    for name in ("first", "second", "third"):
        t = time.perf_counter()
        res = diagnostic()
        times[name] = time.perf_counter() - t
        q.append(res.summary["q_geo"])
    assert q[0] == q[1] == q[2], q  # deterministic: the same numbers each time
    n = res.table.num_rows
    print(f"{model_spec} on {device}: {a.prompts} prompts x {a.T} tokens, batch {a.batch}: {n:,} measurements, "
          f"q_geo {q[0]:.4f}")
    for name, s in times.items():
        print(f"  {name:8s} {s:8.2f} s")
    print(f"second diagnostic / first: {times['second'] / times['first']:.2f}; "
          f"third / first: {times['third'] / times['first']:.2f}; the process: {time.perf_counter() - T0:.2f} s")
    out = {"model": model_spec, "device": device, "measurements": n, "seconds": times, "q_geo": q[0]}
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
