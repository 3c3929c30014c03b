"""How long a refused command takes, as the user's stopwatch sees it: each case run as typed, as a
fresh process, start to exit.

    python benchmarks/bench_errors.py [--repeat 5] [--json FILE]

Cases: ``--help``; argument errors (a required argument missing, a value out of range, an unknown
preset or prompt suite); model directories refused for what their files say (no such directory, no
config.json, no weights, pickled weights, a size field that cannot build a model, a config asking for
its own code, damaged safetensors). The baseline, timed in the same loop, is the interpreter starting
and exiting (``python -c pass``): each case prints its median wall time and its ratio to that. Each
refused case must exit 2 with one line on stderr (checked, not timed). Targets (issue 48): argument
errors ≤ 0.5 s; a model refused from its files before any heavy import (``tests/test_cli_imports.py``
checks which modules load).

The command is the console script ``osdn-diag`` where it is on PATH, else ``python -m osdn_diag``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = '{"model_type": "gated_deltanet", "num_heads": 2, "hidden_size": 64}'


def _model(root: Path, name: str, files: dict[str, str]) -> str:
    d = root / name
    d.mkdir()
    for file, text in files.items():
        (d / file).write_text(text)
    return str(d)


def cases(root: Path) -> list[tuple[str, str, list[str], int]]:
    """``(group, name, argv, expected exit status)`` of every case, model directories made in ``root``."""
    out = str(root / "out")
    run = lambda model, *more: ["run", model, "--prompts", "random", "--out", out, *more]  # noqa: E731
    models = {
        "no such directory": str(root / "absent"),
        "no config.json": _model(root, "no-config", {"model.safetensors": ""}),
        "no weights": _model(root, "no-weights", {"config.json": CONFIG}),
        "pickled weights": _model(root, "pickles", {"config.json": CONFIG, "pytorch_model.bin": "x"}),
        "a size that builds no model": _model(root, "size", {
            "config.json": CONFIG.replace('"num_heads": 2', '"num_heads": 0'), "model.safetensors": ""}),
        "config asks for its own code": _model(root, "auto-map", {
            "config.json": CONFIG.replace("}", ', "auto_map": {"AutoModel": "x.Model"}}'), "model.safetensors": ""}),
        "damaged safetensors": _model(root, "damaged", {"config.json": CONFIG, "model.safetensors": "garbage"}),
    }
    held = root / "held"  # a finished run's directory (its manifest and a result file)
    held.mkdir()
    (held / "manifest.json").write_text('{"run_id": "r", "stages": {"capture": true}, "complete": true}')
    (held / "summary.json").write_text("{}")
    foreign = root / "foreign"  # a run's file names, no manifest
    foreign.mkdir()
    (foreign / "summary.json").write_text("{}")
    at = lambda directory, *more: ["run", "random:deltanet-tiny", "--prompts", "random", "--out", str(directory),  # noqa: E731
                                   *more]
    return [
        ("help", "--help", ["--help"], 0),
        ("argument", "run: required arguments missing", ["run"], 2),
        ("argument", "run: --batch-size 0", run("random:deltanet-tiny", "--batch-size", "0"), 2),
        ("argument", "run: unknown preset", run("random:nonexistent"), 2),
        ("argument", "run: no such prompt file", ["run", "random:deltanet-tiny", "--prompts", str(root / "p.jsonl"),
                                                  "--out", out], 2),
        ("argument", "report: no such run", ["report", str(root / "absent")], 2),
        ("argument", "run: --out holds a run", at(held), 2),
        ("argument", "run: --out a run's files, no manifest", at(foreign, "--overwrite"), 2),
        *[("model", name, run(model), 2) for name, model in models.items()],
    ]


def _command() -> list[str]:
    script = shutil.which("osdn-diag")
    return [script] if script else [sys.executable, "-m", "osdn_diag"]


def _time(argv: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    return time.perf_counter() - t, done


def _at_least_one(text: str) -> int:
    """``--repeat``: a whole number of at least 1 (0 timed nothing, and the check of the last run had none)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {text!r}")
    return value


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=_at_least_one, default=5, help="timings of each case (median reported; 5)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    command = _command()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        todo = [("baseline", "python -c pass", [sys.executable, "-c", "pass"], 0)]
        todo += [(g, n, command + args, rc) for g, n, args, rc in cases(root)]
        _time(command + ["--help"])  # bytecode written once, as after an install
        for group, name, args, want in todo:
            times = []
            for _ in range(a.repeat):
                seconds, done = _time(args)
                times.append(seconds)
            err = done.stderr.strip()
            if done.returncode != want or (want == 2 and (len(err.splitlines()) != 1
                                                          or not err.startswith("osdn-diag: error: "))):
                raise SystemExit(f"{name}: exit {done.returncode} (expected {want}), stderr: {err[-500:]}")
            rows.append({"group": group, "case": name, "median_s": statistics.median(times), "times_s": times})
    base = rows[0]["median_s"]
    print(f"{'case':38s} {'median':>8s} {'vs python -c pass':>18s}")
    for r in rows:
        r["vs_baseline"] = r["median_s"] / base
        print(f"{r['group'] + ': ' + r['case']:38.38s} {r['median_s']:7.3f}s {r['vs_baseline']:17.1f}×")
    worst = {g: max(r["median_s"] for r in rows if r["group"] == g) for g in ("argument", "model")}
    print(f"slowest argument error {worst['argument']:.3f} s (target ≤ 0.5 s); "
          f"slowest model error from files {worst['model']:.3f} s")
    result = {"command": command, "repeat": a.repeat, "rows": rows, "slowest": worst}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
