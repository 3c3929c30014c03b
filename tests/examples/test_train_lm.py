"""examples/train_lm.py — ``prepare``, ``train`` and ``ship`` — on a small synthetic library, on the CPU.

The script runs in this process (imported from its path, ``main(argv)``) rather than as a subprocess
as tests/examples/test_examples.py runs the others: a subprocess would pay fla's import again (~5–10 s),
and ``train`` is the only costly step (~8 s for three 1-layer models, 2 steps). ``train`` seeds torch's
global generator, so it runs inside ``torch.random.fork_rng``.

The library is a handful of generated ``.py`` files whose paths fall on both sides of the corpus split
(:func:`osdn_diag.prompts.corpus.split_of`), beside files ``prepare`` must leave out (site-packages,
bytecode caches, not UTF-8, not ``.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import math
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from osdn_diag.prompts import corpus

ROOT = Path(__file__).resolve().parents[2]
TRAIN_FILES = ["mod1.py", "mod2.py", "mod3.py", "pkg/sub1.py"]
HELDOUT_FILES = ["mod28.py", "pkg/sub6.py"]  # sha256 of the path starts with a byte < 13
VOCAB = 300
SEQ = 32
TRAIN_ARGV = ["train", "--device", "cpu", "--arch", "deltanet", "osdn:0.003", "osdn:0.03", "--hidden", "32",
              "--layers", "1", "--heads", "2", "--intermediate", "64", "--seq", str(SEQ), "--batch", "2",
              "--steps", "2", "--eval-windows", "2", "--warmup", "1", "--lr", "0.01"]
# --arch entry -> (checkpoint name, class, eta)
ARCHS = {"deltanet": ("deltanet", "DeltaNetForCausalLM", None),
         "osdn:0.003": ("osdn-eta0.003", "OSDNForCausalLM", 0.003),
         "osdn:0.03": ("osdn-eta0.03", "OSDNForCausalLM", 0.03)}
# |summary NLL - NLL recomputed here|: train evaluates its fp32 weights, the checkpoint holds them
# rounded to bf16 (relative error <= 2^-9 per weight). On these models the rounding moves the mean
# NLL by <= 3e-4 (measured); a target shifted by one token moves it by >= 0.1 and the twice NLL
# differs from the single one by >= 5e-3, so 2e-3 tells the right number from those.
NLL_TOL = 2e-3


def _load_script():
    spec = importlib.util.spec_from_file_location("train_lm_under_test", ROOT / "examples" / "train_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _source(seed: int, functions: int) -> str:
    r = random.Random(seed)
    words = "value index count result name items data None True False".split()
    return "\n".join(
        f"def f{seed}_{i}(x, y):\n    \"\"\"Return the {r.choice(words)} of x.\"\"\"\n"
        f"    return x {r.choice('+-*')} y * {r.randint(0, 9)}\n" for i in range(functions))


def _library(root: Path) -> dict[str, str]:
    """Write the synthetic library; returns the ``.py`` files prepare must read, ``{relpath: text}``."""
    files = {rel: _source(i, 30) for i, rel in enumerate(TRAIN_FILES + HELDOUT_FILES)}
    files["mod2.py"] += "\n# non-ASCII text survives: π ≈ 3.14159, «quoted», 日本\n"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    for rel in ("site-packages/third.py", "pkg/__pycache__/cached.py", "dist-packages/other.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("def third_party():\n    return 1\n")
    (root / "latin1.py").write_bytes(b"# caf\xe9\n")  # not UTF-8: skipped
    (root / "notes.txt").write_text("not a Python file\n")
    return files


@pytest.fixture(scope="module")
def script():
    return _load_script()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, script):
    base = tmp_path_factory.mktemp("lm")
    lib = base / "lib"
    files = _library(lib)
    data = base / "data"
    info = script.main(["prepare", "--data", str(data), "--stdlib", str(lib), "--vocab", str(VOCAB)])
    return lib, files, data, info


@pytest.fixture(scope="module")
def training(prepared, script, fla_interpreter):
    """The three models trained 2 steps, logged at each; stderr (not a terminal) as printed."""
    _, _, data, _ = prepared
    out = data.parent / "runs"
    argv = [*TRAIN_ARGV, "--log-every", "1", "--data", str(data), "--out", str(out)]
    err = io.StringIO()  # not a terminal: tqdm's bar is off, the progress lines are printed
    with pytest.MonkeyPatch.context() as mp, torch.random.fork_rng(), contextlib.redirect_stderr(err):
        mp.setattr(sys, "argv", ["examples/train_lm.py", *argv])  # what the card's "Made by" quotes
        results = script.main(argv)
    return out, results, argv, err.getvalue()


@pytest.fixture(scope="module")
def trained(training):
    return training[:3]


def _split(files, split):
    return sorted((rel, text) for rel, text in files.items() if corpus.split_of(rel) == split)


# --- prepare ----------------------------------------------------------------------------------------


def test_the_synthetic_library_falls_on_both_sides_of_the_split():
    assert [corpus.split_of(p) for p in TRAIN_FILES] == ["train"] * len(TRAIN_FILES)
    assert [corpus.split_of(p) for p in HELDOUT_FILES] == ["heldout"] * len(HELDOUT_FILES)


def test_prepare_tokenizer_loads_with_transformers_and_round_trips(prepared):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    _, files, data, info = prepared
    assert {p.name for p in data.iterdir()} == {
        "tokenizer.json", "tokenizer_config.json", "train.bin", "heldout.safetensors", "corpus.json"}
    tok = AutoTokenizer.from_pretrained(str(data))
    assert isinstance(tok, PreTrainedTokenizerFast)  # the class every transformers release resolves
    assert tok.eos_token == corpus.END_OF_TEXT and tok.convert_tokens_to_ids(corpus.END_OF_TEXT) == 0
    assert len(tok) == info["vocab_size"] == info["tokenizer"]["vocab_size"]
    assert 256 < info["vocab_size"] <= VOCAB  # every byte, the special token, some merges
    for rel, text in files.items():  # held-out text too: byte-level BPE encodes anything
        ids = tok(text)["input_ids"]
        assert 0 not in ids and len(ids) < len(text)  # merges learnt, no special token inside text
        assert tok.decode(ids) == text, rel


def test_prepare_train_bin_is_the_train_documents_each_followed_by_end_of_text(prepared):
    from tokenizers import Tokenizer

    _, files, data, info = prepared
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    want = [t for _, text in _split(files, "train") for t in [*tok.encode(text).ids, 0]]
    raw = (data / "train.bin").read_bytes()
    got = np.frombuffer(raw, dtype="<u2").tolist()
    assert len(raw) == 2 * len(want) and got == want
    assert info["train_tokens"] == len(want)


def test_prepare_heldout_decodes_to_the_heldout_files(prepared):
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    _, files, data, info = prepared
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    held = _split(files, "heldout")
    docs = corpus.heldout_documents(data)
    assert [tok.decode(d) for d in docs] == [text for _, text in held]
    assert docs == [tok.encode(text).ids for _, text in held]
    raw = load_file(str(data / "heldout.safetensors"))
    assert raw["offsets"].dtype == np.int64 and raw["offsets"].tolist() == np.cumsum(
        [0, *map(len, docs)]).tolist()
    assert (data / "heldout.safetensors").stat().st_mode & 0o777 == 0o644
    assert info["heldout_tokens"] == sum(map(len, docs)) and info["heldout_documents"] == len(held)


def test_prepare_corpus_json_counts_the_files_read(prepared):
    lib, files, data, info = prepared
    assert json.loads((data / "corpus.json").read_text()) == info == corpus.corpus_info(data)
    train, held = _split(files, "train"), _split(files, "heldout")
    assert info["files"] == {"train": len(train), "heldout": len(held)}  # nothing of the excluded files
    assert info["characters"] == {"train": sum(len(t) for _, t in train), "heldout": sum(len(t) for _, t in held)}
    assert info["stdlib"] == str(lib)
    assert info["python"] == sys.version.split()[0]
    assert info["tokenizer"]["end_of_text"] == corpus.END_OF_TEXT and info["tokenizer"]["end_of_text_id"] == 0
    assert str(corpus.HELDOUT_BYTE) in info["split"]
    digest = hashlib.sha256()
    for rel, text in train + held:
        digest.update(rel.encode() + b"\0" + text.encode() + b"\0")
    assert info["sha256"] == digest.hexdigest()


def test_prepare_is_deterministic(prepared, script, tmp_path):
    lib, _, data, _ = prepared
    script.main(["prepare", "--data", str(tmp_path), "--stdlib", str(lib), "--vocab", str(VOCAB)])
    for name in ("tokenizer.json", "tokenizer_config.json", "train.bin", "heldout.safetensors", "corpus.json"):
        assert (tmp_path / name).read_bytes() == (data / name).read_bytes(), name


def test_prepare_defaults_to_the_interpreters_library(script, monkeypatch, tmp_path):
    """Without --stdlib the library is corpus.stdlib_root() (stopped at the first read, not run)."""
    seen = []

    def stop(root=None):
        seen.append(root)
        raise RuntimeError("stop")

    monkeypatch.setattr(corpus, "stdlib_documents", stop)
    with pytest.raises(RuntimeError, match="stop"):
        script.main(["prepare", "--data", str(tmp_path / "d")])
    assert seen == [corpus.stdlib_root()]


def test_prepare_refuses_a_vocabulary_beyond_int16(prepared, script, tmp_path):
    """heldout.safetensors stores token ids as int16 (osdn_diag.prompts.corpus): a larger vocabulary is
    refused before any work, rather than failing after the tokenizer was trained."""
    lib, _, _, _ = prepared
    with pytest.raises(SystemExit, match="--vocab <= 32768, got 32769"):
        script.main(["prepare", "--data", str(tmp_path / "d"), "--stdlib", str(lib), "--vocab", "32769"])
    assert not (tmp_path / "d").exists()
    from safetensors.numpy import load_file

    assert load_file(str(corpus.CORPUS_DIR / "heldout.safetensors"))["tokens"].dtype == np.int16  # as documented


# --- train ------------------------------------------------------------------------------------------


def test_train_writes_bf16_checkpoints_that_load_with_their_tokenizer(trained, prepared):
    from safetensors import safe_open

    from osdn_diag.models import load_model

    out, results, _ = trained
    _, _, data, info = prepared
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*(f"lm-{name}" for name, _, _ in ARCHS.values()), "monitor.parquet", "train_summary.json"])  # nothing half-written
    for name, cls, eta in ARCHS.values():
        d = out / f"lm-{name}"
        loaded = load_model(str(d))
        assert type(loaded.model).__name__ == cls
        cfg = loaded.config
        assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_heads"], cfg["intermediate_size"]) == (
            32, 1, 2, 64)
        assert cfg["vocab_size"] == info["vocab_size"] and cfg["tie_word_embeddings"] is True
        assert cfg.get("eta") == eta
        assert cfg["torch_dtype" if "torch_dtype" in cfg else "dtype"] == "bfloat16"
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            assert f.keys() and {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        for tf in ("tokenizer.json", "tokenizer_config.json"):
            assert (d / tf).read_bytes() == (data / tf).read_bytes()
        assert json.loads((d / "task.json").read_text()) == {"suite": "lm-heldout", "length": SEQ}
        assert sum(p.numel() for p in loaded.model.parameters()) == results[name]["parameters"]


def test_train_summary_log_and_card_agree(trained):
    out, results, argv = trained
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["command"] == "python examples/train_lm.py " + " ".join(argv)
    assert set(summary["results"]) == {name for name, _, _ in ARCHS.values()}
    assert summary["results"].keys() == results.keys()
    steps = {}
    for spec, (name, _, eta) in ARCHS.items():
        res = summary["results"][name]
        assert res["arch"] == spec.partition(":")[0] and res["eta"] == eta
        assert res["steps"] == 2 and res["device"] == "cpu"
        rows = [json.loads(x) for x in (out / f"lm-{name}" / "train_log.jsonl").read_text().splitlines()]
        losses = [r for r in rows if "loss" in r]
        evals = [r for r in rows if "heldout_nll" in r]
        assert losses[-1]["step"] == 2 and losses[-1]["loss"] == res["loss"]
        assert evals == res["evals"] and evals[-1]["step"] == 2
        assert (res["heldout_nll"], res["heldout_nll_twice"]) == (evals[-1]["heldout_nll"],
                                                                   evals[-1]["heldout_nll_twice"])
        assert all(math.isfinite(r["heldout_nll"]) and 0 < r["heldout_nll"] < math.log(1000) for r in evals)
        steps[name] = [r["step"] for r in rows]

        card = (out / f"lm-{name}" / "README.md").read_text()
        assert card.startswith(f"# lm-{name}\n")
        assert f"final training loss {res['loss']:.4f}" in card
        for r in evals:
            assert (f"| {r['step']} | {r['heldout_nll']:.4f} | {math.exp(r['heldout_nll']):.2f} | "
                    f"{r['heldout_nll_twice']:.4f} |") in card
        assert (f"Final: perplexity {math.exp(res['heldout_nll']):.2f} single, "
                f"{math.exp(res['heldout_nll_twice']):.2f} twice.") in card
        assert f"({res['parameters'] / 1e6:.2f} M parameters)" in card
        assert f"## Held-out loss (2 windows of {SEQ} tokens)" in card
        assert summary["command"] in card
        config = json.loads(card.split("```json\n", 1)[1].split("\n```", 1)[0])
        assert config["hidden_size"] == 32 and config.get("eta") == eta
        d = res.get("d")
        assert (d is not None) is (eta is not None)
        if d is not None:  # OSDN's preconditioner, read from the kernels, in its box
            assert 0.5 - 1e-6 <= d["min"] <= d["mean"] <= d["max"] <= 2.0 + 1e-6
            assert f"- preconditioner d on held-out text: mean {d['mean']:.3f}" in card
        else:
            assert "preconditioner d" not in card
    assert len(set(map(tuple, steps.values()))) == 1  # lockstep


def test_train_monitors_each_model_and_its_card_and_files_agree(trained, prepared):
    """At the last step (2, below --monitor-every 100) every model is probed once on the first
    --monitor-windows held-out windows: OUT/monitor.parquet holds each model's rows, the checkpoint its
    own, the card the whole-model q_geo and q_arith, train_summary.json the overhead."""
    import pyarrow.parquet as pq

    from osdn_diag.monitor import SCHEMA_FIELDS

    out, results, _ = trained
    table = pq.read_table(out / "monitor.parquet").to_pylist()
    assert {r["model"] for r in table} == {f"lm-{name}" for name, _, _ in ARCHS.values()}
    for name, _, eta in ARCHS.values():
        mine = [r for r in table if r["model"] == f"lm-{name}"]
        assert [(r["step"], r["layer"]) for r in mine] == [(2, 0), (2, -1)]  # one layer, and the whole model
        assert all(math.isfinite(r["q_geo"]) and 0 < r["q_geo"] <= r["q_arith"] for r in mine)
        assert (mine[0]["d_mean"] is not None) is (eta is not None)
        own = pq.read_table(out / f"lm-{name}" / "monitor.parquet")
        assert tuple(own.column_names) == SCHEMA_FIELDS and own.to_pylist() == mine
        mon = results[name]["monitor"]
        assert mon["probes"] == 1 and mon["every"] == 100 and 0 < mon["fraction"] < 1
        assert mon["first_probe_seconds"] == mon["probe_seconds"] and mon["fraction_after_first"] is None
        whole = mine[-1]
        assert mon["q_by_step"] == [{"step": 2, "q_geo": whole["q_geo"], "q_arith": whole["q_arith"]}]
        card = (out / f"lm-{name}" / "README.md").read_text()
        assert "## Contraction during training" in card
        # one probe is no curve: no figure, and the card shows none
        assert "q_geo_by_step.png" not in card and not (out / f"lm-{name}" / "q_geo_by_step.png").exists()
        assert f"| 2 | {whole['q_geo']:.4f} | {whole['q_arith']:.4f} |" in card


def test_train_with_the_monitor_trains_as_without_it(prepared, script, tmp_path):
    """A probe after every step leaves the training loss and held-out NLL exactly as with none."""
    _, _, data, _ = prepared
    base = [*TRAIN_ARGV[:4], "osdn:0.03", *TRAIN_ARGV[7:], "--data", str(data)]
    runs = {}
    for every in ("1", "0"):
        with torch.random.fork_rng():
            runs[every] = script.main([*base, "--out", str(tmp_path / every), "--monitor-every", every])
    on, off = runs["1"]["osdn-eta0.03"], runs["0"]["osdn-eta0.03"]
    assert on["monitor"]["probes"] == 2 and "monitor" not in off
    mon = on["monitor"]  # the second probe's share of the time the first did not take
    assert 0 < mon["first_probe_seconds"] < mon["probe_seconds"]
    assert mon["fraction_after_first"] == pytest.approx(
        (mon["probe_seconds"] - mon["first_probe_seconds"]) / (on["seconds"] - mon["first_probe_seconds"]), rel=1e-12)
    card = (tmp_path / "1" / "lm-osdn-eta0.03" / "README.md").read_text()
    assert (f"the first {mon['first_probe_seconds']:.2f} s (it compiles the probe's kernels), the other "
            f"{100 * mon['fraction_after_first']:.2f} % of the rest") in card
    # two probes: the card shows the curve, drawn from the checkpoint's own monitor.parquet
    assert "](q_geo_by_step.png)" in card
    png = tmp_path / "1" / "lm-osdn-eta0.03" / "q_geo_by_step.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (on["loss"], on["heldout_nll"], on["heldout_nll_twice"]) == \
        (off["loss"], off["heldout_nll"], off["heldout_nll_twice"])
    assert not (tmp_path / "0" / "monitor.parquet").exists()


def _without_seconds(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if "seconds" not in k} for r in rows]


def test_recipe_command_leaves_out_where_a_command_stopped(script):
    assert script.recipe_command(["train", "--time-budget", "480", "--steps", "3", "--stop-after=2", "--out", "a b"]) \
        == "python examples/train_lm.py train --steps 3 --out 'a b'"


def test_train_stopped_and_resumed_trains_as_one_command(prepared, script, tmp_path):
    """Stopped after each step by --stop-after and run again, the run ends where one command ends: the
    same weights bit for bit, the same losses, evaluations and probes; state.pt exists between the
    commands and is removed by the last; a command with another recipe is refused, naming the option."""
    import pyarrow.parquet as pq
    from safetensors.torch import load_file

    _, _, data, _ = prepared
    argv = [*TRAIN_ARGV[:4], "osdn:0.03", *TRAIN_ARGV[7:], "--data", str(data), "--steps", "3",
            "--monitor-every", "1", "--eval-every", "1", "--log-every", "1"]
    with torch.random.fork_rng():
        whole = script.main([*argv, "--out", str(tmp_path / "whole")])["osdn-eta0.03"]
    out = tmp_path / "parts"
    for part in range(2):
        # the second command with another --eta, which no --arch entry here takes (osdn:0.03 names its
        # own): no part of the recipe, it resumes
        eta = ["--eta", "0.5"] if part else []
        command = [*argv, "--out", str(out), "--stop-after", "1", *eta]
        with torch.random.fork_rng(), contextlib.redirect_stderr(io.StringIO()) as err, \
                pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "argv", ["examples/train_lm.py", *command])  # what the card's "Made by" quotes
            stopped = script.main(command)["osdn-eta0.03"]
        assert stopped["steps"] == part + 1 and (out / "state.pt").is_file()
        # the card and summary quote the recipe, not where this command stopped
        made_by = json.loads((out / "train_summary.json").read_text())["command"]
        assert "--stop-after" not in made_by and made_by.endswith(f"--out {out}{' --eta 0.5' if part else ''}") and made_by in (
            out / "lm-osdn-eta0.03" / "README.md").read_text()
        assert f"stopped after step {part + 1} of 3" in err.getvalue()
        if part == 0:
            with pytest.raises(SystemExit, match=r"state.pt: saved by a run with other options \(--lr 0.01 there"):
                script.main([*argv, "--out", str(out), "--lr", "0.02"])

    with torch.random.fork_rng(), contextlib.redirect_stderr(io.StringIO()) as err:
        resumed = script.main([*argv, "--out", str(out)])["osdn-eta0.03"]
    assert "resumed" in err.getvalue() and not (out / "state.pt").exists()
    # its progress line counts this command's one step, not the run's three
    assert re.search(r"\[train\] step 3/3: .* s/step \(last 1\)", err.getvalue()), err.getvalue()
    for key in ("steps", "loss", "heldout_nll", "heldout_nll_twice", "d"):
        assert resumed[key] == whole[key], key
    assert _without_seconds(resumed["evals"]) == _without_seconds(whole["evals"])
    assert resumed["monitor"]["probes"] == whole["monitor"]["probes"] == 3
    assert resumed["monitor"]["q_by_step"] == whole["monitor"]["q_by_step"]
    a, b = (load_file(d / "lm-osdn-eta0.03" / "model.safetensors") for d in (tmp_path / "whole", out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    logs = [[json.loads(x) for x in (d / "lm-osdn-eta0.03" / "train_log.jsonl").read_text().splitlines()]
            for d in (tmp_path / "whole", out)]
    assert _without_seconds(logs[0]) == _without_seconds(logs[1])
    tables = [_without_seconds(pq.read_table(d / "monitor.parquet").to_pylist()) for d in (tmp_path / "whole", out)]
    assert tables[0] == tables[1] and sorted({r["step"] for r in tables[1]}) == [1, 2, 3]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


PROGRESS = re.compile(r"\[train\] step (\d+)/(\d+): (.+) · (\d+\.\d) s, (\d+\.\d\d) s/step \(last (\d+)\)"
                      r"(?: · monitor (\d+\.\d\d) s \((\d+\.\d) %\))?")
FIRST_STEP = re.compile(r"\[train\] step 1/(\d+) took (\d+\.\d) s")


def _progress_lines(stderr: str, out: Path, names: list[str], steps: list[int], total: int) -> list[re.Match]:
    """Check the progress lines train printed on a stderr that is not a terminal: the first step's
    seconds, then one line per logged step (``steps``) naming each model with the loss its
    train_log.jsonl holds for that step, the seconds so far and per step since the line before.
    Returns the step lines' matches."""
    assert f"train {'/'.join(names)}:" not in stderr  # no training bar drawn (tqdm's desc: ...)
    lines = [ln for ln in stderr.splitlines() if ln.startswith("[train] ")]
    assert lines, f"no progress lines on stderr:\n{stderr[-2000:]}"
    first = FIRST_STEP.fullmatch(lines[0])
    assert first and int(first[1]) == total, lines
    matches = [PROGRESS.fullmatch(ln) for ln in lines[1:]]
    assert all(matches), lines
    assert [int(m[1]) for m in matches] == steps and {int(m[2]) for m in matches} == {total}
    logged = {n: {r["step"]: r["loss"] for r in map(json.loads, (out / f"lm-{n}" / "train_log.jsonl").read_text()
                                                        .splitlines()) if "loss" in r} for n in names}
    before_step, before_seconds = 0, 0.0
    for m in matches:
        step = int(m[1])
        assert m[3] == ", ".join(f"{n} {logged[n][step]:.3f}" for n in names)
        seconds, rate, interval = float(m[4]), float(m[5]), int(m[6])
        assert interval == step - before_step and seconds >= before_seconds
        assert abs(rate * interval - (seconds - before_seconds)) <= 0.1 + 0.005 * interval  # as rounded
        before_step, before_seconds = step, seconds
    assert float(first[2]) <= float(matches[0][4])
    return matches


