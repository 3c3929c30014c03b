"""Resolve a MODEL argument to an fla causal LM.

* ``DIR`` — a local Hugging Face directory of an fla model: ``config.json`` plus ``*.safetensors``
  weights (never a pickle: ``.bin`` checkpoints are refused). Nothing is downloaded, and no code from
  the directory is run: a ``config.json`` or ``tokenizer_config.json`` with an ``auto_map``, or a
  ``model_type`` that neither transformers, fla nor this package provides, is refused. The weights
  must match the model exactly: a tensor missing from the file, one the model does not have, or one
  of another shape is an error, not a silently random parameter.
* ``ORG/NAME`` or ``ORG/NAME@REVISION`` — a Hugging Face Hub id that names no local path: resolved
  to a snapshot in the user's cache (``HF_HUB_OFFLINE=1`` honoured), fetching only JSON,
  safetensors and tokenizer vocabularies (:mod:`osdn_diag.catalog.hub`), then loaded as a directory;
  the commit it resolved to is recorded (:attr:`LoadedModel.hub`).
* ``random:PRESET`` — a randomly initialised model of a named shape (:data:`PRESETS`), seeded, for
  benchmarks and tests.
* ``builtin:NAME`` — a small trained model shipped with the package (:mod:`osdn_diag.catalog.builtin`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .._fla_import import config_class, import_model_type
from ..catalog.presets import PRESETS

__all__ = ["DEVICE_MAPS", "PRESETS", "LoadedModel", "load_model"]

@dataclass
class LoadedModel:
    model: torch.nn.Module
    spec: str
    source: str  # "directory" | "random" | "builtin" | "hub"
    config: dict
    directory: Path | None = None
    hub: dict | None = None  # a Hub model's repo_id, revision asked for, commit resolved, snapshot


#: Preset config classes of this package's own models (:mod:`osdn_diag.models`).
_PACKAGE_CONFIGS = ("GDN2Config", "MomentumDeltaNetConfig")


def _register_fla() -> None:
    """Fail with the install command if fla is missing (its models register themselves with
    transformers' Auto classes as they are imported: :mod:`osdn_diag._fla_import`)."""
    try:
        import fla  # noqa: F401
    except ImportError as err:  # pragma: no cover - fla is a dependency
        raise RuntimeError(
            "flash-linear-attention (fla) is required to load models: pip install flash-linear-attention"
        ) from err


def load_model(
    spec: str,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device_map: str | dict | None = None,
) -> LoadedModel:
    """Load ``spec`` (a directory, a Hub id, ``random:PRESET`` or ``builtin:NAME``) onto ``device`` in ``dtype``,
    in eval mode.

    ``device_map`` spreads a model too large for one GPU over the GPUs of the machine instead
    (accelerate's big-model dispatch; ``device`` is then ignored): ``"auto"``/``"balanced"`` (the
    blocks evenly over every GPU), ``"sequential"`` (fill GPU 0 first), or an explicit
    ``{module name: device}``. Blocks are never split. Each block then runs on its own GPU and
    capture records it there, tagged with its layer as always.
    """
    _register_fla()
    from transformers import AutoModelForCausalLM  # OSDN / OSGDN registered by importing this package

    if spec.startswith("random:"):
        name = spec.removeprefix("random:")
        if name not in PRESETS:
            raise ValueError(
                f"MODEL {spec!r}: unknown preset {name!r}; available: "
                + ", ".join(f"random:{p}" for p in PRESETS)
            )
        cls_name, kwargs = PRESETS[name]
        fla_config = config_class(cls_name)
        if fla_config is not None:
            config = fla_config(**kwargs)
        elif cls_name in _PACKAGE_CONFIGS:  # a config this package provides where fla has none
            import osdn_diag.models as package_models

            config = getattr(package_models, cls_name)(**kwargs)
        else:
            import transformers

            config = getattr(transformers, cls_name)(**kwargs)
        # Built and initialised where it will run: on a GPU, a 340M model's CPU initialisation
        # alone took 3 s of the command's wall clock. CUDA's generator gives the same weights on any
        # GPU; they differ from a CPU build's. A device map builds on the CPU, as the model may not
        # fit one GPU.
        build = _build_device(device, device_map)
        with torch.random.fork_rng(devices=[build.index] if build.type == "cuda" else []), build:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config)
        source, directory, hub = "random", None, None
    else:
        from ..catalog import hub as _hub

        builtin = spec.startswith("builtin:")
        hub = None
        if builtin:
            from ..catalog.builtin import builtin_path

            directory = builtin_path(spec.removeprefix("builtin:"))
        elif _hub.is_hub_id(spec):
            directory, source_info = _hub.resolve(spec)
            hub = source_info.as_dict()
        else:
            directory = Path(spec)
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(
                f"MODEL {spec!r}: expected a Hugging Face model directory with config.json "
                "(or random:PRESET)"
            )
        if not list(directory.glob("*.safetensors")):
            pickles = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt")]
            hint = f" (found {', '.join(pickles)}: pickled weights are not loaded)" if pickles else ""
            raise FileNotFoundError(f"MODEL {spec!r}: no *.safetensors weights in {directory}{hint}")
        config = _refuse_remote_code(spec, directory)
        # ignore_mismatched_sizes: transformers then reports a wrong shape in the loading info (which
        # we turn into our error) instead of raising its own, which names no tensor.
        from safetensors import SafetensorError

        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                directory, use_safetensors=True, local_files_only=True, dtype=dtype,
                trust_remote_code=False, output_loading_info=True, ignore_mismatched_sizes=True,
            )
        except SafetensorError as err:  # its message names no file
            raise ValueError(f"MODEL {spec!r}: the *.safetensors weights in {directory} are not readable "
                             f"({err}): truncated or damaged; replace them with a complete copy") from err
        _check_loading_info(spec, directory, info)
        source = "builtin" if builtin else "hub" if hub is not None else "directory"
    if device_map is None:
        model = model.to(device=device, dtype=dtype)
    else:
        model = _dispatch(model.to(dtype=dtype), device_map, spec)
    model = model.eval()
    cfg = model.config.to_dict() if source == "random" else config
    if isinstance(cfg.get("text_config"), dict):
        # A multimodal checkpoint (e.g. Qwen3.5's) keeps the language model's sizes in text_config,
        # which is what is loaded (as a causal LM).
        cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if v is not None}}
    if cfg.get("vocab_size") is None:
        cfg = {**cfg, "vocab_size": model.get_input_embeddings().num_embeddings}
    return LoadedModel(model=model, spec=spec, source=source, config=cfg, directory=directory, hub=hub)


