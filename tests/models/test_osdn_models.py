"""The OSDN / OSGDN language models (:mod:`osdn_diag.models`): Auto-class registration and
save/load, equality with fla's DeltaNet / GatedDeltaNet models at η = 0, initialisation, training
gradients and cached generation.

Tiny fp32 models (hidden 32, 2 layers, vocab 64, 2 heads of 16) on CPU under Triton's interpreter,
T ≤ 16. fla's fused cross-entropy refuses CPU tensors, so the configs turn it off. Grouped value
heads are exercised by the layer tests (tests/layers/test_osgdn_layer.py); here they would only
double the interpreter's work.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.usefixtures("fla_interpreter")

VOCAB = 64
COMMON = dict(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB, fuse_cross_entropy=False)
KINDS = {
    # kind: (our config kwargs beyond COMMON, fla's config class name)
    "osdn": (dict(num_heads=2), "DeltaNetConfig"),
    "osgdn": (dict(num_heads=2, head_dim=16, expand_v=1.0), "GatedDeltaNetConfig"),
}


def _config(kind, **kw):
    from osdn_diag.models import OSDNConfig, OSGDNConfig

    cls = OSDNConfig if kind == "osdn" else OSGDNConfig
    return cls(**COMMON, **KINDS[kind][0], **kw)


def _model(kind, seed=0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_config(kind, **kw))


def _osdn_layers(model):
    return [block.attn for block in model.model.layers]


def _perturb_osdn_params(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in _osdn_layers(model):
            if layer.apf:
                layer.r_proj.weight.copy_(0.05 * torch.randn(layer.r_proj.weight.shape, generator=g))
                layer.r_proj.bias.fill_(2.0)
            if layer.learn_d0:
                layer.d0.copy_(1 + 0.3 * torch.rand(layer.d0.shape, generator=g))


def _ids(B=1, T=16, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def test_importing_osdn_diag_models_prepares_fla_and_registers():
    """The command line (osdn_diag, osdn_diag.cli) imports neither fla nor triton, so its argument
    checks answer at once; importing osdn_diag.models imports fla — on a machine without CUDA after
    switching Triton's interpreter on, which must precede fla's import — and registers the models."""
    code = ("import os, sys, osdn_diag, osdn_diag.cli\n"
            "assert not ({'fla', 'triton'} & set(sys.modules)), sorted({'fla', 'triton'} & set(sys.modules))\n"
            "import osdn_diag.models\n"
            "from transformers import CONFIG_MAPPING\n"
            "print(os.environ.get('TRITON_INTERPRET'), 'fla' in sys.modules, 'osdn' in CONFIG_MAPPING)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    interpret = "None" if torch.cuda.is_available() else "1"
    assert out.stdout.strip().splitlines()[-1] == f"{interpret} True True"


def test_classes_are_registered_with_the_auto_classes():
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    import osdn_diag.models as models

    for kind, prefix in (("osdn", "OSDN"), ("osgdn", "OSGDN")):
        config = AutoConfig.for_model(kind, **COMMON, **KINDS[kind][0])
        assert type(config) is getattr(models, f"{prefix}Config")
        assert type(AutoModel.from_config(config)) is getattr(models, f"{prefix}Model")
        assert type(AutoModelForCausalLM.from_config(config)) is getattr(models, f"{prefix}ForCausalLM")


@pytest.mark.parametrize("kind", ["osdn", "osgdn"])
def test_save_pretrained_then_auto_load_gives_identical_model(kind, tmp_path):
    """safetensors round trip through AutoModelForCausalLM: same class, same config (phase-1 fields
    included), every tensor (r_proj and d0 too: loading must not re-initialise them), same logits."""
    from transformers import AutoModelForCausalLM

    model = _model(kind, eta=0.2, d_max=3.0, beta_aware=False, apf=True, learn_d0=True,
                   phase1_method="parallel").eval()
    _perturb_osdn_params(model)
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert list(tmp_path.glob("*.safetensors"))

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model) and loaded.config.model_type == kind
    for name in ("eta", "d_max", "beta_aware", "apf", "learn_d0", "phase1_method"):
        assert getattr(loaded.config, name) == getattr(model.config, name), name
    assert {layer.phase1_method for layer in _osdn_layers(loaded)} == {"parallel"}
    want, got = model.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["osdn", "osgdn"])
def test_a_bad_phase1_argument_fails_at_the_config(kind):
    with pytest.raises(ValueError, match="'phase1_method'"):
        _config(kind, phase1_method="fast")


@pytest.mark.parametrize("kind", ["osdn", "osgdn"])
def test_eta0_equals_fla_model_with_copied_weights(kind):
    """With η = 0 (d ≡ 1) the model is fla's DeltaNet / GatedDeltaNet model: fla's state dict loads
    strictly and the logits and the loss agree."""
    import fla.models
    from transformers import AutoModelForCausalLM

    fla_config = getattr(fla.models, KINDS[kind][1])(**COMMON, **KINDS[kind][0])
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(fla_config)
    assert type(ref).__name__ == {"osdn": "DeltaNetForCausalLM", "osgdn": "GatedDeltaNetForCausalLM"}[kind]
    ours = _model(kind, seed=1, eta=0.0)
    ours.load_state_dict(ref.state_dict(), strict=True)
    ids = _ids()
    with torch.no_grad():
        want, got = ref.eval()(ids, labels=ids), ours.eval()(ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("learn_d0", [True, False], ids=["with_d0", "apf_only"])
@pytest.mark.parametrize("kind", ["osdn", "osgdn"])
def test_osdn_parameter_init_survives_post_init(kind, learn_d0):
    """fla's _init_weights re-draws every Linear; the APF projection must still end at weight 0 and
    bias logit(0.999), and d0 at 1 clamped into the box — while the other weights did get fla's init.
    Without d0 an OSDN layer holds no parameter of its own, and transformers then never hands it to
    _init_weights: the gate must be recognised by itself."""
    model = _model(kind, apf=True, learn_d0=learn_d0, d_min=1.5, d_max=3.0)
    std = model.config.initializer_range
    for layer in _osdn_layers(model):
        assert torch.all(layer.r_proj.weight == 0)
        torch.testing.assert_close(layer.r_proj.bias, torch.full_like(layer.r_proj.bias, math.log(999)))
        if learn_d0:
            assert torch.all(layer.d0 == 1.5)
        assert abs(layer.q_proj.weight.std().item() - std) < 0.3 * std  # fla's normal(0, 0.02)


@pytest.mark.parametrize("kind", ["osdn", "osgdn"])
def test_loss_is_finite_and_every_parameter_gets_a_finite_gradient(kind):
    model = _model(kind, eta=0.1, apf=True, learn_d0=True).train()
    ids = _ids(B=1)
    loss = model(ids, labels=ids).loss
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    for layer in _osdn_layers(model):
        for p in (layer.r_proj.weight, layer.r_proj.bias, layer.d0):
            assert p.grad.abs().max() > 0


def test_cached_generation_equals_one_full_forward():
    """generate() (prefill, then one token at a time through fla's Cache carrying S, d and the conv
    states) produces, at every step, the logits of one uncached pass over the final sequence — and
    so picks that pass's greedy tokens."""
    model = _model("osdn", eta=0.5, apf=True, learn_d0=True, eos_token_id=None).eval()
    _perturb_osdn_params(model)
    ids = _ids(B=2, T=8, seed=3)
    T = ids.shape[1]
    with torch.no_grad():
        # an explicit all-ones mask: generate() would otherwise mask every prompt token equal to pad
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        full = model(out.sequences, use_cache=False).logits
    assert out.sequences.shape == (2, T + 3)
    for i, step_logits in enumerate(out.logits):
        torch.testing.assert_close(step_logits, full[:, T - 1 + i], rtol=1e-4, atol=1e-5)
    assert torch.equal(out.sequences[:, T:], full[:, T - 1:-1].argmax(-1))