def test_train_prints_progress_lines_where_stderr_is_not_a_terminal(training):
    """Output to a file (nohup, a batch job): the first step's seconds, then a line at each logged step
    (--log-every 1) with every model's loss as train_log.jsonl records it, and the monitor's seconds
    and share; at the last step the seconds of its only probes, the ones train_summary.json reports."""
    out, results, _, stderr = training
    names = [name for name, _, _ in ARCHS.values()]
    matches = _progress_lines(stderr, out, names, [1, 2], 2)
    step1, step2 = matches
    assert (step1[7], step1[8]) == ("0.00", "0.0")  # --monitor-every 100: the only probes follow step 2
    probe_seconds = sum(results[n]["monitor"]["probe_seconds"] for n in names)
    assert step2[7] == f"{probe_seconds:.2f}" and float(step2[7]) > 0
    share, seconds = float(step2[8]), float(step2[4])
    assert 0 < share < 100 and share == pytest.approx(100 * probe_seconds / seconds, abs=1.0)


def test_train_progress_lines_without_the_monitor_and_at_a_terminal(prepared, script, tmp_path):
    """--monitor-every 0: the lines hold no monitor figures, and a last step that is no multiple of
    --log-every has its line. At a terminal the tqdm bar is drawn and no line is printed."""
    _, _, data, _ = prepared
    argv = [*TRAIN_ARGV[:4], "osdn:0.03", *TRAIN_ARGV[7:], "--data", str(data), "--monitor-every", "0",
            "--log-every", "2"]
    argv[argv.index("--steps") + 1] = "3"
    streams = {"file": io.StringIO(), "terminal": _Terminal()}
    for where, stream in streams.items():
        with torch.random.fork_rng(), contextlib.redirect_stderr(stream):
            script.main([*argv, "--out", str(tmp_path / where)])
    matches = _progress_lines(streams["file"].getvalue(), tmp_path / "file", ["osdn-eta0.03"], [2, 3], 3)
    assert all(m[7] is None and m[8] is None for m in matches) and "monitor" not in streams["file"].getvalue()
    terminal = streams["terminal"].getvalue()
    assert "[train]" not in terminal and "\rtrain osdn-eta0.03: 100%" in terminal and "3/3" in terminal  # the bar


