"""Importing only the parts of fla that a run uses.

``import fla`` executes ``fla/__init__.py``, which imports every layer and model fla has; importing
any submodule (``fla.ops.utils.index``, say) executes ``fla/ops/__init__.py`` first, which imports
every op. On one H200 that costs 18 s per process, against 9.5 s for what a DeltaNet model needs
(``benchmarks/CHANGELOG.md``, series 12). :func:`import_lazily` replaces the four package
initialisers that import everything — ``fla``, ``fla.layers``, ``fla.models``, ``fla.ops`` — by
*shells*: package modules with the real ``__path__`` whose ``__init__.py`` has not run. Importing
``fla.layers.delta_net`` then executes that module and what it imports, nothing else.

A shell completes itself — runs its real ``__init__.py`` in place, once — the first time anything
other than a submodule is asked of it (``from fla.ops import chunk_delta_rule``, ``fla.layers.__all__``,
``dir(fla)``), so code written against plain ``import fla`` still works, only slower. fla's models
register themselves with transformers' Auto classes in ``fla/models/<name>/__init__.py``:
:func:`import_model_type` and :func:`config_class` import the one a ``model_type`` or config class
needs, found by reading (not importing) ``fla/models/*/configuration_*.py``.

fla also decorates helpers with ``torch.compile`` as its modules load (``fla.modules.activations``),
and each such decoration imports torch's inductor compiler: 540 modules, 0.7 s on a 2-core CPU and
several seconds on an H200 host, where its custom operators register slowly. :func:`import_lazily`
therefore defers ``torch.compile`` of a plain function until that function's first call — the
compilation happens at the first call anyway; only the import moves, and it is skipped when the
function never runs (called inside another compiled function, it is traced inline, as torch does
with a compiled one). Modules passed to ``torch.compile`` are compiled as usual, and the command line
gives ``torch.compile`` back when its command ends (:func:`restore_torch_compile`).

The shells are installed only where they are known to be right: fla 0.6.0 (both of its
distributions), fla not imported yet, and ``OSDN_DIAG_FLA_IMPORT`` not ``full`` (which restores the
plain ``import fla``, for comparison or if a future fla breaks the assumption). The command line
installs them for its model commands; library users who ``import fla`` themselves get plain fla.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
from pathlib import Path

__all__ = ["SHELLS", "config_class", "import_lazily", "import_model_type", "is_lazy", "restore_torch_compile"]

#: The fla versions whose package initialisers :func:`import_lazily` knows to be replaceable.
SUPPORTED = ("0.6.0",)
#: The package initialisers that import everything, parents first.
SHELLS = ("fla", "fla.layers", "fla.models", "fla.ops")
_ENV = "OSDN_DIAG_FLA_IMPORT"


def _installed_version() -> str | None:
    """fla's version if both of its distributions (fla-core: ops, modules; flash-linear-attention:
    layers, models) are installed at the same version, else ``None``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        core, full = version("fla-core"), version("flash-linear-attention")
    except PackageNotFoundError:
        return None
    return core if core == full else None


def is_lazy() -> bool:
    """Whether fla is loaded through shells (some package initialisers not run yet, or completed)."""
    module = sys.modules.get("fla")
    return module is not None and "_osdn_shell" in vars(module)


def import_lazily() -> bool:
    """Install the shells (see the module docstring); ``True`` if fla is now loaded lazily, ``False``
    if plain ``import fla`` applies (fla imported already, another version, or ``OSDN_DIAG_FLA_IMPORT=full``)."""
    if is_lazy():
        _defer_torch_compile()  # given back when an earlier command ended
        return True
    if os.environ.get(_ENV, "").strip().lower() == "full" or "fla" in sys.modules:
        return False
    version = _installed_version()
    if version not in SUPPORTED:
        return False
    installed = []
    for name in SHELLS:
        spec = None if name in sys.modules else importlib.util.find_spec(name)  # nothing executes
        if spec is None or spec.submodule_search_locations is None or spec.loader is None:
            for done in reversed(installed):  # not the layout this was written for: plain fla
                del sys.modules[done]
            return False
        module = importlib.util.module_from_spec(spec)
        module.__dict__.update(_osdn_shell=True, __getattr__=_completing_getattr(module),
                               __dir__=_completing_dir(module))
        if name == "fla":
            module.__version__ = version  # fla.utils asks for it while the shell is incomplete
            # fla's own __init__ extends its path over every sys.path entry holding an fla/ folder:
            # its two distributions (fla-core: ops, modules; flash-linear-attention: layers, models)
            # may be installed in different places.
            module.__path__ = pkgutil.extend_path(list(module.__path__), name)
        sys.modules[name] = module
        installed.append(name)
        if "." in name:
            parent, _, child = name.rpartition(".")
            setattr(sys.modules[parent], child, module)
    _defer_torch_compile()
    return True


