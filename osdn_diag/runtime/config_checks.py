"""The sizes a model's ``config.json`` gives, checked before a model is built from them.

transformers and fla take a config's numbers as they come: ``num_heads: 0`` ended in a
ZeroDivisionError, ``hidden_size: -5`` in "negative dimension", ``"abc"`` or ``1e9`` (a float) in a
TypeError deep in torch, and a huge value would allocate for minutes before failing. Every size field
this package or the model classes it loads read is checked here: absent or ``null`` (the class's
default) or a positive integer within a bound far above any published model. Pure Python (no torch),
so that the command line can run it before fla is imported.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SIZE_FIELDS", "check_config", "check_model_files", "refuse_auto_map"]

_WIDTH = 1 << 17   # hidden and MLP widths: published models stay under 32k
_HEADS = 1 << 12
_HEAD_DIM = 1 << 14

#: field -> the largest value accepted (every one must be a positive integer when given).
SIZE_FIELDS = {
    "hidden_size": _WIDTH,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 1 << 12,
    "num_heads": _HEADS,
    "num_attention_heads": _HEADS,
    "num_key_value_heads": _HEADS,
    "num_v_heads": _HEADS,
    "linear_num_key_heads": _HEADS,
    "linear_num_value_heads": _HEADS,
    "head_dim": _HEAD_DIM,
    "linear_key_head_dim": _HEAD_DIM,
    "linear_value_head_dim": _HEAD_DIM,
    "vocab_size": 1 << 22,
    "conv_size": 1 << 10,
}


def _field_error(key: str, value, limit: int) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{key} must be a positive integer, got {value!r}"
    if not 1 <= value <= limit:
        return f"{key} must be a positive integer of at most {limit:,}, got {value:,}"
    return None


def check_config(spec: str, config, path: str | Path) -> None:
    """Refuse ``config`` (the parsed ``config.json`` at ``path`` of MODEL ``spec``) whose size fields
    are not positive integers within :data:`SIZE_FIELDS`' bounds, or whose ``model_type`` is not a
    string (looked up in transformers' registry, a dict), naming the field; a multimodal
    config's ``text_config`` (what is loaded) is checked too. Raises ``ValueError``."""
    if not isinstance(config, dict):
        raise ValueError(f"MODEL {spec!r}: {path} is not a JSON object; repair or replace it")
    sections = [("", config)]
    if isinstance(config.get("text_config"), dict):
        sections.append(("text_config.", config["text_config"]))
    for prefix, section in sections:
        model_type = section.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            raise ValueError(f"MODEL {spec!r}: {path}: {prefix}model_type must be a string, got "
                             f"{model_type!r}; repair config.json (use the one saved with the weights)")
        for key, limit in SIZE_FIELDS.items():
            error = _field_error(prefix + key, section.get(key), limit)
            if error:
                raise ValueError(f"MODEL {spec!r}: {path}: {error}; repair config.json (use the one saved "
                                 "with the weights)")


#: Why a directory asking for its own code is refused.
NO_REMOTE_CODE = ("; osdn-diag never runs code from a model directory: use a checkpoint of an architecture "
                  "that transformers, fla or osdn-diag provides")


def check_model_files(spec: str, directory: Path) -> None:
    """The files a Hugging Face model directory must hold: ``config.json`` and ``*.safetensors``
    weights (pickled ``*.bin``/``*.pt`` weights are named and refused). Raises ``FileNotFoundError``.
    Pure Python: the command line checks this before importing torch."""
    import stat

    config = directory / "config.json"
    if not config.is_file():
        if config.exists() or config.is_symlink():  # a FIFO, a directory, a link to nothing
            raise ValueError(f"MODEL {spec!r}: {config} is not a regular file (a FIFO, a directory, a device, or "
                             "a link to nothing); replace it with the model's config.json")
        raise FileNotFoundError(f"MODEL {spec!r}: expected a Hugging Face model directory with config.json "
                                "(or random:PRESET)")

    for path in sorted(directory.glob("*.safetensors")):
        try:
            regular = stat.S_ISREG(path.stat().st_mode)
        except OSError:
            continue  # a dangling link: the loader names it
        if not regular:  # a FIFO would be waited on forever, a device read without end
            raise ValueError(f"MODEL {spec!r}: {path} is not a regular file (a FIFO, a device, a socket or a "
                             "link to one); replace it with the weights file")
    if not any(directory.glob("*.safetensors")):
        pickles = sorted(p.name for pattern in ("*.bin", "*.pt") for p in directory.glob(pattern))
        hint = f" (found {', '.join(pickles)}: pickled weights are not loaded)" if pickles else ""
        index = sorted(p.name for p in directory.glob("*.safetensors.index.json"))
        if index and not hint:  # its shards named elsewhere: only files in the directory are read
            hint = f" ({index[0]} lists shards that are not files in it)"
        raise FileNotFoundError(f"MODEL {spec!r}: no *.safetensors weights in {directory}{hint}")


def refuse_auto_map(spec: str, path: Path, data) -> None:
    """Refuse a parsed ``config.json`` / ``tokenizer_config.json`` (``data``, read from ``path``) that
    asks for custom code by an ``auto_map``. Raises ``ValueError``."""
    if isinstance(data, dict) and data.get("auto_map"):
        classes = data["auto_map"]
        listed = ", ".join(map(str, classes.values() if isinstance(classes, dict) else classes))
        raise ValueError(f"MODEL {spec!r}: {path} asks for custom code (auto_map: {listed}){NO_REMOTE_CODE} "
                         "(if its model_type is one, delete auto_map)")