def _eval_windows(data: Path, count: int) -> torch.Tensor:
    """The first SEQ tokens of the ``count`` longest held-out documents (train's documented rule)."""
    docs = [d for d in corpus.heldout_documents(data) if len(d) >= SEQ]
    return torch.tensor([d[:SEQ] for d in sorted(docs, key=len, reverse=True)[:count]])


def test_train_heldout_nll_equals_a_cross_entropy_of_the_saved_model(trained, prepared):
    import osdn_diag
    from osdn_diag.models import load_model

    out, results, _ = trained
    _, _, data, _ = prepared
    w = _eval_windows(data, 2)
    assert w.shape == (2, SEQ)  # both held-out documents are long enough for a window
    for name, _, _ in ARCHS.values():
        model = load_model(str(out / f"lm-{name}")).model.float().eval()
        with torch.no_grad(), osdn_diag.capture(model, kernels="reference", sink=lambda call: None):
            single = model(input_ids=w).logits.double()
            twice = model(input_ids=torch.cat([w, w], dim=1)).logits.double()
        ce = torch.nn.functional.cross_entropy
        targets = w[:, 1:].reshape(-1)
        nll_single = float(ce(single[:, :SEQ - 1].reshape(-1, single.shape[-1]), targets))
        nll_twice = float(ce(twice[:, SEQ:2 * SEQ - 1].reshape(-1, twice.shape[-1]), targets))
        assert results[name]["heldout_nll"] == pytest.approx(nll_single, abs=NLL_TOL), name
        assert results[name]["heldout_nll_twice"] == pytest.approx(nll_twice, abs=NLL_TOL), name


