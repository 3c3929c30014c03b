"""Capture on transformers' delta-rule models when they run their torch fallback (fla hidden), and
what capture does with padded batches and with layers whose forward it cannot see.

The fallback is bound the way transformers binds it on a machine without fla:
``use_kernel_func_from_hub_with_fallback(<fla name>, "fla")`` applied to the modeling file's torch
function while ``import fla`` fails (``_hf_models.fallback_bound``). Tiny random models (three
linear-attention layers, then full attention) run a prompt and one cached decoding step, plainly
and under capture. Ground truth as in ``test_hf_capture_fla.py`` (``_hf_oracle``); plain torch, no
Triton, so these run in well under a second each.
"""

from __future__ import annotations

import pytest
import torch

from _hf_models import MODELS, decode_step, fallback_bound, tiny_model, torch_on_cpu
from _hf_oracle import (
    consumed,
    fp64_delta_rule,
    ratio_error,
    relative_error,
    spy_fallback_qk,
    spy_kernel_calls,
)
from osdn_diag.capture import transformers_sites as hf
from osdn_diag.capture.context import capture
from osdn_diag.replay import replay_call

LAYERS = ("linear_attention",) * 3 + ("full_attention",)
TOL = 1e-5


def _bind_fallback(monkeypatch, model: str) -> None:
    module = MODELS[model][1]
    for name, fn in fallback_bound(model).items():
        monkeypatch.setattr(f"{module}.{name}", fn)


