"""Capture on transformers' delta-rule models with fla's kernels (Triton's interpreter, fp32, CPU).

Qwen3-Next, Qwen3.5, Kimi Linear and OLMo-Hybrid call a kernel name of their modeling file, which
transformers binds to fla's kernel at import. Tiny random models with two decoder layers — full
attention first, then one linear-attention layer (so the captured layer is decoder layer 1, the
first one capture sees) — run a prompt (the chunk kernel, with a cache: the caller asks for the
final state) and one cached decoding step (the fused recurrent kernel, from the cached state),
once plainly and once under ``capture(kernels="fla")``. Ground truth comes from
``_hf_oracle``: the raw arguments the layer passed, fla's stored ``l2norm_fwd`` outputs, and an fp64
replay of what the recurrence consumed. For every model:

* the logits (prompt and decoding step) are bitwise those of the plain run;
* the records are numbered by decoder layer (1), name fla's kernels and paths, and the
  full-attention layer 0 is listed as skipped;
* the record holds what the recurrence read: q and k bitwise what the chunk kernel stored, or within
  1e-6 of the kernel's fp32 normalisation on the fused path (grouped value heads expanded); v, β,
  g bitwise as passed; the decoding step's initial state as it was *before* the kernel ran (the
  cache overwrites that buffer in place);
* the fp64 replay of those tensors reproduces the kernels' outputs and final states (1e-5), and
  the package's replay agrees with it per token (residual ratios, 1e-5 relative to max(q, 1e-3)).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _hf_models import MODELS, decode_step, fla_on_cpu, tiny_model
from _hf_oracle import consumed, fp64_delta_rule, ratio_error, relative_error, spy_kernel_calls, spy_stored_qk
from osdn_diag.capture.context import capture
from osdn_diag.replay import replay_call

pytestmark = pytest.mark.usefixtures("fla_interpreter")

LAYERS = ("full_attention", "linear_attention")
T = 20
TOL = 1e-5


@dataclasses.dataclass
class Run:
    plain: list  # logits: prompt, decoding step
    hooked: list
    calls: list  # KernelCall records
    raw: list    # _hf_oracle.RawCall per kernel call
    stored: list  # (q̂, k̂) per chunk-kernel call
    skipped: list


@pytest.fixture(scope="module")
def runs():
    memo = {}

    def get(model: str) -> Run:
        if model not in memo:
            net = tiny_model(model, LAYERS, seed=7)
            vocab = net.config.vocab_size
            gen = torch.Generator().manual_seed(11)
            ids = torch.randint(3, vocab, (1, T), generator=gen)
            step = torch.randint(3, vocab, (1, 1), generator=gen)

            def forward():
                out = net(ids, use_cache=True)
                nxt = decode_step(net, step, out.past_key_values)
                return [out.logits, nxt.logits]

            _, module, names = MODELS[model]
            with torch.no_grad(), fla_on_cpu(model):
                plain = forward()
                with capture(net, kernels="fla") as cap, spy_kernel_calls(module, names) as raw, \
                        spy_stored_qk() as stored:
                    hooked = forward()
            memo[model] = Run(plain, hooked, list(cap.calls), raw, stored, cap.skipped)
        return memo[model]

    return get


@pytest.mark.parametrize("model", list(MODELS))
def test_capture_records_what_fla_consumed(runs, model):
    run = runs(model)
    for plain, hooked in zip(run.plain, run.hooked):
        assert torch.equal(plain, hooked)
    assert run.skipped == [{"layer": 0, "type": "full_attention"}]
    assert [c.layer for c in run.calls] == [1, 1] and [c.forward for c in run.calls] == [0, 1]
    assert [c.flags["path"] for c in run.calls] == ["chunk", "fused_recurrent"]
    assert all(c.flags["kernels"] == "fla" and c.flags["implementation"].startswith("fla.ops.") for c in run.calls)
    assert len(run.raw) == 2 and len(run.stored) == 1

    for i, (call, raw) in enumerate(zip(run.calls, run.raw)):
        # chunk: q̂, k̂ as l2norm_fwd stored them (bitwise); fused: normalised in fp32 registers.
        chunk = call.flags["path"] == "chunk"
        want = consumed(raw, stored_qk=run.stored[0] if chunk else None)
        for name in ("q", "k"):
            if chunk:
                assert torch.equal(getattr(call, name), want[name].float())
            else:
                assert relative_error(getattr(call, name), want[name]) <= 1e-6
        assert torch.equal(call.v, raw.args["value"].float())
        assert torch.equal(call.beta, raw.args["beta"].float())
        assert torch.equal(call.g, raw.args["g"].float())
        if i == 1:  # the decoding step starts from the prompt's cached state, as it was then
            assert torch.equal(call.initial_state, raw.args["initial_state"].transpose(-1, -2).float())

        ref = fp64_delta_rule(want["q"], want["k"], want["v"], want["beta"], want["g"], want["scale"],
                              want["initial_state"])
        assert relative_error(raw.out[0], ref.o) <= TOL
        assert relative_error(raw.out[1].transpose(-1, -2), ref.final_state) <= TOL
        res = replay_call(call)
        B, steps, H = call.beta.shape  # the table is in (sequence, head, position) order
        ratio = res.columns["residual_ratio"].reshape(B, H, steps).transpose(1, 2)
        assert ratio_error(ratio, ref.ratio) <= TOL
        assert res.fidelity <= TOL and res.state_fidelity <= 1e-4