def test_train_refuses_a_window_longer_than_every_heldout_document(prepared, script, tmp_path):
    _, _, data, _ = prepared
    longest = max(map(len, corpus.heldout_documents(data)))
    argv = [*TRAIN_ARGV, "--data", str(data), "--out", str(tmp_path / "runs")]
    argv[argv.index("--seq") + 1] = str(longest + 1)
    with pytest.raises(SystemExit, match=f"no held-out document has {longest + 1} tokens"):
        script.main(argv)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("arch, message", [
    (["nope"], "unknown architecture 'nope'"),
    (["deltanet:0.1"], "'deltanet' has no step size"),
    (["osdn:fast"], "must be a number"),
    (["osdn:0.03", "osdn:0.03"], "named twice"),
])
def test_train_refuses_bad_arch_entries(prepared, script, tmp_path, arch, message):
    _, _, data, _ = prepared
    with pytest.raises(SystemExit, match=message):
        script.main(["train", "--data", str(data), "--out", str(tmp_path / "runs"), "--device", "cpu",
                     "--arch", *arch])
    assert not (tmp_path / "runs").exists()


# --- ship -------------------------------------------------------------------------------------------


def _runs_with(trained, tmp_path, nll: dict[str, float]) -> Path:
    """A copy of the trained runs whose summary gives the OSDN models these held-out NLLs."""
    out, _, _ = trained
    runs = tmp_path / "runs"
    shutil.copytree(out, runs)
    summary = json.loads((runs / "train_summary.json").read_text())
    for name, value in nll.items():
        summary["results"][name]["heldout_nll"] = value
    (runs / "train_summary.json").write_text(json.dumps(summary))
    return runs


