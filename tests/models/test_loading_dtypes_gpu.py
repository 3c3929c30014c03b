"""On a GPU, in bf16: the model diagnosed is the one ``from_pretrained(DIR, dtype=torch.bfloat16)``
gives, moved to the GPU — same tensors (dtype for dtype, bit for bit), same logits bitwise with fla's
compiled kernels — for every tiny preset (fla's families and transformers' models) saved to a
directory, and a ``random:`` preset built on the GPU holds what its saved copy loads with. The CPU
file (``test_loading_dtypes.py``) checks the tensors in bf16 and the logits in fp32 (the interpreter's
bf16 dot is wrong)."""

from __future__ import annotations

import os

import pytest
import torch

from _saved_presets import TINY, save_tiny_presets, tensors
from osdn_diag.models import load_model

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fla's compiled kernels)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled kernels; TRITON_INTERPRET=1 runs them interpreted"),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_tiny_presets(tmp_path_factory)


@pytest.mark.parametrize("name", TINY)
def test_bf16_on_the_gpu_is_from_pretrained_moved_to_the_gpu(saved, name):
    from transformers import AutoModelForCausalLM

    ours = load_model(str(saved[name]), device="cuda", dtype=torch.bfloat16).model
    ref = AutoModelForCausalLM.from_pretrained(saved[name], dtype=torch.bfloat16).to("cuda").eval()
    got, want = tensors(ours), tensors(ref)
    assert set(got) == set(want)
    assert {n: got[n].dtype for n in want} == {n: want[n].dtype for n in want}
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
    ids = torch.randint(3, 200, (2, 80), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.inference_mode():
        assert torch.equal(ours(input_ids=ids, use_cache=False).logits, ref(input_ids=ids, use_cache=False).logits)


@pytest.mark.parametrize("name", ["gated-deltanet-tiny", "kimi-linear-tiny", "deltanet-tiny"])
def test_a_random_preset_built_on_the_gpu_holds_its_saved_copys_dtypes(tmp_path, name):
    from transformers import AutoModelForCausalLM

    built = load_model(f"random:{name}", device="cuda", dtype=torch.float32).model
    built.save_pretrained(tmp_path)
    ours = load_model(f"random:{name}", device="cuda", dtype=torch.bfloat16).model
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).to("cuda")
    got, want = tensors(ours), tensors(ref)
    assert {n: got[n].dtype for n in want} == {n: want[n].dtype for n in want}
    assert [n for n in want if not torch.equal(got[n], want[n])] == []
