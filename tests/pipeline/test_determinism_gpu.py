"""On a GPU: the same command twice gives the same numbers.

Two stream runs of one random model on the same prompts, in one process, with fla's compiled kernels
and the Triton replay: ``summary.json`` (less its run id) and every column of ``residuals.parquet``
are equal, bit for bit. On the CPU every reduction adds in one order; on a GPU a scattered add
(``index_add_``) adds with atomics in another order each run, so a sum taken that way would differ in
its last bits between the two runs (the replay's fidelity did, until it was summed by segments).
"""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (atomics; fla's compiled kernels)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1: fla's kernels would be interpreted, not compiled"),
    pytest.mark.usefixtures("fla_kernels"),
]


def _summary(run) -> dict:
    s = json.loads((run / "summary.json").read_text())
    s.pop("run_id")
    return s


def _differences(a, b, path=""):
    """The paths at which two JSON values differ (empty when they are equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in _differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def test_two_identical_runs_give_identical_tables(tmp_path):
    from osdn_diag.pipeline import stream_run

    runs = [tmp_path / "first", tmp_path / "second"]
    for run in runs:  # enough tokens per stream that an atomic sum's order shows in its last bits
        stream_run("random:deltanet-tiny", "random", run, device="cuda", batch_size=4, num_prompts=8,
                   length=1024, progress=False)
    assert _differences(_summary(runs[0]), _summary(runs[1])) == []
    first, second = (pq.read_table(r / "residuals.parquet") for r in runs)
    if "run_id" in first.column_names:  # each run's own id, when the table carries it
        first, second = first.drop_columns(["run_id"]), second.drop_columns(["run_id"])
    assert first.column_names == second.column_names and first.num_rows == second.num_rows > 0
    for name in first.column_names:
        assert first.column(name).equals(second.column(name)), name


def test_a_call_replayed_twice_has_the_same_fidelity():
    """The fidelity of one large call, replayed ten times: one value, not ten nearby ones."""
    from osdn_diag.capture.record import KernelCall
    from osdn_diag.replay.call import replay_call

    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, H, K = 4, 4096, 8, 64
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, device="cuda", generator=g), dim=-1)
    q = torch.randn(B, T, H, K, device="cuda", generator=g)
    v = torch.randn(B, T, H, K, device="cuda", generator=g)
    beta = torch.rand(B, T, H, device="cuda", generator=g)
    from osdn_diag.math.recurrence import delta_rule_recurrence

    ref = delta_rule_recurrence(q=q, k=k, v=v, beta=beta, scale=K ** -0.5, dtype=torch.float64)
    o = (ref.o + 1e-6 * torch.randn(ref.o.shape, device="cuda", generator=g, dtype=torch.float64)).float()
    call = KernelCall(layer=0, layer_name="x", family="delta_rule", kernel="chunk_delta_rule", q=q, k=k, v=v,
                      beta=beta, o=o, scale=K ** -0.5, flags={"kernels": "fla", "device": "cuda"})
    seen = {replay_call(call, backend="triton").fidelity for _ in range(10)}
    assert len(seen) == 1 and 0 < next(iter(seen)) < 1e-3
