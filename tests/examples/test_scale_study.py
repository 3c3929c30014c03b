"""examples/scale_study.py on the CPU at a tiny size: ``prepare`` records its sources, and a ``train``
stopped after 2 of 4 steps and run again ends exactly where an uninterrupted run ends (weights,
optimiser state, monitor rows, results.json)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from osdn_diag.prompts import corpus

ROOT = Path(__file__).resolve().parents[2]
SEQ = 32
TINY = ["train", "--device", "cpu", "--hidden", "32", "--layers", "1", "--heads", "2", "--intermediate", "64",
        "--seq", str(SEQ), "--batch", "2", "--steps", "4", "--warmup", "1", "--lr", "0.01", "--eval-windows", "2",
        "--monitor-every", "2", "--monitor-windows", "1", "--log-every", "1", "--save-every", "0"]


def _load(name: str):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_under_test", ROOT / "examples" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "examples"))


@pytest.fixture(scope="module")
def script():
    return _load("scale_study")


def _library(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _source(i: int) -> str:
    return "\n".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n" for j in range(40))


@pytest.fixture(scope="module")
def data(tmp_path_factory, script):
    base = tmp_path_factory.mktemp("scale")
    lib, pkgs = base / "lib", base / "pkgs"
    names = ["mod1.py", "mod2.py", "mod3.py", "pkg/sub1.py", "mod28.py", "pkg/sub6.py"]
    _library(lib, {rel: _source(i) for i, rel in enumerate(names)})
    # An installed package: its files join the corpus (one is a copy of a library file: kept once).
    _library(pkgs / "fakepkg", {"__init__.py": _source(50), "core.py": _source(51), "copy.py": _source(0)})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus, "stdlib_root", lambda: lib)
        mp.syspath_prepend(str(pkgs))
        info = script.main(["prepare", "--data", str(base / "data"), "--vocab", "300",
                            "--packages", "fakepkg", "no_such_package_here"])
    return base / "data", info


def test_prepare_records_each_source_and_what_is_missing(data):
    path, info = data
    assert info == json.loads((path / "corpus.json").read_text())
    by_name = {s["name"]: s for s in info["sources"]}
    assert set(by_name) == {"stdlib", "fakepkg"}
    assert info["not_installed"] == ["no_such_package_here"]
    assert sum(by_name["stdlib"]["files"].values()) == 6
    assert sum(by_name["fakepkg"]["files"].values()) == 2  # copy.py repeats mod1.py's text: dropped
    assert by_name["fakepkg"]["characters"] == len(_source(50)) + len(_source(51))
    assert info["files"] == {split: sum(s["files"][split] for s in info["sources"]) for split in ("train", "heldout")}
    assert info["heldout_documents"] >= 1 and info["train_tokens"] > 0


def test_prepare_with_an_earlier_tokenizer_encodes_with_it(data, script, tmp_path):
    """--tokenizer: the earlier prepare's tokenizer.json is used as it is (the same bytes written, the
    same token files), recorded by its sha256; a file that is not a tokenizer is refused in one line."""
    import hashlib

    path, info = data
    lib = path.parent / "lib"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(corpus, "stdlib_root", lambda: lib)
        mp.syspath_prepend(str(path.parent / "pkgs"))
        again = script.main(["prepare", "--data", str(tmp_path / "again"), "--vocab", "999",
                             "--packages", "fakepkg", "no_such_package_here", "--tokenizer", str(path)])
        for name in ("tokenizer.json", "train.bin", "heldout.safetensors"):
            assert (tmp_path / "again" / name).read_bytes() == (path / name).read_bytes(), name
        digest = hashlib.sha256((path / "tokenizer.json").read_bytes()).hexdigest()
        assert again["tokenizer"]["kind"].endswith(f"reused: tokenizer.json of sha256 {digest}")
        assert {k: v for k, v in again.items() if k != "tokenizer"} == {k: v for k, v in info.items() if k != "tokenizer"}
        (tmp_path / "bad.json").write_text("{}")
        with pytest.raises(SystemExit, match="argument --tokenizer: .*bad.json is not a readable tokenizer.json"):
            script.main(["prepare", "--data", str(tmp_path / "bad"), "--tokenizer", str(tmp_path / "bad.json")])


def _run(script, argv):
    with torch.random.fork_rng():
        return script.main(argv)


def test_a_stopped_and_resumed_run_ends_as_an_uninterrupted_one(data, script, tmp_path, fla_interpreter, capsys):
    import pyarrow.parquet as pq

    path, _ = data
    whole = _run(script, [*TINY, "--data", str(path), "--out", str(tmp_path / "whole")])
    first = _run(script, [*TINY, "--data", str(path), "--out", str(tmp_path / "parts"), "--stop-after", "2"])
    # each command says it started and how long its first step took (which compiles), before any log line
    said = capsys.readouterr().err
    assert said.count("[scale] 2 models from step 0 of 4\n") == 2  # on the CPU: nothing compiles
    assert re.findall(r"\[scale\] step (\d)/4 took \d+\.\d s", said) == ["1", "1"]
    assert said.index("step 1/4 took") < said.index("[scale] step 2/4:")
    assert first == {"step": 2, "done": False}
    assert not (tmp_path / "parts" / "results.json").exists()
    _check_report_of_a_stopped_run(script, tmp_path / "parts", whole)
    last = [*TINY, "--data", str(path), "--out", str(tmp_path / "parts"), "--time-budget", "100000"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", ["examples/scale_study.py", *last])  # what results.json quotes
        second = _run(script, last)
    said = capsys.readouterr().err
    assert "[scale] 2 models from step 2 of 4\n" in said and re.findall(r"step (\d)/4 took", said) == ["3"]
    # the recipe, without where a command stopped
    assert second["command"] == "python examples/scale_study.py " + " ".join(last[:-2])
    assert whole["done"] and second["done"] and second["steps"] == whole["steps"] == 4

    a = torch.load(tmp_path / "whole" / "state.pt", weights_only=True)
    b = torch.load(tmp_path / "parts" / "state.pt", weights_only=True)
    assert a["step"] == b["step"] == 4
    for name in a["models"]:
        for key, value in a["models"][name].items():
            assert torch.equal(value, b["models"][name][key]), (name, key)
    assert torch.equal(a["generator"], b["generator"])
    for name, res in whole["models"].items():
        other = second["models"][name]
        for key in ("loss", "heldout_nll", "heldout_nll_twice", "q_geo_single", "q_geo_twice", "q_arith_twice"):
            assert res[key] == other[key], (name, key)
        # the monitor's account covers both commands' probes, not the last command's alone
        assert res["monitor"]["probes"] == other["monitor"]["probes"] == 2, name
    assert set(whole["models"]) == {"deltanet", "osdn-eta0.003"}
    assert whole["gap"]["q_geo_single"] == (whole["models"]["osdn-eta0.003"]["q_geo_single"]
                                            - whole["models"]["deltanet"]["q_geo_single"])

    def rows(run):
        t = pq.read_table(tmp_path / run / "monitor.parquet").drop(["probe_seconds"]).to_pylist()
        return sorted(t, key=lambda r: (r["model"], r["step"], r["layer"]))

    assert rows("whole") == rows("parts")
    assert sorted({r["step"] for r in rows("whole")}) == [2, 4]
    def strict(constant):  # NaN or Infinity: not JSON
        raise AssertionError(f"results.json holds {constant}")

    saved = json.loads((tmp_path / "parts" / "results.json").read_text(), parse_constant=strict)
    assert saved["models"]["deltanet"]["q_geo_twice"] == second["models"]["deltanet"]["q_geo_twice"]


def _check_report_of_a_stopped_run(script, out: Path, whole: dict) -> None:
    """report on a run stopped at step 2 of 4 (no results.json): each model's q_geo single and d at the
    last step every model was probed at, read here from monitor.parquet; perplexity and twice not
    measured (—), the gap at the paper's η from those q_geo; a note says where it stopped."""
    import pyarrow.parquet as pq

    run = json.loads((out / "run.json").read_text())
    assert run["steps"] == 4 and run["preset"] == "h256" and run["config"]["hidden"] == 32
    assert {n: m["parameters"] for n, m in run["models"].items()} == {
        n: m["parameters"] for n, m in whole["models"].items()}
    probes = {(r["model"], r["step"]): r for r in pq.read_table(out / "monitor.parquet").to_pylist() if r["layer"] == -1}
    assert sorted({step for _, step in probes}) == [2]
    table = script.main(["report", str(out)])
    models_part, gap_part, note = table.split("\n\n")
    rows = {r[3]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in models_part.splitlines()[2:])}
    assert set(rows) == {"deltanet", "osdn-eta0.003"}
    for name, row in rows.items():
        r = probes[(name, 2)]
        assert float(row[2].removesuffix(" M")) == pytest.approx(2 * 2 * SEQ / 1e6, abs=0.05)  # tokens by step 2
        assert row[4:6] == ["—", "—"] and row[7] == "—"
        assert float(row[6]) == pytest.approx(r["q_geo"], abs=6e-5)
        assert (row[8] == "") == (r["d_mean"] is None)
        if r["d_mean"] is not None:
            assert float(row[8]) == pytest.approx(r["d_mean"], abs=6e-5)
    gap = [c.strip() for c in gap_part.splitlines()[2].strip("|").split("|")]
    assert float(gap[2]) == pytest.approx(probes[("osdn-eta0.003", 2)]["q_geo"] - probes[("deltanet", 2)]["q_geo"],
                                          abs=6e-5)
    assert gap[3:] == ["—"] * 6
    assert note.strip().endswith("unfinished (no results.json); q_geo single and d from its monitor's probe at step "
                                 "2 of 4; perplexity, twice and best η not measured")
    fig = script.report_figure([script._unfinished(out)])  # draws what was measured, and nothing else
    q_ax, gap_ax = fig.axes
    lines = {ln.get_label(): ln for ln in q_ax.get_lines()}
    assert list(lines["deltanet, single"].get_ydata()) == [probes[("deltanet", 2)]["q_geo"]]
    assert list(lines["deltanet, twice"].get_ydata()) == []
    assert [t.get_text() for t in gap_ax.texts] == ["step 2 of 4"]


