"""The shapes of a run's JSON files, checked as they are read: one function per file kind.

``replay``, ``report`` and ``what-if`` index into ``manifest.json`` and ``summary.json`` freely; a file
damaged by hand or by a tool (``"stages": []``, ``"shards": null``, a summary without ``fidelity``,
a string where a number was) ended in an AttributeError, TypeError or KeyError deep in the report.
Here each key a reader uses is checked for its type, and a file that is not what osdn-diag writes is
refused in one line naming the file and the key, and saying to re-run the command that wrote it. Keys
are checked where present; only those every such file has are required. No torch, no pyarrow.
"""

from __future__ import annotations

import os
import re
from numbers import Real

__all__ = ["SchemaError", "check_manifest", "check_summary"]


class SchemaError(ValueError):
    """A run file whose content is not what osdn-diag writes (the message names the file and key)."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return x is None or (isinstance(x, Real) and not isinstance(x, bool))


def _kind(value) -> str:
    return "null" if value is None else {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
                                         int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


class _Checker:
    """Checks the keys of one file, raising :class:`SchemaError` that names it and says what to do."""

    def __init__(self, path, again: str):
        self.path, self.again = os.fspath(path), again

    def fail(self, key: str, expected: str, value) -> None:
        raise SchemaError(f"{self.path}: key {key!r} should be {expected}, found {_kind(value)}; the file is "
                          f"damaged: {self.again}")

    def check(self, obj: dict, key: str, test, expected: str, *, required: bool = False, where: str = "") -> None:
        name = f"{where}{key}"
        if key not in obj:
            if required:
                raise SchemaError(f"{self.path}: key {name!r} is missing; the file is damaged: {self.again}")
            return
        if not test(obj[key]):
            self.fail(name, expected, obj[key])

    def each(self, obj: dict, key: str, test, expected: str, *, where: str = "") -> None:
        """Every value of the object (or item of the list) at ``key``, when present."""
        value = obj.get(key)
        items = value.items() if isinstance(value, dict) else enumerate(value or ())
        for name, item in items:
            if not test(item):
                self.fail(f"{where}{key}.{name}" if isinstance(name, str) else f"{where}{key}[{name}]",
                          expected, item)


def _dict(x) -> bool:
    return isinstance(x, dict)


def _file_entry(x) -> bool:
    """A shard's or table part's ``{"sha256": hex, "size": bytes}``."""
    return (isinstance(x, dict) and isinstance(x.get("sha256"), str) and _is_int(x.get("size"))
            and x["size"] >= 0)


def _result_entry(x) -> bool:
    """A result file's entry: ``{"sha256", "size"}``, or a per-token table file's ``{"size", "rows"}``
    (a file listed so without a sha256 other than that table is refused when it is checked)."""
    return _file_entry(x) or (isinstance(x, dict) and "sha256" not in x and _is_int(x.get("size"))
                              and x["size"] >= 0 and _is_int(x.get("rows")) and x["rows"] >= 0)


def _tokens_entry(x) -> bool:
    """The manifest's ``tokens`` entry (``tokens.parquet``'s sha256 and size, what its text came from):
    an entry without its sha256 would leave the token table unchecked."""
    return (_file_entry(x) and x.get("file", "tokens.parquet") == "tokens.parquet"
            and _is_int(x.get("rows", 0)) and isinstance(x.get("text", False), bool)
            and (x.get("tokenizer") is None or isinstance(x["tokenizer"], dict)))


def _ints(x) -> bool:
    return isinstance(x, list) and all(_is_int(i) for i in x)


def check_manifest(manifest, path, again: str = "re-run the command that wrote it") -> None:
    """Refuse a ``manifest.json`` (parsed) whose keys are not of the types osdn-diag writes."""
    c = _Checker(path, again)
    if not isinstance(manifest, dict):
        raise SchemaError(f"{c.path}: not a JSON object; the file is damaged: {again}")
    c.check(manifest, "run_id", lambda x: isinstance(x, str), "a string", required=True)
    c.check(manifest, "stages", _dict, "an object of {stage: true/false}", required=True)
    c.each(manifest, "stages", lambda x: isinstance(x, bool), "true or false")
    for key in ("complete", "capture_stored", "counterfactual", "merge_needed", "twice", "shared_out"):
        c.check(manifest, key, lambda x: isinstance(x, bool), "true or false")
    for key in ("world_size", "batch_size", "seed"):
        c.check(manifest, key, _is_int, "an integer")
    for key in ("shards", "parts"):
        c.check(manifest, key, _dict, "an object of {file: {sha256, size}}")
        c.each(manifest, key, _file_entry, "{sha256: string, size: integer}")
    for key in ("model", "settings", "identity", "what_if", "versions"):
        c.check(manifest, key, _dict, "an object")
    c.check(manifest, "files", _dict, "an object of {file: {sha256, size}}")
    c.each(manifest, "files", _result_entry, "{sha256: string, size: integer} or {size: integer, rows: integer}")
    c.check(manifest, "kernels", lambda x: isinstance(x, list) and all(isinstance(k, str) for k in x),
            "a list of strings")
    c.check(manifest.get("model") or {}, "spec", lambda x: isinstance(x, str), "a string", where="model.")
    c.check(manifest, "layers_skipped", lambda x: isinstance(x, list) and all(
        isinstance(e, dict) and _is_int(e.get("layer")) and isinstance(e.get("type"), str) for e in x),
        "a list of {layer: integer, type: string}")
    c.check(manifest, "tokens", _tokens_entry, "an object {file, sha256: string, size: integer, rows: integer, "
            "text: true/false, tokenizer: object or null}")
    c.check(manifest, "prompts", lambda x: isinstance(x, list), "a list of prompt entries")
    for i, entry in enumerate(manifest.get("prompts") or ()):
        _check_prompt(c, entry, f"prompts[{i}].")
    c.check(manifest, "layers", lambda x: isinstance(x, list), "a list of layer entries")
    for i, entry in enumerate(manifest.get("layers") or ()):
        _check_layer(c, entry, f"layers[{i}].")


def _check_prompt(c: _Checker, entry, where: str) -> None:
    if not isinstance(entry, dict):
        c.fail(where.rstrip("."), "an object", entry)
    c.check(entry, "id", _is_int, "an integer", required=True, where=where)
    c.check(entry, "task", lambda x: isinstance(x, str), "a string", required=True, where=where)
    for key in ("length", "repeat_start", "recall_correct", "recall_queries", "recall_excluded"):
        c.check(entry, key, _is_int, "an integer", where=where)
    for key in ("answer_positions", "answers"):
        c.check(entry, key, _ints, "a list of integers", where=where)
    c.check(entry, "recall_nll", _is_number, "a number", where=where)


def _check_layer(c: _Checker, entry, where: str) -> None:
    if not isinstance(entry, dict):
        c.fail(where.rstrip("."), "an object", entry)
    c.check(entry, "layer", _is_int, "an integer", required=True, where=where)
    for key in ("heads", "head_k_dim", "head_v_dim"):
        c.check(entry, key, _is_int, "an integer", where=where)
    for key in ("name", "family", "kernel"):
        c.check(entry, key, lambda x: isinstance(x, str), "a string", where=where)
    for key in ("has_d", "gated"):
        c.check(entry, key, lambda x: isinstance(x, bool), "true or false", where=where)
    c.check(entry, "flags", _dict, "an object", where=where)


def _stats(x) -> bool:
    """One cell of ``by_layer``/``by_head``/``by_task``: numbers ``q_geo``, ``q_arith`` and a count ``n``."""
    return (isinstance(x, dict) and _is_number(x.get("q_geo")) and _is_number(x.get("q_arith"))
            and _is_int(x.get("n")))


def _real(x) -> bool:
    """A number that is there (not ``null``): one the report prints or draws as it is."""
    return x is not None and _is_number(x)


def _numbers(x) -> bool:
    return isinstance(x, list) and all(_is_number(i) for i in x)


def _layer_name(name) -> bool:
    """A ``by_layer`` key: the layer's number (``"003"``)."""
    return isinstance(name, str) and re.fullmatch(r"[0-9]{1,6}", name) is not None


