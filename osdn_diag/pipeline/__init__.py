"""Run directories, stage by stage: :func:`capture_run` (model + prompts → ``capture/`` +
``manifest.json``), :func:`replay_run` (→ ``residuals.parquet``, ``comparator.parquet``,
``summary.json``), or both in one pass without storing the capture, :func:`stream_run`.

The replay itself — the per-token table and the summary's accumulators — is
:class:`osdn_diag.replay.Replayer`; this package handles files, ranks and the manifest:

- :mod:`.session` — the capture stage (:func:`capture_run`, :func:`stream_run`): model, prompts,
  this rank's forward batches, the manifest;
- :mod:`.inputs` — batches, masks, tokenizers and the checks that a batch can run;
- :mod:`.resume` — which unfinished run can be continued, and each rank's verified record;
- :mod:`.replaying` — the replay stage (:func:`replay_run`) and the summary's files;
- :mod:`.writers` — the result files' names and their writers (the table encoded on its own thread);
- :mod:`.recall` — recall on prompts that carry answers;
- :mod:`.kernels` — whether the first batch compiles Triton kernels, and the notice said before it.
"""

from ..replay import CONTRACT_COLUMNS, Replayer
from .kernels import COMPILE_NOTICE, has_compiled_kernels, triton_cache_dir
from .recall import recall_table
from .replaying import record_result_files, replay_run
from .session import capture_run, stream_run
from .writers import COMPARATOR, RESIDUALS, SUMMARY

__all__ = [
    "COMPARATOR",
    "COMPILE_NOTICE",
    "CONTRACT_COLUMNS",
    "RESIDUALS",
    "SUMMARY",
    "Replayer",
    "capture_run",
    "has_compiled_kernels",
    "recall_table",
    "record_result_files",
    "replay_run",
    "stream_run",
    "triton_cache_dir",
]
