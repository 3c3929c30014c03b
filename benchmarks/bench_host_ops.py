"""Host work around the replay kernel: the torch operations that ``Replayer.add`` issues per call,
where they come from, and the host microseconds they take (CPU only; no GPU needed).

    python benchmarks/bench_host_ops.py [--B 8 --T 8 --H 8 --K 16 --V 16] [--dtype bfloat16]
        [--precond] [--gated] [--varlen] [--repeats 200] [--sites 25] [--baseline FILE] [--json FILE]

On a GPU every operation costs ~10–25 µs of host dispatch whatever its size, so per call the host work
is roughly (operations × that) and, at small and medium shapes, sets the pace of a replay. This script
builds a captured call of a DeltaNet-like layer on the CPU (``o`` and the final state by the package's
reference recurrence, so the fidelity checks pass), replaces the recurrence (``triton_replay`` and
``delta_rule_recurrence``) by its precomputed result so that only the surrounding host work runs, and
measures, for the configurations below, the aten operations dispatched per call (a
``TorchDispatchMode``; the sites with the most operations are listed with ``--sites``) and the median
host microseconds per call (the default shape is small, so that on the CPU the arithmetic is negligible
and dispatch dominates; the counts do not depend on ``T``, ``K`` or ``V``):

* ``replay_call`` — :func:`osdn_diag.replay.call.replay_call` alone (backend ``triton``, as on a GPU);
* ``add (comparator off)`` — ``Replayer.add`` without the comparator;
* ``add (run --stream)`` — ``Replayer.add(table=False)`` with the comparator on, as
  :func:`osdn_diag.pipeline.stream_run` and :func:`osdn_diag.pipeline.replay_run` use it.

``--baseline FILE`` (an earlier ``--json`` result) adds the ratios against it. On the CPU a ``.cpu()``
is free where on a GPU it is a copy; the counts are otherwise the GPU's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import time
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _common import write_json

import osdn_diag
from osdn_diag.capture.record import KernelCall
from osdn_diag.capture.store import StoredCall
from osdn_diag.math.recurrence import delta_rule_recurrence
from osdn_diag.replay import call as call_module
from osdn_diag.replay.call import recurrence_inputs, replay_call
from osdn_diag.replay.replayer import Replayer

_PACKAGE = os.path.dirname(os.path.abspath(osdn_diag.__file__))


def make_call(B: int = 8, T: int = 8, H: int = 8, K: int = 16, V: int = 16, *, dtype: str = "float32",
              precond: bool = False, gated: bool = False, varlen: bool = False, seed: int = 0,
              layer: int = 0) -> KernelCall:
    """A captured call of a DeltaNet-like layer (``precond``: an OSDN one, with ``d``; ``gated``: a head
    gate), inputs rounded to ``dtype`` and stored in fp32 as capture stores them, ``o`` and
    ``final_state`` from the reference recurrence in fp32. ``varlen`` packs ``B`` sequences of unequal
    lengths (total ``B·T``) into one row with ``cu_seqlens``."""
    g = torch.Generator().manual_seed(seed)
    rows, length = (1, B * T) if varlen else (B, T)
    rd = lambda x: x.to(getattr(torch, dtype)).float()  # noqa: E731  (the model's rounding)
    q = rd(torch.nn.functional.normalize(torch.randn(rows, length, H, K, generator=g), dim=-1))
    k = rd(torch.nn.functional.normalize(torch.randn(rows, length, H, K, generator=g), dim=-1))
    v = rd(torch.randn(rows, length, H, V, generator=g))
    beta = rd(torch.rand(rows, length, H, generator=g))
    d = rd(0.5 + 1.5 * torch.rand(rows, length, H, K, generator=g)) if precond else None
    gate = rd(-0.1 * torch.rand(rows, length, H, generator=g)) if gated else None
    cu = None
    if varlen:  # B sequences of unequal lengths, T on average
        cuts = sorted(torch.randperm(B * T - 1, generator=g)[:B - 1].add(1).tolist())
        cu = torch.tensor([0, *cuts, B * T], dtype=torch.long)
    res = delta_rule_recurrence(q, k, v, beta, write_key=None if d is None else d * k, g=gate,
                                scale=K**-0.5, cu_seqlens=cu, dtype=torch.float32)
    family = ("osgdn" if gated else "osdn") if precond else ("gated_delta_rule" if gated else "delta_rule")
    return KernelCall(
        layer=layer, layer_name=f"layers.{layer}.attn", family=family, kernel=f"chunk_{family}",
        q=q, k=k, v=v, beta=beta, g=gate, d=d, o=rd(res.o), scale=K**-0.5, final_state=res.final_state,
        cu_seqlens=cu, input_dtype=dtype,
        flags={"kernels": "fla", "path": "fused_recurrent", "device": "cpu", "qk_read_as": dtype},
    )


def prompts_of(n: int) -> dict[int, dict]:
    """The prompt entries ``Replayer`` reads (task, length, repeat start) for prompts ``0..n−1``."""
    return {i: {"task": ("copy", "recall")[i % 2], "length": 64, "repeat_start": 32 if i % 2 else -1}
            for i in range(n)}


@contextlib.contextmanager
def recurrence_replaced(call: KernelCall, dtype: torch.dtype = torch.float32):
    """Within the block, the replay's recurrence (``triton_replay`` and ``delta_rule_recurrence`` as
    :mod:`osdn_diag.replay.call` calls them) returns the result computed here once for ``call``:
    only the host work around the kernel runs (and is counted)."""
    res = delta_rule_recurrence(**recurrence_inputs(call, dtype, None))
    res.kernel = "fused"
    saved = call_module.triton_replay, call_module.delta_rule_recurrence
    call_module.triton_replay = lambda args, chunked=True: res
    call_module.delta_rule_recurrence = lambda **kw: res
    try:
        yield res
    finally:
        call_module.triton_replay, call_module.delta_rule_recurrence = saved


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched inside the block, by name and, with ``sites``, by the
    innermost line of the package that issued them."""

    def __init__(self, sites: bool = False):
        super().__init__()
        self.ops: Counter = Counter()
        self.sites: Counter = Counter() if sites else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        if self.sites is not None:
            for frame in reversed(traceback.extract_stack()):
                if frame.filename.startswith(_PACKAGE):
                    path = os.path.relpath(frame.filename, os.path.dirname(_PACKAGE))
                    self.sites[f"{path}:{frame.lineno} {frame.line}"] += 1
                    break
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def count_ops(fn, sites: bool = False) -> OpCounter:
    """The operations of one call of ``fn`` (after an untimed one, so that kept layouts are built)."""
    fn()
    with OpCounter(sites) as counter:
        fn()
    return counter


