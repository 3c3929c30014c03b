"""``osdn-diag demo``: the whole diagnostic on the built-in trained models, offline.

For every built-in model (DeltaNet, OSDN, OSDN-APF trained on MQAR, :mod:`osdn_diag.catalog.builtin`)
the demo captures the paired MQAR / MQAR-twice suite at the shape the model was trained on, replays
every write, and then writes one report comparing the models: the residual-contraction table
(Table 8 layout), recall accuracy single vs twice (Table 7 layout) and the contraction curve over
relative position (Fig. 2). It runs on the GPU when there is one, else on the CPU.

With ``lm=True`` (``osdn-diag demo --lm``) it does the same for the built-in *language* models
(DeltaNet, OSDN, OSDN-APF trained on the Python standard library's sources) on held-out text, single
and with the window repeated (the ``lm-heldout-pair`` suite): the contraction table, held-out
perplexity and next-token accuracy single vs twice, and the contraction curve.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["DEMO_LM_MODELS", "DEMO_MODELS", "DemoRow", "format_rows", "run_demo"]

#: The built-in models the demo compares, in report order, with their labels.
DEMO_MODELS: dict[str, str] = {
    "mqar-deltanet": "DeltaNet",
    "mqar-osdn": "OSDN",
    "mqar-osdn-apf": "OSDN-APF",
}

#: The built-in language models ``demo --lm`` compares, in report order, with their labels.
DEMO_LM_MODELS: dict[str, str] = {
    "lm-deltanet": "DeltaNet",
    "lm-osdn": "OSDN",
    "lm-osdn-apf": "OSDN-APF",
}

#: The interactive view the demo writes beside ``report.md`` when plotly is installed.
VIEW_FILE = "view.html"

#: ``demo --lm``'s defaults: held-out windows per model (each also asked twice) and their length.
LM_NUM_PROMPTS = 4
LM_LENGTH = 256


@dataclass
class DemoRow:
    label: str
    run_dir: Path
    q_geo: float
    q_arith: float
    q_geo_by_task: dict[str, float]
    accuracy_by_task: dict[str, float]
    fidelity: float | None  # None: no live kernel ran (reference kernels), nothing to compare
    perplexity_by_task: dict[str, float] = field(default_factory=dict)  # held-out text tasks only


def run_demo(
    out_dir: str | os.PathLike = "osdn-demo",
    *,
    num_prompts: int | None = None,
    lm: bool = False,
    length: int | None = None,
    models: list[str] | None = None,
    device: str | None = None,
    seed: int = 0,
    progress: bool = True,
    root: Path | None = None,
    overwrite: bool = False,
) -> tuple[Path, list[DemoRow]]:
    """Run the demo into ``out_dir`` (one run directory per model and ``report/``).

    Args:
        num_prompts: MQAR contexts per model (default 16), or with ``lm`` held-out text windows (default
            :data:`LM_NUM_PROMPTS`); each is asked once single and once twice.
        lm: run the built-in language models on held-out text instead of the MQAR models.
        length: with ``lm``, tokens per held-out window (default :data:`LM_LENGTH`); the MQAR models'
            prompt length is the one they were trained on.
        models: built-in model names (default: :data:`DEMO_MODELS`, or :data:`DEMO_LM_MODELS` with
            ``lm``, that are installed).
        root: where the built-in models live (default: the package's own).
        overwrite: replace an earlier demo's output (only the files osdn-diag wrote; see
            :mod:`osdn_diag.rundir`). Without it a model directory that holds a run, or a ``report/``
            that holds a report, is refused; files osdn-diag did not write are refused either way.
            Every directory is checked before the first model runs.

    With plotly installed (``pip install 'osdn-diag[view]'``), the interactive view of the runs is
    written beside the report too, as ``report/view.html``.

    Returns ``(report.md path, one row per model)``.
    """
    from .catalog import builtin_names, builtin_task
    from .report.markdown import REPORT_FILES
    from .rundir import RunDirectoryError, check_links, check_output, existing_run_files, is_report_dir, output_lock
    from .runtime.atomic import refuse_link

    if num_prompts is None:
        num_prompts = LM_NUM_PROMPTS if lm else 16
    if num_prompts < 1:
        raise ValueError(f"argument 'num_prompts': expected >= 1, got {num_prompts}")
    if length is not None and not lm:
        raise ValueError("argument 'length': the MQAR demo asks its models at the shape they were trained on; "
                         "length applies to the language-model demo (--lm) only")
    length = LM_LENGTH if length is None else length
    available = builtin_names(root)
    defaults = DEMO_LM_MODELS if lm else DEMO_MODELS
    names = list(models) if models else [m for m in defaults if m in available]
    if not names:
        raise ValueError(
            "no built-in models to run the demo on (expected "
            + ", ".join(defaults) + f"; found {', '.join(available) or 'none'})"
        )
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ValueError(
            f"MODEL 'builtin:{unknown[0]}': no such built-in model; available: "
            + (", ".join(f"builtin:{n}" for n in available) or "none")
        )
    # Every model's task is read and checked before anything runs: the suite below asks N queries
    # of N pairs, and the report compares runs only on identical prompts.
    tasks = {name: builtin_task(name, root) for name in names}
    suite = "lm-heldout" if lm else "mqar"
    for name, task in tasks.items():
        if task.get("suite") != suite:
            hint = "the language-model demo (--lm) takes builtin lm-* models" if lm else (
                "run the language models with --lm" if task.get("suite") == "lm-heldout" else "")
            raise ValueError(f"built-in model {name!r}: task.json names suite {task.get('suite')!r}, expected "
                             f"{suite!r}" + (f"; {hint}" if hint else ""))
    if lm:  # every model is asked the same windows, of the demo's length
        tasks = {name: {**task, "length": length} for name, task in tasks.items()}
    for name, task in ({} if lm else tasks).items():
        if task.get("num_queries", task["num_pairs"]) != task["num_pairs"]:
            raise ValueError(f"built-in model {name!r}: the demo asks every key (num_queries = num_pairs); "
                             f"task.json has {task['num_queries']} queries of {task['num_pairs']} pairs")
    shapes = set() if lm else {(t["num_pairs"], t.get("vocab_size")) for t in tasks.values()}
    if len(shapes) > 1:
        raise ValueError("the demo compares models on the same prompts; these were trained on different "
                         "MQAR shapes: " + ", ".join(f"{n}: {t['num_pairs']} pairs, vocabulary "
                                                     f"{t.get('vocab_size')}" for n, t in tasks.items()))
    out_dir = Path(out_dir)
    twice = sorted({name for name in names if list(names).count(name) > 1})
    if twice:
        raise ValueError(f"argument --models: {', '.join(twice)} given more than once; name each model once")
    for name in names:
        # Names the demo chose, below the user's --out (which may itself be a link): never written through.
        refuse_link(out_dir / name)
        check_output(out_dir / name, overwrite=overwrite)
    report_dir = out_dir / "report"
    refuse_link(report_dir)
    found = existing_run_files(report_dir)
    if found and not is_report_dir(report_dir):
        raise RunDirectoryError(f"{report_dir}: not an osdn-diag report directory, but it holds "
                                f"{', '.join(found)}, which the demo would write; choose another --out")
    if found and not overwrite:
        raise RunDirectoryError(f"{report_dir}: already holds a report; pass --overwrite to replace it, or "
                                "choose another --out")
    check_links(report_dir, (*REPORT_FILES, VIEW_FILE))
    made = not os.path.lexists(out_dir)  # the marker goes only into a directory the demo makes
    with output_lock(out_dir):
        if made:
            _ignore_in_git(out_dir)
        return _run(out_dir, names, tasks, num_prompts=num_prompts, device=device, seed=seed, progress=progress,
                    root=root, overwrite=overwrite, lm=lm)


def _ignore_in_git(out_dir: Path) -> None:
    """The demo writes into the working directory by default, often a checkout: a ``.gitignore`` of
    ``*`` inside the folder it made keeps ``git status`` clean without touching the user's own ignore
    files. Created only if there is nothing at that name (O_EXCL does not follow a link, even a
    dangling one): a file or link there is the user's."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(out_dir / ".gitignore", flags, 0o666)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as fh:
        fh.write("# osdn-diag demo output: generated, not source\n*\n")