def _build_device(device: str | torch.device, device_map) -> torch.device:
    """Where a random preset is built: ``device``, or the CPU for a ``device_map`` (then spread)."""
    if device_map is not None:
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _refuse_remote_code(spec: str, directory: Path) -> dict:
    """``directory``'s config.json, after checking that loading it runs no code of its own: no
    ``auto_map`` (in config.json or tokenizer_config.json) and a ``model_type`` that transformers, fla
    or this package registers (fla and :func:`register` must have run). Reads JSON only."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    what = ("; osdn-diag never runs code from a model directory: use a checkpoint of an architecture "
            "that transformers, fla or osdn-diag provides")
    config = _read_json(spec, directory / "config.json")
    for name, data in (("config.json", config),
                       ("tokenizer_config.json", _read_json(spec, directory / "tokenizer_config.json"))):
        if isinstance(data, dict) and data.get("auto_map"):
            classes = data["auto_map"]
            listed = ", ".join(map(str, classes.values() if isinstance(classes, dict) else classes))
            raise ValueError(f"MODEL {spec!r}: {directory / name} asks for custom code (auto_map: "
                             f"{listed}){what} (if its model_type is one, delete auto_map)")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    import_model_type(model_type if isinstance(model_type, str) else None)  # fla's model of that type
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"MODEL {spec!r}: {directory / 'config.json'} has model_type {model_type!r}, "
                         f"which no installed library provides{what}")
    return config


def _read_json(spec: str, path: Path):
    """``path`` parsed, or ``None`` if there is no such file."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"MODEL {spec!r}: {path} is not readable JSON ({err})") from err


def _check_loading_info(spec: str, directory: Path, info: dict) -> None:
    """Refuse a checkpoint whose tensors are not exactly the model's (``from_pretrained``'s
    ``output_loading_info``). Tied weights and non-persistent buffers are not in that report: the
    former are filled from the tensor they share, the latter are not part of a state dict."""
    problems = []
    for key, label in (("missing_keys", "missing from the file"),
                       ("unexpected_keys", "in the file but not in the model")):
        names = sorted(info.get(key) or ())
        if names:
            problems.append(f"{_count(names)} {label} ({_few(names)})")
    # transformers 5 reports (name, shape in the file, shape in the model).
    shown = sorted(
        f"{m[0]} {list(m[1])} in the file, {list(m[2])} in the model"
        if isinstance(m, (tuple, list)) and len(m) == 3 else str(m)
        for m in info.get("mismatched_keys") or ()
    )
    if shown:
        problems.append(f"{_count(shown)} of the wrong shape ({_few(shown)})")
    errors = [" ".join(str(e).split()) for e in info.get("error_msgs") or ()]
    if errors:
        problems.append(f"{len(errors)} loading error(s) ({_few(errors)})")
    if problems:
        raise ValueError(
            f"MODEL {spec!r}: the *.safetensors weights in {directory} do not match the model its "
            f"config.json describes: {'; '.join(problems)}; not loaded, since parameters without "
            "their tensor would keep a random initialisation: use the weights saved with this config.json"
        )


def _count(names: list) -> str:
    return f"{len(names)} tensor{'s' if len(names) != 1 else ''}"


def _few(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names``, and how many more."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


DEVICE_MAPS = ("auto", "balanced", "sequential")


def _dispatch(model: torch.nn.Module, device_map: str | dict, spec: str) -> torch.nn.Module:
    """``model`` spread over the devices of ``device_map`` by accelerate (its hooks move activations
    from block to block)."""
    try:
        from accelerate import dispatch_model, infer_auto_device_map
        from accelerate.utils import get_balanced_memory
    except ImportError as err:
        raise RuntimeError("argument 'device_map': needs accelerate (pip install accelerate)") from err
    if isinstance(device_map, str):
        if device_map not in DEVICE_MAPS:
            raise ValueError(f"argument 'device_map': expected one of {', '.join(DEVICE_MAPS)} or a "
                             f"{{module: device}} dict, got {device_map!r}")
        no_split = list(getattr(model, "_no_split_modules", None) or [])
        max_memory = None
        if device_map != "sequential":
            max_memory = get_balanced_memory(model, no_split_module_classes=no_split, low_zero=False)
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
    if "disk" in set(map(str, device_map.values())):
        raise ValueError(f"MODEL {spec!r}: does not fit in the GPUs' and the host's memory "
                         f"(the device map offloads to disk: {device_map})")
    # Hooks even when every block lands on one device: the same code path on one GPU as on eight.
    return dispatch_model(model, device_map=device_map, force_hooks=True)
