"""`osdn-diag run --kernels fla` on a tiny saved GatedDeltaProduct model, checked against a plain fp64
loop written here from the tensors stored in the capture (nothing of the package).

One layer (hidden 64, two heads of 32, two micro-steps per token, forget gate, β in [0, 2]), fp32,
fla's kernels under Triton's interpreter: prompts of 70 and 45 tokens in one batch run the chunk
kernel (``chunk_gated_delta_product``; its public wrapper refuses fp32, so the layer module's name is
bound to the autograd function behind it for the run), prompts of 40 and 27 tokens the fused
recurrent kernel as the layer calls it (``RUN_PATHS``: the chunk path only by default; the fused
path's layer forward is checked in tests/capture/test_family_gated_deltaproduct.py). The table has one row per (prompt, head, token,
micro-step); each row's ``loss_before``, ``loss_after``, ``residual_ratio``, ``residual_ratio_post``,
the token's loss ``L_t = Σ_j ½‖S k_j − v_j‖²`` at its three states (``token_loss_*``), its ratios
``token_ratio`` / ``token_ratio_post`` and the products of its micro-step ratios
(``micro_step_ratio_product``, ``_post``) is compared with the loop, the summary's q_geo and per-token
q_geo with the table's, and the replayed output and final state with the kernel's. Also: ``random:gated-deltaproduct-tiny`` runs through the command line
with the reference stand-in, with the retention probes on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from osdn_diag.cli import main

pytestmark = pytest.mark.usefixtures("fla_interpreter")

N_H = 2
# The fused recurrent path as the layer calls it is run on a layer under capture in
# tests/capture/test_family_gated_deltaproduct.py; here the chunk path (the interpreter is slow).
LENGTHS = {"chunk": (70, 45), "fused_recurrent": (40, 27)}
RUN_PATHS = ("chunk",)
KERNEL = {"chunk": "chunk_gated_delta_product", "fused_recurrent": "fused_recurrent_gated_delta_rule"}


def _chunk_fp32(q, k, v, g, beta, num_householder, scale=None, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, cp_context=None):
    """fla's ``chunk_gated_delta_product`` without the wrapper's refusal of fp32 inputs."""
    from fla.ops.gated_delta_product.chunk import ChunkGatedDeltaProductFunction

    scale = k.shape[-1] ** -0.5 if scale is None else scale
    return ChunkGatedDeltaProductFunction.apply(q, k, v, g, beta, scale, num_householder, initial_state,
                                                output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                                                cu_seqlens_cpu, cp_context)


def _save_model(directory: Path) -> Path:
    import fla.models
    from transformers import AutoModelForCausalLM

    config = fla.models.GatedDeltaProductConfig(
        hidden_size=64, num_hidden_layers=1, num_heads=2, head_dim=32, expand_v=1.0, vocab_size=256,
        num_householder=N_H, use_forget_gate=True, allow_neg_eigval=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def gdp_runs(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(path: str) -> Path:
        if path not in made:
            import fla.layers.gated_deltaproduct as layer_module

            root = tmp_path_factory.mktemp(f"gdp-{path}")
            gen = torch.Generator().manual_seed(1)
            rows = [{"input_ids": torch.randint(3, 256, (n,), generator=gen).tolist(), "task": f"len{n}"}
                    for n in LENGTHS[path]]
            (root / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
            argv = ["run", str(_save_model(root / "model")), "--prompts", str(root / "prompts.jsonl"),
                    "--out", str(root / "run"), "--kernels", "fla", "--device", "cpu", "--dtype", "fp32",
                    "--batch-size", "2", "-q"]
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(layer_module, "chunk_gated_delta_product", _chunk_fp32)
                assert main(argv) == 0
            made[path] = root / "run"
        return made[path]

    return get


def _shards(run: Path):
    from safetensors import safe_open

    manifest = json.loads((run / "manifest.json").read_text())
    out = []
    for name in sorted(manifest["shards"]):
        with safe_open(str(run / name), "pt") as f:
            meta = f.metadata()
            out.append((json.loads(meta["call"]), json.loads(meta["prompts"]), {k: f.get_tensor(k) for k in f.keys()}))
    return manifest, out


def _loop(q, k, v, beta, g, n, scale):
    """One sequence in fp64, stored interleaved tensors ``[T·n, H, ·]`` (q on each token's last
    micro-step, g on its first); state V×K from zero. Per micro-step row: losses before (pre-decay),
    decayed, after; per token ``[T, H]``: its loss Σ_j ½‖S k_j − v_j‖² over its n pairs at S_{t−1}
    ("tok_before"), after the gate ("tok_decayed") and after its last micro-step ("tok_after"); o per
    token (last micro-step)."""
    Tn, H, K = k.shape
    q, k, v, beta, g = (x.double() for x in (q, k, v, beta, g))
    S = torch.zeros(H, v.shape[-1], K, dtype=torch.float64)
    out = {name: torch.zeros(Tn, H, dtype=torch.float64) for name in ("before", "decayed", "after")}
    out.update({name: torch.zeros(Tn // n, H, dtype=torch.float64) for name in ("tok_before", "tok_decayed", "tok_after")})
    o = torch.zeros(Tn // n, H, v.shape[-1], dtype=torch.float64)

    def loss(state, r):
        return 0.5 * (torch.einsum("hvk,hk->hv", state, k[r]) - v[r]).square().sum(-1)

    def token_loss(state, r):  # the token of row r: the sum of its n pairs' losses
        first = r - r % n
        return sum(loss(state, x) for x in range(first, first + n))

    for r in range(Tn):
        out["before"][r] = loss(S, r)
        if r % n == 0:
            out["tok_before"][r // n] = token_loss(S, r)
            S = S * g[r].exp()[:, None, None]
            out["tok_decayed"][r // n] = token_loss(S, r)
        else:
            assert not g[r].any()  # the gate acts on micro-step 0 only
        out["decayed"][r] = loss(S, r)
        S = S + beta[r][:, None, None] * (v[r] - torch.einsum("hvk,hk->hv", S, k[r]))[:, :, None] * k[r][:, None, :]
        out["after"][r] = loss(S, r)
        if r % n == n - 1:
            out["tok_after"][r // n] = token_loss(S, r)
            o[r // n] = torch.einsum("hvk,hk->hv", S, scale * q[r])
        else:
            assert not q[r].any()  # the query reads after the token's last micro-step
    return o, S, out


@pytest.mark.parametrize("path", RUN_PATHS)
def test_run_matches_an_fp64_loop_on_the_stored_tensors(gdp_runs, path):
    run = gdp_runs(path)
    manifest, shards = _shards(run)
    assert manifest["complete"] is True and manifest["kernels"] == ["fla"]
    (layer,) = manifest["layers"]
    assert (layer["kernel"], layer["family"]) == (KERNEL[path], "gated_delta_product")
    assert layer["flags"]["path"] == path and layer["flags"]["micro_steps"] == N_H
    summary = json.loads((run / "summary.json").read_text())
    assert 0 <= summary["fidelity"]["max_rel_error"] <= 1e-5
    assert 0 <= summary["fidelity"]["state"]["max_rel_error"] <= 1e-5
    table = pq.read_table(run / "residuals.parquet").to_pydict()
    rows = {(p, h, t, j): i for i, (p, h, t, j) in
            enumerate(zip(table["prompt"], table["head"], table["pos"], table["step"]))}
    assert len(rows) == len(table["prompt"]) == sum(LENGTHS[path]) * 2 * N_H  # two heads
    checked = 0
    for meta, prompts, x in shards:
        cu = x.get("cu_seqlens")
        spans = [(b, slice(None)) for b in range(len(prompts))] if cu is None else [
            (0, slice(s, e)) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
        for n_seq, (prompt, (b, span)) in enumerate(zip(prompts, spans)):
            o, S, losses = _loop(*(x[name][b, span] for name in ("q", "k", "v", "beta", "g")), N_H, meta["scale"])
            T = o.shape[0]
            assert T == LENGTHS[path][prompt]
            o_kernel = x["o"][b, span].reshape(T, N_H, *o.shape[1:])
            assert float((o_kernel[:, -1].double() - o).norm() / o.norm()) <= 1e-5
            assert not o_kernel[:, :-1].any()
            assert float((x["final_state"][n_seq].double() - S).norm() / S.norm()) <= 1e-5
            ratio = losses["after"] / losses["before"]
            post = losses["after"] / losses["decayed"]
            assert (losses["before"] > 0).all()  # the q = 1 convention is not in play here
            for h in range(2):
                for t in range(T):
                    steps = range(t * N_H, (t + 1) * N_H)
                    Lb, Ld, La = (float(losses[name][t, h]) for name in ("tok_before", "tok_decayed", "tok_after"))
                    for j, r in enumerate(steps):
                        i = rows[(prompt, h, t, j)]
                        fb = float(losses["before"][r, h])
                        # (column, fp64 value, floor, tolerance): relative, except below a floor where
                        # fp32 cannot resolve a value relatively (a write with β·‖k‖² ≈ 1 leaves a loss
                        # ~1e-8 of the one before it); a product of n_h ratios is within n_h·1e-5.
                        for col, want, floor, tol in (
                            ("loss_before", fb, 0.0, 1e-5),
                            ("loss_after", float(losses["after"][r, h]), 1e-3 * fb, 1e-5),
                            ("residual_ratio", float(ratio[r, h]), 1e-3, 1e-5),
                            ("residual_ratio_post", float(post[r, h]), 1e-3, 1e-5),
                            ("micro_step_ratio_product", math.prod(float(ratio[s, h]) for s in steps), 1e-3,
                             N_H * 1e-5),
                            ("micro_step_ratio_product_post", math.prod(float(post[s, h]) for s in steps), 1e-3,
                             N_H * 1e-5),
                            # The token's own ratio: one loss, after its last micro-step over before.
                            ("token_loss_before", Lb, 0.0, 1e-5),
                            ("token_loss_before_decayed", Ld, 0.0, 1e-5),
                            ("token_loss_after", La, 1e-3 * Lb, 1e-5),
                            ("token_ratio", La / Lb, 1e-3, 1e-5),
                            ("token_ratio_post", La / Ld, 1e-3, 1e-5),
                        ):
                            got = table[col][i]
                            assert got is not None and math.isfinite(got), (col, prompt, h, t, j, got)
                            assert abs(got - want) <= tol * max(abs(want), floor), (col, prompt, h, t, j, got, want)
                        assert table["rel_pos"][i] == pytest.approx(t / T)
                        checked += 1
    assert checked == len(table["prompt"])
    # The summary's q_geo is over micro-step rows: its n_h-th power is the geometric mean of the
    # products of the micro-step ratios; its per-token q_geo is that of the token's own ratio.
    first = [i for i, j in enumerate(table["step"]) if j == 0]
    prod = [math.log(table["micro_step_ratio_product"][i]) for i in first]
    assert summary["q_geo"] ** N_H == pytest.approx(math.exp(sum(prod) / len(prod)), rel=1e-5)
    tok = [math.log(table["token_ratio"][i]) for i in first]
    assert summary["q_geo_per_token"] == pytest.approx(math.exp(sum(tok) / len(tok)), rel=1e-5)
    assert summary["n_tokens"] == len(first)
    tok_post = [math.log(table["token_ratio_post"][i]) for i in first]
    assert summary["post_decay"]["q_geo_per_token"] == pytest.approx(math.exp(sum(tok_post) / len(tok_post)), rel=1e-5)
    assert summary["by_family"]["gated_delta_product"]["n"] == len(table["prompt"])


def test_random_tiny_preset_runs_with_retention(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "random:gated-deltaproduct-tiny", "--prompts", "random", "--twice", "--num-prompts", "1",
                 "--length", "16", "--out", str(out), "--device", "cpu", "--retained", "-q"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    table = pq.read_table(out / "residuals.parquet").to_pydict()
    assert set(table["step"]) == {0, 1} and max(table["pos"]) == 15
    assert summary["n"] == len(table["prompt"]) == 16 * 2 * 2 * N_H  # tokens, layers, heads
    assert sum(summary["position_bins"]["n"]) == len(table["prompt"])  # bins of token positions
    assert summary["retained"]  # probes at token positions, after each token's last micro-step
