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
           "fidelity": {"max_rel_error": 1e-7}}


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