def _ship(script, runs, dest):
    return script.main(["ship", "--runs", str(runs), "--to", str(dest), "--paper-eta", "0.003"])


def _check_shipped(runs, dest, chosen):
    summary = json.loads((runs / "train_summary.json").read_text())
    assert sorted(p.name for p in dest.iterdir()) == sorted([*chosen, "lm_train_summary.json"])
    for target, name in chosen.items():
        src = runs / f"lm-{name}"
        assert sorted(p.name for p in (dest / target).iterdir()) == sorted(p.name for p in src.iterdir())
        for f in ("model.safetensors", "config.json", "tokenizer.json", "train_log.jsonl", "task.json"):
            assert (dest / target / f).read_bytes() == (src / f).read_bytes()
        # the monitor's rows under the shipped name, every other column as trained
        shipped, trained_rows = (pq.read_table(d / "monitor.parquet") for d in (dest / target, src))
        assert set(trained_rows["model"].to_pylist()) == {f"lm-{name}"} and shipped.num_rows == trained_rows.num_rows > 0
        assert shipped["model"].to_pylist() == [target] * shipped.num_rows
        assert shipped.drop(["model"]).equals(trained_rows.drop(["model"]))
        card = (dest / target / "README.md").read_text()
        assert card.startswith(f"# {target}\n")  # renamed from lm-NAME
        assert card.startswith((src / "README.md").read_text().replace(f"# lm-{name}\n", f"# {target}\n", 1))
    table = json.loads((dest / "lm_train_summary.json").read_text())
    assert table["command"] == summary["command"] and table["corpus"] == summary["corpus"]
    assert table["models"] == {
        target: {"from": name, **{k: v for k, v in summary["results"][name].items() if k != "evals"}}
        for target, name in chosen.items()}