def test_report_reads_an_unfinished_run_at_the_last_step_every_model_was_probed(script, tmp_path):
    """Probes at steps 100 and 200 for both models and at 300 for DeltaNet only (a run killed between
    the two models' probes): the report takes step 200, and the tokens seen by then."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = {"command": "c", "preset": "h512", "config": {"hidden": 512, "layers": 8, "heads": 8, "intermediate": 1024},
           "seq": 512, "batch": 32, "steps": 1600,
           "models": {"deltanet": {"arch": "deltanet", "eta": None, "parameters": 23_000_000},
                      "osdn-eta0.003": {"arch": "osdn", "eta": 0.003, "parameters": 23_000_000}}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    rows = []
    for model, steps in (("deltanet", (100, 200, 300)), ("osdn-eta0.003", (100, 200))):
        for step in steps:
            for layer in (-1, 0):
                q = step / 1000 + (0.01 if model == "deltanet" else 0.0) + (layer + 1) / 100
                rows.append({"model": model, "step": step, "layer": layer, "q_geo": q, "q_arith": 2 * q,
                             "d_mean": None if model == "deltanet" else 1.0 + step / 1e5})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "monitor.parquet")
    res = script._unfinished(tmp_path)
    assert (res["stopped"], res["of"], res["tokens"]) == (200, 1600, 200 * 32 * 512)
    assert res["models"]["deltanet"]["q_geo_single"] == pytest.approx(0.2 + 0.01)
    assert res["models"]["osdn-eta0.003"]["q_geo_single"] == pytest.approx(0.2)
    assert res["models"]["osdn-eta0.003"]["d"] == {"mean": pytest.approx(1.002)}
    assert res["gap"]["q_geo_single"] == pytest.approx(-0.01)
    assert res["models"]["deltanet"]["heldout_ppl"] is None and script.best_osdn(res) is None
    (tmp_path / "run.json").write_text(json.dumps({k: v for k, v in run.items() if k != "batch"}))
    with pytest.raises(SystemExit, match=r"run.json: not a scale_study.py run.json \(expected preset"):
        script.main(["report", str(tmp_path)])
    (tmp_path / "run.json").write_text(json.dumps({**run, "seed": "0"}))
    with pytest.raises(SystemExit, match=r"run.json: \"seed\" is '0', not an integer"):
        script.main(["report", str(tmp_path)])


def test_report_refuses_a_stopped_run_without_a_probe(data, script, tmp_path, fla_interpreter):
    path, _ = data
    out = tmp_path / "early"
    _run(script, [*TINY, "--data", str(path), "--out", str(out), "--stop-after", "1"])  # probes every 2 steps
    with pytest.raises(SystemExit, match="an unfinished run without monitor.parquet: nothing measured to report"):
        script.main(["report", str(out)])


def test_resume_refuses_a_state_of_other_models(data, script, tmp_path, fla_interpreter):
    path, _ = data
    _run(script, [*TINY, "--data", str(path), "--out", str(tmp_path), "--stop-after", "1", "--monitor-every", "0"])
    with pytest.raises(SystemExit, match="saved by a run of other models"):
        _run(script, [*TINY, "--data", str(path), "--out", str(tmp_path), "--sweep", "0.03"])


def test_resume_refuses_another_corpus_and_a_directory_in_use(data, script, tmp_path, fla_interpreter):
    import fcntl
    import os
    import shutil

    from osdn_diag.rundir import LOCK_FILE

    path, _ = data
    out = tmp_path / "run"
    _run(script, [*TINY, "--data", str(path), "--out", str(out), "--stop-after", "1", "--monitor-every", "0"])
    other = tmp_path / "other"
    shutil.copytree(path, other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text().replace('"', '"', 1) + " ")
    with pytest.raises(SystemExit, match="saved by a run that read another corpus"):
        _run(script, [*TINY, "--data", str(other), "--out", str(out), "--monitor-every", "0"])
    with open(out / LOCK_FILE, "w") as held:  # another command's lock
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(f"{os.getpid()}\n")
        held.flush()
        with pytest.raises(SystemExit, match="in use by another osdn-diag command"):
            _run(script, [*TINY, "--data", str(path), "--out", str(out), "--monitor-every", "0"])
    with pytest.raises(SystemExit, match="argument --time-budget: expected a number of seconds > 0, got 0"):
        _run(script, [*TINY, "--data", str(path), "--out", str(out), "--time-budget", "0"])


def _fake_results(preset: str, hidden: int, layers: int, params: int, q: dict[str, tuple[float, float]]) -> dict:
    models = {}
    for i, (name, (single, twice)) in enumerate(q.items()):
        models[name] = {"arch": name.split("-")[0], "parameters": params + i, "heldout_ppl": 10.0 + i / 8,
                        "heldout_ppl_twice": 7.0 + i / 16, "q_geo_single": single, "q_geo_twice": twice,
                        **({"d": {"mean": 1.0 + i / 100}} if name != "deltanet" else {})}
    paper = models["osdn-eta0.003"]
    return {"preset": preset, "config": {"hidden": hidden, "layers": layers, "heads": 4, "intermediate": 2 * hidden},
            "tokens": 1_000_000 * layers, "models": models,
            "gap": {"q_geo_single": paper["q_geo_single"] - models["deltanet"]["q_geo_single"],
                    "q_geo_twice": paper["q_geo_twice"] - models["deltanet"]["q_geo_twice"],
                    "heldout_ppl": paper["heldout_ppl"] - models["deltanet"]["heldout_ppl"]}}


def test_report_puts_the_sizes_side_by_side(script, tmp_path):
    small = _fake_results("h256", 256, 4, 3_700_000, {"deltanet": (0.286, 0.281), "osdn-eta0.003": (0.282, 0.279)})
    large = _fake_results("h512", 512, 8, 21_000_000, {"deltanet": (0.31, 0.30), "osdn-eta0.003": (0.25, 0.26),
                                                       "osdn-eta0.03": (0.24, 0.23)})
    for name, res in (("large", large), ("small", small)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(res))
    out = tmp_path / "report"
    # the larger first on the command line: the table orders by parameters
    table = script.main(["report", str(tmp_path / "large"), str(tmp_path / "small" / "results.json"),
                         "--out", str(out)])
    assert (out / "scale.md").read_text() == table
    assert (out / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    models_part, gap_part = table.split("\n\n")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in models_part.splitlines()[2:]]
    expected = [(res, name) for res in (small, large) for name in res["models"]]
    assert len(rows) == len(expected) == 5
    for row, (res, name) in zip(rows, expected):
        m = res["models"][name]
        assert row[3] == name and row[0].startswith(res["preset"])
        assert float(row[1].removesuffix(" M")) == pytest.approx(m["parameters"] / 1e6, abs=0.05)
        assert float(row[2].removesuffix(" M")) == pytest.approx(res["tokens"] / 1e6, abs=0.05)
        assert [float(x) for x in row[4:8]] == pytest.approx(
            [m["heldout_ppl"], m["heldout_ppl_twice"], m["q_geo_single"], m["q_geo_twice"]], abs=6e-4)
        assert (row[8] == "") == ("d" not in m)
    gaps = [[c.strip() for c in line.strip("|").split("|")] for line in gap_part.splitlines()[2:]]
    assert [g[0].split()[0] for g in gaps] == ["h256", "h512"]
    # best η: the OSDN of lowest held-out perplexity, found here by hand from the models' rows
    large["models"]["osdn-eta0.03"]["heldout_ppl"] = 9.0
    large["models"]["osdn-eta0.03"]["eta"] = 0.03
    (tmp_path / "large" / "results.json").write_text(json.dumps(large))
    _, gap_part = script.main(["report", str(tmp_path / "large"), str(tmp_path / "small")]).split("\n\n")
    gaps = [[c.strip() for c in line.strip("|").split("|")] for line in gap_part.splitlines()[2:]]
    for g, res, best_name, best_eta in zip(gaps, (small, large), ("osdn-eta0.003", "osdn-eta0.03"), ("0.003", "0.03")):
        osdn, delta, best = res["models"]["osdn-eta0.003"], res["models"]["deltanet"], res["models"][best_name]
        assert [float(x) for x in g[2:5]] == pytest.approx(
            [osdn["q_geo_single"] - delta["q_geo_single"], osdn["q_geo_twice"] - delta["q_geo_twice"],
             osdn["heldout_ppl"] - delta["heldout_ppl"]], abs=6e-4)
        assert g[5] == best_eta
        assert [float(x) for x in g[6:9]] == pytest.approx(
            [best["q_geo_single"] - delta["q_geo_single"], best["q_geo_twice"] - delta["q_geo_twice"],
             best["heldout_ppl"] - delta["heldout_ppl"]], abs=6e-4)
    # the figure's lines carry the same numbers
    fig = script.report_figure([small, large])
    q_ax, gap_ax = fig.axes
    lines = {ln.get_label(): ln for ln in q_ax.get_lines()}
    assert list(lines["deltanet, single"].get_ydata()) == [0.286, 0.31]
    assert list(lines["osdn-eta0.03, twice"].get_ydata()) == [0.23]
    assert list(lines["osdn-eta0.03, twice"].get_xdata()) == [21_000_000]
    single = next(ln for ln in gap_ax.get_lines() if ln.get_label() == "single")
    assert list(single.get_ydata()) == pytest.approx([0.282 - 0.286, 0.25 - 0.31])
    best = next(ln for ln in gap_ax.get_lines() if ln.get_label() == "twice, best η")
    assert list(best.get_ydata()) == pytest.approx([0.279 - 0.281, 0.23 - 0.30])  # h512: η = 0.03 is best


def test_report_refuses_what_it_cannot_compare(script, tmp_path):
    res = _fake_results("h256", 256, 4, 3_700_000, {"deltanet": (0.3, 0.3), "osdn-eta0.003": (0.3, 0.3)})
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(res))
    with pytest.raises(SystemExit, match="the same size and seed as"):
        script.main(["report", str(tmp_path / "a"), str(tmp_path / "b")])
    (tmp_path / "stopped").mkdir()
    with pytest.raises(SystemExit, match="no results.json"):
        script.main(["report", str(tmp_path / "stopped")])
    (tmp_path / "b" / "results.json").write_text(json.dumps(res).replace("0.3", "NaN", 1))
    with pytest.raises(SystemExit, match="holds NaN"):
        script.main(["report", str(tmp_path / "b")])
    (tmp_path / "b" / "results.json").write_text('{"models": {}}')
    with pytest.raises(SystemExit, match="not a scale_study.py results.json"):
        script.main(["report", str(tmp_path / "b")])
    for seed in ("1", 1.5, True):  # a hand-edited seed: one line naming the file, not a traceback
        (tmp_path / "b" / "results.json").write_text(json.dumps({**res, "seed": seed}))
        with pytest.raises(SystemExit, match=r"b/results.json: \"seed\" is .* not an integer"):
            script.main(["report", str(tmp_path / "b")])


def test_report_averages_a_size_trained_from_several_seeds(script, tmp_path):
    s0 = _fake_results("h256", 256, 4, 3_700_000, {"deltanet": (0.34, 0.35), "osdn-eta0.003": (0.30, 0.30),
                                                    "osdn-eta0.01": (0.29, 0.26)})
    s1 = _fake_results("h256", 256, 4, 3_700_000, {"deltanet": (0.33, 0.34), "osdn-eta0.003": (0.31, 0.29),
                                                    "osdn-eta0.01": (0.28, 0.27)})
    s0["models"]["osdn-eta0.01"]["heldout_ppl"] = 9.0   # seed 0: η = 0.01 best; seed 1: η = 0.003 (10.125)
    s1["command"] = "python examples/scale_study.py train --preset h256 --seed 1"  # a run written before "seed"
    s0["seed"] = 0
    large = _fake_results("h512", 512, 8, 21_000_000, {"deltanet": (0.18, 0.17), "osdn-eta0.003": (0.18, 0.16)})
    for name, res in (("s1", s1), ("large", large), ("s0", s0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(res))
    table = script.main(["report", *(str(tmp_path / n) for n in ("s1", "large", "s0"))])
    _, gap_part = table.split("\n\n")
    gaps = [[c.strip() for c in line.strip("|").split("|")] for line in gap_part.splitlines()[2:]]
    assert [g[0] for g in gaps] == ["h256 (256×4), seed 0", "h256 (256×4), seed 1", "h256 (256×4), mean of 2 seeds",
                                    "h512 (512×8), seed 0"]
    # the mean row, from the models' rows by hand
    d0, d1 = s0["models"]["deltanet"], s1["models"]["deltanet"]
    p0, p1 = s0["models"]["osdn-eta0.003"], s1["models"]["osdn-eta0.003"]
    b0, b1 = s0["models"]["osdn-eta0.01"], s1["models"]["osdn-eta0.003"]
    mean = gaps[2]
    assert [float(x) for x in mean[2:5]] == pytest.approx(
        [((p0[k] - d0[k]) + (p1[k] - d1[k])) / 2 for k in ("q_geo_single", "q_geo_twice", "heldout_ppl")], abs=6e-4)
    assert mean[5] == "0.01/0.003"
    assert [float(x) for x in mean[6:9]] == pytest.approx(
        [((b0[k] - d0[k]) + (b1[k] - d1[k])) / 2 for k in ("q_geo_single", "q_geo_twice", "heldout_ppl")], abs=6e-4)
    # the figure's lines join the means; each seed's value is drawn beside them
    q_ax, gap_ax = script.report_figure([s0, s1, large]).axes
    single = next(ln for ln in q_ax.get_lines() if ln.get_label() == "deltanet, single")
    assert list(single.get_ydata()) == pytest.approx([(0.34 + 0.33) / 2, 0.18])
    seeds = [ln for ln in q_ax.get_lines() if ln.get_linestyle() == "None" and ln.get_color() == single.get_color()
             and ln.get_marker() == "o"]
    assert [list(ln.get_ydata()) for ln in seeds] == [[0.34, 0.33]]
    g = next(ln for ln in gap_ax.get_lines() if ln.get_label() == "single")
    assert list(g.get_ydata()) == pytest.approx([((0.30 - 0.34) + (0.31 - 0.33)) / 2, 0.0])
    # a seed stopped early (probed at an earlier step) is listed but not averaged with finished ones
    stopped = _fake_results("h256", 256, 4, 3_700_000, {"deltanet": (0.40, 0.0), "osdn-eta0.003": (0.30, 0.0)})
    stopped.update(seed=2, stopped=600, of=1600)
    for m in stopped["models"].values():
        m.update(heldout_ppl=None, heldout_ppl_twice=None, q_geo_twice=None)
    stopped["gap"].update(q_geo_twice=None, heldout_ppl=None)
    again = script.report_table([s0, s1, stopped, large])
    gap_rows = [[c.strip() for c in line.strip("|").split("|")] for line in again.split("\n\n")[1].splitlines()[2:]]
    assert [g[0] for g in gap_rows] == ["h256 (256×4), seed 0", "h256 (256×4), seed 1", "h256 (256×4), seed 2",
                                        "h256 (256×4), mean of 2 seeds", "h512 (512×8), seed 0"]
    assert gap_rows[3] == mean and gap_rows[2][2] == "-0.1000" and gap_rows[2][3] == "—"
    q_ax, gap_ax = script.report_figure([s0, s1, stopped, large]).axes
    single = next(ln for ln in q_ax.get_lines() if ln.get_label() == "deltanet, single")
    assert list(single.get_ydata()) == pytest.approx([(0.34 + 0.33) / 2, 0.18])
    seeds = [ln for ln in q_ax.get_lines() if ln.get_linestyle() == "None" and ln.get_color() == single.get_color()
             and ln.get_marker() == "o"]
    assert [list(ln.get_ydata()) for ln in seeds] == [[0.34, 0.33, 0.40]]
    # one run of each size and seed
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "results.json").write_text(json.dumps({**s1, "seed": 1}))
    with pytest.raises(SystemExit, match="the same size and seed as"):
        script.main(["report", str(tmp_path / "s1"), str(tmp_path / "again")])
