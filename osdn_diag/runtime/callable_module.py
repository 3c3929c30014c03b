"""Let a module be called like the function it is named after (``osdn_diag.capture(model)``).

``osdn_diag.capture`` is both the subpackage holding the capture machinery and the context manager
users call; ``osdn_diag.replay`` likewise. Making the module object callable keeps both working —
``osdn_diag.capture(model)``, ``import osdn_diag.capture.store as store``, ``from osdn_diag.capture
import KernelCall`` — where binding a function over the module name would break the module imports.
"""

from __future__ import annotations

import sys
import types

__all__ = ["make_callable"]


def make_callable(module_name: str, function_name: str) -> None:
    """Calling module ``module_name`` calls its attribute ``function_name``."""
    module = sys.modules[module_name]

    class CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return getattr(self, function_name)(*args, **kwargs)

    CallableModule.__name__ = f"CallableModule[{module_name}]"
    module.__class__ = CallableModule
