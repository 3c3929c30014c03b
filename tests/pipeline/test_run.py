"""`osdn-diag run/capture/replay` end to end on a tiny random fla model (CPU).

Kernels: the default ``kernels="auto"``, so on a CPU the reference recurrence stands in for fla's kernel
(the NaN test also runs ``kernels="fla"``); test_fla_kernels_e2e.py runs fla's own kernels end to end.
"""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest
import torch

from osdn_diag.cli import main

# Spelled out here (not imported) so that the test fails if the contract's columns change.
CONTRACT_COLUMNS = {
    "prompt", "task", "layer", "head", "pos", "rel_pos", "repeat_start", "beta", "key_sqnorm",
    "write_gain", "loss_before", "loss_after", "residual_ratio",
}


def _run(out, *extra):
    argv = ["run", "random:deltanet-tiny", "--prompts", "random", "--num-prompts", "3",
            "--length", "20", "--out", str(out), "-q", *extra]
    assert main(argv) == 0


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    _run(out, "--twice")
    return out


def test_run_writes_the_contract(run_dir):
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["complete"] is True
    assert [layer["layer"] for layer in manifest["layers"]] == [0, 1]
    assert manifest["layers"][0]["family"] == "delta_rule" and manifest["layers"][0]["heads"] == 2
    assert len(manifest["prompts"]) == 3 and all(p["repeat_start"] == 10 for p in manifest["prompts"])
    table = pq.read_table(run_dir / "residuals.parquet")
    assert CONTRACT_COLUMNS <= set(table.column_names)
    assert table.num_rows == 3 * 2 * 2 * 20  # prompts × layers × heads × positions
    df = table.to_pydict()
    assert set(df["task"]) == {"random-twice"}
    assert min(df["rel_pos"]) == 0.0 and max(df["rel_pos"]) == pytest.approx(19 / 20)
    summary = json.loads((run_dir / "summary.json").read_text())
    q = torch.tensor(df["residual_ratio"], dtype=torch.float64)
    assert summary["n"] == q.numel()
    assert summary["q_geo"] == pytest.approx(math.exp(q.clamp_min(1e-30).log().mean().item()), rel=1e-9)
    assert summary["q_arith"] == pytest.approx(q.mean().item(), rel=1e-9)
    assert set(summary["by_layer"]) == {"000", "001"}
    assert sum(s["n"] for s in summary["by_layer"].values()) == summary["n"]
    # On the CPU the reference recurrence stood in for fla: nothing to check the replay against, and
    # the summary says so rather than reporting the stand-in's self-agreement as a fidelity.
    fid = summary["fidelity"]
    assert fid["measured"] is False and fid["max_rel_error"] is None and "state" not in fid
    assert fid["against_by_layer"] == {"000": "reference", "001": "reference"}
    assert max(fid["by_layer"].values()) <= 1e-5


def test_run_is_deterministic(run_dir, tmp_path):
    _run(tmp_path, "--twice")
    a = pq.read_table(run_dir / "residuals.parquet").to_pydict()
    b = pq.read_table(tmp_path / "residuals.parquet").to_pydict()
    assert a == b


