"""Autotuning choices recorded on one kind of GPU, reused on the next machine of that kind.

fla's chunk kernels are autotuned: on a machine that has never run a model, Triton compiles and
times every candidate configuration of each (kernel, tuning key) before the first launch. For the
paper-scale DeltaNet run on one H200 that was 151 configurations of 11 kernels, 53 s of the
command's first run even with the candidates compiled in parallel (``benchmarks/CHANGELOG.md``,
series 12). The choice is a function of the kernel, its tuning key (mostly head count, head
dimensions, chunk size and dtypes; for fla's l2 norm, layer norm and chunk cumsum also a block count
of the tokens or the batch size), the GPU, Triton and fla.

The package ships the choices made on the GPUs it is benchmarked on, one table per GPU
(``osdn_diag/tuning/<gpu>.json``). On a machine whose GPU name, Triton and fla versions match a
table, a (kernel, key) found in it runs its recorded configuration, one of fla's own candidates,
without compiling and timing the others; every other (kernel, key) autotunes as before. The
kernels' results do not depend on which candidate runs beyond floating-point rounding (the
candidates differ in block sizes and pipelining), as with autotuning itself, whose choice can
differ between two machines of one kind.

``OSDN_DIAG_TUNING=off`` ignores the tables (fla's autotuning always runs); ``OSDN_DIAG_TUNING=FILE``
uses FILE instead of the shipped table. ``osdn-diag warmup MODEL --save-tuning FILE`` writes the
choices of a run in the same format, for a GPU or model shape the package has no table for.
"""

from __future__ import annotations

import json
import os
import re
import weakref
from pathlib import Path

from .cache_paths import OFF as _OFF

__all__ = ["ENV", "TABLES", "check_table_file", "load_table", "recorded_choices_used", "save_choices", "table_path",
           "tuning_key", "use_recorded_choices"]

ENV = "OSDN_DIAG_TUNING"
TABLES = Path(__file__).resolve().parents[1] / "tuning"  # osdn_diag/tuning/: the package data
FORMAT = 1

_TUNERS: weakref.WeakSet = weakref.WeakSet()   # every autotuner that ran since the patch
_STATE: dict = {"table": None, "used": 0}       # table: {(kernel, key repr): config str}, loaded lazily


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import triton

    try:
        fla = version("flash-linear-attention")
    except PackageNotFoundError:  # pragma: no cover - fla is a dependency
        fla = None
    return {"triton": triton.__version__, "fla": fla}


def _slug(device_name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")


def _named_file() -> Path | None:
    """The FILE ``OSDN_DIAG_TUNING`` names; ``None`` when it is unset or off."""
    setting = os.environ.get(ENV, "").strip()
    return Path(setting).expanduser() if setting and setting.lower() not in _OFF else None


def table_path(device_name: str) -> Path | None:
    """The table to use on ``device_name``: ``OSDN_DIAG_TUNING``'s FILE, else the shipped one;
    ``None`` when switched off."""
    if os.environ.get(ENV, "").strip().lower() in _OFF:
        return None
    return _named_file() or TABLES / f"{_slug(device_name)}.json"


def _mismatch(recorded: dict, device_name: str) -> str | None:
    """How a table's ``recorded`` device, Triton and fla differ from ``device_name`` and the
    installed versions (``"triton '3.5.0' (here '3.6.0')"``); ``None`` when they agree."""
    here = {"device": device_name, **_versions()}
    differ = [f"{n} {recorded[n]!r} (here {here[n]!r})" for n in recorded if recorded[n] != here[n]]
    return ", ".join(differ) or None


def _read(path: Path) -> tuple[dict, dict[tuple[str, str], str]]:
    """``(recorded, choices)`` of the table at ``path``: ``recorded`` its device, Triton and fla,
    ``choices`` ``{(kernel, repr(key)): str(config)}``; ``ValueError`` for anything else."""
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        raise ValueError("no list of choices")
    recorded = {n: data[n] for n in ("device", "triton", "fla")}
    choices = {}
    for e in data["choices"]:
        if not (isinstance(e, dict) and all(isinstance(e.get(n), str) for n in ("kernel", "key", "config"))):
            raise ValueError(f"a choice that is not {{kernel, key, config}} strings: {e!r}"[:200])
        choices[(e["kernel"], e["key"])] = e["config"]
    return recorded, choices


def load_table(device_name: str) -> dict[tuple[str, str], str]:
    """``{(kernel, repr(tuning key)): str(config)}`` for ``device_name`` under the installed Triton
    and fla; empty where there is no table or it was recorded elsewhere. A FILE named by
    ``OSDN_DIAG_TUNING`` that is missing, unreadable or recorded on another GPU or Triton/fla
    version is an error (``ValueError``): it was asked for by name."""
    path, explicit = table_path(device_name), _named_file() is not None
    if path is None or (not explicit and not path.is_file()):
        return {}
    try:
        recorded, choices = _read(path)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{ENV}={path}: not a tuning table osdn-diag can read ({err}); write one with "
                         f"`osdn-diag warmup MODEL --save-tuning FILE`, or set {ENV}=off") from None
    differ = _mismatch(recorded, device_name)
    if differ:
        if explicit:
            raise ValueError(f"{ENV}={path}: recorded with {differ}; its choices do not apply to this "
                             f"machine. Record a table here with `osdn-diag warmup MODEL --save-tuning FILE`")
        return {}
    return choices


