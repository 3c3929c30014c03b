"""The Python API: osdn_diag.capture(model) … osdn_diag.replay(cap)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import osdn_diag

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _fresh_python import run_json  # noqa: E402

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
    # of the columns only some layers fill, the decay's (both layers fill them), as the file would hold
    from osdn_diag.replay.replayer import optional_columns

    assert set(optional_columns()) & set(t) == {"loss_before_decayed", "residual_ratio_post"}
    assert None not in t["residual_ratio_post"]
    if df is not None:
        assert list(df.columns)[:5] == ["prompt", "task", "layer", "head", "pos"]


def test_replay_of_nothing_is_an_error():
    with pytest.raises(ValueError, match="no calls were captured"):
        osdn_diag.replay([])


@pytest.mark.parametrize("tolerance", [-1, 0, float("nan"), "1e-5"])
def test_a_tolerance_that_is_not_a_positive_number_is_an_argument_error(tolerance):
    from osdn_diag.replay import Replayer

    with pytest.raises(ValueError, match="argument 'tolerance': expected a relative error > 0"):
        Replayer({}, tolerance=tolerance)  # what osdn_diag.replay and the pipeline replay with


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA GPU")
def test_a_cuda_device_without_a_gpu_is_an_argument_error_naming_it():
    from osdn_diag.models import load_model
    from osdn_diag.replay import Replayer

    with pytest.raises(ValueError, match="argument 'device': 'cuda' asked for, but torch sees no CUDA GPU"):
        Replayer({}, device="cuda")
    with pytest.raises(ValueError, match="argument 'device': 'cuda:1' asked for"):
        load_model("random:deltanet-tiny", device="cuda:1")


def _has_pandas() -> bool:
    try:
        import pandas  # noqa: F401
    except ImportError:
        return False
    return True


def test_in_memory_positions_and_position_bins_follow_the_prompt_lengths():
    """Prompts of three lengths (two packed in one padded batch, one in a second forward pass), each
    with a task and a repeated context: every row's pos runs over its prompt, rel_pos = pos / length,
    the summary's position bins count and average the rows whose rel_pos falls in each tenth, and the
    repeat boundary per task is the mean of repeat_start / length — all computed here from the lengths
    the test chose (coprime with 10, so that no pos / length sits on a bin edge)."""
    from fla.layers import GatedDeltaNet

    from osdn_diag.prompts import Prompt

    lengths, tasks, repeats = [19, 13, 17], ["a", "b", "a"], [9, 6, 8]
    hidden, heads, bins = 64, 2, 10
    torch.manual_seed(1)
    layer = GatedDeltaNet(hidden_size=hidden, num_heads=heads, head_dim=32, expand_v=1, layer_idx=0).eval()
    x = torch.zeros(2, lengths[0], hidden)
    mask = torch.zeros(2, lengths[0], dtype=torch.long)
    for row in (0, 1):
        x[row, :lengths[row]] = torch.randn(lengths[row], hidden)
        mask[row, :lengths[row]] = 1
    with torch.no_grad(), osdn_diag.capture(layer, kernels="fla") as cap:
        layer(x, attention_mask=mask)  # prompts 0 and 1, packed (the kernel gets cu_seqlens)
        layer(torch.randn(1, lengths[2], hidden))  # prompt 2
    prompts = [Prompt(id=i, task=t, input_ids=list(range(n)), repeat_start=r)
               for i, (n, t, r) in enumerate(zip(lengths, tasks, repeats))]
    res = osdn_diag.replay(cap, prompts=prompts, comparator=False)
    t = res.table.to_pydict()

    rows = {}
    for p, head, pos, rel in zip(t["prompt"], t["head"], t["pos"], t["rel_pos"]):
        rows.setdefault((p, head), []).append((pos, rel))
    assert sorted(rows) == [(p, h) for p in range(3) for h in range(heads)]
    for (p, head), got in rows.items():
        n = lengths[p]
        assert sorted(pos for pos, _ in got) == list(range(n)), (p, head)
        for pos, rel in got:
            assert math.isclose(rel, pos / n, rel_tol=1e-6, abs_tol=0), (p, pos, rel)
    assert t["task"] == [tasks[p] for p in t["prompt"]]
    assert t["repeat_start"] == [repeats[p] for p in t["prompt"]]

    def binned(select):
        count, logs = [0] * bins, [[] for _ in range(bins)]
        for p, pos, q, finite in zip(t["prompt"], t["pos"], t["residual_ratio"], t["finite"]):
            if finite and select(p):
                b = (bins * pos) // lengths[p]  # exact: the bin of pos / length
                count[b] += 1
                logs[b].append(math.log(max(q, 1e-30)))
        return count, [math.exp(math.fsum(v) / len(v)) if v else None for v in logs]

    summary_bins = res.summary["position_bins"]
    for got, select in [(summary_bins, lambda p: True),
                        *((summary_bins["by_task"][task], lambda p, task=task: tasks[p] == task) for task in "ab")]:
        count, q_geo = binned(select)
        assert got["n"] == count
        for g, want in zip(got["q_geo"], q_geo):
            assert (want is None and math.isnan(g)) or math.isclose(g, want, rel_tol=1e-6), (got["q_geo"], q_geo)
    assert sum(summary_bins["n"]) == res.summary["n"] == sum(lengths) * heads
    boundary = summary_bins["repeat_boundary"]
    assert boundary.keys() == {"a", "b"}
    assert math.isclose(boundary["a"], (9 / 19 + 8 / 17) / 2, rel_tol=1e-12)
    assert math.isclose(boundary["b"], 6 / 13, rel_tol=1e-12)


# An fla model built on a CPU, fla imported before or after osdn_diag.models, Triton's interpreter not
# set in the environment: the README's snippet as a user writes it.
_ORDER = """
import json, sys
first = sys.argv[1]
if first == "osdn":
    import osdn_diag.models
import torch
from fla.models import DeltaNetConfig, DeltaNetForCausalLM
import osdn_diag
model = DeltaNetForCausalLM(DeltaNetConfig(hidden_size=32, num_hidden_layers=1, num_heads=2,
                                           vocab_size=50)).eval()
try:
    with torch.no_grad(), osdn_diag.capture(model) as cap:
        model(torch.randint(0, 50, (1, 8)))
    out = {"q_geo": osdn_diag.replay(cap).summary["q_geo"]}
except Exception as err:
    out = {"error": type(err).__name__, "message": str(err)}
print(json.dumps(out))
"""


@pytest.mark.parametrize("first", ["fla", "osdn"])
def test_cpu_capture_whichever_was_imported_first(first):
    """With osdn_diag.models imported first the interpreter is on and capture works; with fla first its
    kernels were built for a GPU: capture refuses in one line saying what to do, instead of a Triton
    traceback from inside the forward."""
    out = run_json(_ORDER.replace("sys.argv[1]", repr(first)), unset=("TRITON_INTERPRET",), timeout=300)
    if first == "osdn":
        assert 0 < out["q_geo"] < 1
    else:
        assert out["error"] == "InterpreterUnavailable"
        assert "import osdn_diag.models` before importing fla" in out["message"]
