"""End to end: the paper-scale diagnostic — capture + replay + summary — on one GPU or several.

    python benchmarks/bench_e2e.py [--model random:deltanet-340m] [--prompts 48] [--T 2048]
                                   [--batch-size 8] [--mode stream,stored] [--profile] [--stages] [--json FILE]
    torchrun --nproc-per-node 2 benchmarks/bench_e2e.py ...      (prompts sharded across the GPUs)
    python benchmarks/bench_e2e.py --device-map balanced ...     (one model spread over the GPUs)

The model is loaded first and one warm-up run of one batch per rank follows (fla's kernels compile
and autotune on their first call at a shape); neither is timed. Then each mode is timed as a user
runs it: ``stream`` (``run --stream``: every call replayed on the GPU as it is captured) and
``stored`` (``run``: the capture written to disk in fp32, then read back and replayed). The table
gives the wall time of each (all ranks, barrier to barrier), the measurements per second, q_geo and
the peak host memory of rank 0. ``--profile`` adds an untimed stream run under cProfile (rank 0).
``--stages`` adds an untimed stream run with wall-clock timers around the pipeline's stages, per
thread (cProfile under Python 3.12 records every thread at once, which muddles a pipeline whose
parquet writer runs beside the replay): where the host's time goes, and how long the replay waits
for the writer.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import platform
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from _common import fidelity_text, write_json


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


#: (module, attribute path, label): the stages ``--stages`` times. Each is looked up where the pipeline
#: calls it (``replayer`` imports ``to_device`` and ``replay_call`` by name). Inclusive times: a
#: stage's time contains the stages it calls (indented).
STAGES = (
    ("osdn_diag.pipeline.session", "_CaptureSession.__init__", "set-up: prompts, manifest"),
    ("osdn_diag.pipeline.session", "_CaptureSession.run", "forwards, each call replayed as captured"),
    ("osdn_diag.replay.replayer", "Replayer.add", "  replay one call (everything below)"),
    ("osdn_diag.replay.replayer", "to_device", "    the record to the replay device"),
    ("osdn_diag.replay.replayer", "replay_call", "    replay kernel and per-token columns"),
    ("osdn_diag.metrics.ratios", "RatioAccumulator.add", "    ratio statistics (two accumulators)"),
    ("osdn_diag.metrics.audit", "AuditAccumulator.add", "    assumption audit"),
    ("osdn_diag.replay.replayer", "Replayer._queue_problems", "    comparator problems (queued; solved in batches)"),
    ("osdn_diag.replay.replayer", "Replayer._finish_solving", "waiting for the comparator's batch"),
    ("osdn_diag.replay.replayer", "_Problems.solve", "comparator solve (a batch)"),
    ("osdn_diag.replay.replayer", "_arrow_table", "the calls' parquet rows (on their own thread)"),
    ("osdn_diag.pipeline.writers", "_ParquetEncoder.write", "  waiting to hand rows to the writer"),
    ("osdn_diag.pipeline.writers", "_ParquetEncoder.close", "waiting for the writer to finish"),
    ("pyarrow.parquet", "ParquetWriter.write_table", "parquet encoding"),
    ("osdn_diag.pipeline.replaying", "_finish_replay", "summary, comparator table, files"),
    ("osdn_diag.pipeline.session", "_CaptureSession.finish", "the manifest, completed"),
)


class _StageTimers:
    """Wraps each of ``stages`` (default :data:`STAGES`) with a wall-clock timer for the duration of a
    ``with`` block; the originals are restored on exit, also on error."""

    def __init__(self, stages=STAGES):
        self.stages = stages
        self.lock = threading.Lock()
        self.totals: dict[tuple[str, str], list] = {}

    def _wrap(self, label, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = (label, threading.current_thread().name)
                with self.lock:
                    entry = self.totals.setdefault(key, [0, 0.0])
                    entry[0] += 1
                    entry[1] += time.perf_counter() - t0
        return timed

    def __enter__(self):
        self.saved = []
        for module, path, label in self.stages:
            owner = importlib.import_module(module)
            *parents, name = path.split(".")
            for part in parents:
                owner = getattr(owner, part)
            fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            self.saved.append((owner, name, fn))
            setattr(owner, name, self._wrap(label, fn))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self.saved):
            setattr(owner, name, fn)

    def table(self, wall: float) -> str:
        lines = [f"{'stage (inclusive wall time)':56s} {'thread':>18s} {'calls':>6s} {'seconds':>8s} {'of run':>7s}"]
        for _, _, label in self.stages:
            for (lab, thread), (calls, secs) in self.totals.items():
                if lab == label:
                    lines.append(f"{label:56s} {thread:>18s} {calls:6d} {secs:8.2f} {100 * secs / wall:6.1f}%")
        return "\n".join(lines)


def _one(mode: str, loaded, out: str, a, ranks, progress=False) -> dict:
    from osdn_diag.pipeline import capture_run, replay_run, stream_run

    # The benchmark's own scratch directories (``--dir`` may be reused from an earlier invocation).
    common = dict(num_prompts=a.prompts, length=a.T, batch_size=a.batch_size, seed=0, progress=progress,
                  overwrite=True)
    if mode == "stream":
        return stream_run(loaded, "random", out, **common)
    if mode == "stream-every-column":  # the baseline of series 31: every registered column written
        from osdn_diag.pipeline.writers import _ParquetEncoder

        expect = _ParquetEncoder.expect
        _ParquetEncoder.expect = lambda self, kinds: None
        try:
            return stream_run(loaded, "random", out, **common)
        finally:
            _ParquetEncoder.expect = expect
    capture_run(loaded, "random", out, **common)
    return replay_run(out, progress=progress)


def wall_command(a, out: str) -> list[str]:
    """The command line ``--wall`` times: what a user types for this benchmark's run (``osdn-diag`` as
    ``python -m osdn_diag``, with this interpreter)."""
    cmd = [sys.executable, "-m", "osdn_diag", "run", a.model, "--prompts", a.suite,
           "--num-prompts", str(a.prompts), "--length", str(a.T), "--batch-size", str(a.batch_size)]
    if a.mode == "stream":
        cmd.append("--stream")
    if a.device:
        cmd += ["--device", a.device]
    return cmd + ["--out", out]


def _gpu_name() -> str | None:
    """The GPU's name, asked after the timed runs (this process never touches the GPU before them)."""
    try:
        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except RuntimeError:
        return None


