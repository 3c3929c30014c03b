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

The model is the one its user runs: it is loaded exactly as ``from_pretrained(DIR, dtype=DTYPE)``
loads it — the parameters transformers keeps in fp32 whatever ``dtype`` asks (fla's Gated DeltaNet
``A_log``, created in fp32; a model's ``_keep_in_fp32_modules_strict``, e.g. Kimi Linear's
``dt_bias`` and MoE router) stay fp32 — and moved to its device without a cast. A ``random:``
preset is built in fp32 and then loaded through the same ``from_pretrained`` from its in-memory
state dict, so it holds exactly the dtypes a saved copy of it would load with.
:attr:`LoadedModel.kept_dtypes` lists the parameters and buffers whose dtype is not ``dtype``.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..runtime.config_checks import NO_REMOTE_CODE, check_config, check_model_files, refuse_auto_map
from ..runtime.fla_import import config_class, import_model_type
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
    #: ``{name: dtype}`` of every floating-point parameter and buffer whose dtype is not the model's
    #: (kept in fp32 by transformers' loading), e.g. ``{"model.layers.0.attn.A_log": "float32"}``
    kept_dtypes: dict | None = None


#: Preset config classes of this package's own models (:mod:`osdn_diag.models`).
_PACKAGE_CONFIGS = ("GDN2Config", "MomentumDeltaNetConfig")


def _register_fla() -> None:
    """Fail with the install command if fla is missing (its models register themselves with
    transformers' Auto classes as they are imported: :mod:`osdn_diag.runtime.fla_import`)."""
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
    if device_map is None:
        from ..runtime.device import check_device

        check_device(device)
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
        # Built and initialised in fp32 where it will run (on a GPU, a 340M model's CPU initialisation
        # alone took 3 s of the command's wall clock; CUDA's generator gives the same weights on any
        # GPU, they differ from a CPU build's), then loaded from its own state dict by from_pretrained
        # in ``dtype``: the dtypes a saved copy of it loads with. A device map builds on the CPU, as
        # the model may not fit one GPU.
        build = _build_device(device, device_map)
        with torch.random.fork_rng(devices=[build.index] if build.type == "cuda" else []), build:
            torch.manual_seed(seed)
            built = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = _from_state_dict(built, dtype, build)
        del built
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
        check_model_files(spec, directory)
        config = _refuse_remote_code(spec, directory)
        file_tensors = _checkpoint_tensors(spec, directory)
        _check_fits(spec, directory, file_tensors, dtype, device, device_map)
        # ignore_mismatched_sizes: transformers then reports a wrong shape in the loading info (which
        # we turn into our error) instead of raising its own, which names no tensor.
        from safetensors import SafetensorError

        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                directory, use_safetensors=True, local_files_only=True, dtype=dtype,
                trust_remote_code=False, output_loading_info=True, ignore_mismatched_sizes=True,
                **_placement(device, device_map),
            )
        except SafetensorError as err:  # its message names no file
            raise ValueError(f"MODEL {spec!r}: the *.safetensors weights in {directory} are not readable "
                             f"({err}): truncated or damaged; replace them with a complete copy") from err
        except Exception as err:
            refused = _build_error(spec, directory, err)
            if refused is err:
                raise
            raise refused from err
        _check_loading_info(spec, directory, info)
        _check_weight_dtypes(spec, directory, file_tensors, model)
        source = "builtin" if builtin else "hub" if hub is not None else "directory"
    # No dtype cast here: ``to(dtype)`` would also cast what transformers keeps in fp32.
    if device_map is not None:
        model = _dispatch(model, device_map, spec)
    model = model.eval()
    cfg = model.config.to_dict() if source == "random" else config
    if isinstance(cfg.get("text_config"), dict):
        # A multimodal checkpoint (e.g. Qwen3.5's) keeps the language model's sizes in text_config,
        # which is what is loaded (as a causal LM).
        cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if v is not None}}
    if cfg.get("vocab_size") is None:
        cfg = {**cfg, "vocab_size": model.get_input_embeddings().num_embeddings}
    return LoadedModel(model=model, spec=spec, source=source, config=cfg, directory=directory, hub=hub,
                       kept_dtypes=kept_dtypes(model, dtype))