def test_name_monitor_renames_the_rows_and_redraws_the_curve(script, tmp_path, monkeypatch):
    rows = [{"model": "lm-osdn-eta0.003", "step": s, "layer": layer, "q_geo": 0.3 - s / 1000, "q_arith": 0.4,
             "n": 8} for s in (100, 200) for layer in (-1, 0)]
    ckpt = tmp_path / "lm-osdn"
    ckpt.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), ckpt / "monitor.parquet")
    (ckpt / script.CURVE).write_bytes(b"old")
    drawn = []
    import osdn_diag.plot as odp

    real = odp.training
    monkeypatch.setattr(odp, "training", lambda table, **kw: drawn.append(table) or real(table, **kw))
    script.name_monitor(ckpt, "lm-osdn")
    table = pq.read_table(ckpt / "monitor.parquet")
    assert table["model"].to_pylist() == ["lm-osdn"] * 4
    assert table.drop(["model"]).to_pylist() == [{k: v for k, v in r.items() if k != "model"} for r in rows]
    assert [set(t["model"].to_pylist()) for t in drawn] == [{"lm-osdn"}]  # the legend's name
    assert (ckpt / script.CURVE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in ckpt.iterdir()) == ["monitor.parquet", script.CURVE]  # nothing left beside
    before = {f: (ckpt / f).read_bytes() for f in ("monitor.parquet", script.CURVE)}
    script.name_monitor(ckpt, "lm-osdn")  # already under that name: left as it is
    assert {f: (ckpt / f).read_bytes() for f in before} == before and len(drawn) == 1


