"""The command line's grammar: the subcommands, their arguments and help texts. Building the parser
imports nothing heavy; each subcommand is bound to its function in :mod:`osdn_diag.cli.commands`,
looked up when the parser is built."""

from __future__ import annotations

import argparse

from . import commands


def _seed(text: str) -> int:
    """``--seed``: a whole number torch's generators take, 0 <= N < 2**64 (a larger one ended in
    "Overflow when unpacking long long" once the prompts were drawn, naming no argument)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected a whole number 0 <= N < 2**64, got {text}")
    return value


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
    p.add_argument("--dtype", choices=sorted(commands._DTYPES), help="model dtype (bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--kernels", choices=("auto", "fla", "reference"), default="auto",
                   help="what runs the delta rule during capture: fla's kernel, the reference "
                   "recurrence, or auto (fla on CUDA, reference on CPU)")
    p.add_argument("--seed", type=_seed, default=0, help="seed for random models and suites (0)")
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

    from .. import __version__

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
    prove.set_defaults(func=commands._cmd_prove)

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
    run.set_defaults(func=commands._cmd_run)

    cap = sub.add_parser("capture", help="capture what the kernels receive, to DIR/capture",
                         description="Hook MODEL's delta-rule kernels on every prompt and store what "
                         "each kernel received (safetensors shards + manifest.json) in DIR.")
    _add_capture_args(cap)
    _add_common(cap)
    cap.set_defaults(func=commands._cmd_capture)

    rep = sub.add_parser("replay", help="replay a capture directory",
                         description="Replay every captured write of DIR in fp32 and write "
                         "residuals.parquet and summary.json there.")
    rep.add_argument("dir", metavar="DIR", help="a capture directory")
    _add_replay_args(rep)
    _add_common(rep)
    rep.set_defaults(func=commands._cmd_replay)

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
    wi.set_defaults(func=commands._cmd_what_if)

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
    demo.add_argument("--seed", type=_seed, default=0, help="seed of the prompt suite (0)")
    demo.add_argument("--overwrite", action="store_true",
                      help="replace the demo output DIR already holds (only the files osdn-diag wrote); "
                      "without it such a DIR is refused")
    _add_common(demo)
    demo.set_defaults(func=commands._cmd_demo)

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
    warm.add_argument("--dtype", choices=sorted(commands._DTYPES), help="model dtype (bf16 on CUDA)")
    warm.add_argument("--kernels", choices=("auto", "fla", "reference"), default="auto",
                      help="as for run (auto: fla's kernels on CUDA)")
    warm.add_argument("--seed", type=_seed, default=0, help="seed of a random model (0)")
    warm.add_argument("--save-tuning", metavar="FILE",
                      help="also write the autotuning choices of fla's kernels made here as a table "
                      "(JSON) that OSDN_DIAG_TUNING=FILE reuses on machines with the same GPU, Triton "
                      "and fla (docs/performance.md)")
    _add_common(warm)
    warm.set_defaults(func=commands._cmd_warmup)

    report = sub.add_parser("report", help="write report.md and plots for one or more runs",
                            description="Write report.md and plots/*.png: into RUN for one run, or "
                            "into --out comparing several runs side by side.")
    report.add_argument("runs", nargs="+", metavar="RUN", help="run directories (with summary.json)")
    report.add_argument("--out", metavar="DIR", help="where to write (required for several runs)")
    report.add_argument("--labels", nargs="+", metavar="LABEL", help="one label per run")
    report.add_argument("--d-head", metavar="LAYER.HEAD",
                        help="the head whose preconditioner trajectory is plotted (default: the first "
                        "layer with a d, head 0)")
    report.set_defaults(func=commands._cmd_report)

    view = sub.add_parser("view", help="write an interactive HTML view of one or more runs (needs plotly)",
                          description="Write one self-contained HTML page (plotly.js inlined: opens from "
                          "disk, no network) of one or more runs side by side: the contraction curve, the "
                          "layer x head heat map linked to each head's curve, q_geo by layer, the comparator "
                          "gap by layer, the preconditioner d, fidelity and the assumption audit, and token "
                          "strips coloured by q_t for a few prompts. Needs plotly: pip install "
                          "'osdn-diag[view]'.")
    view.add_argument("runs", nargs="+", metavar="RUN", help="run directories (with summary.json)")
    view.add_argument("--out", metavar="FILE.html", help="where to write (default: RUN/view.html for one run; "
                      "required for several)")
    view.add_argument("--labels", nargs="+", metavar="LABEL", help="one label per run")
    view.add_argument("--strips", type=int, default=None, metavar="N",
                      help="token strips for N prompts, taken in turn from each task (default 4)")
    view.add_argument("--strip-prompts", metavar="ID,ID,...",
                      help="token strips for these prompt ids instead (manifest.json: prompts[].id)")
    view.set_defaults(func=commands._cmd_view)

    merge = sub.add_parser("merge", help="one run directory from the nodes' directories of a multi-node run",
                           description="Assemble the parts a run under torchrun --nnodes N left under "
                           "each node's own --out (no shared file system) into one run directory, "
                           "checking every rank's parts by run id and sha256, and write its report.")
    merge.add_argument("dirs", nargs="+", metavar="DIR", help="every node's --out directory (rank 0's among them)")
    merge.add_argument("--out", required=True, metavar="OUT", help="the merged run directory to write")
    merge.add_argument("--overwrite", action="store_true", help="replace the run OUT already holds")
    merge.set_defaults(func=commands._cmd_merge)
    return parser
