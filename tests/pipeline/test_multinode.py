"""Two "nodes" on one machine: two ``torchrun --nnodes 2 --node-rank {0,1}`` launches meeting at a
c10d rendezvous on 127.0.0.1 (gloo on the CPU), with one ``--out`` for both (a shared file system) or
one each (then ``osdn-diag merge``); a rank killed as a preempted node would be, and the rerun that
resumes it. Every result equals a single-process run's.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from osdn_diag.cli import entry, main

from test_distributed import _close

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["random:deltanet-tiny", "--prompts", "random", "--num-prompts", "4", "--length", "8", "-q"]
KEYS = [("prompt", "ascending"), ("layer", "ascending"), ("head", "ascending"), ("pos", "ascending")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(out0: Path, out1: Path, *extra: str, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """``osdn-diag run ARGS`` under two torchrun launches of one process each (node ranks 0 and 1),
    writing under ``out0`` and ``out1``; the worktree first on the ranks' PYTHONPATH."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = []
    for node, out in enumerate((out0, out1)):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", f"test-{port}", "--local-addr", "127.0.0.1", "--max-restarts", "0",
               "-m", "osdn_diag", "run", *ARGS, *extra, "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=240)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return done


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    from osdn_diag import runtime
    from osdn_diag.pipeline import capture_run, replay_run

    runtime.prepare("cpu")
    out = tmp_path_factory.mktemp("one") / "run"  # the results of `run ARGS` in one process, no report
    capture_run(ARGS[0], "random", out, num_prompts=4, length=8, progress=False)
    replay_run(out, progress=False)
    return out


def _same_as_one(one: Path, run: Path) -> dict:
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["world_size"] == 2
    a = json.loads((one / "summary.json").read_text())
    b = json.loads((run / "summary.json").read_text())
    assert b.pop("world_size") == 2 and a.pop("run_id") != b.pop("run_id") == manifest["run_id"]
    _close(a, b)
    assert pq.read_table(one / "residuals.parquet").sort_by(KEYS).to_pydict() == \
        pq.read_table(run / "residuals.parquet").sort_by(KEYS).to_pydict()
    # Every rank's shards and table parts are listed with their hashes, and every rank left a record.
    shards = sorted(p.relative_to(run).as_posix() for p in (run / "capture").rglob("*.safetensors"))
    assert sorted(manifest["shards"]) == shards and len(shards) == 8
    assert sorted(manifest["parts"]) == [f"residuals.parquet/part-0000{r}.parquet" for r in (0, 1)]
    assert sorted(p.name for p in (run / "ranks").iterdir()) == ["rank-00000.json", "rank-00001.json"]
    # Rank 0's tokens.parquet, listed with its hash (a merge copies it), holds the same tokens.
    from osdn_diag.rundir import sha256_file

    assert manifest["tokens"]["sha256"] == sha256_file(run / "tokens.parquet")
    assert pq.read_table(run / "tokens.parquet").equals(pq.read_table(one / "tokens.parquet"))
    return manifest