def test_batched_padded_prompts_match_one_by_one(tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [{"input_ids": list(range(1, n + 1)), "task": f"t{n}"} for n in (12, 7, 9)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    tables = []
    for bs in ("1", "3"):
        out = tmp_path / f"bs{bs}"
        assert main(["run", "random:gated-deltanet-tiny", "--prompts", str(prompts), "--out", str(out),
                     "--batch-size", bs, "-q"]) == 0
        t = pq.read_table(out / "residuals.parquet").sort_by(
            [("prompt", "ascending"), ("layer", "ascending"), ("head", "ascending"), ("pos", "ascending")]
        )
        tables.append(t.to_pydict())
    one, batched = tables
    for col in ("prompt", "task", "layer", "head", "pos", "repeat_start"):
        assert one[col] == batched[col], col
    # Replay computes every sequence alone (bit for bit, tests/math/test_math_packing.py); what differs
    # is the capture: torch's CPU matmul rounds a token's row of the model's projections by where it
    # sits in the packed batch (layer 0's q, k, v: ≤ 3e-7 relative), and later layers carry that on.
    # Measured here: 4.7e-7 relative at most; docs/reproducibility.md states the bound this pins.
    for col in ("loss_before", "loss_after", "residual_ratio", "residual_ratio_post"):
        a, b = torch.tensor(one[col], dtype=torch.float64), torch.tensor(batched[col], dtype=torch.float64)
        assert torch.allclose(a, b, rtol=2e-6, atol=0), col
    # The comparator's streams are cut out of the packed batch: the same problems, the same answers.
    keys = [("prompt", "ascending"), ("layer", "ascending"), ("head", "ascending")]
    one, batched = (pq.read_table(tmp_path / f"bs{bs}" / "comparator.parquet").sort_by(keys).to_pydict()
                    for bs in ("1", "3"))
    assert one["n_valid"] == batched["n_valid"] == [n for n in (12, 7, 9) for _ in range(2 * 2)]
    for col in ("eps_diag", "eps_at_ones", "regret", "log_prod_q"):
        assert torch.allclose(torch.tensor(one[col]), torch.tensor(batched[col]), rtol=2e-6, atol=1e-12), col


def test_comparator_batches_do_not_change_the_answers(tmp_path):
    """Comparator problems solved call by call equal those solved all together."""
    from osdn_diag.pipeline import replay_run

    _run(tmp_path, "--twice")
    tables = []
    for elems in (1, 1 << 40):
        replay_run(tmp_path, progress=False, out_dir=tmp_path / str(elems), theorem_batch_elems=elems)
        tables.append(pq.read_table(tmp_path / str(elems) / "comparator.parquet").to_pydict())
    assert tables[0].keys() == tables[1].keys()
    for col, a in tables[0].items():
        b = tables[1][col]
        if isinstance(a[0], float):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-12, atol=1e-15, equal_nan=True), col
        else:
            assert a == b, col


def test_replay_fp64_and_capture_step_by_step(tmp_path):
    out = tmp_path / "cap"
    assert main(["capture", "random:kda-tiny", "--prompts", "random", "--num-prompts", "1",
                 "--length", "16", "--out", str(out), "-q"]) == 0
    assert not (out / "residuals.parquet").exists()
    assert main(["replay", str(out), "--fp64", "--backend", "torch", "-q"]) == 0
    table = pq.read_table(out / "residuals.parquet")
    assert str(table.schema.field("loss_after").type) == "double"
    summary = json.loads((out / "summary.json").read_text())
    assert "post_decay" in summary and summary["replay"]["dtype"] == "float64"


def test_stream_gives_the_stored_runs_files_without_a_capture(run_dir, tmp_path):
    _run(tmp_path, "--twice", "--stream")
    assert not (tmp_path / "capture").exists()
    for name in ("residuals.parquet", "comparator.parquet"):
        assert pq.read_table(tmp_path / name).equals(pq.read_table(run_dir / name)), name
    a, b = (json.loads((d / "summary.json").read_text()) for d in (run_dir, tmp_path))
    assert a.pop("run_id") != b.pop("run_id")  # two runs, the same numbers
    assert a == b
    a = json.loads((run_dir / "manifest.json").read_text())
    b = json.loads((tmp_path / "manifest.json").read_text())
    assert (a.pop("capture_stored"), b.pop("capture_stored")) == (True, False)
    assert len(a.pop("shards")) == 3 * 2 and b.pop("shards") == {}  # prompts × layers; none stored
    assert a.pop("run_id") != b.pop("run_id")
    # The same tokens (the file's hash differs with the run id in its metadata).
    tokens = [{k: v for k, v in m.pop("tokens").items() if k not in ("sha256", "size")} for m in (a, b)]
    assert tokens[0] == tokens[1] and tokens[0]["rows"] == 3 * 20
    assert pq.read_table(tmp_path / "tokens.parquet").equals(pq.read_table(run_dir / "tokens.parquet"))
    # The result files' hashes differ with the run id they carry; their contents were compared above.
    assert set(a.pop("files")) == set(b.pop("files")) == {"summary.json", "comparator.parquet", "residuals.parquet"}
    assert a == b
    for argv in (["replay", str(tmp_path), "-q"], ["what-if", str(tmp_path), "-q"]):
        with pytest.raises(ValueError, match="stored no capture.*--stream"):
            main(argv)


@pytest.mark.parametrize("stream", [False, True], ids=["stored", "stream"])
def test_interrupted_run_is_never_complete(tmp_path, monkeypatch, stream):
    from transformers import PreTrainedModel

    calls = {"n": 0}
    original = torch.nn.Module.__call__

    def flaky(self, *args, **kwargs):
        if isinstance(self, PreTrainedModel):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("simulated crash")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", flaky)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(tmp_path, *(["--stream"] if stream else []))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["complete"] is False
    assert not (tmp_path / "residuals.parquet").exists()
    assert not (tmp_path / "summary.json").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="incomplete"):
        main(["replay", str(tmp_path), "-q"])