def _build_error(spec: str, directory: Path, err: Exception) -> Exception:
    """What ``from_pretrained`` raised while building the model a directory's ``config.json``
    describes, as the user's error naming that file: the model classes take a config's values as they
    come, and a value they cannot build from (``num_heads`` not dividing the key width, a negative
    ``expand_v``, an unknown ``attn_mode``, a huge ``hidden_ratio``) ends in an AssertionError,
    RuntimeError, TypeError or ImportError deep inside them. The package's own errors and a full disk
    pass unchanged."""
    if type(err).__module__.startswith("osdn_diag") or isinstance(err, OSError):
        return err
    what = " ".join(str(err).split())[:300] or "no message"
    return ValueError(f"MODEL {spec!r}: the model that {directory / 'config.json'} describes could not be built "
                      f"({type(err).__name__}: {what}); repair config.json (use the one saved with the weights)")


def _placement(device, device_map) -> dict:
    """``from_pretrained``'s ``device_map`` for one ``device``: every tensor materialised there, in
    its final dtype (transformers dispatches no hooks for a single device). A multi-device map is
    applied afterwards by :func:`_dispatch`, from the CPU. On the CPU none is passed: the CPU is where
    transformers materialises tensors anyway, and any ``device_map`` makes it require accelerate,
    which a CPU install (the ``cpu`` extra) does not have (as :func:`_from_state_dict`)."""
    if device_map is not None:
        return {}
    build = _build_device(device, None)
    return {} if build.type == "cpu" else {"device_map": {"": build}}


