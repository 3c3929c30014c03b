"""The run's tokens: ``tokens.parquet`` (ids and their text), the report's table of the tokens whose
writes contract most and least, and ``Results.per_token()`` — every number recomputed here from
residuals.parquet and tokens.parquet alone (pyarrow + numpy + math.fsum), as test_report_numbers.py
does for the other tables.

Runs: the built-in language model DeltaNet on ``{"text": ...}`` prompts written for this test (Python
code, and characters that its byte-level tokenizer splits over several tokens), and the built-in MQAR
DeltaNet, which has no tokenizer (ids only, and the report says so).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from osdn_diag.cli import main
from _markdown import table_after

REL = 1e-9
FLOOR = 1e-30
MIN_COUNT = 5
SHOWN = 10
HEADING = "Tokens: which writes contract most and least"

TEXTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
    "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)  # naïve café, π ≈ 3.14\n",
    "for i in range(10):\n    if i % 2:\n        print(i, 'odd')\n    else:\n        print(i, 'even')\n",
    "s = '日本語 ✓'\nx = [s for s in (1, 2, 3) if s]\n",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    prompts = root / "code.jsonl"
    prompts.write_text("".join(json.dumps({"text": t, "task": "code"}) + "\n" for t in TEXTS))
    out = {}
    for name, args in {"lm": ["builtin:lm-deltanet", "--prompts", str(prompts)],
                       "mqar": ["builtin:mqar-deltanet", "--prompts", "mqar", "--num-prompts", "8",
                                "--length", "128"]}.items():
        run_dir = root / name
        assert main(["run", *args, "--out", str(run_dir), "-q"]) == 0
        out[name] = run_dir
    return out


def _manifest(run_dir):
    return json.loads((run_dir / "manifest.json").read_text())


def _tokenizer():
    from transformers import AutoTokenizer

    from osdn_diag.catalog.builtin import BUILTIN_ROOT

    return AutoTokenizer.from_pretrained(BUILTIN_ROOT / "lm-deltanet", local_files_only=True)


# ------------------------------------------------------------------------- independent computation

def _rows(run_dir) -> tuple[dict, dict]:
    """``{(prompt, layer, pos): [q, ...]}`` of the finite rows, and ``{(prompt, pos): (id, text)}``."""
    t = pq.read_table(run_dir / "residuals.parquet").to_pydict()
    cells = defaultdict(list)
    for p, layer, pos, q, ok in zip(t["prompt"], t["layer"], t["pos"], t["residual_ratio"], t["finite"]):
        if ok:
            cells[(p, layer, pos)].append(float(q))
    tok = pq.read_table(run_dir / "tokens.parquet").to_pydict()
    tokens = {(p, pos): (i, s) for p, pos, i, s in zip(tok["prompt"], tok["pos"], tok["token_id"], tok["text"])}
    return cells, tokens


def _geo(q: list[float]) -> float:
    return math.exp(math.fsum(math.log(max(x, FLOOR)) for x in q) / len(q))


def _expected_tokens(run_dir) -> list[dict]:
    """Per token id: its positions, its ratios (every layer and head), q_geo; sorted by q_geo, id."""
    cells, tokens = _rows(run_dir)
    by_id = defaultdict(lambda: {"positions": set(), "q": []})
    for (p, _, pos), q in cells.items():
        tid, text = tokens[(p, pos)]
        by_id[tid]["positions"].add((p, pos))
        by_id[tid]["q"] += q
        by_id[tid]["text"] = text
    out = [{"token_id": tid, "text": v["text"], "count": len(v["positions"]), "q_geo": _geo(v["q"])}
           for tid, v in by_id.items()]
    return sorted(out, key=lambda r: (r["q_geo"], r["token_id"]))


def _cell(r) -> str:
    """The report's cell of a token, as markdown source (``|`` and ``\\`` escaped)."""
    text = f"id {r['token_id']}" if r["text"] is None else \
        f"{json.dumps(r['text'], ensure_ascii=False)} ({r['token_id']})"
    return text.replace("\\", "\\\\").replace("|", "\\|")


def _printed(q: float) -> str:
    """A ratio as the report prints it: 3 decimals, 3 significant digits below 0.01."""
    return f"{q:.3f}" if q >= 0.01 else f"{q:.2e}"


def _section(report: str, label: str) -> str:
    section = report[report.index(f"## {HEADING}"):]
    section = section[:section.index("\n## ", 1)]
    return section[section.index(f"### {label}"):]


