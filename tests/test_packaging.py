"""The distribution lists every subpackage (an explicit list, since proofs/ is mapped into the package)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "osdn_diag").rglob("__init__.py")
    } | {"osdn_diag.proofs"}
    assert found == listed


def test_builtin_models_and_tuning_tables_ship_as_package_data():
    """Every file of every built-in model, and every autotuning table, matches a package-data
    pattern (else a wheel lacks it)."""
    import fnmatch

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["osdn_diag"]
    files = [p.relative_to(ROOT / "osdn_diag").as_posix() for folder in ("builtin", "tuning")
             for p in (ROOT / "osdn_diag" / folder).rglob("*") if p.is_file()]
    assert any(f.endswith("model.safetensors") for f in files) and any(f.startswith("tuning/") for f in files)
    missing = [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert not missing, f"built-in files not in package-data: {missing}"


def test_public_ops_import_from_the_package():
    """``from osdn_diag.ops import ...`` gives each public kernel, the same object as its module's, with
    a docstring that states shapes; importing the package alone loads none of them."""
    import subprocess
    import sys

    code = ("import sys, osdn_diag.ops as ops; "
            "assert not any(m.startswith(('fla', 'triton')) for m in sys.modules), 'eager import'; "
            "print(sorted(ops.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['chunk_osdn', 'chunk_replay', 'fused_recurrent_osdn', 'fused_replay', 'osdn_precondition']"


def test_public_ops_are_the_modules_functions(fla_interpreter):
    import importlib

    from osdn_diag import ops

    for name, module in (("osdn_precondition", "phase1"), ("chunk_osdn", "osdn_chunk"),
                         ("fused_recurrent_osdn", "osdn_recurrent"), ("fused_replay", "replay"),
                         ("chunk_replay", "replay_chunk")):
        fn = getattr(ops, name)
        assert fn is getattr(importlib.import_module(f"osdn_diag.ops.{module}"), name)
        assert "[B, T, H" in (fn.__doc__ or "") or "[N, " in (fn.__doc__ or ""), name


def test_help_and_version_do_not_import_torch():
    """`osdn-diag --help` and `--version` answer without importing torch (seconds on a cold start);
    the package's callables still load on first use."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io; import osdn_diag.cli as cli\n"
            "for argv in (['--help'], ['--version'], ['run', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        assert cli.entry(argv) == 0, argv\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "import osdn_diag\n"
            "assert callable(osdn_diag.capture) and callable(osdn_diag.replay) and osdn_diag.Results\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_importing_models_registers_the_auto_classes():
    """``import osdn_diag.models`` registers "osdn" and "osgdn" with transformers' Auto classes, as
    ``import fla`` registers fla's (a fresh interpreter: nothing else has imported them); a bad
    MODEL argument is refused before fla is imported."""
    import subprocess
    import sys

    code = ("import sys, contextlib, io\n"
            "from osdn_diag.cli import entry\n"
            "err = io.StringIO()\n"
            "with contextlib.redirect_stderr(err):\n"
            "    assert entry(['run', 'random:nope', '--prompts', 'random', '--out', '/nonexistent/o']) == 2\n"
            "assert 'unknown preset' in err.getvalue() and 'fla' not in sys.modules, err.getvalue()\n"
            "import osdn_diag.models\n"
            "from transformers import AutoConfig, AutoModelForCausalLM\n"
            "for kind in ('osdn', 'osgdn'):\n"
            "    cfg = AutoConfig.for_model(kind, hidden_size=32, num_hidden_layers=1, num_heads=2, vocab_size=16)\n"
            "    model = AutoModelForCausalLM.from_config(cfg)\n"
            "    assert type(model).__name__ == kind.upper() + 'ForCausalLM', type(model)\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
