"""Lazy import of fla (:mod:`osdn_diag.runtime.fla_import`): only the fla modules a run uses are executed,
shells complete themselves when asked for more, ``OSDN_DIAG_FLA_IMPORT=full`` restores plain ``import fla``,
and the model index agrees with fla's own registry. Each check runs in a fresh interpreter, since the
shells change process-wide import state; each lazy check also asserts that modules a plain ``import fla``
would load (RWKV, Mamba, ...) were not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Modules a plain ``import fla`` executes and a DeltaNet model never needs.
UNRELATED = ("fla.ops.rwkv6", "fla.layers.rwkv6", "fla.models.mamba", "fla.models.rwkv7")


def _run(code, **env):
    """Run ``code`` in a fresh interpreter (Triton's interpreter on, lazy import unless ``env`` says
    otherwise) and return the JSON its last line of stdout prints."""
    full = {k: v for k, v in os.environ.items() if k != "OSDN_DIAG_FLA_IMPORT"}
    full.update(TRITON_INTERPRET="1", **env)
    done = subprocess.run([sys.executable, "-c", code], env=full, cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_lazy_import_loads_only_what_is_asked_and_completes_on_demand():
    """Importing fla.layers.delta_net / fla.models.delta_net lazily loads no unrelated fla module; a
    submodule import keeps a shell incomplete; a non-submodule attribute completes it."""
    out = _run(f"""
import json, sys
from osdn_diag.runtime.fla_import import import_lazily, is_lazy
out = {{"installed": import_lazily()}}
import fla.layers.delta_net, fla.models.delta_net
out.update(version=fla.__version__, lazy=is_lazy(), unrelated=[m for m in {UNRELATED!r} if m in sys.modules])
from fla.layers import delta_net
out["layers_incomplete"] = "DeltaNet" not in vars(sys.modules["fla.layers"]) and "fla.layers.rwkv6" not in sys.modules
from fla.ops import chunk_delta_rule
import fla.ops.delta_rule
out["same_kernel"] = chunk_delta_rule is fla.ops.delta_rule.chunk_delta_rule
out["deltanet"] = fla.DeltaNet is fla.layers.delta_net.DeltaNet
out["still_lazy"] = is_lazy()
print(json.dumps(out))
""")
    assert out["installed"] is True and out["lazy"] is True and out["still_lazy"] is True
    assert out["version"] == "0.6.0"
    assert out["unrelated"] == []
    assert out["layers_incomplete"] is True
    assert out["same_kernel"] is True and out["deltanet"] is True


def test_full_setting_and_fla_imported_first_give_plain_fla():
    """``OSDN_DIAG_FLA_IMPORT=full``: no shells, ``import fla`` is the whole package; with fla already
    imported (and the setting gone), ``import_lazily()`` is False as well."""
    out = _run("""
import json, os, sys
from osdn_diag.runtime.fla_import import import_lazily, is_lazy
out = {"full": import_lazily()}
import fla
out.update(lazy=is_lazy(), count=len([m for m in sys.modules if m.startswith("fla")]),
           rwkv6="fla.ops.rwkv6" in sys.modules)
del os.environ["OSDN_DIAG_FLA_IMPORT"]
out["after_fla"] = import_lazily()
out["lazy_after"] = is_lazy()
print(json.dumps(out))
""", OSDN_DIAG_FLA_IMPORT="full")
    assert out["full"] is False and out["after_fla"] is False
    assert out["lazy"] is False and out["lazy_after"] is False
    assert out["rwkv6"] is True and out["count"] > 300


def test_model_index_agrees_with_fla():
    """``_model_index()`` maps every config class of ``fla.models.__all__`` and its ``model_type`` to the
    package that defines it, as a plain ``import fla.models`` registers them."""
    out = _run("""
import json
import fla, fla.models
from osdn_diag.runtime.fla_import import _model_index
by_type, by_class = _model_index()
rows = []
for name in fla.models.__all__:
    if name.endswith("Config"):
        cls = getattr(fla.models, name)
        rows.append([name, cls.model_type, cls.__module__.rsplit(".", 1)[0],
                     by_class.get(name), by_type.get(cls.model_type)])
print(json.dumps(rows))
""")
    assert len(out) >= 30
    for name, model_type, package, from_class, from_type in out:
        assert package.startswith("fla.models."), (name, package)
        assert from_class == package, (name, package, from_class)
        assert from_type == package, (name, model_type, package, from_type)


def test_config_class_imports_one_model_and_registers_it():
    """``config_class("DeltaNetConfig")`` under lazy import returns fla's class and registers
    ``delta_net`` with transformers, loading no other model; an unknown name gives None."""
    out = _run(f"""
