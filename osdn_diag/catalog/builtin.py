"""The built-in trained models, shipped inside the package and loadable offline as ``builtin:NAME``.

Each lives in ``osdn_diag/builtin/NAME/``: a Hugging Face checkpoint (``config.json``,
``model.safetensors``), its model card (``README.md``: configuration, training, final accuracy, the
command that made it), the training log (``train_log.jsonl``) and ``task.json``, the recall task it
was trained on (the MQAR shape the demo's prompts must have).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["BUILTIN_ROOT", "builtin_names", "builtin_path", "builtin_task"]

BUILTIN_ROOT = Path(__file__).resolve().parent.parent / "builtin"


def builtin_names(root: Path | None = None) -> list[str]:
    """Names of the shipped models (directories with a ``config.json``), sorted."""
    root = BUILTIN_ROOT if root is None else root
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())


def builtin_path(name: str, root: Path | None = None) -> Path:
    """The directory of built-in model ``name``; a ValueError listing the available ones otherwise."""
    names = builtin_names(root)
    if name not in names:
        available = ", ".join(f"builtin:{n}" for n in names) or "none (the package was installed without them)"
        raise ValueError(f"MODEL 'builtin:{name}': no such built-in model; available: {available}")
    return (BUILTIN_ROOT if root is None else root) / name


def builtin_task(name: str, root: Path | None = None) -> dict:
    """The recall task built-in model ``name`` was trained on (``task.json``)."""
    path = builtin_path(name, root) / "task.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"built-in model {name!r}: {path} is missing") from None
