"""``report.md``: the residual-contraction tables of one run, or of several side by side."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ..runtime.atomic import atomic_write_text, check_target, real_directory
from ..replay.families import MICRO_STEP_FAMILIES, NOT_APPLICABLE
from ..replay.runs import load_run, read_table
from ..replay.tokens import MIN_COUNT, NO_TOKENIZER
from ..rundir import (
    MANIFEST,
    PLOT_FILES,
    RunDirectoryError,
    check_links,
    enclosing_runs,
    existing_run_files,
    finish_stage,
    is_report_dir,
    output_lock,
    reading_lock,
    remove_report_files,
    run_manifest,
    start_stage,
)
from .render import Figure, draw

__all__ = ["REPORT_FILES", "d_trajectories_of", "d_trajectory_of", "eps_q_series", "load_run", "write_report"]

#: what a report writes into its directory (a run's, or a comparison report's)
REPORT_FILES = (MANIFEST, "report.md", "plots")


def _prompt_shape(manifest: dict) -> list[tuple[str, int, int]]:
    return [(p.get("task", ""), p.get("length", 0), p.get("repeat_start", -1)) for p in manifest.get("prompts", [])]


def _prompt_difference(a: list[tuple], b: list[tuple]) -> str:
    """The first difference between two runs' prompts (task, length, repeat start), in words."""
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} prompts"
    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    parts = [f"{name} {x!r} vs {y!r}" for name, x, y in zip(("task", "length", "repeat start"), a[i], b[i]) if x != y]
    return f"prompt {i}: {', '.join(parts)}"


def _check_comparable(paths, loaded) -> None:
    """Runs side by side must measure the same prompts with the same position bins."""
    ref_path, (ref_m, ref_s) = paths[0], loaded[0]
    for path, (m, s) in zip(paths[1:], loaded[1:]):
        a, b = _prompt_shape(ref_m), _prompt_shape(m)
        if a != b:
            raise ValueError(
                f"runs {ref_path} and {path} used different prompts ({_prompt_difference(a, b)}): "
                "side-by-side numbers would not be comparable; compare runs of the same --prompts, "
                "--num-prompts, --length, --seed and --twice"
            )
        if s["position_bins"]["edges"] != ref_s["position_bins"]["edges"]:
            raise ValueError(f"runs {ref_path} and {path} use different relative-position bins")


def _f(x, digits: int = 3) -> str:
    return "–" if x is None or x != x else f"{x:.{digits}f}"


def _q(x) -> str:
    """A ratio statistic: 3 decimals, or 3 significant digits below 0.01 (a per-token ratio of a
    micro-step family is a product of several ratios, often far below what 3 decimals show)."""
    if x is None or x != x:
        return "–"
    return f"{x:.3f}" if x >= 0.01 else f"{x:.2e}"


#: The token-local loss of the families whose loss is not ``½‖S k_t − v_t‖²`` on the write's own key
#: (docs/families.md); a GatedDeltaProduct micro-step's loss is that form on the micro-step's key.
OWN_LOSS = {
    "comba": "`½‖S p_t − v_t‖²` (read with its removal key p_t)",
    "gdn2": "`½‖S (b_t ⊙ k_t) − w_t ⊙ v_t‖²` (erase gate b_t, write gate w_t)",
    "rwkv7": "`½‖S κ̂_t − v_t‖²` (read with its normalised removal key κ̂_t)",
}


def _families(m: dict) -> set[str]:
    return {layer.get("family", "") for layer in m.get("layers", [])}


def _micro_steps(m: dict, s: dict) -> list[int] | None:
    """The micro-steps per token of a run whose ratios are per micro-step (a GatedDeltaProduct
    layer's), from its layers' ``micro_steps`` flag; ``None`` for a run of one write per token."""
    units = {e.get("unit") for e in s.get("by_family", {}).values()}
    if "micro-step" not in units and not _families(m) & MICRO_STEP_FAMILIES:
        return None
    return sorted({int(layer.get("flags", {}).get("micro_steps", 1)) for layer in m.get("layers", [])
                   if layer.get("family") in MICRO_STEP_FAMILIES})


def _writes_cell(m: dict, s: dict) -> str:
    steps = _micro_steps(m, s)
    if steps is None:
        return "per token"
    return f"per micro-step ({' or '.join(map(str, steps))} per token)"


def _unit_label(label: str, m: dict, s: dict) -> str:
    """A run's label where its per-write numbers stand beside others': marked when they are per
    micro-step."""
    return label if _micro_steps(m, s) is None else f"{label} (per micro-step)"


def _cell(text) -> str:
    """A table cell: ``|`` escaped and line breaks made spaces (task names and labels are the user's)."""
    return " ".join(str(text).replace("\\", "\\\\").replace("|", "\\|").splitlines())


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(map(_cell, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(_cell, r)) + " |" for r in rows]
    return "\n".join(lines)


def _label(run_dir: Path, manifest: dict) -> str:
    spec = manifest.get("model", {}).get("spec", run_dir.name)
    return spec if len(spec) <= 40 else run_dir.name


def distinct_labels(labels: list[str], dirs: list[Path | None]) -> list[str]:
    """Default labels told apart: runs of one model spec (two seeds, a run given twice) would share a
    label in every table, legend and view; those get their run directory's name after it, and a
    number where that does not separate them either."""
    out = list(labels)
    for label in {x for x in labels if labels.count(x) > 1}:
        same = [i for i, x in enumerate(labels) if x == label]
        names = [None if dirs[i] is None else dirs[i].name for i in same]
        for i, name in zip(same, names):
            if name is not None and names.count(name) == 1 and name != label:
                out[i] = f"{label} ({name})"
    for label in {x for x in out if out.count(x) > 1}:
        for n, i in enumerate([i for i, x in enumerate(out) if x == label], start=1):
            out[i] = f"{label} #{n}"
    return out


