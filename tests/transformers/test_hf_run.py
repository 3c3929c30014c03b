"""`osdn-diag run` end to end on a transformers delta-rule model, its random presets, and loading a
Qwen3.5 checkpoint saved in its published (multimodal) layout — all on the CPU, offline."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import torch

from _hf_models import torch_on_cpu
from osdn_diag.capture.context import capture
from osdn_diag.cli import main
from osdn_diag.models import load_model

LENGTHS = (12, 7, 9)


def test_run_on_qwen3_next_batched_equals_one_by_one(tmp_path):
    """Three prompts of different lengths, one by one and as one right-padded batch: the manifest
    numbers the three Gated DeltaNet layers 0–2 and lists decoder layer 3 (full attention) as
    skipped; the table has one row per real token (none for padding), and the batched run measures
    what the one-by-one run does. The report says how many layers were not captured. On a CPU the
    layers run fla's kernel (the reference stands in for it) or, from transformers 5.25, the
    modeling file's torch function, and the manifest names which."""
    module = "transformers.models.qwen3_next.modeling_qwen3_next"
    load_model("random:qwen3-next-tiny")  # imports the modeling module
    if torch_on_cpu("qwen3_next"):
        kernel, implementation = "torch_chunk_gated_delta_rule", f"{module}.torch_chunk_gated_delta_rule"
    else:
        kernel, implementation = "chunk_gated_delta_rule", "fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"input_ids": list(range(3, n + 3)), "task": f"t{n}"})
                                 for n in LENGTHS))
    tables = []
    for bs in ("1", "3"):
        out = tmp_path / f"bs{bs}"
        assert main(["run", "random:qwen3-next-tiny", "--prompts", str(prompts), "--out", str(out),
                     "--batch-size", bs, "-q"]) == 0
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["complete"] is True and manifest["model"]["model_type"] == "qwen3_next"
        assert [entry["layer"] for entry in manifest["layers"]] == [0, 1, 2]
        assert manifest["layers_skipped"] == [{"layer": 3, "type": "full_attention"}]
        for entry in manifest["layers"]:
            assert entry["family"] == "gated_delta_rule" and entry["kernel"] == kernel
            assert entry["heads"] == 4 and entry["head_k_dim"] == 16  # 2 key heads serve 4 value heads
            assert entry["flags"]["implementation"] == implementation
        table = pq.read_table(out / "residuals.parquet").sort_by(
            [("prompt", "ascending"), ("layer", "ascending"), ("head", "ascending"), ("pos", "ascending")])
        assert table.num_rows == sum(LENGTHS) * 3 * 4  # real tokens × layers × value heads
        summary = json.loads((out / "summary.json").read_text())
        assert set(summary["by_layer"]) == {"000", "001", "002"}
        assert "| 3 (gated_delta_rule); 1 not captured (full_attention) |" in (out / "report.md").read_text()
        tables.append(table.to_pydict())
    one, batched = tables
    for col in ("prompt", "layer", "head", "pos"):
        assert one[col] == batched[col], col
    # The model's projections round a token's row by where it sits in the batch (torch's CPU
    # matmul): ≤ 1e-6 relative here; the replay itself is per sequence.
    for col in ("loss_before", "loss_after", "residual_ratio", "residual_ratio_post"):
        a, b = torch.tensor(one[col], dtype=torch.float64), torch.tensor(batched[col], dtype=torch.float64)
        assert torch.allclose(a, b, rtol=2e-6, atol=0), col


@pytest.mark.parametrize("preset, linear, family", [
    ("qwen3-next-tiny", "Qwen3NextGatedDeltaNet", "gated_delta_rule"),
    ("qwen3.5-tiny", "Qwen3_5GatedDeltaNet", "gated_delta_rule"),
    ("qwen3.5-moe-tiny", "Qwen3_5MoeGatedDeltaNet", "gated_delta_rule"),
    ("kimi-linear-tiny", "KimiLinearDeltaAttention", "kda"),
    ("olmo-hybrid-tiny", "OlmoHybridGatedDeltaNet", "gated_delta_rule"),
])
def test_tiny_presets_are_hybrids_capture_knows(preset, linear, family):
    model = load_model(f"random:{preset}").model
    ids = torch.randint(3, 256, (1, 6))
    with torch.no_grad(), capture(model, kernels="reference") as cap:
        model(ids, use_cache=False)
    assert [(i, type(m).__name__) for i, _, m in cap.layers] == [(0, linear), (1, linear), (2, linear)]
    assert cap.skipped == [{"layer": 3, "type": "full_attention"}]
    assert [c.family for c in cap.calls] == [family] * 3


