"""``random:PRESET``: randomly initialised models of named shapes, for benchmarks and tests.

Each preset is ``(config class name, config kwargs)`` — fla's config class where fla has one of that
name, transformers' otherwise — built with ``AutoModelForCausalLM.from_config`` and seeded
(:func:`osdn_diag.models.load_model`). :data:`PRESETS` holds them all: fla's DeltaNet family at the
paper's shapes and tiny ones, and transformers' delta-rule models (Qwen3-Next, Qwen3.5 dense and MoE,
Kimi Linear, OLMo-Hybrid):

* ``*-tiny``: four decoder layers (three linear-attention layers and one full-attention layer, the
  models' own 3 : 1 pattern), hidden size 64, heads of 16 — for tests and CPU runs. The Qwen presets
  have twice as many value heads as key heads (grouped value heads, as the published models).
* ``*-shape``: the published models' layer shapes — hidden size, attention and linear-attention heads
  and head dimensions, MLP width — with four decoder layers (three linear, one full attention),
  a 32000-token vocabulary and, for the mixture-of-experts models, 4 experts (2 active) of the
  published expert width: what capture and replay cost per layer is set by these shapes; depth,
  vocabulary and the number of experts only scale the model's own cost and memory. Sources:

  - ``qwen3-next-80b-a3b-shape``: ``Qwen3NextConfig``'s defaults (its docstring's checkpoint is
    Qwen/Qwen3-Next-80B-A3B-Instruct): hidden 2048, 16 attention heads (2 KV) of 256, 16 key and
    32 value heads of 128 in the linear layers, experts of width 512;
  - ``qwen3.5-0.8b-shape``: Qwen/Qwen3.5-0.8B's ``text_config``: hidden 1024, MLP 3584, 8 attention
    heads (2 KV) of 256, 16 key and 16 value heads of 128;
  - ``qwen3.5-shape``: ``Qwen3_5TextConfig``'s defaults: hidden 4096, MLP 12288, 16 attention heads
    (4 KV) of 256, 16 key and 32 value heads of 128;
  - ``qwen3.5-35b-a3b-shape``: ``Qwen3_5MoeTextConfig``'s defaults (its docstring's checkpoint is
    Qwen/Qwen3.5-35B-A3B): hidden 2048, 16 attention heads (2 KV) of 256, 16 key and 32 value heads
    of 128, experts of width 512;
  - ``kimi-linear-48b-a3b-shape``: ``KimiLinearConfig``'s defaults (Kimi-Linear-48B-A3B-Instruct):
    hidden 2304, 32 KDA heads of 128, MLA attention (32 heads, KV rank 512), experts of width 1024;
  - ``olmo-hybrid-7b-shape``: ``OlmoHybridConfig``'s defaults (allenai/Olmo-Hybrid-7B): hidden 3840,
    MLP 11008, 30 attention heads, 30 linear heads with key dim 96 and value dim 192, β ∈ (0, 2)
    (``linear_allow_neg_eigval``).
"""

from __future__ import annotations

__all__ = ["PRESETS", "TRANSFORMERS_PRESETS"]

_LLLF = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4, layer_types=_LLLF)
_SHAPE = dict(vocab_size=32000, num_hidden_layers=4, layer_types=_LLLF)
#: Special tokens inside the small vocabularies (Kimi's and OLMo's defaults lie beyond them).
_TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_QWEN_TINY_LINEAR = dict(
    num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
)

TRANSFORMERS_PRESETS: dict[str, tuple[str, dict]] = {
    "qwen3-next-tiny": ("Qwen3NextConfig", dict(
        **_TINY, **_QWEN_TINY_LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )),
    "qwen3.5-tiny": ("Qwen3_5TextConfig", dict(**_TINY, **_QWEN_TINY_LINEAR)),
    "qwen3.5-moe-tiny": ("Qwen3_5MoeTextConfig", dict(
        **_TINY, **_QWEN_TINY_LINEAR, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )),
    "kimi-linear-tiny": ("KimiLinearConfig", dict(
        **_TINY, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, linear_num_heads=2, linear_head_dim=16,
        num_experts=4, num_experts_per_token=2, moe_intermediate_size=32,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], **_TOKENS,
    )),
    "olmo-hybrid-tiny": ("OlmoHybridConfig", dict(
        **_TINY, num_attention_heads=2, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=32, **_TOKENS,
    )),
    "qwen3-next-80b-a3b-shape": ("Qwen3NextConfig", dict(**_SHAPE, num_experts=4, num_experts_per_tok=2)),
    "qwen3.5-0.8b-shape": ("Qwen3_5TextConfig", dict(
        **_SHAPE, hidden_size=1024, intermediate_size=3584, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, tie_word_embeddings=True,
    )),
    "qwen3.5-shape": ("Qwen3_5TextConfig", dict(**_SHAPE)),
    "qwen3.5-35b-a3b-shape": ("Qwen3_5MoeTextConfig", dict(**_SHAPE, num_experts=4, num_experts_per_tok=2)),
    "kimi-linear-48b-a3b-shape": ("KimiLinearConfig", dict(
        **_SHAPE, num_experts=4, num_experts_per_token=2, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        **_TOKENS,
    )),
    "olmo-hybrid-7b-shape": ("OlmoHybridConfig", dict(**_SHAPE, **_TOKENS)),
}


