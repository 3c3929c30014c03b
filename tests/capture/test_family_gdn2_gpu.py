"""On a GPU: fla's compiled GDN-2 kernels in a bf16 model (the package's ``GDN2ForCausalLM``) — each
layer's record is what the kernel consumed, its replay agrees with an fp64 replay of that, and
capture leaves the logits unchanged.

Mirrors ``test_kernel_exact_gpu.py`` for the GDN-2 family: a 2-layer bf16 model (hidden 512, 4 heads
of 128), batch 2, on the chunk path (T = 1024, no grad) and the fused recurrent path (T = 64, no
grad). At every layer:

(i)   the record holds what the recurrence consumed: on the chunk path q̂ and k̂ are the stored
      ``l2norm_fwd`` outputs bitwise (record ``q`` and ``write_key``), on the fused recurrent path the
      kernel's fp32 register norm of the raw q, k; the read key is the fp32 product ``b ⊙ k̂`` and the
      target ``w ⊙ v``, bitwise; the channel log decay ``g`` as passed; β ≡ 1; the raw gates in
      ``extra``; the kernel's fp32 final state, transposed to ``V×K``, bitwise;
(ii)  the package's GPU replay (``backend="triton"``: the delta-rule fused replay kernel, which serves
      GDN-2 as recorded) agrees per token with an fp64 loop written here, in fla's ``K×V`` form, on
      the consumed tensors: residual ratios within 1e-5 relative at p99 (relative to
      max(ratio, 1e-3), over tokens with a non-negligible loss), their geometric mean within 1e-6;
(iii) the replay passes its own output and final-state checks at their default tolerances (one line
      per layer is printed; run pytest with ``-s`` to keep them);
(iv)  the logits with and without capture are bitwise equal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
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
LAYERS = 2
LENGTHS = {"chunk": 1024, "fused_recurrent": 64}
PATHS = tuple(LENGTHS)
SITES = {"chunk": "chunk_gdn2", "fused_recurrent": "fused_recurrent_gdn2"}
KERNEL_TOLERANCE = {
    "fused_recurrent": {"o": 1e-2, "state": 1e-4},
    "chunk": {"o": 1e-2, "state": 5e-2},
}
RATIO_FLOOR = 1e-3


def _register_l2norm(x):
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


@dataclasses.dataclass
class Run:
    path: str
    args: dict
    stored: list = dataclasses.field(default_factory=list)         # l2norm_fwd outputs during the call
    stored_inputs: list = dataclasses.field(default_factory=list)  # and their inputs
    out: tuple = ()


def _keep(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


@contextlib.contextmanager
def _spy():
    """Spy on the GDN-2 call sites of ``fla.layers.gdn2`` and on ``l2norm_fwd`` as
    ``fla.ops.gdn2.chunk`` looks it up; yields the list of :class:`Run`, in call order."""
    runs: list[Run] = []
    current: list[Run] = []
    patched = []

    def site(path, original):
        @functools.wraps(original)
        def spy(*args, **kwargs):
            bound = inspect.signature(original).bind(*args, **kwargs)
            bound.apply_defaults()
            named = dict(bound.arguments)
            named.update(named.pop("kwargs", {}))
            run = Run(path, {k: _keep(v) for k, v in named.items()})
            current.append(run)
            try:
                out = original(*args, **kwargs)
            finally:
                current.pop()
            run.out = tuple(_keep(x) for x in out)
            runs.append(run)
            return out
        return spy

    def norm(original):
        @functools.wraps(original)
        def spy(x, *args, **kwargs):
            out = original(x, *args, **kwargs)
            if current:
                current[-1].stored.append(_keep(out[0]))
                current[-1].stored_inputs.append(_keep(x))
            return out
        return spy

    try:
        ops = importlib.import_module("fla.ops.gdn2.chunk")
        patched.append((ops, "l2norm_fwd", ops.l2norm_fwd))
        ops.l2norm_fwd = norm(ops.l2norm_fwd)
        layers = importlib.import_module("fla.layers.gdn2")
        for path, name in SITES.items():
            original = getattr(layers, name)
            patched.append((layers, name, original))
            setattr(layers, name, site(path, original))
        yield runs
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)


def _qk(run: Run):
    """q̂, k̂ as the recurrence read them (fp32)."""
    a = run.args
    assert a["use_qk_l2norm_in_kernel"] is True and a.get("initial_state") is None
    assert a.get("use_gate_in_kernel", False) is False  # the layer passes the gate computed
    if run.path == "chunk":
        q, k = run.stored
        return q.float(), k.float()
    return _register_l2norm(a["q"]), _register_l2norm(a["k"])


def _fp64_gdn2(run: Run) -> dict:
    """GDN-2 from a zero state in fp64, fla's K×V form, vectorised over ``[B, H]``:
    ``S ← (I − k (b⊙k)ᵀ) Diag(exp g) S + k (w⊙v)ᵀ``, ``o = Sᵀ(q·K^{-1/2})``; the loss
    ``½‖Sᵀ(b⊙k) − w⊙v‖²`` before the token (undecayed) and after."""
    a = run.args
    q, k = (x.double() for x in _qk(run))
    v, g, b, w = (a[n].double() for n in ("v", "g", "b", "w"))
    B, T, H, K = k.shape
    S = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64, device=k.device)
    before = torch.empty(B, T, H, dtype=torch.float64, device=k.device)
    after = torch.empty_like(before)
    o = torch.empty(B, T, H, v.shape[-1], dtype=torch.float64, device=k.device)
    for t in range(T):
        kt, bk, target = k[:, t], b[:, t] * k[:, t], w[:, t] * v[:, t]
        before[:, t] = 0.5 * (torch.einsum("bhkv,bhk->bhv", S, bk) - target).square().sum(-1)
        S = S * g[:, t].exp()[..., :, None]
        S = S - kt[..., :, None] * torch.einsum("bhkv,bhk->bhv", S, bk)[..., None, :] \
            + kt[..., :, None] * target[..., None, :]
        after[:, t] = 0.5 * (torch.einsum("bhkv,bhk->bhv", S, bk) - target).square().sum(-1)
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t] * K**-0.5)
    ratio = torch.where(before == 0, torch.ones_like(after), after / torch.where(before == 0, 1.0, before))
    return {"o": o, "final_state": S, "loss_before": before, "ratio": ratio}


def _compare(columns: dict, ref_ratio, ref_before) -> dict:
    seq, head, pos = (columns[n].long() for n in ("sequence", "head", "pos"))
    r_ref, b_ref = ref_ratio.cpu()[seq, pos, head], ref_before.cpu()[seq, pos, head]
    got = columns["residual_ratio"].double()
    ok = b_ref > 1e-6 * b_ref.median()
    diff = (got - r_ref).abs()[ok] / r_ref[ok].abs().clamp_min(RATIO_FLOOR)
    geo = lambda x: float(x.clamp_min(1e-30).log().mean().exp())  # noqa: E731
    return {"p99": float(torch.quantile(diff, 0.99)), "n": int(ok.sum()), "total": ok.numel(),
            "q_geo_rel": abs(geo(got) - geo(r_ref)) / geo(r_ref)}


def _model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from osdn_diag.models import GDN2Config

    config = GDN2Config(hidden_size=512, num_hidden_layers=LAYERS, num_heads=4, head_dim=128, vocab_size=VOCAB)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device=DEVICE, dtype=DTYPE).eval()


@pytest.fixture(scope="module")
def model_run():
    model = _model()
    memo = {}

    def get(path: str):
        if path not in memo:
            gen = torch.Generator(device=DEVICE).manual_seed(3000 + PATHS.index(path))
            ids = torch.randint(0, VOCAB, (BATCH, LENGTHS[path]), device=DEVICE, generator=gen)
            with torch.no_grad():
                plain = model(ids).logits
                again = model(ids).logits
                with _spy() as runs, capture(model, kernels="fla") as cap:
                    hooked = model(ids).logits
            memo[path] = (plain, again, hooked, runs, cap.calls)
        return memo[path]

    return get


def _pairs(path, model_run):
    *_, runs, calls = model_run(path)
    assert len(runs) == len(calls) == LAYERS, (len(runs), len(calls))
    for run, call in zip(runs, calls):
        assert run.path == path and call.kernel == SITES[path] and call.family == "gdn2"
        assert call.flags["kernels"] == "fla" and call.flags["device"] == torch.device(DEVICE).type
    return list(zip(runs, calls))


@pytest.mark.parametrize("path", PATHS)
def test_every_layer_records_what_the_kernel_consumed(path, model_run):
    dtype_name = str(DTYPE).removeprefix("torch.")
    for run, call in _pairs(path, model_run):
        a = run.args
        assert call.input_dtype == dtype_name
        q_hat, k_hat = _qk(run)
        if path == "chunk":
            assert len(run.stored) == 2, "chunk_gdn2 normalises q and k with l2norm_fwd"
            assert torch.equal(run.stored_inputs[0], a["q"]) and torch.equal(run.stored_inputs[1], a["k"])
            assert run.stored[0].dtype == run.stored[1].dtype == DTYPE
            assert torch.equal(call.q, q_hat) and torch.equal(call.write_key, k_hat)
            assert call.flags["qk_read_as"] == dtype_name
        else:
            assert not run.stored
            torch.testing.assert_close(call.q, q_hat, rtol=0, atol=1e-6)
            torch.testing.assert_close(call.write_key, k_hat, rtol=0, atol=1e-6)
            if DTYPE != torch.float32:
                assert not torch.equal(call.write_key, call.write_key.to(DTYPE).float()), "k̂ was rounded"
            assert call.flags["qk_read_as"] == "float32"
        # The read key and target as the kernels form them: fp32 products of what they loaded.
        assert torch.equal(call.k, a["b"].float() * call.write_key), "read key is not b ⊙ k̂"
        assert torch.equal(call.v, a["w"].float() * a["v"].float()), "target is not w ⊙ v"
        assert torch.equal(call.extra["b"], a["b"].float()) and torch.equal(call.extra["w"], a["w"].float())
        assert torch.all(call.beta == 1)
        assert torch.equal(call.g, a["g"].float())
        assert a["output_final_state"] is True
        assert torch.equal(call.final_state, run.out[1].transpose(-1, -2).float())


@pytest.mark.parametrize("path", PATHS)
def test_every_layer_replays_like_the_fp64_loop(path, model_run):
    for run, call in _pairs(path, model_run):
        ref = _fp64_gdn2(run)
        o_err = float((ref["o"] - run.out[0].double()).norm() / run.out[0].double().norm())
        Sk = run.out[1].double()
        s_err = float(((ref["final_state"] - Sk).square().sum((-2, -1)).sqrt()
                       / Sk.square().sum((-2, -1)).sqrt()).max())
        res = replay_call(call, backend="triton")  # raises FidelityError above the default tolerances
        cmp = _compare(res.columns, ref["ratio"], ref["loss_before"])
        units = math.nan if res.state_rounding_units is None else res.state_rounding_units
        print(f"[gdn2-gpu] {path} layer {call.layer}: fidelity {res.fidelity:.3g} (tol {res.tolerance:.1g}) "
              f"state {res.state_fidelity:.3g} (tol {res.state_tolerance:.1g}, {units:.3g} units) | "
              f"loop vs kernel: o {o_err:.3g} state {s_err:.3g} | ratio p99 {cmp['p99']:.3g} "
              f"q_geo {cmp['q_geo_rel']:.3g}", flush=True)
        tol = KERNEL_TOLERANCE[path]
        assert o_err <= tol["o"] and s_err <= tol["state"], (o_err, s_err)
        assert res.state_fidelity is not None
        assert cmp["n"] >= 0.9 * cmp["total"], cmp
        assert cmp["p99"] <= 1e-5, cmp
        assert cmp["q_geo_rel"] <= 1e-6, cmp


@pytest.mark.parametrize("path", PATHS)
def test_capture_leaves_the_logits_bitwise_unchanged(path, model_run):
    plain, again, hooked, _, _ = model_run(path)
    assert torch.equal(again, plain), "the model is not deterministic run to run"
    assert torch.equal(hooked, plain), "capture changed the model's logits"
