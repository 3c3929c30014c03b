"""On a GPU: osdn_diag.monitor while a model trains under bf16 autocast with fla's compiled kernels.

A 2-layer OSDN and a 2-layer DeltaNet language model (hidden 128, fp32 parameters) train 10 steps under
``torch.autocast("cuda", bfloat16)``, probed every 5 steps with ``autocast=torch.bfloat16``. At each
probe:

(i)   the rows equal a separate measurement of a copy of the model taken at that step: the copy in
      eval mode under the same autocast, captured with fla's kernels and replayed in fp32 (q_geo and
      q_arith per layer and overall within 1e-5 relative, n equal);
(ii)  every module is back in train mode, autograd is on, the CUDA and CPU generators are where they
      were (their states compared byte for byte);
(iii) the values are finite and positive.

The CPU tests (tests/test_monitor.py) cover the bitwise training comparison; here the bf16 path, which
the CPU's Triton interpreter cannot run correctly (its bf16 ``tl.dot`` is wrong).
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fla's compiled kernels)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1: fla's kernels would be interpreted, not compiled"),
    pytest.mark.usefixtures("fla_kernels"),
]

VOCAB = 512


def _model(kind: str):
    import osdn_diag.models  # noqa: F401
    from fla.models import DeltaNetConfig
    from transformers import AutoModelForCausalLM

    from osdn_diag.models import OSDNConfig

    common = dict(hidden_size=128, num_hidden_layers=2, num_heads=2, vocab_size=VOCAB, intermediate_size=256,
                  fuse_cross_entropy=False)
    cfg = OSDNConfig(**common, eta=0.03) if kind == "osdn" else DeltaNetConfig(**common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).cuda().train()


def _measure(model, probe):
    import osdn_diag

    twin = copy.deepcopy(model).eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16), osdn_diag.capture(twin) as cap:
        twin(input_ids=probe)
    return osdn_diag.replay(cap, dtype=torch.float32).summary


@pytest.mark.parametrize("kind", ["osdn", "deltanet"])
def test_bf16_autocast_training_probe_equals_a_separate_measurement(kind, tmp_path):
    from osdn_diag.monitor import Monitor

    model = _model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    probe = (torch.arange(2 * 128, device="cuda").reshape(2, 128) * 7) % VOCAB
    mon = Monitor(model, probe, every=5, out=tmp_path, autocast=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for step in range(1, 11):
        ids = torch.randint(0, VOCAB, (4, 128), device="cuda", generator=gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 5:
            continue
        want = _measure(model, probe)
        cuda_rng, cpu_rng = torch.cuda.get_rng_state_all(), torch.get_rng_state()
        rows = mon.step(step)
        assert all(torch.equal(a, b) for a, b in zip(cuda_rng, torch.cuda.get_rng_state_all()))
        assert torch.equal(cpu_rng, torch.get_rng_state())
        assert all(m.training for m in model.modules()) and torch.is_grad_enabled()
        by = {r["layer"]: r for r in rows}
        for layer in (0, 1):
            got, ref = by[layer], want["by_layer"][f"{layer:03d}"]
            for key in ("q_geo", "q_arith"):
                assert math.isfinite(got[key]) and got[key] > 0
                assert abs(got[key] - ref[key]) <= 1e-5 * abs(ref[key]), (step, layer, key, got[key], ref[key])
            assert got["n"] == ref["n"]
            assert (got["d_mean"] is not None) is (kind == "osdn")
        assert abs(by[-1]["q_geo"] - want["q_geo"]) <= 1e-5 * want["q_geo"]
    assert mon.probes == 2
    print(f"[monitor gpu] {kind}: {mon.overhead()}")
