"""The interactive view: one self-contained HTML page of one or more runs, in the browser or inline in
Jupyter. Downstream of the report (capture → replay → metrics → report → plot, view): it only reads
finished runs or in-memory results.

    import osdn_diag
    v = osdn_diag.view(["runs/deltanet", "runs/osdn"])   # or a Results, or {label: run}
    v                                                     # Jupyter shows it inline
    v.save("view.html")                                   # the same page, opens from disk

* :mod:`.data` — :func:`view_data`: each run reduced to what the view shows (aggregates exactly; token
  strips for a chosen or sampled few prompts).
* :mod:`.figures` — the plotly figures.
* :mod:`.page` — :class:`View`, the page (plotly.js inlined, no network), and :func:`write_view`.

Needs plotly (``pip install 'osdn-diag[view]'``); the static report does not. The package is callable:
``osdn_diag.view(runs)`` is :func:`view`.
"""

from __future__ import annotations

__all__ = ["View", "view", "view_data", "write_view"]


def view(runs, labels=None, *, strips: int | None = None, strip_prompts=None, height: int = 900):
    """The :class:`~osdn_diag.view.page.View` of ``runs``: a run directory, a
    :class:`~osdn_diag.replay.Results`, a list of them, or a ``{label: run}`` mapping. ``labels``: one
    per run. Token strips for the prompt ids ``strip_prompts``, or else for ``strips`` prompts (4 by
    default) taken in turn from each task. ``height``: of the inline frame in Jupyter, pixels."""
    from .data import view_data
    from .page import View

    return View(view_data(runs, labels, strips=strips, strip_prompts=strip_prompts), height=height)


def __getattr__(name: str):
    import importlib

    homes = {"View": "page", "write_view": "page", "view_data": "data"}
    if name in homes:
        return getattr(importlib.import_module(f".{homes[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


from ..runtime.callable_module import make_callable  # noqa: E402

make_callable(__name__, "view")
