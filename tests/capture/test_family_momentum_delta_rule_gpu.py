"""On a GPU: MomentumDeltaNet records are what fla's momentum kernels consumed, bit for bit, and replay
like an fp64 replay; capture leaves the logits bitwise unchanged.

A 2-layer bf16 model (the package's MomentumDeltaNetConfig around fla's layer; hidden 512, 4 heads of
128, value heads of 256), batch 2, on the chunk path (T = 1024) and the fused recurrent path
(T = 64), no grad. fla 0.6.0's two entry points are torch code around ``l2norm_fwd`` (Triton) and a
torch recurrence (``recurrent_momentum_delta_rule_ref`` / ``chunk_momentum_delta_rule_ref``); the
spies here wrap those two functions and ``l2norm_fwd`` where the entry points' modules import them,
so they see exactly what the recurrence read. At every layer:

(i)   the record's q, loss key k, write key η k, residual key α k, v, β, log α and log μ equal the
      consumed tensors bitwise (k is the second ``l2norm_fwd`` output of the call);
(ii)  the replay (``backend="triton"``, which runs the torch reference for this family) passes its
      own output, state and momentum-buffer checks at their default tolerances, and its per-token
      residual ratios agree with an fp64 replay of the same record (p99 relative, floored at 1e-3,
      ≤ 1e-5; geometric mean within 1e-6);
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
]

DEVICE = "cuda"
DTYPE = torch.bfloat16
BATCH = 2
VOCAB = 1024
LENGTHS = {"chunk": 1024, "fused_recurrent": 64}
PATHS = tuple(LENGTHS)
LAYERS = 2
RECURRENCES = {  # path -> (module of the entry point, the torch recurrence it hands the tensors to)
    "chunk": ("fla.ops.momentum_delta_rule.chunk", "chunk_momentum_delta_rule_ref"),
    "fused_recurrent": ("fla.ops.momentum_delta_rule.fused_recurrent", "recurrent_momentum_delta_rule_ref"),
}


def _model():
    from transformers import AutoModelForCausalLM

    from osdn_diag.models import MomentumDeltaNetConfig

    config = MomentumDeltaNetConfig(hidden_size=512, num_hidden_layers=LAYERS, num_heads=4, head_dim=128,
                                    vocab_size=VOCAB)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device=DEVICE, dtype=DTYPE).eval()


@contextlib.contextmanager
def _spy(path: str):
    """Keeps, per kernel call, the l2norm_fwd outputs and the recurrence's arguments."""
    import importlib

    module = importlib.import_module(RECURRENCES[path][0])
    name = RECURRENCES[path][1]
    rec, norm = getattr(module, name), module.l2norm_fwd
    calls: list[dict] = []
    normed: list[torch.Tensor] = []

    def norm_spy(x, *args, **kwargs):
        out = norm(x, *args, **kwargs)
        normed.append(out[0].detach().clone())
        return out

    def rec_spy(*args, **kwargs):
        kept = {n: x.detach().clone() if isinstance(x, torch.Tensor) else x for n, x in kwargs.items()}
        kept["normed"] = list(normed)
        normed.clear()
        calls.append(kept)
        return rec(*args, **kwargs)

    setattr(module, name, rec_spy)
    module.l2norm_fwd = norm_spy
    try:
        yield calls
    finally:
        setattr(module, name, rec)
        module.l2norm_fwd = norm


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
        assert call.family == "momentum_delta_rule" and call.flags["path"] == path
        assert call.flags["kernels"] == "fla" and call.input_dtype == "bfloat16"
    return list(zip(r.consumed, r.calls))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.float(), b.float())


@pytest.mark.parametrize("path", PATHS)
def test_every_layer_records_what_the_recurrence_consumed(path, model_run):
    """(i) bitwise, every tensor the recurrence read."""
    for seen, call in _pairs(model_run(path), path):
        assert len(seen["normed"]) == 3  # q, k, p
        assert _same(call.q, seen["q"]) and _same(call.q, seen["normed"][0])
        assert _same(call.k, seen["normed"][1])
        assert _same(call.write_key, seen["k"])  # η ⊙ k as stored
        assert _same(call.extra["residual_key"], seen["p"])  # α ⊙ p as stored
        assert _same(call.v, seen["v"]) and _same(call.beta, seen["beta"])
        assert _same(call.g, seen["log_alpha"]) and _same(call.extra["log_mu"], seen["log_mu"])
        assert torch.all(seen["eta"] == 1)  # η went into the write key
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
        print(f"[momentum-gpu] {path} layer {call.layer}: fidelity {res.fidelity:.3g} (tol {res.tolerance:.1g}) "
              f"state {res.state_fidelity} (tol {res.state_tolerance:.1g}) | vs fp64: ratio p99 {p99:.3g}, "
              f"q_geo {abs(q_geo - q_geo_ref) / q_geo_ref:.3g} over {int(ok.sum())} tokens", flush=True)
        assert res.state_fidelity is not None
        assert int(ok.sum()) >= 0.9 * ok.numel()
        assert p99 <= 1e-5
        assert abs(q_geo - q_geo_ref) <= 1e-6 * q_geo_ref


@pytest.mark.parametrize("path", PATHS)
def test_capture_leaves_the_logits_bitwise_unchanged(path, model_run):
    """(iii)"""
    r = model_run(path)
    assert torch.equal(r.logits_again, r.logits_plain), "the model is not deterministic run to run"
    assert torch.equal(r.logits_hooked, r.logits_plain), "capture changed the model's logits"
