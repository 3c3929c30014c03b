"""Autotuning choices recorded on one GPU and reused on the next machine of its kind
(:mod:`osdn_diag.runtime.tuning`). Triton's ``Autotuner`` runs here around a stand-in kernel that records
what it was asked to do, with the GPU's name pretended (the H200 measurement is in
benchmarks/RESULTS.md). Each check runs in a fresh interpreter: the patch is process-wide."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _fresh_python import run_json

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = """
import json, sys
from pathlib import Path
import torch
from triton.runtime.autotuner import Autotuner, Config
import osdn_diag.runtime.tuning as tuning

tuning._device_name = lambda *args: "NVIDIA Test GPU"
launches, timed = [], []

def kernel(x, n, m):
    pass

class StandIn:
    arg_names = ["x", "n", "m"]
    fn = staticmethod(kernel)

    def run(self, *args, grid, warmup, **kw):
        launches.append(kw["B"])

def autotuner(*blocks):
    def bench(call, quantiles):
        timed.append(len(launches))
        call()
        return [1.0, 1.0, 1.0]
    return Autotuner(StandIn(), StandIn.arg_names, [Config({"B": b}, num_warps=4) for b in blocks], key=["n"],
                     reset_to_zero=None, restore_value=None, do_bench=bench)

def table(path, choices, **head):
    data = {"format": 1, "device": "NVIDIA Test GPU", **tuning._versions(), **head,
            "choices": [{"kernel": __name__ + ".kernel", "key": k, "config": c} for k, c in choices]}
    Path(path).write_text(json.dumps(data))

x = torch.zeros(2)
"""


def _run(code: str, **env) -> dict:
    return run_json(PRELUDE + code, unset=("TRITON_INTERPRET", "OSDN_DIAG_TUNING"), **env)


def test_the_key_is_the_one_triton_files_its_choice_under():
    """tuning_key gives the key under which Triton's own Autotuner.run cached its choice: the key
    arguments' values, then every argument's dtype."""
    out = _run("""
tuner = autotuner(1, 2)
tuner.run(x, 5, 7, grid=(1,), warmup=False)
print(json.dumps(dict(cached=[repr(k) for k in tuner.cache], ours=repr(tuning.tuning_key(tuner, (x, 5, 7), {})))))
""")
    assert out["cached"] == [out["ours"]] == ["(5, 'torch.float32')"]


def test_a_recorded_choice_runs_without_timing_and_other_keys_autotune(tmp_path):
    """A (kernel, key) in the table launches its recorded configuration with nothing timed; a key
    the table does not hold is timed over every candidate as before."""
    out = _run(f"""
table({str(tmp_path / 't.json')!r}, [("(5, 'torch.float32')", str(Config({{"B": 3}}, num_warps=4)))])
tuning.use_recorded_choices()
tuner = autotuner(1, 2, 3)
tuner.run(x, 5, 0, grid=(1,), warmup=False)
seeded = dict(launches=list(launches), timed=list(timed), used=tuning.recorded_choices_used())
launches.clear(); timed.clear()
tuner.run(x, 6, 0, grid=(1,), warmup=False)
print(json.dumps(dict(seeded=seeded, other=dict(launches=launches, timed=len(timed)))))
""", OSDN_DIAG_TUNING=str(tmp_path / "t.json"))
    assert out["seeded"] == {"launches": [3], "timed": [], "used": 1}
    assert out["other"]["timed"] == 3 and out["other"]["launches"][-1] == 1  # equal timings: the first wins


def test_switched_off_or_recorded_elsewhere_autotunes_as_before(tmp_path):
    """OSDN_DIAG_TUNING=off ignores the tables; the shipped table of another Triton/fla version is
    ignored quietly; a configuration the kernel no longer has is ignored."""
    out = _run(f"""
import os
shipped = Path({str(tmp_path)!r}) / "shipped"; shipped.mkdir()
tuning.TABLES = shipped
table(shipped / "nvidia-test-gpu.json", [("(5, 'torch.float32')", str(Config({{"B": 3}}, num_warps=4)))], fla="0.0.1")
tuning.use_recorded_choices()
autotuner(1, 2, 3).run(x, 5, 0, grid=(1,), warmup=False)
other_version = len(timed); timed.clear()
tuning._STATE["table"] = None
table(shipped / "nvidia-test-gpu.json", [("(5, 'torch.float32')", str(Config({{"B": 9}}, num_warps=4)))])
autotuner(1, 2, 3).run(x, 5, 0, grid=(1,), warmup=False)
unknown_config = len(timed); timed.clear()
tuning._STATE["table"] = None
table(shipped / "nvidia-test-gpu.json", [("(5, 'torch.float32')", str(Config({{"B": 3}}, num_warps=4)))])
autotuner(1, 2, 3).run(x, 5, 0, grid=(1,), warmup=False)
shipped_used = len(timed) == 0 and launches[-1] == 3; timed.clear()
tuning._STATE["table"] = None
os.environ["OSDN_DIAG_TUNING"] = "off"
autotuner(1, 2, 3).run(x, 5, 0, grid=(1,), warmup=False)
print(json.dumps(dict(other_version=other_version, unknown_config=unknown_config, shipped_used=shipped_used,
                      off=len(timed))))
