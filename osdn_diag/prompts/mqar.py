"""Multi-query associative recall (MQAR): a training-batch generator and diagnostic prompt suites.

A sequence is a context of ``N`` key–value pairs followed by ``Q`` queries::

    k1 v1 k2 v2 … kN vN   q1 a1 q2 a2 … qQ aQ

Each ``q_i`` is a key of the context (the ``Q`` queried keys are distinct, in random order) and
``a_i`` the value paired with it there; the model has to predict ``a_i`` at the position of ``q_i``.
With ``twice`` (the JRT variant) the context is written twice before the queries,
``context + context + query``, and ``repeat_start = 2N`` is where the second copy begins.

The vocabulary is split by a rule of ``vocab_size`` alone, so that a model's vocabulary fixes the
task: keys are drawn without replacement from ``[1, vocab_size // 2)``, values with replacement
from ``[vocab_size // 2, vocab_size)``. Token 0 is never drawn; it is free for padding (the capture
pipeline right-pads with 0).

Single and twice sequences are drawn from the same random numbers — the draws do not depend on
``twice`` — so for one seed they hold the same associations and queries, and a comparison of the
two is paired.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from .prompt import Prompt

__all__ = [
    "IGNORE_INDEX",
    "MIN_VOCAB_SIZE",
    "MQARSpec",
    "mqar_batch",
    "mqar_pair_prompts",
    "mqar_pair_suite",
    "mqar_prompts",
    "mqar_suite",
    "recall_accuracy",
    "recall_by_task",
]

#: Label of positions that carry no loss (Hugging Face / ``torch.nn.CrossEntropyLoss`` default).
IGNORE_INDEX = -100

#: Smallest vocabulary: three keys ``{1, 2, 3}`` and four values ``{4, …, 7}``.
MIN_VOCAB_SIZE = 8


def _check_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"argument {name!r}: expected an integer, got {type(value).__name__}")


@dataclass(frozen=True)
class MQARSpec:
    """Shape of an MQAR task: ``num_pairs`` (N) key–value pairs in the context, ``num_queries``
    (Q ≤ N) of them asked, token ids below ``vocab_size``. ``num_pairs`` must be smaller than the
    number of keys, ``vocab_size // 2 - 1``."""

    vocab_size: int
    num_pairs: int
    num_queries: int

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_pairs", "num_queries"):
            _check_int(name, getattr(self, name))
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(f"argument 'vocab_size': expected >= {MIN_VOCAB_SIZE}, got {self.vocab_size}")
        if not 1 <= self.num_pairs < self.num_keys:
            raise ValueError(
                f"argument 'num_pairs': expected 1 <= num_pairs < {self.num_keys} (the keys "
                f"[1, {self.vocab_size // 2}) of vocab_size {self.vocab_size}), got {self.num_pairs}"
            )
        if not 1 <= self.num_queries <= self.num_pairs:
            raise ValueError(
                f"argument 'num_queries': expected 1 <= num_queries <= num_pairs = {self.num_pairs}, "
                f"got {self.num_queries}"
            )

    @property
    def key_ids(self) -> range:
        """Token ids keys are drawn from: ``[1, vocab_size // 2)``."""
        return range(1, self.vocab_size // 2)

    @property
    def value_ids(self) -> range:
        """Token ids values are drawn from: ``[vocab_size // 2, vocab_size)``."""
        return range(self.vocab_size // 2, self.vocab_size)

    @property
    def num_keys(self) -> int:
        return len(self.key_ids)

    def context_length(self, twice: bool) -> int:
        """Tokens before the first query: ``2N``, or ``4N`` with ``twice``."""
        return 2 * self.num_pairs * (2 if twice else 1)

    def length(self, twice: bool) -> int:
        """Tokens in a sequence: the context(s) and ``2Q`` query tokens."""
        return self.context_length(twice) + 2 * self.num_queries

    def answer_positions(self, twice: bool) -> list[int]:
        """Positions of the query keys ``q_i``, whose next-token logits predict the answers."""
        start = self.context_length(twice)
        return list(range(start, start + 2 * self.num_queries, 2))


def _draw(spec: MQARSpec, batch_size: int, generator: torch.Generator):
    """Keys ``[B, N]``, values ``[B, N]`` and queried pair indices ``[B, Q]``, on the CPU.

    The indices of the N largest of iid uniforms are a uniformly random N-subset in uniformly random
    order; ``topk`` finds them in O(K) per row where a full ``argsort`` of K keys is several times
    slower at large vocabularies.
    """
    scores = torch.rand(batch_size, spec.num_keys, generator=generator)
    keys = scores.topk(spec.num_pairs, dim=1).indices + spec.key_ids.start
    values = torch.randint(
        spec.value_ids.start, spec.value_ids.stop, (batch_size, spec.num_pairs), generator=generator
    )
    order = torch.rand(batch_size, spec.num_pairs, generator=generator).topk(spec.num_queries, dim=1).indices
    return keys, values, order


def _assemble(spec: MQARSpec, keys, values, order, twice: bool):
    """``input_ids`` and ``labels`` ``[B, T]`` from :func:`_draw`'s tensors."""
    batch_size = keys.shape[0]
    context = torch.stack((keys, values), dim=2).reshape(batch_size, 2 * spec.num_pairs)
    query = torch.stack((keys.gather(1, order), values.gather(1, order)), dim=2)
    parts = (context, context, query.reshape(batch_size, -1)) if twice else (context, query.reshape(batch_size, -1))
    ids = torch.cat(parts, dim=1)
    labels = torch.full_like(ids, IGNORE_INDEX)
    first_answer = spec.context_length(twice) + 1
    labels[:, first_answer::2] = ids[:, first_answer::2]
    return ids, labels


def mqar_batch(
    spec: MQARSpec,
    batch_size: int,
    *,
    twice: bool,
    generator: torch.Generator,
    device: str | torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A training batch: ``(input_ids, labels)``, both ``[batch_size, spec.length(twice)]`` int64.

    ``labels`` equals ``input_ids`` at the answer tokens ``a_i`` and is ``-100`` elsewhere, the
    Hugging Face causal-LM convention: the model shifts the labels by one itself, so the loss falls on
    the logits at the query keys ``q_i``. Every row is drawn from ``generator`` (a CPU generator, so
    the data order for a seed is the same on any device) and the result is moved to ``device`` at the
    end. A mixture of single and twice batches is the caller's: call once with each.
    """
    _check_int("batch_size", batch_size)
    if batch_size < 1:
        raise ValueError(f"argument 'batch_size': expected >= 1, got {batch_size}")
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        raise ValueError(
            "argument 'generator': expected a CPU torch.Generator (draws are made on the CPU and moved "
            "to 'device' afterwards)"
        )
    ids, labels = _assemble(spec, *_draw(spec, batch_size, generator), twice)
    if device is not None:
        ids, labels = ids.to(device), labels.to(device)
    return ids, labels


def _task(twice: bool) -> str:
    return "mqar-twice" if twice else "mqar"


def _prompt(spec: MQARSpec, id: int, ids: torch.Tensor, twice: bool) -> Prompt:
    positions = spec.answer_positions(twice)
    tokens = ids.tolist()
    return Prompt(
        id=id,
        task=_task(twice),
        input_ids=tokens,
        repeat_start=spec.context_length(False) if twice else -1,
        # Plain ints: the meta is spread into the capture manifest, which is JSON.
        meta={
            "num_pairs": spec.num_pairs,
            "num_queries": spec.num_queries,
            "answer_positions": positions,
            "answers": [tokens[p + 1] for p in positions],
        },
    )


def _draws(spec: MQARSpec, num_prompts: int, seed: int):
    """One draw per prompt from a single seeded generator, in order: prompt ``i`` depends only on the
    seed and ``i``, so asking for more prompts keeps the first ones."""
    _check_int("num_prompts", num_prompts)
    _check_int("seed", seed)
    if num_prompts < 1:
        raise ValueError(f"argument 'num_prompts': expected >= 1, got {num_prompts}")
    generator = torch.Generator().manual_seed(seed)
    return [_draw(spec, 1, generator) for _ in range(num_prompts)]


def mqar_prompts(spec: MQARSpec, *, num_prompts: int, seed: int, twice: bool) -> list[Prompt]:
    """``num_prompts`` MQAR prompts (task ``"mqar"`` or ``"mqar-twice"``, ids ``0 … num_prompts-1``).

    ``meta["answer_positions"]`` are the positions of the query keys (where the logits predict the
    answer), ``meta["answers"]`` the answer tokens. The same seed gives the same associations and
    queries with and without ``twice``.
    """
    return [_prompt(spec, i, _assemble(spec, *draw, twice)[0][0], twice)
            for i, draw in enumerate(_draws(spec, num_prompts, seed))]


def mqar_pair_prompts(spec: MQARSpec, *, num_prompts: int, seed: int) -> list[Prompt]:
    """Both variants of ``num_prompts`` draws: the single prompts (ids ``0 … n-1``, task ``"mqar"``)
    then the twice prompts (ids ``n … 2n-1``, task ``"mqar-twice"``); prompts ``i`` and ``n + i``
    hold the same associations and queries. Equal to :func:`mqar_prompts` without then with
    ``twice`` for the same seed."""
    draws = _draws(spec, num_prompts, seed)
    return [
        _prompt(spec, twice * num_prompts + i, _assemble(spec, *draw, twice)[0][0], twice)
        for twice in (False, True)
        for i, draw in enumerate(draws)
    ]


def _recall_hits(logits_or_predictions, prompt: Prompt) -> tuple[int, int]:
    meta = prompt.meta
    if "answer_positions" not in meta or "answers" not in meta:
        raise ValueError(
            f"prompt {prompt.id} (task {prompt.task!r}): no 'answer_positions'/'answers' in its meta, "
            "so not a recall prompt"
        )
    x = torch.as_tensor(logits_or_predictions)
    if x.dim() == 2:
        predictions = x.argmax(dim=-1)
    elif x.dim() == 1:
        if x.is_floating_point() or x.is_complex():
            raise ValueError(
                f"prompt {prompt.id}: a 1-D tensor must hold predicted token ids (integers), "
                f"got dtype {x.dtype}; pass logits as [T, vocab]"
            )
        predictions = x
    else:
        raise ValueError(f"prompt {prompt.id}: expected logits [T, vocab] or predictions [T], got shape {tuple(x.shape)}")
    if predictions.shape[0] < len(prompt):
        raise ValueError(
            f"prompt {prompt.id}: {predictions.shape[0]} positions for a prompt of {len(prompt)} tokens"
        )
    positions = torch.as_tensor(meta["answer_positions"], dtype=torch.long, device=predictions.device)
    answers = torch.as_tensor(meta["answers"], dtype=torch.long, device=predictions.device)
    return int((predictions[positions] == answers).sum()), len(meta["answers"])


def recall_accuracy(logits_or_predictions, prompt: Prompt) -> float:
    """Fraction of the prompt's queries answered right: the argmax of ``logits [T, vocab]`` (or the
    predicted ids ``[T]``) at ``meta["answer_positions"]`` compared with ``meta["answers"]``.

    ``T`` may exceed ``len(prompt)`` (a right-padded row of a batch); position ``t`` holds the
    prediction of token ``t + 1``, as a causal LM's logits do.
    """
    hits, total = _recall_hits(logits_or_predictions, prompt)
    if total == 0:
        raise ValueError(f"prompt {prompt.id}: no queries")
    return hits / total


def recall_by_task(
    predictions: Mapping[int, torch.Tensor], prompts: Iterable[Prompt]
) -> dict[str, dict[str, float | int]]:
    """Recall per task over ``prompts``: ``{task: {"accuracy": float, "queries": int}}``, tasks in
    order of first appearance. ``predictions`` maps a prompt id to its logits ``[T, vocab]`` or
    predicted ids ``[T]`` (as :func:`recall_accuracy`); the accuracy weights every query equally, not
    every prompt."""
    counts: dict[str, list[int]] = {}
    for prompt in prompts:
        if prompt.id not in predictions:
            raise ValueError(f"argument 'predictions': no entry for prompt id {prompt.id} (task {prompt.task!r})")
        hits, total = _recall_hits(predictions[prompt.id], prompt)
        tally = counts.setdefault(prompt.task, [0, 0])
        tally[0] += hits
        tally[1] += total
    return {task: {"accuracy": hits / total if total else float("nan"), "queries": total}
            for task, (hits, total) in counts.items()}


def _suite_spec(length: int, vocab_size: int) -> MQARSpec:
    """``length // 4`` pairs, all queried: a single prompt is then ``length`` tokens (up to 3 fewer)."""
    _check_int("length", length)
    _check_int("vocab_size", vocab_size)
    if length < 4:  # one pair and its query take four tokens; fewer would silently become four
        raise ValueError(f"argument 'length': the mqar suites need length >= 4 (one key-value pair and "
                         f"its query), got {length}")
    n = length // 4
    keys = vocab_size // 2 - 1
    if vocab_size >= MIN_VOCAB_SIZE and n >= keys:
        raise ValueError(
            f"argument 'length': the mqar suites put length // 4 = {n} key-value pairs in a prompt, and "
            f"vocab_size {vocab_size} has only {keys} keys; expected length <= {4 * (keys - 1) + 3}"
        )
    return MQARSpec(vocab_size=vocab_size, num_pairs=n, num_queries=n)


def mqar_suite(*, num_prompts: int, length: int, vocab_size: int, seed: int, twice: bool) -> list[Prompt]:
    """Built-in suite ``mqar``: N = max(1, length // 4) pairs and N queries over the model's
    vocabulary, so a single prompt has ``4N`` tokens and a twice prompt ``6N``."""
    return mqar_prompts(_suite_spec(length, vocab_size), num_prompts=num_prompts, seed=seed, twice=twice)


def mqar_pair_suite(*, num_prompts: int, length: int, vocab_size: int, seed: int, twice: bool) -> list[Prompt]:
    """Built-in suite ``mqar-pair``: :func:`mqar_suite`'s prompts single then twice, ``2 * num_prompts``
    in all. It holds both variants already, so ``twice`` must be false."""
    if twice:
        raise ValueError(
            "argument 'twice': the mqar-pair suite already holds every prompt single and twice; "
            "leave twice off (or use the mqar suite with twice)"
        )
    return mqar_pair_prompts(_suite_spec(length, vocab_size), num_prompts=num_prompts, seed=seed)
