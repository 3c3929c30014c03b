"""What-if: a captured model's write ratios under OSDN's preconditioner, without retraining.

For every captured call, phase 1 (:func:`osdn_diag.math.phase1.osdn_phase1`) runs over the call's own
keys and gates, and the writes are replayed with the write key ``d_t ⊙ k_t``. Reads, values, gates
and the layer's decay are the model's own; the *states* are not — they follow the counterfactual
writes, so the replay no longer reproduces the kernel's outputs (the fidelity check is off) and the
numbers answer "how would these writes contract under OSDN", not "what would an OSDN model do".
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .runtime.atomic import refuse_link
from .runtime.usage import what_if_settings_error
from .capture.record import KernelCall
from .capture.store import CaptureReader
from .math.phase1 import osdn_phase1
from .replay.families import NOT_APPLICABLE
from .rundir import (
    MANIFEST,
    RunDirectoryError,
    enclosing_runs,
    finish_stage,
    new_run_id,
    out_inside_input,
    output_lock,
    reading_lock,
    prepare_output,
    remove_run_files,
    run_manifest,
    start_stage,
)

__all__ = ["WhatIf", "source_run", "what_if_out", "what_if_run"]


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
        # Checked here, before any file is touched: a what-if with a setting phase 1 cannot use must
        # not replace an existing output first. (NaN fails every comparison below.)
        error = what_if_settings_error(self.eta, self.d_min, self.d_max, self.retention)
        if error:
            raise ValueError(error)

    def name(self) -> str:
        """The default output's name: every setting written out exactly (:func:`_exact`), so that two
        what-ifs of different settings never share a directory."""
        ba = "ba" if self.beta_aware else "nba"
        return (f"what-if_eta{_exact(self.eta)}_box{_exact(self.d_min)}-{_exact(self.d_max)}"
                f"_r{_exact(self.retention)}_{ba}")

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


def _exact(x: float) -> str:
    """``x`` as the short ``%g`` form (``0.003``, ``2``) where that reads back as ``x`` exactly, else as
    ``repr`` (the shortest text that does: ``2.0000001``): ``%g`` alone keeps 6 significant digits, and
    gave box bounds 2.0000001 and 2.0000002 the same directory, the second what-if replacing the first.
    -0.0 is written ``0``: it is the setting 0 (``--retention -0.0`` had its own ``_r-0`` directory)."""
    x = float(x) + 0.0  # -0.0 + 0.0 is +0.0; every other number unchanged
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


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
    may not be ``run_dir`` or lie inside its files (``capture/``, ``plots/``, …); one that holds a
    what-if output is refused unless ``overwrite``, one that holds any other run always; it may not
    lie inside any other run either. All of this is checked,
    and ``run_dir``'s capture opened, before anything is written. ``source_run`` is stored as an
    absolute path (see :func:`source_run` for a what-if output moved with its source)."""
    run_dir = Path(run_dir)
    with reading_lock(run_dir):  # no command writes into the source while its capture is read
        return _what_if_locked(run_dir, settings, out_dir=out_dir, overwrite=overwrite, then=then, **replay_kw)


def _what_if_locked(run_dir: Path, settings: WhatIf, *, out_dir, overwrite, then, **replay_kw) -> Path:
    reader = CaptureReader(run_dir)  # refuses a run without a usable capture, naming why
    for layer in reader.manifest.get("layers", []):
        family = layer.get("family")
        if family in NOT_APPLICABLE:
            raise RunDirectoryError(
                f"{run_dir}: what-if does not apply to layer {layer.get('layer')}'s family {family} "
                f"({NOT_APPLICABLE[family]}): it replays delta-rule writes with OSDN's write key d ⊙ k "
                "(docs/families.md); nothing was written"
            )
    out = what_if_out(run_dir, settings, out_dir)
    with output_lock(out):
        return _what_if(run_dir, reader, settings, out, overwrite=overwrite, then=then, **replay_kw)