def _contraction_table(runs, micro: bool = False) -> str:
    """Table 8's layout: q_geo, q_arith, then q_geo per task. With ``micro`` (a run of the report
    makes several writes per token), the unit of each row's numbers ("writes") and the per-token
    q_geo and token count, which compare across families, follow."""
    tasks = sorted({t for _, _, s in runs for t in s["by_task"]})
    header = ["model", *(["writes"] if micro else []), "q_geo ↓", "q_arith ↓",
              *[f"{t} q_geo ↓" for t in tasks], "n", *(["q_geo per token ↓", "tokens"] if micro else [])]
    rows = []
    for label, m, s in runs:
        by_task = s["by_task"]
        tokens = s.get("n_tokens")
        rows.append(
            [label, *([_writes_cell(m, s)] if micro else []), _q(s["q_geo"]), _q(s["q_arith"]),
             *[_q(by_task.get(t, {}).get("q_geo")) for t in tasks], f"{s['n']:,}",
             *([_q(s.get("q_geo_per_token")), "–" if tokens is None else f"{tokens:,}"] if micro else [])]
        )
    return _table(header, rows)


def _units_note(runs) -> list[str]:
    """Beside a table where a run's numbers are per micro-step: what that means, and which column
    compares across families."""
    micro = [label for label, m, s in runs if _micro_steps(m, s) is not None]
    if not micro:
        return []
    return [f"Units: {', '.join(micro)} {'makes' if len(micro) == 1 else 'make'} several writes "
            "(micro-steps) per token (GatedDeltaProduct): its q_geo, q_arith, per-task q_geo and n are per "
            "micro-step write, every other family's per token. `q_geo per token` is the geometric mean "
            "of each token's ratio (`token_ratio`: its loss over all its micro-steps' (key, value) "
            "pairs, after the token over before it, as a delta rule's ratio is of its one pair's "
            "loss): it is the column that compares across families. The product of a token's "
            "micro-step ratios (`micro_step_ratio_product`, geometric mean q_geo^n) multiplies ratios "
            "of different losses and does not.", ""]


#: The reading guide printed under the contraction table (docs/metrics.md, "What q_geo to expect").
EXPECTATION_NOTE = (
    "What q_geo to expect: for a layer without decay each write multiplies its token's loss by exactly "
    "q_t = (1 − a_t)², a_t = β_t⟨d_t, k_t⊙k_t⟩ (`write_gain` in residuals.parquet; Eq. 20), so q_geo "
    "is set by the gates and key norms, not by the data. With unit keys and no preconditioner "
    "a_t = β_t: a randomly initialised model, whose β_t = sigmoid(≈ 0) ≈ 0.5, gives "
    "q_t ≈ (1 − 0.5)² = 0.25; β_t → 1 (an exact Newton write) sends q_t to 0, β_t → 0 to 1, and any "
    "0 < a_t < 2 gives q_t < 1 (Corollary A.2). A q_geo near 0.25 thus says the gates sit near "
    "0.5, as at initialisation; a trained model's departure from it is what the diagnostic measures. "
    "For a layer with decay the identity holds for the ratio against the decayed state "
    "(`residual_ratio_post`); q_t also carries the decay."
)


def _own_target_note(runs) -> list[str]:
    """Beside the contraction table, for runs with RWKV-7 layers: their q_geo toward the update's own
    target (``by_family -> rwkv7 -> q_geo_own_target``), which the table's q_geo (toward v) is not."""
    lines = []
    for label, _, s in runs:
        for family, e in sorted(s.get("by_family", {}).items()):
            if "q_geo_own_target" not in e:
                continue
            post = s.get("post_decay", {}).get("by_family", {}).get(family, {}).get("q_geo_own_target")
            lines.append(
                f"- {label}, `{family}`: q_geo toward v_t {_q(e['q_geo'])} (the figure that compares with "
                f"the delta rules); toward the update's own target (c_k/c_b)·v_t {_q(e['q_geo_own_target'])}"
                + ("" if post is None else f", post-decay {_q(post)}")
                + f" (`q_geo_own_target`, {e.get('n_own_target', 0):,} tokens)")
    if not lines:
        return []
    return ["RWKV-7 writes drive the prediction along the removal key toward (c_k/c_b)·v_t, not v_t "
            "(docs/families.md, RWKV-7):", "", *lines, ""]


def _bins_table(runs) -> str:
    edges = runs[0][2]["position_bins"]["edges"]
    header = ["model", *[f"[{a:.1f}, {b:.1f})" for a, b in zip(edges[:-1], edges[1:])]]
    rows = [[_unit_label(label, m, s), *[_q(x) for x in s["position_bins"]["q_geo"]]] for label, m, s in runs]
    return _table(header, rows)


def _layer_table(runs) -> str:
    layers = sorted({layer for _, _, s in runs for layer in s["by_layer"]}, key=int)
    header = ["layer", *[_unit_label(label, m, s) for label, m, s in runs]]
    rows = [[str(int(layer)), *[_q(s["by_layer"].get(layer, {}).get("q_geo")) for _, _, s in runs]]
            for layer in layers]
    return _table(header, rows)


def _family_tables(runs) -> list[str]:
    """One table per kernel family (``summary.json -> by_family``): every run with layers of that
    family, their ratio statistics together. Empty when there is only one (run, family) pair."""
    families = sorted({f for _, _, s in runs for f in s.get("by_family", {})})
    if sum(len(s.get("by_family", {})) for _, _, s in runs) < 2:
        return []
    gated = any("post_decay" in s for _, _, s in runs)  # the post-decay column only where there is one
    # Where a family of several writes per token is in the report, every table says per what its
    # numbers are and adds the per-token ones, the columns that compare across families.
    micro = any(f in MICRO_STEP_FAMILIES or e.get("unit") == "micro-step"
                for _, _, s in runs for f, e in s.get("by_family", {}).items())
    parts = []
    for family in families:
        rows = []
        for label, m, s in runs:
            stats = s.get("by_family", {}).get(family)
            if stats is None:
                continue
            layers = [layer["layer"] for layer in m.get("layers", []) if layer.get("family") == family]
            post_stats = s.get("post_decay", {}).get("by_family", {}).get(family, {})
            row = [label, str(len(layers))]
            if micro:
                unit = stats.get("unit") or ("micro-step" if family in MICRO_STEP_FAMILIES else "token")
                row.append(f"per {unit}")
            row += [_q(stats["q_geo"]), _q(stats["q_arith"]), *([_q(post_stats.get("q_geo"))] if gated else []),
                    f"{stats['n']:,}"]
            if micro:
                tokens = stats.get("n_tokens")
                row += [_q(stats.get("q_geo_per_token")),
                        *([_q(post_stats.get("q_geo_per_token"))] if gated else []),
                        "–" if tokens is None else f"{tokens:,}"]
            rows.append(row)
        header = ["model", "layers", *(["writes"] if micro else []), "q_geo ↓", "q_arith ↓",
                  *(["post-decay q_geo ↓"] if gated else []), "n",
                  *(["q_geo per token ↓", *(["post-decay q_geo per token ↓"] if gated else []), "tokens"]
                    if micro else [])]
        parts += [f"### {family}", "", _table(header, rows), ""]
    return parts


