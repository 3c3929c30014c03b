"""What-if: a captured model's write ratios under OSDN's preconditioner, without retraining.

For every captured call, phase 1 (:func:`osdn_diag.math.phase1.osdn_phase1`) runs over the call's own
keys and gates, and the writes are replayed with the write key ``d_t ⊙ k_t``. Reads, values, gates
and the layer's decay are the model's own; the *states* are not — they follow the counterfactual
writes, so the replay no longer reproduces the kernel's outputs (the fidelity check is off) and the
numbers answer "how would these writes contract under OSDN", not "what would an OSDN model do".
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ._json import dumps as strict_json
from .capture.record import KernelCall
from .capture.store import CaptureReader
from .math.phase1 import osdn_phase1
from .rundir import RunDirectoryError, finish_stage, new_run_id, out_inside_input, prepare_output, start_stage

__all__ = ["WhatIf", "what_if_run"]


@dataclass(frozen=True)
class WhatIf:
    """The counterfactual preconditioner: Algorithm 1 with these settings (``retention`` is a
    constant r applied every token; 1 is plain OSDN)."""

    eta: float = 0.003
    d_min: float = 0.5
    d_max: float = 2.0
    retention: float = 1.0
    beta_aware: bool = True

    def __post_init__(self):
        if not 0.0 <= self.retention <= 1.0:
            raise ValueError(f"argument 'retention': expected a value in [0, 1], got {self.retention}")

    def name(self) -> str:
        ba = "ba" if self.beta_aware else "nba"
        return f"what-if_eta{self.eta:g}_box{self.d_min:g}-{self.d_max:g}_r{self.retention:g}_{ba}"

    def __call__(self, call: KernelCall) -> KernelCall:
        k = torch.nan_to_num(call.k)  # non-finite tokens are flagged by replay and left out anyway
        beta = torch.nan_to_num(call.beta)
        retention = None if self.retention == 1.0 else torch.full_like(beta, self.retention)
        pre = osdn_phase1(
            k, beta, retention=retention, eta=self.eta, d_min=self.d_min, d_max=self.d_max,
            beta_aware=self.beta_aware, cu_seqlens=call.cu_seqlens,
        )
        # The counterfactual writes with d ⊙ k in fp32: the kernel's stored write key and final state
        # describe the model's own writes, not these.
        return replace(call, d=pre.d.to(call.k.dtype), write_key=None, final_state=None,
                       flags={**call.flags, "what_if": asdict(self)})


def what_if_run(
    run_dir: str | os.PathLike,
    settings: WhatIf,
    *,
    out_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
    then: tuple[str, ...] = (),
    **replay_kw,
) -> Path:
    """Replay ``run_dir``'s capture with the counterfactual preconditioner into ``out_dir``
    (default ``run_dir/<settings name>``), writing a manifest marked ``"counterfactual": true``,
    ``residuals.parquet`` and ``summary.json`` — without recall accuracy, which only a forward pass
    with the counterfactual d could measure. Returns ``out_dir``.

    The output is a run of its own: a new run id, ``source_run`` and ``source_run_id`` naming what it
    replayed, no capture, and the stages ``replay`` (plus ``then``, e.g. ``("report",)``). ``out_dir``
    may not be ``run_dir`` or lie inside its files (``capture/``, ``plots/``, …); one that holds a run
    is refused unless ``overwrite``. Both are checked, and ``run_dir``'s capture opened, before
    anything is written."""
    from .pipeline import replay_run

    run_dir = Path(run_dir)
    reader = CaptureReader(run_dir)  # refuses a run without a usable capture, naming why
    out = Path(out_dir) if out_dir is not None else run_dir / settings.name()
    if out_inside_input(run_dir, out):
        raise RunDirectoryError(f"--out {out}: would write over the run {run_dir} that what-if reads; "
                                "choose a directory outside it (the default is a new subdirectory of it)")
    prepare_output(out, overwrite=overwrite)
    source = reader.manifest
    spec = source.get("model", {}).get("spec", "?")
    manifest = {
        **{k: v for k, v in source.items() if k not in ("run_id", "shards", "stages", "complete")},
        "run_id": new_run_id(),
        "model": {**source.get("model", {}), "spec": f"{spec} + OSDN d (what-if)"},
        # No recall: the source run measured it on the model's own forward pass, and no forward pass
        # ran with this d, so a what-if has none to report.
        "prompts": [{k: v for k, v in p.items() if not k.startswith("recall_")}
                    for p in source.get("prompts", [])],
        "counterfactual": True,
        "what_if": asdict(settings),
        "source_run": str(run_dir),
        "source_run_id": reader.run_id,
    }
    out.mkdir(parents=True, exist_ok=True)
    manifest["stages"] = dict.fromkeys(("replay", *then), False)
    start_stage(out, manifest, "replay")
    replay_run(run_dir, out_dir=out, run_id=manifest["run_id"], transform=settings, tolerance=float("inf"),
               recall=False, extra={"counterfactual": True, "what_if": asdict(settings)}, **replay_kw)
    finish_stage(out, manifest, "replay")
    return out