@pytest.mark.parametrize("model", list(MODELS))
def test_torch_fallback_is_captured(monkeypatch, model):
    net = tiny_model(model, LAYERS, seed=3)
    _bind_fallback(monkeypatch, model)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(3, net.config.vocab_size, (2, 16), generator=gen)
    step = torch.randint(3, net.config.vocab_size, (2, 1), generator=gen)

    def forward():
        out = net(ids, use_cache=True)
        return [out.logits, decode_step(net, step, out.past_key_values).logits]

    _, module, names = MODELS[model]
    with torch.no_grad():
        plain = forward()
        with capture(net) as cap, spy_kernel_calls(module, names) as raw, spy_fallback_qk(module) as qk:
            hooked = forward()
    for a, b in zip(plain, hooked):
        assert torch.equal(a, b)
    assert cap.skipped == [{"layer": 3, "type": "full_attention"}]
    assert [c.layer for c in cap.calls] == [0, 1, 2, 0, 1, 2]
    assert [c.kernel for c in cap.calls] == [names[0]] * 3 + [names[1]] * 3
    assert [c.flags["path"] for c in cap.calls] == ["chunk"] * 3 + ["fused_recurrent"] * 3
    assert len(qk) == len(raw) == 6
    for call, rec, normalised in zip(cap.calls, raw, qk):
        assert call.flags["kernels"] == "torch" and call.flags["implementation"] == f"{module}.{rec.name}"
        assert call.flags["qk_read_as"] == "float32"
        want = consumed(rec, stored_qk=normalised)
        for name in ("q", "k"):  # what the fallback's own fp32 normalisation returned, bit for bit
            assert torch.equal(getattr(call, name), want[name].float()), name
        for name in ("v", "beta", "g"):
            assert torch.equal(getattr(call, name), want[name].float()), name
        if call.flags["path"] == "fused_recurrent":  # the state as it was before the kernel ran
            assert torch.equal(call.initial_state, want["initial_state"].float())
        ref = fp64_delta_rule(want["q"], want["k"], want["v"], want["beta"], want["g"], want["scale"],
                              want["initial_state"])
        assert relative_error(rec.out[0], ref.o) <= TOL
        assert relative_error(rec.out[1].transpose(-1, -2), ref.final_state) <= TOL
        res = replay_call(call)
        B, steps, H = call.beta.shape
        ratio = res.columns["residual_ratio"].reshape(B, H, steps).transpose(1, 2)
        assert ratio_error(ratio, ref.ratio) <= TOL


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_is_recorded_as_its_sequences(monkeypatch, side):
    """A padded batch reaches the kernel padded; the record keeps each row's real tokens, packed,
    equal to the records of the sequences run one by one (the final state only where it is the
    state after the last real token: left padding)."""
    model = "qwen3_next"
    net = tiny_model(model, ("linear_attention", "linear_attention"), seed=4)
    _bind_fallback(monkeypatch, model)
    lengths = (11, 6)
    gen = torch.Generator().manual_seed(9)
    seqs = [torch.randint(3, net.config.vocab_size, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(seqs):
        span = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
        ids[row, span], mask[row, span] = s, 1
    with torch.no_grad():
        with capture(net) as cap:
            net(ids, attention_mask=mask, use_cache=False)
        singles = []
        for s in seqs:
            with capture(net) as one:
                net(s[None], use_cache=False)
            singles.append(one.calls)
    assert [c.layer for c in cap.calls] == [0, 1]
    for i, call in enumerate(cap.calls):
        assert call.cu_seqlens.tolist() == [0, lengths[0], sum(lengths)] and call.k.shape[0] == 1
        assert call.flags["unpadded"] is True
        for row, (start, end) in enumerate(zip(call.cu_seqlens[:-1].tolist(), call.cu_seqlens[1:].tolist())):
            one = singles[row][i]
            for name in ("q", "k", "v", "beta", "g", "o"):
                got, want = getattr(call, name)[:, start:end], getattr(one, name)
                assert relative_error(got, want) <= 1e-6, (name, row)
        if side == "left":
            want = torch.cat([singles[row][i].final_state for row in range(len(seqs))])
            assert relative_error(call.final_state, want) <= 1e-6
        else:
            assert call.final_state is None
        replay_call(call)  # and it replays within the default tolerances


def test_interior_padding_is_refused(monkeypatch):
    net = tiny_model("qwen3_next", ("linear_attention", "full_attention"), seed=4)
    _bind_fallback(monkeypatch, "qwen3_next")
    ids = torch.randint(3, net.config.vocab_size, (2, 8))
    mask = torch.ones_like(ids)
    mask[1, 3] = 0
    with torch.no_grad(), capture(net), pytest.raises(ValueError, match="row 1 has padding between real tokens"):
        net(ids, attention_mask=mask, use_cache=False)


def test_a_layer_that_calls_no_kernel_is_an_error(monkeypatch):
    """A linear-attention layer whose forward was replaced (e.g. by a Hub kernel through kernelize)
    calls nothing capture sees: that is an error, not a capture without that layer."""
    net = tiny_model("qwen3_5", ("linear_attention", "linear_attention", "full_attention"), seed=4)
    layer = net.model.layers[1].linear_attn
    monkeypatch.setattr(layer, "forward", lambda hidden_states, **_: torch.zeros_like(hidden_states))
    ids = torch.randint(3, net.config.vocab_size, (1, 8))
    with torch.no_grad(), capture(net, kernels="reference"), \
            pytest.raises(RuntimeError, match=r"layer 1 \(model.layers.1.linear_attn.*without calling a kernel"):
        net(ids, use_cache=False)


def test_resolve_names_what_runs():
    """What a modeling file's kernel name is bound to: fla's kernel through transformers' wrapper,
    the file's torch function through it (fla missing), either bound directly, or something else."""
    import fla.ops.gated_delta_rule as gdn

    tiny_model("qwen3_next", ("linear_attention", "full_attention"))  # imports the modeling module
    site = next(s for s in hf.SITES if s.model.model_type == "qwen3_next" and s.fla_name == "chunk_gated_delta_rule")
    module = __import__(site.module, fromlist=["x"])
    bound = getattr(module, site.name)
    fallback = fallback_bound("qwen3_next")[site.name]
    torch_fn = hf.kernel_function(bound).__wrapped__
    assert hf.resolve(site, bound).kind == "fla" and hf.resolve(site, bound).fn is gdn.chunk_gated_delta_rule
    assert hf.resolve(site, bound, "cuda").kind == "fla"
    assert hf.resolve(site, fallback).kind == "torch" and hf.resolve(site, fallback).fn is torch_fn
    assert hf.resolve(site, gdn.chunk_gated_delta_rule).kind == "fla"
    assert hf.resolve(site, torch_fn).kind == "torch"
    assert hf.resolve(site, lambda *a, **k: None).kind == "other"
    # transformers 5.25 and later run the torch function on inputs fla's kernels do not run on (the
    # CPU); earlier ones run fla's kernel on any device
    assert hf.resolve(site, bound, "cpu").kind == ("torch" if torch_on_cpu("qwen3_next") else "fla")


def test_a_kernel_module_whose_forward_was_replaced_is_another_implementation():
    """The ``kernels`` package wraps a kernel name in a module whose ``forward`` calls the function it
    holds (``func``): that function is what runs. Once a Hub kernel replaced the module's ``forward``
    (``kernelize``), the module is what runs — neither fla's kernel nor the torch fallback."""
    import fla.ops.gated_delta_rule as gdn

    tiny_model("qwen3_next", ("linear_attention", "full_attention"))
    site = next(s for s in hf.SITES if s.model.model_type == "qwen3_next" and s.fla_name == "chunk_gated_delta_rule")

    def wrap(func):
        class Wrapped(torch.nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)

        return Wrapped()

    wrapped = wrap(gdn.chunk_gated_delta_rule)
    assert hf.kernel_function(wrapped) is gdn.chunk_gated_delta_rule
    assert hf.resolve(site, wrapped).kind == "fla"
    hub_kernel = lambda *args, **kwargs: None  # noqa: E731
    hub_kernel.__module__ = "kernels_hub.gated_delta_rule"
    wrapped.forward = hub_kernel  # what kernelize does to the module
    assert hf.kernel_function(wrapped) is wrapped
    assert hf.resolve(site, wrapped).kind == "other"
    flash = lambda *args, **kwargs: None  # noqa: E731
    flash.__module__ = "flash_linear.ops"  # not fla, whatever its name starts with
    assert hf.resolve(site, flash).kind == "other"
    assert hf.resolve(site, wrap(flash)).kind == "other"


def test_an_implementation_that_does_not_run_on_the_device_resolves_to_the_torch_function():
    """transformers 5.25's wrapper lists the devices its implementation runs on and calls the torch
    function on any other: resolve says so for such a device, and for a listed or unknown device
    names the implementation."""
    import fla.ops.gated_delta_rule as gdn

    tiny_model("qwen3_next", ("linear_attention", "full_attention"))
    site = next(s for s in hf.SITES if s.model.model_type == "qwen3_next" and s.fla_name == "chunk_gated_delta_rule")
    torch_fn = lambda *args, **kwargs: None  # noqa: E731

    def wrapper(implementation, torch_function, supported_devices):
        def bound(*args, **kwargs):
            return (implementation, torch_function, supported_devices)

        return bound

    bound = wrapper(gdn.chunk_gated_delta_rule, torch_fn, ("cuda",))
    assert hf.resolve(site, bound, "cpu").kind == "torch" and hf.resolve(site, bound, "cpu").fn is torch_fn
    assert hf.resolve(site, bound, "cuda").kind == "fla" and hf.resolve(site, bound, None).kind == "fla"