""")
    assert out == {"other_version": 3, "unknown_config": 3, "shipped_used": True, "off": 3}


@pytest.mark.parametrize("problem,message", [
    ("missing", "not a tuning table osdn-diag can read"),
    ("garbage", "not a tuning table osdn-diag can read"),
    ("bad entry", "a choice that is not {kernel, key, config} strings"),
    ("other gpu", "recorded with device 'NVIDIA Other GPU' (here 'NVIDIA Test GPU')"),
])
def test_a_table_named_by_the_user_that_does_not_apply_is_an_error(tmp_path, problem, message):
    path = tmp_path / "t.json"
    if problem == "garbage":
        path.write_text("{not json")
    if problem == "bad entry":
        path.write_text(json.dumps({"device": "NVIDIA Test GPU", "triton": "x", "fla": "y",
                                    "choices": [{"kernel": "k", "key": "(1,)"}]}))
    out = _run(f"""
if {problem!r} == "other gpu":
    table({str(path)!r}, [], device="NVIDIA Other GPU")
try:
    tuning.load_table("NVIDIA Test GPU")
    print(json.dumps(dict(error=None)))
except ValueError as err:
    print(json.dumps(dict(error=str(err))))
""", OSDN_DIAG_TUNING=str(path))
    assert out["error"] is not None and message in out["error"] and "OSDN_DIAG_TUNING=" in out["error"]


def test_saved_choices_add_to_a_table_of_the_same_gpu_and_refuse_another_file(tmp_path):
    """save_choices writes every choice of the autotuners that ran (timed here or taken from a
    table), added to what the file held; a file of another GPU is left as it was."""
    out = _run(f"""
tuning.use_recorded_choices()
path = Path({str(tmp_path)!r}) / "t.json"
table(path, [("(1, 'torch.float32')", "B: 7, num_warps: 4, num_ctas: 1, num_stages: 3, maxnreg: None")])
tuner = autotuner(1, 2)
tuner.run(x, 5, 0, grid=(1,), warmup=False)
n = tuning.save_choices(path)
saved = json.loads(path.read_text())
other = Path({str(tmp_path)!r}) / "other.json"
table(other, [], device="NVIDIA Other GPU")
before = other.read_text()
try:
    tuning.save_choices(other)
    refused = None
except ValueError as err:
    refused = str(err)
print(json.dumps(dict(n=n, saved=saved, refused=refused, untouched=other.read_text() == before)))
""", OSDN_DIAG_TUNING="off")
    assert out["n"] == 2
    saved = out["saved"]
    assert saved["device"] == "NVIDIA Test GPU" and saved["format"] == 1
    assert [(c["key"], c["config"].split(",")[0]) for c in saved["choices"]] == [
        ("(1, 'torch.float32')", "B: 7"), ("(5, 'torch.float32')", "B: 1")]
    assert all(c["kernel"] == "__main__.kernel" for c in saved["choices"])
    assert "not a tuning table of this GPU" in out["refused"] and out["untouched"]


def test_the_shipped_tables_name_their_gpu_and_versions():
    """Every shipped table is readable, named after its GPU, and holds fla's kernels only."""
    tables = sorted((ROOT / "osdn_diag" / "tuning").glob("*.json"))
    assert tables, "no shipped tuning table"
    from osdn_diag.runtime.tuning import _slug

    for path in tables:
        data = json.loads(path.read_text())
        assert path.stem == _slug(data["device"])
        assert data["fla"] == "0.6.0" and data["triton"] and data["format"] == 1
        assert data["choices"] and all(c["kernel"].startswith("fla.") for c in data["choices"])
        keys = [(c["kernel"], c["key"]) for c in data["choices"]]
        assert len(keys) == len(set(keys))


def test_a_named_table_is_checked_when_the_patch_is_installed(tmp_path):
    """OSDN_DIAG_TUNING=FILE is read when the command starts (before the model loads), not at the
    first autotuned launch in the middle of a batch."""
    out = _run(f"""
try:
    tuning.use_recorded_choices()
    print(json.dumps(dict(error=None)))
except ValueError as err:
    print(json.dumps(dict(error=str(err))))
""", OSDN_DIAG_TUNING=str(tmp_path / "missing.json"))
    assert out["error"] and "missing.json" in out["error"]


def test_save_tuning_refuses_an_existing_file_that_is_not_a_table_before_the_warmup(tmp_path):
    from osdn_diag.runtime.tuning import check_table_file

    from osdn_diag.runtime.tuning import _versions

    check_table_file(tmp_path / "new.json")  # a new file: fine
    for name, text in (("notes.json", '{"a": 1}'), ("list.json", "[1, 2]"),
                       ("entry.json", '{"device": "G", "triton": "t", "fla": "f", "choices": [{"kernel": "k"}]}')):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match="exists and is not a tuning table"):
            check_table_file(tmp_path / name)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"device": "NVIDIA Other GPU", **_versions(), "choices": []}))
    check_table_file(other)  # no GPU named: only its form is checked
    with pytest.raises(ValueError, match="recorded with device 'NVIDIA Other GPU'"):
        check_table_file(other, "NVIDIA H200")


def test_the_shipped_tables_are_where_the_lookup_reads():
    """The tables the package ships (``osdn_diag/tuning/*.json``, package data) are the folder
    :func:`osdn_diag.runtime.tuning.table_path` looks in: an H200 finds its table by its name."""
    from osdn_diag.runtime import tuning

    shipped = sorted(p.name for p in (ROOT / "osdn_diag" / "tuning").glob("*.json"))
    assert "nvidia-h200.json" in shipped
    assert sorted(p.name for p in tuning.TABLES.glob("*.json")) == shipped
    assert tuning.table_path("NVIDIA H200") == tuning.TABLES / "nvidia-h200.json"
    assert json.loads(tuning.table_path("NVIDIA H200").read_text())