def _head_name(name) -> bool:
    """A ``by_head`` key: ``"LLL.HHH"``, the layer's and the head's numbers."""
    return isinstance(name, str) and re.fullmatch(r"[0-9]{1,6}\.[0-9]{1,6}", name) is not None


def _family_stats(x) -> bool:
    """A ``by_family`` cell: :func:`_stats`, its ``unit`` and its per-token and own figures
    (``q_geo_*`` numbers, ``n_*`` counts)."""
    return (_stats(x) and isinstance(x.get("unit", ""), str)
            and all(_is_number(v) for k, v in x.items() if k.startswith("q_"))
            and all(_is_int(v) for k, v in x.items() if k.startswith("n_")))


def _bins(x, length: int) -> bool:
    """One curve of ``position_bins``: ``q_geo``, ``q_arith`` (numbers) and ``n`` (counts) per bin."""
    return (isinstance(x, dict) and all(_numbers(x.get(k)) and len(x[k]) == length for k in ("q_geo", "q_arith"))
            and _ints(x.get("n")) and len(x["n"]) == length)


def _box(x) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(_real(i) for i in x)


def _counts(x) -> bool:
    """``{name: count}`` (``hypotheses_failed``, ``nonfinite.by_layer``)."""
    return isinstance(x, dict) and all(_is_int(v) for v in x.values())


