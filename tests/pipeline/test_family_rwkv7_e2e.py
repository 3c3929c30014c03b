"""`osdn-diag run --kernels fla` on a tiny saved RWKV-7 model, and the tiny preset.

fla's ``RWKV7ForCausalLM`` (two layers, hidden 64, two heads of 32) is saved to a directory and run
through the command line with fla's own kernel — its fused recurrent path (``fused_mul_recurrent_rwkv7``:
the layer takes it below 64 tokens without grad; fla's chunk DPLR kernel is only ~3e-5 accurate in
fp32, above the fp32 fidelity tolerance, see tests/capture/test_family_rwkv7.py) — on two prompts of
different lengths in one batch (the layer masks the padded batch instead of unpadding it; capture
unpads its records, so that the padded positions are not counted as tokens). A plain fp64 loop written here, from the tensors stored in the
capture shards (r, the removal key κ̂, b = κ̂ ⊙ α, the write key, v, w) and nothing of the package,
must reproduce the kernel's output and every token's ``loss_before``, ``loss_after``,
``residual_ratio``, ``residual_ratio_post`` (removal key) and ``residual_ratio_alt`` (write key).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from osdn_diag.cli import main

pytestmark = [pytest.mark.usefixtures("fla_interpreter"), pytest.mark.filterwarnings("ignore::UserWarning")]

LENGTHS = (40, 27)


def _save_model(directory: Path) -> Path:
    from fla.models import RWKV7Config
    from transformers import AutoModelForCausalLM

    config = RWKV7Config(hidden_size=64, num_hidden_layers=2, head_dim=32, decay_low_rank_dim=16,
                         gate_low_rank_dim=16, a_low_rank_dim=16, v_low_rank_dim=16, vocab_size=256)
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


def _fp64_rwkv7(x: dict, scale: float):
    """One sequence ``[T, H, ·]``, all heads, S stored V×K from zero:
    S ← S·Diag(exp w) − (S κ̂)(κ̂ ⊙ α)ᵀ + v kᵀ; losses ½‖S x − v‖² for x = κ̂ and x = k."""
    T, H, K = x["k"].shape
    S = torch.zeros(H, x["v"].shape[-1], K, dtype=torch.float64)
    o = torch.zeros(T, H, x["v"].shape[-1], dtype=torch.float64)
    names = ("before", "decayed", "after", "before_k", "after_k", "own_before", "own_decayed", "own_after", "scale")
    L = {n: torch.zeros(T, H, dtype=torch.float64) for n in names}
    apply = lambda A, y: torch.einsum("hvk,hk->hv", A, y)  # noqa: E731
    for t in range(T):
        kh, k, v = x["k"][t], x["write_key"][t], x["v"][t]
        loss = lambda A, key: 0.5 * (apply(A, key) - v).square().sum(-1)  # noqa: E731
        # The update's own target along κ̂: y = (c_k / c_b) v, c_k = ⟨k, κ̂⟩, c_b = ⟨κ̂ ⊙ α, κ̂⟩.
        c = (k * kh).sum(-1) / (x["extra.b"][t] * kh).sum(-1)
        own = lambda A: 0.5 * (apply(A, kh) - c[:, None] * v).square().sum(-1)  # noqa: E731
        L["before"][t], L["before_k"][t], L["own_before"][t], L["scale"][t] = loss(S, kh), loss(S, k), own(S), c
        S_dec = S * x["g"][t].exp()[:, None, :]
        L["decayed"][t], L["own_decayed"][t] = loss(S_dec, kh), own(S_dec)
        S = S_dec - apply(S, kh)[:, :, None] * x["extra.b"][t][:, None, :] + v[:, :, None] * k[:, None, :]
        L["after"][t], L["after_k"][t], L["own_after"][t] = loss(S, kh), loss(S, k), own(S)
        o[t] = apply(S, scale * x["q"][t])
    return o, S, L


def _sequences(prompts, tensors):
    cu = tensors.get("cu_seqlens")
    if cu is None:
        return [(p, b, slice(None)) for b, p in enumerate(prompts)]
    bounds = cu.tolist()
    return [(p, 0, slice(s, e)) for p, s, e in zip(prompts, bounds[:-1], bounds[1:])]


def test_fla_run_matches_the_fp64_loop(tmp_path):
    gen = torch.Generator().manual_seed(1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": torch.randint(3, 256, (n,), generator=gen).tolist(),
                                             "task": f"len{n}"}) for n in LENGTHS))
    run = tmp_path / "run"
    argv = ["run", str(_save_model(tmp_path / "model")), "--prompts", str(prompts), "--out", str(run),
            "--kernels", "fla", "--device", "cpu", "--dtype", "fp32", "--batch-size", "2", "-q"]
    assert main(argv) == 0
    manifest, shards = _shards(run)
    assert manifest["kernels"] == ["fla"]
    assert {(la["family"], la["kernel"]) for la in manifest["layers"]} == {("rwkv7", "fused_mul_recurrent_rwkv7")}
    summary = json.loads((run / "summary.json").read_text())
    assert 0 <= summary["fidelity"]["max_rel_error"] <= 1e-5
    # The layer runs the padded batch as it is (it masks, it does not unpad): capture unpads the
    # records, and drops the final state, which for the shorter prompt is the state after its pads.
    assert "state" not in summary["fidelity"]
    assert "rwkv7" in summary["by_family"]
    table = pq.read_table(run / "residuals.parquet").to_pydict()
    rows = {key: i for i, key in enumerate(zip(table["prompt"], table["layer"], table["head"], table["pos"]))}
    checked = 0
    for meta, prompt_ids, tensors in shards:
        assert meta["flags"]["unpadded"] is True and tensors["cu_seqlens"].tolist() == [0, *LENGTHS[:1], sum(LENGTHS)]
        assert "final_state" not in tensors
        x_all = {n: t.double() for n, t in tensors.items()}
        for n, (prompt, row, span) in enumerate(_sequences(prompt_ids, tensors)):
            x = {name: x_all[name][row, span] for name in ("q", "k", "write_key", "v", "g", "extra.b")}
            o, S, L = _fp64_rwkv7(x, meta["scale"])
            assert float((x_all["o"][row, span] - o).norm() / o.norm()) <= 1e-5
            for h in range(o.shape[1]):
                idx = [rows[(prompt, meta["layer"], h, t)] for t in range(o.shape[0])]
                want = {"loss_before": L["before"][:, h], "loss_after": L["after"][:, h],
                        "loss_before_decayed": L["decayed"][:, h],
                        "residual_ratio": L["after"][:, h] / L["before"][:, h],
                        "residual_ratio_post": L["after"][:, h] / L["decayed"][:, h],
                        "residual_ratio_alt": L["after_k"][:, h] / L["before_k"][:, h],
                        "own_target_ratio": L["own_after"][:, h] / L["own_before"][:, h],
                        "own_target_ratio_post": L["own_after"][:, h] / L["own_decayed"][:, h],
                        "target_scale": L["scale"][:, h]}
                for c, w in want.items():
                    got = torch.tensor([table[c][i] for i in idx], dtype=torch.float64)
                    assert float(((got - w).abs() / w.abs()).max()) <= 1e-5, (c, prompt, meta["layer"], h)
                checked += len(idx)
    assert checked == len(table["prompt"]) == sum(LENGTHS) * 2 * 2
    # The summary's own-target figures are the table's geometric means (numpy, fp64), and report.md
    # prints them beside the ratio toward v.
    entry, post = summary["by_family"]["rwkv7"], summary["post_decay"]["by_family"]["rwkv7"]
    for got, column in ((entry, "own_target_ratio"), (post, "own_target_ratio_post")):
        q = np.asarray(table[column], dtype=np.float64)[np.asarray(table["finite"])]
        q = q[np.isfinite(q)]
        assert got["n_own_target"] == len(q) == checked
        assert abs(got["q_geo_own_target"] / np.exp(np.log(np.maximum(q, 1e-30)).mean()) - 1) <= 1e-9
    scale = np.asarray(table["target_scale"], dtype=np.float64)
    assert 0 < np.median(scale) < 1 and entry["q_geo_own_target"] < entry["q_geo"]  # the write aims short of v
    line = next(x for x in (run / "report.md").read_text().splitlines() if "q_geo_own_target" in x)
    assert f"toward v_t {entry['q_geo']:.3f}" in line and f"(c_k/c_b)·v_t {entry['q_geo_own_target']:.3f}" in line
    assert f"post-decay {post['q_geo_own_target']:.3f}" in line


def test_tiny_preset_runs(tmp_path):
    run = tmp_path / "run"
    assert main(["run", "random:rwkv7-tiny", "--prompts", "random", "--num-prompts", "1",
                 "--length", "24", "--out", str(run), "--device", "cpu", "-q"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["n"] == 24 * 2 * 2 and 0 < summary["q_geo"] < 1
