"""What the benchmark scripts share: GPU timing, relative error against a reference, result files.

The scripts import it as ``_common`` (``python benchmarks/<script>.py`` puts this folder on the path).
"""

from __future__ import annotations

import json
import time

import torch

from osdn_diag.runtime.atomic import atomic_write_text


def bench(fn, name: str | None = None, *, warmup: int = 25, rep: int = 200) -> float:
    """Median milliseconds of ``fn`` (``triton.testing.do_bench``); printed as soon as measured when
    ``name`` is given, so a run cut short still reports what it measured."""
    from triton.testing import do_bench

    ms = do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    if name:
        print(f"  measured {name}: {ms:.3f} ms", flush=True)
    return ms


def _profiled(fn, calls: int):
    """The torch profiler's record of ``calls`` calls of ``fn`` (GPU activity), after three untimed."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def device_and_host_ms(fn, calls: int = 20) -> tuple[float, float]:
    """``(device, host)`` milliseconds per call of ``fn``: the sum of its kernels' device time (torch
    profiler) and the time the host takes to issue it without waiting. A call's wall time is about
    the larger of the two: where the host is larger, the kernels wait for their launches."""
    prof = _profiled(fn, calls)
    device = sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e3
    torch.cuda.synchronize()
    return device, host


def kernel_timeline(fn, calls: int = 10) -> list[tuple[str, float]]:
    """The kernels of one call of ``fn`` in launch order, ``(name, median device µs)``: where a call's
    GPU time goes, kernel by kernel (launches of one kernel with different constants keep their
    places). Every call must launch the same kernels."""
    prof = _profiled(fn, calls)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    per_call = len(kernels) // calls
    if per_call * calls != len(kernels):
        raise RuntimeError(f"{len(kernels)} kernels in {calls} calls: not the same kernels every call")
    names = [kernels[i].name for i in range(per_call)]
    times = torch.tensor([e.time_range.elapsed_us() for e in kernels], dtype=torch.float64)
    return list(zip(names, times.view(calls, per_call).median(0).values.tolist()))


def fidelity_text(err: float | None, fmt: str = ".2e") -> str:
    """A summary's ``fidelity.max_rel_error`` for a printed line: ``None`` means no live kernel ran
    (the CPU's reference stand-in), so there was nothing to compare the replay with."""
    return "not measured (reference kernels)" if err is None else format(err, fmt)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in fp64 (``b`` the reference)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def write_json(path: str | None, result: dict) -> None:
    """``result`` as indented JSON at ``path`` (nothing when ``path`` is None), written atomically."""
    if path:
        atomic_write_text(path, json.dumps(result, indent=2))
