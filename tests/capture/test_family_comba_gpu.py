"""On a GPU: fla's compiled Comba kernels in a bf16 model — each layer's record is what the kernel
consumed, its replay agrees with an fp64 replay of that, and capture leaves the logits unchanged.

Mirrors ``test_kernel_exact_gpu.py`` for the Comba family: a 2-layer bf16 ``CombaForCausalLM``
(hidden 512, 4 heads of 128 keys and 256 values), batch 2, on the chunk path (T = 1024, no grad) and
the fused recurrent path (T = 64, no grad). At every layer:

(i)   the record holds what the recurrence consumed: on the chunk path the stored ``l2norm_fwd``
      outputs bitwise (q̂, k̂, p̂ in bf16, in that order: the record's ``q``, ``write_key`` and ``k``),
      on the fused recurrent path the kernel's fp32 register norm of the raw q, p, k; β and the
      log decay ``g`` as passed; the kernel's fp32 final state, transposed to ``V×K``, bitwise;
(ii)  the package's replay (``backend="triton"``: Comba's torch reference, on the GPU) agrees per
      token with an fp64 loop written here on the consumed tensors: residual ratios within 1e-5
      relative at p99 (relative to max(ratio, 1e-3), over tokens with a non-negligible loss), their
      geometric mean within 1e-6; ``residual_ratio_alt`` likewise;
(iii) the replay passes its own output and final-state checks at their default tolerances (one
      line per layer is printed; run pytest with ``-s`` to keep them);
(iv)  the logits with and without capture are bitwise equal.

The fp64 loop also reproduces the kernel's own output and final state within the tolerances of the
kernel's working precision, which makes it the reference.
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
SITES = {"chunk": "chunk_comba", "fused_recurrent": "fused_recurrent_comba"}
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
    """Spy on the Comba call sites of ``fla.layers.comba`` and on ``l2norm_fwd`` as
    ``fla.ops.comba.chunk`` looks it up; yields the list of :class:`Run`, in call order."""
    runs: list[Run] = []
    current: list[Run] = []
    patched = []

    def site(path, original):
        @functools.wraps(original)
        def spy(*args, **kwargs):
            bound = inspect.signature(original).bind(*args, **kwargs)
            bound.apply_defaults()
            run = Run(path, {k: _keep(v) for k, v in bound.arguments.items()})
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
        ops = importlib.import_module("fla.ops.comba.chunk")
        patched.append((ops, "l2norm_fwd", ops.l2norm_fwd))
        ops.l2norm_fwd = norm(ops.l2norm_fwd)
        layers = importlib.import_module("fla.layers.comba")
        for path, name in SITES.items():
            original = getattr(layers, name)
            patched.append((layers, name, original))
            setattr(layers, name, site(path, original))
        yield runs
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)


def _consumed(run: Run) -> dict:
    """q, p, k (as the recurrence read them), v, β, g in fp64, ``[B, T, H, ·]``."""
    a = run.args
    assert a["use_qk_l2norm_in_kernel"] is True and a.get("initial_state") is None
    if run.path == "chunk":
        q, k, p = run.stored
    else:
        q, k, p = (_register_l2norm(a[n]) for n in ("q", "k", "p"))
    return {"q": q.double(), "p": p.double(), "k": k.double(), "v": a["v"].double(),
            "beta": a["beta"].double(), "g": a["g"].double()}


def _fp64_comba(c: dict) -> dict:
    """Comba from a zero state in fp64, vectorised over ``[B, H]``: ``u = v − S p``;
    ``S ← exp(g) S + β u kᵀ``; ``o = S (q·K^{-1/2})``; losses ``½‖S p − v‖²`` before, after, and
    ``½‖S k − v‖²`` before and after."""
    q, p, k, v, beta, g = (c[n] for n in ("q", "p", "k", "v", "beta", "g"))
    B, T, H, K = k.shape
    S = torch.zeros(B, H, v.shape[-1], K, dtype=torch.float64, device=k.device)
    L = {n: torch.empty(B, T, H, dtype=torch.float64, device=k.device) for n in ("b", "a", "b2", "a2")}
    o = torch.empty(B, T, H, v.shape[-1], dtype=torch.float64, device=k.device)

    def f(state, key, t):
        return 0.5 * (torch.einsum("bhvk,bhk->bhv", state, key[:, t]) - v[:, t]).square().sum(-1)

    for t in range(T):
        L["b"][:, t], L["b2"][:, t] = f(S, p, t), f(S, k, t)
        u = v[:, t] - torch.einsum("bhvk,bhk->bhv", S, p[:, t])
        S = S * g[:, t].exp()[..., None, None] + beta[:, t, :, None, None] * u[..., :, None] * k[:, t, :, None, :]
        L["a"][:, t], L["a2"][:, t] = f(S, p, t), f(S, k, t)
        o[:, t] = torch.einsum("bhvk,bhk->bhv", S, q[:, t] * K**-0.5)

    def ratio(after, before):
        return torch.where(before == 0, torch.ones_like(after), after / torch.where(before == 0, 1.0, before))

    return {"o": o, "final_state": S, "loss_before": L["b"], "ratio": ratio(L["a"], L["b"]),
            "ratio_alt": ratio(L["a2"], L["b2"]), "loss_before_alt": L["b2"]}


def _compare(columns: dict, name: str, ref_ratio, ref_before) -> dict:
    seq, head, pos = (columns[n].long() for n in ("sequence", "head", "pos"))
    r_ref, b_ref = ref_ratio.cpu()[seq, pos, head], ref_before.cpu()[seq, pos, head]
    got = columns[name].double()
    ok = b_ref > 1e-6 * b_ref.median()
    diff = (got - r_ref).abs()[ok] / r_ref[ok].abs().clamp_min(RATIO_FLOOR)
    geo = lambda x: float(x.clamp_min(1e-30).log().mean().exp())  # noqa: E731
    return {"p99": float(torch.quantile(diff, 0.99)), "n": int(ok.sum()), "total": ok.numel(),
            "q_geo_rel": abs(geo(got) - geo(r_ref)) / geo(r_ref)}


def _model() -> torch.nn.Module:
    from fla.models import CombaConfig
    from transformers import AutoModelForCausalLM

    config = CombaConfig(hidden_size=512, num_hidden_layers=LAYERS, num_heads=4, head_dim=128, expand_v=2.0,
                         vocab_size=VOCAB)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device=DEVICE, dtype=DTYPE).eval()


@pytest.fixture(scope="module")
def model_run():
    model = _model()
    memo = {}

    def get(path: str):
        if path not in memo:
            gen = torch.Generator(device=DEVICE).manual_seed(2000 + PATHS.index(path))
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
        assert run.path == path and call.kernel == SITES[path] and call.family == "comba"
        assert call.flags["kernels"] == "fla" and call.flags["device"] == torch.device(DEVICE).type
    return list(zip(runs, calls))


@pytest.mark.parametrize("path", PATHS)
def test_every_layer_records_what_the_kernel_consumed(path, model_run):
    for run, call in _pairs(path, model_run):
        a = run.args
        assert call.input_dtype == str(DTYPE).removeprefix("torch.")
        if path == "chunk":
            assert len(run.stored) == 3, "chunk_comba normalises q, k, p with l2norm_fwd"
            for x_in, name in zip(run.stored_inputs, ("q", "k", "p")):
                assert torch.equal(x_in, a[name]), name
            q_hat, k_hat, p_hat = run.stored
            assert q_hat.dtype == k_hat.dtype == p_hat.dtype == DTYPE
            assert torch.equal(call.q, q_hat.float()), "record's q is not the stored q̂"
            assert torch.equal(call.k, p_hat.float()), "record's read key is not the stored p̂"
            assert torch.equal(call.write_key, k_hat.float()), "record's write key is not the stored k̂"
            assert call.flags["qk_read_as"] == str(DTYPE).removeprefix("torch.")
        else:
            assert not run.stored
            for field, name in (("q", "q"), ("k", "p"), ("write_key", "k")):
                torch.testing.assert_close(getattr(call, field), _register_l2norm(a[name]), rtol=0, atol=1e-6)
            if DTYPE != torch.float32:
                assert not torch.equal(call.k, call.k.to(DTYPE).float()), "record's p was rounded to bf16"
            assert call.flags["qk_read_as"] == "float32"
        assert torch.equal(call.beta, a["beta"].float())
        assert torch.equal(call.g, a["g"].float())
        assert a["output_final_state"] is True
        assert torch.equal(call.final_state, run.out[1].transpose(-1, -2).float())


@pytest.mark.parametrize("path", PATHS)
def test_every_layer_replays_like_the_fp64_loop(path, model_run):
    for run, call in _pairs(path, model_run):
        ref = _fp64_comba(_consumed(run))
        o_err = float((ref["o"] - run.out[0].double()).norm() / run.out[0].double().norm())
        Sk = run.out[1].transpose(-1, -2).double()
        s_err = float(((ref["final_state"] - Sk).square().sum((-2, -1)).sqrt()
                       / Sk.square().sum((-2, -1)).sqrt()).max())
        res = replay_call(call, backend="triton")  # raises FidelityError above the default tolerances
        main = _compare(res.columns, "residual_ratio", ref["ratio"], ref["loss_before"])
        alt = _compare(res.columns, "residual_ratio_alt", ref["ratio_alt"], ref["loss_before_alt"])
        units = math.nan if res.state_rounding_units is None else res.state_rounding_units
        print(f"[comba-gpu] {path} layer {call.layer}: fidelity {res.fidelity:.3g} (tol {res.tolerance:.1g}) "
              f"state {res.state_fidelity:.3g} (tol {res.state_tolerance:.1g}, {units:.3g} units) | "
              f"loop vs kernel: o {o_err:.3g} state {s_err:.3g} | ratio p99 {main['p99']:.3g} "
              f"q_geo {main['q_geo_rel']:.3g} | alt p99 {alt['p99']:.3g}", flush=True)
        tol = KERNEL_TOLERANCE[path]
        assert o_err <= tol["o"] and s_err <= tol["state"], (o_err, s_err)
        assert res.state_fidelity is not None
        for cmp in (main, alt):
            assert cmp["n"] >= 0.9 * cmp["total"], cmp
            assert cmp["p99"] <= 1e-5, cmp
            assert cmp["q_geo_rel"] <= 1e-6, cmp


@pytest.mark.parametrize("path", PATHS)
def test_capture_leaves_the_logits_bitwise_unchanged(path, model_run):
    plain, again, hooked, _, _ = model_run(path)
    assert torch.equal(again, plain), "the model is not deterministic run to run"
    assert torch.equal(hooked, plain), "capture changed the model's logits"