def _what_if(run_dir: Path, reader: CaptureReader, settings: WhatIf, out: Path, *, overwrite, then, **replay_kw):
    from .pipeline import replay_run

    held = run_manifest(out)
    if held is not None and held.get("counterfactual") is not True:  # a measured run: not what-if's to replace
        raise RunDirectoryError(
            f"{out}: holds a run that is not a what-if output; what-if replaces only a what-if output "
            "(with --overwrite), never a measured run: choose another --out")
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
        # Absolute: the output is read from other working directories too.
        "source_run": str(run_dir.resolve()),
        "source_run_id": reader.run_id,
    }
    out.mkdir(parents=True, exist_ok=True)
    manifest["stages"] = dict.fromkeys(("replay", *then), False)
    try:
        start_stage(out, manifest, "replay")
        replay_run(run_dir, out_dir=out, run_id=manifest["run_id"], transform=settings, tolerance=float("inf"),
                   recall=False, extra={"counterfactual": True, "what_if": asdict(settings)}, **replay_kw)
        _copy_tokens(run_dir, out)
        from .pipeline import record_result_files

        record_result_files(out, manifest)  # this output's, not the source's
        finish_stage(out, manifest, "replay")
    except BaseException:
        # A what-if is a replay of a capture that stays: a failed one (the replay refused, Ctrl-C) leaves
        # nothing to resume, and its unfinished manifest would only make the next try need --overwrite.
        remove_run_files(out)
        (out / MANIFEST).unlink(missing_ok=True)
        raise
    return out


def _copy_tokens(run_dir: Path, out: Path) -> None:
    """The source run's ``tokens.parquet`` (the same tokens, replayed with another d), where it has one;
    its manifest entry came with the source's manifest."""
    from .runtime.atomic import atomic_path

    source = run_dir / "tokens.parquet"
    if source.is_file():
        with atomic_path(out / "tokens.parquet") as tmp:
            shutil.copyfile(source, tmp)


def what_if_out(run_dir: str | os.PathLike, settings: WhatIf, out_dir: str | os.PathLike | None = None) -> Path:
    """Where a what-if of ``run_dir`` writes (``out_dir``, default ``run_dir/<settings name>``),
    refused if that is ``run_dir`` itself, inside its files, or inside any other run."""
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / settings.name()
    if out_dir is None:  # a name the package chose, below the user's directory: never written through
        refuse_link(out)
    if out_inside_input(run_dir, out):
        raise RunDirectoryError(f"--out {out}: would write over the run {run_dir} that what-if reads; "
                                "choose a directory outside it (the default is a new subdirectory of it)")
    others = [r for r in enclosing_runs(out) if r != run_dir.resolve()]
    if others:
        raise RunDirectoryError(f"--out {out}: inside the run {others[0]}, which what-if does not read; "
                                "choose a directory outside it")
    return out


def source_run(what_if_dir: str | os.PathLike, manifest: dict) -> Path:
    """The run a what-if output replayed: its ``source_run`` (relative to the working directory, as
    earlier versions stored it, or absolute) if that directory is still the run ``source_run_id``
    names, else the output's parent directory (what-if's default layout, which survives moving or
    copying the source with its outputs). Refuses, naming what it tried, when neither is."""
    what_if_dir = Path(what_if_dir)
    want = manifest.get("source_run_id")
    candidates = [Path(manifest["source_run"])] if manifest.get("source_run") else []
    candidates.append(what_if_dir.resolve().parent)
    tried: list[Path] = []
    for candidate in candidates:
        if candidate in tried:
            continue
        tried.append(candidate)
        found = run_manifest(candidate)
        if found is not None and found.get("run_id") == want:
            return candidate
    raise RunDirectoryError(f"{what_if_dir}: the run it replayed (run id {want}) is not at "
                            f"{' nor at '.join(map(str, tried))}; run what-if again on its source run")
