"""`osdn-diag run --kernels fla` on a tiny saved MomentumDeltaNet model, and the tiny preset.

The model (the package's :class:`osdn_diag.models.MomentumDeltaNetConfig` around fla's layer, two
layers, hidden 64, two heads of 16 — fla 0.6.0 ships no model class for this layer) is saved to a
directory and run through the command line with fla's own momentum kernel (its fused recurrent path:
prompts of at most 64 tokens, fp32 — the chunk path refuses fp32), one prompt per forward pass (the
layer takes no attention mask). A plain fp64 loop written here, from the tensors stored in the
capture shards (q, k, v, β, log α, log μ, the write key η k and residual key α k) and nothing of the
package, must reproduce the kernel's output, final state and momentum buffer and every token's
``loss_before``, ``loss_after``, ``residual_ratio`` and ``residual_ratio_post`` in residuals.parquet.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from osdn_diag.cli import main

pytestmark = pytest.mark.usefixtures("fla_interpreter")

LENGTHS = (40, 27)


def _save_model(directory: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from osdn_diag.models import MomentumDeltaNetConfig

    config = MomentumDeltaNetConfig(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=16, vocab_size=256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return directory


def _shards(run: Path):
    from safetensors import safe_open

    manifest = json.loads((run / "manifest.json").read_text())
    out = []
    for name in sorted(manifest["shards"]):
        with safe_open(str(run / name), "pt") as f:
            meta = f.metadata()
            out.append((json.loads(meta["call"]), json.loads(meta["prompts"]), {k: f.get_tensor(k) for k in f.keys()}))
    return manifest, out


def _fp64_momentum(x: dict, scale: float):
    """One sequence ``[T, H, ·]``, all heads, fp64, S and M stored V×K from zero:
    r = S p̃ − v; M ← μ M + r k̃ᵀ; S ← α S − β M; o = S (scale q); losses ½‖S k − v‖²."""
    T, H, K = x["k"].shape
    Vd = x["v"].shape[-1]
    S = torch.zeros(H, Vd, K, dtype=torch.float64)
    M = torch.zeros_like(S)
    o = torch.zeros(T, H, Vd, dtype=torch.float64)
    L = {n: torch.zeros(T, H, dtype=torch.float64) for n in ("before", "decayed", "after")}
    apply = lambda A, y: torch.einsum("hvk,hk->hv", A, y)  # noqa: E731
    for t in range(T):
        alpha, mu, beta = x["g"][t].exp(), x["extra.log_mu"][t].exp(), x["beta"][t]
        k, v = x["k"][t], x["v"][t]
        L["before"][t] = 0.5 * (apply(S, k) - v).square().sum(-1)
        L["decayed"][t] = 0.5 * (apply(alpha[:, None, None] * S, k) - v).square().sum(-1)
        r = apply(S, x["extra.residual_key"][t]) - v
        M = mu[:, None, None] * M + r[:, :, None] * x["write_key"][t][:, None, :]
        S = alpha[:, None, None] * S - beta[:, None, None] * M
        L["after"][t] = 0.5 * (apply(S, k) - v).square().sum(-1)
        o[t] = apply(S, scale * x["q"][t])
    return o, S, M, L


def test_fla_run_matches_the_fp64_loop(tmp_path):
    gen = torch.Generator().manual_seed(1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": torch.randint(3, 256, (n,), generator=gen).tolist(),
                                             "task": f"len{n}"}) for n in LENGTHS))
    run = tmp_path / "run"
    argv = ["run", str(_save_model(tmp_path / "model")), "--prompts", str(prompts), "--out", str(run),
            "--kernels", "fla", "--device", "cpu", "--dtype", "fp32", "--batch-size", "1", "-q"]
    assert main(argv) == 0
    manifest, shards = _shards(run)
    assert manifest["kernels"] == ["fla"]
    assert {(la["family"], la["kernel"]) for la in manifest["layers"]} == {
        ("momentum_delta_rule", "fused_recurrent_momentum_delta_rule")}
    summary = json.loads((run / "summary.json").read_text())
    assert 0 <= summary["fidelity"]["max_rel_error"] <= 1e-5
    assert 0 <= summary["fidelity"]["state"]["max_rel_error"] <= 1e-5
    assert "momentum_delta_rule" in summary["by_family"]
    table = pq.read_table(run / "residuals.parquet").to_pydict()
    rows = {key: i for i, key in enumerate(zip(table["prompt"], table["layer"], table["head"], table["pos"]))}
    checked = 0
    assert len(shards) == len(LENGTHS) * 2
    for meta, (prompt,), tensors in shards:
        x = {n: t[0].double() for n, t in tensors.items() if t.dim() >= 3 and n not in ("final_state",)}
        o, S, M, L = _fp64_momentum(x, meta["scale"])
        assert float((tensors["o"][0].double() - o).norm() / o.norm()) <= 1e-5
        assert float((tensors["final_state"][0].double() - S).norm() / S.norm()) <= 1e-5
        assert float((tensors["extra.final_momentum"][0].double() - M).norm() / M.norm()) <= 1e-5
        for h in range(o.shape[1]):
            idx = [rows[(prompt, meta["layer"], h, t)] for t in range(o.shape[0])]
            want = {"loss_before": L["before"][:, h], "loss_after": L["after"][:, h],
                    "loss_before_decayed": L["decayed"][:, h],
                    "residual_ratio": L["after"][:, h] / L["before"][:, h],
                    "residual_ratio_post": L["after"][:, h] / L["decayed"][:, h]}
            for c, w in want.items():
                got = torch.tensor([table[c][i] for i in idx], dtype=torch.float64)
                assert float(((got - w).abs() / w.abs()).max()) <= 1e-5, (c, prompt, meta["layer"], h)
            checked += len(idx)
    assert checked == len(table["prompt"]) == sum(LENGTHS) * 2 * 2


def test_tiny_preset_runs(tmp_path):
    run = tmp_path / "run"
    assert main(["run", "random:momentum-deltanet-tiny", "--prompts", "random", "--num-prompts", "1",
                 "--length", "24", "--out", str(run), "--device", "cpu", "-q"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["n"] == 24 * 2 * 2 and 0 < summary["q_geo"] < 1
