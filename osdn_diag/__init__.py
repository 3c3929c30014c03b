"""osdn-diag: residual-contraction diagnostics for delta-rule linear attention.

    import osdn_diag
    with osdn_diag.capture(model) as cap:     # hook fla's delta-rule kernels
        model(input_ids)
    res = osdn_diag.replay(cap)                # replay every write in fp32
    res.summary["q_geo"], res.to_pandas()
    osdn_diag.view(res)                        # the interactive view (needs plotly)

``osdn_diag.capture``, ``osdn_diag.replay`` and ``osdn_diag.view`` are modules that can be called like the functions
they hold. The reference mathematics lives in :mod:`osdn_diag.math`; the symbolic proofs and the
claims ledger in :mod:`osdn_diag.proofs` (the repository's ``proofs/`` folder); the command line in
:mod:`osdn_diag.cli`. Nothing here imports fla: that happens when a capture starts.
"""

__version__ = "0.1.0"

__all__ = ["Results", "capture", "replay", "view"]


def _source_tree_proofs() -> None:
    """Serve ``osdn_diag.proofs`` from the ``proofs/`` folder beside this package in a source checkout.

    An installed distribution holds ``osdn_diag/proofs/``, found the ordinary way. In a checkout the
    folder sits at the top of the repository (pyproject's ``package-dir``), and an editable install's
    finder maps the name to the *installed* checkout's folder: a second checkout imported through
    ``PYTHONPATH`` would otherwise run another tree's proofs. A finder placed first maps the name to
    this package's own checkout; submodules then follow that package's ``__path__``.
    """
    import sys
    from importlib.util import spec_from_file_location
    from pathlib import Path

    here = Path(__file__).resolve().parent
    folder = here.parent / "proofs"
    if (here / "proofs").exists() or not (folder / "__init__.py").is_file() \
            or not (here.parent / "pyproject.toml").is_file():
        return

    class _CheckoutProofs:  # a MetaPathFinder for one name
        @staticmethod
        def find_spec(fullname, path=None, target=None):
            if fullname != f"{__name__}.proofs":
                return None
            return spec_from_file_location(fullname, folder / "__init__.py",
                                           submodule_search_locations=[str(folder)])

    if not any(getattr(f, "_osdn_folder", None) == folder for f in sys.meta_path):
        _CheckoutProofs._osdn_folder = folder
        sys.meta_path.insert(0, _CheckoutProofs)


_source_tree_proofs()


def __getattr__(name: str):
    # Loaded on first use, so that `import osdn_diag` (and `osdn-diag --help`, or an argument error)
    # does not pay for importing torch. `capture` and `replay` are callable modules
    # (osdn_diag.runtime.callable_module); importing a submodule also sets it on this package.
    import importlib

    if name in ("capture", "replay", "view"):
        return importlib.import_module(f".{name}", __name__)
    if name == "Results":
        return importlib.import_module(".replay", __name__).Results
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