# ------------------------------------------------------------------------------------------ tests

def test_text_run_stores_its_tokens_and_their_text(runs):
    run = runs["lm"]
    manifest = _manifest(run)
    tok = _tokenizer()
    table = pq.read_table(run / "tokens.parquet")
    assert table.column_names == ["prompt", "pos", "token_id", "text"]
    t = table.to_pydict()
    from osdn_diag.rundir import sha256_file

    entry = manifest["tokens"]
    assert entry["file"] == "tokens.parquet" and entry["text"] is True and entry["rows"] == table.num_rows
    assert entry["sha256"] == sha256_file(run / "tokens.parquet")
    assert set(entry["tokenizer"]["files"]) >= {"tokenizer.json", "tokenizer_config.json"}
    assert entry["tokenizer"]["files"]["tokenizer.json"] == sha256_file(_builtin("lm-deltanet") / "tokenizer.json")
    assert pq.read_schema(run / "tokens.parquet").metadata[b"osdn_diag.run_id"].decode() == manifest["run_id"]
    split = 0
    for i, text in enumerate(TEXTS):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        rows = [j for j, p in enumerate(t["prompt"]) if p == i]
        assert [t["pos"][j] for j in rows] == list(range(len(ids)))
        assert [t["token_id"][j] for j in rows] == ids
        pieces = [t["text"][j] for j in rows]
        assert len(pieces) == manifest["prompts"][i]["length"]
        # Every piece is the token's own bytes: a byte of a split character written <0xNN>.
        assert b"".join(_piece_bytes(s) for s in pieces) == text.encode() == tok.decode(ids).encode()
        if text.isascii():  # no character split: the pieces joined are the decoded text itself
            assert "".join(pieces) == tok.decode(ids) == text
        else:
            assert "\ufffd" not in "".join(pieces) and "<0x" in "".join(pieces)
            split += 1
    assert split == 2


def _builtin(name):
    from osdn_diag.catalog.builtin import BUILTIN_ROOT

    return BUILTIN_ROOT / name


def _piece_bytes(piece: str) -> bytes:
    import re

    out = b""
    for part in re.split(r"(<0x[0-9A-F]{2}>)", piece):
        out += bytes([int(part[3:5], 16)]) if re.fullmatch(r"<0x[0-9A-F]{2}>", part) else part.encode()
    return out


def test_token_text_of_split_characters():
    """Each id decoded on its own: whole characters as themselves, the bytes of a split one as <0xNN>;
    ids that are not in any prompt (generated ones) too."""
    from osdn_diag.prompts.text import TokenText

    tok = _tokenizer()
    text = TokenText(tok)
    ids = tok("é ✓ ok", add_special_tokens=False)["input_ids"]
    pieces = text.pieces(ids)
    assert b"".join(_piece_bytes(p) for p in pieces) == "é ✓ ok".encode()
    assert pieces[:2] == ["<0xC3>", "<0xA9>"]
    assert text.pieces([0]) == ["<|endoftext|>"]  # the special token, kept
    assert "".join(pieces[-2:]) == " ok" and text.pieces([ids[-1], ids[-1]]) == [pieces[-1]] * 2


def test_sentencepiece_word_start_keeps_its_space():
    from osdn_diag.prompts.text import TokenText

    class Piece:  # a SentencePiece tokenizer whose lone decode drops a word's leading space
        vocab = ["▁the", "re", "<0xE2>", "▁"]

        def convert_ids_to_tokens(self, ids):
            return [self.vocab[i] for i in ids]

        def decode(self, ids, **_):
            return "".join(self.vocab[i] for i in ids).replace("▁", " ").lstrip().replace("<0xE2>", "\ufffd")

    assert TokenText(Piece()).pieces([0, 1, 2]) == [" the", "re", "<0xE2>"]


