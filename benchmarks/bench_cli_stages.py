"""Where the wall clock of one command goes: the command line run in this process, as the console
script runs it (bytecode cache, lazy fla), with a timer around model loading, the stream run's stages
(those of ``bench_e2e.py --stages``) and the report; the imports before the command are timed too.

    python benchmarks/bench_cli_stages.py run random:deltanet-340m --prompts random --num-prompts 48 \\
        --length 2048 --batch-size 8 --stream --out /tmp/stages

Run it warm (a second time) to see a warm run's split; ``bench_e2e.py --wall`` times the whole
process from the shell.
"""

from __future__ import annotations

import sys
import time

T_START = time.perf_counter()

from osdn_diag.runtime.bytecode import keep_bytecode  # noqa: E402
from osdn_diag.runtime.fla_import import import_lazily  # noqa: E402


def main(argv: list[str]) -> None:
    print(f"bytecode cache: {keep_bytecode()}; fla loaded lazily: {import_lazily()}")
    import bench_e2e

    stages = ((("osdn_diag.models", "load_model", "model load"),
               ("osdn_diag.pipeline", "stream_run", "stream run (the stages below)"))
              + bench_e2e.STAGES + (("osdn_diag.report", "write_report", "report"),
                                    ("osdn_diag.report.markdown", "draw", "  its figures (on the workers, if any)")))
    with bench_e2e._StageTimers(stages) as timers:
        t_command = time.perf_counter()
        print(f"imports before the command: {t_command - T_START:.2f} s", flush=True)
        from osdn_diag.cli import main as cli_main

        cli_main(argv, report_workers=True)  # as the console script runs it
        t_end = time.perf_counter()
    print(f"the command: {t_end - t_command:.2f} s; the process so far: {t_end - T_START:.2f} s")
    print(timers.table(t_end - t_command))


if __name__ == "__main__":
    main(sys.argv[1:])