def _one_line(argv, capsys) -> str:
    assert entry(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_shared_out_a_killed_rank_and_the_rerun_that_resumes(one, tmp_path, capsys):
    run = tmp_path / "shared"
    # Rank 1 dies (SIGKILL) after its capture: no rank may leave a run that says complete.
    procs = _two_nodes(run, run, env={"OSDN_DIAG_FAULT": "1:captured"})
    assert all(p.returncode != 0 for p in procs), [p.stderr[-2000:] for p in procs]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["complete"] is False and not (run / "summary.json").exists()
    assert sorted(p.name for p in (run / "ranks").iterdir()) == ["rank-00000.json", "rank-00001.json"]
    # Resuming needs as many processes as the run had, and says so.
    err = _one_line(["run", *ARGS, "--out", str(run)], capsys)
    assert "made by 2 processes" in err and "--overwrite" in err, err
    # A shard of rank 0 changed since: rank 0 captures again, rank 1's verified shards are kept.
    shard = run / "capture" / "batch_00000" / "layer_000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    kept = (run / "capture" / "batch_00001" / "layer_000.safetensors").stat().st_mtime_ns
    procs = _two_nodes(run, run)
    assert all(p.returncode == 0 for p in procs), [p.stderr[-3000:] for p in procs]
    err = "".join(p.stderr for p in procs)
    assert "rank 0: capturing its batches again" in err and "sha256 differs" in err, err[-3000:]
    assert "rank 1: its 4 shards are complete and verified; not captured again" in err, err[-3000:]
    assert (run / "capture" / "batch_00001" / "layer_000.safetensors").stat().st_mtime_ns == kept
    manifest = _same_as_one(one, run)
    assert manifest["shared_out"] is True and "merge_needed" not in manifest
    assert (run / "report.md").is_file()


def test_own_out_per_node_a_killed_rank_a_resume_then_merge(one, tmp_path, capsys):
    a, b = tmp_path / "node0", tmp_path / "node1"
    # Rank 1 dies during its replay; the rerun gives each node the other's --out, as a requeued job
    # whose rank 0 the c10d rendezvous put on the other node: it resumes all the same.
    procs = _two_nodes(a, b, env={"OSDN_DIAG_FAULT": "1:replayed"})
    assert all(p.returncode != 0 for p in procs), [p.stderr[-2000:] for p in procs]
    assert not any((d / "summary.json").exists() for d in (a, b))
    assert [json.loads((d / "manifest.json").read_text())["complete"] for d in (a, b)
            if (d / "manifest.json").exists()] == [False]
    procs = _two_nodes(b, a)
    assert all(p.returncode == 0 for p in procs), [p.stderr[-3000:] for p in procs]
    rank0 = next(d for d in (a, b) if (d / "manifest.json").exists())  # c10d gives rank 0 to either node
    other = b if rank0 == a else a
    manifest = json.loads((rank0 / "manifest.json").read_text())
    # No node's directory holds the whole run, so none says complete, and no report was written.
    assert manifest["shared_out"] is False and manifest["merge_needed"] is True and manifest["complete"] is False
    assert not (rank0 / "report.md").exists() and not (other / "manifest.json").exists()
    assert "osdn-diag merge" in "".join(p.stdout for p in procs)
    err = _one_line(["report", str(rank0)], capsys)  # a report of rank 0's part alone is refused
    assert "merge_needed" in err and "osdn-diag merge" in err, err
    # Parts missing, a file changed, a record of another run: refused, naming the file, before writing.
    alone = tmp_path / "rank0-alone"  # rank 0's directory without the other node's records
    shutil.copytree(rank0, alone)
    for record in (alone / "ranks").glob("rank-*.json"):
        if record.name != "rank-00000.json":  # the earlier attempt left one here, when ranks were swapped
            record.unlink()
    err = _one_line(["merge", str(alone), "--out", str(tmp_path / "m")], capsys)
    assert "rank 1: no ranks/rank-00001.json" in err and str(alone) in err, err
    # Rank 1's part changed, in every directory holding a copy (the earlier attempt left one).
    copies = [d / "residuals.parquet" / "part-00001.parquet" for d in (rank0, other)]
    saved = {c: c.read_bytes() for c in copies if c.is_file()}
    for c, data in saved.items():
        c.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    err = _one_line(["merge", str(rank0), str(other), "--out", str(tmp_path / "m")], capsys)
    assert "part-00001.parquet" in err and "sha256" in err, err
    for c, data in saved.items():
        c.write_bytes(data)
    stranger = tmp_path / "stranger"
    (stranger / "ranks").mkdir(parents=True)
    (stranger / "ranks" / "rank-00001.json").write_text(json.dumps({"run_id": "0" * 32, "rank": 1}))
    err = _one_line(["merge", str(rank0), str(other), str(stranger), "--out", str(tmp_path / "m")], capsys)
    assert str(stranger / "ranks" / "rank-00001.json") in err and "another run" in err, err
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m.merging-*"))
    assert main(["merge", str(rank0), str(other), "--out", str(tmp_path / "m")]) == 0
    merged = _same_as_one(one, tmp_path / "m")
    assert merged["merge_needed"] is False and merged["stages"]["report"] is True
    assert (tmp_path / "m" / "report.md").is_file()
    # What it merged is a run like any other: its capture is whole (replay and what-if can read it).
    from osdn_diag.capture.store import CaptureReader

    assert len(CaptureReader(tmp_path / "m")) == 8


def test_a_nodes_own_out_holding_parts(tmp_path):
    """A node's own --out (no manifest there): its parts of the run being resumed stay, another run's
    are refused, and removed with --overwrite (only the files its records list)."""
    from osdn_diag.pipeline.resume import _prepare_node_output
    from osdn_diag.rundir import RunDirectoryError, write_rank_record

    out = tmp_path / "node"
    shard = out / "capture" / "batch_00001" / "layer_000.safetensors"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"x")
    (out / "capture" / "batch_00001" / "notes.txt").write_text("mine")
    write_rank_record(out, 1, {"run_id": "a" * 32, "rank": 1, "shards": {"capture/batch_00001/layer_000.safetensors": {}}})
    _prepare_node_output(out, "a" * 32, overwrite=False, resume=True)
    assert shard.exists() and (out / "ranks" / "rank-00001.json").exists()
    for resume in (False, True):
        with pytest.raises(RunDirectoryError, match=f"{out}: already holds files of another run.*--overwrite"):
            _prepare_node_output(out, "b" * 32, overwrite=False, resume=resume)
    # A file of the user's in capture/ (a new capture would not replay beside it): refused before
    # anything is removed; once it is moved out, the other run's files go.
    with pytest.raises(RunDirectoryError, match="notes.txt: not a file osdn-diag writes.*move it out of"):
        _prepare_node_output(out, "b" * 32, overwrite=True, resume=False)
    assert shard.exists() and (out / "ranks" / "rank-00001.json").exists()
    (out / "capture" / "batch_00001" / "notes.txt").rename(out / "notes.txt")
    _prepare_node_output(out, "b" * 32, overwrite=True, resume=False)
    assert not shard.exists() and not (out / "ranks").exists() and not (out / "capture").exists()
    assert (out / "notes.txt").read_text() == "mine"


