"""`osdn-diag demo` on the built-in trained models, shortened to 2 prompts per model (what CI runs).

One demo run (all three models, ``--num-prompts 2``) is shared by the module; on a CPU it takes
~15 s. Two more single-model runs check determinism and that the seed is honoured.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import pyarrow.parquet as pq
import pytest

from osdn_diag.capture.store import CaptureReader
from osdn_diag.cli import entry, main
from osdn_diag.demo import run_demo
from osdn_diag.catalog.builtin import BUILTIN_ROOT
from _demo_table import printed_table

# Spelled out (not imported from osdn_diag.demo) so that the test fails if the demo's models change.
MODELS = {"mqar-deltanet": "DeltaNet", "mqar-osdn": "OSDN", "mqar-osdn-apf": "OSDN-APF"}
FAMILY = {"mqar-deltanet": "delta_rule", "mqar-osdn": "osdn", "mqar-osdn-apf": "osdn"}
TASKS = {"mqar", "mqar-twice"}
NUM_PROMPTS = 2
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CONTRACT_COLUMNS = {
    "prompt", "task", "layer", "head", "pos", "rel_pos", "repeat_start", "beta", "key_sqnorm",
    "write_gain", "loss_before", "loss_after", "residual_ratio",
}


def _task(name):
    return json.loads((BUILTIN_ROOT / name / "task.json").read_text())


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _manifest(run_dir):
    return json.loads((run_dir / "manifest.json").read_text())


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """``osdn-diag demo --num-prompts 2 -q`` once: (out dir, exit code, stdout)."""
    out = tmp_path_factory.mktemp("demo") / "osdn-demo"  # made by the demo, as its default is
    buf = io.StringIO()  # capsys is function-scoped; the run is shared by the module
    with contextlib.redirect_stdout(buf):
        rc = main(["demo", "--out", str(out), "--num-prompts", str(NUM_PROMPTS), "-q"])
    return out, rc, buf.getvalue()


def _section(report: str, title: str) -> str:
    """The text of the ``## title`` section (up to the next ``## ``)."""
    start = report.index(f"## {title}")
    end = report.find("\n## ", start + 3)
    return report[start: end if end >= 0 else len(report)]


def _md_table(section: str) -> tuple[list[str], list[list[str]]]:
    """The first markdown table of a section: (header cells, body rows)."""
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    assert len(cells) >= 2 and set(cells[1][0]) <= set("-: "), section
    return cells[0], cells[2:]


def test_demo_writes_a_complete_run_per_model(demo):
    out, rc, _ = demo
    assert rc == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted([*MODELS, "report"])
    for name in MODELS:
        run_dir = out / name
        manifest = _manifest(run_dir)
        assert manifest["complete"] is True
        assert manifest["model"]["spec"] == f"builtin:{name}" and manifest["model"]["source"] == "builtin"
        assert manifest["prompts_source"] == "mqar-pair"
        n_pairs = _task(name)["num_pairs"]
        tasks = [p["task"] for p in manifest["prompts"]]
        assert tasks == ["mqar"] * NUM_PROMPTS + ["mqar-twice"] * NUM_PROMPTS
        # The shape the model was trained on: N pairs and N queries, the context repeated for twice.
        lengths = [p["length"] for p in manifest["prompts"]]
        assert lengths == [4 * n_pairs] * NUM_PROMPTS + [6 * n_pairs] * NUM_PROMPTS
        table = pq.read_table(run_dir / "residuals.parquet")
        assert CONTRACT_COLUMNS <= set(table.column_names)
        layers, heads = manifest["model"]["num_hidden_layers"], manifest["model"]["num_heads"]
        assert len(manifest["layers"]) == layers
        assert table.num_rows == sum(lengths) * layers * heads
        summary = _summary(run_dir)
        assert summary["n"] == table.num_rows
        assert set(summary["by_task"]) == TASKS
        assert 0.0 < summary["q_geo"] <= summary["q_arith"]  # AM-GM
        fid = summary["fidelity"]  # replay agrees with the captured kernel output, layer by layer
        assert set(fid["by_layer"]) == {f"{i:03d}" for i in range(layers)}
        assert all(fid["by_layer"][k] <= fid["tolerance_by_layer"][k] for k in fid["by_layer"])


def test_output_is_ignored_by_git(demo, tmp_path):
    """The demo's folder keeps a checkout's ``git status`` clean (it ignores itself)."""
    import shutil
    import subprocess

    out, _, _ = demo
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    repo = tmp_path / "checkout"
    shutil.copytree(out, repo / "osdn-demo")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=all"],
                            check=True, capture_output=True, text=True).stdout
    assert status == "", status


def test_trained_models_recall_both_tasks(demo):
    out, _, _ = demo
    for name in MODELS:
        summary, manifest = _summary(out / name), _manifest(out / name)
        n_queries = _task(name)["num_pairs"]
        assert set(summary["recall"]) == TASKS, name
        for task, row in summary["recall"].items():
            assert row["prompts"] == NUM_PROMPTS
            assert row["queries"] == NUM_PROMPTS * n_queries
            # the summary agrees with the per-prompt counts of the manifest
            mine = [p for p in manifest["prompts"] if p["task"] == task]
            assert row["correct"] == sum(p["recall_correct"] for p in mine)
            assert row["accuracy"] == pytest.approx(row["correct"] / row["queries"])
            # trained to ~0.99 on exactly this task: anything below 0.9 means a broken capture/model
            assert row["accuracy"] >= 0.9, (name, task, row)