def _kernel(tuner) -> str:
    fn = tuner.base_fn
    return f"{fn.__module__}.{fn.__name__}"


def tuning_key(tuner, args: tuple, kwargs: dict) -> tuple:
    """The key Triton's ``Autotuner.run`` files its choice under: the values of the autotuner's key
    arguments, then the dtype of every argument that has one (Triton 3.x)."""
    named = {**dict(zip(tuner.arg_names, args)), **kwargs}
    named = {n: x for n, x in named.items() if n in tuner.arg_names}
    key = [named[n] for n in tuner.keys if n in named]
    key += [str(x.dtype) for x in named.values() if hasattr(x, "dtype")]
    return tuple(key)


def _device_name(args: tuple = ()) -> str:
    """The name of the GPU the first CUDA tensor among ``args`` is on (else the current device)."""
    import torch

    index = next((a.device.index for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
    return torch.cuda.get_device_name(torch.cuda.current_device() if index is None else index)


def use_recorded_choices() -> bool:
    """Patch Triton's ``Autotuner.run`` once: the table for this process's GPU (loaded at the first
    autotuned launch after this call, or now when ``OSDN_DIAG_TUNING`` names a FILE) answers the
    keys it holds, and every autotuner that runs is remembered for :func:`save_choices`. ``False``
    if Triton is not importable."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:  # pragma: no cover - triton comes with torch on Linux
        return False
    _STATE["table"] = None  # each command reads OSDN_DIAG_TUNING afresh
    if _named_file() is not None:
        # A FILE asked for by name: read and checked now, before the model loads, not at the first
        # autotuned launch in the middle of a batch.
        _STATE["table"] = load_table(_device_name())
    if getattr(Autotuner.run, "_osdn_tuning", False):
        return True
    from triton import knobs

    run = Autotuner.run

    def run_with_table(self, *args, **kwargs):
        _TUNERS.add(self)
        # (Under Triton's interpreter nothing is timed: osdn_diag.runtime.interpret keeps one configuration.)
        if len(self.configs) > 1 and not knobs.runtime.interpret:
            if _STATE["table"] is None:
                _STATE["table"] = load_table(_device_name(args))
            table = _STATE["table"]
            if table:
                key = tuning_key(self, args, kwargs)
                want = table.get((_kernel(self), repr(key))) if key not in self.cache else None
                chosen = next((c for c in self.configs if str(c) == want), None) if want else None
                if chosen is not None:
                    self.cache[key] = chosen
                    _STATE["used"] += 1
        return run(self, *args, **kwargs)

    run_with_table.__wrapped__ = run
    run_with_table._osdn_tuning = True
    Autotuner.run = run_with_table
    return True


def recorded_choices_used() -> int:
    """How many (kernel, key) choices this process took from a table rather than timing."""
    return _STATE["used"]


def check_table_file(path: Path, device_name: str | None = None) -> None:
    """``path`` either does not exist or is a tuning table :func:`save_choices` can add to: of
    ``device_name`` (when given) and the installed Triton and fla; ``ValueError`` otherwise. For a
    check before a warmup's minutes of work rather than after."""
    path = Path(path)
    if not path.exists():
        return
    try:
        recorded, _ = _read(path)
    except (OSError, ValueError, KeyError):
        raise ValueError(f"argument --save-tuning {str(path)!r}: exists and is not a tuning table; give a "
                         "new file, or a table written by --save-tuning to add to") from None
    differ = _mismatch(recorded, device_name or recorded["device"])
    if differ:
        raise ValueError(f"argument --save-tuning {str(path)!r}: a table recorded with {differ}; give a new "
                         "file for this machine's choices")


def save_choices(path: Path) -> int:
    """Write every (kernel, key) choice the autotuners that ran in this process hold (timed here,
    read from fla's disk cache, or taken from a table) as a table for this GPU, added to the choices
    ``path`` already holds when it is a table of the same GPU, Triton and fla (so that several
    models' runs build one table); returns how many choices the file holds. Any other file at
    ``path`` is left alone (``ValueError``). The file is replaced whole or not at all."""
    from .atomic import atomic_write_text

    path = Path(path)
    head = {"format": FORMAT, "device": _device_name(), **_versions()}
    choices = {}
    if path.exists():
        try:
            recorded, choices = _read(path)
            if _mismatch(recorded, head["device"]):
                choices = None
        except (OSError, ValueError, KeyError):
            choices = None
        if choices is None:
            raise ValueError(f"{path}: not a tuning table of this GPU, Triton and fla ({head['device']}, "
                             f"Triton {head['triton']}, fla {head['fla']}); left as it is. Give another file")
    choices.update({(_kernel(t), repr(key)): str(config) for t in list(_TUNERS) for key, config in t.cache.items()})
    entries = [{"kernel": kernel, "key": key, "config": config} for (kernel, key), config in sorted(choices.items())]
    atomic_write_text(path, json.dumps({**head, "choices": entries}, indent=1) + "\n")
    return len(entries)
