"""Every public op of :mod:`osdn_diag.ops` that takes ``cu_seqlens`` refuses bad offsets, and CPU
tensors it has no way to run, before it launches a kernel.

The kernels index memory through ``cu_seqlens`` without bounds checks: offsets that stop short of T
leave the tail of the output unwritten (whatever ``torch.empty`` held), offsets past T read and write
outside the tensors. So the checks must come first. Each test here makes every Triton launch raise
(:class:`LaunchGuard`), so a refused call costs no kernel time and a check that came too late fails
the test. The CPU-without-interpreter test runs in a child process started without
``TRITON_INTERPRET`` (this process has it: the root conftest sets it on a machine without CUDA).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="needs triton")

from osdn_diag.ops.osdn_chunk import chunk_osdn  # noqa: E402
from osdn_diag.ops.osdn_recurrent import fused_recurrent_osdn  # noqa: E402
from osdn_diag.ops.phase1 import osdn_precondition  # noqa: E402
from osdn_diag.ops.phase1_parallel import parallel_fwd  # noqa: E402
from osdn_diag.ops.replay import fused_replay  # noqa: E402
from osdn_diag.ops.replay_chunk import chunk_replay  # noqa: E402
from osdn_diag.ops.replay_chunk_states import chunk_replay_states  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
T, H, K, V = 16, 2, 16, 16
# Where the kernels run: compiled on a GPU, interpreted on a CPU (the root conftest sets
# TRITON_INTERPRET=1 only on a machine without CUDA).
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


class KernelLaunched(AssertionError):
    pass


@pytest.fixture
def no_launch(monkeypatch, fla_kernels):
    """Any Triton launch (ours or fla's, compiled or interpreted) raises :class:`KernelLaunched`; fla
    prepared as for a real run, so that a call that passes every check gets as far as a launch."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    def refuse(self, *args, **kwargs):
        raise KernelLaunched(f"kernel {getattr(self, '__name__', self)} launched")

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", refuse)
    monkeypatch.setattr(jit.JITFunction, "run", refuse)


def _inputs(B=1):
    gen = torch.Generator().manual_seed(0)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    x = dict(q=torch.randn(B, T, H, K, generator=gen), k=k, v=torch.randn(B, T, H, V, generator=gen),
             beta=torch.rand(B, T, H, generator=gen))
    return {name: t.to(DEVICE) for name, t in x.items()}


# Each op called with the given inputs and cu_seqlens; the ones with validate=False skip only the
# checks that read cu_seqlens' values (a device synchronisation), not its dtype, shape or device.
OPS = {
    "chunk_osdn": lambda x, cu: chunk_osdn(x["q"], x["k"], x["v"], x["beta"], x["k"], cu_seqlens=cu),
    "chunk_osdn-novalidate": lambda x, cu: chunk_osdn(
        x["q"], x["k"], x["v"], x["beta"], x["k"], cu_seqlens=cu, validate=False),
    "fused_recurrent_osdn": lambda x, cu: fused_recurrent_osdn(x["q"], x["k"], x["v"], x["beta"], cu_seqlens=cu),
    "fused_recurrent_osdn-novalidate": lambda x, cu: fused_recurrent_osdn(
        x["q"], x["k"], x["v"], x["beta"], cu_seqlens=cu, validate=False),
    "osdn_precondition-sequential": lambda x, cu: osdn_precondition(x["k"], x["beta"], cu_seqlens=cu,
                                                                   method="sequential"),
    "osdn_precondition-parallel": lambda x, cu: osdn_precondition(x["k"], x["beta"], cu_seqlens=cu,
                                                                 method="parallel"),
    "osdn_precondition-novalidate": lambda x, cu: osdn_precondition(x["k"], x["beta"], cu_seqlens=cu,
                                                                   validate=False),
    "parallel_fwd": lambda x, cu: parallel_fwd(
        x["k"], x["beta"], None, None, cu, x["k"].shape[0] if cu is None else max(len(cu) - 1, 1),
        0.003, 0.5, 2.0, True, 1e-6, False),
    "fused_replay": lambda x, cu: fused_replay(x["q"], x["k"], x["v"], x["beta"], cu_seqlens=cu),
}
VALIDATING = [name for name in OPS if not name.endswith("novalidate")]


def _cu(*offsets, dtype=torch.int64):
    return torch.tensor(offsets, dtype=dtype, device=DEVICE)


# Wrong whatever `validate` says: type, dtype, shape, device, batch size.
BAD_LAYOUT = {
    "list": ([0, T], 1, "1-D integer tensor"),
    "float": (torch.tensor([0.0, T], device=DEVICE), 1, "dtype"),
    "bool": (torch.tensor([False, True], device=DEVICE), 1, "dtype"),
    "2-D": (_cu(0, T).reshape(1, 2), 1, "shape"),
    "one-entry": (_cu(0), 1, "two entries"),
    "other-device": (torch.tensor([0, T], device="meta"), 1, f"on {DEVICE}"),
    "batch-2": (_cu(0, T), 2, "batch size 1"),
}
# Wrong values: checked unless validate=False.
BAD_VALUES = {
    "stops-short": _cu(0, 5, 10),  # tokens 10-15 in no sequence: their outputs never written
    "past-the-end": _cu(0, 5, 40),  # reads and writes past the tensors
    "not-from-0": _cu(2, T),
    "decreasing": _cu(0, 10, 5, T),
    "negative": _cu(0, -3, T),
}


@pytest.mark.parametrize("case", list(BAD_LAYOUT))
@pytest.mark.parametrize("op", list(OPS))
def test_malformed_cu_seqlens_are_refused_before_any_launch(no_launch, op, case):
    cu, B, words = BAD_LAYOUT[case]
    x = _inputs(B)
    if op == "parallel_fwd" and case == "batch-2":
        cu = _cu(0, T)
    with pytest.raises(ValueError, match="argument 'cu_seqlens'") as err:
        OPS[op](x, cu)
    assert words in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case", list(BAD_VALUES))
@pytest.mark.parametrize("op", VALIDATING)
def test_offsets_outside_0_to_T_are_refused_before_any_launch(no_launch, op, case):
    with pytest.raises(ValueError, match=r"argument 'cu_seqlens': expected non-decreasing offsets from 0 to T = 16"):
        OPS[op](_inputs(), BAD_VALUES[case])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("op", list(OPS))
def test_good_offsets_reach_the_kernel(no_launch, op, dtype):
    """The guard's control: valid offsets (an empty sequence among them) pass every check."""
    with pytest.raises(KernelLaunched):
        OPS[op](_inputs(), _cu(0, 0, 5, T, dtype=dtype))


def test_parallel_fwd_refuses_a_sequence_count_that_is_not_the_offsets(no_launch):
    x = _inputs()
    with pytest.raises(ValueError, match="argument 'N'"):
        parallel_fwd(x["k"], x["beta"], None, None, _cu(0, 5, T), 3, 0.003, 0.5, 2.0, True, 1e-6, False)


REPLAYS = {"fused_replay": fused_replay, "chunk_replay": chunk_replay, "chunk_replay_states": chunk_replay_states}


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("op", list(REPLAYS))
def test_a_non_finite_scale_is_refused_before_any_launch(no_launch, op, scale):
    """scale=nan or ±inf ran in every replay, silently, and gave non-finite read-outs for every token
    (the losses, which do not read q, stayed finite). Now each refuses it, naming the op and the
    argument, before anything runs; a finite scale (the control) reaches the kernel."""
    x = _inputs()
    with pytest.raises(ValueError, match=rf"^{op}: scale must be a finite number .*got {scale!r}$"):
        REPLAYS[op](x["q"], x["k"], x["v"], x["beta"], scale=scale)
    with pytest.raises(KernelLaunched):
        REPLAYS[op](x["q"], x["k"], x["v"], x["beta"], scale=0.5)


def test_packed_chunk_osdn_writes_every_token(fla_kernels):
    """A run through the kernels under the interpreter: with offsets covering all T tokens every
    output is finite (the unchecked [0, 5, 10] left tokens 10-15 as uninitialised memory)."""
    x = _inputs()
    o, _ = chunk_osdn(x["q"], x["k"], x["v"], x["beta"], x["k"], cu_seqlens=_cu(0, 5, 10, T, dtype=torch.int32))
    assert o.shape == (1, T, H, V) and bool(torch.isfinite(o).all())


CHILD = textwrap.dedent(
    """
    import torch
    from osdn_diag.ops.osdn_chunk import chunk_osdn
    from osdn_diag.ops.osdn_recurrent import fused_recurrent_osdn
    from osdn_diag.ops.phase1 import osdn_precondition
    from osdn_diag.ops.phase1_parallel import parallel_fwd
    from osdn_diag.ops.replay import fused_replay

    k = torch.nn.functional.normalize(torch.randn(1, 8, 2, 16), dim=-1)
    v, beta = torch.randn(1, 8, 2, 16), torch.rand(1, 8, 2)
    calls = {
        "chunk_osdn": lambda: chunk_osdn(k, k, v, beta, k),
        "fused_recurrent_osdn": lambda: fused_recurrent_osdn(k, k, v, beta),
        "osdn_precondition": lambda: osdn_precondition(k, beta),
        "parallel_fwd": lambda: parallel_fwd(k, beta, None, None, None, 1, 0.003, 0.5, 2.0, True, 1e-6, False),
        "fused_replay": lambda: fused_replay(k, k, v, beta),
    }
    for name, call in calls.items():
        try:
            call()
            print(name, "RAN")
        except Exception as e:
            print(name, type(e).__name__, str(e).replace("\\n", " | "))
    """
)


def test_cpu_tensors_without_the_interpreter_get_a_clear_error():
    """Without TRITON_INTERPRET=1 our kernels are built for compilation and fla's are neither built
    for nor patched for the interpreter; on CPU tensors Triton itself would fail with "0 active
    drivers". Each op says instead what to do."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert set(lines) == {"chunk_osdn", "fused_recurrent_osdn", "osdn_precondition", "parallel_fwd",
                          "fused_replay"}, out.stdout
    for name, line in lines.items():
        assert line.startswith(f"RuntimeError {name}: "), line
        for words in ("TRITON_INTERPRET=1", "osdn_diag.runtime.prepare", "osdn_diag.math"):
            assert words in line, line
        assert "active drivers" not in line and " | " not in line, line


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's fixes matter only where kernels are interpreted")
def test_chunk_osdn_without_fla_s_interpreter_fixes(no_launch, monkeypatch):
    """TRITON_INTERPRET=1 but fla not prepared (its autotuner would look for a GPU to time configs
    on): the error names the call that prepares it."""
    import osdn_diag.runtime.interpret as interp

    monkeypatch.setattr(interp, "_ENABLED", False)
    x = _inputs()
    with pytest.raises(RuntimeError, match=r"^chunk_osdn: .*osdn_diag\.runtime\.prepare\('cpu'\)"):
        chunk_osdn(x["q"], x["k"], x["v"], x["beta"], x["k"])
