"""On a GPU: RWKV-7 records are what fla's compiled kernels consumed, bit for bit, and replay like an
fp64 replay; capture leaves the logits bitwise unchanged.

A 2-layer bf16 ``RWKV7ForCausalLM`` (hidden 512, 4 heads of 128), batch 2, on the chunk path
(T = 1024: ``chunk_rwkv7``, fla's chunked DPLR delta rule) and the fused recurrent path (T = 32:
``fused_mul_recurrent_rwkv7``), no grad. The spies wrap what the two entry points hand their
recurrence — ``chunk_dplr_delta_rule`` (as ``fla.ops.rwkv7.chunk`` imports it) and
``fused_recurrent_rwkv7_fwd`` (as ``fla.ops.rwkv7.fused_recurrent`` calls it) — so they see exactly
what the kernels read. At every layer:

(i)   the record's r, removal key κ̂ (``−a``, or ``kk``), b (``b``, or ``kk ⊙ a`` in fp32 as the fused
      kernel forms it in registers), write key k, v and log decay w equal the consumed tensors bitwise;
(ii)  the replay (``backend="triton"``, which runs the torch reference for this family) passes its
      own output and state checks at their default tolerances, and its per-token residual ratios (and
      ``residual_ratio_alt``) agree with an fp64 replay of the same record (p99 relative, floored at
      1e-3, ≤ 1e-5; geometric mean within 1e-6);
(iii) the logits with and without capture are bitwise equal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import pytest
import torch

from osdn_diag.capture.context import capture
from osdn_diag.replay import replay_call

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fla's compiled kernels)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1: fla's kernels would be interpreted, not compiled"),
    pytest.mark.usefixtures("fla_kernels"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]

DEVICE = "cuda"
DTYPE = torch.bfloat16
BATCH = 2
VOCAB = 1024
LENGTHS = {"chunk": 1024, "fused_recurrent": 32}
PATHS = tuple(LENGTHS)
LAYERS = 2
#: path -> (module, the function the entry point hands the tensors to, its parameter names)
RECURRENCES = {
    "chunk": ("fla.ops.rwkv7.chunk", "chunk_dplr_delta_rule", None),
    "fused_recurrent": ("fla.ops.rwkv7.fused_recurrent", "fused_recurrent_rwkv7_fwd",
                        ("r", "w", "k", "v", "kk", "a", "scale", "initial_state", "output_final_state",
                         "reverse", "cu_seqlens")),
}


def _model():
    from fla.models import RWKV7Config
    from transformers import AutoModelForCausalLM

    config = RWKV7Config(hidden_size=512, num_hidden_layers=LAYERS, head_dim=128, vocab_size=VOCAB)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device=DEVICE, dtype=DTYPE).eval()


@contextlib.contextmanager
def _spy(path: str):
    """Keeps, per kernel call, the arguments the recurrence received (by name)."""
    import importlib

    module_name, name, params = RECURRENCES[path]
    module = importlib.import_module(module_name)
    original = getattr(module, name)
    calls: list[dict] = []

    def spy(*args, **kwargs):
        named = dict(zip(params, args)) if params else {}
        named.update(kwargs)
        calls.append({n: x.detach().clone() if isinstance(x, torch.Tensor) else x for n, x in named.items()})
        return original(*args, **kwargs)

    setattr(module, name, spy)
    try:
        yield calls
    finally:
        setattr(module, name, original)


@dataclasses.dataclass
class ModelRun:
    logits_plain: torch.Tensor
    logits_again: torch.Tensor
    logits_hooked: torch.Tensor
    consumed: list
    calls: list


@pytest.fixture(scope="module")
def model_run():
    models: dict = {}
    memo: dict = {}

    def get(path: str) -> ModelRun:
        if path not in memo:
            if "model" not in models:
                models["model"] = _model()
            model = models["model"]
            gen = torch.Generator(device=DEVICE).manual_seed(1000)
            ids = torch.randint(0, VOCAB, (BATCH, LENGTHS[path]), device=DEVICE, generator=gen)
            with torch.no_grad():
                plain = model(ids).logits
                again = model(ids).logits
                with _spy(path) as consumed, capture(model, kernels="fla") as cap:
                    hooked = model(ids).logits
            memo[path] = ModelRun(plain, again, hooked, consumed, cap.calls)
        return memo[path]

    return get


def _pairs(r: ModelRun, path: str):
    assert len(r.consumed) == len(r.calls) == LAYERS, (len(r.consumed), len(r.calls))
    for call in r.calls:
        assert call.family == "rwkv7" and call.flags["path"] == path
        assert call.flags["kernels"] == "fla" and call.input_dtype == "bfloat16"
    return list(zip(r.consumed, r.calls))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.float(), b.float())


@pytest.mark.parametrize("path", PATHS)
def test_every_layer_records_what_the_recurrence_consumed(path, model_run):
    """(i) bitwise, every tensor the recurrence read."""
    for seen, call in _pairs(model_run(path), path):
        assert _same(call.write_key, seen["k"]) and _same(call.v, seen["v"])
        if path == "chunk":
            assert _same(call.q, seen["q"]) and _same(call.g, seen["gk"])
            assert _same(call.k, -seen["a"].float()) and _same(call.extra["b"], seen["b"])
        else:
            assert _same(call.q, seen["r"]) and _same(call.g, seen["w"])
            assert _same(call.k, seen["kk"])
            assert _same(call.extra["b"], seen["kk"].float() * seen["a"].float())  # fp32 registers
            assert seen["reverse"] is False
        assert call.scale == seen["scale"]


def _ratios(columns: dict) -> tuple[torch.Tensor, torch.Tensor]:
    ok = columns["finite"] & (columns["loss_before"] > 1e-12)
    return columns["residual_ratio"][ok].double(), ok


@pytest.mark.parametrize("path", PATHS)
def test_every_layer_replays_like_fp64(path, model_run):
    """(ii) the replay passes its checks, and agrees with an fp64 replay per token."""
    for _, call in _pairs(model_run(path), path):
        res = replay_call(call, backend="triton")  # raises FidelityError above the default tolerances
        ref = replay_call(call, dtype=torch.float64)
        q, ok = _ratios(res.columns)
        q_ref = ref.columns["residual_ratio"][ok].double()
        rel = (q - q_ref).abs() / q_ref.abs().clamp_min(1e-3)
        p99 = float(torch.quantile(rel, 0.99))
        q_geo = math.exp(float(q.clamp_min(1e-30).log().mean()))
        q_geo_ref = math.exp(float(q_ref.clamp_min(1e-30).log().mean()))
        print(f"[rwkv7-gpu] {path} layer {call.layer}: fidelity {res.fidelity:.3g} (tol {res.tolerance:.1g}) "
              f"state {res.state_fidelity} (tol {res.state_tolerance:.1g}) | vs fp64: ratio p99 {p99:.3g}, "
              f"q_geo {abs(q_geo - q_geo_ref) / q_geo_ref:.3g} over {int(ok.sum())} tokens", flush=True)
        assert res.state_fidelity is not None
        assert int(ok.sum()) >= 0.9 * ok.numel()
        assert p99 <= 1e-5
        assert abs(q_geo - q_geo_ref) <= 1e-6 * q_geo_ref
        alt, alt_ref = res.columns["residual_ratio_alt"][ok].double(), ref.columns["residual_ratio_alt"][ok].double()
        rel_alt = (alt - alt_ref).abs() / alt_ref.abs().clamp_min(1e-3)
        assert float(torch.quantile(rel_alt, 0.99)) <= 1e-5


@pytest.mark.parametrize("path", PATHS)
def test_capture_leaves_the_logits_bitwise_unchanged(path, model_run):
    """(iii)"""
    r = model_run(path)
    assert torch.equal(r.logits_again, r.logits_plain), "the model is not deterministic run to run"
    assert torch.equal(r.logits_hooked, r.logits_plain), "capture changed the model's logits"
