"""Two processes (torchrun, gloo on the CPU) give the summary and table of one process.

Kernels: the default ``kernels="auto"``, so on a CPU the reference recurrence stands in for fla's kernel;
test_fla_kernels_e2e.py runs fla's own kernels end to end.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from osdn_diag.cli import main

ARGS = ["random:gated-deltanet-tiny", "--prompts", "random", "--twice", "--num-prompts", "5",
        "--length", "16", "-q"]


def _close(a, b, path="summary"):
    """Equal up to floating-point summation order (relative 1e-9)."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for key in a:
            _close(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and not (math.isnan(a) and math.isnan(b)):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), (path, a, b)
    elif not isinstance(a, float):
        assert a == b, (path, a, b)


COMPARE = Path(__file__).resolve().parents[2] / "benchmarks" / "compare_runs.py"


def _compare(a, b, *extra) -> subprocess.CompletedProcess:
    """``benchmarks/compare_runs.py``, the check a user runs on two run directories."""
    return subprocess.run([sys.executable, str(COMPARE), *extra, str(a), str(b)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    assert main(["run", *ARGS, "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("mode", [[], ["--stream"]], ids=["stored", "stream"])
def test_two_ranks_equal_one(one, tmp_path, mode):
    two = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "osdn_diag", "run", *ARGS, *mode, "--out", str(two)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((two / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["world_size"] == 2
    assert manifest["capture_stored"] is (not mode) and (two / "capture").exists() is (not mode)
    assert sorted(p.name for p in (two / "residuals.parquet").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]
    a = json.loads((one / "summary.json").read_text())
    b = json.loads((two / "summary.json").read_text())
    assert b.pop("world_size") == 2
    assert a.pop("run_id") != b.pop("run_id") == manifest["run_id"]
    _close(a, b)
    shards = sorted(p.relative_to(two).as_posix() for p in (two / "capture").rglob("*.safetensors")) if not mode else []
    assert sorted(manifest["shards"]) == shards  # every rank's shards, each listed once
    keys = [("prompt", "ascending"), ("layer", "ascending"), ("head", "ascending"), ("pos", "ascending")]
    ta = pq.read_table(one / "residuals.parquet").sort_by(keys).to_pydict()
    tb = pq.read_table(two / "residuals.parquet").sort_by(keys).to_pydict()  # the parts read as one
    assert ta == tb
    ca = pq.read_table(one / "comparator.parquet").sort_by(keys[:3]).to_pydict()
    cb = pq.read_table(two / "comparator.parquet").sort_by(keys[:3]).to_pydict()
    _close(ca, cb, "comparator")
    proc = _compare(one, two, "--rtol", "1e-9", "--atol", "1e-12")  # the same verdict from the user's tool
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_model_spread_block_by_block_is_captured_layer_by_layer(one, tmp_path):
    """accelerate's dispatch (hooks on every block, as when each block sits on its own GPU) leaves
    capture, its layer tags and every result unchanged."""
    pytest.importorskip("accelerate")
    from osdn_diag import runtime
    from osdn_diag.models import load_model
    from osdn_diag.pipeline import capture_run, replay_run

    runtime.prepare("cpu")
    names = ["model.embeddings", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    loaded = load_model("random:gated-deltanet-tiny", device_map={n: "cpu" for n in names})
    assert all(hasattr(loaded.model.get_submodule(n), "_hf_hook") for n in names[1:3])
    out = tmp_path / "spread"
    capture_run(loaded, "random", out, twice=True, num_prompts=5, length=16, progress=False)
    summary = replay_run(out, progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert [entry["layer"] for entry in manifest["layers"]] == [0, 1]
    assert manifest["device_map"] == {n: "cpu" for n in names}
    reference = json.loads((one / "summary.json").read_text())
    assert summary.pop("run_id") != reference.pop("run_id")
    assert summary == reference
    assert pq.read_table(out / "residuals.parquet").equals(pq.read_table(one / "residuals.parquet"))
    proc = _compare(one, out)
    assert proc.returncode == 0 and "same results" in proc.stdout, proc.stdout + proc.stderr


def test_compare_runs_names_what_differs(one, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(one, other)
    summary = json.loads((other / "summary.json").read_text())
    summary["q_geo"] *= 1 + 1e-6
    (other / "summary.json").write_text(json.dumps(summary))
    proc = _compare(one, other)
    assert proc.returncode == 1 and "(q_geo)" in proc.stdout and "DIFFERENT" in proc.stdout, proc.stdout
    assert _compare(one, other, "--rtol", "1e-5").returncode == 0
    # A device name is metadata: listed, not a difference in results; a changed flag is a result.
    summary["q_geo"] /= 1 + 1e-6
    summary["replay"]["device"] = "cuda:1"
    (other / "summary.json").write_text(json.dumps(summary))
    proc = _compare(one, other)
    assert proc.returncode == 0 and "same results" in proc.stdout, proc.stdout
    assert "metadata (not compared as a result): replay.device: 'cpu' vs 'cuda:1'" in proc.stdout, proc.stdout
    summary["fidelity"]["measured"] = not summary["fidelity"]["measured"]
    (other / "summary.json").write_text(json.dumps(summary))
    proc = _compare(one, other)
    assert proc.returncode == 1 and "(fidelity.measured)" in proc.stdout, proc.stdout
    proc = _compare(one, tmp_path / "nowhere")
    assert proc.returncode == 2 and "RUN_B" in proc.stderr and "no summary.json" in proc.stderr, proc.stderr


def test_compare_runs_takes_a_column_left_out_as_one_null_throughout(one, tmp_path):
    """A run written before the table left out the columns no layer fills (null throughout) and one
    written after hold the same results; a left-out column that the other run fills is a difference."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(one / "residuals.parquet")
    assert "residual_ratio_alt" not in table.column_names  # a Comba and RWKV-7 column; this is Gated DeltaNet
    for name, column, same in (("old", pa.nulls(table.num_rows, pa.float32()), True),
                               ("filled", pa.array([0.5] * table.num_rows, pa.float32()), False)):
        other = tmp_path / name
        shutil.copytree(one, other)
        pq.write_table(table.append_column("residual_ratio_alt", column), other / "residuals.parquet")
        proc = _compare(one, other)
        assert proc.returncode == (0 if same else 1), proc.stdout
        assert ("same results" in proc.stdout) == same and ("(residual_ratio_alt)" in proc.stdout) != same


def test_device_map_refuses_bad_requests(tmp_path):
    pytest.importorskip("accelerate")
    from osdn_diag import runtime
    from osdn_diag.models import load_model

    runtime.prepare("cpu")
    with pytest.raises(ValueError, match="device_map.*auto, balanced, sequential"):
        load_model("random:deltanet-tiny", device_map="everywhere")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "osdn_diag", "run", *ARGS, "--device-map", "auto", "--out", str(tmp_path / "x")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "not under torchrun with several" in proc.stderr, proc.stderr[-2000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    """Whether some process listens on ``port`` (the rendezvous store of a rank 0 waiting for the others)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        if any(f[1].endswith(f":{port:04X}") and f[3] == "0A" for f in map(str.split, lines)):
            return True
    return False


@pytest.mark.parametrize("how", ["timeout", "SIGTERM", "SIGINT"])
def test_a_group_whose_other_ranks_never_come_ends(tmp_path, how):
    """``WORLD_SIZE=2`` set by hand for one process: it waited in torch's C++ rendezvous for the other
    rank for 30 minutes, and SIGTERM and Ctrl-C did nothing meanwhile. Now the wait ends after
    OSDN_DIAG_RENDEZVOUS_TIMEOUT seconds with one line naming WORLD_SIZE, and a signal ends it at once
    as anywhere else (143 / 130, one line), nothing written."""
    import os
    import signal
    import time

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "WORLD_SIZE": "2", "RANK": "0",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OSDN_DIAG_RENDEZVOUS_TIMEOUT": "2" if how == "timeout" else "600"}
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "osdn_diag", "capture", *ARGS, "--out", str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if how != "timeout":
            deadline = time.monotonic() + 120
            while not _listening(port):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.1)
            time.sleep(0.5)
            proc.send_signal(getattr(signal, how))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    err = err.strip()
    if how == "timeout":
        assert proc.returncode == 2, err
        assert err.startswith("osdn-diag: error: WORLD_SIZE=2: the other processes of the group did not join "
                              "within 2 s") and "\n" not in err
    else:
        assert (proc.returncode, err) == ((143, "osdn-diag: terminated (SIGTERM)") if how == "SIGTERM"
                                          else (130, "osdn-diag: interrupted"))
    assert not out.exists()


@pytest.mark.parametrize("case", ["host-does-not-resolve", "label-too-long", "port-taken", "port-zero"])
def test_a_wrong_rendezvous_address_is_one_line_naming_master_addr_and_port(tmp_path, case):
    """A MASTER_ADDR that does not resolve: torch warned every second until the wait ended (with a line
    blaming the other ranks; on GPUs torch's own traceback, after its store's timeout). A MASTER_PORT
    already taken on rank 0's host: torch's traceback (DistNetworkError, EADDRINUSE), exit status 1.
    MASTER_PORT=0 (no port to meet at: rank 0's store binds any free one, the others find none) was
    taken, and rank 1 waited the whole rendezvous timeout. A MASTER_ADDR with a label past 63
    characters: getaddrinfo raised UnicodeError (not gaierror), which the check left to torch (its
    warnings, then the whole wait). Now each is refused at once in one line naming MASTER_ADDR and
    MASTER_PORT and what to check, exit status 2, nothing written. (gloo on the CPU, one rank of 2
    started alone; the wait is set short, so that without the refusal the host, long-label and
    port-zero cases end in 5 s.)"""
    import os
    import socket

    out = tmp_path / "out"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr, port, rank = {"host-does-not-resolve": ("no-such-host.invalid", str(_free_port()), "0"),
                            "label-too-long": ("a" * 64 + ".example.com", str(_free_port()), "0"),
                            "port-taken": ("127.0.0.1", str(taken.getsockname()[1]), "0"),
                            "port-zero": ("localhost", "0", "1")}[case]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "WORLD_SIZE": "2", "RANK": rank,
               "LOCAL_RANK": "0", "MASTER_ADDR": addr, "MASTER_PORT": port, "OSDN_DIAG_RENDEZVOUS_TIMEOUT": "5"}
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        done = subprocess.run([sys.executable, "-m", "osdn_diag", "capture", *ARGS, "--out", str(out)], env=env,
                              capture_output=True, text=True, timeout=120)
    err = done.stderr.strip()
    assert done.returncode == 2 and "\n" not in err, err[-3000:]
    assert err.startswith(f"osdn-diag: error: MASTER_ADDR={addr!r}, MASTER_PORT={port!r}: "), err
    assert {"host-does-not-resolve": "the host name MASTER_ADDR does not resolve",
            "label-too-long": "the host name MASTER_ADDR does not resolve (not a host name: ",
            "port-taken": "joining the process group failed (The server socket has failed to listen",
            "port-zero": "MASTER_PORT is not a port number (1 to 65535)"}[case] in err
    assert "check that MASTER_ADDR names the host of rank 0" in err
    assert not out.exists()


@pytest.mark.parametrize(("addr", "where"), [("::1", "[::1]:29521"), ("fe80::1%eth0", "[fe80::1%eth0]:29521"),
                                           ("127.0.0.1", "127.0.0.1:29521"), ("node-0", "node-0:29521")])
def test_the_rendezvous_timeout_line_brackets_an_ipv6_address(monkeypatch, addr, where):
    """An IPv6 MASTER_ADDR printed as "rendezvous at ::1:29521": which colon starts the port? Now a
    host with a colon is bracketed, "[::1]:29521" (as in a URL); other hosts print as before. (The
    joining is made to wait on an event, so the group never forms, and the wait is 0.2 s.)"""
    import threading

    from osdn_diag import distributed

    release = threading.Event()
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **_: release.wait(30))
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(distributed, "_check_rendezvous_address", lambda: None)  # not what this tests
    for name, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "0", "MASTER_ADDR": addr,
                        "MASTER_PORT": "29521", distributed.RENDEZVOUS_ENV: "0.2"}.items():
        monkeypatch.setenv(name, value)
    try:
        with pytest.raises(TimeoutError) as refused:
            distributed.init_from_env()
    finally:
        release.set()
    assert f"(rendezvous at {where});" in str(refused.value)


@pytest.mark.parametrize("raw", ["abc", "nan", "-1", "0", "inf", "1e10", "1e300"])
def test_a_rendezvous_timeout_out_of_range_is_refused_naming_the_variable(monkeypatch, raw):
    """Not a number above 0, or past a week (a thread's wait cannot take a deadline beyond the
    platform's clock: 1e10 s raised OverflowError from deep in threading), is refused naming it."""
    from osdn_diag.distributed import RENDEZVOUS_ENV, rendezvous_timeout

    monkeypatch.setenv(RENDEZVOUS_ENV, raw)
    with pytest.raises(ValueError, match=f"{RENDEZVOUS_ENV}={raw!r}: expected .* at most 604800"):
        rendezvous_timeout()


def test_a_rendezvous_timeout_of_a_week_is_taken(monkeypatch):
    from osdn_diag.distributed import RENDEZVOUS_ENV, rendezvous_timeout

    monkeypatch.setenv(RENDEZVOUS_ENV, "604800")
    assert rendezvous_timeout() == 604800.0
    monkeypatch.delenv(RENDEZVOUS_ENV)
    assert rendezvous_timeout() == 300.0