def _from_state_dict(built: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """``built`` (an fp32 model) loaded again by its class's ``from_pretrained`` from its own state
    dict in ``dtype``: transformers' loading then decides each tensor's dtype (what it keeps in fp32)
    exactly as for a checkpoint saved from ``built``, and materialises it on ``device``."""
    if dtype == torch.float32:
        return built
    placement = {} if device.type == "cpu" else {"device_map": {"": device}}
    return type(built).from_pretrained(None, config=built.config, state_dict=built.state_dict(), dtype=dtype,
                                       **placement)


def kept_dtypes(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """``{name: dtype}`` of the floating-point parameters and buffers of ``model`` not in ``dtype``,
    in module order (tied parameters once)."""
    out = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and tensor.dtype != dtype:
            out[name] = str(tensor.dtype).removeprefix("torch.")
    return out


#: safetensors dtype names that hold no floating-point number.
_NOT_FLOAT = frozenset({"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"})
#: the floating-point dtypes a model's parameters are loaded from (fp8 and fp4 are quantized formats).
_FLOATS = frozenset({"F64", "F32", "F16", "BF16"})


def _checkpoint_tensors(spec: str, directory: Path) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """``{tensor name: (safetensors dtype, file name, shape)}`` of every tensor in
    ``directory``'s ``*.safetensors``, from their headers alone (no tensor is read)."""
    from safetensors import SafetensorError, safe_open

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(path, framework="pt") as fh:
                for name in fh.keys():
                    part = fh.get_slice(name)
                    out[name] = (part.get_dtype(), path.name, tuple(part.get_shape()))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"MODEL {spec!r}: {path} is not readable safetensors ({err}): truncated or "
                             "damaged; replace it with a complete copy") from err
    other = sorted(f"{name} ({kind} in {file})" for name, (kind, file, _) in out.items()
                   if kind not in _FLOATS and kind not in _NOT_FLOAT)
    if other:  # checked before transformers sees the directory
        raise ValueError(f"MODEL {spec!r}: {_count(other)} in the *.safetensors weights in {directory} of a "
                         f"quantized format ({_few(other)}); use the floating-point (fp32, bf16 or fp16) weights")
    return out


def _check_fits(spec: str, directory: Path, file_tensors: dict, dtype: torch.dtype, device, device_map) -> None:
    """Refuse, before a tensor is allocated, a model its weights cannot fill or its device cannot hold.

    The model's size is ``config.json``'s, not the weights': a config that names only its
    ``model_type`` builds that family's default size (Llama's: 6.7 B parameters, 25 GiB in fp32).
    ``from_pretrained`` would allocate and randomly initialise all of it before reporting the tensors
    missing (63 s for that model in bf16 on a 2-core CPU), or the kernel's out-of-memory killer would
    end the process without a message. The model is built on the meta device here (no memory; 0.06 s
    at 340M): weights holding fewer values than its parameters (those it may leave out aside) are
    refused naming the parameters not in the file, as :func:`_check_loading_info` would; parameters
    larger than the memory free where they are loaded (the host's for the CPU, one GPU's; not under a
    ``device_map``, where accelerate places and offloads) are refused naming both sizes. Where the
    model cannot be built on the meta device nothing is checked here, and ``from_pretrained``
    reports what it meets."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..runtime.memory import available_bytes, gib

    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")  # a layer's advice at construction is printed by the real build
            meta = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - the real build reports it (_build_error)
        return
    optional = [re.compile(p) for p in getattr(meta, "_keys_to_ignore_on_load_missing", None) or ()]
    params = {name: tuple(p.shape) for name, p in meta.named_parameters()  # tied parameters once
              if not any(r.search(name) for r in optional)}
    count = sum(map(math.prod, params.values()))
    held = sum(math.prod(shape) for _, _, shape in file_tensors.values())
    if held < count:
        # Names can differ between a file and its model (transformers renames some as it loads), values
        # cannot appear from nowhere: the count decides, the names are what the user reads.
        problems = _problems(
            [name for name in params if name not in file_tensors],
            set(file_tensors) - set(meta.state_dict()),
            [(name, file_tensors[name][2], shape) for name, shape in params.items()
             if name in file_tensors and file_tensors[name][2] != shape])
        raise ValueError(_mismatch(spec, directory, problems or [
            f"they hold {held:,} values for the model's {count:,} parameters"]))
    target = _build_device(device, None)
    free = None if device_map is not None else available_bytes(target)
    # the parameters in the dtype asked for, and the buffers as the model makes them (a causal mask of
    # the context length in each layer can outweigh the parameters)
    buffers = sum(b.numel() * b.element_size() for b in meta.buffers())
    need = count * dtype.itemsize + buffers
    if free is not None and need > free:
        ways = ([] if dtype.itemsize <= 2 else ["in bfloat16 (--dtype bfloat16)"])
        ways += ["on a device with more free memory"]
        if target.type == "cuda":
            ways += ["over several GPUs (--device-map auto)"]
        with_buffers = f" and {gib(buffers)} of buffers" if buffers >= 2**20 else ""
        raise ValueError(
            f"MODEL {spec!r}: the model {directory / 'config.json'} describes has {count:,} parameters, "
            f"{gib(need - buffers)} in {str(dtype).removeprefix('torch.')}{with_buffers}, more than the {gib(free)} "
            f"free on {target}; not built, since the system would end the process without a message: load it "
            + (", ".join(ways[:-1]) + " or " + ways[-1] if len(ways) > 1 else ways[0]))


def _check_weight_dtypes(spec: str, directory: Path, file_tensors: dict, model: torch.nn.Module) -> None:
    """Refuse a checkpoint that stores integer or boolean tensors where the model has no integer or
    boolean tensor of that name: transformers would cast them into floating-point parameters
    silently (a bool checkpoint loads as 0/1 weights), and a quantized checkpoint is not a model this
    package diagnoses."""
    integral = {name for name, t in model.state_dict().items() if not t.is_floating_point()}
    wrong = sorted(f"{name} ({kind} in {file})" for name, (kind, file, _) in file_tensors.items()
                   if kind in _NOT_FLOAT and name not in integral)
    if wrong:
        raise ValueError(f"MODEL {spec!r}: {_count(wrong)} in the *.safetensors weights in {directory} hold "
                         f"integers or booleans where the model has floating-point parameters ({_few(wrong)}); "
                         "quantized or converted checkpoints are not loaded: use the floating-point weights")


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

    what = NO_REMOTE_CODE
    config = _read_json(spec, directory / "config.json")
    check_config(spec, config, directory / "config.json")  # sizes a model can be built with
    for name, data in (("config.json", config),
                       ("tokenizer_config.json", _read_json(spec, directory / "tokenizer_config.json"))):
        refuse_auto_map(spec, directory / name, data)
    _check_implementations(spec, directory / "config.json", config)
    model_type = config.get("model_type") if isinstance(config, dict) else None
    import_model_type(model_type if isinstance(model_type, str) else None)  # fla's model of that type
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"MODEL {spec!r}: {directory / 'config.json'} has model_type {model_type!r}, "
                         f"which no installed library provides{what}")
    return config


#: ``attn_implementation`` values whose code ships with transformers and torch. Any other value is
#: code from elsewhere: an ``org/name`` Hub kernel, or ``flash_attention_N`` where the flash-attn
#: package is not installed, for which transformers fetches a Hub kernel instead.
_BUILTIN_ATTENTION = frozenset({"eager", "sdpa", "flex_attention", "paged|eager"})
#: ``experts_implementation`` values computed by torch alone (``deepgemm`` and ``sonicmoe`` load Hub
#: kernels).
_BUILTIN_EXPERTS = frozenset({"eager", "batched_mm", "grouped_mm"})


def _builtin_attention(value: str) -> bool:
    if value in _BUILTIN_ATTENTION:
        return True
    match = re.fullmatch(r"flash_attention_(\d)", value)
    if match is None:
        return False
    # As transformers itself decides whether the flash-attn package serves this version; where it
    # does not, transformers fetches a Hub kernel in its place.
    try:
        from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX

        return bool(FLASH_ATTENTION_COMPATIBILITY_MATRIX[int(match.group(1))]["general_availability_check"]())
    except (ImportError, KeyError, TypeError):
        return False


def _check_implementations(spec: str, path: Path, config) -> None:
    """Refuse a config (or any sub-config, e.g. ``text_config``) whose ``attn_implementation`` or
    ``experts_implementation`` names code that is not part of transformers or torch: transformers 5
    imports such a kernel from the Hub, or from the user's cache offline, where a config chooses it."""
    def values(node):  # iterative: a config as deep as json.loads allows is walked without recursion
        stack = [node]
        while stack:
            node = stack.pop()
            items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
            for key, value in items:
                if key == "quantization_config" and value is not None:
                    yield key, value
                elif key in ("attn_implementation", "experts_implementation"):
                    parts = value.values() if isinstance(value, dict) else [value]
                    yield from ((key, v) for v in parts if v is not None)
                else:
                    stack.append(value)

    for key, value in values(config):
        if key == "quantization_config":
            raise ValueError(
                f"MODEL {spec!r}: {path} has a quantization_config: transformers would quantize or dequantize it "
                "with a method of its own (some load Hub kernels), so the model diagnosed would not be the "
                "floating-point one; use the floating-point weights")
        builtin = isinstance(value, str) and (
            _builtin_attention(value) if key == "attn_implementation" else value in _BUILTIN_EXPERTS)
        if not builtin:
            allowed = sorted(_BUILTIN_ATTENTION if key == "attn_implementation" else _BUILTIN_EXPERTS)
            raise ValueError(
                f"MODEL {spec!r}: {path} sets {key} = {value!r}, which is not an implementation built into "
                f"transformers or torch (installed flash-attn aside): transformers would load its code from "
                f"the Hub or the Hugging Face cache, and osdn-diag never runs code a model directory chooses; "
                f"set it to one of {', '.join(allowed)} (or remove it)")


def _read_json(spec: str, path: Path):
    """``path`` parsed, or ``None`` if there is no such file."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"MODEL {spec!r}: {path} is not readable JSON ({err})") from err
    except RecursionError:
        raise ValueError(f"MODEL {spec!r}: {path} nests its JSON too deeply to be a model's file") from None


def _check_loading_info(spec: str, directory: Path, info: dict) -> None:
    """Refuse a checkpoint whose tensors are not exactly the model's (``from_pretrained``'s
    ``output_loading_info``). Tied weights and non-persistent buffers are not in that report: the
    former are filled from the tensor they share, the latter are not part of a state dict."""
    # transformers 5 reports a wrong shape as (name, shape in the file, shape in the model)
    problems = _problems(info.get("missing_keys") or (), info.get("unexpected_keys") or (),
                         info.get("mismatched_keys") or ())
    errors = [" ".join(str(e).split()) for e in info.get("error_msgs") or ()]
    if errors:
        problems.append(f"{len(errors)} loading error(s) ({_few(errors)})")
    if problems:
        raise ValueError(_mismatch(spec, directory, problems))


def _problems(missing, unexpected, mismatched) -> list[str]:
    """The differences between a checkpoint and its model as the user reads them: tensors missing from
    the file, in the file but not in the model, and of the wrong shape (``(name, shape in the file,
    shape in the model)``, or any other report as it is); each kind counted, a few named."""
    shown = sorted(f"{m[0]} {list(m[1])} in the file, {list(m[2])} in the model"
                   if isinstance(m, (tuple, list)) and len(m) == 3 else str(m) for m in mismatched)
    out = []
    for names, label in ((sorted(missing), "missing from the file"),
                         (sorted(unexpected), "in the file but not in the model"), (shown, "of the wrong shape")):
        if names:
            out.append(f"{_count(names)} {label} ({_few(names)})")
    return out


def _mismatch(spec: str, directory: Path, problems: list[str]) -> str:
    return (f"MODEL {spec!r}: the *.safetensors weights in {directory} do not match the model its "
            f"config.json describes: {'; '.join(problems)}; not loaded, since parameters without "
            "their tensor would keep a random initialisation: use the weights saved with this config.json")


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
