"""Model layers built on the OSDN kernels (fla-style ``nn.Module`` s)."""

from .osdn import OSDN
from .osgdn import OSGDN

__all__ = ["OSDN", "OSGDN"]
