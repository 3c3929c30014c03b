"""Running one parsed command: the checks made before anything heavy is imported, the libraries
made quiet and fast for model commands, the report's figure workers started beside the command, and
which exceptions are the user's input rather than this package's fault."""

from __future__ import annotations

import argparse
import contextlib
import sys

from .commands import _on_cpu
from .parser import build_parser


def _quiet_libraries() -> None:
    """The command line prints its own progress: transformers' weight-loading bars and its
    deprecation notices about fla's keyword names would only bury it."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers comes with fla
        return
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


#: The commands that run a model or a replay (the others read and write files only).
_MODEL_COMMANDS = ("capture", "replay", "run", "what-if", "demo", "warmup")


def _cpu_threads(device: str | None) -> bool:
    """On the CPU, one torch thread unless ``OMP_NUM_THREADS`` says otherwise: the work is many small
    operations (Triton's interpreter, per-token recurrences), where a second thread gains little on
    an idle machine and, beside one other busy process on two cores, made the demo 7× slower
    (docs/performance.md). torchrun sets ``OMP_NUM_THREADS`` itself. Returns whether the command
    runs on the CPU."""
    import os

    import torch

    on_cpu = _on_cpu(device)
    if on_cpu and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    return on_cpu


def main(argv: list[str] | None = None, *, report_workers: bool = False) -> int:
    """Run a command; errors propagate (for use from Python and tests). The arguments are checked
    (:func:`osdn_diag.cli.checks.check_args`) before fla is imported or anything is written.
    ``report_workers``: start the processes that draw the report's figures, as the console script
    does (:func:`entry`); off by default, since a process started from a script re-imports the
    script's main module, which then has to guard its own code."""
    from .checks import check_args

    args = build_parser().parse_args(argv)
    check_args(args)
    with _report_workers(args.command) if report_workers else contextlib.nullcontext():
        return _run_command(args)


#: The commands that end in a report, whose figures are drawn on worker processes started with them.
_REPORT_COMMANDS = ("run", "what-if", "demo", "report", "merge")


def _report_workers(command: str):
    """For a command that ends in a report, on the process that writes it (rank 0 under torchrun):
    the worker processes that will draw its figures, started now so that their imports overlap the
    command's own work (:func:`osdn_diag.report.render.figure_workers`)."""
    from ..runtime.launcher import launched_rank

    if command not in _REPORT_COMMANDS or launched_rank() != 0:
        return contextlib.nullcontext()
    from ..report.render import figure_workers

    return figure_workers()


def _run_command(args: argparse.Namespace) -> int:
    try:
        if args.command in _MODEL_COMMANDS:  # the others never import transformers (nor torch, for prove)
            from ..runtime.dist_cache import remember_distributions
            from ..runtime.fla_import import import_lazily

            # transformers < 5.24 reads every installed distribution's metadata as it is imported (1.0 s
            # on an H200 host); answered from a cache of it, kept current by what is installed.
            remember_distributions()
            import_lazily()  # only the fla modules the model uses (OSDN_DIAG_FLA_IMPORT=full: all of fla)
            _quiet_libraries()
            if _cpu_threads(getattr(args, "device", None)) is False:
                from ..runtime.autotune import compile_configs_in_parallel
                from ..runtime.tuning import use_recorded_choices

                # On a GPU (triton may be imported now): fla's first-run autotuning answered from the
                # shipped table of this GPU where it can be, the rest compiled in parallel.
                use_recorded_choices()
                compile_configs_in_parallel()
        return args.func(args)
    finally:
        if args.command in _MODEL_COMMANDS:
            from ..runtime.dist_cache import forget_distributions
            from ..runtime.fla_import import restore_torch_compile

            restore_torch_compile()
            forget_distributions()
        # Only osdn_diag.distributed joins a process group. Not imported here: a SIGTERM or Ctrl-C that
        # stopped `import torch` half way leaves a torch that cannot be imported again (an AttributeError
        # in place of the one line the signal deserves).
        joined = sys.modules.get("osdn_diag.distributed")
        if joined is not None:
            joined.shutdown()


def _user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that describe the user's input (a file, a layer, an argument, the machine)
    rather than a fault of this package: printed as one line. Only classes of modules already
    imported: an error cannot be an instance of a class never loaded, and importing their modules
    (torch) would add seconds to an error found before the command imported anything heavy."""
    classes = [ValueError, OSError]
    for module, name in (("safetensors", "SafetensorError"), ("osdn_diag.runtime.interpret", "InterpreterUnavailable"),
                         ("osdn_diag.rundir", "IncompleteRunError"),
                         ("osdn_diag.replay.call", "FidelityError"),
                         ("osdn_diag.view.figures", "ViewUnavailable")):
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None:
            classes.append(cls)
    return tuple(classes)
