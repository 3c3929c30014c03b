"""The types of manifest.json and summary.json as osdn-diag writes them (:mod:`osdn_diag.runtime.schema`):
what passes and what is refused in one line naming the key. Damaged files met by the commands are in
tests/pipeline/test_damaged_files.py."""

from __future__ import annotations

import pytest

from osdn_diag.runtime.schema import SchemaError, check_manifest, check_summary

ENTRY = {"sha256": "0" * 64, "size": 5}
MANIFEST = {"run_id": "a" * 32, "stages": {"capture": True}, "world_size": 2, "seed": 0,
            "shards": {"capture/batch_00000/layer_000.safetensors": ENTRY}}
SUMMARY = {"run_id": "a" * 32, "q_geo": 0.5, "q_arith": 0.6, "n": 3, "by_layer": {"000": {"q_geo": 0.5, "q_arith": 0.6, "n": 3}},
           "fidelity": {"max_rel_error": 1e-7},
           "position_bins": {"edges": [0.0, 0.5, 1.0], "q_geo": [0.5, None], "q_arith": [0.6, None], "n": [3, 0],
                             "by_task": {"t": {"q_geo": [0.5, None], "q_arith": [0.6, None], "n": [3, 0]}},
                             "repeat_boundary": {}}}


def test_what_osdn_diag_writes_passes():
    check_manifest(MANIFEST, "m.json")
    check_manifest({**MANIFEST, "shards": {"x": {**ENTRY, "size": 0}}}, "m.json")
    check_summary(SUMMARY, "s.json")
    check_summary({**{k: v for k, v in SUMMARY.items() if k != "fidelity"}, "counterfactual": True}, "s.json")


@pytest.mark.parametrize("change,key", [
    ({"world_size": True}, "world_size"),
    ({"seed": 1.0}, "seed"),
    ({"shards": {"x": {**ENTRY, "size": -1}}}, "shards.x"),
    ({"shards": {"x": {**ENTRY, "size": False}}}, "shards.x"),
    ({"stages": {"capture": 1}}, "stages.capture"),
])
def test_a_manifest_key_of_another_type_is_refused_naming_it(change, key):
    with pytest.raises(SchemaError, match=rf"^m.json: key '{key}' should be .*; the file is damaged"):
        check_manifest({**MANIFEST, **change}, "m.json")


@pytest.mark.parametrize("change,key", [({"n": True}, "n"), ({"by_layer": {"000": {"q_geo": 0.5, "q_arith": 0.6, "n": False}}},
                                                          "by_layer.000")])
def test_a_summary_key_of_another_type_is_refused_naming_it(change, key):
    with pytest.raises(SchemaError, match=rf"^s.json: key '{key}' should be "):
        check_summary({**SUMMARY, **change}, "s.json")


def test_a_replays_summary_needs_its_fidelity():
    """Only a what-if (counterfactual) summary has no kernel output to compare, hence no fidelity."""
    with pytest.raises(SchemaError, match=r"^s.json: key 'fidelity' is missing"):
        check_summary({k: v for k, v in SUMMARY.items() if k != "fidelity"}, "s.json")


@pytest.mark.parametrize("change,message", [
    ({"position_bins": None}, "key 'position_bins' should be an object, found null"),
    ({"position_bins": {"edges": [0.0, 1.0], "q_geo": [1, 2], "q_arith": [1], "n": [1]}},
     "key 'position_bins' should be {q_geo, q_arith: 1 numbers, n: 1 integers}"),
    ({"by_head": {"1": {"q_geo": 1, "q_arith": 1, "n": 1}}}, "key 'by_head' holds an entry named '1'"),
    ({"by_layer": {"first": {"q_geo": 1, "q_arith": 1, "n": 1}}}, "key 'by_layer' holds an entry named 'first'"),
    ({"assumptions": None}, "key 'assumptions' should be an object"),
    ({"assumptions": {"box": [0.5, 2.0], "n": 4, "beta_min": 0.1}}, "key 'assumptions.max_unit_dev' is missing"),
    ({"assumptions": {"box": [0.5]}}, "key 'assumptions.box' should be a list of two numbers"),
    ({"post_decay": None}, "key 'post_decay' should be an object"),
    ({"post_decay": {"q_geo": 1, "q_arith": 1, "n": 1}}, "key 'post_decay.by_layer' is missing"),
    ({"comparator": {"box": [0.5, 2.0], "problems": 1}}, "key 'comparator.hypotheses_hold' is missing"),
    ({"recall": {"t": {"accuracy": 1.0}}}, "key 'recall.t.queries' is missing"),
    ({"retained": {"t": {"distance_bins": [[0, 1]], "mean_error": [], "mean_error_at_last_token": 0,
                         "mean_error_of_first_copy_at_last_token": 0}}}, "key 'retained.t.mean_error' should be"),
    ({"nonfinite": {"streams": 1, "of_streams": 2, "tokens": 3, "by_layer": {"x": 1}}},
     "key 'nonfinite.by_layer' holds an entry named 'x'"),
    ({"fidelity": {"max_rel_error": 0.1, "state": {"max_rel_error": 0.1}}}, "key 'fidelity.state.max_rounding_units'"),
    ({"replay": {"backend": 1}}, "key 'replay.backend' should be a string"),
])
def test_every_summary_key_the_report_and_view_read_is_checked(change, message):
    """Not only the headline numbers: a key the report, the view or the CLI reads, damaged, is refused
    naming the file and the key (not a TypeError in a table or a plot)."""
    with pytest.raises(SchemaError, match=r"^s.json: ") as err:
        check_summary({**SUMMARY, **change}, "s.json")
    assert message in str(err.value) and "the file is damaged" in str(err.value), err.value
