"""The GPU context a model command creates on a thread while it imports (``osdn_diag._cuda_context``).

Which GPU, and when not at all: the ordinal torch will use (``--device cuda:N``; 0 for ``cuda`` or no
``--device``), never under torchrun, Triton's interpreter, ``--device cpu`` or
``OSDN_DIAG_CUDA_CONTEXT=off``. The driver calls are checked against a stand-in of ``libcuda``; on a
GPU, torch's own context afterwards is the one the thread made.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from osdn_diag import _cuda_context as cc
from osdn_diag import cli


@pytest.fixture
def plain_env(monkeypatch):
    for name in (cc.ENV, "TRITON_INTERPRET", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "device, ordinal",
    [(None, 0), ("cuda", 0), ("cuda:0", 0), ("cuda:3", 3), ("cpu", None), ("cpu:0", None), ("cuda:x", None)],
)
def test_ordinal_is_the_gpu_torch_will_use(plain_env, device, ordinal):
    assert cc.context_ordinal(device) == ordinal


@pytest.mark.parametrize("env, value", [("LOCAL_RANK", "1"), ("WORLD_SIZE", "2"), ("TRITON_INTERPRET", "1"),
                                        (cc.ENV, "off"), (cc.ENV, "0")])
def test_no_context_where_the_gpu_is_not_known_yet(plain_env, env, value):
    plain_env.setenv(env, value)
    assert cc.context_ordinal("cuda:1") is None
    assert cc.start_context(None) is None


class _FakeDriver:
    """``libcuda`` with ``count`` GPUs: records the calls, answers ``fail`` (a CUresult) from ``fail_at``."""

    def __init__(self, count: int, fail_at: str | None = None):
        self.count, self.fail_at, self.calls = count, fail_at, []

    def _call(self, name, result=None):
        def fn(*args):
            self.calls.append((name, args))
            if name == self.fail_at:
                return 100  # CUDA_ERROR_NO_DEVICE
            if result is not None:
                result(*args)
            return 0
        return fn

    def __getattr__(self, name):
        if name == "cuDeviceGetCount":
            return self._call(name, lambda p: setattr(p._obj, "value", self.count))
        if name == "cuDeviceGet":
            return self._call(name, lambda p, ordinal: setattr(p._obj, "value", 10 + ordinal))
        return self._call(name)


def _driver(monkeypatch, driver):
    monkeypatch.setattr(ctypes, "CDLL", lambda name: driver if name == "libcuda.so.1" else None)


def test_retains_the_primary_context_of_that_ordinal(plain_env):
    driver = _FakeDriver(count=4)
    _driver(plain_env, driver)
    plain_env.delenv("CUDA_MODULE_LOADING", raising=False)
    thread = cc.start_context("cuda:2")
    thread.join(10)
    names = [name for name, _ in driver.calls]
    assert names == ["cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDevicePrimaryCtxRetain"]
    assert driver.calls[2][1][1] == 2  # cuDeviceGet(&dev, 2)
    assert driver.calls[3][1][1].value == 12  # retained on the device that ordinal names
    import os

    assert os.environ["CUDA_MODULE_LOADING"] == "LAZY"  # as torch sets it before its first call


@pytest.mark.parametrize("driver", [_FakeDriver(count=2), _FakeDriver(count=0), _FakeDriver(4, fail_at="cuInit"),
                                    _FakeDriver(4, fail_at="cuDeviceGet")])
def test_nothing_retained_without_that_gpu(plain_env, driver):
    _driver(plain_env, driver)
    assert cc._retain(2 if driver.count == 2 else 1) is False
    assert "cuDevicePrimaryCtxRetain" not in [name for name, _ in driver.calls]


def test_no_driver_library_is_no_error(plain_env):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    plain_env.setattr(ctypes, "CDLL", missing)
    assert cc._retain(0) is False
    thread = cc.start_context(None)
    thread.join(10)
    assert not thread.is_alive()


def test_model_commands_start_it_with_their_device(plain_env, tmp_path):
    seen = []
    plain_env.setattr(cc, "start_context", lambda device: seen.append(device))
    plain_env.setattr(cli, "_run_command", lambda args: 0)
    cli.main(["run", "random:deltanet-tiny", "--prompts", "random", "--device", "cpu", "--out", str(tmp_path / "r")])
    cli.main(["capture", "random:deltanet-tiny", "--prompts", "random", "--out", str(tmp_path / "c")])
    assert seen == ["cpu", None]
    cli.main(["report", str(tmp_path)])  # no model: no GPU context
    assert seen == ["cpu", None]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_torch_uses_the_context_made_on_the_thread(plain_env):
    # In a fresh process: the thread's context must be torch's (the primary context of GPU 0).
    import subprocess
    import sys

    code = (
        "import ctypes, threading\n"
        "from osdn_diag._cuda_context import start_context\n"
        "t = start_context(None); t.join()\n"
        "cuda = ctypes.CDLL('libcuda.so.1')\n"
        "dev = ctypes.c_int(); cuda.cuDeviceGet(ctypes.byref(dev), 0)\n"
        "flags, active = ctypes.c_uint(), ctypes.c_int()\n"
        "cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active))\n"
        "assert active.value == 1, 'no primary context after the thread'\n"
        "import torch\n"
        "x = torch.ones(4, device='cuda') * 2\n"
        "ctx = ctypes.c_void_p(); cuda.cuCtxGetCurrent(ctypes.byref(ctx))\n"
        "prim = ctypes.c_void_p(); cuda.cuDevicePrimaryCtxRetain(ctypes.byref(prim), dev)\n"
        "assert ctx.value == prim.value, (ctx.value, prim.value)\n"
        "assert float(x.sum()) == 8.0\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
