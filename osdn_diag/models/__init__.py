"""Models: loading what a MODEL argument names (local directories, Hub ids, ``random:`` presets,
``builtin:`` models; the names themselves live in :mod:`osdn_diag.catalog`), and the OSDN / OSGDN
language models.

``import osdn_diag.models`` imports fla and registers model types ``"osdn"`` and ``"osgdn"`` with
transformers' ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM``, as ``import fla`` registers
fla's: a saved OSDN model then loads with ``AutoModelForCausalLM.from_pretrained(dir)``. On a machine
without a GPU, fla must run under Triton's interpreter, which has to be switched on before triton or
fla is first imported: this import does that (:func:`osdn_diag.runtime.prepare`) unless triton was
imported already — then set ``TRITON_INTERPRET=1`` in the environment before starting Python.
"""

from __future__ import annotations

from .. import runtime
from ..catalog import PRESETS

runtime.prepare()  # the interpreter on a machine without CUDA, before fla is imported below

from .configuration import OSDNConfig, OSGDNConfig  # noqa: E402
from .loading import LoadedModel, load_model  # noqa: E402
from .modeling import OSDNForCausalLM, OSDNModel, OSGDNForCausalLM, OSGDNModel  # noqa: E402  (registers)
from .gdn2 import GDN2Config, GDN2ForCausalLM, GDN2Model  # noqa: E402  (registers model type "gdn2")
from .momentum import MomentumDeltaNetConfig, MomentumDeltaNetForCausalLM  # noqa: E402  (registers)

__all__ = [
    "PRESETS",
    "GDN2Config",
    "GDN2ForCausalLM",
    "GDN2Model",
    "LoadedModel",
    "MomentumDeltaNetConfig",
    "MomentumDeltaNetForCausalLM",
    "OSDNConfig",
    "OSDNForCausalLM",
    "OSDNModel",
    "OSGDNConfig",
    "OSGDNForCausalLM",
    "OSGDNModel",
    "load_model",
    "register",
]


def register() -> None:
    """Kept for callers written against the lazy registration: the import above has registered the
    OSDN / OSGDN configs and models with transformers' Auto classes already."""
