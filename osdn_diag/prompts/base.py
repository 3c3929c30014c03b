"""Prompts: token sequences with a task name and the position where a repeated context starts.

A PROMPTS argument is a built-in suite name (:data:`SUITES`) or a JSONL file whose rows are

    {"input_ids": [1, 2, ...], "task": "..."}            or
    {"text": "...", "task": "..."}                        (tokenised with the model directory's tokenizer)

optionally with a query kept apart from the context — ``"query_ids": [...]`` or ``"query": "..."`` —
so that ``twice`` (JRT-style) repeats the context and not the query: ``context + context + query``.
``repeat_start`` is the position where the second copy begins (−1 when nothing is repeated).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from pathlib import Path

import torch

from .lm import lm_heldout_pair_suite, lm_heldout_suite
from .mqar import mqar_pair_suite, mqar_suite
from .prompt import Prompt

__all__ = ["Prompt", "SUITES", "load_prompts", "random_suite", "read_jsonl"]


def _twice(context: list[int], query: list[int], twice: bool) -> tuple[list[int], int]:
    if not twice:
        return context + query, -1
    return context + context + query, len(context)


def read_jsonl(
    path: str | Path,
    *,
    tokenize: Callable[[str], list[int]] | None = None,
    twice: bool = False,
    vocab_size: int | None = None,
) -> list[Prompt]:
    """Read a prompt file; errors name the file and line and what was expected."""
    path = Path(path)
    prompts: list[Prompt] = []
    with path.open("rb") as fh:  # decoded line by line, so that an encoding error names its line
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not UTF-8 text (byte {raw[err.start]:#04x} at column "
                                 f"{err.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            row = _parse_row(line, where)
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            _check_fields(row, where)
            context = _tokens(row, "input_ids", "text", where, tokenize, vocab_size, required=True)
            query = _tokens(row, "query_ids", "query", where, tokenize, vocab_size, required=False)
            ids, repeat = _twice(context, query, twice)
            task = _task(row, path.stem, where)
            meta = _answers(row, where, len(context) + len(query), len(context) if twice else 0, vocab_size)
            prompts.append(Prompt(id=len(prompts), task=task, input_ids=ids, repeat_start=repeat, meta=meta))
    if not prompts:
        raise ValueError(f"{path}: no prompts (expected one JSON object per line)")
    return prompts


#: The longest task name (characters). A task name is repeated on every row of residuals.parquet and
#: in every summary key: a 1 MB name doubled the command's memory, and no task needs more than a few words.
MAX_TASK_CHARS = 256


def _parse_row(line: str, where: str):
    """One JSONL row; a row nested too deeply for Python's parser (RecursionError) is refused like
    any other malformed row, naming its line."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply to read; a prompt row is one flat object") from None


#: The fields a prompt row is read for; any other is the user's own (an id, a source) and left alone.
FIELDS = ("input_ids", "text", "query_ids", "query", "task", "answer_positions", "answers")


def _check_fields(row: dict, where: str) -> None:
    """Refuse a row that gives a part of the prompt twice (ids and text: which one would be read is
    not what either says), and a field that is a near miss of one read (``txt``, ``answer``): ignored
    like the user's own fields, its prompt would be measured without it."""
    for ids_key, text_key in (("input_ids", "text"), ("query_ids", "query")):
        if ids_key in row and text_key in row:
            raise ValueError(f"{where}: fields {ids_key!r} and {text_key!r} both given; give one of them")
    for key in row:
        if key not in FIELDS:
            near = difflib.get_close_matches(str(key), FIELDS, n=1, cutoff=0.75)
            if near:
                raise ValueError(f"{where}: field {key!r} is not one osdn-diag reads; did you mean {near[0]!r}? "
                                 f"(the fields: {', '.join(FIELDS)}; others are left alone)")


def _task(row: dict, default: str, where: str) -> str:
    """The row's task name (``default``: the file's stem), a string UTF-8 can encode of at most
    :data:`MAX_TASK_CHARS`."""
    task = row.get("task", default)
    if not isinstance(task, str):
        raise ValueError(f"{where}: field 'task' must be a string, got {type(task).__name__}")
    try:
        task.encode("utf-8")
    except UnicodeEncodeError:  # a \udcff escape: the result tables cannot store it
        raise ValueError(f"{where}: field 'task' {task!r} holds a lone surrogate, which is not text; give a "
                         "name of Unicode characters") from None
    if len(task) > MAX_TASK_CHARS:
        raise ValueError(f"{where}: field 'task' is {len(task):,} characters long; give a name of at most "
                         f"{MAX_TASK_CHARS} (it is repeated on every row of the results)")
    return task