#: Named random-model shapes: (config class name — fla's, else transformers' — config kwargs).
PRESETS: dict[str, tuple[str, dict]] = {
    # The paper's 340M DeltaNet: 24 layers, hidden 1024, 8 heads of d_k = d_v = 128.
    "deltanet-340m": ("DeltaNetConfig", dict(hidden_size=1024, num_hidden_layers=24, num_heads=8, vocab_size=32000)),
    # The paper's 1.3B shape: 24 layers, hidden 2048, 16 heads.
    "deltanet-1.3b": ("DeltaNetConfig", dict(hidden_size=2048, num_hidden_layers=24, num_heads=16, vocab_size=32000)),
    "deltanet-tiny": ("DeltaNetConfig", dict(hidden_size=64, num_hidden_layers=2, num_heads=2, vocab_size=256)),
    "gated-deltanet-tiny": (
        "GatedDeltaNetConfig",
        dict(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, expand_v=1.0, vocab_size=256),
    ),
    "kda-tiny": ("KDAConfig", dict(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, vocab_size=256)),
    "precond-gated-deltanet-tiny": (
        "PrecondGatedDeltaNetConfig",
        dict(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, expand_v=1.0, vocab_size=256),
    ),
    # fla's Comba: q/k heads of head_dim keys, values expand_v times wider; 0.75 * hidden key width at
    # the 340M shape, as the layer's docstring asks with its output gate on.
    "comba-tiny": (
        "CombaConfig", dict(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, expand_v=1.0, vocab_size=256),
    ),
    "comba-340m": (
        "CombaConfig", dict(hidden_size=1024, num_hidden_layers=24, num_heads=6, head_dim=128, expand_v=2.0, vocab_size=32000),
    ),
    # fla's GatedDeltaNet2 layer in the package's GDN2 model (osdn_diag.models.gdn2; fla has no model
    # class for it): heads of head_dim keys and values, the layer's defaults; 8 heads of 128 at 340M.
    "gdn2-tiny": ("GDN2Config", dict(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, vocab_size=256)),
    "gdn2-340m": ("GDN2Config", dict(hidden_size=1024, num_hidden_layers=24, num_heads=8, head_dim=128, vocab_size=32000)),
    # fla's GatedDeltaProduct with the layer's defaults (fla's config defaults to one Householder
    # step, no forget gate, β in [0, 1]): two micro-steps per token, forget gate, β in [0, 2].
    "gated-deltaproduct-tiny": ("GatedDeltaProductConfig", dict(
        hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, expand_v=1.0, vocab_size=256,
        num_householder=2, use_forget_gate=True, allow_neg_eigval=True,
    )),
    # The 340M shape of deltanet-340m (hidden 1024, 24 layers, 8 heads of d_k = 128; d_v = 128).
    "gated-deltaproduct-340m": ("GatedDeltaProductConfig", dict(
        hidden_size=1024, num_hidden_layers=24, num_heads=8, head_dim=128, expand_v=1.0, vocab_size=32000,
        num_householder=2, use_forget_gate=True, allow_neg_eigval=True,
    )),
    # fla's MomentumDeltaNet layer in the package's model class (fla 0.6.0 has none), in the 340M
    # DeltaNet's shape (24 layers, hidden 1024, 8 heads of d_k = d_v = 128) with the layer's own output
    # gate (its default): 400M parameters (deltanet-340m: 374M).
    "momentum-deltanet-340m": (
        "MomentumDeltaNetConfig",
        dict(hidden_size=1024, num_hidden_layers=24, num_heads=8, head_dim=128, expand_v=1.0, vocab_size=32000),
    ),
    "momentum-deltanet-tiny": (
        "MomentumDeltaNetConfig",
        dict(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=16, vocab_size=256),
    ),
    # fla's RWKV-7 at the 340M DeltaNet's depth and width (24 layers, hidden 1024), heads of fla's
    # default 64 (16 heads).
    "rwkv7-340m": ("RWKV7Config", dict(hidden_size=1024, num_hidden_layers=24, head_dim=64, vocab_size=32000)),
    "rwkv7-tiny": (
        "RWKV7Config",
        dict(hidden_size=64, num_hidden_layers=2, head_dim=32, decay_low_rank_dim=16, gate_low_rank_dim=16,
             a_low_rank_dim=16, v_low_rank_dim=16, vocab_size=256),
    ),
    # transformers' own delta-rule models (config classes of transformers, not fla).
    **TRANSFORMERS_PRESETS,
}