def _run(out_dir: Path, names, tasks, *, num_prompts, device, seed, progress, root, overwrite, lm):
    from .pipeline import capture_run, replay_run
    from .report import write_report

    run_dirs, labels = [], []
    for name in names:
        task = tasks[name]
        spec = f"builtin:{name}" if root is None else str(root / name)
        run_dir = out_dir / name
        if lm:
            what = f"{num_prompts} held-out text windows of {task['length']} tokens, single and twice"
            suite, length = "lm-heldout-pair", int(task["length"])
        else:
            what = f"{num_prompts} MQAR and {num_prompts} MQAR-twice prompts"
            # N pairs -> a suite "length" of 4N (the suite's own rule).
            suite, length = "mqar-pair", 4 * int(task["num_pairs"])
        if progress:
            print(f"[{name}] capture + replay of {what}")
        # Every prompt of one variant has one length, so a batch per variant packs nothing.
        capture_run(
            spec, suite, run_dir, device=device, num_prompts=num_prompts, length=length, seed=seed,
            batch_size=num_prompts, progress=progress, overwrite=overwrite,
        )
        replay_run(run_dir, progress=progress, device=device)
        run_dirs.append(run_dir)
        labels.append({**DEMO_MODELS, **DEMO_LM_MODELS}.get(name, name))
    report = write_report(run_dirs, out_dir / "report", labels)
    if view_available():  # beside report.md; the static report never needs plotly
        from .view import write_view
        from .view.figures import ViewUnavailable

        try:
            write_view(run_dirs, out_dir / "report" / VIEW_FILE, labels)
        except ViewUnavailable as err:  # installed, but broken: the demo's results stand without it
            print(f"osdn-diag demo: {out_dir / 'report' / VIEW_FILE} not written: {err}", file=sys.stderr)
    return report, [_row(label, d) for label, d in zip(labels, run_dirs)]