def _answers(row, where, length, shift, vocab_size) -> dict:
    """A recall prompt's ``answer_positions`` and ``answers`` (the model's prediction at position ``p``,
    the argmax of its next-token logits, should be ``answers[i]``): positions index the prompt as
    written (context then query); with ``--twice`` they move by the context's length, so that they
    are read after the context was seen once. ``{}`` for a prompt without answers."""
    if "answer_positions" not in row and "answers" not in row:
        return {}
    pos, ans = row.get("answer_positions"), row.get("answers")
    if pos is None or ans is None:
        raise ValueError(f"{where}: fields 'answer_positions' and 'answers' go together (give both, or neither)")
    for key, values in (("answer_positions", pos), ("answers", ans)):
        if not (isinstance(values, list) and values
                and all(isinstance(i, int) and not isinstance(i, bool) for i in values)):
            raise ValueError(f"{where}: field {key!r} must be a non-empty list of integers"
                             + (" (token ids)" if key == "answers" else " (positions in the prompt)"))
    if len(pos) != len(ans):
        raise ValueError(f"{where}: {len(pos)} answer_positions but {len(ans)} answers; give one answer per position")
    bad = [i for i in pos if not 0 <= i < length]
    if bad:
        raise ValueError(f"{where}: answer_positions {bad[:3]} outside the prompt's {length} tokens [0, {length})")
    if vocab_size is not None and any(i < 0 or i >= vocab_size for i in ans):
        raise ValueError(f"{where}: field 'answers' has token ids outside [0, {vocab_size})")
    return {"answer_positions": [i + shift for i in pos], "answers": list(ans)}


def _tokens(row, ids_key, text_key, where, tokenize, vocab_size, *, required):
    if ids_key in row:
        ids = row[ids_key]
        if not (isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise ValueError(f"{where}: field {ids_key!r} must be a list of integers")
        if vocab_size is not None and any(i < 0 or i >= vocab_size for i in ids):
            raise ValueError(f"{where}: field {ids_key!r} has token ids outside [0, {vocab_size})")
        if required and not ids:
            raise ValueError(f"{where}: field {ids_key!r} is empty")
        return list(ids)
    if text_key in row:
        text = row[text_key]
        if not isinstance(text, str):
            raise ValueError(f"{where}: field {text_key!r} must be a string")
        if tokenize is None:
            raise ValueError(
                f"{where}: field {text_key!r} needs a tokenizer, and the model has none "
                f"(give {ids_key!r} instead, or a model directory with tokenizer files)"
            )
        ids = list(tokenize(text))
        if required and not ids:
            raise ValueError(f"{where}: field {text_key!r} has no tokens (an empty text); give a non-empty one")
        if vocab_size is not None and any(i < 0 or i >= vocab_size for i in ids):
            bad = max(ids)
            raise ValueError(f"{where}: field {text_key!r} tokenizes to ids outside the model's vocabulary "
                             f"[0, {vocab_size}) (up to {bad}): the tokenizer is not this model's; give "
                             f"{ids_key!r} or a model whose tokenizer matches")
        return ids
    if required:
        raise ValueError(f"{where}: expected a field {ids_key!r} (list of token ids) or {text_key!r} (string)")
    return []


def random_suite(*, num_prompts: int, length: int, vocab_size: int, seed: int, twice: bool) -> list[Prompt]:
    """Uniformly random tokens (for random-weight models and benchmarks). With ``twice`` the first
    half is a context that is repeated in the second half."""
    if num_prompts < 1:
        raise ValueError(f"argument 'num_prompts': expected >= 1, got {num_prompts}")
    if length < (2 if twice else 1):
        raise ValueError(f"argument 'length': expected >= {2 if twice else 1}"
                         f"{' with twice (a context of one token, repeated)' if twice else ''}, got {length}")
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(num_prompts):
        if twice:
            ctx = torch.randint(0, vocab_size, (length // 2,), generator=gen).tolist()
            ids, repeat = _twice(ctx, [], True)
        else:
            ids, repeat = torch.randint(0, vocab_size, (length,), generator=gen).tolist(), -1
        prompts.append(Prompt(id=i, task="random-twice" if twice else "random", input_ids=ids, repeat_start=repeat))
    return prompts


#: Built-in suites: name -> builder(num_prompts, length, vocab_size, seed, twice). The MQAR suites
#: (``mqar``, ``mqar-pair``) and the held-out text suites (``lm-heldout``, ``lm-heldout-pair``) are added
#: at the end of this module.
SUITES: dict[str, Callable[..., list[Prompt]]] = {
    "random": random_suite, "mqar": mqar_suite, "mqar-pair": mqar_pair_suite,
    "lm-heldout": lm_heldout_suite, "lm-heldout-pair": lm_heldout_pair_suite,
}


def load_prompts(
    spec: str,
    *,
    vocab_size: int,
    tokenize: Callable[[str], list[int]] | None = None,
    twice: bool = False,
    num_prompts: int = 8,
    length: int = 512,
    seed: int = 0,
) -> list[Prompt]:
    """Resolve a PROMPTS argument: a built-in suite name or a JSONL file."""
    if spec in SUITES:
        if num_prompts < 1:  # checked here, before a run directory is touched
            raise ValueError(f"argument --num-prompts: expected at least 1 prompt of suite {spec!r}, got {num_prompts}")
        from ..runtime.usage import check_suite_size

        check_suite_size(num_prompts, length)
        return SUITES[spec](num_prompts=num_prompts, length=length, vocab_size=vocab_size, seed=seed, twice=twice)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(
            f"PROMPTS {spec!r}: neither a built-in suite ({', '.join(SUITES)}) nor an existing JSONL file"
        )
    return read_jsonl(path, tokenize=tokenize, twice=twice, vocab_size=vocab_size)
