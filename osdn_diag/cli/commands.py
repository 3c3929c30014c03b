"""What each subcommand does, given its parsed arguments (:func:`osdn_diag.cli.parser.build_parser`
binds each to its subcommand): the heavy imports happen here, inside the command that needs them."""

from __future__ import annotations

import argparse
import shutil
import sys


def _cmd_prove(args: argparse.Namespace) -> int:
    from ..proofs import ledger

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
    from ..pipeline import capture_run

    return capture_run(
        args.model, args.prompts, args.out,
        device=args.device, dtype=_torch_dtype(args.dtype), kernels=args.kernels,
        batch_size=args.batch_size, twice=args.twice, num_prompts=args.num_prompts,
        length=args.length, seed=args.seed, progress=not args.quiet, device_map=args.device_map,
        overwrite=args.overwrite, then=("replay", "report") if args.command == "run" else (),
        generate=args.generate,
    )


def _replay_device(args: argparse.Namespace) -> None:
    """The Triton replays (``--backend triton|fused``) run on the CPU only under Triton's interpreter,
    which must be on before triton is imported: switched on here, first, as ``run`` does for its
    model (the replay commands read no model, so nothing else would)."""
    if getattr(args, "backend", "auto") not in ("triton", "fused"):
        return
    from ..runtime.device import check_device, default_device, prepare

    device = check_device(args.device, "--device") or default_device()
    if device.type == "cpu":
        prepare(device)


def _replay(args: argparse.Namespace, run_dir) -> dict:
    import torch

    from ..pipeline import replay_run

    _replay_device(args)

    return replay_run(
        run_dir, backend=args.backend, dtype=torch.float64 if args.fp64 else torch.float32,
        device=args.device, tolerance=args.tolerance, progress=not args.quiet, retained=args.retained,
        zero_residual=args.zero_residual,
    )


def _stream(args: argparse.Namespace) -> dict:
    import torch

    from ..pipeline import stream_run

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
    from ..distributed import init_from_env

    from ..rundir import output_lock

    ranks = init_from_env()
    with output_lock(args.out):
        out = _capture(args)
    if ranks.is_main:
        print(f"capture written to {out}")
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    _replay_device(args)
    from ..distributed import init_from_env

    from ..rundir import output_lock

    ranks = init_from_env()
    with output_lock(args.dir):
        summary = _replay(args, args.dir)
    if ranks.is_main:
        _print_summary(summary, args.dir)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from ..distributed import init_from_env
    from ..report import write_report

    from ..rundir import output_lock, run_manifest

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
    _replay_device(args)
    import torch

    from ..report import write_report
    from ..replay import load_run
    from ..rundir import output_lock, reading_lock
    from ..whatif import WhatIf, what_if_out, what_if_run

    settings = WhatIf(eta=args.eta, d_min=args.d_min, d_max=args.d_max, retention=args.retention,
                      beta_aware=args.beta_aware)
    out = what_if_out(args.dir, settings, args.out)
    with output_lock(out), reading_lock(args.dir):  # the whole command: replay and report, DIR only read
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

    from ..demo import format_rows, run_demo

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
    view = report.parent / "view.html"
    if view.is_file():
        print(f"view: {view}")
    return 0


def _cmd_warmup(args: argparse.Namespace) -> int:
    """One batch of the random suite at the given shape, through the whole diagnostic, into a
    temporary directory that is removed: fla's kernels and the package's own compile and autotune
    as a first run's would, and stay in Triton's cache for the runs that follow."""
    import shutil
    import tempfile
    import time
    from pathlib import Path

    from ..pipeline import stream_run, triton_cache_dir

    if _on_cpu(args.device):
        if args.save_tuning is not None:
            raise ValueError("warmup --save-tuning: nothing is autotuned on the CPU (fla's kernels run "
                             "under Triton's interpreter there); run it on the GPU the table is for")
        print("osdn-diag warmup: nothing to compile on the CPU (fla's kernels run under Triton's "
              "interpreter there): runs start without it")
        return 0
    if args.save_tuning is not None:
        import torch

        from ..runtime.tuning import check_table_file

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
        from ..runtime.tuning import ENV, save_choices

        n = save_choices(args.save_tuning)
        print(f"{args.save_tuning}: {n} autotuning choices of this GPU (added to those it held); "
              f"{ENV}={args.save_tuning} makes runs on machines with this GPU, Triton and fla use them "
              "instead of autotuning")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from ..report import write_report

    from .checks import parse_d_head

    d_head = parse_d_head(args.d_head) if args.d_head else None
    print(f"report: {write_report(args.runs, args.out, args.labels, d_head)}")
    return 0


def _cmd_view(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..rundir import reading_lock
    from ..view import write_view
    from .checks import parse_strip_prompts

    out = args.out or str(Path(args.runs[0]) / "view.html")
    ids = parse_strip_prompts(args.strip_prompts) if args.strip_prompts else None
    with reading_lock(*args.runs):  # no command writes into the runs while they are read
        print(f"view: {write_view(args.runs, out, args.labels, strips=args.strips, strip_prompts=ids)}")
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from ..merge import merge_runs

    out = merge_runs(args.dirs, args.out, overwrite=args.overwrite)
    print(f"merged run written to {out}")
    return 0

def _on_cpu(device: str | None) -> bool:
    """Whether a model command with ``--device`` ``device`` runs on the CPU (no ``--device``: the
    GPU if torch sees one)."""
    import torch

    return str(device).startswith("cpu") if device else not torch.cuda.is_available()