def _names(c: _Checker, obj: dict, key: str, test, expected: str, where: str = "") -> None:
    """Every key of the object at ``key`` (when it is one) passes ``test``."""
    value = obj.get(key)
    for name in value if isinstance(value, dict) else ():
        if not test(name):
            raise SchemaError(f"{c.path}: key {where + key!r} holds an entry named {name!r}, which should be "
                              f"{expected}; the file is damaged: {c.again}")


def _check_ratios(c: _Checker, s: dict, where: str = "") -> None:
    """The ratio statistics of a summary or of its ``post_decay``: overall, per layer, head, task and
    family, by relative position (``position_bins``)."""
    for key in ("q_geo", "q_arith", "q_geo_per_token"):
        c.check(s, key, _is_number, "a number or null", required=key != "q_geo_per_token", where=where)
    for key in ("n", "n_zero", "n_tokens", "excluded_nonfinite"):
        c.check(s, key, _is_int, "an integer", required=key == "n", where=where)
    for key in ("by_layer", "by_head", "by_task"):
        c.check(s, key, _dict, "an object of {name: {q_geo, q_arith, n}}", required=key == "by_layer" or bool(where),
                where=where)
        c.each(s, key, _stats, "{q_geo: number, q_arith: number, n: integer}", where=where)
    _names(c, s, "by_layer", _layer_name, "a layer number (\"003\")", where)
    _names(c, s, "by_head", _head_name, "a layer and head number (\"003.001\")", where)
    c.check(s, "by_family", _dict, "an object of {family: {q_geo, q_arith, n, unit}}", where=where)
    c.each(s, "by_family", _family_stats, "{q_geo: number, q_arith: number, n: integer, unit: string}", where=where)
    if where:
        return
    c.check(s, "position_bins", _dict, "an object", required=True)
    bins, at = s["position_bins"], "position_bins."
    c.check(bins, "edges", lambda x: isinstance(x, list) and len(x) >= 2 and all(_real(e) for e in x),
            "a list of at least two numbers", required=True, where=at)
    length = len(bins["edges"]) - 1
    curve = f"{{q_geo, q_arith: {length} numbers, n: {length} integers}} (one per bin of edges)"
    if not _bins(bins, length):
        c.fail("position_bins", curve, bins)
    c.check(bins, "by_task", _dict, "an object of {task: {q_geo, q_arith, n}}", where=at)
    c.each(bins, "by_task", lambda x: _bins(x, length), curve, where=at)
    c.check(bins, "repeat_boundary", _dict, "an object of {task: number}", where=at)
    c.each(bins, "repeat_boundary", _real, "a number", where=at)


#: The numbers of ``assumptions`` the report prints for a run whose audit measured something (``n``).
_AUDIT_NUMBERS = ("max_unit_dev", "beta_min", "beta_max", "d_min", "d_max", "share_zero_residual",
                  "share_newton_infeasible")
#: The numbers of ``comparator`` the report prints (``null``: over no stream).
_COMPARATOR_NUMBERS = ("eps_diag_mean", "eps_diag_median", "eps_at_ones_mean", "eps_at_final_d_mean", "regret_mean",
                       "share_newton_infeasible_mean", "share_newton_feasible", "share_newton_feasible_box",
                       "max_kkt_residual", "max_gap", "slack_min", "slack_mean")