def host_speed() -> tuple[float, str | None]:
    """A yardstick for the host's CPU, which decides most of a warm run's wall clock (imports, the
    main thread's per-call work): the best of three timings of a fixed pure-Python loop (10^6 integer
    multiplications and additions; 0.06-0.09 s on the 2-core development CPU), and the CPU's model name
    where Linux gives it. Two machines' wall clocks compare only beside this."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        sum(i * i for i in range(1_000_000))
        times.append(time.perf_counter() - t0)
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return min(times), model


def wall_clock(a) -> dict:
    """``--wall N``: the command as typed, timed N times as a fresh process from start to exit; the
    first with an empty Triton cache of its own, the others warm."""
    from importlib.metadata import version

    if a.wall < 1:
        raise SystemExit(f"--wall: expected at least one run, got {a.wall}")
    if a.mode not in ("stream", "stored"):
        raise SystemExit(f"--wall times one command: --mode stream or --mode stored, not {a.mode!r}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise SystemExit("--wall starts its own processes: run it with python, not under torchrun")
    root = Path(a.dir or tempfile.mkdtemp(prefix="osdn_wall_"))
    root.mkdir(parents=True, exist_ok=True)
    caches = root / "caches"  # private and empty at the first run: "first run on a fresh machine"
    if caches.exists():
        shutil.rmtree(caches)
    env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"),
           "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}
    load_before = os.getloadavg()
    loop_s, cpu_model = host_speed()
    print(f"{a.model}, {a.prompts} prompts x {a.T} tokens, batch {a.batch_size}, {a.mode}: the command as "
          f"typed, {a.wall} run(s), the first with an empty TRITON_CACHE_DIR ({caches / 'triton'}); "
          f"load average {load_before[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    print("  " + " ".join(wall_command(a, "DIR")), flush=True)
    print(f"host: {cpu_model or platform.machine()}; the Python yardstick loop took {loop_s * 1e3:.0f} ms",
          flush=True)
    seconds, summary = [], None
    for i in range(a.wall):
        out = root / f"wall-{i}"
        if out.exists():  # --dir reused from an earlier invocation: every run gets a fresh --out
            shutil.rmtree(out)
        log = root / f"wall-{i}.log"
        with open(log, "w") as f:
            t0 = time.perf_counter()
            done = subprocess.run(wall_command(a, str(out)), env=env, stdout=f, stderr=subprocess.STDOUT)
            elapsed = time.perf_counter() - t0
        if done.returncode != 0:
            tail = log.read_text()[-3000:]
            raise SystemExit(f"run {i + 1} exited with status {done.returncode} after {elapsed:.1f} s; "
                             f"its output ({log}) ends:\n{tail}")
        seconds.append(elapsed)
        summary = json.loads((out / "summary.json").read_text())
        kind = "first, empty Triton cache" if i == 0 else "warm"
        print(f"run {i + 1}/{a.wall} ({kind}): {elapsed:8.2f} s  n = {summary['n']:,}  q_geo "
              f"{summary['q_geo']:.4f}", flush=True)
    warm = seconds[1:]
    result = dict(
        mode="wall", model=a.model, suite=a.suite, prompts=a.prompts, T=a.T, batch_size=a.batch_size,
        stream=a.mode == "stream", device=a.device, command=wall_command(a, "DIR"), runs=a.wall,
        first_s=seconds[0], warm_s=warm, warm_median_s=statistics.median(warm) if warm else None,
        n=summary["n"], q_geo=summary["q_geo"], gpu=_gpu_name(), host=platform.machine(),
        cpus=os.cpu_count(), cpu_model=cpu_model, python_loop_s=loop_s, load_before=list(load_before), load_after=list(os.getloadavg()),
        torch=version("torch"), run_dir=str(root) if a.dir else None,
    )
    median = f"{result['warm_median_s']:.2f} s" if warm else "-"
    print(f"\nfirst run {seconds[0]:.2f} s; warm median {median} over {len(warm)} run(s); "
          f"on {result['gpu'] or result['host']}")
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    write_json(a.json, result)
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random:deltanet-340m")
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--mode", help="comma-separated: stream, stored, stream-every-column (the stream run writing "
                   "every registered column of the per-token table, as before series 31; default: stream, "
                   "stored; with --wall: stream)")
    p.add_argument("--wall", type=int, metavar="N",
                   help="time the command as typed, as a fresh process, N times (the first with an empty "
                   "Triton cache, the others warm) instead of the pipeline in this process")
    p.add_argument("--suite", default="random", help="with --wall: the command's --prompts (random)")
    p.add_argument("--device", help="with --wall: the command's --device (default: the command's own)")
    p.add_argument("--dir", help="where run directories go (default: a temporary directory)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--stages", action="store_true", help="also an untimed stream run timed stage by stage")
    p.add_argument("--device-map", help="spread the model over this machine's GPUs: auto, balanced, sequential")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.wall is not None:
        a.mode = a.mode or "stream"
        return wall_clock(a)
    if a.suite != "random" or a.device:
        p.error("--suite and --device go with --wall")
    a.mode = a.mode or "stream,stored"
    unknown = sorted(set(a.mode.split(",")) - {"stream", "stored", "stream-every-column"})
    if unknown:
        p.error(f"--mode: unknown {', '.join(unknown)} (stream, stored, stream-every-column)")

    from osdn_diag import runtime
    from osdn_diag.distributed import init_from_env
    from osdn_diag.models import load_model

    ranks = init_from_env()
    dev = runtime.prepare(ranks.device())
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    loaded = load_model(a.model, device=dev, dtype=dtype, seed=0, device_map=a.device_map)
    load_s = time.perf_counter() - t0
    placement = getattr(loaded.model, "hf_device_map", None)
    if placement and ranks.is_main:
        print(f"device map ({a.device_map}): " + ", ".join(f"{m} -> {d}" for m, d in placement.items()))
    root = a.dir or tempfile.mkdtemp(prefix="osdn_e2e_")
    # The same directory name on every rank: rank 0 broadcasts its choice.
    root = ranks.gather(root)[0]

    warm = argparse.Namespace(**{**vars(a), "prompts": a.batch_size * ranks.world})
    t0 = time.perf_counter()
    _one("stream", loaded, f"{root}/warmup", warm, ranks)
    warm_s = time.perf_counter() - t0

    rows = []
    for mode in a.mode.split(","):
        ranks.barrier()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        summary = _one(mode, loaded, f"{root}/{mode}", a, ranks)
        ranks.barrier()
        elapsed = time.perf_counter() - t0
        if ranks.is_main:
            row = dict(mode=mode, seconds=elapsed, n=summary["n"], per_s=summary["n"] / elapsed,
                       q_geo=summary["q_geo"], fidelity=summary["fidelity"]["max_rel_error"],
                       peak_rss_gib=_peak_rss_gib())
            rows.append(row)
            print(f"{mode:7s} {elapsed:8.2f} s  {row['per_s'] / 1e6:7.2f} M/s  n = {row['n']:,}  "
                  f"q_geo {row['q_geo']:.4f}  fidelity {fidelity_text(row['fidelity'], '.1e')}  peak RSS {row['peak_rss_gib']:.2f} GiB",
                  flush=True)
    if a.profile:  # a separate, untimed pass: cProfile slows the Python side down
        prof = cProfile.Profile() if ranks.is_main else None
        if prof:
            prof.enable()
        _one("stream", loaded, f"{root}/profiled", a, ranks)
        if prof:
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
            print(f"cProfile of a stream run (rank 0):\n{buf.getvalue()}")
    stages = None
    if a.stages:  # untimed: the timers' own cost is small, but the run is not the one in the table
        if dev.type == "cuda":
            torch.cuda.synchronize()
        with _StageTimers() as timers:
            t0 = time.perf_counter()
            _one("stream", loaded, f"{root}/staged", a, ranks)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        if ranks.is_main:
            print(f"stream run, stage by stage ({wall:.2f} s; rank 0):\n{timers.table(wall)}")
            stages = dict(seconds=wall, stages=[dict(stage=k[0], thread=k[1], calls=v[0], seconds=v[1])
                                                for k, v in timers.totals.items()])
    ranks.barrier()
    if a.dir is None and ranks.is_main:
        shutil.rmtree(root, ignore_errors=True)  # a stored run at paper scale is tens of GB
    if not ranks.is_main:
        return {}
    result = dict(
        model=a.model, prompts=a.prompts, T=a.T, batch_size=a.batch_size, world=ranks.world,
        device_map=a.device_map, placement=placement, run_dir=root if a.dir else None,
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.machine(),
        torch=torch.__version__, load_s=load_s, warmup_s=warm_s, rows=rows, stages=stages,
    )
    spread = f", device map {a.device_map} over {len(set(placement.values()))} device(s)" if placement else ""
    print(f"\n{a.model}, {a.prompts} prompts x {a.T} tokens, batch {a.batch_size}, {ranks.world} process(es) "
          f"on {result['device']}{spread}; model load {load_s:.1f} s and warm-up {warm_s:.1f} s not timed")
    print(f"{'mode':8s} {'time':>9s} {'measurements/s':>15s} {'vs stored':>10s}")
    base = next((r["seconds"] for r in rows if r["mode"] == "stored"), None)
    every = [r["seconds"] for r in rows if r["mode"] == "stream-every-column"]
    for r in rows:
        ratio = f"{base / r['seconds']:.2f}x" if base else "-"
        print(f"{r['mode']:8s} {r['seconds']:8.2f}s {r['per_s'] / 1e6:13.2f} M {ratio:>10s}")
    if every:
        best = min(r["seconds"] for r in rows if r["mode"] == "stream")
        print(f"stream (the run's columns) against stream-every-column, best of each: {min(every) / best:.2f}x")
    write_json(a.json, result)
    return result


if __name__ == "__main__":
    from osdn_diag.distributed import shutdown

    try:
        main()
    finally:
        shutdown()
