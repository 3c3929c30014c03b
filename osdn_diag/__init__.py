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

__all__ = ["Results", "capture", "replay"]


def __getattr__(name: str):
    # Loaded on first use, so that `import osdn_diag` (and `osdn-diag --help`, or an argument error)
    # does not pay for importing torch. `capture` and `replay` are callable modules
    # (osdn_diag._callable); importing a submodule also sets it on this package.
    import importlib

    if name in ("capture", "replay"):
        return importlib.import_module(f".{name}", __name__)
    if name == "Results":
        return importlib.import_module(".replay", __name__).Results
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
