"""The held-out text suites ``lm-heldout`` / ``lm-heldout-pair``: the windows re-derived here from a
synthetic corpus written by this file, the next-token answers, determinism, the pair layout, and the
refusals that name the argument.

The draw is the one osdn_diag/prompts/lm.py documents (eligible documents: ≥ ``length`` tokens, in
corpus order; ordered by ``torch.randperm``; a start per document by ``torch.randint``; a window equal
to an earlier one skipped), written again below from that description. The documents are compared with
the numpy arrays this file saved, not with what the package reads back.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from osdn_diag.prompts import SUITES, corpus, load_prompts
from osdn_diag.prompts.lm import heldout_windows, lm_heldout_pair_suite, lm_heldout_suite

VOCAB = 97
LENGTHS = (5, 40, 12, 30, 64, 3, 25, 18)


def write_corpus(directory, docs, vocab_size=VOCAB, dtype=np.int16):
    """The shipped format (osdn_diag/prompts/corpus.py): ``tokens`` 1-D, ``offsets`` int64
    ``[num_docs + 1]``, and corpus.json with the tokenizer's ``vocab_size``."""
    directory.mkdir(parents=True, exist_ok=True)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(d) for d in docs])
    tokens = np.concatenate([np.asarray(d, dtype=dtype) for d in docs])
    save_file({"tokens": tokens, "offsets": offsets}, str(directory / "heldout.safetensors"))
    (directory / "corpus.json").write_text(json.dumps({"vocab_size": vocab_size, "heldout_tokens": len(tokens)}))
    return directory


@pytest.fixture
def docs():
    rng = np.random.default_rng(7)
    return [rng.integers(0, VOCAB, n).tolist() for n in LENGTHS]


@pytest.fixture
def corpus_dir(tmp_path, docs):
    return write_corpus(tmp_path / "lm-corpus", docs)


def expected_windows(docs, num_prompts, length, seed):
    """The documented draw: ``[(document, start, window)]``."""
    eligible = [i for i, d in enumerate(docs) if len(d) >= length]
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(eligible), generator=gen)
    out, seen = [], []
    for j in order:
        doc = docs[eligible[int(j)]]
        start = torch.randint(0, len(doc) - length + 1, (1,), generator=gen).item()
        window = doc[start:start + length]
        if window not in seen:
            seen.append(window)
            out.append((eligible[int(j)], start, window))
        if len(out) == num_prompts:
            break
    return out


@pytest.mark.parametrize("seed", [0, 1, 5])
@pytest.mark.parametrize("length", [2, 12, 25])
def test_windows_are_the_documented_draw(docs, corpus_dir, seed, length):
    n = sum(len(d) >= length for d in docs) - 1
    got = heldout_windows(num_prompts=n, length=length, seed=seed, directory=corpus_dir)
    assert got == expected_windows(docs, n, length, seed)


@pytest.mark.parametrize("twice", [False, True])
def test_prompts_are_windows_of_long_documents_scored_on_the_next_token(docs, corpus_dir, twice):
    length, n = 12, 5
    prompts = lm_heldout_suite(num_prompts=n, length=length, vocab_size=VOCAB, seed=3, twice=twice,
                               directory=corpus_dir)
    assert [p.id for p in prompts] == list(range(n))
    assert {p.task for p in prompts} == {"lm-heldout-twice" if twice else "lm-heldout"}
    windows = []
    for p in prompts:
        doc, start = p.meta["document"], p.meta["start"]
        window = docs[doc][start:start + length]
        assert len(docs[doc]) >= length and len(window) == length
        windows.append(window)
        if twice:
            assert p.input_ids == window + window and p.repeat_start == length and len(p) == 2 * length
            assert p.meta["answer_positions"] == list(range(length, 2 * length - 1))
        else:
            assert p.input_ids == window and p.repeat_start == -1 and len(p) == length
            assert p.meta["answer_positions"] == list(range(length - 1))
        # the targets are the window's tokens after the first, each the token after its position
        assert p.meta["answers"] == window[1:]
        assert [p.input_ids[i + 1] for i in p.meta["answer_positions"]] == window[1:]
        assert p.meta["scoring"] == "next-token"
        entry = p.manifest_entry()
        assert entry["scoring"] == "next-token" and json.loads(json.dumps(entry)) == entry
    assert len({p.meta["document"] for p in prompts}) == n  # a different document each
    assert len({tuple(w) for w in windows}) == n


