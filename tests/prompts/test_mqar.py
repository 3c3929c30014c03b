"""MQAR: the layout of batches and prompts, determinism, the paired suite, recall scoring, and
errors that name the argument."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from osdn_diag.prompts import (
    SUITES,
    MQARSpec,
    Prompt,
    load_prompts,
    mqar_batch,
    mqar_pair_prompts,
    mqar_prompts,
    recall_accuracy,
    recall_by_task,
)

# Documented values (osdn_diag/prompts/mqar.py): labels are -100 (torch's and Hugging Face's ignore
# index, mqar_batch's docstring) off the answer tokens; the smallest vocabulary is 8 (keys {1, 2, 3},
# values {4, ..., 7}).
IGNORE_INDEX = -100
MIN_VOCAB_SIZE = 8


@st.composite
def specs(draw, max_vocab: int = 300) -> MQARSpec:
    vocab = draw(st.integers(MIN_VOCAB_SIZE, max_vocab))
    pairs = draw(st.integers(1, min(vocab // 2 - 2, 40)))
    queries = draw(st.integers(1, pairs))
    return MQARSpec(vocab, pairs, queries)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _check_row(spec: MQARSpec, ids: list[int], twice: bool) -> None:
    """One sequence: keys distinct and in range, values in range, the context repeated exactly under
    twice, and every query a context key followed by the value paired with it."""
    n, q = spec.num_pairs, spec.num_queries
    assert len(ids) == spec.length(twice) == 2 * n * (2 if twice else 1) + 2 * q
    context = ids[: 2 * n]
    keys, values = context[0::2], context[1::2]
    assert len(set(keys)) == n and all(k in spec.key_ids for k in keys)
    assert all(v in spec.value_ids for v in values)
    if twice:
        assert ids[2 * n : 4 * n] == context
    query = ids[spec.context_length(twice) :]
    asked = query[0::2]
    assert len(set(asked)) == q
    pairs = dict(zip(keys, values))
    assert all(a == pairs[k] for k, a in zip(asked, query[1::2]))


@given(spec=specs(), batch=st.integers(1, 4), seed=st.integers(0, 2**32 - 1), twice=st.booleans())
def test_batch_layout_and_labels(spec, batch, seed, twice):
    ids, labels = mqar_batch(spec, batch, twice=twice, generator=_gen(seed))
    assert ids.shape == labels.shape == (batch, spec.length(twice))
    assert ids.dtype == labels.dtype == torch.int64
    assert int(ids.min()) >= 1 and int(ids.max()) < spec.vocab_size  # token 0 is never drawn
    for row in ids.tolist():
        _check_row(spec, row, twice)
    # Labels only at the answers, so that after the model's shift the loss is at the query keys.
    answer = torch.zeros_like(ids, dtype=torch.bool)
    answer[:, [p + 1 for p in spec.answer_positions(twice)]] = True
    assert torch.equal(labels[answer], ids[answer])
    assert bool((labels[~answer] == IGNORE_INDEX).all())


@given(spec=specs(), batch=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_batch_single_and_twice_share_draws(spec, batch, seed):
    single, _ = mqar_batch(spec, batch, twice=False, generator=_gen(seed))
    twice, _ = mqar_batch(spec, batch, twice=True, generator=_gen(seed))
    n = spec.num_pairs
    assert torch.equal(twice[:, : 2 * n], single[:, : 2 * n])
    assert torch.equal(twice[:, 4 * n :], single[:, 2 * n :])


@given(spec=specs(), num=st.integers(1, 3), seed=st.integers(0, 2**32 - 1), twice=st.booleans())
def test_prompt_layout_and_meta(spec, num, seed, twice):
    prompts = mqar_prompts(spec, num_prompts=num, seed=seed, twice=twice)
    assert [p.id for p in prompts] == list(range(num))
    for p in prompts:
        _check_row(spec, p.input_ids, twice)
        assert p.task == ("mqar-twice" if twice else "mqar")
        assert p.repeat_start == (2 * spec.num_pairs if twice else -1)
        positions, answers = p.meta["answer_positions"], p.meta["answers"]
        assert positions == spec.answer_positions(twice)
        assert answers == [p.input_ids[t + 1] for t in positions]
        assert all(p.input_ids[t] in spec.key_ids for t in positions)
        entry = p.manifest_entry()
        assert json.loads(json.dumps(entry)) == entry
    # Prompt 0 is the first row a batch drawn from the same seed gets, and the batch's labels sit
    # one past the answer positions.
    ids, labels = mqar_batch(spec, 1, twice=twice, generator=_gen(seed))
    assert ids[0].tolist() == prompts[0].input_ids
    assert [t - 1 for t in (labels[0] != IGNORE_INDEX).nonzero().flatten().tolist()] == positions


def test_deterministic_for_a_seed_and_different_across_seeds():
    spec = MQARSpec(vocab_size=64, num_pairs=8, num_queries=4)
    a = mqar_batch(spec, 16, twice=False, generator=_gen(3))
    b = mqar_batch(spec, 16, twice=False, generator=_gen(3))
    c = mqar_batch(spec, 16, twice=False, generator=_gen(4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    first = mqar_prompts(spec, num_prompts=5, seed=7, twice=True)
    assert [p.input_ids for p in first] == [p.input_ids for p in mqar_prompts(spec, num_prompts=5, seed=7, twice=True)]
    assert [p.input_ids for p in first] != [p.input_ids for p in mqar_prompts(spec, num_prompts=5, seed=8, twice=True)]
    # Asking for more prompts keeps the first ones.
    more = mqar_prompts(spec, num_prompts=9, seed=7, twice=True)
    assert [p.input_ids for p in more[:5]] == [p.input_ids for p in first]
    # Rows of a batch differ from one another.
    assert len({tuple(r) for r in a[0].tolist()}) == 16


def test_batch_moves_to_device():
    spec = MQARSpec(vocab_size=32, num_pairs=4, num_queries=4)
    ids, labels = mqar_batch(spec, 2, twice=False, generator=_gen(0), device="cpu")
    assert ids.device.type == labels.device.type == "cpu"


def test_pair_prompts_share_associations_and_queries():
    spec = MQARSpec(vocab_size=100, num_pairs=6, num_queries=3)
    n = 4
    pair = mqar_pair_prompts(spec, num_prompts=n, seed=11)
    assert [p.id for p in pair] == list(range(2 * n))
    assert [p.task for p in pair] == ["mqar"] * n + ["mqar-twice"] * n
    single = mqar_prompts(spec, num_prompts=n, seed=11, twice=False)
    twice = mqar_prompts(spec, num_prompts=n, seed=11, twice=True)
    assert [p.input_ids for p in pair] == [p.input_ids for p in single + twice]
    assert [p.meta for p in pair] == [p.meta for p in single + twice]
    for s, t in zip(pair[:n], pair[n:]):
        ctx = 2 * spec.num_pairs
        assert t.input_ids[:ctx] == t.input_ids[ctx : 2 * ctx] == s.input_ids[:ctx]
        assert t.input_ids[2 * ctx :] == s.input_ids[ctx:]
        assert t.meta["answers"] == s.meta["answers"]


def _oracle(prompt: Prompt) -> torch.Tensor:
    """Predictions of a perfect causal LM: position t predicts token t + 1."""
    return torch.tensor(prompt.input_ids[1:] + [0])


@pytest.mark.parametrize("twice", [False, True])
def test_recall_accuracy_oracle_and_shifted(twice):
    spec = MQARSpec(vocab_size=50, num_pairs=5, num_queries=4)
    for p in mqar_prompts(spec, num_prompts=3, seed=0, twice=twice):
        oracle = _oracle(p)
        assert recall_accuracy(oracle, p) == 1.0
        logits = torch.nn.functional.one_hot(oracle, spec.vocab_size).float()
        assert recall_accuracy(logits, p) == 1.0
        # Padded on the right, as a row of a batch of unequal lengths.
        assert recall_accuracy(torch.cat([logits, torch.zeros(3, spec.vocab_size)]), p) == 1.0
        # Off by one: each query position predicts itself, a key, never the value asked for.
        assert recall_accuracy(torch.tensor(p.input_ids), p) == 0.0


def test_partial_accuracy_and_query_weighting():
    spec = MQARSpec(vocab_size=40, num_pairs=6, num_queries=4)
    (p,) = mqar_prompts(spec, num_prompts=1, seed=5, twice=False)
    pred = _oracle(p)
    wrong = p.meta["answer_positions"][:1]
    pred[wrong] = 0
    assert recall_accuracy(pred, p) == pytest.approx(3 / 4)

    one = MQARSpec(vocab_size=40, num_pairs=2, num_queries=1)
    (a,) = mqar_prompts(one, num_prompts=1, seed=1, twice=False)
    b = Prompt(id=1, task="mqar", input_ids=p.input_ids, meta=p.meta)
    wrong_b = _oracle(b)
    wrong_b[b.meta["answer_positions"]] = 0
    c = Prompt(id=2, task="mqar-twice", input_ids=p.input_ids, meta=p.meta)
    got = recall_by_task({0: _oracle(a), 1: wrong_b, 2: pred}, [a, b, c])
    # One right out of 1 + 4 queries: weighted by queries, not a mean over prompts (which is 1/2).
    assert got == {"mqar": {"accuracy": pytest.approx(1 / 5), "queries": 5},
                   "mqar-twice": {"accuracy": pytest.approx(3 / 4), "queries": 4}}
    with pytest.raises(ValueError, match="'predictions'.*prompt id 2"):
        recall_by_task({0: _oracle(a), 1: wrong_b}, [a, b, c])


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: MQARSpec(MIN_VOCAB_SIZE - 1, 1, 1), "'vocab_size'"),
        (lambda: MQARSpec(20, 9, 1), "'num_pairs'"),  # keys are [1, 10): nine of them, N must be < 9
        (lambda: MQARSpec(20, 0, 1), "'num_pairs'"),
        (lambda: MQARSpec(20, 3, 4), "'num_queries'"),
        (lambda: MQARSpec(20, 3, 0), "'num_queries'"),
        (lambda: MQARSpec(20.0, 3, 1), "'vocab_size'"),
        (lambda: mqar_batch(MQARSpec(20, 3, 1), 0, twice=False, generator=_gen(0)), "'batch_size'"),
        (lambda: mqar_batch(MQARSpec(20, 3, 1), 2, twice=False, generator=0), "'generator'"),
        (lambda: mqar_prompts(MQARSpec(20, 3, 1), num_prompts=0, seed=0, twice=False), "'num_prompts'"),
        (lambda: load_prompts("mqar", vocab_size=20, length=40), "'length'"),
        (lambda: load_prompts("mqar", vocab_size=4, length=8), "'vocab_size'"),
        (lambda: load_prompts("mqar-pair", vocab_size=64, length=8, twice=True), "'twice'"),
    ],
)
def test_errors_name_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_bounds_are_inclusive_where_documented():
    spec = MQARSpec(MIN_VOCAB_SIZE, MIN_VOCAB_SIZE // 2 - 2, MIN_VOCAB_SIZE // 2 - 2)
    assert spec.key_ids == range(1, 4) and spec.value_ids == range(4, 8)
    assert MQARSpec(20, 8, 8).num_keys == 9  # N = 8 is the largest below nine keys


def test_recall_accuracy_rejects_bad_inputs():
    spec = MQARSpec(vocab_size=40, num_pairs=3, num_queries=2)
    (p,) = mqar_prompts(spec, num_prompts=1, seed=0, twice=False)
    with pytest.raises(ValueError, match="predicted token ids"):
        recall_accuracy(torch.zeros(len(p)), p)
    with pytest.raises(ValueError, match="positions for a prompt"):
        recall_accuracy(torch.zeros(len(p) - 1, dtype=torch.long), p)
    with pytest.raises(ValueError, match="not a recall prompt"):
        recall_accuracy(torch.zeros(3, dtype=torch.long), Prompt(id=0, task="random", input_ids=[1, 2, 3]))


@pytest.mark.parametrize("twice", [False, True])
def test_load_prompts_mqar_suite(twice):
    assert {"mqar", "mqar-pair"} <= set(SUITES)
    prompts = load_prompts("mqar", vocab_size=256, length=50, num_prompts=3, seed=2, twice=twice)
    n = 50 // 4
    spec = MQARSpec(256, n, n)
    assert len(prompts) == 3 and all(len(p) == (6 if twice else 4) * n for p in prompts)
    assert [p.input_ids for p in prompts] == [
        p.input_ids for p in mqar_prompts(spec, num_prompts=3, seed=2, twice=twice)
    ]
    for p in prompts:
        _check_row(spec, p.input_ids, twice)
    assert len(load_prompts("mqar", vocab_size=16, length=4)[0]) == 4  # one pair and its query
    with pytest.raises(ValueError, match="length >= 4"):  # refused, not silently made 4 tokens
        load_prompts("mqar", vocab_size=16, length=2)


def test_load_prompts_mqar_pair_suite():
    prompts = load_prompts("mqar-pair", vocab_size=256, length=32, num_prompts=3, seed=2)
    assert [p.id for p in prompts] == list(range(6))
    assert [p.task for p in prompts] == ["mqar"] * 3 + ["mqar-twice"] * 3
    assert [p.meta["answers"] for p in prompts[:3]] == [p.meta["answers"] for p in prompts[3:]]
    json.dumps([p.manifest_entry() for p in prompts])
