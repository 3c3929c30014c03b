"""Compiling an autotuned kernel's configurations in parallel before Triton times them.

On a machine that has not run a model yet, fla's kernels autotune: Triton's ``Autotuner`` compiles
and times each candidate configuration, one after another. For the paper-scale DeltaNet run on one
H200 that was 151 configurations of 11 kernels, 94 s of a 142 s first run
(``benchmarks/CHANGELOG.md``, series 12). Compilation mostly runs outside Python's GIL
(LLVM, ``ptxas``), so :func:`compile_configs_in_parallel` makes every autotuner compile all of its
candidates concurrently, in threads, just before it times the first one; the timing itself, the
configuration chosen and Triton's and fla's caches are unchanged. Nothing happens when the
choice is already cached (in memory, or on disk with fla's ``FLA_CACHE_RESULTS``), when one
configuration is left, or under Triton's interpreter.

``OSDN_DIAG_PARALLEL_COMPILE=0`` (or ``1``: one thread) leaves Triton's sequential compilation
alone; ``=N`` uses at most N threads (default: the processor's cores, at most 16).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from .cpus import usable_cpus

__all__ = ["ENV", "compile_configs_in_parallel", "workers"]

ENV = "OSDN_DIAG_PARALLEL_COMPILE"
_MAX_WORKERS = 16
_PENDING = "_osdn_precompile"  # the candidates an autotuner is about to time (set by prune_configs)


def workers() -> int:
    """Threads per autotuner (0: off), from ``OSDN_DIAG_PARALLEL_COMPILE`` or the usable cores."""
    setting = os.environ.get(ENV, "").strip()
    if setting:
        try:
            return max(0, int(setting))
        except ValueError:
            return 0 if setting.lower() in ("off", "no", "false") else _default_workers()
    return _default_workers()


def _default_workers() -> int:
    return min(usable_cpus(), _MAX_WORKERS)


def _compile_one(autotuner, args: tuple, meta: dict, config) -> None:
    """Compile ``config``'s kernel without launching it; a configuration that fails to compile is
    left to the timing pass, which records it as unusable exactly as before."""
    try:
        autotuner.fn.run(*args, **{**meta, **config.all_kwargs(), "warmup": True})
    except Exception:  # noqa: BLE001 - the sequential pass reports it in Triton's own way
        pass


def _precompile(autotuner, args: tuple, meta: dict, configs: list, threads: int) -> None:
    # The first one here, in this thread: it sets up the kernel's per-device caches that the
    # others then share.
    _compile_one(autotuner, args, meta, configs[0])
    rest = configs[1:]
    if not rest:
        return
    try:
        from triton.runtime import _async_compile
    except ImportError:  # an older Triton: the compilations themselves in threads
        _async_compile = None
    with ThreadPoolExecutor(max_workers=min(threads, len(rest)), thread_name_prefix="osdn-compile") as pool:
        if _async_compile is not None and _async_compile.active_mode.get() is None:
            # Triton's own asynchronous mode: its compiler runs in the pool, its bookkeeping here.
            with _async_compile.AsyncCompileMode(pool, ignore_errors=True):
                for config in rest:
                    _compile_one(autotuner, args, meta, config)
        else:
            # Triton compiles for the thread's current CUDA device: the caller's, in every thread.
            import torch

            device = torch.cuda.current_device() if torch.cuda.is_available() else None

            def compile_on_device(config):
                if device is not None:
                    torch.cuda.set_device(device)
                _compile_one(autotuner, args, meta, config)

            list(pool.map(compile_on_device, rest))


def compile_configs_in_parallel() -> bool:
    """Patch Triton's ``Autotuner`` once (see the module docstring); ``False`` if switched off or
    Triton is not importable. Call it before the first kernel runs."""
    threads = workers()
    if threads < 2:
        return False
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # pragma: no cover - triton comes with torch on Linux
        return False
    if getattr(Autotuner._bench, "_osdn_parallel", False):
        return True
    prune_configs, bench = Autotuner.prune_configs, Autotuner._bench

    def prune_configs_noting(self, kwargs):
        configs = prune_configs(self, kwargs)
        # Called where the autotuner has no choice for this key in memory; whether it times them
        # (no choice on disk either) shows at the first _bench below.
        self.__dict__[_PENDING] = list(configs) if len(configs) > 1 else None
        return configs

    def bench_after_compiling(self, *args, config, **meta):
        pending = self.__dict__.pop(_PENDING, None)
        if pending:
            _precompile(self, args, meta, pending, threads)
        return bench(self, *args, config=config, **meta)

    prune_configs_noting.__wrapped__ = prune_configs
    bench_after_compiling.__wrapped__ = bench
    bench_after_compiling._osdn_parallel = True
    Autotuner.prune_configs = prune_configs_noting
    Autotuner._bench = bench_after_compiling
    return True
