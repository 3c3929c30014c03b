"""The built-in trained models (``builtin:NAME``): what ships with them, loading, and that they still
recall what they were trained on."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "layers"))  # the layers' fp64 oracle
from _layer_oracle import osdn_oracle, relative_error  # noqa: E402

from osdn_diag.models import load_model  # noqa: E402
from osdn_diag.catalog.builtin import (  # noqa: E402
    BUILTIN_ROOT,
    builtin_names,
    builtin_path,
    builtin_task,
)

# Spelled out so that the test fails if a model is added, renamed or lost from the package data.
NAMES = ["mqar-deltanet", "mqar-osdn", "mqar-osdn-apf"]
LM_NAMES = ["lm-deltanet", "lm-osdn", "lm-osdn-apf"]  # the language models: tests/models/test_builtin_lm.py
CLASS = {"mqar-deltanet": "DeltaNetForCausalLM", "mqar-osdn": "OSDNForCausalLM",
         "mqar-osdn-apf": "OSDNForCausalLM"}
MODEL_TYPE = {"mqar-deltanet": "delta_net", "mqar-osdn": "osdn", "mqar-osdn-apf": "osdn"}


def _log(name):
    return [json.loads(line) for line in (BUILTIN_ROOT / name / "train_log.jsonl").read_text().splitlines()
            if line.strip()]


def test_names_are_exactly_the_shipped_models():
    assert builtin_names() == sorted(NAMES + LM_NAMES)
    assert builtin_names(BUILTIN_ROOT) == sorted(NAMES + LM_NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_model_ships_weights_card_log_and_task(name):
    d = builtin_path(name)
    assert d == BUILTIN_ROOT / name
    for f in ("config.json", "model.safetensors", "README.md", "task.json", "train_log.jsonl"):
        assert (d / f).is_file() and (d / f).stat().st_size > 0, f
    assert not list(d.glob("*.bin")) and not list(d.glob("*.pt"))  # no pickled weights
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE[name]
    assert config["architectures"] == [CLASS[name]]

    task = builtin_task(name)
    assert task == json.loads((d / "task.json").read_text())
    assert task["suite"] == "mqar"
    assert task["vocab_size"] == config["vocab_size"]
    assert 1 <= task["num_queries"] <= task["num_pairs"] < task["vocab_size"] // 2


@pytest.mark.parametrize("name", NAMES)
def test_model_card_reports_the_logged_final_accuracy(name):
    card = (BUILTIN_ROOT / name / "README.md").read_text()
    log = _log(name)
    losses = [r for r in log if "loss" in r]
    evals = [r for r in log if "accuracy_single" in r]
    assert losses and evals
    assert all(math.isfinite(r["loss"]) for r in losses)
    last = evals[-1]
    assert last["step"] == losses[-1]["step"]  # the last evaluation is at the final step
    assert card.startswith(f"# {name}\n")
    assert f"| MQAR | {last['accuracy_single']:.4f} |" in card
    assert f"| MQAR-twice | {last['accuracy_twice']:.4f} |" in card
    assert f"final training loss {losses[-1]['loss']:.4f}" in card
    assert f"{last['step']} steps of batch" in card
    assert "python examples/train_mqar.py" in card
    assert f'"model_type": "{MODEL_TYPE[name]}"' in card
    # ... and the shared training summary next to the models agrees with the log
    summary = json.loads((BUILTIN_ROOT / "train_summary.json").read_text())
    result = summary["results"][name.removeprefix("mqar-")]
    assert result["accuracy_single"] == last["accuracy_single"]
    assert result["accuracy_twice"] == last["accuracy_twice"]
    assert result["steps"] == last["step"]


@pytest.mark.parametrize("name", NAMES)
def test_load_builtin(name):
    loaded = load_model(f"builtin:{name}")
    assert type(loaded.model).__name__ == CLASS[name]
    assert loaded.source == "builtin" and loaded.spec == f"builtin:{name}"
    assert loaded.directory == BUILTIN_ROOT / name
    assert loaded.config["model_type"] == MODEL_TYPE[name]
    assert not loaded.model.training
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    if MODEL_TYPE[name] == "osdn":
        from osdn_diag.models import OSDNForCausalLM

        assert isinstance(loaded.model, OSDNForCausalLM)
        assert loaded.model.config.apf is (name == "mqar-osdn-apf")


def test_unknown_builtin_lists_the_available_ones():
    with pytest.raises(ValueError, match="builtin:x") as err:
        load_model("builtin:x")
    for name in NAMES:
        assert f"builtin:{name}" in str(err.value)


def test_root_without_models(tmp_path):
    assert builtin_names(tmp_path) == []
    assert builtin_names(tmp_path / "missing") == []
    (tmp_path / "half").mkdir()  # a directory without config.json is not a model
    (tmp_path / "half" / "task.json").write_text("{}")
    assert builtin_names(tmp_path) == []
    with pytest.raises(ValueError, match="none") as err:
        builtin_path("mqar-osdn", tmp_path)
    assert "builtin:mqar-osdn" in str(err.value) and "mqar-deltanet" not in str(err.value)
    with pytest.raises(ValueError, match="none"):
        builtin_task("mqar-osdn", tmp_path)


def test_custom_root(tmp_path):
    shutil.copytree(BUILTIN_ROOT / "mqar-osdn", tmp_path / "mine", ignore=shutil.ignore_patterns("*.safetensors"))
    assert builtin_names(tmp_path) == ["mine"]
    assert builtin_path("mine", tmp_path) == tmp_path / "mine"
    assert builtin_task("mine", tmp_path)["suite"] == "mqar"
    with pytest.raises(ValueError, match="available: builtin:mine$"):
        builtin_path("mqar-osdn", tmp_path)
    (tmp_path / "mine" / "task.json").unlink()
    with pytest.raises(FileNotFoundError, match="task.json"):
        builtin_task("mine", tmp_path)


@pytest.mark.usefixtures("fla_interpreter")
@pytest.mark.parametrize("name", NAMES)
def test_builtin_recalls_its_own_task(name):
    """The shipped weights still solve the MQAR shape of their task.json (single and twice), on the
    CPU with the delta-rule kernel replaced by the reference recurrence."""
    import osdn_diag
    from osdn_diag.prompts import MQARSpec, mqar_prompts, recall_by_task

    model = load_model(f"builtin:{name}").model
    task = builtin_task(name)
    spec = MQARSpec(vocab_size=task["vocab_size"], num_pairs=task["num_pairs"], num_queries=task["num_queries"])
    layers = model.config.num_hidden_layers
    for twice in (False, True):
        prompts = mqar_prompts(spec, num_prompts=2, seed=1234, twice=twice)
        ids = torch.tensor([p.input_ids for p in prompts])
        with osdn_diag.capture(model, kernels="reference") as cap, torch.inference_mode():
            logits = model(input_ids=ids).logits
        assert len(cap.calls) == layers
        assert {c.flags.get("kernels") for c in cap.calls} == {"reference"}
        assert all((c.d is not None) is (MODEL_TYPE[name] == "osdn") for c in cap.calls)
        recall = recall_by_task({p.id: logits[i] for i, p in enumerate(prompts)}, prompts)
        t = "mqar-twice" if twice else "mqar"
        assert recall[t]["queries"] == 2 * task["num_queries"]
        assert recall[t]["accuracy"] >= 0.9, (name, t, recall)


# The OSDN layer's constructor arguments that a model's config.json carries.
_LAYER_ARGS = ("num_heads", "eta", "d_min", "d_max", "beta_aware", "apf", "learn_d0", "phase1_eps", "use_beta",
               "use_gate", "use_short_conv", "allow_neg_eigval", "qk_activation", "qk_norm", "norm_eps")


@pytest.mark.usefixtures("fla_interpreter")
@pytest.mark.parametrize("name", ["mqar-osdn", "mqar-osdn-apf"])
def test_builtin_osdn_layers_equal_fp64_oracle(name):
    """Each attention layer of a shipped OSDN model, with its trained weights (APF's retention gate
    included) and the settings read from config.json by plain JSON, equals the fp64 oracle of
    tests/layers on random hidden states (T = 70: the chunked path, one chunk of 64 and a partial one)."""
    config = json.loads((BUILTIN_ROOT / name / "config.json").read_text())
    assert config["expand_k"] == config["expand_v"] == 1.0 and config["conv_size"] == 4  # the oracle's shape
    kw = {key: config[key] for key in _LAYER_ARGS}
    model = load_model(f"builtin:{name}").model
    x = torch.randn(1, 70, config["hidden_size"], generator=torch.Generator().manual_seed(5))
    for i, block in enumerate(model.model.layers):
        with torch.no_grad():
            got = block.attn(x)[0]
            want, _, parts = osdn_oracle(block.attn, x, **kw)
        assert (parts["retention"] is not None) is (name == "mqar-osdn-apf")
        assert relative_error(got, want) <= 1e-5, (name, i)