def _runs_table(runs) -> str:
    header = ["model", "prompts", "layers", "kernels", "replay", "fidelity (max rel. error)",
              "final state (max rel. error)"]
    rows = []
    for label, m, s in runs:
        rep = s.get("replay", {})
        layers = m.get("layers", [])
        families = sorted({layer["family"] for layer in layers})
        skipped = m.get("layers_skipped") or []  # a hybrid model's full-attention layers
        not_captured = (f"; {len(skipped)} not captured ({', '.join(sorted({x['type'] for x in skipped}))})"
                        if skipped else "")
        rows.append([
            label,
            f"{len(m.get('prompts', []))} × `{m.get('prompts_source', '?')}`" + (" (twice)" if m.get("twice") else ""),
            f"{len(layers)} ({', '.join(families)}){not_captured}",
            ", ".join(m.get("kernels", [])) or "?",
            f"{rep.get('backend', '?')}, {rep.get('dtype', '?')}"
            + (", zero residuals continuous" if rep.get("zero_residual") == "continuous" else ""),
            _fidelity_cell(s),
            _state_cell(s),
        ])
    return _table(header, rows)


NOT_MEASURED = "not measured (reference kernels)"


def _fidelity_cell(s: dict) -> str:
    """Replay against the kernel's output; a run whose kernels were all the package's own reference
    has nothing to compare with (the replay reproduces it by construction)."""
    if s.get("counterfactual"):
        return "counterfactual"
    fid = s["fidelity"]
    if fid.get("max_rel_error") is None:
        return NOT_MEASURED
    return f"{fid['max_rel_error']:.1e}"


def _state_cell(s: dict) -> str:
    """The final-state agreement with the kernel: the error, and how many units of the kernel's
    working-precision rounding it is (a few units: rounding explains it)."""
    state = s.get("fidelity", {}).get("state")
    if s.get("counterfactual"):
        return "—"
    if not state:
        return NOT_MEASURED if s.get("fidelity", {}).get("max_rel_error", 0.0) is None else "—"
    precisions = sorted({v["working_precision"] for v in state["by_layer"].values()})
    return f"{state['max_rel_error']:.1e} ({state['max_rounding_units']:.2g} × {'/'.join(precisions)} rounding)"


#: ``summary.json["recall"][task]["scoring"]`` of a task scored on next-token prediction of text.
TEXT_SCORING = "next-token"


def _is_text(row: dict) -> bool:
    return row.get("scoring") == TEXT_SCORING


def _scored_count(rows: list[dict]) -> str:
    """How many queries (tokens) were scored, and how many were excluded for NaN/Inf logits."""
    queries = sum(r["queries"] for r in rows)
    excluded = sum(r.get("excluded_nonfinite", 0) for r in rows)
    return f"{queries:,}" + (f" (+{excluded:,} excluded: NaN/Inf logits)" if excluded else "")


def _recall_table(runs) -> str | None:
    """Recall accuracy per task (the paper's Table 7 layout: single vs twice), for the measured runs
    whose prompts carry answers (a what-if run has no forward pass of its own, so no row), over the
    recall tasks (not the text tasks: :func:`_text_table`); ``None`` when there are none. A task whose
    every query had non-finite logits shows "–"."""
    measured = [(label, s) for label, _, s in runs if not s.get("counterfactual")]
    tasks = sorted({t for _, s in measured for t, r in s.get("recall", {}).items() if not _is_text(r)})
    if not tasks:
        return None
    header = ["model", *[f"{t} accuracy ↑" for t in tasks], "queries"]
    rows = []
    for label, s in measured:
        rec = {t: r for t, r in s.get("recall", {}).items() if not _is_text(r)}
        rows.append([label, *[_f(rec.get(t, {}).get("accuracy")) for t in tasks],
                     _scored_count(list(rec.values()))])
    return _table(header, rows)


def _text_table(runs) -> str | None:
    """Held-out text per task (Table 7's spirit: single vs twice): per measured run, the perplexity
    (2 decimals) of every text task, then its next-token accuracy (3 decimals), then the tokens
    scored; ``None`` when no task is scored on text. "–" where nothing was scored (or a run written
    before the nll was recorded)."""
    measured = [(label, s) for label, _, s in runs if not s.get("counterfactual")]
    tasks = sorted({t for _, s in measured for t, r in s.get("recall", {}).items() if _is_text(r)})
    if not tasks:
        return None
    header = ["model", *[f"{t} perplexity ↓" for t in tasks], *[f"{t} accuracy ↑" for t in tasks], "tokens"]
    rows = []
    for label, s in measured:
        rec = {t: r for t, r in s.get("recall", {}).items() if _is_text(r)}
        rows.append([label, *[_f(rec.get(t, {}).get("perplexity"), 2) for t in tasks],
                     *[_f(rec.get(t, {}).get("accuracy")) for t in tasks], _scored_count(list(rec.values()))])
    return _table(header, rows)


def _phase_table(runs) -> str | None:
    """Generated runs (``--generate``): q_geo of the prompts' tokens (prefill) and of the tokens the
    model decoded after them, per run; ``None`` when no run generated."""
    rows = []
    for label, m, s in runs:
        phases = s.get("by_phase")
        if not phases:
            continue
        pre, dec = phases.get("prefill", {}), phases.get("decode", {})
        rows.append([label, str(m.get("generate", "–")), _q(pre.get("q_geo")), _q(dec.get("q_geo")),
                     f"{pre.get('n', 0):,}", f"{dec.get('n', 0):,}"])
    if not rows:
        return None
    return _table(["model", "tokens generated per prompt", "q_geo prefill", "q_geo decode", "n prefill",
                   "n decode"], rows)