def _defer_torch_compile() -> None:
    """Make ``torch.compile(fn, ...)`` of a plain function compile at the function's first call
    (see the module docstring); anything else goes to torch's own ``torch.compile`` at once."""
    import torch

    compile_now = torch.compile
    if getattr(compile_now, "_osdn_deferred", False):
        return

    def compile_on_first_call(model=None, **options):
        if model is None:  # @torch.compile(...) with options: the decorator
            return functools.partial(compile_on_first_call, **options)
        if not inspect.isfunction(model):  # a module, a method, a callable object: as torch does it
            return compile_now(model, **options)
        compiled = []

        @functools.wraps(model)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                # Inside another compiled function, as torch does with a compiled one: traced inline.
                return model(*args, **kwargs)
            if not compiled:
                compiled.append(compile_now(model, **options))
            return compiled[0](*args, **kwargs)

        return call

    compile_on_first_call._osdn_deferred = True
    compile_on_first_call.__wrapped__ = compile_now
    torch.compile = compile_on_first_call


def restore_torch_compile() -> None:
    """Give ``torch.compile`` back (the command line does when its command ends, so that Python code
    after it compiles as usual); functions decorated meanwhile stay deferred."""
    torch = sys.modules.get("torch")
    deferred = getattr(torch, "compile", None)
    if getattr(deferred, "_osdn_deferred", False):
        torch.compile = deferred.__wrapped__


def _complete(module) -> None:
    """Run a shell's real ``__init__.py`` in its namespace, once."""
    namespace = vars(module)
    getattr_ = namespace.pop("__getattr__", None)
    if getattr_ is None:
        return  # completed already (or completing: the initialiser asked for one of its own names)
    dir_ = namespace.pop("__dir__", None)
    try:
        module.__spec__.loader.exec_module(module)
    except BaseException:
        # Still a shell: the next access tries again (as a failed plain import would be retried).
        namespace.update(__getattr__=getattr_, __dir__=dir_)
        raise


def _submodule(module, name: str):
    """``module.name`` imported alone if it is a submodule (a file or package in its ``__path__``),
    else ``None``."""
    for folder in module.__path__:
        if (Path(folder, f"{name}.py").is_file() or Path(folder, name, "__init__.py").is_file()):
            return importlib.import_module(f"{module.__name__}.{name}")
    return None


def _completing_getattr(module):
    def __getattr__(name: str):
        # Dunders other than __all__ are probes (copy, inspect, pickle): they never complete a shell.
        if name.startswith("__") and name != "__all__":
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
        if not name.startswith("_"):
            found = _submodule(module, name)
            if found is not None:
                return found
        _complete(module)
        try:
            return vars(module)[name]
        except KeyError:
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}") from None

    return __getattr__


def _completing_dir(module):
    def __dir__() -> list[str]:
        _complete(module)
        return sorted(vars(module))

    return __dir__


@functools.cache
def _model_index() -> tuple[dict[str, str], dict[str, str]]:
    """``({model_type: package}, {config class name: package})`` of fla's models, each package a
    folder of ``fla/models``, read from the text of their ``configuration_*.py`` files."""
    module = sys.modules.get("fla")
    if module is not None:
        folders = list(getattr(module, "__path__", ()))
    else:
        spec = importlib.util.find_spec("fla")
        folders = [] if spec is None else pkgutil.extend_path(list(spec.submodule_search_locations or ()), "fla")
    by_type, by_class = {}, {}
    for folder in folders:
        for path in sorted(Path(folder, "models").glob("*/configuration_*.py")):
            text = path.read_text(encoding="utf-8")
            package = f"fla.models.{path.parent.name}"
            for match in re.finditer(r"^\s+model_type\s*=\s*['\"]([^'\"]+)['\"]", text, re.M):
                by_type.setdefault(match.group(1), package)
            for match in re.finditer(r"^class\s+(\w+Config)\b", text, re.M):
                by_class.setdefault(match.group(1), package)
    return by_type, by_class


def import_model_type(model_type: str | None) -> None:
    """Register fla's model of ``model_type`` (a config.json's) with transformers' Auto classes: its
    package alone when fla is loaded lazily, all of fla's models otherwise. A type that is not
    fla's is left to transformers (and to :mod:`osdn_diag.models`, which registers its own)."""
    if not is_lazy():
        import fla.models  # noqa: F401  (registers every fla model)
        return
    package = _model_index()[0].get(model_type)
    if package is not None:
        importlib.import_module(package)


def config_class(name: str):
    """fla's config class ``name`` (``DeltaNetConfig``, ...), its model registered, or ``None`` if
    fla has no config of that name."""
    if is_lazy():
        package = _model_index()[1].get(name)
        return None if package is None else getattr(importlib.import_module(package), name, None)
    import fla.models

    return getattr(fla.models, name, None)
