"""Prompt files and built-in suites: parsing, `twice`, determinism, and errors that name the line."""

from __future__ import annotations

import json

import pytest

from osdn_diag.prompts import load_prompts, random_suite, read_jsonl


def _write(tmp_path, rows):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_ids_and_twice(tmp_path):
    path = _write(tmp_path, [{"input_ids": [1, 2, 3], "query_ids": [9], "task": "t"}, "", {"input_ids": [4]}])
    once = read_jsonl(path)
    assert [p.input_ids for p in once] == [[1, 2, 3, 9], [4]]
    assert [p.repeat_start for p in once] == [-1, -1]
    assert once[1].task == "p"  # defaults to the file stem
    twice = read_jsonl(path, twice=True)
    assert twice[0].input_ids == [1, 2, 3, 1, 2, 3, 9] and twice[0].repeat_start == 3
    assert twice[1].input_ids == [4, 4] and twice[1].repeat_start == 1


def test_jsonl_text_uses_tokenizer(tmp_path):
    path = _write(tmp_path, [{"text": "ab", "query": "c"}])
    (p,) = read_jsonl(path, tokenize=lambda s: [ord(c) for c in s], twice=True)
    assert p.input_ids == [97, 98, 97, 98, 99] and p.repeat_start == 2


@pytest.mark.parametrize(
    "row,message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"task": "x"}, "expected a field 'input_ids'"),
        ({"input_ids": [1, "a"]}, "must be a list of integers"),
        ({"input_ids": [1, 999]}, r"outside \[0, 100\)"),
        ({"input_ids": [1, 100]}, r"outside \[0, 100\)"),  # ids run to vocab_size − 1
        ({"input_ids": [-1, 1]}, r"outside \[0, 100\)"),
        ({"input_ids": []}, "is empty"),
        ({"text": "hello"}, "needs a tokenizer"),
        ({"input_ids": [1], "task": 3}, "'task' must be a string"),
        ({"input_ids": [1], "text": "a"}, "fields 'input_ids' and 'text' both given; give one of them"),
        ({"input_ids": [1], "query_ids": [2], "query": "b"}, "fields 'query_ids' and 'query' both given"),
        ({"txt": "a"}, "field 'txt' is not one osdn-diag reads; did you mean 'text'"),
        ({"input_ids": [1], "answer_position": [0], "answers": [1]}, "did you mean 'answer_positions'"),
    ],
)
def test_malformed_row_names_the_line(tmp_path, row, message):
    path = _write(tmp_path, [{"input_ids": [1]}, row])
    with pytest.raises(ValueError, match=message) as err:
        read_jsonl(path, vocab_size=100)
    assert f"{path}:2" in str(err.value)


def test_fields_of_the_users_own_are_left_alone(tmp_path):
    rows = [{"input_ids": [1, 2], "id": "q-17", "source": "wiki", "meta": {"k": 1}, "label": 3}]
    (prompt,) = read_jsonl(_write(tmp_path, rows), vocab_size=100)
    assert prompt.input_ids == [1, 2] and prompt.meta == {}


def test_ids_from_0_to_vocab_size_minus_1_are_read(tmp_path):
    (prompt,) = read_jsonl(_write(tmp_path, [{"input_ids": [0, 99]}]), vocab_size=100)
    assert prompt.input_ids == [0, 99]


def test_random_suite_is_deterministic_and_twice_repeats():
    a = random_suite(num_prompts=3, length=10, vocab_size=50, seed=1, twice=True)
    b = random_suite(num_prompts=3, length=10, vocab_size=50, seed=1, twice=True)
    assert [p.input_ids for p in a] == [p.input_ids for p in b]
    assert all(p.input_ids[:5] == p.input_ids[5:] and p.repeat_start == 5 for p in a)
    c = random_suite(num_prompts=3, length=10, vocab_size=50, seed=2, twice=False)
    assert [p.input_ids for p in c] != [p.input_ids for p in a]


def test_unknown_prompt_spec(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a built-in suite"):
        load_prompts(str(tmp_path / "missing.jsonl"), vocab_size=10)


def test_jsonl_answers_are_recall_prompts(tmp_path):
    """``answer_positions`` index the prompt as written; ``--twice`` moves them past the first copy."""
    path = _write(tmp_path, [{"input_ids": [1, 2, 3], "query_ids": [9, 8], "answer_positions": [3, 1],
                              "answers": [5, 6]}, {"input_ids": [4]}])
    once, plain = read_jsonl(path, vocab_size=10)
    assert once.meta == {"answer_positions": [3, 1], "answers": [5, 6]} and plain.meta == {}
    (twice, _) = read_jsonl(path, twice=True)
    assert twice.meta == {"answer_positions": [6, 4], "answers": [5, 6]}
    assert twice.input_ids[6] == once.input_ids[3] and twice.input_ids[4] == once.input_ids[1]
    assert twice.manifest_entry()["answers"] == [5, 6]


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"answers": [1]}, "'answer_positions' and 'answers' go together"),
        ({"answer_positions": [0]}, "'answer_positions' and 'answers' go together"),
        ({"answer_positions": [0, 1], "answers": [1]}, "2 answer_positions but 1 answers"),
        ({"answer_positions": [3], "answers": [1]}, "answer_positions [3] outside the prompt's 3 tokens"),
        ({"answer_positions": [-1], "answers": [1]}, "outside the prompt's 3 tokens"),
        ({"answer_positions": [0], "answers": [10]}, "'answers' has token ids outside [0, 10)"),
        ({"answer_positions": [0], "answers": ["x"]}, "'answers' must be a non-empty list of integers (token ids)"),
        ({"answer_positions": [], "answers": []}, "'answer_positions' must be a non-empty list"),
    ],
)
def test_jsonl_answer_errors_name_the_line(tmp_path, extra, message):
    path = _write(tmp_path, [{"input_ids": [1]}, {"input_ids": [1, 2, 3], **extra}])
    with pytest.raises(ValueError, match=f"p.jsonl:2: .*{__import__('re').escape(message)}"):
        read_jsonl(path, vocab_size=10)