def test_bad_model_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown preset 'nope'.*random:deltanet-340m"):
        main(["run", "random:nope", "--prompts", "random", "--out", str(tmp_path / "x"), "-q"])
    empty = tmp_path / "model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    (empty / "pytorch_model.bin").write_bytes(b"")
    # the command finds it from the files alone, before it loads anything, and names MODEL
    with pytest.raises(ValueError, match="MODEL .*pickled weights are not loaded"):
        main(["run", str(empty), "--prompts", "random", "--out", str(tmp_path / "y"), "-q"])
    assert not (tmp_path / "y").exists()
    # the loader, called from Python, refuses the same directory itself
    from osdn_diag.models import load_model

    with pytest.raises(FileNotFoundError, match="pickled weights are not loaded"):
        load_model(str(empty))


def test_local_model_directory(tmp_path):
    from osdn_diag.models import load_model

    model_dir = tmp_path / "model"
    load_model("random:deltanet-tiny", seed=3).model.save_pretrained(model_dir)
    assert list(model_dir.glob("*.safetensors"))
    out = tmp_path / "run"
    assert main(["run", str(model_dir), "--prompts", "random", "--num-prompts", "1", "--length", "8",
                 "--out", str(out), "-q"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model"]["source"] == "directory" and manifest["model"]["model_type"] == "delta_net"


def test_run_with_retained_associations(tmp_path):
    _run(tmp_path, "--twice", "--retained")
    summary = json.loads((tmp_path / "summary.json").read_text())
    r = summary["retained"]["random-twice"]
    assert 0 <= r["mean_error_at_last_token"] and sum(r["n"]) > 0
    assert "Retained associations" in (tmp_path / "report.md").read_text()


def test_text_prompts_use_the_model_directorys_tokenizer(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    from osdn_diag.models import load_model

    model_dir = tmp_path / "model"
    load_model("random:deltanet-tiny", seed=4).model.save_pretrained(model_dir)
    words = ["[UNK]", "alpha", "beta", "gamma", "delta"]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(model_dir)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"text": "alpha beta gamma", "query": "delta", "task": "words"}) + "\n")
    out = tmp_path / "run"
    assert main(["capture", str(model_dir), "--prompts", str(prompts), "--twice", "--out", str(out), "-q"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["prompts"] == [{"id": 0, "task": "words", "length": 7, "repeat_start": 3}]


def test_console_errors_are_one_line(tmp_path, capsys):
    from osdn_diag.cli import entry

    assert entry(["run", "random:nope", "--prompts", "random", "--out", str(tmp_path / "x"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("osdn-diag: error: MODEL 'random:nope': unknown preset") and "Traceback" not in err


def test_stream_run_of_an_osdn_model_says_why_d_is_not_plotted(tmp_path):
    argv = ["run", "builtin:mqar-osdn", "--prompts", "mqar", "--num-prompts", "1", "--length", "128",
            "--out", str(tmp_path), "-q", "--stream"]
    assert main(argv) == 0
    report = (tmp_path / "report.md").read_text()
    assert "ran with `--stream`, which stores no capture" in report
    assert not (tmp_path / "plots" / "d_trajectory.png").exists()
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["capture_stored"] is False and manifest["layers"][0]["has_d"] is True


def test_a_failed_table_write_fails_the_run_and_leaves_no_table(tmp_path, monkeypatch):
    """The per-token table is encoded on a background thread: its failure must still reach the run."""
    import pyarrow.parquet as pq_module

    def broken(self, table, *args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(pq_module.ParquetWriter, "write_table", broken)
    with pytest.raises(RuntimeError, match="residuals.parquet failed") as info:
        _run(tmp_path, "--stream")
    assert "disk full" in str(info.value.__cause__)
    assert not (tmp_path / "residuals.parquet").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert json.loads((tmp_path / "manifest.json").read_text())["complete"] is False


def _strict_json(path):
    """``path`` parsed as strict JSON: a bare NaN/Infinity is an error, as in non-Python parsers."""
    def refuse(token):
        raise ValueError(f"{path}: {token} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def _nan_model(path, layer: int, channels: slice):
    """A tiny DeltaNet saved to ``path`` whose v projection of ``layer`` is NaN on ``channels``: the
    kernel of that layer reads NaN values there (channels 0–31 are head 0), and the logits are NaN."""
    from osdn_diag.models import load_model

    model = load_model("random:deltanet-tiny", seed=3).model
    with torch.no_grad():
        model.model.layers[layer].attn.v_proj.weight[channels] = float("nan")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("kernels", ["auto", "fla"])
def test_nonfinite_streams_are_flagged_excluded_and_reported(tmp_path, kernels):
    """NaN in one head of layer 1: on the CPU stand-in ("auto") as with fla's own kernel, the run
    finishes; that (prompt, layer, head) stream of every prompt is flagged and left out, counted in
    summary.json, stated in report.md, and recall is not computed from the NaN logits."""
    model = _nan_model(tmp_path / "model", layer=1, channels=slice(0, 32))
    out = tmp_path / "run"
    assert main(["run", str(model), "--prompts", "mqar", "--num-prompts", "2", "--length", "8",
                 "--kernels", kernels, "--out", str(out), "-q"]) == 0
    summary = _strict_json(out / "summary.json")
    assert summary["nonfinite"] == {"streams": 2, "of_streams": 8, "tokens": 16, "by_layer": {"001": 2},
                                    "prompts": [0, 1]}
    df = pq.read_table(out / "residuals.parquet").to_pydict()
    bad = {(p, la, h) for p, la, h, ok in zip(df["prompt"], df["layer"], df["head"], df["finite"]) if not ok}
    assert bad == {(0, 1, 0), (1, 1, 0)}
    q = torch.tensor([r for r, ok in zip(df["residual_ratio"], df["finite"]) if ok], dtype=torch.float64)
    assert summary["n"] == q.numel() == 6 * 8
    assert summary["q_geo"] == pytest.approx(math.exp(q.clamp_min(1e-30).log().mean().item()), rel=1e-9)
    assert summary["recall"]["mqar"] == {"accuracy": None, "correct": 0, "queries": 0, "excluded_nonfinite": 4,
                                         "prompts": 2, "nll": None, "perplexity": None, "scoring": "recall"}
    report = (out / "report.md").read_text()
    headline = report.index("## Residual contraction")
    note = report.index("2 of 8 (prompt, layer, head) streams excluded")
    assert headline < note < report.index("## Recall accuracy")
    assert "| – | 0 (+4 excluded: NaN/Inf logits) |" in report
    comparator = pq.read_table(out / "comparator.parquet").to_pydict()
    excluded = [n for n, la, h in zip(comparator["n_valid"], comparator["layer"], comparator["head"])
                if (la, h) == (1, 0)]
    assert excluded == [0, 0]  # the whole stream, not only its tokens from the first NaN on


def test_a_run_with_nothing_finite_writes_nulls(tmp_path, capsys):
    """Every stream excluded: q_geo has no value, and summary.json says null (strict JSON), not NaN."""
    model = _nan_model(tmp_path / "model", layer=0, channels=slice(None))
    out = tmp_path / "run"
    assert main(["run", str(model), "--prompts", "random", "--num-prompts", "1", "--length", "8",
                 "--out", str(out), "-q"]) == 0
    summary = _strict_json(out / "summary.json")
    assert summary["q_geo"] is None and summary["n"] == 0 and summary["nonfinite"]["streams"] == 4
    assert summary["position_bins"]["q_geo"] == [None] * 10
    assert "4 of 4 (prompt, layer, head) streams excluded" in (out / "report.md").read_text()
    assert "excluded: 4 of 4 (prompt, layer, head) streams" in capsys.readouterr().out
