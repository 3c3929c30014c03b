"""The ``osdn-diag`` command (also ``python -m osdn_diag``).

- :mod:`.parser` — the grammar: subcommands, arguments, help;
- :mod:`.checks` — the arguments and input files checked before anything heavy is imported;
- :mod:`.commands` — what each subcommand does;
- :mod:`.dispatch` — :func:`main`: check, prepare the libraries, run one command;
- :mod:`.exits` — :func:`entry` and :func:`console`: exit statuses, signals, the end of the process.

Importing this package imports nothing heavy (no torch), so ``--help`` and an argument error stay fast.
"""

from .dispatch import main
from .exits import console, entry
from .parser import build_parser

__all__ = ["build_parser", "console", "entry", "main"]
