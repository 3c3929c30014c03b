"""osdn-diag: residual-contraction diagnostics for delta-rule linear attention.

The reference mathematics lives in :mod:`osdn_diag.math`; the symbolic proofs and the claims ledger in
:mod:`osdn_diag.proofs` (the repository's ``proofs/`` folder).
"""

__version__ = "0.1.0"
