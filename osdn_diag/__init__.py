"""osdn-diag: residual-contraction diagnostics for delta-rule linear attention.

    import osdn_diag
    with osdn_diag.capture(model) as cap:     # hook fla's delta-rule kernels
        model(input_ids)
    res = osdn_diag.replay(cap)                # replay every write in fp32
    res.summary["q_geo"], res.to_pandas()

``osdn_diag.capture`` and ``osdn_diag.replay`` are modules that can be called like the functions
they hold. The reference mathematics lives in :mod:`osdn_diag.math`; the symbolic proofs and the
claims ledger in :mod:`osdn_diag.proofs` (the repository's ``proofs/`` folder); the command line in
:mod:`osdn_diag.cli`. Nothing here imports fla: that happens when a capture starts.
"""

__version__ = "0.1.0"

from . import capture, replay  # noqa: E402  (callable modules, see osdn_diag._callable)
from .results import Results  # noqa: E402

__all__ = ["Results", "capture", "replay"]
