"""Streaming ratio statistics: exact against a direct computation, additive across parts."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from osdn_diag.metrics.ratios import RatioAccumulator, RatioStats

# The documented floor on exact-zero ratios in q_geo (README, "The reference mathematics";
# docs/design-notes.md, note 4).
Q_FLOOR = 1e-30


def _call(seed: int, lengths: list[int], heads: int, zero_frac: float = 0.1):
    gen = torch.Generator().manual_seed(seed)
    cols = {k: [] for k in ("sequence", "head", "pos", "finite", "residual_ratio")}
    for s, L in enumerate(lengths):
        for h in range(heads):
            cols["sequence"].append(torch.full((L,), s))
            cols["head"].append(torch.full((L,), h))
            cols["pos"].append(torch.arange(L))
            cols["finite"].append(torch.rand(L, generator=gen) > 0.05)
            q = torch.rand(L, generator=gen, dtype=torch.float64) * 2
            q[torch.rand(L, generator=gen) < zero_frac] = 0.0
            cols["residual_ratio"].append(q)
    return {k: torch.cat(v) for k, v in cols.items()}


@given(
    seed=st.integers(0, 10_000),
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=3),
    heads=st.integers(1, 3),
    num_bins=st.integers(1, 7),
)
def test_summary_matches_direct_computation(seed, lengths, heads, num_bins):
    cols = _call(seed, lengths, heads)
    tasks = [f"t{i % 2}" for i in range(len(lengths))]
    acc = RatioAccumulator(num_bins=num_bins)
    acc.add(3, cols, tasks, lengths)
    s = acc.summary({"t0": 0.5})
    ok = cols["finite"]
    q = cols["residual_ratio"][ok]
    assert s["n"] == q.numel() and s["excluded_nonfinite"] == int((~ok).sum())
    assert s["n_zero"] == int((q == 0).sum())
    if q.numel():
        assert math.isclose(s["q_geo"], math.exp(q.clamp_min(Q_FLOOR).log().mean()), rel_tol=1e-12)
        assert math.isclose(s["q_arith"], float(q.mean()), rel_tol=1e-12)
    length = torch.tensor(lengths, dtype=torch.float64)[cols["sequence"]]
    b = (cols["pos"] / length * num_bins).floor().long().clamp(max=num_bins - 1)[ok]
    for i in range(num_bins):
        sel = q[b == i]
        assert s["position_bins"]["n"][i] == sel.numel()
        if sel.numel():
            assert math.isclose(s["position_bins"]["q_arith"][i], float(sel.mean()), rel_tol=1e-12)
    for t in set(tasks):
        rows = torch.tensor([tasks[int(i)] == t for i in cols["sequence"]])[ok]
        assert s["by_task"].get(t, {"n": 0})["n"] == int(rows.sum())
    assert s["position_bins"]["repeat_boundary"] == {"t0": 0.5}
    assert sum(v["n"] for v in s["by_head"].values()) == s["n"]


@given(seed=st.integers(0, 10_000))
def test_merge_equals_one_pass(seed):
    a, b = _call(seed, [9, 4], 2), _call(seed + 1, [7], 2)
    b["finite"][0] = False  # the part merged in has an exclusion of its own
    whole, left, right = RatioAccumulator(), RatioAccumulator(), RatioAccumulator()
    whole.add(0, a, ["x", "y"], [9, 4])
    whole.add(1, b, ["x"], [7])
    left.add(0, a, ["x", "y"], [9, 4])
    right.add(1, b, ["x"], [7])
    left.merge(right)
    sa, sb = whole.summary(), left.summary()
    assert sa["n"] == sb["n"] and math.isclose(sa["q_geo"], sb["q_geo"], rel_tol=1e-12)
    assert sa["by_layer"] == sb["by_layer"]
    # NaN/Inf ratios left out of either part are counted once each in the merged summary
    nonfinite = int((~a["finite"]).sum()) + int((~b["finite"]).sum())
    assert sa["excluded_nonfinite"] == sb["excluded_nonfinite"] == nonfinite


@given(seed=st.integers(0, 10_000), lengths=st.lists(st.integers(1, 20), min_size=1, max_size=3))
def test_row_order_does_not_matter(seed, lengths):
    """Rows out of cell order (sorted internally) summarise as rows in order do."""
    cols = _call(seed, lengths, 3)
    perm = torch.randperm(cols["pos"].numel(), generator=torch.Generator().manual_seed(seed))
    shuffled = {k: v[perm] for k, v in cols.items()}
    tasks = [f"t{i}" for i in range(len(lengths))]
    ordered, unordered = RatioAccumulator(num_bins=4), RatioAccumulator(num_bins=4)
    ordered.add(2, cols, tasks, lengths)
    unordered.add(2, shuffled, tasks, lengths)
    assert ordered.cells.keys() == unordered.cells.keys()
    for key, stats in ordered.cells.items():
        other = unordered.cells[key]
        assert (stats.n, stats.n_zero) == (other.n, other.n_zero)
        assert math.isclose(stats.sum_log, other.sum_log, rel_tol=1e-12, abs_tol=1e-12)
        assert math.isclose(stats.sum, other.sum, rel_tol=1e-12, abs_tol=1e-12)
    assert ordered.excluded_nonfinite == unordered.excluded_nonfinite


def test_heads_beyond_the_largest_seen_are_counted_apart():
    """``num_heads`` larger than the heads present (a head all non-finite, say) keeps each row's head."""
    cols = _call(0, [5, 3], 2)
    acc = RatioAccumulator(num_bins=2)
    acc.add(0, cols, ["a", "b"], [5, 3], num_heads=4)
    heads = {key[1] for key in acc.cells}
    assert heads == {0, 1}
    assert sum(s.n for s in acc.cells.values()) == int(cols["finite"].sum())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_sums_on_the_gpu_equal_the_host_sums():
    cols = _call(7, [300, 41, 1000], 4)
    tasks = ["x", "y", "x"]
    host, gpu = RatioAccumulator(), RatioAccumulator()
    host.add(1, cols, tasks, [300, 41, 1000])
    gpu.add(1, {k: v.cuda() for k, v in cols.items()}, tasks, [300, 41, 1000], num_heads=4)
    assert host.cells.keys() == gpu.cells.keys()
    for key, stats in host.cells.items():
        other = gpu.cells[key]
        assert (stats.n, stats.n_zero) == (other.n, other.n_zero)
        assert math.isclose(stats.sum_log, other.sum_log, rel_tol=1e-12)
        assert math.isclose(stats.sum, other.sum, rel_tol=1e-12)
    assert host.excluded_nonfinite == gpu.excluded_nonfinite


def test_ratio_stats_of_a_tensor():
    """n_zero counts exact zeros only; a tiny positive ratio is floored in the log sum, not a zero."""
    q = torch.tensor([0.0, 1e-35, 0.5, 2.0], dtype=torch.float64)
    s = RatioStats.of(q)
    assert (s.n, s.n_zero) == (4, 1)
    assert s.sum == 2.5 + 1e-35 and math.isclose(s.q_arith, (2.5 + 1e-35) / 4, rel_tol=1e-15)
    assert math.isclose(s.sum_log, 2 * math.log(Q_FLOOR) + math.log(0.5) + math.log(2.0), rel_tol=1e-15)
