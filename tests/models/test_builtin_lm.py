"""The built-in language models (``builtin:lm-*``): what ships with them, that they load offline, that
their cards, configs, tokenizers and ``lm_train_summary.json`` agree, and that ``{"text": ...}``
prompts are tokenised with their tokenizer."""

from __future__ import annotations

import json
import math
import socket

import pytest
import torch

from osdn_diag.catalog.builtin import BUILTIN_ROOT, builtin_names, builtin_task
from osdn_diag.models import load_model
from osdn_diag.prompts import corpus

# Spelled out so that the test fails if a language model is added, renamed or lost from the package.
LM_NAMES = ["lm-deltanet", "lm-osdn", "lm-osdn-apf"]
CLASS = {"lm-deltanet": "DeltaNetForCausalLM", "lm-osdn": "OSDNForCausalLM", "lm-osdn-apf": "OSDNForCausalLM"}
MODEL_TYPE = {"lm-deltanet": "delta_net", "lm-osdn": "osdn", "lm-osdn-apf": "osdn"}
ARCH = {"lm-deltanet": "deltanet", "lm-osdn": "osdn", "lm-osdn-apf": "osdn-apf"}  # train_lm.py --arch
PAPER_ETA = 0.003
MAX_BYTES = 12 * 1024 * 1024  # each checkpoint: the wheel carries them


def _summary():
    return json.loads((BUILTIN_ROOT / "lm_train_summary.json").read_text())


def _card(name):
    return (BUILTIN_ROOT / name / "README.md").read_text()


def _card_config(name):
    return json.loads(_card(name).split("```json\n", 1)[1].split("\n```", 1)[0])


