"""Which Triton replay a captured call gets (``osdn_diag.replay.call.triton_replay``): the chunked one
for fp32 delta-rule calls it takes, the token-by-token one elsewhere, each meeting the fp64
reference (CPU: Triton's interpreter; GPU: real kernels)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from osdn_diag.math import delta_rule_recurrence

pytest.importorskip("osdn_diag.ops.replay_chunk", reason="needs triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))
from _replay_cases import assert_fields_close, replay_inputs  # noqa: E402

from osdn_diag.replay.call import BACKENDS, chunk_applies, triton_replay  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _args(K=16, gate=None, dtype=torch.float32, T=21, seed=0):
    q, k, v, beta, kw = replay_inputs(seed, 1, T, 2, K, 8, gate=gate, asym=True, h0=True)
    args = dict(q=q, k=k, v=v, beta=beta, write_key=kw.get("write_key"), g=kw.get("g"),
                scale=None, initial_state=kw.get("initial_state"), cu_seqlens=None, dtype=dtype)
    return {n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for n, x in args.items()}


def _reference(args):
    kw = {n: (x.cpu() if isinstance(x, torch.Tensor) else x) for n, x in args.items() if n != "dtype"}
    return delta_rule_recurrence(**kw, dtype=torch.float64)


@pytest.mark.parametrize("K,gate,dtype,expected", [
    (16, None, torch.float32, "chunk"),
    (16, "head", torch.float32, "fused"),         # a gate: the chunked ratios miss 1e-5 on real captures
    (128, None, torch.float32, "chunk"),          # the widest key it takes
    (256, None, torch.float32, "fused"),          # wider: the fused replay, faster there
    (16, "channel", torch.float32, "fused"),      # a key-channel gate: per-channel ratios in a chunk
    (16, None, torch.float64, "fused"),           # the chunked replay is fp32 only
])
def test_kernel_chosen_and_exact(K, gate, dtype, expected):
    args = _args(K, gate, dtype, T=17 if K > 64 else 21)
    assert chunk_applies(args) == (expected == "chunk")
    res = triton_replay(args)
    assert res.kernel == expected
    assert_fields_close(res, _reference(args), 1e-5)


def test_growing_state_falls_back_to_fused():
    """A positive log decay (a state that grows) is the token-by-token replay's: the chunk's products of
    decay ratios would cancel."""
    args = _args(gate="head")
    args["g"] = args["g"].abs() * 0.05
    res = triton_replay(args)
    assert res.kernel == "fused"
    assert_fields_close(res, _reference(args), 1e-5)


def test_wider_keys_and_fused_backend_take_the_fused_replay():
    args = _args(K=129, T=5)
    assert not chunk_applies(args)
    assert triton_replay(args).kernel == "fused"
    assert triton_replay(_args(), chunked=False).kernel == "fused"
    assert BACKENDS == ("torch", "triton", "fused")