def _step_size(card: str) -> str:
    assert card.count("## Step size") == 1
    return card.split("## Step size\n\n", 1)[1]


def test_ship_without_a_better_step_size_ships_the_paper_eta_alone(trained, script, tmp_path):
    runs = _runs_with(trained, tmp_path, {"osdn-eta0.003": 1.5, "osdn-eta0.03": 1.75})
    dest = tmp_path / "builtin"
    for stale in ("lm-osdn-tuned", "lm-gdn"):  # an earlier ship's models that this run does not make
        (dest / stale).mkdir(parents=True)
        (dest / stale / "config.json").write_text("{}")
    (dest / "mqar-osdn").mkdir()  # not a language model: left alone
    chosen = _ship(script, runs, dest)
    assert (dest / "mqar-osdn").is_dir()
    shutil.rmtree(dest / "mqar-osdn")
    assert chosen == {"lm-deltanet": "deltanet", "lm-osdn": "osdn-eta0.003"}
    _check_shipped(runs, dest, chosen)
    assert "## Step size" not in (dest / "lm-deltanet" / "README.md").read_text()
    section = _step_size((dest / "lm-osdn" / "README.md").read_text())
    assert section.startswith("η = 0.003 had the lowest held-out NLL of the OSDN models trained in lockstep, "
                              "the paper's own step size, so no separate tuned model ships")
    assert "(held-out NLL by η: η = 0.003: 1.5000, η = 0.03: 1.7500)." in section


def test_ship_with_a_better_step_size_adds_lm_osdn_tuned(trained, script, tmp_path):
    runs = _runs_with(trained, tmp_path, {"osdn-eta0.003": 1.75, "osdn-eta0.03": 1.5})
    dest = tmp_path / "builtin"
    stale = dest / "lm-osdn"  # an earlier ship is replaced whole
    stale.mkdir(parents=True)
    (stale / "old.bin").write_bytes(b"old")
    chosen = _ship(script, runs, dest)
    assert chosen == {"lm-deltanet": "deltanet", "lm-osdn": "osdn-eta0.003", "lm-osdn-tuned": "osdn-eta0.03"}
    _check_shipped(runs, dest, chosen)
    for target in ("lm-osdn", "lm-osdn-tuned"):
        section = _step_size((dest / target / "README.md").read_text())
        assert section.startswith("η = 0.03 had the lowest held-out NLL of the OSDN models trained in lockstep; "
                                  "`lm-osdn` is the paper's η = 0.003, `lm-osdn-tuned` this one")
        assert "(held-out NLL by η: η = 0.003: 1.7500, η = 0.03: 1.5000)." in section
    assert json.loads((dest / "lm-osdn-tuned" / "config.json").read_text())["eta"] == 0.03
    assert json.loads((dest / "lm-osdn" / "config.json").read_text())["eta"] == 0.003


@pytest.mark.parametrize("option", ["--log-every", "--eval-every"])
def test_steps_between_lines_or_evaluations_must_be_at_least_one(prepared, script, tmp_path, option):
    """0 (or less) ended in a ZeroDivisionError traceback at the first step; it is refused up front."""
    _, _, data, _ = prepared
    with pytest.raises(SystemExit, match="argument --log-every/--eval-every: expected at least 1"):
        script.main([*TRAIN_ARGV, "--data", str(data), "--out", str(tmp_path / "o"), option, "0"])
    assert not (tmp_path / "o").exists()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_finished_or_foreign_out_is_refused_and_left_as_it_was(trained, prepared, script, tmp_path):
    """The same command again after the run finished would retrain from scratch over its checkpoints (and
    a new run in a directory holding other files would mix its monitor rows with theirs): refused in
    one line, nothing written."""
    out, _, argv = trained
    done = tmp_path / "done"
    shutil.copytree(out, done)
    before = _files(done)
    again = [*argv[:argv.index("--out")], "--out", str(done)]
    with pytest.raises(SystemExit, match=r"holds a finished training run \(train_summary.json, no state.pt"):
        script.main([*again, "--stop-after", "1"])
    assert _files(done) == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match=r"not empty \(notes.txt\) and no stopped run's state.pt"):
        script.main([*argv[:argv.index("--out")], "--out", str(other)])
    assert _files(other) == {"notes.txt": b"mine"}