#: The published layer shapes, spelled out (config.json / the config classes' documented defaults).
SHAPES = {
    "qwen3-next-80b-a3b-shape": dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, moe_intermediate_size=512),
    "qwen3.5-0.8b-shape": dict(
        hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128),
    "qwen3.5-shape": dict(
        hidden_size=4096, intermediate_size=12288, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128),
    "qwen3.5-35b-a3b-shape": dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, moe_intermediate_size=512),
    "kimi-linear-48b-a3b-shape": dict(
        hidden_size=2304, linear_num_heads=32, linear_head_dim=128, num_attention_heads=32, kv_lora_rank=512,
        moe_intermediate_size=1024),
    "olmo-hybrid-7b-shape": dict(
        hidden_size=3840, intermediate_size=11008, num_attention_heads=30, linear_num_key_heads=30,
        linear_num_value_heads=30, linear_key_head_dim=96, linear_value_head_dim=192, linear_allow_neg_eigval=True),
}


@pytest.mark.parametrize("preset", sorted(SHAPES))
def test_shape_presets_have_the_published_layer_shapes(preset):
    import transformers

    from osdn_diag.models import PRESETS

    cls_name, kwargs = PRESETS[preset]
    config = getattr(transformers, cls_name)(**kwargs)  # the config only: no weights allocated
    for name, value in SHAPES[preset].items():
        assert getattr(config, name) == value, name
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]


def test_a_qwen3_5_checkpoint_in_its_published_layout_loads_as_a_causal_lm(tmp_path):
    """Qwen3.5 checkpoints are saved as ``Qwen3_5ForConditionalGeneration`` (model_type ``qwen3_5``,
    the language model's sizes under ``text_config``, vision tower weights beside it): MODEL loads its
    language model, and the manifest's sizes and the prompts' vocabulary come from ``text_config``."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from osdn_diag.models import PRESETS

    text = PRESETS["qwen3.5-tiny"][1]
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert type(loaded.model).__name__ == "Qwen3_5ForCausalLM"
    assert loaded.config["vocab_size"] == 256 and loaded.config["hidden_size"] == 64
    assert loaded.config["model_type"] == "qwen3_5"
    with torch.no_grad(), capture(loaded.model, kernels="reference") as cap:
        loaded.model(torch.randint(3, 256, (1, 5)), use_cache=False)
    assert [c.layer for c in cap.calls] == [0, 1, 2]


def test_device_map_dispatch_records_the_same_writes(fla_interpreter):
    """``--device-map`` (accelerate's dispatch, hooks on every block) on a hybrid transformers model:
    capture still finds every linear-attention layer under the hooks, numbered as the model numbers
    them, and the replay is the undispatched model's, row for row. Every block goes to the CPU here
    (one machine, no GPU); on a GPU machine the same map spreads them over the GPUs."""
    import osdn_diag
    from osdn_diag.models import load_model

    plain = load_model("random:qwen3-next-tiny").model
    blocks = ["model.embed_tokens", *[f"model.layers.{i}" for i in range(plain.config.num_hidden_layers)],
              "model.norm", "model.rotary_emb", "lm_head"]
    modules = dict(plain.named_modules())
    spread = load_model("random:qwen3-next-tiny", device_map={b: "cpu" for b in blocks if b in modules}).model
    assert getattr(spread, "hf_device_map", None)  # dispatched, with accelerate's hooks
    ids = torch.randint(3, plain.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    results = []
    for model in (plain, spread):
        with torch.no_grad(), osdn_diag.capture(model) as cap:
            model(ids)
        results.append(osdn_diag.replay(cap))
    assert sorted(set(results[1].table["layer"].to_pylist())) == [0, 1, 2]  # layer 3: full attention
    assert results[0].table.equals(results[1].table)