def test_report_lists_the_tokens_that_contract_most_and_least(runs):
    for name in ("lm", "mqar"):
        run = runs[name]
        manifest = _manifest(run)
        label = manifest["model"]["spec"]
        report = (run / "report.md").read_text()
        section = _section(report, label)
        exp = _expected_tokens(run)
        kept = [r for r in exp if r["count"] >= MIN_COUNT]
        assert 3 <= len(kept) < len(exp), name  # the min count matters
        if name == "mqar":
            assert len(kept) >= 2 * SHOWN  # both lists full
        assert f"at least {MIN_COUNT} occurrences (positions)" in report
        assert f"{len(kept):,} of {len(exp):,} distinct tokens occur at least {MIN_COUNT} times." in section
        header, rows = table_after(section, f"### {label}")
        assert header == ["", "contracts most", "q_geo ↓", "occurrences", "contracts least", "q_geo ↓",
                          "occurrences"]
        # Each token listed once: the lowest q_geo as contracting most, the highest as least.
        most = kept[:min(SHOWN, (len(kept) + 1) // 2)]
        least = kept[::-1][:min(SHOWN, len(kept) // 2)]
        assert len(rows) == len(most)
        for i, row in enumerate(rows):
            assert row[0] == str(i + 1)
            r = most[i]
            assert row[1:4] == [_cell(r), _printed(r["q_geo"]), f"{r['count']:,}"], (name, i)
            r = least[i] if i < len(least) else None
            assert row[4:7] == (["–"] * 3 if r is None else
                                [_cell(r), _printed(r["q_geo"]), f"{r['count']:,}"]), (name, i)
        # The data tells the most from the least contracting: not one value throughout.
        assert kept[0]["q_geo"] < kept[-1]["q_geo"] * 0.9


def test_a_run_without_tokenizer_says_so(runs):
    run = runs["mqar"]
    manifest = _manifest(run)
    entry = manifest["tokens"]
    assert entry["text"] is False and entry["tokenizer"] is None and "no tokenizer" in entry["note"]
    t = pq.read_table(run / "tokens.parquet").to_pydict()
    assert set(t["text"]) == {None}
    # The ids are the prompts' own, as the suite draws them again.
    from osdn_diag.prompts import load_prompts

    prompts = load_prompts("mqar", vocab_size=manifest["model"]["vocab_size"], num_prompts=8, length=128)
    assert t["token_id"] == [i for p in prompts for i in p.input_ids]
    assert t["prompt"] == [p.id for p in prompts for _ in p.input_ids]
    label = manifest["model"]["spec"]
    section = _section((run / "report.md").read_text(), label)
    assert f"{label}: the model has no tokenizer, so tokens are shown by id only." in section
    assert "| id " in section


def test_per_token_frame(runs):
    import osdn_diag

    for name in ("lm", "mqar"):
        run = runs[name]
        res = osdn_diag.Results.load(run)
        cells, tokens = _rows(run)
        frame = res.per_token()
        assert frame.column_names == ["prompt", "pos", "token_id", "text", "q_geo", "q_arith", "n"]
        f = frame.to_pydict()
        assert list(zip(f["prompt"], f["pos"])) == sorted(tokens)
        pooled = defaultdict(list)
        for (p, _, pos), q in cells.items():
            pooled[(p, pos)] += q
        for p, pos, tid, text, geo, arith, n in zip(*(f[c] for c in frame.column_names)):
            assert (tid, text) == tokens[(p, pos)]
            q = pooled[(p, pos)]
            assert n == len(q) and n > 0
            assert geo == pytest.approx(_geo(q), rel=REL, abs=0)
            assert arith == pytest.approx(math.fsum(q) / n, rel=REL, abs=0)
        by_layer = res.per_token(by_layer=True).to_pydict()
        assert len(by_layer["prompt"]) == len(f["prompt"]) * len(_manifest(run)["layers"])
        keys = list(zip(by_layer["prompt"], by_layer["pos"], by_layer["layer"]))
        assert keys == sorted(keys)  # the documented order: prompt, pos, then layer
        for p, layer, pos, tid, geo, n in zip(*(by_layer[c] for c in ("prompt", "layer", "pos", "token_id",
                                                                       "q_geo", "n"))):
            q = cells[(p, layer, pos)]
            assert tid == tokens[(p, pos)][0] and n == len(q)
            assert geo == pytest.approx(_geo(q), rel=REL, abs=0)
        if name == "lm":
            assert any(text and text.startswith(" ") for text in f["text"])


def test_per_token_leaves_out_what_the_summary_leaves_out():
    """Non-finite rows are not counted (a position with none left has n = 0 and null means), and a
    micro-step family counts its token's ratio once, on the step-0 row."""
    from osdn_diag.replay.tokens import per_token, token_table

    res = pa.table({
        "prompt": pa.array([0, 0, 0, 0, 0], pa.int32()), "layer": pa.array([0, 0, 0, 0, 0], pa.int16()),
        "pos": pa.array([0, 0, 1, 1, 2], pa.int32()),
        "residual_ratio": pa.array([0.5, 0.5, 0.2, 0.3, 0.7], pa.float32()),
        "finite": [True, True, True, True, False],
        "step": pa.array([0, 1, None, None, None], pa.int32()),
        "token_ratio": pa.array([0.25, 0.25, None, None, None], pa.float32()),
    })
    f = per_token(res, token_table({0: [7, 8, 9]})).to_pydict()
    assert f["n"] == [1, 2, 0] and f["token_id"] == [7, 8, 9] and f["text"] == [None] * 3
    assert f["q_geo"][0] == pytest.approx(0.25) and f["q_geo"][1] == pytest.approx(math.sqrt(0.2 * 0.3))
    assert f["q_geo"][2] is None and f["q_arith"][2] is None


def test_a_run_written_before_tokens_replays_and_reports_no_token_text(runs, tmp_path):
    """A run of an earlier version (no tokens.parquet, no manifest entry): replay and report work and
    say there is no token text; Results has no tokens and per_token() gives positions without ids."""
    import shutil

    import osdn_diag

    old = tmp_path / "old"
    shutil.copytree(runs["mqar"], old)
    (old / "tokens.parquet").unlink()
    manifest = _manifest(old)
    del manifest["tokens"]
    (old / "manifest.json").write_text(json.dumps(manifest, indent=2))
    assert main(["replay", str(old), "-q"]) == 0
    assert main(["report", str(old)]) == 0
    label = manifest["model"]["spec"]
    section = _section((old / "report.md").read_text(), label)
    assert f"No token text: {label} has no tokens.parquet" in section
    res = osdn_diag.Results.load(old)
    assert res.tokens is None
    f = res.per_token().to_pydict()
    assert set(f["token_id"]) == {None} and len(f["pos"]) == sum(p["length"] for p in manifest["prompts"])
    assert not (old / "tokens.parquet").exists()


def test_what_if_output_has_the_source_runs_tokens(runs, tmp_path):
    """A what-if replays the source's tokens: it copies tokens.parquet, and its report has the table."""
    out = tmp_path / "wi"
    assert main(["what-if", str(runs["mqar"]), "--out", str(out), "-q"]) == 0
    assert (out / "tokens.parquet").read_bytes() == (runs["mqar"] / "tokens.parquet").read_bytes()
    report = (out / "report.md").read_text()
    assert f"## {HEADING}" in report and "No token text" not in report


def test_overwrite_removes_the_tokens_of_the_run_it_replaces(tmp_path):
    from osdn_diag.rundir import RUN_FILES, remove_run_files

    assert "tokens.parquet" in RUN_FILES
    (tmp_path / "tokens.parquet").write_bytes(b"x")
    (tmp_path / "notes.txt").write_text("mine")
    remove_run_files(tmp_path)
    assert not (tmp_path / "tokens.parquet").exists() and (tmp_path / "notes.txt").exists()


def test_an_unreadable_tokenizer_fails_only_the_prompts_that_need_it(tmp_path, capsys):
    """A damaged tokenizer.json: prompts of token ids run (without token text, a line says why),
    text prompts are refused in one line naming the file; neither is a traceback."""
    import json as _json

    from osdn_diag.cli import entry
    from osdn_diag.models import load_model

    model_dir = tmp_path / "model"
    load_model("random:deltanet-tiny").model.save_pretrained(model_dir)
    (model_dir / "tokenizer.json").write_text("{not json")
    ok = tmp_path / "ids"
    assert entry(["run", str(model_dir), "--prompts", "random", "--num-prompts", "1", "--length", "12",
                  "--out", str(ok), "-q"]) == 0
    err = capsys.readouterr().err
    assert "tokenizer.json" in err and "cannot be loaded" in err and "Traceback" not in err
    tokens = _json.loads((ok / "manifest.json").read_text())["tokens"]
    assert tokens["text"] is False and tokens["tokenizer"] is None
    # It records what happened: the model has a tokenizer, which could not be loaded (not "none").
    assert tokens["note"].startswith("the model's tokenizer could not be loaded: token ids only (")
    assert "tokenizer.json" in tokens["note"] and "no tokenizer" not in tokens["note"]
    report = (ok / "report.md").read_text()
    assert "the model's tokenizer could not be loaded, so tokens are shown by id only." in report
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "hello"}\n')
    assert entry(["run", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "text"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "error: text prompts need the model's tokenizer" in err and "tokenizer.json" in err
    assert "Traceback" not in err and not (tmp_path / "text").exists()