def test_osdn_runs_record_d_and_deltanet_does_not(demo):
    out, _, _ = demo
    for name, family in FAMILY.items():
        run_dir = out / name
        layers = _manifest(run_dir)["layers"]
        assert {layer["family"] for layer in layers} == {family}, name
        assert all(layer["has_d"] is (family == "osdn") for layer in layers), name
        reader = CaptureReader(run_dir)
        call = reader.load(reader.shards()[0]).call
        if family == "osdn":
            assert call.d is not None and call.d.shape == call.k.shape
            assert float(call.d.min()) >= 0.5 - 1e-6 and float(call.d.max()) <= 2.0 + 1e-6
        else:
            assert call.d is None
    audit = {name: _summary(out / name)["assumptions"] for name in MODELS}
    assert audit["mqar-deltanet"]["d_min"] == audit["mqar-deltanet"]["d_max"] == 1.0
    # the trained preconditioners moved away from d = 1 (APF down to d_min, OSDN up towards d_max)
    assert audit["mqar-osdn"]["d_max"] > 1.0
    assert audit["mqar-osdn-apf"]["d_min"] < 1.0


def test_report_has_the_tables_and_the_plot(demo):
    out, _, _ = demo
    path = out / "report" / "report.md"
    report = path.read_text()
    labels = list(MODELS.values())

    header, rows = _md_table(_section(report, "Residual contraction (the paper's Table 8 layout)"))
    assert [r[0] for r in rows] == labels
    assert any("mqar q_geo" in h for h in header) and any("mqar-twice q_geo" in h for h in header)
    for row, name in zip(rows, MODELS):
        assert float(row[1]) == pytest.approx(_summary(out / name)["q_geo"], abs=6e-4)

    header, rows = _md_table(_section(report, "Recall accuracy (the paper's Table 7 layout)"))
    assert [r[0] for r in rows] == labels
    col = {t: next(i for i, h in enumerate(header) if h.split()[0] == t and "accuracy" in h) for t in TASKS}
    for row, name in zip(rows, MODELS):
        recall = _summary(out / name)["recall"]
        for task, i in col.items():
            assert float(row[i]) == pytest.approx(recall[task]["accuracy"], abs=6e-4), (name, task)

    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert "plots/contraction.png" in links
    for link in links:  # every image the report links exists and is a PNG
        assert (path.parent / link).read_bytes()[:8] == PNG_MAGIC, link
    assert "## The preconditioner d" in report  # the OSDN runs carry a d
    view = (path.parent / "view.html").read_text()  # plotly is in the test extra: the view is beside it
    assert view.startswith("<!DOCTYPE html>") and all(f">{label}<" in view or label in view for label in labels)


def test_printed_table_has_one_line_per_model_and_the_report_path(demo):
    out, _, stdout = demo
    lines = stdout.splitlines()
    assert not any(ln.startswith("[mqar-") for ln in lines)  # -q: no progress lines
    _, body = printed_table(stdout)
    assert [r[0] for r in body] == list(MODELS.values())
    tasks = sorted(TASKS)
    for row, name in zip(body, MODELS):
        s = _summary(out / name)
        nums = [float(x) for x in row[1:]]
        assert len(nums) == 2 + 2 * len(tasks)
        assert nums[0] == pytest.approx(s["q_geo"], abs=6e-5)
        assert nums[1] == pytest.approx(s["q_arith"], abs=6e-5)
        for i, t in enumerate(tasks):
            assert nums[2 + i] == pytest.approx(s["by_task"][t]["q_geo"], abs=6e-5)
            assert nums[2 + len(tasks) + i] == pytest.approx(s["recall"][t]["accuracy"], abs=6e-4)
    assert f"report: {out / 'report' / 'report.md'}" in lines
    assert f"view: {out / 'report' / 'view.html'}" in lines


def test_demo_is_deterministic_and_follows_the_seed(demo, tmp_path):
    out, _, _ = demo
    ref = _summary(out / "mqar-osdn")
    report, rows = run_demo(tmp_path / "again", num_prompts=NUM_PROMPTS, models=["mqar-osdn"], seed=0,
                            progress=False)
    assert report == tmp_path / "again" / "report" / "report.md" and report.is_file()
    assert [r.label for r in rows] == ["OSDN"]
    again = _summary(tmp_path / "again" / "mqar-osdn")
    assert again["q_geo"] == ref["q_geo"] and rows[0].q_geo == ref["q_geo"]
    assert again["by_task"] == ref["by_task"] and again["recall"] == ref["recall"]
    a = pq.read_table(out / "mqar-osdn" / "residuals.parquet").column("residual_ratio").to_pylist()
    b = pq.read_table(tmp_path / "again" / "mqar-osdn" / "residuals.parquet").column("residual_ratio").to_pylist()
    assert a == b

    run_demo(tmp_path / "seed1", num_prompts=NUM_PROMPTS, models=["mqar-osdn"], seed=1, progress=False)
    other = _manifest(tmp_path / "seed1" / "mqar-osdn")
    assert [p["answers"] for p in other["prompts"]] != [p["answers"] for p in _manifest(out / "mqar-osdn")["prompts"]]
    assert _summary(tmp_path / "seed1" / "mqar-osdn")["q_geo"] != ref["q_geo"]