@pytest.fixture
def offline(monkeypatch):
    """No network: any connection attempt fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access while loading a built-in model: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_shipped_language_models_are_exactly_these():
    assert [n for n in builtin_names() if n.startswith("lm-")] == LM_NAMES
    assert not (BUILTIN_ROOT / "lm-corpus" / "config.json").exists()  # the corpus is not a model


@pytest.mark.parametrize("name", LM_NAMES)
def test_each_language_model_loads_offline_and_matches_its_card(name, offline):
    d = BUILTIN_ROOT / name
    loaded = load_model(f"builtin:{name}")
    assert type(loaded.model).__name__ == CLASS[name]
    assert loaded.source == "builtin" and loaded.directory == d
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPE[name] and config["architectures"] == [CLASS[name]]
    card_config = _card_config(name)
    assert card_config["model_type"] == MODEL_TYPE[name]
    for key, value in card_config.items():  # every field the card states is the config's
        assert config[key] == value, (name, key)
    assert config["vocab_size"] == corpus.corpus_info()["vocab_size"]
    if MODEL_TYPE[name] == "osdn":
        assert config["eta"] == PAPER_ETA and config["apf"] is (name == "lm-osdn-apf")
    assert builtin_task(name) == {"suite": "lm-heldout", "length": 512}
    assert sum(p.numel() for p in loaded.model.parameters()) == _summary()["models"][name]["parameters"]


@pytest.mark.parametrize("name", LM_NAMES)
def test_each_language_model_ships_the_corpus_tokenizer_and_small_bf16_weights(name):
    from safetensors import safe_open

    d = BUILTIN_ROOT / name
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (d / f).read_bytes() == (corpus.CORPUS_DIR / f).read_bytes(), (name, f)
    assert not list(d.glob("*.bin")) and not list(d.glob("*.pt"))  # no pickled weights
    weights = d / "model.safetensors"
    assert weights.stat().st_size <= MAX_BYTES, (name, weights.stat().st_size)
    with safe_open(str(weights), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


def test_lm_train_summary_agrees_with_the_cards_and_logs():
    summary = _summary()
    assert sorted(summary["models"]) == LM_NAMES  # lm-osdn-tuned ships only when another η won
    assert summary["corpus"] == corpus.corpus_info()
    for name in LM_NAMES:
        res = summary["models"][name]
        card = _card(name)
        assert card.startswith(f"# {name}\n")
        assert res["arch"] == ARCH[name]
        assert f"final training loss {res['loss']:.4f}" in card
        assert (f"Final: perplexity {math.exp(res['heldout_nll']):.2f} single, "
                f"{math.exp(res['heldout_nll_twice']):.2f} twice.") in card
        assert f"({res['parameters'] / 1e6:.2f} M parameters)" in card
        assert f"- {res['steps']} steps of " in card
        assert summary["command"] in card
        rows = [json.loads(x) for x in (BUILTIN_ROOT / name / "train_log.jsonl").read_text().splitlines() if x]
        evals = [r for r in rows if "heldout_nll" in r]
        assert evals[-1]["step"] == res["steps"]
        assert (evals[-1]["heldout_nll"], evals[-1]["heldout_nll_twice"]) == (res["heldout_nll"],
                                                                               res["heldout_nll_twice"])
        assert [r for r in rows if "loss" in r][-1]["loss"] == res["loss"]
        d = res.get("d")
        assert (d is not None) is (MODEL_TYPE[name] == "osdn")
        if d is not None:
            assert f"- preconditioner d on held-out text: mean {d['mean']:.3f}" in card
    assert summary["models"]["lm-deltanet"]["from"] == "deltanet"
    assert summary["models"]["lm-osdn"]["eta"] == PAPER_ETA
    # the card's step-size verdict: the paper's η had the lowest held-out NLL, so no tuned model ships
    step = _card("lm-osdn").split("## Step size\n\n", 1)[1]
    assert step.startswith(f"η = {PAPER_ETA:g} had the lowest held-out NLL")
    assert f"η = {PAPER_ETA:g}: {summary['models']['lm-osdn']['heldout_nll']:.4f}" in step


TEXTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())  # π"]


@pytest.mark.usefixtures("fla_interpreter")
def test_text_prompts_run_through_the_models_tokenizer(tmp_path):
    """``osdn-diag run builtin:lm-osdn --prompts FILE`` on ``{"text": ...}`` rows: each prompt is the
    tokenizer's encoding (no special tokens). The manifest records each prompt's length, not its ids,
    so the ids are checked through what they produce: the first layer's captured keys equal those of a
    forward pass on the ids encoded here."""
    import osdn_diag
    from osdn_diag.capture.store import CaptureReader
    from osdn_diag.cli import main
    from tokenizers import Tokenizer

    prompts = tmp_path / "text.jsonl"
    prompts.write_text("".join(json.dumps({"text": t, "task": "code"}) + "\n" for t in TEXTS))
    out = tmp_path / "run"
    assert main(["run", "builtin:lm-osdn", "--prompts", str(prompts), "--out", str(out), "-q"]) == 0
    tok = Tokenizer.from_file(str(corpus.CORPUS_DIR / "tokenizer.json"))
    ids = [tok.encode(t).ids for t in TEXTS]
    assert [tok.decode(x) for x in ids] == TEXTS and all(0 not in x for x in ids)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [(p["id"], p["task"], p["length"]) for p in manifest["prompts"]] == [
        (i, "code", len(x)) for i, x in enumerate(ids)]

    model = load_model("builtin:lm-osdn").model
    reader = CaptureReader(out)
    stored = {}
    for shard in reader.shards():
        s = reader.load(shard)
        if s.call.layer == 0:
            assert len(s.prompts) == 1
            stored[s.prompts[0]] = s.call.k
    assert sorted(stored) == [0, 1]
    for i, x in enumerate(ids):
        with osdn_diag.capture(model, kernels="reference") as cap, torch.inference_mode():
            model(input_ids=torch.tensor([x]))
        assert torch.allclose(stored[i], cap.calls[0].k.float(), atol=1e-5, rtol=1e-4), i