def test_deterministic_prefix_stable_and_seeded(corpus_dir):
    def ids(**kw):
        base = dict(num_prompts=4, length=12, vocab_size=VOCAB, seed=0, twice=False, directory=corpus_dir)
        return [p.input_ids for p in lm_heldout_suite(**{**base, **kw})]

    assert ids() == ids()
    assert ids(num_prompts=2) == ids()[:2]
    assert ids(seed=1) != ids()


def test_pair_is_single_then_twice_of_the_same_windows(corpus_dir):
    kw = dict(num_prompts=3, length=10, vocab_size=VOCAB, seed=2, directory=corpus_dir)
    pair = lm_heldout_pair_suite(**kw, twice=False)
    single = lm_heldout_suite(**kw, twice=False)
    twice = lm_heldout_suite(**kw, twice=True)
    assert [p.id for p in pair] == list(range(6))
    assert [p.task for p in pair] == ["lm-heldout"] * 3 + ["lm-heldout-twice"] * 3
    assert [p.input_ids for p in pair] == [p.input_ids for p in single + twice]
    assert [p.meta for p in pair] == [p.meta for p in single + twice]
    for a, b in zip(pair[:3], pair[3:]):
        assert b.input_ids == a.input_ids + a.input_ids
        assert b.meta["answers"] == a.meta["answers"]  # the same targets, single and twice
    with pytest.raises(ValueError, match="argument 'twice': the lm-heldout-pair suite already holds"):
        lm_heldout_pair_suite(**kw, twice=True)


def test_registered_suites_read_the_corpus_directory(monkeypatch, corpus_dir):
    monkeypatch.setattr(corpus, "CORPUS_DIR", corpus_dir)
    assert {"lm-heldout", "lm-heldout-pair"} <= set(SUITES)
    pair = load_prompts("lm-heldout-pair", vocab_size=VOCAB, num_prompts=2, length=9, seed=4)
    assert [p.input_ids for p in pair] == [p.input_ids for p in lm_heldout_pair_suite(
        num_prompts=2, length=9, vocab_size=VOCAB, seed=4, twice=False, directory=corpus_dir)]
    assert [p.task for p in load_prompts("lm-heldout", vocab_size=VOCAB, num_prompts=2, length=9, twice=True)] \
        == ["lm-heldout-twice"] * 2


def test_int32_tokens(tmp_path, docs):
    directory = write_corpus(tmp_path / "c32", docs, dtype=np.int32)
    assert heldout_windows(num_prompts=3, length=20, seed=0, directory=directory) == expected_windows(docs, 3, 20, 0)


def test_equal_windows_are_drawn_once(tmp_path):
    same = list(range(10))
    directory = write_corpus(tmp_path / "dup", [same, [1] * 4, list(same), list(range(10, 20))])
    windows = heldout_windows(num_prompts=2, length=10, seed=0, directory=directory)
    assert len({tuple(w) for _, _, w in windows}) == 2
    with pytest.raises(ValueError, match=r"^argument --num-prompts: only 2 of the 3 held-out documents .* "
                                         r"expected --num-prompts <= 2"):
        heldout_windows(num_prompts=3, length=10, seed=0, directory=directory)


def test_refusals_name_the_argument(corpus_dir):
    kw = dict(vocab_size=VOCAB, seed=0, twice=False, directory=corpus_dir)
    # LENGTHS sorted: 64, 40, 30, 25, 18, 12, 5, 3 — four prompts from documents of >= 26 tokens: 3 exist
    with pytest.raises(ValueError, match=r"^argument --length: only 3 held-out documents have 26 tokens or "
                                         r"more .* expected --length <= 25 \(or fewer --num-prompts\)$"):
        lm_heldout_suite(num_prompts=4, length=26, **kw)
    with pytest.raises(ValueError, match=r"expected --length <= 64"):
        lm_heldout_pair_suite(num_prompts=1, length=65, **kw)
    with pytest.raises(ValueError, match=r"^argument --num-prompts: .* 8 of them have 2 tokens or more; "
                                         r"expected --num-prompts <= 8$"):
        lm_heldout_suite(num_prompts=9, length=2, **kw)
    with pytest.raises(ValueError, match=r"^argument --length: .* needs length >= 2, got 1$"):
        lm_heldout_suite(num_prompts=1, length=1, **kw)
    for message in (str(e) for e in _errors(corpus_dir)):
        assert "\n" not in message


