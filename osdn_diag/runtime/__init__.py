"""The plumbing below every stage: where the work runs and how the package gets there.

Nothing here knows what a delta rule is; every room (capture, replay, metrics, report, ...) may use it,
and it imports none of them. Importing this package imports nothing heavy: each module loads what it
needs (torch, triton, fla) when it is imported itself.

- where kernels run: :mod:`.device` (:func:`prepare`: a GPU, or the CPU under Triton's interpreter),
  :mod:`.interpret` (the interpreter's fixes for fla 0.6.0), :mod:`.fla_import` (only the fla
  modules a model uses), :mod:`.host` (small tensors copied without waiting), :mod:`.cpus`;
- what is kept between processes: :mod:`.cache_paths`, :mod:`.bytecode`, :mod:`.dist_cache`,
  :mod:`.tuning` and :mod:`.autotune` (fla's autotuning choices);
- files: :mod:`.atomic` (written all at once or not at all), :mod:`.strict_json`, :mod:`.storage`
  (a full disk in one line), :mod:`.schema` (the run files' shapes, checked on read);
- checks of what users pass: :mod:`.checks` (the public functions' arguments), :mod:`.config_checks`
  (a model directory's files and sizes, before a model is built);
- the package's own shape: :mod:`.lazy` (names loaded on first use), :mod:`.callable_module`.
"""

from .lazy import lazy_names

__all__ = ["default_device", "prepare"]

__getattr__, __dir__ = lazy_names(__name__, {"default_device": "device", "prepare": "device"})
