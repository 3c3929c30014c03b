"""The model diagnosed is the model its user loads: exactly what ``from_pretrained(DIR, dtype=...)`` gives.

transformers keeps some parameters in fp32 whatever ``dtype`` asks: fla's Gated DeltaNet creates
``A_log`` in fp32, and Kimi Linear declares ``_keep_in_fp32_modules_strict`` (its ``dt_bias`` and
MoE router). A cast of the whole model to ``dtype`` after loading changes those parameters, and with
them the gates, the keys and every ratio downstream. Here, for every tiny preset the package ships
(fla's families and transformers' delta-rule models), saved to a directory:

* ``load_model(DIR, dtype)`` holds the same tensors, dtype for dtype and bit for bit, as
  ``from_pretrained(DIR, dtype)``, in bf16 and fp32; a ``random:`` preset in bf16 holds those of its
  own fp32 build saved and loaded in bf16;
* its logits equal ``from_pretrained``'s bitwise (fp32, fla's kernels interpreted on the CPU);
* the parameters kept out of ``dtype`` are listed (:attr:`LoadedModel.kept_dtypes`) and recorded in
  the run's manifest.

The reference side calls transformers' ``AutoModelForCausalLM.from_pretrained`` itself: it shares no
loading code with the package.
"""

from __future__ import annotations

import json

import pytest
import torch

from _saved_presets import TINY, save_tiny_presets, tensors
from osdn_diag.models import load_model

#: parameters transformers keeps in fp32 when a bf16 model is asked for, per preset (those not listed keep none)
KEPT_FP32 = {
    "gated-deltanet-tiny": {"model.layers.0.attn.A_log", "model.layers.1.attn.A_log"},
    "kimi-linear-tiny": {"model.layers.0.self_attn.forget_gate.dt_bias", "model.layers.1.mlp.gate.weight"},
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, fla_kernels):
    return save_tiny_presets(tmp_path_factory)


def _reference(directory, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()


def _assert_same_tensors(got, want, what):
    got, want = tensors(got), tensors(want)
    assert set(got) == set(want), what
    dtypes = {n: (str(got[n].dtype), str(want[n].dtype)) for n in want if got[n].dtype != want[n].dtype}
    assert not dtypes, f"{what}: dtypes differ (ours, transformers'): {dtypes}"
    values = [n for n in want if not torch.equal(got[n].cpu(), want[n].cpu())]
    assert not values, f"{what}: values differ: {values}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", TINY)
def test_a_directory_loads_as_from_pretrained_loads_it(saved, name, dtype):
    loaded = load_model(str(saved[name]), dtype=dtype)
    _assert_same_tensors(loaded.model, _reference(saved[name], dtype), f"{name} in {dtype}")
    kept = set(loaded.kept_dtypes)
    assert kept == {n for n, t in tensors(loaded.model).items() if t.is_floating_point() and t.dtype != dtype}
    assert all(v == "float32" for v in loaded.kept_dtypes.values())


@pytest.mark.parametrize("name", TINY)
def test_a_random_preset_holds_what_its_saved_copy_loads_with(saved, name):
    """``random:NAME`` in bf16 is its fp32 build saved and loaded in bf16, not its fp32 build cast."""
    _assert_same_tensors(load_model(f"random:{name}", dtype=torch.bfloat16).model,
                         _reference(saved[name], torch.bfloat16), f"random:{name} in bf16")


@pytest.mark.parametrize("name", sorted(KEPT_FP32))
def test_what_transformers_keeps_in_fp32_stays_fp32(saved, name):
    """The parameters the audit found cast: named, so that a transformers or fla change that stops
    keeping them is seen here rather than only as a changed reference."""
    for spec in (str(saved[name]), f"random:{name}"):
        kept = load_model(spec, dtype=torch.bfloat16).kept_dtypes
        assert KEPT_FP32[name] <= set(kept), (spec, kept)


@pytest.mark.parametrize("name", TINY)
def test_logits_equal_from_pretrained_bitwise(saved, name):
    ids = torch.tensor([[3, 17, 5, 9, 3, 17]])
    ours = load_model(str(saved[name]), dtype=torch.float32).model
    with torch.inference_mode():
        got = ours(input_ids=ids, use_cache=False).logits
        want = _reference(saved[name], torch.float32)(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, want)


def test_the_run_records_what_is_kept_out_of_the_model_dtype(saved, tmp_path):
    """manifest.json's ``model.kept_dtypes``: the model is diagnosed as loaded, and says so."""
    from osdn_diag.pipeline.session import _CaptureSession

    preloaded = load_model(str(saved["gated-deltanet-tiny"]), dtype=torch.bfloat16)
    # No forward pass (the interpreter's bf16 dot is wrong): the manifest's model entry comes from
    # the load, which capture_run's session records as it finishes.
    session = _CaptureSession(preloaded, "mqar", tmp_path / "run", device="cpu", dtype=None, kernels="auto",
                              batch_size=1, twice=False, num_prompts=1, length=16, seed=0)
    assert session.dtype == torch.bfloat16
    session.finish()
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["model"]["kept_dtypes"] == {"model.layers.0.attn.A_log": "float32",
                                                "model.layers.1.attn.A_log": "float32"}


@pytest.mark.parametrize("stored, given, note", [("bfloat16", None, True), ("bfloat16", "float32", False),
                                                 ("float32", None, False)])
def test_a_default_dtype_other_than_the_checkpoints_is_said(tmp_path, capsys, stored, given, note):
    """On the CPU the default is fp32: a checkpoint whose config.json stores bf16 (which
    ``from_pretrained(DIR)`` without a dtype loads in bf16) is run in fp32 with a note saying so and
    how to run it as stored; an explicit --dtype, or a checkpoint stored in fp32, gets none."""
    import shutil

    from osdn_diag.catalog.builtin import builtin_path
    from osdn_diag.cli import entry

    model = tmp_path / "m"
    shutil.copytree(builtin_path("mqar-deltanet"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "dtype": stored}))
    argv = ["capture", str(model), "--prompts", "mqar", "--num-prompts", "1", "--length", "16",
            "--out", str(tmp_path / "r"), "-q", *(["--dtype", given] if given else [])]
    assert entry(argv) == 0
    err = capsys.readouterr().err
    said = f"{model / 'config.json'} stores the model in bfloat16; it runs in float32, the default on the CPU " \
           "(--dtype bfloat16 runs it as stored)"
    assert (said in err) == note, err
