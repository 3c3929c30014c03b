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
    c.each(manifest, "files", _file_entry, "{sha256: string, size: integer}")
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


def check_summary(summary, path, again: str = "re-run the command that wrote it") -> None:
    """Refuse a ``summary.json`` (parsed) whose keys are not of the types osdn-diag writes. ``fidelity``
    is required except in a counterfactual (what-if) summary, which has no kernel output to compare."""
    c = _Checker(path, again)
    if not isinstance(summary, dict):
        raise SchemaError(f"{c.path}: not a JSON object; the file is damaged: {again}")
    c.check(summary, "run_id", lambda x: x is None or isinstance(x, str), "a string", required=True)
    for key in ("q_geo", "q_arith", "q_geo_per_token"):
        c.check(summary, key, _is_number, "a number or null", required=key != "q_geo_per_token")
    for key in ("n", "n_zero", "n_tokens", "world_size"):
        c.check(summary, key, _is_int, "an integer", required=key == "n")
    for key in ("by_layer", "by_head", "by_task"):
        c.check(summary, key, _dict, "an object of {name: {q_geo, q_arith, n}}", required=key == "by_layer")
        c.each(summary, key, _stats, "{q_geo: number, q_arith: number, n: integer}")
    c.check(summary, "fidelity", _dict, "an object", required=not summary.get("counterfactual"))
    c.check(summary.get("fidelity") or {}, "max_rel_error", _is_number, "a number or null", where="fidelity.")
    c.check(summary.get("fidelity") or {}, "state", lambda x: x is None or isinstance(x, dict), "an object",
            where="fidelity.")
    for key in ("position_bins", "post_decay", "comparator", "nonfinite", "recall", "retained", "by_family",
                "replay"):
        c.check(summary, key, lambda x: x is None or isinstance(x, dict), "an object")
    c.each(summary, "recall", _dict, "an object")
