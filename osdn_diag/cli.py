"""The ``osdn-diag`` command (also ``python -m osdn_diag``)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys

__all__ = ["main"]


def _cmd_prove(args: argparse.Namespace) -> int:
    from .proofs import ledger

    results = ledger.run_ledger(progress=not args.quiet)
    # a terminal gets a table that fits it; a file or a pipe the full widths (one line per cell row)
    width = None if args.wide or not sys.stdout.isatty() else shutil.get_terminal_size().columns
    print(ledger.format_table(results, width=width))
    if args.json:
        ledger.write_json(results, args.json)
        print(f"\nledger written to {args.json}")
    failed = [r for r in results if not r.as_expected]
    if failed:
        print(
            "\nunexpected outcome for: " + ", ".join(r.claim.id for r in failed),
            file=sys.stderr,
        )
        return 1
    return 0


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def _torch_dtype(name: str | None):
    import torch

    return None if name is None else getattr(torch, _DTYPES[name])


def _capture(args: argparse.Namespace):
    from .pipeline import capture_run

    return capture_run(
        args.model, args.prompts, args.out,
        device=args.device, dtype=_torch_dtype(args.dtype), kernels=args.kernels,
        batch_size=args.batch_size, twice=args.twice, num_prompts=args.num_prompts,
        length=args.length, seed=args.seed, progress=not args.quiet, device_map=args.device_map,
        overwrite=args.overwrite, then=("replay", "report") if args.command == "run" else (),
        generate=args.generate,
    )


def _replay(args: argparse.Namespace, run_dir) -> dict:
    import torch

    from .pipeline import replay_run

    return replay_run(
        run_dir, backend=args.backend, dtype=torch.float64 if args.fp64 else torch.float32,
        device=args.device, tolerance=args.tolerance, progress=not args.quiet, retained=args.retained,
        zero_residual=args.zero_residual,
    )


def _stream(args: argparse.Namespace) -> dict:
    import torch

    from .pipeline import stream_run

    return stream_run(
        args.model, args.prompts, args.out,
        device=args.device, dtype=_torch_dtype(args.dtype), kernels=args.kernels,
        batch_size=args.batch_size, twice=args.twice, num_prompts=args.num_prompts,
        length=args.length, seed=args.seed, progress=not args.quiet, device_map=args.device_map,
        backend=args.backend, replay_dtype=torch.float64 if args.fp64 else torch.float32,
        tolerance=args.tolerance, retained=args.retained, overwrite=args.overwrite, then=("report",),
        zero_residual=args.zero_residual, generate=args.generate,
    )


def _g(x, width: int = 0) -> str:
    """A summary number, or "–" where there is none (``null`` in summary.json: nothing measured)."""
    return f"{'–':>{width}s}" if x is None or x != x else f"{x:{width}.4f}"


def _print_summary(summary: dict, run_dir) -> None:
    print(f"\n{run_dir}: q_geo = {_g(summary['q_geo'])}, q_arith = {_g(summary['q_arith'])}, "
          f"n = {summary['n']:,} token-layer-head measurements")
    print(f"{'layer':>6s} {'q_geo':>8s} {'q_arith':>8s} {'n':>10s}")
    for layer, s in summary["by_layer"].items():
        print(f"{layer:>6s} {_g(s['q_geo'], 8)} {_g(s['q_arith'], 8)} {s['n']:10,d}")
    if summary.get("counterfactual"):
        print("fidelity: not applicable (counterfactual writes)")
    elif summary["fidelity"].get("max_rel_error") is None:
        print("fidelity: not measured (reference kernels: the package's own recurrence stood in for the "
              "model's kernels, so there is no kernel output to check the replay against)")
    else:
        print(f"fidelity (replay vs kernel output, max relative error): "
              f"{summary['fidelity']['max_rel_error']:.2e}")
        state = summary["fidelity"].get("state")
        if state:
            print(f"fidelity (replay vs the kernel's fp32 final state, max relative error): "
                  f"{state['max_rel_error']:.2e} ({state['max_rounding_units']:.2g} units of the "
                  "kernel's working-precision rounding)")
    nf = summary.get("nonfinite") or {}
    if nf.get("streams"):
        print(f"excluded: {nf['streams']:,} of {nf['of_streams']:,} (prompt, layer, head) streams "
              f"({nf['tokens']:,} tokens) whose kernel inputs held NaN/Inf; the numbers above leave them out")
    for task, r in summary.get("recall", {}).items():
        if r.get("excluded_nonfinite"):
            print(f"recall ({task}): {r['excluded_nonfinite']:,} of {r['queries'] + r['excluded_nonfinite']:,} "
                  "queries excluded (NaN/Inf logits)")


def _cmd_capture(args: argparse.Namespace) -> int:
    from .distributed import init_from_env

    from .rundir import output_lock

    ranks = init_from_env()
    with output_lock(args.out):
        out = _capture(args)
    if ranks.is_main:
        print(f"capture written to {out}")
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from .distributed import init_from_env

    from .rundir import output_lock

    ranks = init_from_env()
    with output_lock(args.dir):
        summary = _replay(args, args.dir)
    if ranks.is_main:
        _print_summary(summary, args.dir)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .distributed import init_from_env
    from .report import write_report

    from .rundir import output_lock, run_manifest

    ranks = init_from_env()
    with output_lock(args.out):  # the whole command: capture, replay and report
        if args.stream:
            out = args.out
            summary = _stream(args)
        else:
            out = _capture(args)
            summary = _replay(args, out)
        if ranks.is_main:
            _print_summary(summary, out)
            if (run_manifest(out) or {}).get("merge_needed"):
                # Parts of the table are on other machines' disks: a report of this directory alone
                # would plot a part of the run.
                print(f"{out}: the other nodes' parts are under their own --out (no shared file system): "
                      f"assemble the run with `osdn-diag merge {out} NODE_DIR... --out MERGED`, which "
                      "also writes its report")
            else:
                print(f"report: {write_report([out])}")
    return 0


def _cmd_what_if(args: argparse.Namespace) -> int:
    import torch

    from .report import write_report
    from .replay import load_run
    from .rundir import output_lock
    from .whatif import WhatIf, what_if_out, what_if_run

    settings = WhatIf(eta=args.eta, d_min=args.d_min, d_max=args.d_max, retention=args.retention,
                      beta_aware=args.beta_aware)
    out = what_if_out(args.dir, settings, args.out)
    with output_lock(out):  # the whole command: replay and report
        what_if_run(
            args.dir, settings, out_dir=out, backend=args.backend,
            dtype=torch.float64 if args.fp64 else torch.float32, device=args.device, progress=not args.quiet,
            overwrite=args.overwrite, then=("report",), zero_residual=args.zero_residual,
        )
        _print_summary(load_run(out)[1], out)
        print("counterfactual: the replayed states follow OSDN's writes, not the model's own")
        report = write_report([args.dir, out], out, ["as captured", "with OSDN d (what-if)"], into_input=True)
    print(f"report: {report}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    import time

    from .demo import format_rows, run_demo

    start = time.perf_counter()
    report, rows = run_demo(args.out, num_prompts=args.num_prompts, models=args.models, lm=args.lm,
                            length=args.length, device=args.device, seed=args.seed, progress=not args.quiet,
                            overwrite=args.overwrite)
    print(f"\n{format_rows(rows)}")
    scored = ("ppl: held-out perplexity (twice: on the repeated window)" if args.lm
              else "acc: recall accuracy")
    print(f"\nq: residual ratio per write (lower = stronger contraction); {scored}. "
          f"{time.perf_counter() - start:.0f} s.")
    print(f"report: {report}")
    return 0


def _cmd_warmup(args: argparse.Namespace) -> int:
    """One batch of the random suite at the given shape, through the whole diagnostic, into a
    temporary directory that is removed: fla's kernels and the package's own compile and autotune
    as a first run's would, and stay in Triton's cache for the runs that follow."""
    import shutil
    import tempfile
    import time
    from pathlib import Path

    from .pipeline import stream_run, triton_cache_dir

    if _on_cpu(args.device):
        if args.save_tuning is not None:
            raise ValueError("warmup --save-tuning: nothing is autotuned on the CPU (fla's kernels run "
                             "under Triton's interpreter there); run it on the GPU the table is for")
        print("osdn-diag warmup: nothing to compile on the CPU (fla's kernels run under Triton's "
              "interpreter there): runs start without it")
        return 0
    if args.save_tuning is not None:
        import torch

        from ._tuning import check_table_file

        # Before the minutes of work: a FILE to add to must be a table of this GPU, Triton and fla.
        check_table_file(args.save_tuning, torch.cuda.get_device_name(args.device))
    scratch = Path(tempfile.mkdtemp(prefix="osdn-warmup-"))
    t0 = time.perf_counter()
    try:
        stream_run(args.model, "random", scratch / "run", device=args.device, dtype=_torch_dtype(args.dtype),
                   kernels=args.kernels, batch_size=args.batch_size, num_prompts=args.batch_size,
                   length=args.length, seed=args.seed, progress=not args.quiet)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{args.model}: its kernels for batches of {args.batch_size} x {args.length} tokens compiled and "
          f"autotuned in {time.perf_counter() - t0:.1f} s, kept in {triton_cache_dir()}: runs of this "
          "model at that shape on this machine start warm")
    if args.save_tuning is not None:
        from ._tuning import ENV, save_choices

        n = save_choices(args.save_tuning)
        print(f"{args.save_tuning}: {n} autotuning choices of this GPU (added to those it held); "
              f"{ENV}={args.save_tuning} makes runs on machines with this GPU, Triton and fla use them "
              "instead of autotuning")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import write_report

    from ._cli_checks import parse_d_head

    d_head = parse_d_head(args.d_head) if args.d_head else None
    print(f"report: {write_report(args.runs, args.out, args.labels, d_head)}")
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from .merge import merge_runs

    out = merge_runs(args.dirs, args.out, overwrite=args.overwrite)
    print(f"merged run written to {out}")
    return 0


def _add_capture_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="a local Hugging Face directory of an fla, OSDN or transformers model, a Hub "
                   "id ORG/NAME[@REVISION] (safetensors only, never its code), builtin:NAME (a trained "
                   "model shipped with the package) or random:PRESET")
    p.add_argument("--prompts", required=True, metavar="P",
                   help="a built-in suite (random, mqar, mqar-pair, lm-heldout, lm-heldout-pair) or a "
                   "JSONL file of {input_ids|text, task} rows")
    p.add_argument("--out", required=True, metavar="DIR", help="the run directory to write")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run DIR already holds (its files are removed once MODEL and the "
                   "prompts have loaded); without it such a DIR is refused")
    p.add_argument("--twice", action="store_true", help="repeat each context before its query (JRT)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts of a built-in suite (8)")
    p.add_argument("--length", type=int, default=512, help="tokens per prompt of a built-in suite (512)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts per forward pass (1)")
    p.add_argument("--generate", type=int, default=0, metavar="N",
                   help="greedily generate N tokens after each prompt and capture the prompt and its "
                   "decoding as one stream (one prompt at a time; 0: no generation)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="model dtype (bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--kernels", choices=("auto", "fla", "reference"), default="auto",
                   help="what runs the delta rule during capture: fla's kernel, the reference "
                   "recurrence, or auto (fla on CUDA, reference on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed for random models and suites (0)")
    p.add_argument("--device-map", choices=("auto", "balanced", "sequential"),
                   help="spread a model too large for one GPU over the machine's GPUs, whole blocks "
                   "per GPU (needs accelerate; one process); replay then runs on --device")


def _add_replay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("auto", "torch", "triton", "fused"), default="auto",
                   help="replay engine (auto: triton on CUDA, torch otherwise; triton: the chunked replay "
                        "where it applies, the fused one elsewhere; fused: the fused one only)")
    p.add_argument("--fp64", action="store_true", help="replay in fp64 instead of fp32")
    p.add_argument("--tolerance", type=float,
                   help="largest accepted replay-vs-kernel output error (default by dtype)")
    p.add_argument("--retained", action="store_true",
                   help="also measure retained associations: how well the state at the end of the "
                   "first copy and at the last token still retrieves every earlier write")
    _add_zero_residual(p)


def _add_zero_residual(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zero-residual", choices=("drop", "continuous"), default="drop",
                   help="tokens whose residual is zero (ratio 0/0): drop — q = 1 (the paper's convention) "
                   "and left out of Theorem D.7's check (default); continuous — q = (1 - a)^2, the "
                   "ratio's continuous extension, kept in the check")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda if available)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (exit status 2, as argparse's) and ``--debug`` on every
    command."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                          help="on an error, show the traceback instead of one line")

    def error(self, message: str):
        self.exit(2, f"osdn-diag: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    """This package's version and the versions of what it hooks, read from the installed metadata
    (importing torch or fla for their version would cost seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    parts = []
    for dist in ("flash-linear-attention", "torch", "triton", "transformers"):
        try:
            parts.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            parts.append(f"{dist} not installed")
    return f"osdn-diag {__version__} ({', '.join(parts)})"


class _VersionAction(argparse.Action):
    """``--version``: one unwrapped line (argparse's own action wraps it to the terminal's width)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(_version())
        parser.exit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="osdn-diag",
        description="Residual-contraction diagnostics for delta-rule linear attention.",
    )
    parser.add_argument("--version", action=_VersionAction, help="print the versions and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    prove = sub.add_parser(
        "prove",
        help="run the symbolic proofs and print the claims ledger",
        description="Run every sympy derivation in proofs/ and print the claims ledger. Exits "
        "non-zero if any claim's outcome differs from the one recorded in the ledger.",
    )
    prove.add_argument("--json", metavar="FILE", help="also write the ledger as JSON to FILE")
    prove.add_argument("-q", "--quiet", action="store_true", help="no per-claim progress lines")
    prove.add_argument("--wide", action="store_true",
                       help="the table at its full width (148 columns) even on a narrower terminal")
    prove.set_defaults(func=_cmd_prove)

    run = sub.add_parser("run", help="capture, replay and report, in one go",
                         description="Hook MODEL's delta-rule kernels on every prompt, replay every "
                         "write in fp32, and write residuals.parquet, comparator.parquet, "
                         "summary.json and report.md (with plots/) to DIR.")
    _add_capture_args(run)
    _add_replay_args(run)
    run.add_argument("--stream", action="store_true",
                     help="replay each call as soon as it is captured and store no capture/: the same "
                     "results, faster, with host memory bounded and nothing but results on disk; "
                     "`replay` and `what-if` then cannot run on DIR")
    _add_common(run)
    run.set_defaults(func=_cmd_run)

    cap = sub.add_parser("capture", help="capture what the kernels receive, to DIR/capture",
                         description="Hook MODEL's delta-rule kernels on every prompt and store what "
                         "each kernel received (safetensors shards + manifest.json) in DIR.")
    _add_capture_args(cap)
    _add_common(cap)
    cap.set_defaults(func=_cmd_capture)

    rep = sub.add_parser("replay", help="replay a capture directory",
                         description="Replay every captured write of DIR in fp32 and write "
                         "residuals.parquet and summary.json there.")
    rep.add_argument("dir", metavar="DIR", help="a capture directory")
    _add_replay_args(rep)
    _add_common(rep)
    rep.set_defaults(func=_cmd_replay)

    wi = sub.add_parser("what-if", help="replay a capture with OSDN's preconditioner (counterfactual)",
                        description="Run OSDN's phase 1 over DIR's captured keys and gates and replay "
                        "the writes with k̃ = d ⊙ k: the write ratios this model would have under OSDN, "
                        "without retraining. The replayed states differ from the model's own.")
    wi.add_argument("dir", metavar="DIR", help="a capture directory")
    wi.add_argument("--eta", type=float, default=0.003, help="online step size η (0.003)")
    wi.add_argument("--d-min", type=float, default=0.5, help="lower edge of the box (0.5)")
    wi.add_argument("--d-max", type=float, default=2.0, help="upper edge of the box (2.0)")
    wi.add_argument("--retention", type=float, default=1.0,
                    help="constant preconditioner retention r in [0, 1] (1: plain OSDN)")
    wi.add_argument("--beta-aware", action=argparse.BooleanOptionalAction, default=True,
                    help="β' = β (beta-aware, default) or β' = 1 (the paper's 1.3B form)")
    wi.add_argument("--out", metavar="OUT", help="where to write (default: DIR/what-if_...); not DIR itself")
    wi.add_argument("--overwrite", action="store_true", help="replace the what-if run OUT already holds")
    wi.add_argument("--backend", choices=("auto", "torch", "triton", "fused"), default="auto")
    wi.add_argument("--fp64", action="store_true", help="replay in fp64")
    _add_zero_residual(wi)
    _add_common(wi)
    wi.set_defaults(func=_cmd_what_if)

    demo = sub.add_parser("demo", help="the diagnostic on the built-in trained models, offline",
                          description="Capture and replay the built-in MQAR-trained DeltaNet, OSDN and "
                          "OSDN-APF models on MQAR and MQAR-twice prompts and write one report "
                          "comparing them (contraction table, recall accuracy, contraction curve); with "
                          "--lm, the built-in language models on held-out text, single and repeated "
                          "(contraction table, held-out perplexity, contraction curve). "
                          "Runs on the CPU when there is no GPU.")
    demo.add_argument("--lm", action="store_true",
                      help="the built-in language models (lm-deltanet, lm-osdn, lm-osdn-apf) on held-out "
                      "text instead of the MQAR models")
    demo.add_argument("--out", default=None, metavar="DIR",
                      help="where to write (./osdn-demo, or ./osdn-demo-lm with --lm)")
    demo.add_argument("--num-prompts", type=int, default=None,
                      help="MQAR contexts (16), or with --lm held-out windows (4), per model, each asked "
                      "single and twice")
    demo.add_argument("--length", type=int, default=None,
                      help="with --lm: tokens per held-out window (256)")
    demo.add_argument("--models", nargs="+", metavar="NAME",
                      help="built-in model names (default: mqar-deltanet mqar-osdn mqar-osdn-apf)")
    demo.add_argument("--seed", type=int, default=0, help="seed of the prompt suite (0)")
    demo.add_argument("--overwrite", action="store_true",
                      help="replace the demo output DIR already holds (only the files osdn-diag wrote); "
                      "without it such a DIR is refused")
    _add_common(demo)
    demo.set_defaults(func=_cmd_demo)

    warm = sub.add_parser("warmup", help="compile and autotune a model's GPU kernels ahead of its runs",
                          description="Run one batch of random prompts of the given shape through the "
                          "whole diagnostic, writing nothing but Triton's cache: fla's kernels (and the "
                          "package's) compile and autotune once, and later runs of MODEL at that shape "
                          "on this machine start warm. Nothing to do on the CPU.")
    warm.add_argument("model", metavar="MODEL", help="as for run: a directory, Hub id, builtin:NAME or "
                      "random:PRESET")
    warm.add_argument("--length", type=int, default=512, help="tokens per prompt, as the runs will use (512)")
    warm.add_argument("--batch-size", type=int, default=1, help="prompts per forward pass, as the runs "
                      "will use (1)")
    warm.add_argument("--dtype", choices=sorted(_DTYPES), help="model dtype (bf16 on CUDA)")
    warm.add_argument("--kernels", choices=("auto", "fla", "reference"), default="auto",
                      help="as for run (auto: fla's kernels on CUDA)")
    warm.add_argument("--seed", type=int, default=0, help="seed of a random model (0)")
    warm.add_argument("--save-tuning", metavar="FILE",
                      help="also write the autotuning choices of fla's kernels made here as a table "
                      "(JSON) that OSDN_DIAG_TUNING=FILE reuses on machines with the same GPU, Triton "
                      "and fla (docs/performance.md)")
    _add_common(warm)
    warm.set_defaults(func=_cmd_warmup)

    report = sub.add_parser("report", help="write report.md and plots for one or more runs",
                            description="Write report.md and plots/*.png: into RUN for one run, or "
                            "into --out comparing several runs side by side.")
    report.add_argument("runs", nargs="+", metavar="RUN", help="run directories (with summary.json)")
    report.add_argument("--out", metavar="DIR", help="where to write (required for several runs)")
    report.add_argument("--labels", nargs="+", metavar="LABEL", help="one label per run")
    report.add_argument("--d-head", metavar="LAYER.HEAD",
                        help="the head whose preconditioner trajectory is plotted (default: the first "
                        "layer with a d, head 0)")
    report.set_defaults(func=_cmd_report)

    merge = sub.add_parser("merge", help="one run directory from the nodes' directories of a multi-node run",
                           description="Assemble the parts a run under torchrun --nnodes N left under "
                           "each node's own --out (no shared file system) into one run directory, "
                           "checking every rank's parts by run id and sha256, and write its report.")
    merge.add_argument("dirs", nargs="+", metavar="DIR", help="every node's --out directory (rank 0's among them)")
    merge.add_argument("--out", required=True, metavar="OUT", help="the merged run directory to write")
    merge.add_argument("--overwrite", action="store_true", help="replace the run OUT already holds")
    merge.set_defaults(func=_cmd_merge)
    return parser


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


def _on_cpu(device: str | None) -> bool:
    """Whether a model command with ``--device`` ``device`` runs on the CPU (no ``--device``: the
    GPU if torch sees one)."""
    import torch

    return str(device).startswith("cpu") if device else not torch.cuda.is_available()


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
    (:func:`osdn_diag._cli_checks.check_args`) before fla is imported or anything is written.
    ``report_workers``: start the processes that draw the report's figures, as the console script
    does (:func:`entry`); off by default, since a process started from a script re-imports the
    script's main module, which then has to guard its own code."""
    from ._cli_checks import check_args

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
    import os

    if command not in _REPORT_COMMANDS or os.environ.get("RANK", "0") != "0":
        return contextlib.nullcontext()
    from .report.render import figure_workers

    return figure_workers()


def _run_command(args: argparse.Namespace) -> int:
    try:
        if args.command in _MODEL_COMMANDS:  # the others never import transformers (nor torch, for prove)
            from ._dist_cache import remember_distributions
            from ._fla_import import import_lazily

            # transformers < 5.24 reads every installed distribution's metadata as it is imported (1.0 s
            # on an H200 host); answered from a cache of it, kept current by what is installed.
            remember_distributions()
            import_lazily()  # only the fla modules the model uses (OSDN_DIAG_FLA_IMPORT=full: all of fla)
            _quiet_libraries()
            if _cpu_threads(getattr(args, "device", None)) is False:
                from ._autotune import compile_configs_in_parallel
                from ._tuning import use_recorded_choices

                # On a GPU (triton may be imported now): fla's first-run autotuning answered from the
                # shipped table of this GPU where it can be, the rest compiled in parallel.
                use_recorded_choices()
                compile_configs_in_parallel()
        return args.func(args)
    finally:
        if args.command in _MODEL_COMMANDS:
            from ._dist_cache import forget_distributions
            from ._fla_import import restore_torch_compile

            restore_torch_compile()
            forget_distributions()
        if "torch.distributed" in sys.modules:  # else no process group can have been joined
            from .distributed import shutdown

            shutdown()


def _user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that describe the user's input (a file, a layer, an argument, the machine)
    rather than a fault of this package: printed as one line. Only classes of modules already
    imported: an error cannot be an instance of a class never loaded, and importing their modules
    (torch) would add seconds to an error found before the command imported anything heavy."""
    classes = [ValueError, OSError]
    for module, name in (("safetensors", "SafetensorError"), ("osdn_diag._interpret", "InterpreterUnavailable"),
                         ("osdn_diag.rundir", "IncompleteRunError"),
                         ("osdn_diag.replay.call", "FidelityError")):
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None:
            classes.append(cls)
    return tuple(classes)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a batch system preempting or cancelling a job), raised where Ctrl-C would be:
    a subclass of KeyboardInterrupt, so that every clean-up that runs on Ctrl-C runs on it too (a
    temporary removed, a replay's stages put back, the lock released) and the files stay consistent."""


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM raises :class:`Terminated` in the main thread while the block runs (the previous
    handler is restored after it); elsewhere, where Python cannot handle signals, nothing changes."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _ReaderMayLeave:
    """Standard output whose reader may go away (``osdn-diag run … | head``): the first write to a
    closed pipe sends the rest of the output to /dev/null, and the command goes on to its end (its
    files complete, its exit status its own), where a plain stream would raise BrokenPipeError in
    whatever line was printing, ending a finished run in an error."""

    def __init__(self, stream):
        self._stream = stream

    def _gone(self) -> None:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # no file descriptor (a StringIO): drop the output
            import io

            self._stream = io.StringIO()

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _reader_may_leave():
    """:class:`_ReaderMayLeave` as ``sys.stdout`` while the block runs."""
    previous = sys.stdout
    sys.stdout = _ReaderMayLeave(previous)
    try:
        yield
    finally:
        try:
            sys.stdout.flush()
        except OSError:
            # Not a reader that left (the wrapper takes those) but a full disk, say: the text stays
            # buffered and the final flush reports it as a normal exit does (status 120), not as an
            # error of the command's own.
            pass
        finally:
            sys.stdout = previous


def entry(argv: list[str] | None = None) -> int:
    """The console script: like :func:`main`, but an error about the user's input (a file, a layer,
    an argument) is printed as one line and exits with status 2, Ctrl-C exits with status 130 and
    SIGTERM with 143 (128 + the signal's number, as a shell reports it), each after one line;
    ``--debug`` (or ``OSDN_DIAG_DEBUG=1``) shows the traceback instead."""
    import os

    from ._bytecode import keep_bytecode

    keep_bytecode()  # a process of its own: PYTHONDONTWRITEBYTECODE no longer recompiles torch each time
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get("OSDN_DIAG_DEBUG") == "1"
    try:
        with _sigterm_as_interrupt(), _reader_may_leave():
            return main(argv, report_workers=True)
    except SystemExit as done:  # argparse: --help, or a usage error it has printed on one line
        if isinstance(done.code, int) or done.code is None:
            return done.code or 0
        # A message (sys.exit("...")): the user's error, on one line like the others.
        print(f"osdn-diag: error: {' '.join(str(done.code).split())}", file=sys.stderr)
        return 2
    except Terminated:
        if debug:
            raise
        print("osdn-diag: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        if debug:
            raise
        print("osdn-diag: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        user_error = _as_user_error(err)
        if user_error is None or debug:
            raise
        print(f"osdn-diag: error: {' '.join(str(user_error).split())} (--debug shows the traceback)",
              file=sys.stderr)
        return 2


def _as_user_error(err: Exception) -> Exception | None:
    """``err`` if it describes the user's input (:func:`_user_errors`); a full disk, quota or read-only
    file system anywhere in its chain (a writer's RuntimeError around it, say) as a
    :class:`~osdn_diag._storage.StorageError`; else ``None``: a fault of this package, shown as a
    traceback."""
    from ._storage import StorageError, storage_error

    cause = storage_error(err)
    if cause is not None and not isinstance(err, StorageError):
        return StorageError(cause.errno, cause.strerror or os.strerror(cause.errno),
                            cause.filename or "the output directory")
    return err if isinstance(err, _user_errors()) else None


def console() -> None:
    """The ``osdn-diag`` console script and ``python -m osdn_diag``: :func:`entry`, then the process
    ends without tearing the interpreter down. Exit handlers run and the output streams are flushed
    as at a normal exit, but freeing every module and object of torch, transformers and fla one by
    one, which only the exit itself would wait for, is left to the operating system: 1.5 s of a small
    CPU run (docs/performance.md). ``OSDN_DIAG_FAST_EXIT=0`` exits the usual way; so does a process
    that still has a non-daemon thread running, which a normal exit waits for."""
    import os

    code = entry()
    import atexit
    import threading

    waiting = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive() and not t.daemon]
    if os.environ.get("OSDN_DIAG_FAST_EXIT", "1") == "0" or waiting:
        sys.exit(code)
    atexit._run_exitfuncs()  # logging, multiprocessing, weakref.finalize (temporary directories), ...
    code = 0 if code is None else code if isinstance(code, int) else 1  # as sys.exit(code) would
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # a closed reader or stream: nothing to deliver to
            pass
        except OSError as err:  # a full disk, say: as a normal exit does, say so and fail
            try:
                print(f"osdn-diag: error: writing the output failed: {err}", file=sys.stderr, flush=True)
            except (OSError, ValueError):
                pass
            code = code or 120
    try:  # what native libraries (CUDA, NCCL) have buffered in C's stdio
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    console()
