"""The report's figures drawn on worker processes (osdn_diag.report.render): the same files, byte for
byte, as drawn in the calling process; errors raised to the caller; no process left behind; the
worker count from OSDN_DIAG_REPORT_WORKERS, refused in one line when it is not a number."""

from __future__ import annotations

import multiprocessing
import os
import shutil

import pytest

from osdn_diag.cli import entry, main
from osdn_diag.report import write_report
from osdn_diag.report import render
from osdn_diag.report.render import Figure, default_workers, draw, figure_workers


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run whose report has every figure: contraction, q_geo, by layer, layer × head, retained,
    ε vs q (comparator) and the d trajectory (a stored capture of a model with a preconditioner)."""
    out = tmp_path_factory.mktemp("workers") / "run"
    assert main(["run", "builtin:mqar-osdn", "--prompts", "mqar", "--num-prompts", "2", "--length", "64",
                 "--twice", "--retained", "--out", str(out), "-q"]) == 0
    return out


def _files(report_dir):
    return {p.name: p.read_bytes() for p in sorted((report_dir / "plots").iterdir())}


def test_workers_draw_the_same_files_as_the_calling_process(run_dir, tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    write_report([run_dir], here)
    with figure_workers(2):
        assert render._workers is not None
        write_report([run_dir], there)
    assert render._workers is None
    drawn = _files(here)
    assert sorted(drawn) == sorted(f"{name}.{ext}" for ext in ("png", "pdf") for name in (
        "contraction", "q_geo", "by_layer", "layer_head", "retained", "eps_vs_q", "d_trajectory"))
    # Byte for byte: each file comes from a figure of its own in both cases, and a PDF carries no
    # creation date (the two reports were written at different times).
    assert _files(there) == drawn
    assert (here / "report.md").read_text() == (there / "report.md").read_text()
    assert not multiprocessing.active_children()  # the block stopped its workers


def test_this_process_draws_a_share_beside_its_worker(run_dir, tmp_path, monkeypatch):
    """With one worker (a 2-CPU machine), every second file is drawn here meanwhile, not all there."""
    from osdn_diag.report import plots

    here, save_as = [], plots.save_as  # patched in this process only: a worker has its own module
    monkeypatch.setattr(plots, "save_as", lambda fig, path: (here.append(path.name), save_as(fig, path))[1])
    with figure_workers(1):
        write_report([run_dir], tmp_path / "r")
    drawn = _files(tmp_path / "r")
    assert len(here) == len(drawn) // 2 and set(here) < set(drawn)
    assert drawn == _files_of_fresh_report(run_dir, tmp_path / "ref")


def test_a_figure_that_fails_in_a_worker_raises_here(tmp_path):
    with figure_workers(1), pytest.raises(AttributeError, match="no_such_plot"):
        draw([Figure("no_such_plot", (), tmp_path / "x.png")])
    assert not list(tmp_path.iterdir())  # nothing half-written
    assert not multiprocessing.active_children()


def test_workers_that_died_leave_the_figures_to_this_process(run_dir, tmp_path):
    """A killed worker breaks the pool: the figures are drawn here instead, all of them."""
    with figure_workers(1):
        for proc in multiprocessing.active_children():
            proc.kill()
            proc.join()
        write_report([run_dir], tmp_path / "r")
    assert _files(tmp_path / "r") == _files_of_fresh_report(run_dir, tmp_path / "ref")


def _files_of_fresh_report(run_dir, out):
    write_report([run_dir], out)
    return _files(out)


def test_nested_blocks_start_no_second_pool():
    with figure_workers(1):
        outer = render._workers
        with figure_workers(1):
            assert render._workers is outer
        assert render._workers is outer
    assert render._workers is None
    assert not multiprocessing.active_children()  # the block that started the pool stopped its worker


@pytest.mark.parametrize("cpus, expected", [(1, 0), (2, 1), (3, 1), (4, 2), (6, 4), (16, 8), (128, 8)])
def test_default_worker_count(monkeypatch, cpus, expected):
    monkeypatch.delenv(render.WORKERS_ENV, raising=False)
    monkeypatch.setattr(render.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert default_workers() == expected


def test_worker_count_from_the_environment(monkeypatch):
    monkeypatch.setenv(render.WORKERS_ENV, "3")
    assert default_workers() == 3
    # No more than one per file a report draws: 100000 started 100000 processes, for 14 files.
    for many in ("14", "15", "100000"):
        monkeypatch.setenv(render.WORKERS_ENV, many)
        assert default_workers() == 14
    for bad in ("-1", "two", ""):
        monkeypatch.setenv(render.WORKERS_ENV, bad)
        with pytest.raises(ValueError, match="OSDN_DIAG_REPORT_WORKERS"):
            default_workers()


def test_a_bad_worker_count_is_one_line_before_anything_is_written(run_dir, tmp_path, monkeypatch, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    before = {p.relative_to(copy): p.stat().st_mtime_ns for p in copy.rglob("*")}
    monkeypatch.setenv(render.WORKERS_ENV, "many")
    assert entry(["report", str(copy)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("osdn-diag: error: OSDN_DIAG_REPORT_WORKERS='many'") and "\n" not in err
    assert {p.relative_to(copy): p.stat().st_mtime_ns for p in copy.rglob("*")} == before


def test_the_report_command_draws_on_workers_when_told(run_dir, tmp_path, monkeypatch, capsys):
    """`osdn-diag report` with OSDN_DIAG_REPORT_WORKERS=2 starts its workers and writes the same files."""
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    started = []
    real = render.figure_workers

    def spy(n=None):
        started.append(default_workers() if n is None else n)
        return real(n)

    monkeypatch.setattr(render, "figure_workers", spy)
    monkeypatch.setenv(render.WORKERS_ENV, "2")
    assert entry(["report", str(copy)]) == 0
    assert started == [2]
    assert _files(copy) == _files_of_fresh_report(run_dir, tmp_path / "ref")


def test_the_report_command_starts_the_default_workers_when_not_told(run_dir, tmp_path, monkeypatch):
    """`osdn-diag report` with OSDN_DIAG_REPORT_WORKERS unset, as a user runs it (the suite sets it to
    0 elsewhere): on a 2-CPU machine one worker starts, and the files are those drawn here alone."""
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    monkeypatch.delenv(render.WORKERS_ENV, raising=False)
    monkeypatch.setattr(render, "usable_cpus", lambda: 2)
    started = []
    real = render._start

    def spy(n):
        pool = real(n)
        started.append((n, pool is not None))
        return pool

    monkeypatch.setattr(render, "_start", spy)
    assert entry(["report", str(copy)]) == 0
    assert started == [(1, True)]
    assert _files(copy) == _files_of_fresh_report(run_dir, tmp_path / "ref")


def test_a_pdf_carries_no_creation_date(tmp_path, monkeypatch):
    """The same figure saved at two different times gives the same bytes."""
    from osdn_diag.report.plots import plot_q_bars, save_as

    runs = [("a", {"q_geo": 0.5, "q_arith": 0.6})]
    for epoch in ("0", "1700000000"):
        monkeypatch.setenv("SOURCE_DATE_EPOCH", epoch)  # what matplotlib dates a PDF by, if at all
        save_as(plot_q_bars(runs), tmp_path / f"{epoch}.pdf")
    assert (tmp_path / "0.pdf").read_bytes() == (tmp_path / "1700000000.pdf").read_bytes()


def test_workers_that_cannot_start_leave_the_figures_to_this_process(run_dir, tmp_path, monkeypatch):
    """A machine where no process can be started (a sandbox): the report is drawn here, as usual."""
    import concurrent.futures.process as cfp

    def refuse(self):
        raise OSError("no processes here")

    monkeypatch.setattr(cfp.ProcessPoolExecutor, "_adjust_process_count", refuse)
    with figure_workers(2):
        assert render._workers is None
        write_report([run_dir], tmp_path / "r")
    assert _files(tmp_path / "r") == _files_of_fresh_report(run_dir, tmp_path / "ref")


def test_workers_count_the_cpus_this_process_may_use(monkeypatch):
    """A job given 4 cores of a 64-core node (SLURM, a container's cpuset) starts 2 workers, not 8."""
    monkeypatch.delenv(render.WORKERS_ENV, raising=False)
    monkeypatch.setattr(render.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(render.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert default_workers() == 2


def test_a_pool_that_starts_in_part_is_stopped_in_full(run_dir, tmp_path, monkeypatch):
    """The first worker starts, the second cannot: the first is stopped again and the report is drawn
    here; no process and no thread is left (a live non-daemon thread would keep the console script
    from its fast exit)."""
    import concurrent.futures.process as cfp
    import threading

    real, started = cfp.ProcessPoolExecutor._spawn_process, []

    def second_fails(self):
        started.append(1)
        if len(started) == 2:
            raise OSError("no second process")
        return real(self)

    monkeypatch.setattr(cfp.ProcessPoolExecutor, "_spawn_process", second_fails)
    with figure_workers(2):
        assert render._workers is None
        # Stopped already, not on their way out.
        assert not multiprocessing.active_children()
        assert [t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread()] == []
        write_report([run_dir], tmp_path / "r")
    assert len(started) == 2
    assert _files(tmp_path / "r") == _files_of_fresh_report(run_dir, tmp_path / "ref")


def test_a_failed_draw_returns_after_every_file_in_flight(tmp_path):
    """A figure that fails on one worker while another draws: draw() raises only once nothing more
    will be written, as when the figures are drawn here."""
    import time

    runs = [(f"run {i}", {"q_geo": 0.5, "q_arith": 0.6}) for i in range(300)]  # a figure that takes a while
    slow = Figure("plot_q_bars", (runs,), tmp_path / "slow.png")
    with figure_workers(3):
        time.sleep(4.0)  # every worker started: the failing files and the slow PNG are drawn at once
        with pytest.raises(AttributeError):
            draw([Figure("no_such_plot", (), tmp_path / "bad.png"), slow])
        after_raise = sorted(p.name for p in tmp_path.iterdir())
        time.sleep(1.0)
        assert sorted(p.name for p in tmp_path.iterdir()) == after_raise


def test_main_from_python_starts_no_worker(run_dir, tmp_path, monkeypatch):
    """`osdn_diag.cli.main` called from a script starts no process (a spawned process re-imports the
    script's main module); the console script does (`entry`)."""
    started = []
    real = render.figure_workers
    monkeypatch.setattr(render, "figure_workers", lambda n=None: started.append(n) or real(0))
    monkeypatch.setenv(render.WORKERS_ENV, "2")
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    assert main(["report", str(copy)]) == 0
    assert started == []
    assert entry(["report", str(copy)]) == 0
    assert started == [None]


_ORPHAN = """
import os, sys, time
from osdn_diag.report.render import figure_workers
import multiprocessing
import os
with figure_workers(2):
    time.sleep(3.0)  # the workers are up
    print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
    time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_workers_of_a_killed_command_exit(tmp_path):
    """A command killed outright (SIGKILL, the OOM killer) never stops its workers: they notice that
    their parent is gone and exit."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()


# Ctrl-C (or SIGTERM) while this process draws its share, and the worker then dies, as a signal to
# the whole process group ends it. Dies is the first figure's argument: drawn here, its len() waits
# a second (the executor has queued the first files for the worker meanwhile) and is interrupted;
# unpickled in the worker, it sleeps two seconds and ends the worker.
_DIES = """
import os, sys, time
from pathlib import Path
from osdn_diag.report.render import Figure, draw, figure_workers

class Call:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args
    def __reduce__(self):
        return self.fn, self.args

class Dies:
    def __len__(self):
        time.sleep(1.0)
        raise KeyboardInterrupt
    def __reduce__(self):
        return os._exit, (Call(len, (Call(time.sleep, 2.0),)),)

if __name__ == "__main__":
    out = Path(sys.argv[1])
    pairs = [("a", {"q_geo": 0.5, "q_arith": 0.6})]
    figures = [Figure("plot_q_bars", (Dies(),), out / "dies.png")]
    figures += [Figure("plot_q_bars", (pairs,), out / f"f{i}.png") for i in range(6)]
    with figure_workers(1):
        time.sleep(4.0)  # the worker is up and idle: nothing wakes the executor's thread but its death
        try:
            draw(figures)
        except KeyboardInterrupt:
            print("raised", flush=True)
"""


def test_a_failed_draw_whose_worker_dies_returns(tmp_path):
    """The hang seen after a SIGTERM to a `run`'s process group while its report was drawn: this
    process's share failed (Ctrl-C, SIGTERM), it cancelled the files its worker had not started, and
    the worker then died; the executor's thread stopped at the first cancelled future (InvalidStateError,
    CPython 3.11) without failing the file in flight, and draw() waited for it forever. It now raises
    within seconds (issue 44)."""
    import subprocess
    import sys

    script = tmp_path / "dies.py"
    script.write_text(_DIES)
    try:
        done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                              timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("draw() never returned after its worker died")
    assert done.stdout == "raised\n", done.stderr
