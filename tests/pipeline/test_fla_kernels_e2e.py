"""`osdn-diag run --kernels fla` end to end on the CPU: fla's own Triton kernels, not a stand-in.

Which kernels the pipeline tests run. The other files in tests/pipeline keep the default
``kernels="auto"``: on a CPU, capture then substitutes the package's reference recurrence
(osdn_diag.math.recurrence) for fla's delta-rule kernel, and replay re-runs that same recurrence.
Those runs are fast and check the files, tables and statistics, but a fault shared by the stand-in
and the replay (a gate decay missing from the recurrence, say) leaves them green. This file runs the
kernels themselves — fla 0.6.0's, and the package's OSDN kernels — under Triton's interpreter in
fp32, so that:

* the run's own fidelity checks (``summary.json -> fidelity``: replayed outputs against the kernel's,
  replayed final states against the kernel's fp32 final states) compare the replay with the kernel;
* the manifest and every capture shard say that fla's kernel ran (``kernels: ["fla"]``), which one,
  and on which path;
* a plain fp64 loop written here, from the tensors stored in the capture (k, v, β, gate, d or write
  key) and nothing of the package, reproduces the kernel's output and final state and every token's
  ``loss_before``, ``loss_after``, ``residual_ratio`` (and ``residual_ratio_post`` for gated layers)
  in ``residuals.parquet``; for OSDN it also recomputes phase 1's d trajectory from k and β, which
  no fidelity check can see (the kernel wrote with the d it recorded, right or wrong);
* the KDA capture is replayed once more with the fused replay kernel (``--backend triton``, the GPU
  default; the CPU default is the torch backend), checked the same way.

One tiny model per capture adapter (osdn_diag/capture/adapters.py; ``CASES`` below), saved to a
directory and run through the command line: one layer (two for DeltaNet), hidden 64, two heads of 32.
fla's layers take their fused recurrent kernel for inputs of at most 64 tokens at inference and their
chunk kernel above (chunk size 64), as do the OSDN layers, so prompts of 70 and 45 tokens in one batch
run the chunk path on packed sequences whose ends are not chunk boundaries, and prompts of 40 and 27
tokens the fused recurrent path. DeltaNet runs only the fused recurrent path here: fla's public
``chunk_delta_rule`` refuses fp32 inputs. About 40 s of CPU time in all, most of it the interpreter.
On a CUDA machine these tests skip unless ``TRITON_INTERPRET=1`` was exported (``fla_interpreter``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from osdn_diag.cli import main

pytestmark = pytest.mark.usefixtures("fla_interpreter")

CHUNK_LENGTHS = (70, 45)  # one batch: padded width 70 > 64 selects the chunk kernels
FUSED_LENGTHS = (40, 27)  # at most 64 tokens: the fused recurrent kernels
OSDN_ETA = 0.5  # a step large enough that d leaves 1 within a few dozen tokens (design note 7)


@dataclass(frozen=True)
class Case:
    config: str  # fla.models config class, or "OSDNConfig"
    kernel: str  # the entry point the manifest must name
    family: str
    lengths: tuple[int, ...]
    batch_size: int = 2
    layers: int = 1
    extra: tuple = ()  # further config arguments

    @property
    def path(self) -> str:
        return "chunk" if self.kernel.startswith("chunk") else "fused_recurrent"


CASES = {
    # Two layers, one prompt per forward pass: unpacked batches, two shards per layer.
    "deltanet": Case("DeltaNetConfig", "fused_recurrent_delta_rule", "delta_rule", FUSED_LENGTHS,
                     batch_size=1, layers=2),
    "gated-deltanet": Case("GatedDeltaNetConfig", "chunk_gated_delta_rule", "gated_delta_rule", CHUNK_LENGTHS,
                           extra=(("head_dim", 32), ("expand_v", 1.0))),
    "kda": Case("KDAConfig", "chunk_kda", "kda", CHUNK_LENGTHS, extra=(("head_dim", 32),)),
    "precond-gated-deltanet": Case("PrecondGatedDeltaNetConfig", "chunk_precond_gated_delta_rule",
                                   "precond_gated_delta_rule", CHUNK_LENGTHS,
                                   extra=(("head_dim", 32), ("expand_v", 1.0))),
    "precond-kda": Case("PrecondKDAConfig", "fused_recurrent_precond_kda", "precond_kda", FUSED_LENGTHS,
                        extra=(("head_dim", 32),)),
    "osdn": Case("OSDNConfig", "chunk_osdn", "osdn", CHUNK_LENGTHS, extra=(("eta", OSDN_ETA),)),
    "osdn-fused": Case("OSDNConfig", "fused_recurrent_osdn", "osdn", FUSED_LENGTHS, extra=(("eta", OSDN_ETA),)),
}


def _save_model(case: Case, directory: Path) -> Path:
    """A randomly initialised (seeded) tiny model of ``case``, saved as a Hugging Face directory."""
    import fla.models
    from transformers import AutoModelForCausalLM

    if case.config == "OSDNConfig":
        from osdn_diag.models import OSDNConfig as config_cls  # registers the OSDN model type
    else:
        config_cls = getattr(fla.models, case.config)
    config = config_cls(hidden_size=64, num_hidden_layers=case.layers, num_heads=2, vocab_size=256,
                        **dict(case.extra))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return directory


def _prompts(lengths: tuple[int, ...], path: Path) -> Path:
    gen = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(3, 256, (n,), generator=gen).tolist(), "task": f"len{n}"}
            for n in lengths]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


@pytest.fixture(scope="module")
def fla_runs(tmp_path_factory):
    """``fla_runs(name) -> (case, run directory)``: ``osdn-diag run`` of the case's model with
    ``--kernels fla``, made once per module and shared by every test of that case."""
    made: dict[str, Path | BaseException] = {}

    def get(name: str) -> tuple[Case, Path]:
        if name not in made:
            case = CASES[name]
            root = tmp_path_factory.mktemp(name)
            argv = ["run", str(_save_model(case, root / "model")),
                    "--prompts", str(_prompts(case.lengths, root / "prompts.jsonl")), "--out", str(root / "run"),
                    "--kernels", "fla", "--device", "cpu", "--dtype", "fp32", "--batch-size", str(case.batch_size),
                    "-q"]
            try:
                assert main(argv) == 0
                made[name] = root / "run"
            except Exception as err:  # a failed run fails every test of its case, and is run once
                made[name] = err
        if isinstance(made[name], BaseException):
            raise RuntimeError(f"osdn-diag run --kernels fla of case {name!r} failed") from made[name]
        return CASES[name], made[name]

    return get


def _shards(run: Path) -> list[tuple[dict, list[int], dict[str, torch.Tensor]]]:
    """Every capture shard the manifest lists: ``(call metadata, prompt ids, tensors)``, read with
    safetensors alone."""
    from safetensors import safe_open

    manifest = json.loads((run / "manifest.json").read_text())
    out = []
    for name in sorted(manifest["shards"]):
        with safe_open(str(run / name), "pt") as f:
            meta = f.metadata()
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        out.append((json.loads(meta["call"]), json.loads(meta["prompts"]), tensors))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_fla_kernels_ran_and_are_recorded(fla_runs, name):
    """The manifest and every shard name fla's kernel (not the reference stand-in), the expected
    entry point and path; every shard holds the kernel's final state; the run wrote its report."""
    case, run = fla_runs(name)
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["kernels"] == ["fla"]
    assert [layer["layer"] for layer in manifest["layers"]] == list(range(case.layers))
    for layer in manifest["layers"]:
        assert (layer["kernel"], layer["family"], layer["input_dtype"]) == (case.kernel, case.family, "float32")
        assert layer["flags"]["kernels"] == "fla" and layer["flags"]["path"] == case.path
    shards = _shards(run)
    forwards = -(-len(case.lengths) // case.batch_size)
    assert len(shards) == forwards * case.layers  # one shard per (forward batch, layer)
    for meta, _, tensors in shards:
        assert meta["kernel"] == case.kernel and meta["flags"]["kernels"] == "fla"
        assert "final_state" in tensors  # the state check had the kernel's own state to compare with
    assert (run / "report.md").is_file()


def _assert_fidelity_passed(fidelity: dict, layers: int) -> None:
    """``summary.json -> fidelity`` of an fp32 CPU replay of fla's kernels: both checks ran on every
    layer, with fp32's tolerances, and passed by the margin fp32 rounding leaves."""
    names = {f"{i:03d}" for i in range(layers)}
    assert set(fidelity["by_layer"]) == names
    assert all(tol == 1e-5 for tol in fidelity["tolerance_by_layer"].values())
    assert 0 <= fidelity["max_rel_error"] <= 1e-5  # NaN fails both comparisons
    state = fidelity["state"]
    assert set(state["by_layer"]) == names
    for row in state["by_layer"].values():
        assert row["working_precision"] == "float32"
        assert 0 <= row["rel_error"] <= row["tolerance"] == 1e-4
    assert 0 <= state["max_rel_error"] <= 1e-5  # far inside the tolerance: what fp32 rounding explains


@pytest.mark.parametrize("name", list(CASES))
def test_fidelity_checks_passed_against_the_kernel(fla_runs, name):
    case, run = fla_runs(name)
    summary = json.loads((run / "summary.json").read_text())
    kernels = {f"{i:03d}": "torch" for i in range(case.layers)}
    assert summary["replay"] == {
        "backend": "torch", "dtype": "float32", "device": "cpu", "zero_residual": "drop", "kernels": kernels
    }
    _assert_fidelity_passed(summary["fidelity"], case.layers)


def _fp64_delta_rule(q, k, v, beta, g, write_key, scale):
    """One sequence, every head at once, in fp64, the state ``S`` stored V×K and starting at zero.

    Per token: ``S̄ = decay(S)`` (``exp(g)·S`` for a head gate ``g: [T, H]``, ``S·Diag(exp(g))`` on the
    key side for a channel gate ``g: [T, H, K]``, ``S`` without one); ``u = v − S̄ k``;
    ``S ← S̄ + β u k̃ᵀ``; ``o = S (scale·q)``. The token-local loss is ``½‖S k − v‖²`` against the state
    before the token (``before``), its decayed form (``decayed``) and the state after (``after``).
    Inputs ``[T, H, ·]``; returns ``o [T, H, V]``, the final state ``[H, V, K]`` and the three losses
    ``[T, H]``.
    """
    T, H, K = k.shape
    S = torch.zeros(H, v.shape[-1], K, dtype=torch.float64)
    o = torch.zeros(T, H, v.shape[-1], dtype=torch.float64)
    losses = {name: torch.zeros(T, H, dtype=torch.float64) for name in ("before", "decayed", "after")}

    def loss(state, t):
        return 0.5 * (torch.einsum("hvk,hk->hv", state, k[t]) - v[t]).square().sum(-1)

    for t in range(T):
        losses["before"][t] = loss(S, t)
        if g is None:
            S_bar = S
        elif g.dim() == 2:
            S_bar = S * g[t].exp()[:, None, None]
        else:
            S_bar = S * g[t].exp()[:, None, :]
        losses["decayed"][t] = loss(S_bar, t)
        u = v[t] - torch.einsum("hvk,hk->hv", S_bar, k[t])
        S = S_bar + beta[t][:, None, None] * u[:, :, None] * write_key[t][:, None, :]
        losses["after"][t] = loss(S, t)
        o[t] = torch.einsum("hvk,hk->hv", S, scale * q[t])
    return o, S, losses


def _sequences(prompts: list[int], tensors: dict[str, torch.Tensor]):
    """``(prompt id, index into the shard's [B, T] grid)`` of every sequence: packed segments of row
    0 when the shard has ``cu_seqlens``, else one batch row each."""
    cu = tensors.get("cu_seqlens")
    if cu is None:
        return [(p, (b, slice(None))) for b, p in enumerate(prompts)]
    bounds = cu.tolist()
    return [(p, (0, slice(s, e))) for p, s, e in zip(prompts, bounds[:-1], bounds[1:])]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖."""
    return float((a - b).norm() / b.norm())


def _assert_table_is_the_fp64_loop(case: Case, run: Path, residuals: Path) -> None:
    """From each shard of ``run`` — its k, v, β, gate and write key (d ⊙ k where the shard stores no
    write key) — in fp64: the kernel's output and final state per (sequence, head), and the loss and
    ratio columns of ``residuals`` for every (prompt, layer, head, position)."""
    table = pq.read_table(residuals).to_pydict()
    rows = {key: i for i, key in enumerate(zip(table["prompt"], table["layer"], table["head"], table["pos"]))}
    checked = 0
    for meta, prompts, tensors in _shards(run):
        assert "initial_state" not in tensors  # every sequence starts from the zero state
        layer = meta["layer"]
        x = {name: t.double() for name, t in tensors.items()}
        if "write_key" not in x:
            x["write_key"] = x["k"] if "d" not in x else x["d"] * x["k"]
        gated = "g" in x
        for n, (prompt, (row, span)) in enumerate(_sequences(prompts, tensors)):
            seq = {name: x[name][row, span] for name in ("q", "k", "v", "beta", "write_key")}
            g = x["g"][row, span] if gated else None
            o, S, losses = _fp64_delta_rule(seq["q"], seq["k"], seq["v"], seq["beta"], g, seq["write_key"],
                                             meta["scale"])
            for h in range(o.shape[1]):
                # The record describes the kernel: its output and fp32 final state are this recurrence.
                assert _rel(x["o"][row, span, h], o[:, h]) <= 1e-5, (prompt, layer, h)
                assert _rel(x["final_state"][n, h], S[h]) <= 1e-5, (prompt, layer, h)
                idx = [rows[(prompt, layer, h, t)] for t in range(o.shape[0])]
                before, after = losses["before"][:, h], losses["after"][:, h]
                assert (before > 0).all()  # the q = 1 convention for a zero loss is not in play here
                want = {"loss_before": before, "loss_after": after, "residual_ratio": after / before}
                if gated:
                    want["loss_before_decayed"] = losses["decayed"][:, h]
                    want["residual_ratio_post"] = after / losses["decayed"][:, h]
                else:  # no decay, no post-decay columns: a run without decay leaves them out
                    assert not {"loss_before_decayed", "residual_ratio_post"} & table.keys()
                for c, w in want.items():
                    got = torch.tensor([table[c][i] for i in idx], dtype=torch.float64)
                    err = ((got - w).abs() / w.abs()).max()
                    assert err <= 1e-5, (c, prompt, layer, h, float(err))  # NaN fails too
                checked += len(idx)
    assert checked == len(table["prompt"]) == sum(case.lengths) * case.layers * 2  # two heads


@pytest.mark.parametrize("name", list(CASES))
def test_fp64_loop_on_the_stored_tensors_reproduces_kernel_and_table(fla_runs, name):
    case, run = fla_runs(name)
    _assert_table_is_the_fp64_loop(case, run, run / "residuals.parquet")


def test_triton_replay_kernel_on_fla_kda_capture(fla_runs, tmp_path):
    """The fused replay kernel (osdn_diag/ops/replay.py, ``--backend triton``; interpreted here) on
    the KDA chunk capture — packed sequences, a per-key-channel gate: its fidelity checks pass against
    fla's kernel and the fp64 loop reproduces its table. (The runs above replay with the torch
    backend, the CPU default.)"""
    from osdn_diag.pipeline import replay_run

    case, run = fla_runs("kda")
    summary = replay_run(run, out_dir=tmp_path, backend="triton", progress=False)
    # KDA's gate is per key channel, which the chunked replay does not take: every layer runs the fused one
    kernels = {f"{i:03d}": "fused" for i in range(case.layers)}
    assert summary["replay"] == {
        "backend": "triton", "dtype": "float32", "device": "cpu", "zero_residual": "drop", "kernels": kernels
    }
    _assert_fidelity_passed(summary["fidelity"], case.layers)
    _assert_table_is_the_fp64_loop(case, run, tmp_path / "residuals.parquet")


def _fp64_phase1(k, beta, *, eta, d_min, d_max, eps):
    """OSDN phase 1 (beta-aware, no retention) for one sequence in fp64, every head at once: the d each
    token writes with (``d_0 = 1``; then ``d ← clamp(d + η β (1 − β⟨d, s⟩) s / max(‖k‖², eps))``,
    ``s = k⊙k``). ``k: [T, H, K]``, ``beta: [T, H]``; returns ``[T, H, K]``."""
    T, H, K = k.shape
    d = torch.ones(H, K, dtype=torch.float64)
    out = torch.empty(T, H, K, dtype=torch.float64)
    for t in range(T):
        out[t] = d
        s = k[t].square()
        step = beta[t] * (1 - beta[t] * (d * s).sum(-1)) / s.sum(-1).clamp_min(eps)
        d = (d + eta * step[:, None] * s).clamp(d_min, d_max)
    return out


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.family == "osdn"])
def test_osdn_d_is_phase_one_of_the_stored_keys(fla_runs, name):
    """The d trajectory the OSDN kernels recorded (phase 1's kernel, or the fused kernel's) is OSDN's
    phase 1 of the stored keys and β, recomputed in fp64; and it moved away from its start."""
    case, run = fla_runs(name)
    config = json.loads((run.parent / "model" / "config.json").read_text())
    assert config["beta_aware"] and not config["apf"] and config["eta"] == OSDN_ETA
    moved = 0.0
    for _, prompts, tensors in _shards(run):
        for _, (row, span) in _sequences(prompts, tensors):
            k, beta, d = (tensors[field][row, span].double() for field in ("k", "beta", "d"))
            want = _fp64_phase1(k, beta, eta=config["eta"], d_min=config["d_min"], d_max=config["d_max"],
                                eps=config["phase1_eps"])
            assert ((d - want).abs() / want).max() <= 1e-5
            moved = max(moved, float((want - 1).abs().max()))
            if "write_key" in tensors:  # chunk path: phase 2 read d ⊙ k as phase 1 stored it (fp32)
                wk = tensors["write_key"][row, span].double()
                assert ((wk - want * k).abs() <= 1e-5 * k.abs()).all()
    assert moved > 0.01


@pytest.mark.parametrize("preset", ["deltanet-tiny", "gated-deltaproduct-tiny"])
def test_fp32_refused_by_a_chunk_kernel_is_one_line(preset, tmp_path, capsys):
    """fla 0.6.0's chunk entry points assert on fp32 inputs (here: 80 tokens on the CPU, the default
    fp32): a one-line error naming the kernel and what to do, exit status 2, not fla's traceback."""
    from osdn_diag.cli import entry

    assert entry(["run", f"random:{preset}", "--prompts", "random", "--num-prompts", "1", "--length", "80",
                  "--kernels", "fla", "--device", "cpu", "--dtype", "fp32", "--out", str(tmp_path / "r"),
                  "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refuses float32 inputs" in err and "--dtype bf16" in err, err
    assert "layer 0 (" in err and "chunk_" in err, err