def host_us(fn, repeats: int) -> float:
    """Median wall microseconds of ``fn`` over ``repeats`` calls (after five untimed)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def configurations(call: KernelCall) -> dict:
    """Name → a function that replays ``call`` once in that configuration (within
    :func:`recurrence_replaced`)."""
    stored = StoredCall(batch=0, prompts=list(range(len(call.segments()))), call=call)
    prompts = prompts_of(len(stored.prompts))
    off = Replayer(prompts, backend="triton", device="cpu", comparator=False)
    stream = Replayer(prompts, backend="triton", device="cpu", comparator=True)

    def add_stream():
        stream.add(stored, table=False)
        stream._pending.clear()  # the comparator's batch is solved apart, once per 2^28 key entries

    return {
        "replay_call": lambda: replay_call(call, backend="triton"),
        "add (comparator off)": lambda: off.add(stored, table=False),
        "add (run --stream)": add_stream,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("B", 8), ("T", 8), ("H", 8), ("K", 16), ("V", 16)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's dtype")
    p.add_argument("--precond", action="store_true", help="an OSDN layer (with d)")
    p.add_argument("--gated", action="store_true", help="a head gate")
    p.add_argument("--varlen", action="store_true", help="packed sequences of unequal lengths (cu_seqlens)")
    p.add_argument("--repeats", type=int, default=200, help="timed calls per configuration")
    p.add_argument("--sites", type=int, default=0, metavar="N", help="list the N lines issuing the most operations")
    p.add_argument("--baseline", help="an earlier --json result: print ratios against it")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)

    call = make_call(a.B, a.T, a.H, a.K, a.V, dtype=a.dtype, precond=a.precond, gated=a.gated, varlen=a.varlen)
    results = {}
    sites = {}
    with recurrence_replaced(call):
        for name, fn in configurations(call).items():
            counter = count_ops(fn, sites=bool(a.sites))
            results[name] = {"ops": counter.total, "us": host_us(fn, a.repeats),
                             "by_op": dict(counter.ops.most_common())}
            if a.sites:
                sites[name] = counter.sites.most_common(a.sites)
    base = None
    if a.baseline:
        with open(a.baseline) as f:
            base = json.load(f)["configurations"]

    shape = dict(B=a.B, T=a.T, H=a.H, K=a.K, V=a.V)
    print(f"\nhost work per replayed call, {shape}, {a.dtype}"
          f"{', precond' if a.precond else ''}{', gated' if a.gated else ''}{', varlen' if a.varlen else ''}; "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    head = f"{'configuration':24s} {'ops':>6s} {'µs':>9s} {'µs/op':>7s}"
    if base:
        head += f" {'ops base':>9s} {'µs base':>9s} {'ops ×':>6s} {'µs ×':>6s}"
    print(head)
    for name, r in results.items():
        line = f"{name:24s} {r['ops']:6d} {r['us']:9.1f} {r['us'] / max(r['ops'], 1):7.2f}"
        if base and name in base:
            b = base[name]
            line += (f" {b['ops']:9d} {b['us']:9.1f} {r['ops'] / b['ops']:6.3f} "
                     f"{r['us'] / b['us'] if b['us'] else math.nan:6.3f}")
        print(line)
    for name, top in sites.items():
        print(f"\n{name}: the {len(top)} lines issuing the most operations")
        for site, n in top:
            print(f"  {n:4d}  {site}")
    result = {
        "shape": shape, "dtype": a.dtype, "precond": a.precond, "gated": a.gated, "varlen": a.varlen,
        "host": platform.node(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "configurations": results, "sites": {k: [list(s) for s in v] for k, v in sites.items()},
    }
    write_json(a.json, result)
    return result


if __name__ == "__main__":
    main()