def _nonfinite_note(runs) -> list[str]:
    """The sentences stating, beside the headline, what NaN/Inf left out of each run's numbers."""
    lines = []
    for label, _, s in runs:
        nf = s.get("nonfinite") or {}
        if not nf.get("streams"):
            continue
        layers = ", ".join(f"layer {int(k)}: {v}" for k, v in nf.get("by_layer", {}).items())
        prompts = nf.get("prompts", [])
        shown = ", ".join(map(str, prompts[:10])) + (f" and {len(prompts) - 10} more" if len(prompts) > 10 else "")
        lines.append(
            f"**{label}: {nf['streams']:,} of {nf['of_streams']:,} (prompt, layer, head) streams excluded** "
            f"({nf['tokens']:,} token measurements; {layers}; prompts {shown}): the kernel read NaN/Inf "
            "there. Every number in this report is over the remaining streams; `finite = false` marks "
            "the excluded rows of residuals.parquet."
        )
    return [*lines, ""] if lines else []


#: How the report names each check of Theorem D.7's hypotheses (osdn_diag.metrics.hypotheses.HYPOTHESES,
#: the keys of the summaries' ``hypotheses_failed``; not imported from there, which needs torch).
HYPOTHESIS_WORDS = {
    "unit_keys": "keys not unit",
    "beta_in_open_unit_interval": "β outside (0, 1)",
    "d_in_box": "d outside the box",
    "no_decay": "state decays",
    "has_valid_token": "no valid token",
}


def _audit_table(runs) -> str:
    header = ["model", "max abs(‖k‖² − 1)", "keys read as (unit within)", "β range", "d range",
              "zero residuals", "β < 1/d_max", "state decay", "Thm D.7 hypotheses hold (streams)",
              "failed (streams)"]
    rows = []
    for label, _, s in runs:
        a = s.get("assumptions")
        if not a or not a.get("n"):  # nothing measured (every stream excluded): nothing to audit
            continue
        tol = a.get("key_norm_tol")
        rows.append([
            label, f"{a['max_unit_dev']:.1e}",
            ", ".join(a.get("keys_read_as", [])) + (f" ({tol:.1e})" if tol is not None else ""),
            f"[{a['beta_min']:.3f}, {a['beta_max']:.3f}]",
            f"[{a['d_min']:.3f}, {a['d_max']:.3f}]", f"{100 * a['share_zero_residual']:.2f} %",
            f"{100 * a['share_newton_infeasible']:.1f} %", "yes" if a["decay"] else "no",
            *_hypotheses_cells(a),
        ])
    return _table(header, rows)


def _hypotheses_cells(a: dict) -> list[str]:
    """``["hold / streams", "check: streams failing it, …"]`` from the audit's stream counts ("–" for a
    summary written before the audit counted streams)."""
    if "streams" not in a:
        return ["–", "–"]
    failed = [f"{HYPOTHESIS_WORDS.get(name, name)}: {n}" for name, n in a["hypotheses_failed"].items() if n]
    return [f"{a['hypotheses_hold']} / {a['streams']}", ", ".join(failed) or "none"]


def d_trajectory_of(paths, names, manifests, head: tuple[int, int] | None):
    """``(d, title)`` of the first run that has a d (:func:`d_trajectories_of`), or ``None``."""
    found = d_trajectories_of(paths, names, manifests, head, first=True)
    return found[0] if found else None


def d_trajectories_of(paths, names, manifests, head: tuple[int, int] | None, *, first: bool = False):
    """``[(d, title), ...]``, one per run that has a d: d over the first prompt for ``head = (layer,
    head)`` — by default head 0 of the first captured layer that has a d (for a what-if run, the
    counterfactual d, recomputed from the source capture, which must still be the run it replayed: see
    :func:`osdn_diag.whatif.source_run`). Runs without a stored capture, or without a d, are passed
    over; ``first``: stop at the first run found. An asked-for ``head`` that no run has is refused.
    Reads only (the shards it loads are hashed), so that a report refused here has written nothing."""
    found = []
    for path, name, manifest in zip(paths, names, manifests):
        one = _d_of_run(path, name, manifest, head)
        if one is not None:
            found.append(one)
            if first:
                break
    if head is not None and not found:  # asked for, and no run has it: say so rather than leave the plot out
        raise ValueError(f"argument 'd_head' (--d-head {head[0]}.{head[1]}): no run has a write-key "
                         f"preconditioner d in layer {head[0]} (its stored capture); give a layer whose d "
                         "was captured (manifest.json: layers[].has_d), or leave --d-head out")
    return found


def _d_of_run(path, name, manifest, head):
    """``(d, title)`` of one run (see :func:`d_trajectories_of`), or ``None``."""
    transform = None
    if manifest.get("counterfactual"):
        from ..whatif import WhatIf, source_run

        path, transform = source_run(path, manifest), WhatIf(**manifest["what_if"])
    elif manifest.get("capture_stored") is False or not (path / "capture").is_dir() or not any(
            layer.get("has_d") for layer in manifest.get("layers", [])):
        return None
    # Imported here, not above: the capture's reader imports torch, which a report of runs without
    # a stored d never needs (`osdn-diag report` of a --stream run reads JSON and parquet only).
    from ..capture.store import CaptureReader

    reader = CaptureReader(path)
    if transform is not None and reader.run_id != manifest.get("source_run_id"):
        raise RunDirectoryError(f"{path}: no longer the run this what-if output replayed (run id "
                                f"{reader.run_id}, not {manifest.get('source_run_id')}); run what-if again")
    for shard in reader.shards():
        stored = reader.load(shard)
        if head is not None and stored.call.layer != head[0]:
            continue
        call = stored.call if transform is None else transform(stored.call)
        if call.d is None:
            continue
        h = 0 if head is None else head[1]
        if h >= call.num_heads:
            raise ValueError(f"argument 'd_head': layer {call.layer} has {call.num_heads} heads, not {h + 1}")
        row, start, end = call.segments()[0]
        d = call.d[row, start:end, h].float().numpy()
        return d, f"{name}: layer {call.layer}, head {h}, prompt {stored.prompts[0]}"
    return None


#: How many tokens the report lists at each end of a run's tokens ordered by q_geo.
TOKENS_SHOWN = 10


