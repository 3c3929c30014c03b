"""What a MODEL argument can name, known without loading anything (no torch, no fla).

* :mod:`.presets` — ``random:PRESET`` shapes (:data:`PRESETS`);
* :mod:`.builtin` — ``builtin:NAME``, the trained models shipped with the package;
* :mod:`.hub` — Hugging Face Hub ids ``ORG/NAME[@REVISION]`` and their resolution in the user's cache.

The command line checks a MODEL argument against these before anything heavy is imported;
:func:`osdn_diag.models.load_model` then loads what they name.
"""

from __future__ import annotations

from .builtin import BUILTIN_ROOT, builtin_names, builtin_path, builtin_task
from .hub import is_hub_id
from .presets import PRESETS

__all__ = ["BUILTIN_ROOT", "PRESETS", "builtin_names", "builtin_path", "builtin_task", "is_hub_id"]
