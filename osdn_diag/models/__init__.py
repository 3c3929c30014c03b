"""Model loading (local Hugging Face directories of fla models, random presets) and the OSDN / OSGDN
language models.

``import osdn_diag.models`` does not import fla: on a machine without a GPU, fla may only be imported
after ``TRITON_INTERPRET=1`` is set (:func:`osdn_diag.runtime.prepare`), and the command line imports
this package before that. The model classes are therefore loaded on first use — touching any of
``OSDNConfig``, ``OSDNModel``, ``OSDNForCausalLM``, ``OSGDNConfig``, ``OSGDNModel``,
``OSGDNForCausalLM`` (``from osdn_diag.models import OSDNForCausalLM``) or calling :func:`register`
imports :mod:`osdn_diag.models.modeling`, which registers model types ``"osdn"`` and ``"osgdn"``
with transformers' ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM``. Call :func:`register`
before ``AutoModelForCausalLM.from_pretrained`` on a saved OSDN / OSGDN directory.
"""

from __future__ import annotations

import importlib

from .loading import PRESETS, LoadedModel, load_model

_LAZY = {
    "OSDNConfig": "configuration",
    "OSGDNConfig": "configuration",
    "OSDNModel": "modeling",
    "OSDNForCausalLM": "modeling",
    "OSGDNModel": "modeling",
    "OSGDNForCausalLM": "modeling",
}

__all__ = ["PRESETS", "LoadedModel", "load_model", "register", *_LAZY]


def register() -> None:
    """Register the OSDN / OSGDN configs and models with transformers' Auto classes (imports fla;
    idempotent)."""
    importlib.import_module(".modeling", __name__)


def __getattr__(name: str):
    if name in _LAZY:
        register()  # a config alone is useless to AutoModel without its models
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