def tokens_of(paths, loaded) -> list[tuple[dict | None, object]]:
    """Per run, ``(manifest's tokens entry, tokens.parquet as a table)``, or ``(None, None)`` for a run
    without ``tokens.parquet`` (written before runs stored their tokens); a file of another run is
    refused. Reads only."""
    from ..replay.tokens import read_tokens

    out = []
    for path, (manifest, _) in zip(paths, loaded):
        tokens = read_tokens(path, manifest)
        out.append((None, None) if tokens is None else (manifest.get("tokens") or {}, tokens))
    return out


def token_stats_of(paths, token_runs) -> list[tuple[dict | None, list[dict] | None]]:
    """Per run, ``(tokens entry, token_stats)``: its ratios pooled by token id
    (:func:`osdn_diag.replay.tokens.token_stats`, which reads residuals.parquet: about 1 s for the
    18.9 M rows of the paper-scale run, so the report computes it while its figures are drawn)."""
    from ..replay.tokens import token_stats

    return [(entry, None if tokens is None else token_stats(path / "residuals.parquet", tokens))
            for path, (entry, tokens) in zip(paths, token_runs)]


def _token_cell(row: dict) -> str:
    """A token as the tables show it: its text as a JSON string (spaces and line breaks visible) and
    its id, or the id alone without text."""
    if row is None:
        return "–"
    if row["text"] is None:
        return f"id {row['token_id']}"
    return f"{json.dumps(row['text'], ensure_ascii=False)} ({row['token_id']})"


