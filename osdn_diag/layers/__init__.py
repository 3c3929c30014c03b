"""Model layers built on the OSDN kernels (fla-style ``nn.Module`` s)."""

from .osdn import OSDN

__all__ = ["OSDN"]
