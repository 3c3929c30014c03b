"""Autotuned kernels' configurations compiled in parallel before Triton times them
(:mod:`osdn_diag.runtime.autotune`). Triton's ``Autotuner`` runs here around a stand-in kernel that records
what it was asked to do (compiling a real kernel needs a GPU: benchmarks/RESULTS.md has the H200
measurement). Each check runs in a fresh interpreter, since the patch is process-wide and Triton
must not be in interpreter mode (where the package keeps one configuration per kernel)."""

from __future__ import annotations

from _fresh_python import run_json

PRELUDE = """
import json, sys, threading
from triton.runtime.autotuner import Autotuner, Config
from osdn_diag.runtime.autotune import compile_configs_in_parallel

calls = []

def kernel(x, n):
    pass

class StandIn:
    arg_names = ["x", "n"]
    fn = staticmethod(kernel)

    def run(self, *args, grid, warmup, **kw):
        calls.append(["compile" if warmup else "launch", kw["B"], threading.current_thread().name])

def autotuner(*blocks):
    return Autotuner(StandIn(), StandIn.arg_names, [Config({"B": b}) for b in blocks], key=["n"],
                     reset_to_zero=None, restore_value=None,
                     do_bench=lambda call, quantiles: (call(), [1.0, 1.0, 1.0])[1])
"""


def _run(code: str, **env) -> dict:
    return run_json(PRELUDE + code, unset=("TRITON_INTERPRET", "OSDN_DIAG_PARALLEL_COMPILE"), **env)


def test_every_candidate_is_compiled_before_the_first_is_timed():
    """A tuning key without a choice: all three configurations compiled (no launch), then timed
    one by one, then the choice launched; the same key again: nothing compiled or timed."""
    out = _run("""
patched = compile_configs_in_parallel()
tuner = autotuner(1, 2, 3)
tuner.run(0, 5, grid=(1,), warmup=False)
first = list(calls); calls.clear()
tuner.run(0, 5, grid=(1,), warmup=False)
print(json.dumps(dict(patched=patched, first=first, again=calls)))
""", OSDN_DIAG_PARALLEL_COMPILE="4")
    assert out["patched"] is True
    steps = [(what, block) for what, block, _ in out["first"]]
    assert steps == [("compile", 1), ("compile", 2), ("compile", 3),
                     ("launch", 1), ("launch", 2), ("launch", 3), ("launch", 1)]
    assert [(what, block) for what, block, _ in out["again"]] == [("launch", 1)]


def test_a_new_key_compiles_again_and_one_candidate_never_does():
    """Another key is tuned again (its candidates compiled first); a kernel with one configuration is
    never timed, so nothing is compiled ahead of its launch."""
    out = _run("""
compile_configs_in_parallel()
tuner = autotuner(1, 2)
tuner.run(0, 5, grid=(1,), warmup=False); calls.clear()
tuner.run(0, 6, grid=(1,), warmup=False)
other = list(calls); calls.clear()
autotuner(7).run(0, 5, grid=(1,), warmup=False)
print(json.dumps(dict(other=other, single=calls)))
""", OSDN_DIAG_PARALLEL_COMPILE="4")
    assert [w for w, _, _ in out["other"]][:2] == ["compile", "compile"]
    assert [(w, b) for w, b, _ in out["single"]] == [("launch", 7)]


def test_without_triton_async_mode_the_compilations_run_in_threads():
    """With an older Triton (no ``triton.runtime._async_compile``), the candidates after the first are
    compiled by the package's own threads."""
    out = _run("""
import triton.runtime
del triton.runtime._async_compile  # the import fails, as before Triton had it
sys.modules["triton.runtime._async_compile"] = None
compile_configs_in_parallel()
autotuner(1, 2, 3).run(0, 5, grid=(1,), warmup=False)
print(json.dumps(dict(calls=calls)))
""", OSDN_DIAG_PARALLEL_COMPILE="4")
    compiled = {block: thread for what, block, thread in out["calls"] if what == "compile"}
    assert set(compiled) == {1, 2, 3}
    assert compiled[1] == "MainThread"
    assert all(compiled[b].startswith("osdn-compile") for b in (2, 3)), compiled


def test_switched_off_leaves_triton_alone():
    """``OSDN_DIAG_PARALLEL_COMPILE=0``: no patch, Triton compiles as it times."""
    out = _run("""
patched = compile_configs_in_parallel()
autotuner(1, 2).run(0, 5, grid=(1,), warmup=False)
print(json.dumps(dict(patched=patched, calls=calls)))
""", OSDN_DIAG_PARALLEL_COMPILE="0")
    assert out["patched"] is False
    assert [w for w, _, _ in out["calls"]] == ["launch", "launch", "launch"]


def test_workers_setting(monkeypatch):
    """The thread count: the variable's number, 0 for off, else the usable cores (at most 16)."""
    from osdn_diag.runtime import autotune as _autotune

    monkeypatch.setenv("OSDN_DIAG_PARALLEL_COMPILE", "3")
    assert _autotune.workers() == 3
    monkeypatch.setenv("OSDN_DIAG_PARALLEL_COMPILE", "off")
    assert _autotune.workers() == 0
    monkeypatch.delenv("OSDN_DIAG_PARALLEL_COMPILE")
    assert 1 <= _autotune.workers() <= 16