def view_available() -> bool:
    """Whether plotly, which the interactive view needs, is installed."""
    import importlib.util

    return importlib.util.find_spec("plotly") is not None


def _row(label: str, run_dir: Path) -> DemoRow:
    from .replay import load_run

    _, s = load_run(run_dir)
    return DemoRow(
        label=label, run_dir=run_dir, q_geo=s["q_geo"], q_arith=s["q_arith"],
        q_geo_by_task={t: v["q_geo"] for t, v in s["by_task"].items()},
        accuracy_by_task={t: float("nan") if v["accuracy"] is None else v["accuracy"]
                          for t, v in s.get("recall", {}).items()},
        fidelity=s["fidelity"]["max_rel_error"],
        perplexity_by_task={t: float("nan") if v.get("perplexity") is None else v["perplexity"]
                            for t, v in s.get("recall", {}).items() if v.get("scoring") == "next-token"},
    )


def format_rows(rows: list[DemoRow]) -> str:
    """A short fixed-width table of the demo's headline numbers."""
    tasks = sorted({t for r in rows for t in r.q_geo_by_task})
    text = any(r.perplexity_by_task for r in rows)
    width = max(16, *(len(t) + 6 for t in tasks)) if tasks else 16
    head = f"{'model':10s} {'q_geo':>7s} {'q_arith':>7s}" + "".join(f" {'q_geo ' + t:>{width}s}" for t in tasks)
    if text:  # held-out text: perplexity where MQAR has recall accuracy
        head += "".join(f" {'ppl ' + t:>{width - 2}s}" for t in tasks)
    else:
        head += "".join(f" {'acc ' + t:>15s}" for t in tasks)
    lines = [head]
    for r in rows:
        line = f"{r.label:10s} {r.q_geo:7.4f} {r.q_arith:7.4f}"
        line += "".join(f" {r.q_geo_by_task.get(t, float('nan')):{width}.4f}" for t in tasks)
        if text:
            line += "".join(f" {r.perplexity_by_task.get(t, float('nan')):{width - 2}.2f}" for t in tasks)
        else:
            line += "".join(f" {r.accuracy_by_task.get(t, float('nan')):15.3f}" for t in tasks)
        lines.append(line)
    return "\n".join(lines)