def test_a_directory_in_use_is_refused_at_once(prepared, script, tmp_path):
    """Two commands on one --out would both resume from its state and overwrite each other's steps."""
    import fcntl
    import os

    from osdn_diag.rundir import LOCK_FILE

    _, _, data, _ = prepared
    out = tmp_path / "busy"
    out.mkdir()
    with open(out / LOCK_FILE, "w") as held:  # another command's lock (another open file: another holder)
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(f"{os.getpid()}\n")
        held.flush()
        with pytest.raises(SystemExit, match=rf"--out {out}: .*in use by another osdn-diag command"):
            script.main([*TRAIN_ARGV, "--data", str(data), "--out", str(out)])


def test_a_stopped_run_resumed_on_another_corpus_is_refused(prepared, script, tmp_path, fla_interpreter):
    """--data may move, but what it holds may not change between the commands of one run."""
    lib, _, data, _ = prepared
    other_lib = tmp_path / "lib2"
    shutil.copytree(lib, other_lib)
    (other_lib / "mod1.py").write_text(_source(99, 40))  # another text: another corpus and tokenizer
    data2 = tmp_path / "data2"
    script.main(["prepare", "--data", str(data2), "--stdlib", str(other_lib), "--vocab", str(VOCAB)])
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    argv = [*TRAIN_ARGV[:4], "osdn:0.03", *TRAIN_ARGV[7:], "--steps", "2", "--monitor-every", "0"]
    out = tmp_path / "run"
    with torch.random.fork_rng(), contextlib.redirect_stderr(io.StringIO()):
        script.main([*argv, "--data", str(data), "--out", str(out), "--stop-after", "1"])
    with pytest.raises(SystemExit, match=r"read another corpus \(the corpus and the tokenizer of --data .*data2 differ"):
        script.main([*argv, "--data", str(data2), "--out", str(out)])
    assert (out / "state.pt").is_file()
    with torch.random.fork_rng(), contextlib.redirect_stderr(io.StringIO()) as err:
        script.main([*argv, "--data", str(moved), "--out", str(out)])  # the same corpus elsewhere: goes on
    assert "resumed" in err.getvalue() and not (out / "state.pt").exists()


@pytest.mark.parametrize("budget", ["0", "-5", "nan"])
def test_a_time_budget_must_be_positive(prepared, script, tmp_path, budget):
    """0 stopped every command before its first step: a run that never went on, with NaN in its summary."""
    _, _, data, _ = prepared
    with pytest.raises(SystemExit, match=f"argument --time-budget: expected a number of seconds > 0, got {budget}"):
        script.main([*TRAIN_ARGV, "--data", str(data), "--out", str(tmp_path / "o"), "--time-budget", budget])
    assert not (tmp_path / "o").exists()


def test_a_failed_wrap_up_keeps_the_trained_steps(prepared, script, tmp_path, fla_interpreter, monkeypatch):
    """The last command saves the state before it evaluates and writes its checkpoints: a failure there
    leaves every trained step to go on from, and the next command ends as one command would have."""
    from safetensors.torch import load_file

    _, _, data, _ = prepared
    argv = [*TRAIN_ARGV[:4], "osdn:0.03", *TRAIN_ARGV[7:], "--data", str(data), "--steps", "3",
            "--monitor-every", "0"]
    with torch.random.fork_rng(), contextlib.redirect_stderr(io.StringIO()):
        whole = script.main([*argv, "--out", str(tmp_path / "whole")])["osdn-eta0.03"]
    out = tmp_path / "parts"
    with torch.random.fork_rng(), contextlib.redirect_stderr(io.StringIO()):
        script.main([*argv, "--out", str(out), "--stop-after", "1"])

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(script, "save_checkpoint", full_disk)
        with torch.random.fork_rng(), contextlib.redirect_stderr(io.StringIO()), pytest.raises(OSError):
            script.main([*argv, "--out", str(out)])
    saved = torch.load(out / "state.pt", map_location="cpu", weights_only=True)
    assert saved["step"] == 3
    with torch.random.fork_rng(), contextlib.redirect_stderr(io.StringIO()):
        resumed = script.main([*argv, "--out", str(out)])["osdn-eta0.03"]
    assert resumed["loss"] == whole["loss"] and resumed["heldout_nll"] == whole["heldout_nll"]
    a, b = (load_file(d / "lm-osdn-eta0.03" / "model.safetensors") for d in (tmp_path / "whole", out))
    assert all(torch.equal(a[k], b[k]) for k in a) and not (out / "state.pt").exists()


def test_ship_refuses_a_stopped_run(trained, script, tmp_path):
    out, _, _ = trained
    runs = tmp_path / "runs"
    shutil.copytree(out, runs)
    (runs / "state.pt").write_bytes(b"stopped")
    with pytest.raises(SystemExit, match=r"--runs .*: a stopped run \(state.pt"):
        _ship(script, runs, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize("name", ["monitor.parquet", "lm-deltanet", "state.pt"])
def test_a_link_where_train_writes_is_refused_before_training(prepared, script, tmp_path, name):
    _, _, data, _ = prepared
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / name).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(SystemExit, match=rf"--out {out}: {name} is a link"):
        script.main([*TRAIN_ARGV, "--data", str(data), "--out", str(out)])
    assert list(elsewhere.iterdir()) == [] and sorted(p.name for p in out.iterdir()) == [name]
