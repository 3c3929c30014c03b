"""The Python API: osdn_diag.capture(model) … osdn_diag.replay(cap)."""

from __future__ import annotations

import pytest
import torch

import osdn_diag

pytestmark = pytest.mark.usefixtures("fla_interpreter")


def test_capture_then_replay_in_memory():
    from fla.models import GatedDeltaNetConfig
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        GatedDeltaNetConfig(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32,
                            expand_v=1.0, vocab_size=64)
    ).eval()
    with torch.no_grad(), osdn_diag.capture(model, kernels="fla") as cap:
        model(torch.randint(0, 64, (2, 20)))  # two prompts in one batch
        model(torch.randint(0, 64, (1, 12)))  # a third, in a second forward pass
    assert [c.forward for c in cap.calls] == [0, 0, 1, 1]
    res = osdn_diag.replay(cap)
    df = res.to_pandas() if _has_pandas() else None
    t = res.table.to_pydict()
    assert sorted(set(t["prompt"])) == [0, 1, 2]
    assert len(t["prompt"]) == (2 * 20 + 12) * 2 * 2  # tokens × layers × heads
    assert res.summary["n"] == len(t["prompt"]) and "post_decay" in res.summary
    assert res.summary["fidelity"]["max_rel_error"] <= 1e-5
    if df is not None:
        assert list(df.columns)[:5] == ["prompt", "task", "layer", "head", "pos"]


def test_replay_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="no calls were captured"):
        osdn_diag.replay([])


def _has_pandas() -> bool:
    try:
        import pandas  # noqa: F401
    except ImportError:
        return False
    return True
