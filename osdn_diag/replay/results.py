"""Results of a replay: in memory (:func:`replay` of what :func:`osdn_diag.capture` recorded) or read
back from a finished run directory (:meth:`Results.load`, :func:`load_run`).

    with osdn_diag.capture(model) as cap:
        model(input_ids)
    res = osdn_diag.replay(cap)
    res.summary["q_geo"]; res.to_pandas()      # one row per (prompt, layer, head, pos)
    res.per_token()                            # one row per (prompt, pos), with the token and its text

Every sequence of every forward pass is one "prompt", numbered in order (give ``prompts`` to attach
tasks and repeat positions).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa

from ..capture.record import KernelCall
from ..capture.store import StoredCall
from ..prompts import Prompt
from .replayer import Replayer, filled_schema
from .runs import load_run

__all__ = ["Results", "load_run", "replay"]


@dataclass(repr=False)
class Results:
    """Replayed per-token table (pyarrow; one row per (prompt, layer, head, pos), the columns of
    ``residuals.parquet``) and its summary (the ``summary.json`` dictionary).

    From memory (:func:`replay`) or from a finished run directory (:meth:`load`); plot either with
    :mod:`osdn_diag.plot`.

    ``tokens``: the run's tokens, one row per (prompt, pos) with ``token_id`` and ``text`` (the
    columns of ``tokens.parquet``; ``text`` null where the model has no tokenizer), or ``None`` (a run
    written before runs stored their tokens, or an in-memory replay given no prompts).
    """

    table: pa.Table
    summary: dict
    tokens: pa.Table | None = None

    @classmethod
    def load(cls, run_dir) -> Results:
        """A finished run directory's ``residuals.parquet``, ``summary.json`` and ``tokens.parquet``
        (errors name what is missing, or a file another run wrote)."""
        from .runs import read_table
        from .tokens import read_tokens

        manifest, summary = load_run(run_dir)
        return cls(read_table(Path(run_dir) / "residuals.parquet"), summary, read_tokens(run_dir, manifest))

    def per_token(self, *, by_layer: bool = False) -> pa.Table:
        """One row per (prompt, pos) — per (prompt, layer, pos) with ``by_layer`` — with ``token_id``
        and ``text`` (null without :attr:`tokens`, or without a tokenizer), ``q_geo`` and ``q_arith``
        of the token's finite ratios over heads (and layers), and ``n``, their count (0: none, and the
        two means null). q_geo as the summary's: ``exp(mean log max(q, 1e-30))``, a micro-step
        family's ``token_ratio`` on its ``step = 0`` rows. Sorted by prompt, then pos (then layer). A
        pyarrow table; ``.to_pandas()`` for a DataFrame."""
        from .tokens import per_token

        return per_token(self.table, self.tokens, by_layer=by_layer)

    def view(self, *, label: str = "run", strips: int | None = None, strip_prompts=None):
        """The interactive view of these results (:func:`osdn_diag.view`): Jupyter shows it inline,
        ``.save(path)`` writes the page. Needs plotly (``pip install 'osdn-diag[view]'``). In memory
        there is no comparator table, so the ε_T^diag panel is empty; the d panel shows the
        key-weighted ⟨d, k⊙k⟩/‖k‖² from the table."""
        from ..view import view  # lazy: downstream of replay, and plotly is optional

        return view({label: self}, strips=strips, strip_prompts=strip_prompts)

    def __repr__(self) -> str:
        s = self.summary
        layers, tasks = len(s.get("by_layer", {})), sorted(s.get("by_task", {}))

        def g(x):
            return "null" if x is None else f"{x:.4g}"

        fid = s.get("fidelity", {})
        if s.get("counterfactual"):
            check = "counterfactual"
        elif fid.get("max_rel_error") is None:
            check = "fidelity not measured (reference kernels)"
        else:
            check = f"fidelity {fid['max_rel_error']:.1e}"
        return (f"Results(q_geo={g(s.get('q_geo'))}, q_arith={g(s.get('q_arith'))}, n={s.get('n', 0):,} "
                f"measurements over {layers} layer{'s' * (layers != 1)}, tasks {tasks or '-'}, {check}; "
                f".table: {self.table.num_rows:,} rows × {self.table.num_columns} columns)")

    def to_pandas(self):
        try:
            import pandas  # noqa: F401
        except ImportError as err:
            raise ImportError("Results.to_pandas() needs pandas: pip install pandas") from err
        return self.table.to_pandas()


def _check_prompts(prompts: Sequence[Prompt], lengths: list[int], generated: dict, forwards: int) -> list[Prompt]:
    """``prompts``, each the sequence it describes; refused where they are not the captured sequences:
    ``prompts[i]`` describes sequence ``i`` (``lengths[i]`` tokens), and a prompt of another length
    would put its tokens, task and repeat against another sequence's writes. A generated sequence
    (``generated[i] = (decode_start, tokens or None)``) may be given as its prompt alone: the tokens
    :meth:`Capture.generate` kept are appended."""
    if len(prompts) != len(lengths):
        raise ValueError(
            f"argument 'prompts': {len(prompts)} prompts for the {len(lengths)} sequences captured in "
            f"{forwards} forward pass{'es' if forwards != 1 else ''}; give one prompt per captured sequence, "
            "in the order the forward passes ran them")
    prompts = list(prompts)
    for i, (p, length) in enumerate(zip(prompts, lengths)):
        start, tokens = generated.get(i, (None, None))
        if start is not None and len(p.input_ids) == start and tokens is not None and start + len(tokens) == length:
            prompts[i] = replace(p, input_ids=list(p.input_ids) + tokens)
        elif len(p.input_ids) != length:
            raise ValueError(
                f"argument 'prompts': prompt {i} (id {p.id}) holds {len(p.input_ids)} token ids, but captured "
                f"sequence {i} is {length} tokens long; give the ids the model ran (with any BOS token the "
                "tokenizer added; a right-padded batch needs its attention_mask, or the padding in the ids)"
                + (f"; a generated stream: its prompt alone ({start} ids) or with the tokens generated" if start is not None
                   else ""))
    return prompts


def replay(
    capture: Iterable[KernelCall],
    *,
    prompts: Sequence[Prompt] | None = None,
    tokenizer=None,
    **replay_kw,
) -> Results:
    """Replay captured calls (a :class:`~osdn_diag.capture.context.Capture` or a list of
    :class:`KernelCall`) in fp32; options as :class:`osdn_diag.replay.Replayer`. Given ``prompts``,
    one per captured sequence in the order the forward passes ran them (``prompts[i]`` is prompt
    ``i`` of the results, whatever its ``id``; a count or a length that differs from the capture's is
    refused), the result's :attr:`Results.tokens` holds their ids, with their text where
    ``tokenizer`` (a transformers tokenizer) is given, and their tasks and repeats label the rows."""
    calls = list(getattr(capture, "calls", capture))
    if not calls:
        raise ValueError("argument 'capture': no calls were captured (did the model run inside it?)")
    forwards = sorted({c.forward for c in calls})
    offsets, lengths, generated, next_id = {}, [], {}, 0
    kept = getattr(capture, "generated", {})  # a Capture's generated tokens, by forward pass
    for f in forwards:
        first = next(c for c in calls if c.forward == f)
        micro = int(first.flags.get("micro_steps", 1))  # a record of several writes per token
        offsets[f] = next_id
        lengths += [(end - start) // micro for _, start, end in first.segments()]
        if first.flags.get("decode_start") is not None:  # a generated stream: one sequence
            generated[next_id] = (int(first.flags["decode_start"]), kept.get(f))
        next_id = len(lengths)
    if prompts is not None:
        prompts = _check_prompts(prompts, lengths, generated, len(forwards))
    infos = {pid: {"id": pid, "task": prompts[pid].task if prompts else "", "length": length,
                   "repeat_start": prompts[pid].repeat_start if prompts else -1}
             for pid, length in enumerate(lengths)}
    replayer = Replayer(infos, **replay_kw)
    tables = []
    for call in calls:
        n = len(call.segments())
        ids = list(range(offsets[call.forward], offsets[call.forward] + n))
        tables.append(replayer.add(StoredCall(batch=call.forward, prompts=ids, call=call)))
    tokens = None
    if prompts is not None:
        from ..prompts.text import TokenText
        from .tokens import token_table

        tokens = token_table({pid: prompts[pid].input_ids for pid in infos},
                             None if tokenizer is None else TokenText(tokenizer))
    # The columns no layer fills are left out, as a run directory's residuals.parquet leaves them
    columns = filled_schema(replayer.schema, tables).names
    return Results(table=pa.concat_tables(tables).select(columns), summary=replayer.summary(), tokens=tokens)
