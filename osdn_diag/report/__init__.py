"""Reports: ``report.md`` in the paper's table layouts, and plots (contraction curve, per layer).

    osdn-diag report RUN                         # writes RUN/report.md and RUN/plots/*.png
    osdn-diag report RUN_A RUN_B --out DIR       # side by side, into DIR
"""

from .markdown import write_report

__all__ = ["write_report"]