def _token_table(stats: list[dict], min_count: int, shown: int = TOKENS_SHOWN) -> tuple[str, int]:
    """The ``shown`` tokens (of at least ``min_count`` occurrences) whose writes contract most (lowest
    q_geo) and least (highest), side by side; and how many tokens qualified. Where fewer than
    ``2 * shown`` qualify, each is listed once: the lower half as contracting most."""
    kept = [r for r in stats if r["count"] >= min_count]
    most = kept[:min(shown, (len(kept) + 1) // 2)]
    least = kept[::-1][:min(shown, len(kept) // 2)]
    header = ["", "contracts most", "q_geo ↓", "occurrences", "contracts least", "q_geo ↓", "occurrences"]
    rows = []
    for i in range(max(1, len(most))):
        a = most[i] if i < len(most) else None
        b = least[i] if i < len(least) else None
        rows.append([str(i + 1), _token_cell(a), "–" if a is None else _q(a["q_geo"]),
                     "–" if a is None else f"{a['count']:,}", _token_cell(b),
                     "–" if b is None else _q(b["q_geo"]), "–" if b is None else f"{b['count']:,}"])
    return _table(header, rows), len(kept)


def _tokens_section(runs, token_runs, min_count: int) -> list[str]:
    """The report's Tokens section: per run, the tokens whose writes contract most and least, or why
    there is no table."""
    parts = ["## Tokens: which writes contract most and least", "",
             f"Per token id: q_geo over every finite write at its positions — every layer, head and "
             f"occurrence in the run's prompts (the geometric mean of `residual_ratio`, as `q_geo` above; "
             f"a GatedDeltaProduct layer's per-token ratio). Only tokens with at least {min_count} "
             f"occurrences (positions) are listed, the {TOKENS_SHOWN} lowest q_geo (contract most) and "
             f"the {TOKENS_SHOWN} highest (contract least). Text as a JSON string (the token decoded on "
             "its own; a byte of a split character as `<0xNN>`), with the token id. Per position: "
             "`Results.per_token()`; the tokens: `tokens.parquet`.", ""]
    for (label, _, _), (entry, stats) in zip(runs, token_runs):
        parts += [f"### {label}", ""]
        if stats is None:
            parts += [f"No token text: {label} has no tokens.parquet (a run written before runs stored their "
                      "tokens; run it again to have them).", ""]
            continue
        if not entry.get("text"):
            why = ("the model has no tokenizer" if entry.get("note", NO_TOKENIZER) == NO_TOKENIZER
                   else "the model's tokenizer could not be loaded")
            parts += [f"{label}: {why}, so tokens are shown by id only.", ""]
        table, qualified = _token_table(stats, min_count)
        parts += [f"{qualified:,} of {len(stats):,} distinct tokens occur at least {min_count} times.", "",
                  table, ""]
    return parts


def _newton_cell(c: dict) -> str:
    """Shares of streams whose gated Newton system is solvable, unconstrained and in the box ("–" for a
    summary written before these columns existed)."""
    free, box = c.get("share_newton_feasible"), c.get("share_newton_feasible_box")
    if free is None or box is None:
        return "–"
    return f"{100 * free:.1f} % / {100 * box:.1f} %"


def _comparator_table(runs) -> str:
    header = ["model", "streams", "ε_T^diag (mean)", "ε_T(1)", "ε_T(d_T)", "regret R_T(d*)",
              "β < 1/d_max", "Newton feasible (R^K / box)", "hypotheses hold (streams)", "bound holds", "min slack"]
    rows = []
    for label, c in runs:
        rows.append([
            label, str(c["problems"]), _f(c["eps_diag_mean"], 4), _f(c["eps_at_ones_mean"], 4),
            _f(c["eps_at_final_d_mean"], 4), _f(c["regret_mean"], 3),
            f"{100 * (c['share_newton_infeasible_mean'] or 0):.1f} %",
            _newton_cell(c),
            f"{c['hypotheses_hold']} / {c['problems']}",
            f"{c['bound_holds']} / {c['hypotheses_hold']}" if c["hypotheses_hold"] else "–",
            _f(c["slack_min"], 3),
        ])
    return _table(header, rows)


def _comparator_runs(runs) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """``(shown, left_out)``: the runs' ``(label, summary["comparator"])``, split by whether Theorem
    D.7's comparator is that of the run's writes. It models a delta-rule write along ``d ⊙ k`` for
    the key the loss reads; Comba, GDN-2, MomentumDeltaNet and RWKV-7 write otherwise
    (:data:`NOT_APPLICABLE`, docs/families.md), so a run all of whose layers are of those families is
    left out of the table (its rows stay in comparator.parquet)."""
    shown, left_out = [], []
    for label, m, s in runs:
        if not s.get("comparator"):
            continue
        fams = _families(m)
        (left_out if fams and fams <= set(NOT_APPLICABLE) else shown).append((label, s["comparator"]))
    return shown, left_out


def _not_applicable_note(left_out, runs) -> list[str]:
    """The note naming the runs left out of the comparator table, and why; and, for a run of both
    kinds of layers, that its row includes layers the theorem does not describe."""
    lines = []
    if left_out:
        fams = sorted({f for label, m, _ in runs for f in _families(m) if label in {n for n, _ in left_out}})
        lines.append(
            f"Not shown: {', '.join(n for n, _ in left_out)} ({', '.join(fams)}). Theorem D.7's comparator "
            "models a delta-rule write along d ⊙ k for the key the loss reads, which is not these "
            "families' write (" + "; ".join(NOT_APPLICABLE[f] for f in fams) + "): their rows in "
            "comparator.parquet are the comparator of the same keys under a plain delta rule, not a "
            "bound on the model's ratios (docs/families.md).")
    shown = {n for n, _, s in runs if s.get("comparator")} - {n for n, _ in left_out}
    for label, m, _ in runs:
        mixed = sorted(_families(m) & set(NOT_APPLICABLE))
        if label in shown and mixed:
            lines.append(f"{label}'s row includes its {', '.join(mixed)} layers, to which the theorem does "
                         "not apply (docs/families.md).")
    return [line for text in lines for line in (text, "")]


def eps_q_series(paths, names) -> list[tuple[str, list[float], list[float], list[int]]]:
    """``(label, ε_T^diag per stream, q_geo per stream, layer per stream)`` of each run that has
    ``comparator.parquet`` (the stream's q_geo is ``exp(log_prod_q / n_valid)``; streams with no valid
    write are left out)."""
    series = []
    for path, name in zip(paths, names):
        f = Path(path) / "comparator.parquet"
        if not f.is_file():
            continue
        t = read_table(f, columns=["layer", "eps_diag", "log_prod_q", "n_valid"]).to_pydict()
        pts = [(e, math.exp(lp / n), int(layer))
               for layer, e, lp, n in zip(t["layer"], t["eps_diag"], t["log_prod_q"], t["n_valid"]) if n]
        series.append((name, [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]))
    return series


def _retained_table(retained) -> str:
    header = ["model", "task", "at last token", "first copy, at last token", "by distance t − j"]
    rows = []
    for label, per_task in retained:
        for task, r in per_task.items():
            dist = ", ".join(f"[{lo},{hi}): {_f(e)}" for (lo, hi), e in zip(r["distance_bins"], r["mean_error"]))
            rows.append([label, task, _f(r["mean_error_at_last_token"]),
                         _f(r["mean_error_of_first_copy_at_last_token"]), dist])
    return _table(header, rows)


def _preamble(runs) -> str:
    """What the ratios are: the loss each family's write is a step on (its own for Comba, GDN-2 and
    RWKV-7), and per what write they are taken (a micro-step for GatedDeltaProduct)."""
    fams = set().union(*(_families(m) for _, m, _ in runs))
    own = sorted(fams & set(OWN_LOSS))
    loss = "`f_t` the token-local loss the layer's write is a step on" if own else "`f_t(S) = ½‖S k_t − v_t‖²`"
    text = (f"Residual ratio of every write, replayed in fp32 from what the kernels received: "
            f"`q_t = f_t(S_t) / f_t(S_{{t−1}})` with {loss} (lower is stronger contraction; `q_t = 1` where "
            "`f_t(S_{t−1}) = 0`). `q_geo` is the geometric mean over every (prompt, layer, head, position), "
            "`q_arith` the arithmetic mean.")
    if own:
        others = sorted(fams - set(OWN_LOSS) - MICRO_STEP_FAMILIES)
        text += (" Each family's loss is its own: "
                 + "; ".join(f"{f}: {OWN_LOSS[f]}" for f in own)
                 + (f"; {', '.join(others)}: `½‖S k_t − v_t‖²`" if others else "")
                 + (f"; gated_delta_product: each micro-step's `½‖S k_{{t,j}} − v_{{t,j}}‖²`"
                    if fams & MICRO_STEP_FAMILIES else "")
                 + " (docs/families.md" + ("; the By family section below gives each family's numbers"
                                          if _has_family_section(runs) else "") + ").")
    if fams & MICRO_STEP_FAMILIES:
        text += (" GatedDeltaProduct layers make several writes (micro-steps) per token, each a step on "
                 "`½‖S k_{t,j} − v_{t,j}‖²` with the micro-step's own key and value: their ratios are per "
                 "micro-step, and `q_geo per token` (of each token's ratio of its loss over all its "
                 "micro-steps' pairs, `Σ_j ½‖S k_{t,j} − v_{t,j}‖²`, after the token over before it) is "
                 "the number that compares with other families.")
    return text


def _has_family_section(runs) -> bool:
    return sum(len(s.get("by_family", {})) for _, _, s in runs) >= 2


def write_report(
    run_dirs: list[str | os.PathLike],
    out_dir: str | os.PathLike | None = None,
    labels: list[str] | None = None,
    d_head: tuple[int, int] | None = None,
    *,
    into_input: bool = False,
) -> Path:
    """Write ``report.md`` and ``plots/`` for one run (into the run directory by default) or for
    several runs side by side (``out_dir`` required). ``d_head = (layer, head)`` picks the head whose
    d trajectory is plotted. Returns the path of ``report.md``.

    Where a report goes: into a run only as that run's own report stage — ``out_dir`` is the single
    run reported on (or, with ``into_input``, one of the runs: what-if's report of its own output
    beside its source). Anywhere else it is a comparison report directory (``manifest.json`` with
    ``"kind": "report"``), which may not be a run, lie inside one, or hold files of those names that
    osdn-diag did not write. Every input is loaded and checked, and the plotted d computed, before
    anything is written: a refused report leaves every directory as it was."""
    if not run_dirs:
        raise ValueError("argument 'run_dirs': give at least one run directory")
    if len(run_dirs) > 1 and out_dir is None:
        raise ValueError("argument 'out_dir': required when comparing several runs")
    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"argument 'labels': expected {len(run_dirs)} labels, got {len(labels)}")
    paths = [Path(r) for r in run_dirs]
    out = Path(out_dir) if out_dir is not None else paths[0]
    owner = next((i for i, p in enumerate(paths) if p.resolve() == out.resolve()), None)
    _check_out(paths, out, owner, into_input)
    check_links(out, REPORT_FILES)  # before anything is written: a link there is the user's
    # The other runs are read, not written: held against a command writing into them meanwhile (a
    # replay replacing the tables this report is reading).
    with output_lock(out), reading_lock(*paths):
        return _write_report(paths, out, owner, labels, d_head)


def _check_out(paths: list[Path], out: Path, owner: int | None, into_input: bool) -> None:
    if owner is not None:
        if len(paths) > 1 and not into_input:
            raise RunDirectoryError(f"--out {out}: is the run {paths[owner]} itself, whose report is its own; "
                                    "write a report of several runs into a directory of its own")
        return
    if run_manifest(out) is not None:
        raise RunDirectoryError(f"--out {out}: a run directory, whose report is written by "
                                f"`osdn-diag report {out}`; choose a directory that is not a run")
    inside = enclosing_runs(out)
    if inside:
        raise RunDirectoryError(f"--out {out}: inside the run {inside[0]}; choose a directory outside any run")
    found = existing_run_files(out)
    if found and not is_report_dir(out):
        raise RunDirectoryError(f"--out {out}: not an osdn-diag report directory, but it holds "
                                f"{', '.join(found)}, which a report would write; choose another --out")


def _check_targets(out: Path, owner: int | None) -> None:
    """Refuse a name the report writes that it could not write (``plots`` not a directory; a directory,
    a FIFO or a device at ``report.md`` or a figure's name), before the old report is removed or the
    run's report stage started: a refused report leaves the run as it was."""
    plots = out / "plots"
    if (plots.exists() or plots.is_symlink()) and not plots.is_dir():
        raise NotADirectoryError(f"{plots}: not a directory, where osdn-diag writes one; remove it, or choose "
                                 "another --out")
    for path in ([] if owner is not None else [out / MANIFEST]) + [out / "report.md"] + [plots / n for n in PLOT_FILES]:
        check_target(path)


def _write_report(paths: list[Path], out: Path, owner: int | None, labels, d_head) -> Path:
    loaded = [load_run(p) for p in paths]
    if not any(m.get("counterfactual") for m, _ in loaded):
        _check_comparable(paths, loaded)
    names = labels or distinct_labels([_label(p, m) for p, (m, _) in zip(paths, loaded)], list(paths))
    runs = [(name, m, s) for name, (m, s) in zip(names, loaded)]
    d_trajectories = d_trajectories_of(paths, names, [m for m, _ in loaded], d_head)
    token_runs = tokens_of(paths, loaded)

    _check_targets(out, owner)
    # Everything is checked: only now is anything written. Into a run, this is its report stage (not
    # done until report.md is written); elsewhere the directory is marked as a report of these runs.
    if owner is not None:
        start_stage(paths[owner], loaded[owner][0], "report")
    else:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / MANIFEST, root=out, text=json.dumps({
            "kind": "report",
            "report_of": [{"path": str(p.resolve()), "run_id": m.get("run_id"), "label": n}
                          for p, n, (m, _) in zip(paths, names, loaded)],
        }, indent=2))
    remove_report_files(out)  # plots of an earlier report that this one may not draw
    plots = real_directory(out, out / "plots")  # the figures are drawn into it: a real directory
    micro = any(_micro_steps(m, s) is not None for _, m, s in runs)
    pairs = [(_unit_label(n, m, s), s) for n, m, s in runs]  # the plots' q_geo are per write
    figures = [Figure("plot_contraction", (pairs,), plots / "contraction.png"),
               Figure("plot_q_bars", (pairs,), plots / "q_geo.png"),
               Figure("plot_by_layer", (pairs,), plots / "by_layer.png"),
               Figure("plot_layer_head", (pairs,), plots / "layer_head.png")]
    retained_runs = [(n, s["retained"]) for n, _, s in runs if s.get("retained")]
    if retained_runs:
        figures.append(Figure("plot_retained", (retained_runs,), plots / "retained.png"))
    comparators, not_applicable = _comparator_runs(runs)
    shown = {n for n, _ in comparators}
    series = eps_q_series([p for p, n in zip(paths, names) if n in shown], [n for n in names if n in shown])
    eps_plot = d_plot = None
    if series:
        eps_plot = plots / "eps_vs_q.png"
        figures.append(Figure("plot_eps_vs_q", (series,), eps_plot))
    if d_trajectories:
        d_plot = plots / "d_trajectory.png"
        figures.append(Figure("plot_d_trajectories", (d_trajectories,), d_plot))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="token-stats") as pool:
        pending = pool.submit(token_stats_of, paths, token_runs)  # beside the figures (numpy)
        draw(figures)  # every figure at once on the command's worker processes, if it started them
        token_runs = pending.result()

    parts = [
        "# osdn-diag report",
        "",
        _preamble(runs),
        "",
        "## Runs",
        "",
        _runs_table(runs),
        "",
        "## Residual contraction (the paper's Table 8 layout)",
        "",
        _contraction_table(runs, micro),
        "",
        EXPECTATION_NOTE,
        "",
        *_units_note(runs),
        *_own_target_note(runs),
        *_nonfinite_note(runs),
    ]
    recall = _recall_table(runs)
    counterfactual = [name for name, _, s in runs if s.get("counterfactual")]
    if recall:
        parts += [
            "## Recall accuracy (the paper's Table 7 layout)",
            "",
            "Argmax of the next-token logits at every query, against the value the context paired "
            "with that key (the same forward pass that was captured). A query whose logits hold "
            "NaN/Inf is excluded, not counted wrong.",
            "",
            recall,
            "",
        ]
    text = _text_table(runs)
    if text:
        parts += [
            "## Held-out text: perplexity and next-token accuracy (the paper's Table 7 layout)",
            "",
            "Next-token prediction of held-out text, on the same forward pass that was captured: "
            "perplexity = exp(mean negative log-likelihood per scored token), accuracy = the share of "
            "tokens where the argmax of the logits is the next token. A twice prompt is its window "
            "written twice, scored on the second copy: the same target tokens as the single prompt, "
            "after the whole window was seen once. A token whose logits hold NaN/Inf is excluded.",
            "",
            text,
            "",
        ]
    phases = _phase_table(runs)
    if phases:
        parts += [
            "## Prefill and decoding",
            "",
            "Each prompt was read in one forward pass (prefill), then the model greedily generated "
            "tokens one forward pass at a time, each starting from the state the step before left in "
            "its cache; prompt and generated tokens were captured and replayed as one stream, the "
            "positions of the generated tokens continuing the prompt's (`decode_start` in "
            "residuals.parquet). q_geo over every layer and head, per phase:",
            "",
            phases,
            "",
        ]
    if counterfactual and any("answers" in p for _, m, _ in runs for p in m.get("prompts", [])):
        parts += [f"No recall accuracy for {', '.join(counterfactual)}: a what-if replays the captured "
                  "writes with another d, and no forward pass ran with it, so there is nothing to "
                  "measure recall on.", ""]
    parts += [
        "## By relative position (Fig. 2a)",
        "",
        "![contraction curve](plots/contraction.png) ![overall q_geo](plots/q_geo.png)",
        "",
        _bins_table(runs),
        "",
    ]
    boundaries = {t: b for _, _, s in runs for t, b in s["position_bins"].get("repeat_boundary", {}).items()}
    if boundaries:
        parts += ["The repeated context starts at relative position "
                  + ", ".join(f"{b:.2f} ({t})" for t, b in sorted(boundaries.items())) + ".", ""]
    parts += ["## By layer and head", "", "![q_geo by layer](plots/by_layer.png)",
              "![q_geo by layer and head](plots/layer_head.png)", "", _layer_table(runs), ""]
    parts += _tokens_section(runs, token_runs, MIN_COUNT)
    family_tables = _family_tables(runs)
    if family_tables:
        parts += ["## By family", "",
                  "The layers of each kernel family together, run by run (`by_family` in summary.json). "
                  "What the ratio measures in each family: docs/families.md."
                  + (" `writes` says per what q_geo, q_arith and n are: per micro-step for "
                     "GatedDeltaProduct, per token for every other family; `q_geo per token` is per token "
                     "for every family and is the column to compare across families." if micro else ""),
                  "", *family_tables]
    if d_plot is not None:
        parts += ["## The preconditioner d", "", f"![d trajectory](plots/{d_plot.name})", "",
                  "The write-key preconditioner of one head over the first prompt, a panel for every run "
                  "that has one: eight channels and the mean over all channels (`osdn-diag report --d-head "
                  "LAYER.HEAD` picks the head).", ""]
    else:
        unstored = [name for name, (m, _) in zip(names, loaded) if m.get("capture_stored") is False
                    and any(layer.get("has_d") for layer in m.get("layers", []))]
        if unstored:
            parts += ["## The preconditioner d", "",
                      f"Not plotted: {', '.join(unstored)} ran with `--stream`, which stores no capture.", ""]
    if any("assumptions" in s for _, _, s in runs):
        box = next(s["assumptions"]["box"] for _, _, s in runs if "assumptions" in s)
        parts += [
            "## Assumption audit",
            "",
            f"What Theorem D.7 assumes, as measured: unit keys, β ∈ (0, 1), d inside [{box[0]}, "
            f"{box[1]}]^K, no state decay. Tokens with β < 1/d_max cannot meet the gated Newton "
            "condition β⟨d, k⊙k⟩ = 1 under unit keys. ‖k‖² is that of the keys exactly as the kernel "
            "read them: fla's chunk kernels read bf16-rounded unit keys in a bf16 model, and near "
            "β = 1 that rounding, not the model, sets q_t = (1 − β‖k‖²)². The hypotheses are checked "
            "per (prompt, layer, head) stream, over its tokens with a non-zero residual; a key counts as "
            "unit within 1e-3 plus (1 + u)² − 1, what rounding a unit key to the dtype the kernel read "
            "it in (unit roundoff u) can cause: 8.8e-3 in all for bf16, 1.0e-3 for fp32 (in brackets). "
            "The next table counts the same streams by the same definition. Per layer and head in "
            "summary.json.",
            "",
            _audit_table(runs),
            "",
        ]
    if comparators or not_applicable:
        box = (comparators or not_applicable)[0][1]["box"]
        parts += [
            "## Comparator gap and Theorem D.7",
            "",
            f"Per (prompt, layer, head) stream, over tokens with a nonzero residual: the best fixed "
            f"diagonal comparator in [{box[0]}, {box[1]}]^K, ε_T^diag = min_d 1/(2T) Σ (1 − β_t⟨d, "
            "k_t⊙k_t⟩)² (solved with a certificate; rows in comparator.parquet), ε_T at d ≡ 1 and at the "
            "last d, the realised regret of the trajectory against it, and the bound "
            "Π q_t ≤ (2ε_T + 2R_T/T)^T in log space — checked only on the streams where its hypotheses "
            "hold (unit keys, β ∈ (0, 1), d in the box, no decay, a valid token: the audit's definition "
            "above). With the realised regret the bound "
            "reduces to AM–GM, so it must hold there; the informative numbers are ε_T^diag and the "
            "regret.",
            "",
            *([_comparator_table(comparators), ""] if comparators else []),
            *_not_applicable_note(not_applicable, runs),
        ]
        if eps_plot is not None:
            parts += [f"![comparator gap against q_geo](plots/{eps_plot.name})", ""]
    retained = [(n, s["retained"]) for n, _, s in runs if s.get("retained")]
    if retained:
        parts += [
            "## Retained associations",
            "",
            "Mean of ‖S_t k_j − v_j‖² / ‖v_j‖² over earlier writes j, by distance t − j (t: the end of "
            "the first copy and the last token), and over all writes at the last token — 0 means the "
            "association is intact, 1 as if never written. A low q_t with a high retrieval error means "
            "local writes that overwrite memory.",
            "",
            _retained_table(retained),
            "",
            "![retained associations](plots/retained.png)",
            "",
        ]
    gated = [(n, m, s["post_decay"]) for n, m, s in runs if "post_decay" in s]
    if gated:
        parts += [
            "## Gated layers: post-decay ratio",
            "",
            "`f_t(S_t) / f_t(S̄_{t−1})`, against the state after the layer's own decay — the ratio the "
            "write itself controls (the table above uses the paper's pre-decay definition).",
            "",
            _contraction_table(gated, micro),
            "",
        ]
    text = "\n".join(parts)
    report = out / "report.md"
    atomic_write_text(report, text, root=out)
    if owner is not None:
        finish_stage(paths[owner], loaded[owner][0], "report")
    return report