def _errors(corpus_dir):
    for n, length in ((4, 26), (9, 2), (1, 1)):
        try:
            lm_heldout_suite(num_prompts=n, length=length, vocab_size=VOCAB, seed=0, twice=False, directory=corpus_dir)
        except ValueError as err:
            yield err


@pytest.mark.parametrize("suite", [lm_heldout_suite, lm_heldout_pair_suite])
def test_a_smaller_vocabulary_is_refused(tmp_path, docs, suite):
    directory = write_corpus(tmp_path / "big", docs, vocab_size=4096)
    with pytest.raises(ValueError) as err:
        suite(num_prompts=2, length=10, vocab_size=256, seed=0, twice=False, directory=directory)
    message = str(err.value)
    assert "\n" not in message
    assert "tokenised with the built-in language models' tokenizer (4,096 tokens)" in message
    assert "vocabulary has 256" in message and "builtin:lm-*" in message and "JSONL" in message
    # as large, or larger: accepted
    assert len(suite(num_prompts=2, length=10, vocab_size=4096, seed=0, twice=False, directory=directory)) >= 2


def test_missing_corpus_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="corpus.json is missing"):
        lm_heldout_suite(num_prompts=1, length=4, vocab_size=VOCAB, seed=0, twice=False, directory=tmp_path)


def test_a_vocabulary_one_token_smaller_is_refused_and_an_equal_one_accepted(tmp_path, docs):
    directory = write_corpus(tmp_path / "c", docs, vocab_size=VOCAB)
    kw = dict(num_prompts=2, length=10, seed=0, twice=False, directory=directory)
    with pytest.raises(ValueError, match=rf"\({VOCAB} tokens\) and this model's vocabulary has {VOCAB - 1}"):
        lm_heldout_suite(vocab_size=VOCAB - 1, **kw)
    assert len(lm_heldout_suite(vocab_size=VOCAB, **kw)) == 2


@pytest.mark.parametrize("top", [VOCAB - 1, VOCAB])
def test_token_ids_must_lie_below_the_vocabulary_size(tmp_path, top):
    """Ids are in [0, vocab_size): the largest allowed is vocab_size − 1 (a corpus.json that understates
    its tokenizer's size is caught by the ids themselves)."""
    doc = [top] + [1] * 11
    directory = write_corpus(tmp_path / "c", [doc], vocab_size=VOCAB)
    kw = dict(num_prompts=1, length=12, vocab_size=VOCAB, seed=0, twice=False, directory=directory)
    if top < VOCAB:
        assert lm_heldout_suite(**kw)[0].input_ids == doc
    else:
        with pytest.raises(ValueError, match=rf"heldout.safetensors: token ids outside \[0, {VOCAB}\)"):
            lm_heldout_suite(**kw)


def _path_with_first_byte(byte: int) -> str:
    import hashlib

    return next(p for i in range(100_000) if hashlib.sha256((p := f"m{i}.py").encode()).digest()[0] == byte)


def test_heldout_split_is_the_first_sha256_byte_below_the_boundary():
    """A path is held out when the first byte of its sha256 is below HELDOUT_BYTE (13): 12 is, 13 is not."""
    assert corpus.HELDOUT_BYTE == 13
    assert corpus.split_of(_path_with_first_byte(0)) == "heldout"
    assert corpus.split_of(_path_with_first_byte(12)) == "heldout"
    assert corpus.split_of(_path_with_first_byte(13)) == "train"
    assert corpus.split_of(_path_with_first_byte(255)) == "train"


@pytest.mark.parametrize("end", [-1, 1])
def test_offsets_that_do_not_end_at_the_tokens_end_are_refused(tmp_path, end):
    tokens = np.arange(10, dtype=np.int16)
    save_file({"tokens": tokens, "offsets": np.array([0, 4, 10 + end], dtype=np.int64)},
              str(tmp_path / "heldout.safetensors"))
    with pytest.raises(ValueError, match=r"heldout.safetensors: 'offsets' must run from 0 to len\(tokens\) = 10"):
        corpus.heldout_documents(tmp_path)