import json, sys
from osdn_diag.runtime.fla_import import config_class, import_lazily, is_lazy
out = {{"installed": import_lazily()}}
cls = config_class("DeltaNetConfig")
import transformers
from fla.models.delta_net.configuration_delta_net import DeltaNetConfig
out["same_class"] = cls is DeltaNetConfig
out["registered"] = type(transformers.AutoConfig.for_model("delta_net")) is DeltaNetConfig
out["missing"] = config_class("NoSuchConfig")
out.update(lazy=is_lazy(), unrelated=[m for m in {UNRELATED!r} if m in sys.modules])
print(json.dumps(out))
""")
    assert out["installed"] is True and out["lazy"] is True
    assert out["same_class"] is True and out["registered"] is True
    assert out["missing"] is None
    assert out["unrelated"] == []


RUN_CODE = """
import json, sys
from osdn_diag.cli import main
rc = main(["run", "random:deltanet-tiny", "--prompts", "random", "--num-prompts", "2", "--length", "32",
           "--device", "cpu", "--out", sys.argv[1], "-q"])
print(json.dumps({"rc": rc, "count": len([m for m in sys.modules if m.startswith("fla")]),
                  "rwkv6": "fla.ops.rwkv6" in sys.modules,
                  # kernel sites of other families (capture patches only the modules a model imported)
                  "other_layers": [m for m in ("fla.layers.comba", "fla.layers.rwkv7",
                                               "fla.layers.gated_deltaproduct") if m in sys.modules]}))
