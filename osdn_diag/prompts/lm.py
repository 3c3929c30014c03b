"""Held-out text for the built-in language models: the ``lm-heldout`` and ``lm-heldout-pair`` suites.

A prompt is a window of exactly ``length`` consecutive tokens of one document of the corpus's
held-out split (:func:`osdn_diag.prompts.corpus.heldout_documents`; the Python standard library's
sources, tokenised with the built-in language models' tokenizer). The windows are drawn as follows,
from one CPU ``torch.Generator`` seeded with ``seed``:

1. the *eligible* documents are those with at least ``length`` tokens, in corpus order;
2. ``torch.randperm(len(eligible))`` orders them;
3. in that order, each document draws a start ``torch.randint(0, len(doc) - length + 1, (1,))`` and
   gives the window ``doc[start:start + length]`` — skipped when an earlier window has the same
   tokens — until ``num_prompts`` windows are found.

So every window comes from a different document, no two windows are equal, and prompt ``i`` depends
only on the corpus, ``length``, ``seed`` and ``i`` (asking for more prompts keeps the first ones).

Every prompt is scored on next-token prediction of the same targets, ``window[1:]``, through the
recall fields of its ``meta`` (``answer_positions``, ``answers``; position ``p``'s logits predict
token ``p + 1``): a single prompt (task ``lm-heldout``) is the window, scored at positions
``0 … L-2``; a twice prompt (task ``lm-heldout-twice``) is the window written twice,
``repeat_start = L``, scored at ``L … 2L-2`` — the second copy, read after the whole window was seen
once. ``meta["scoring"] = "next-token"`` tells these prompts from recall prompts, and
``meta["document"]``, ``meta["start"]`` say where the window came from.
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import corpus
from .prompt import Prompt

__all__ = ["SCORING", "heldout_windows", "lm_heldout_pair_suite", "lm_heldout_suite"]

#: ``meta["scoring"]`` of a prompt scored on next-token prediction of its text.
SCORING = "next-token"


def _check_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"argument {name}: expected an integer, got {type(value).__name__}")


def _check_vocab(vocab_size: int | None, directory: Path | None) -> None:
    """Refuse a model whose vocabulary is smaller than the corpus tokenizer's."""
    if vocab_size is None:
        return
    info = corpus.corpus_info(directory)
    need = info.get("vocab_size")
    if not isinstance(need, int) or isinstance(need, bool):
        where = (corpus.CORPUS_DIR if directory is None else Path(directory)) / "corpus.json"
        raise ValueError(f"{where}: no integer 'vocab_size' (the tokenizer's vocabulary size); write it again "
                         "with examples/train_lm.py prepare")
    if vocab_size < need:
        raise ValueError(
            f"the lm-heldout suites are tokenised with the built-in language models' tokenizer ({need:,} "
            f"tokens) and this model's vocabulary has {vocab_size:,}: use a builtin:lm-* model, or a JSONL "
            "file of prompts in the model's own tokens"
        )


def heldout_windows(
    *, num_prompts: int, length: int, seed: int, directory: Path | None = None
) -> list[tuple[int, int, list[int]]]:
    """``num_prompts`` windows of ``length`` tokens of the held-out documents, drawn as the module
    docstring describes: ``[(document index, start, tokens), ...]``, in the order drawn. ``directory``
    is the corpus directory (default :data:`osdn_diag.prompts.corpus.CORPUS_DIR`, read when called).
    Raises ``ValueError`` naming ``--length`` / ``--num-prompts`` when fewer than ``num_prompts``
    documents hold a distinct window of ``length`` tokens."""
    for name, value in (("--num-prompts", num_prompts), ("--length", length), ("--seed", seed)):
        _check_int(name, value)
    if num_prompts < 1:
        raise ValueError(f"argument --num-prompts: expected at least 1 prompt, got {num_prompts}")
    if length < 2:
        raise ValueError(f"argument --length: the lm-heldout suites score next-token prediction, which needs "
                         f"length >= 2, got {length}")
    docs = corpus.heldout_documents(directory)
    eligible = [i for i, d in enumerate(docs) if len(d) >= length]
    if len(eligible) < num_prompts:
        sizes = sorted((len(d) for d in docs), reverse=True)
        usable = sum(1 for n in sizes if n >= 2)
        if usable < num_prompts:
            raise ValueError(f"argument --num-prompts: the lm-heldout suites take every prompt from a different "
                             f"held-out document and {usable} of them have 2 tokens or more; expected "
                             f"--num-prompts <= {usable}")
        have = "1 held-out document has" if len(eligible) == 1 else f"{len(eligible)} held-out documents have"
        raise ValueError(
            f"argument --length: only {have} {length} tokens or more and the lm-heldout suites take each of "
            f"the {num_prompts} prompts from a different one; expected --length <= {sizes[num_prompts - 1]} "
            "(or fewer --num-prompts)"
        )
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(eligible), generator=gen).tolist()
    windows, seen = [], set()
    for j in order:
        doc = docs[eligible[j]]
        start = int(torch.randint(0, len(doc) - length + 1, (1,), generator=gen))
        tokens = doc[start:start + length]
        if tuple(tokens) in seen:
            continue
        seen.add(tuple(tokens))
        windows.append((eligible[j], start, tokens))
        if len(windows) == num_prompts:
            return windows
    raise ValueError(
        f"argument --num-prompts: only {len(windows)} of the {len(eligible)} held-out documents with {length} "
        f"tokens or more gave a window unlike the others'; expected --num-prompts <= {len(windows)} (or another "
        "--length)"
    )


