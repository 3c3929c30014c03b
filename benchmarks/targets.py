"""The performance targets, each beside its measured value: one table from the benchmarks' JSON files.

    python benchmarks/targets.py DIR [--json FILE]

``DIR`` holds what ``gpu_suite.sh`` writes (``OUT=DIR bash benchmarks/gpu_suite.sh`` ends by calling
this script): ``replay.json`` (K = V = 128), ``replay_k64.json``, ``replay_k256.json``, ``e2e.json``
(340M shape, 48 × 2,048 tokens), ``e2e_1b.json`` (1.3B shape), ``phase1.json``, ``comparator.json``
and ``memory.json`` (one 20,000-token prompt). A missing file is reported as not measured. Each row
gives the target, the measured value, the ratio it is judged by and whether it is met; ratios come
from numbers measured in the same run of one benchmark (ours and the baseline side by side).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _common import write_json

#: (file, what it measures) of every input, for the "not measured" rows.
FILES = {
    "replay": "replay.json",
    "replay_k64": "replay_k64.json",
    "replay_k256": "replay_k256.json",
    "e2e": "e2e.json",
    "e2e_1b": "e2e_1b.json",
    "phase1": "phase1.json",
    "comparator": "comparator.json",
    "memory": "memory.json",
}
OURS, FLA = "fused replay (ours, fp32)", "fla fused_recurrent_delta_rule (fp32)"
PHASE1, PHASE2 = "phase1 parallel fwd", "fla chunk_delta_rule fwd (phase 2)"


def _load(folder: Path, name: str) -> dict | None:
    path = folder / FILES[name]
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path}: not valid JSON ({e}); was the benchmark cut short?") from e


def _missing(label: str) -> dict:
    return {"target": label, "measured": None, "ratio": None, "met": None}


def _stream_row(result: dict, path: str) -> dict:
    rows = [r for r in result.get("rows", []) if r.get("mode") == "stream"]
    if not rows:
        raise SystemExit(f"{path}: no 'stream' row in 'rows' (expected bench_e2e.py --mode stream output)")
    return rows[0]


def _replay_row(result: dict | None, label: str, threshold: float | None) -> dict:
    if result is None:
        return _missing(label)
    ms = result["ms"]
    ratio = ms[FLA] / ms[OURS]
    err = max(result["errors_vs_fp64"].values())
    shape = result["shape"]
    return {
        "target": label,
        "measured": f"{ms[OURS]:.3f} ms vs fla {ms[FLA]:.3f} ms (K = V = {shape['K']}), error {err:.1e}",
        "ratio": f"{ratio:.2f}x",
        "met": None if threshold is None else bool(ratio >= threshold and err <= 1e-5),
    }


def rows(folder: Path) -> list[dict]:
    """The table's rows: ``target``, ``measured`` (None: not measured), ``ratio``, ``met`` (None: a
    figure to report, not a target)."""
    got = {name: _load(folder, name) for name in FILES}
    out = [
        _replay_row(got["replay"], "replay >= 1.0x fla fp32 fused_recurrent_delta_rule, <= 1e-5 vs fp64", 1.0),
        _replay_row(got["replay"], "replay stretch >= 3x fla", 3.0),
        _replay_row(got["replay_k64"], "replay at K = V = 64, reported", None),
        _replay_row(got["replay_k256"], "replay at K = V = 256, reported", None),
    ]
    for name, label, limit in (("e2e", "paper-scale diagnostic (340M, 48 x 2,048) <= 10 s", 10.0),
                               ("e2e_1b", "the same at the 1.3B shape, reported", None)):
        result = got[name]
        if result is None:
            out.append(_missing(label))
            continue
        row = _stream_row(result, FILES[name])
        out.append({
            "target": label,
            "measured": f"{row['seconds']:.2f} s, {row['n']:,} measurements ({result['model']}, "
                        f"{result['prompts']} x {result['T']})",
            "ratio": f"{row['seconds'] / limit:.2f} of the limit" if limit else "-",
            "met": bool(row["seconds"] <= limit) if limit else None,
        })
    result = got["phase1"]
    label = "phase 1 <= 25 % of phase 2 (B=8, T=4096, H=8, K=128), by GPU work"
    if result is None:
        out.append(_missing(label))
    else:
        split = result["device_and_host_ms"]
        gpu1, gpu2 = split[PHASE1][0], split[PHASE2][0]
        wall1, wall2 = result["ms"][PHASE1], result["ms"][PHASE2]
        out.append({
            "target": label,
            "measured": f"{gpu1:.3f} vs {gpu2:.3f} ms of GPU work; wall {wall1:.3f} vs {wall2:.3f} ms "
                        f"({100 * wall1 / wall2:.0f} %)",
            "ratio": f"{100 * gpu1 / gpu2:.1f} %",
            "met": bool(gpu1 <= 0.25 * gpu2),
        })
    result = got["comparator"]
    label = "comparator gap, 9,216 problems (T = 2048, K = 128) <= 10 s"
    if result is None:
        out.append(_missing(label))
    else:
        total, shape = result["seconds"]["total"], result["shape"]
        out.append({
            "target": label,
            "measured": f"{total:.2f} s for {shape['P']:,} problems (T = {shape['T']}, K = {shape['K']}), "
                        f"max gap {result['max_gap']:.1e}",
            "ratio": f"{total / 10:.2f} of the limit",
            "met": bool(total <= 10 and shape["P"] >= 9216),
        })
    result = got["memory"]
    label = "streaming capture of one 20,000-token prompt (340M) < 8 GiB host RAM"
    if result is None:
        out.append(_missing(label))
    else:
        row = _stream_row(result, FILES["memory"])
        out.append({
            "target": label,
            "measured": f"peak RSS {row['peak_rss_gib']:.2f} GiB, {result['prompts']} x {result['T']:,} tokens",
            "ratio": f"{row['peak_rss_gib'] / 8:.2f} of the limit",
            "met": bool(row["peak_rss_gib"] < 8 and result["T"] >= 20000),
        })
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="the benchmarks' JSON files (gpu_suite.sh's OUT)")
    p.add_argument("--json", help="write the table here")
    a = p.parse_args(argv)
    if not a.dir.is_dir():
        raise SystemExit(f"{a.dir}: not a directory")
    table = rows(a.dir)
    width = max(len(r["target"]) for r in table)
    print(f"{'target':{width}s}  {'met':5s}  {'ratio':>20s}  measured")
    for r in table:
        if r["measured"] is None:
            print(f"{r['target']:{width}s}  {'-':5s}  {'-':>20s}  not measured ({a.dir})")
            continue
        met = {True: "yes", False: "NO", None: "-"}[r["met"]]
        print(f"{r['target']:{width}s}  {met:5s}  {r['ratio']:>20s}  {r['measured']}")
    write_json(a.json, {"dir": str(a.dir), "rows": table})
    return table


if __name__ == "__main__":
    main()