def test_replay_and_what_if_of_rank_0s_part_say_merge(tmp_path, capsys):
    """Rank 0's --out of a run without a shared file system holds only its own shards: replay and
    what-if on it say to merge (not that the capture is damaged and must be captured again)."""
    import torch

    from osdn_diag.capture import CaptureWriter, KernelCall
    from osdn_diag.math import deltanet

    gen = torch.Generator().manual_seed(0)
    q, v = torch.randn(1, 6, 1, 4, generator=gen), torch.randn(1, 6, 1, 4, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(1, 6, 1, 4, generator=gen), dim=-1)
    beta = torch.rand(1, 6, 1, generator=gen)
    run = tmp_path / "node0"
    w = CaptureWriter(run)
    w.begin({"model": {"spec": "synthetic"}, "prompts": [{"id": 0, "task": "a", "length": 6, "repeat_start": -1},
                                                          {"id": 1, "task": "a", "length": 6, "repeat_start": -1}]})
    for b in (0, 1):
        w.write(b, [b], KernelCall(layer=0, layer_name="l0", family="delta_rule", kernel="x", q=q, k=k, v=v,
                                   beta=beta, o=deltanet(q, k, v, beta).o, scale=0.5))
    w.finish()
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps({**manifest, "world_size": 2, "shared_out": False,
                                                   "merge_needed": True}))
    shutil.rmtree(run / "capture" / "batch_00001")  # rank 1's shards are on the other node
    for argv in (["replay", str(run)], ["what-if", str(run), "--out", str(tmp_path / "wi")]):
        err = _one_line([*argv, "-q"], capsys)
        assert "merge_needed" in err and "osdn-diag merge" in err and "damaged" not in err, err
    assert not (tmp_path / "wi").exists()
