"""On a GPU, bf16, fla's compiled kernels: generation captured as one stream per prompt
(``Capture.generate``) replays as the same tokens run as one prefill. The prefill of prompt + tokens
takes fla's chunk kernels (above 64 tokens), the decoding steps its fused recurrent kernels, so the
two differ by the kernels' own bf16 rounding: the ratios agree to the tolerance the kernel-exact GPU
tests use between fla's two paths (median 1e-3, p99 5e-2 relative, on tokens with a loss above 1e-3
of the largest), the state is handed from step to step unchanged (hand-off error 0), and the replay
passes its own fidelity checks against the kernels' outputs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import osdn_diag
from osdn_diag.models import load_model

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fla's compiled kernels)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="compiled kernels; TRITON_INTERPRET=1 runs them interpreted"),
]

MODELS = ["random:deltanet-tiny", "random:gated-deltanet-tiny", "random:kda-tiny",
          "random:precond-gated-deltanet-tiny", "random:qwen3.5-tiny", "builtin:lm-osdn"]
N = 24


def _rows(results):
    t = results.table
    cols = {c: t.column(c).to_numpy() for c in ("layer", "head", "pos", "residual_ratio", "loss_before")}
    order = np.lexsort((cols["pos"], cols["head"], cols["layer"]))
    return {c: v[order] for c, v in cols.items()}


@pytest.mark.parametrize("spec", MODELS)
def test_generation_replays_as_one_prefill_in_bf16(spec):
    model = load_model(spec, device="cuda", dtype=torch.bfloat16).model
    prompt = torch.randint(3, 200, (1, 100), generator=torch.Generator().manual_seed(0)).cuda()
    with osdn_diag.capture(model) as cap:
        tokens = cap.generate(prompt, N)
    assert all(c.flags["state_handoff_error"] == 0.0 for c in cap.calls)
    assert all(c.flags["decode_start"] == 100 and c.k.shape[1] == 100 + N for c in cap.calls)
    with osdn_diag.capture(model) as whole, torch.inference_mode():
        model(input_ids=torch.cat([prompt, tokens], 1), use_cache=False)
    res, ref = osdn_diag.replay(cap), osdn_diag.replay(whole)
    got, want = _rows(res), _rows(ref)
    np.testing.assert_array_equal(got["pos"], want["pos"])
    big = want["loss_before"] > 1e-3 * want["loss_before"].max()
    rel = np.abs(got["residual_ratio"] - want["residual_ratio"])[big] / np.maximum(want["residual_ratio"][big], 1e-3)
    print(f"{spec}: decode vs prefill ratios rel median {np.median(rel):.2e} p99 {np.quantile(rel, 0.99):.2e}; "
          f"fidelity {res.summary['fidelity']['max_rel_error']:.2e}; by_phase {res.summary['by_phase']}")
    assert np.median(rel) <= 1e-3 and np.quantile(rel, 0.99) <= 5e-2
    assert res.summary["fidelity"]["measured"]
