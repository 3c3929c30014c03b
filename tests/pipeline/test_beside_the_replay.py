"""Work done beside the replay, on threads of its own.

Theorem D.7's comparator (osdn_diag.replay.replayer._Solve): on a GPU each batch is solved on a thread
and CUDA stream of its own while the next calls replay. The rows must be those of solving every batch
in place, in the calls' order, none lost; a solver error must reach the caller. On the CPU the
replayer solves in place by default; these tests switch the thread on there too (``solve_beside``),
and repeat on a GPU where there is one.

The per-token table's rows: a run builds each call's rows on a thread of the residuals writer's, not
on the replay's; an error building them reaches the caller."""

from __future__ import annotations

import json
import threading

import pyarrow.parquet as pq
import pytest
import torch

from osdn_diag.cli import main
from osdn_diag.pipeline import replay_run
from osdn_diag.replay import replayer as replayer_mod

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    out = tmp_path_factory.mktemp("beside") / "cap"
    assert main(["capture", "random:deltanet-tiny", "--prompts", "random", "--num-prompts", "3",
                 "--length", "40", "--twice", "--out", str(out), "-q"]) == 0
    return out


def _replay(captured, out, monkeypatch, *, beside: bool, device: str, elems: int = 1):
    """The run replayed with every call its own comparator batch (``elems = 1``), the batches solved
    beside the replay or in place; returns comparator.parquet and how many batches went to a thread."""
    threads = []
    real_init, real_solve = replayer_mod.Replayer.__init__, replayer_mod._Solve.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.solve_beside = beside

    def solve(self, *args, **kwargs):
        real_solve(self, *args, **kwargs)
        threads.append(self.thread.name)

    monkeypatch.setattr(replayer_mod.Replayer, "__init__", init)
    monkeypatch.setattr(replayer_mod._Solve, "__init__", solve)
    replay_run(captured, progress=False, out_dir=out, theorem_batch_elems=elems, device=device)
    monkeypatch.undo()
    return pq.read_table(out / "comparator.parquet"), threads


@pytest.mark.parametrize("device", DEVICES)
def test_solved_beside_equals_solved_in_place(captured, tmp_path, monkeypatch, device):
    in_place, none = _replay(captured, tmp_path / "in_place", monkeypatch, beside=False, device=device)
    beside, threads = _replay(captured, tmp_path / "beside", monkeypatch, beside=True, device=device)
    assert none == []
    manifest = json.loads((captured / "manifest.json").read_text())
    calls = len(manifest["shards"])  # a shard is a call
    assert calls >= 2 and threads == ["comparator"] * calls
    assert in_place.num_rows == beside.num_rows == 2 * len(manifest["prompts"]) * 2  # layers × prompts × heads
    # The same operations on the same numbers: equal bit for bit, rows in the calls' order.
    assert beside.equals(in_place)


@pytest.mark.parametrize("device", DEVICES)
def test_all_batches_together_beside(captured, tmp_path, monkeypatch, device):
    """One batch of every call (the default batch size here) gives the same rows as a batch per call."""
    per_call, _ = _replay(captured, tmp_path / "per_call", monkeypatch, beside=True, device=device)
    together, threads = _replay(captured, tmp_path / "together", monkeypatch, beside=True, device=device,
                                elems=replayer_mod.THEOREM_BATCH_ELEMS)
    assert threads == ["comparator"]
    for name in per_call.column_names:
        a, b = per_call[name].to_pylist(), together[name].to_pylist()
        if isinstance(a[0], float):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-12, atol=1e-15, equal_nan=True), name
        else:
            assert a == b, name


def test_a_solver_error_on_the_thread_reaches_the_caller(captured, tmp_path, monkeypatch):
    real = replayer_mod._Problems.solve
    seen = []

    def failing(self, box):
        seen.append(1)
        if len(seen) == 2:
            raise RuntimeError("solver failed on the second batch")
        return real(self, box)

    monkeypatch.setattr(replayer_mod._Problems, "solve", failing)
    with pytest.raises(RuntimeError, match="second batch"):
        _replay(captured, tmp_path / "fails", monkeypatch, beside=True, device="cpu")
    assert not (tmp_path / "fails" / "comparator.parquet").exists()


@pytest.mark.parametrize("stream", [True, False])
def test_rows_are_built_beside_the_replay(tmp_path, monkeypatch, stream):
    built = []
    real = replayer_mod._arrow_table

    def spy(*args, **kwargs):
        built.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(replayer_mod, "_arrow_table", spy)
    out = tmp_path / "run"
    argv = ["run", "random:deltanet-tiny", "--prompts", "random", "--num-prompts", "2", "--length", "24",
            "--out", str(out), "-q"]
    assert main(argv + (["--stream"] if stream else [])) == 0
    assert built and set(built) == {"residuals-rows"}
    assert pq.read_table(out / "residuals.parquet").num_rows == 2 * 24 * 2 * 2  # prompts × tokens × layers × heads


def test_an_error_building_rows_reaches_the_caller(tmp_path, monkeypatch):
    """A call's rows that fail to build on their thread fail the run, naming the file, and the run is
    not complete (no residuals.parquet, no summary)."""
    real, seen = replayer_mod._arrow_table, []

    def failing(*args, **kwargs):
        seen.append(1)
        if len(seen) == 2:
            raise ValueError("the second call's rows")
        return real(*args, **kwargs)

    monkeypatch.setattr(replayer_mod, "_arrow_table", failing)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="residuals.parquet failed") as err:
        main(["run", "random:deltanet-tiny", "--prompts", "random", "--num-prompts", "2", "--length", "24",
              "--stream", "--out", str(out), "-q"])
    assert isinstance(err.value.__cause__, ValueError)
    assert json.loads((out / "manifest.json").read_text())["complete"] is False
    assert not (out / "residuals.parquet").exists() and not (out / "summary.json").exists()
