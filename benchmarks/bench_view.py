"""The interactive view at the paper-scale run's size, on the CPU: a synthetic per-token table of
48 prompts × 2,048 tokens × 24 layers × 8 heads (18.9 M rows, the paper-scale run's count) in memory,
reduced (``view_data``) and rendered (``render``) with the default 4 token strips; prints the time of
each, the page's size and, where headless Chromium is installed, how long the page takes to open
and draw (``--virtual-time-budget`` lets it finish its scripts; the wall time of the process).

    python benchmarks/bench_view.py [--prompts 48 --length 2048 --layers 24 --heads 8]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "view"))

from _synthetic import synthetic_results  # noqa: E402  (the tests' generator: one definition)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=8)
    args = ap.parse_args()
    from osdn_diag.view.data import view_data
    from osdn_diag.view.page import render

    t0 = time.perf_counter()
    res = synthetic_results(args.prompts, args.length, args.layers, args.heads)
    t1, c1 = time.perf_counter(), time.process_time()
    runs = view_data(res)
    t2, c2 = time.perf_counter(), time.process_time()
    page = render(runs)
    t3, c3 = time.perf_counter(), time.process_time()
    # CPU seconds beside wall seconds: on a shared machine the wall time says more about the neighbours
    print(f"{res.table.num_rows:,} rows (made in {t1 - t0:.1f} s): view_data {t2 - t1:.2f} s ({c2 - c1:.2f} s "
          f"CPU), render {t3 - t2:.2f} s ({c3 - c2:.2f} s CPU), page {len(page.encode()) / 1e6:.2f} MB", flush=True)
    browser = shutil.which("chromium")
    if browser:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "view.html"
            path.write_text(page)
            import resource

            t4, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=30000",
                            f"--screenshot={Path(tmp) / 'v.png'}", "--window-size=1400,2600", path.as_uri()],
                           capture_output=True, timeout=600, check=True)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            print(f"chromium: opened, drawn and screenshot in {time.perf_counter() - t4:.1f} s ({cpu:.1f} s CPU, "
                  "every process of it)")


if __name__ == "__main__":
    main()