"""


def _cli_run(out, **env):
    full = {k: v for k, v in os.environ.items() if k != "OSDN_DIAG_FLA_IMPORT"}
    full.update(TRITON_INTERPRET="1", **env)
    done = subprocess.run([sys.executable, "-c", RUN_CODE, str(out)], env=full, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cli_run_lazy_matches_full_import_with_fewer_modules(tmp_path):
    """``run`` through ``cli.main`` gives the same q_geo with lazy import (the default) as with
    ``OSDN_DIAG_FLA_IMPORT=full``, having loaded fewer fla modules, no RWKV ops, and no layer module
    of another family (capture's kernel sites included)."""
    lazy = _cli_run(tmp_path / "lazy")
    full = _cli_run(tmp_path / "full", OSDN_DIAG_FLA_IMPORT="full")
    assert lazy["rc"] == 0 and full["rc"] == 0
    q_lazy = json.loads((tmp_path / "lazy" / "summary.json").read_text())["q_geo"]
    q_full = json.loads((tmp_path / "full" / "summary.json").read_text())["q_geo"]
    assert q_lazy == q_full
    assert lazy["count"] < full["count"], (lazy, full)
    assert lazy["rwkv6"] is False and full["rwkv6"] is True
    assert lazy["other_layers"] == [], lazy


def test_saved_model_of_a_type_osdn_diag_does_not_import_loads_lazily(tmp_path):
    """A saved fla Comba model (``osdn_diag.models`` imports DeltaNet, Gated DeltaNet, KDA and
    MomentumDeltaNet, never Comba) loads under lazy import: ``import_model_type`` registers ``comba``
    from its config.json, and nothing else of fla's models is loaded."""
    saved = tmp_path / "comba"
    _run(f"""
import json
from osdn_diag.models import load_model
load_model("random:comba-tiny").model.save_pretrained({str(saved)!r}, safe_serialization=True)
print(json.dumps(None))
""")  # plain fla: osdn_diag.models alone installs no shells
    assert json.loads((saved / "config.json").read_text())["model_type"] == "comba"
    out = _run(f"""
import json, sys
from osdn_diag.runtime.fla_import import import_lazily, is_lazy
out = {{"installed": import_lazily()}}
from osdn_diag.models import load_model
out["comba_before"] = "fla.models.comba" in sys.modules
loaded = load_model({str(saved)!r})
out.update(cls=type(loaded.model).__module__ + "." + type(loaded.model).__name__, source=loaded.source,
           lazy=is_lazy(), unrelated=[m for m in {UNRELATED!r} if m in sys.modules])
print(json.dumps(out))
""")
    assert out["installed"] is True and out["lazy"] is True
    assert out["comba_before"] is False
    assert out["cls"] == "fla.models.comba.modeling_comba.CombaForCausalLM" and out["source"] == "directory"
    assert out["unrelated"] == []


def test_torch_compile_of_fla_helpers_is_deferred_to_their_first_call():
    """Under lazy import, fla's ``@torch.compile`` helpers (fla.modules.activations) no longer import
    torch's inductor compiler as they load; a deferred function computes what the function does,
    compiling at its first call; a module still gets torch's own compiled module at once."""
    out = _run("""
import json, sys, torch
from osdn_diag.runtime.fla_import import import_lazily
out = {"installed": import_lazily()}
import fla.modules.activations
out["lowering_after_fla"] = "torch._inductor.lowering" in sys.modules
f = torch.compile(lambda x: x * 2 + 1, backend="eager")
out["deferred"] = "torch._dynamo.eval_frame" not in repr(type(f)) and callable(f)
out["value"] = f(torch.arange(3.0)).tolist()
m = torch.compile(torch.nn.Linear(2, 2), backend="eager")
out["module"] = type(m).__name__
print(json.dumps(out))
""")
    assert out["installed"] is True
    assert out["lowering_after_fla"] is False
    assert out["deferred"] is True and out["value"] == [1.0, 3.0, 5.0]
    assert out["module"] == "OptimizedModule"


def _split_install(root: Path) -> Path:
    """fla laid out as its two distributions may be installed in two places: ``root/fla`` holds
    fla-core's part (every folder but layers and models, linked) and fla's ``__init__``; the real
    installation, later on sys.path, still holds layers and models."""
    import importlib.util

    real = Path(importlib.util.find_spec("fla").submodule_search_locations[0])
    target = root / "fla"
    target.mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name in ("layers", "models", "__pycache__"):
            continue
        if entry.name == "__init__.py":
            (target / entry.name).write_bytes(entry.read_bytes())
        else:
            (target / entry.name).symlink_to(entry)
    return root


def test_fla_split_over_two_folders_loads_lazily(tmp_path):
    """fla-core and flash-linear-attention in different sys.path entries (fla extends its path over
    both): the shells do too, so layers, models and their index are found."""
    split = _split_install(tmp_path / "split")
    out = _run("""
import json, sys
from osdn_diag.runtime.fla_import import import_lazily, is_lazy, _model_index
out = {"installed": import_lazily(), "lazy": is_lazy(), "path": len(sys.modules["fla"].__path__)}
import fla.layers.delta_net, fla.models.delta_net, fla.ops.delta_rule
out["index"] = _model_index()[0].get("delta_net")
out["first"] = sys.modules["fla.ops"].__path__[0]
print(json.dumps(out))
""", PYTHONPATH=f"{split}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    assert out["installed"] is True and out["lazy"] is True and out["path"] >= 2
    assert out["index"] == "fla.models.delta_net"
    assert out["first"].startswith(str(split))


def test_a_layout_it_does_not_know_leaves_no_shell_behind():
    """If a package to replace cannot be found, nothing stays installed: plain ``import fla`` then."""
    out = _run("""
import importlib.util, json, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "fla.ops" else real(name, *a)
from osdn_diag.runtime.fla_import import import_lazily, is_lazy
out = {"installed": import_lazily(), "lazy": is_lazy(), "left": [m for m in sys.modules if m.startswith("fla")]}
print(json.dumps(out))
""")
    assert out == {"installed": False, "lazy": False, "left": []}


def test_a_failing_initialiser_is_retried_like_a_failed_import():
    """A shell whose real ``__init__`` fails stays a shell: once the cause is gone, the next access
    completes it."""
    out = _run("""
import json, sys
from osdn_diag.runtime.fla_import import import_lazily
import_lazily()
import fla.layers
sys.modules["fla.layers.abc"] = None     # fla.layers' __init__ imports it first: now it fails
try:
    fla.layers.GatedDeltaNet
    first = "no error"
except ImportError as err:
    first = "ImportError"
del sys.modules["fla.layers.abc"]
print(json.dumps({"first": first, "then": fla.layers.GatedDeltaNet.__name__}))
""")
    assert out == {"first": "ImportError", "then": "GatedDeltaNet"}


def test_deferred_compile_inside_a_compiled_function_and_after_the_command():
    """A deferred function called inside another compiled one is traced inline (``fullgraph`` holds,
    as with torch's own); after ``cli.main`` returns, ``torch.compile`` is torch's again."""
    out = _run("""
import json, sys, torch
from osdn_diag.runtime.fla_import import import_lazily, restore_torch_compile
import_lazily()
@torch.compile(backend="eager")
def g(x):
    return x * 2
outer = torch.compile(lambda x: g(x) + 1, backend="eager", fullgraph=True)
value = outer(torch.ones(3)).tolist()
restore_torch_compile()
restored = not getattr(torch.compile, "_osdn_deferred", False)
from osdn_diag.cli import main
rc = main(["warmup", "random:deltanet-tiny", "--device", "cpu"])
after_main = not getattr(torch.compile, "_osdn_deferred", False)
import_lazily()  # the next command defers again
print(json.dumps({"value": value, "restored": restored, "rc": rc, "after_main": after_main,
                  "again": getattr(torch.compile, "_osdn_deferred", False)}))
""")
    assert out == {"value": [3.0, 3.0, 3.0], "restored": True, "rc": 0, "after_main": True, "again": True}