def check_summary(summary, path, again: str = "re-run the command that wrote it") -> None:
    """Refuse a ``summary.json`` (parsed) whose keys are not of the types osdn-diag writes: every key
    the report, the view and the CLI read. ``fidelity`` is required except in a counterfactual
    (what-if) summary, which has no kernel output to compare."""
    c = _Checker(path, again)
    if not isinstance(summary, dict):
        raise SchemaError(f"{c.path}: not a JSON object; the file is damaged: {again}")
    c.check(summary, "run_id", lambda x: x is None or isinstance(x, str), "a string", required=True)
    c.check(summary, "world_size", _is_int, "an integer")
    c.check(summary, "counterfactual", lambda x: isinstance(x, bool), "true or false")
    _check_ratios(c, summary)
    c.check(summary, "fidelity", _dict, "an object", required=not summary.get("counterfactual"))
    fidelity = summary.get("fidelity") or {}
    c.check(fidelity, "max_rel_error", _is_number, "a number or null", where="fidelity.")
    c.check(fidelity, "state", lambda x: x is None or isinstance(x, dict), "an object", where="fidelity.")
    if fidelity.get("state"):
        state, at = fidelity["state"], "fidelity.state."
        for key in ("max_rel_error", "max_rounding_units"):
            c.check(state, key, _real, "a number", required=True, where=at)
        c.check(state, "by_layer", _dict, "an object of {layer: {working_precision, ...}}", required=True, where=at)
        c.each(state, "by_layer", lambda x: isinstance(x, dict) and isinstance(x.get("working_precision"), str),
               "{working_precision: string, ...}", where=at)
    # Present or absent, never null: the report reads these whenever the key is there.
    for key in ("post_decay", "assumptions", "replay", "what_if"):
        c.check(summary, key, _dict, "an object")
    if "post_decay" in summary:
        _check_ratios(c, summary["post_decay"], "post_decay.")
    for key in ("comparator", "nonfinite", "recall", "retained", "by_phase"):
        c.check(summary, key, lambda x: x is None or isinstance(x, dict), "an object")
    audit = summary.get("assumptions")
    if audit is not None:
        at = "assumptions."
        c.check(audit, "box", _box, "a list of two numbers [d_min, d_max]", required=True, where=at)
        for key in ("n", "streams", "hypotheses_hold"):
            c.check(audit, key, _is_int, "an integer", where=at)
        c.check(audit, "hypotheses_failed", _counts, "an object of {check: integer}", where=at)
        for key in (*_AUDIT_NUMBERS, "key_norm_tol", "unit_tol", "key_rounding_bound"):
            c.check(audit, key, _real if key in _AUDIT_NUMBERS and audit.get("n") else _is_number,
                    "a number" if key in _AUDIT_NUMBERS and audit.get("n") else "a number or null",
                    required=key in _AUDIT_NUMBERS and bool(audit.get("n")), where=at)
        c.check(audit, "keys_read_as", lambda x: isinstance(x, list) and all(isinstance(k, str) for k in x),
                "a list of strings", where=at)
        c.check(audit, "decay", lambda x: isinstance(x, bool), "true or false", required=bool(audit.get("n")), where=at)
        if "streams" in audit:  # the audit counted streams: how many hold and fail each check
            for key in ("hypotheses_hold", "hypotheses_failed"):
                c.check(audit, key, lambda x: True, "", required=True, where=at)
    comparator = summary.get("comparator")
    if comparator:
        at = "comparator."
        c.check(comparator, "box", _box, "a list of two numbers [d_min, d_max]", required=True, where=at)
        for key in ("problems", "hypotheses_hold", "bound_holds"):
            c.check(comparator, key, _is_int, "an integer", required=True, where=at)
        for key in _COMPARATOR_NUMBERS:
            c.check(comparator, key, _is_number, "a number or null", required=key in (
                "eps_diag_mean", "eps_at_ones_mean", "eps_at_final_d_mean", "regret_mean",
                "share_newton_infeasible_mean", "slack_min"), where=at)
        c.check(comparator, "hypotheses_failed", _counts, "an object of {check: integer}", where=at)
    nonfinite = summary.get("nonfinite") or {}
    for key in ("streams", "of_streams", "tokens"):
        c.check(nonfinite, key, _is_int, "an integer", required=bool(nonfinite.get("streams")), where="nonfinite.")
    c.check(nonfinite, "by_layer", _counts, "an object of {layer: integer}", where="nonfinite.")
    _names(c, nonfinite, "by_layer", _layer_name, "a layer number (\"003\")", "nonfinite.")
    c.check(nonfinite, "prompts", _ints, "a list of integers", where="nonfinite.")
    c.each(summary, "recall", _dict, "an object")
    for task, row in (summary.get("recall") or {}).items():
        at = f"recall.{task}."
        for key in ("correct", "queries", "excluded_nonfinite", "prompts"):
            c.check(row, key, _is_int, "an integer", required=key == "queries", where=at)
        for key in ("accuracy", "nll", "perplexity"):
            c.check(row, key, _is_number, "a number or null", required=key == "accuracy", where=at)
        c.check(row, "scoring", lambda x: isinstance(x, str), "a string", where=at)
    c.each(summary, "retained", _dict, "an object")
    for task, row in (summary.get("retained") or {}).items():
        at = f"retained.{task}."
        c.check(row, "distance_bins", lambda x: isinstance(x, list) and all(_box(b) for b in x),
                "a list of [from, to] pairs of numbers", required=True, where=at)
        c.check(row, "mean_error", lambda x: _numbers(x) and len(x) == len(row["distance_bins"]),
                "a list of numbers, one per distance bin", required=True, where=at)
        c.check(row, "n", _ints, "a list of integers", where=at)
        for key in ("mean_error_at_last_token", "mean_error_of_first_copy_at_last_token"):
            c.check(row, key, _is_number, "a number or null", required=True, where=at)
    c.each(summary, "by_phase", lambda x: isinstance(x, dict) and _is_number(x.get("q_geo"))
           and _is_int(x.get("n", 0)), "{q_geo: number, n: integer}")
    replay = summary.get("replay") or {}
    for key in ("backend", "dtype", "zero_residual"):
        c.check(replay, key, lambda x: isinstance(x, str), "a string", where="replay.")
