"""Where a ``random:`` preset is built and initialised (:func:`osdn_diag.models.loading._build_device`):
on the device that runs it, CUDA's generator giving every GPU the same weights; on the CPU for a
``--device-map`` (the model may not fit one GPU) and on the CPU."""

from __future__ import annotations

import torch

from osdn_diag.models import loading


def test_build_device(monkeypatch):
    """cpu stays cpu; a bare "cuda" becomes the current GPU; a device map builds on the CPU."""
    assert loading._build_device("cpu", None) == torch.device("cpu")
    assert loading._build_device(torch.device("cuda", 3), None) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert loading._build_device("cuda", None) == torch.device("cuda", 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert loading._build_device("cuda", "balanced") == torch.device("cpu")


def test_cpu_preset_weights_do_not_depend_on_the_process_state():
    """Seeded in a forked random state on the CPU: the same weights whatever the global generator
    did before, and the global generator left as it was."""
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = loading.load_model("random:deltanet-tiny", seed=5).model.state_dict()
    assert torch.equal(torch.random.get_rng_state(), before)
    torch.rand(7)
    b = loading.load_model("random:deltanet-tiny", seed=5).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_model_loaded_on_the_cpu_needs_no_accelerate(monkeypatch):
    """The README's CPU install (the ``cpu`` extra) has no accelerate, and transformers requires it for
    any ``device_map``: on the CPU, from_pretrained is called without one (the demo failed there)."""
    import transformers

    from osdn_diag.models import load_model

    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    load_model("builtin:mqar-deltanet", device="cpu")
    assert seen and all("device_map" not in kwargs for kwargs in seen), seen