def _prompt(id: int, doc: int, start: int, window: list[int], twice: bool) -> Prompt:
    length = len(window)
    shift = length if twice else 0
    return Prompt(
        id=id,
        task="lm-heldout-twice" if twice else "lm-heldout",
        input_ids=window + window if twice else list(window),
        repeat_start=length if twice else -1,
        meta={
            "scoring": SCORING,
            "document": doc,
            "start": start,
            # position p predicts token p + 1: the targets window[1:], in the second copy with twice
            "answer_positions": list(range(shift, shift + length - 1)),
            "answers": list(window[1:]),
        },
    )


def _windows(num_prompts, length, vocab_size, seed, directory):
    _check_vocab(vocab_size, directory)
    windows = heldout_windows(num_prompts=num_prompts, length=length, seed=seed, directory=directory)
    if vocab_size is not None:
        top = max(max(w) for _, _, w in windows)
        if top >= vocab_size or min(min(w) for _, _, w in windows) < 0:
            where = (corpus.CORPUS_DIR if directory is None else Path(directory)) / "heldout.safetensors"
            raise ValueError(f"{where}: token ids outside [0, {vocab_size}) of the model's vocabulary; the "
                             "corpus does not match its corpus.json")
    return windows


def lm_heldout_suite(
    *, num_prompts: int, length: int, vocab_size: int | None, seed: int, twice: bool,
    directory: Path | None = None,
) -> list[Prompt]:
    """Built-in suite ``lm-heldout``: :func:`heldout_windows` as prompts (ids ``0 … num_prompts-1``),
    task ``lm-heldout`` (``length`` tokens), or with ``twice`` task ``lm-heldout-twice`` (the window
    twice, ``2 * length`` tokens, ``repeat_start = length``), scored on ``window[1:]`` (module
    docstring). ``vocab_size`` is the model's: one smaller than the corpus tokenizer's is refused."""
    windows = _windows(num_prompts, length, vocab_size, seed, directory)
    return [_prompt(i, doc, start, w, twice) for i, (doc, start, w) in enumerate(windows)]


def lm_heldout_pair_suite(
    *, num_prompts: int, length: int, vocab_size: int | None, seed: int, twice: bool,
    directory: Path | None = None,
) -> list[Prompt]:
    """Built-in suite ``lm-heldout-pair``: the same ``num_prompts`` windows single (ids ``0 … n-1``,
    task ``lm-heldout``) then twice (ids ``n … 2n-1``, task ``lm-heldout-twice``); prompts ``i`` and
    ``n + i`` score the same targets. Equal to :func:`lm_heldout_suite` without then with ``twice``.
    It holds both variants already, so ``twice`` must be false."""
    if twice:
        raise ValueError(
            "argument 'twice': the lm-heldout-pair suite already holds every window single and twice; "
            "leave twice off (or use the lm-heldout suite with twice)"
        )
    windows = _windows(num_prompts, length, vocab_size, seed, directory)
    n = len(windows)
    return [_prompt(twice * n + i, doc, start, w, twice)
            for twice in (False, True) for i, (doc, start, w) in enumerate(windows)]