@pytest.mark.parametrize("models", [["nope"], ["mqar-osdn", "nope"]], ids=["alone", "after-a-good-one"])
def test_unknown_model_is_one_line_naming_the_available_ones(tmp_path, capsys, models):
    assert entry(["demo", "--models", *models, "--out", str(tmp_path / "d"), "--num-prompts", "2", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("osdn-diag: error:")
    assert "nope" in err
    for name in MODELS:
        assert f"builtin:{name}" in err
    assert not (tmp_path / "d").exists()  # refused before any model ran


@pytest.mark.parametrize("planted", ["mqar-osdn", "report"])
def test_a_link_where_the_demo_names_a_directory_is_refused_before_any_model_runs(tmp_path, capsys, planted):
    out, elsewhere = tmp_path / "d", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / planted).symlink_to(elsewhere, target_is_directory=True)
    assert entry(["demo", "--out", str(out), "--num-prompts", "2", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{out / planted}: a symbolic link, where osdn-diag writes" in err
    assert list(elsewhere.iterdir()) == [] and sorted(p.name for p in out.iterdir()) == [planted]


def test_a_model_named_twice_is_refused_before_any_model_runs(tmp_path, capsys):
    argv = ["demo", "--models", "mqar-deltanet", "mqar-osdn", "mqar-deltanet", "--out", str(tmp_path / "d"), "-q"]
    assert entry(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "argument --models: mqar-deltanet given more than once" in err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("n", [0, -1])
def test_num_prompts_below_one_is_refused(tmp_path, capsys, n):
    assert entry(["demo", "--out", str(tmp_path / "d"), "--num-prompts", str(n), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--num-prompts" in err
    assert not (tmp_path / "d").exists()
    with pytest.raises(ValueError, match="num_prompts"):
        run_demo(tmp_path / "d", num_prompts=n, progress=False)


def test_a_root_without_models_or_with_a_non_mqar_model_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no built-in models") as err:
        run_demo(tmp_path / "out", num_prompts=1, root=empty, progress=False)
    assert "none" in str(err.value)

    import shutil

    root = tmp_path / "root"
    shutil.copytree(BUILTIN_ROOT / "mqar-deltanet", root / "mqar-deltanet")
    task = _task("mqar-deltanet") | {"suite": "copy"}
    (root / "mqar-deltanet" / "task.json").write_text(json.dumps(task))
    with pytest.raises(ValueError, match="suite 'copy'"):
        run_demo(tmp_path / "out", num_prompts=1, root=root, progress=False)
    assert not (tmp_path / "out" / "mqar-deltanet").exists()


def test_models_of_different_task_shapes_are_refused_before_any_capture(tmp_path):
    import shutil

    root = tmp_path / "root"
    for name in ("mqar-deltanet", "mqar-osdn"):
        shutil.copytree(BUILTIN_ROOT / name, root / name)
    task = _task("mqar-osdn")
    (root / "mqar-osdn" / "task.json").write_text(json.dumps(task | {"num_pairs": task["num_pairs"] // 2,
                                                                     "num_queries": task["num_pairs"] // 2}))
    with pytest.raises(ValueError, match="different MQAR shapes"):
        run_demo(tmp_path / "out", num_prompts=1, root=root, progress=False)
    (root / "mqar-osdn" / "task.json").write_text(json.dumps(task | {"num_queries": 3}))
    with pytest.raises(ValueError, match="num_queries = num_pairs"):
        run_demo(tmp_path / "out", num_prompts=1, root=root, progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("given", ["new", "existing", "dangling link"])
def test_the_git_marker_goes_only_into_a_directory_the_demo_made(tmp_path, monkeypatch, given):
    """``demo --out .`` in a checkout must not write ``.gitignore`` = ``*`` into the user's own directory,
    and a ``.gitignore`` that is a link is never written through (issue 44)."""
    from osdn_diag import demo as demo_module

    monkeypatch.setattr(demo_module, "_run", lambda out_dir, *a, **k: (out_dir / "report" / "report.md", []))
    out = tmp_path / "out"
    if given != "new":
        out.mkdir()
    if given == "dangling link":
        (out / ".gitignore").symlink_to(tmp_path / "created")
    run_demo(out, models=["mqar-deltanet"], progress=False)
    marker = out / ".gitignore"
    if given == "new":
        assert marker.read_text().splitlines()[-1] == "*"
    elif given == "existing":
        assert not marker.exists()
    else:
        assert marker.is_symlink() and not (tmp_path / "created").exists()
