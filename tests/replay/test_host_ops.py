"""The host work around the replay kernel: how many torch operations ``Replayer.add`` issues per call
(on a GPU each is ~10–25 µs of host dispatch), and that the layouts kept between calls, the fused
checks and the host-side counting leave every number as a plain computation gives it.

The operation counts come from ``benchmarks/bench_host_ops.py`` (the recurrence replaced by its
precomputed result, so only the surrounding work is counted). The expected values below are computed
here, plainly: gathers from the reference recurrence's own result (exact), per-stream loops over the
call's tensors (extremes and counts: exact), and an fp64 loop of the delta rule (sums: to rounding).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from osdn_diag.capture.store import StoredCall
from osdn_diag.math.recurrence import delta_rule_recurrence
from osdn_diag.metrics.hypotheses import HYPOTHESES, key_norm_tol
from osdn_diag.metrics.ratios import Q_FLOOR, RatioAccumulator
from osdn_diag.replay.call import recurrence_inputs, replay_call
from osdn_diag.replay.replayer import Replayer, _Problems

#: Torch operations per call at most, measured after the work was cut down (before: 520 for
#: ``Replayer.add`` with the comparator, 470 without, 125 for ``replay_call``, at this shape; the
#: counts grew with the heads and sequences of a call, which they no longer do). A little headroom for
#: another torch's decompositions; a change that adds work per call fails here.
BUDGET = {"replay_call": 84, "add (comparator off)": 166, "add (run --stream)": 184}


@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script("bench_host_ops")


@pytest.mark.parametrize("heads, sequences", [(8, 8), (4, 3)])
def test_operations_per_call_stay_within_the_budget(bench, heads, sequences):
    call = bench.make_call(B=sequences, T=8, H=heads, K=16, V=16)
    with bench.recurrence_replaced(call):
        for name, fn in bench.configurations(call).items():
            ops = bench.count_ops(fn).total
            assert ops <= BUDGET[name], (name, ops)


# ---- awkward calls, and what a plain computation says about them ----

B, T, H, K, V = 3, 37, 2, 8, 4  # T not a multiple of 64


def _awkward(*, varlen=False, precond=False, gated=False, nonfinite=False, seed=0):
    """A call with zero keys, zero residuals (v = 0 on a zero state), β ≈ 0, β = 0 and β ≈ 2; packed
    into one row with ``varlen``; one (sequence, head) stream holding a NaN (and one an Inf) with
    ``nonfinite``. ``o`` is the reference recurrence's, nudged by a relative 1e-7 (so that the fidelity
    is not 0)."""
    g = torch.Generator().manual_seed(seed)
    rows, length = (1, B * T) if varlen else (B, T)
    q = torch.randn(rows, length, H, K, generator=g)
    k = torch.nn.functional.normalize(torch.randn(rows, length, H, K, generator=g), dim=-1)
    v = torch.randn(rows, length, H, V, generator=g)
    beta = torch.rand(rows, length, H, generator=g)
    k[:, 2:4, 0] = 0.0
    v[:, :3] = 0.0
    beta[:, 5] = 1e-7
    beta[:, 6] = 1.999
    beta[:, 7, 1] = 0.0
    d = 0.5 + 1.5 * torch.rand(rows, length, H, K, generator=g) if precond else None
    gate = -0.1 * torch.rand(rows, length, H, generator=g) if gated else None
    cu = torch.tensor([0, 30, 31, 70, B * T]) if varlen else None
    ref = delta_rule_recurrence(q, k, v, beta, write_key=None if d is None else d * k, g=gate, scale=K**-0.5,
                                cu_seqlens=cu, dtype=torch.float32)
    o = ref.o * (1 + 1e-7 * torch.randn(ref.o.shape, generator=g))
    if nonfinite:
        q = q.clone()
        q[0, 4, 1, 3] = float("nan")
        v = v.clone()
        v[0, -1, 0, 0] = float("inf")  # the last sequence of a packed row, else row 0's head 0
    from osdn_diag.capture import KernelCall

    return KernelCall(layer=1, layer_name="layers.1.attn", family="delta_rule", kernel="chunk_delta_rule",
                      q=q, k=k, v=v, beta=beta, g=gate, d=d, o=o, scale=K**-0.5, final_state=ref.final_state,
                      cu_seqlens=cu, flags={"kernels": "fla", "path": "fused_recurrent", "device": "cpu"})


CASES = {
    "plain": {},
    "nonfinite": {"nonfinite": True},
    "varlen-nonfinite": {"varlen": True, "nonfinite": True},
    "precond-gated": {"precond": True, "gated": True, "nonfinite": True},
}


def _streams(call):
    """``(sequence, head, row, tokens)`` of every stream, in the table's order."""
    return [(i, h, r, torch.arange(s, e)) for i, (r, s, e) in enumerate(call.segments()) for h in range(H)]


def _stream_finite(call, r, toks, h) -> bool:
    """Whether every input of the stream is finite."""
    xs = [x for x in (call.q, call.k, call.v, call.beta, call.d, call.g) if x is not None]
    return all(bool(torch.isfinite(x[r, toks, h]).all()) for x in xs)


def _fp64_losses(call, r, toks, h):
    """fp64 delta rule along one stream: f_t(S_{t−1}) (pre-decay), f_t(S̄_{t−1}), f_t(S_t)."""
    k, v, beta = call.k[r, toks, h].double(), call.v[r, toks, h].double(), call.beta[r, toks, h].double()
    wk = k if call.d is None else call.d[r, toks, h].double() * k
    a = None if call.g is None else call.g[r, toks, h].double().exp()
    S = torch.zeros(V, K, dtype=torch.float64)
    before, decayed, after = [], [], []
    for t in range(len(toks)):
        before.append(0.5 * float((S @ k[t] - v[t]).square().sum()))
        if a is not None:
            S = a[t] * S
        decayed.append(0.5 * float((S @ k[t] - v[t]).square().sum()))
        S = S + beta[t] * torch.outer(v[t] - S @ k[t], wk[t])
        after.append(0.5 * float((S @ k[t] - v[t]).square().sum()))
    return torch.tensor(before), torch.tensor(decayed), torch.tensor(after)


@pytest.mark.parametrize("case", list(CASES))
def test_replayed_columns_are_the_recurrences_values_in_table_order(case):
    call = _awkward(**CASES[case])
    res = replay_call(call)
    # The replay's recurrence runs on zeros in place of the non-finite tokens (only those).
    finite = torch.isfinite(call.beta)
    for x in (call.q, call.k, call.v, call.d, call.g):
        if x is not None:
            finite &= torch.isfinite(x).all(-1) if x.dim() == 4 else torch.isfinite(x)
    ref = delta_rule_recurrence(**recurrence_inputs(call, torch.float32, None if bool(finite.all()) else ~finite))
    want_rows = {"sequence": [], "head": [], "pos": [], "finite": []}
    gathered = {name: [] for name in ("beta", "key_sqnorm", "write_gain", "loss_before", "loss_after")}
    for i, h, r, toks in _streams(call):
        ok = _stream_finite(call, r, toks, h)
        want_rows["sequence"] += [i] * len(toks)
        want_rows["head"] += [h] * len(toks)
        want_rows["pos"] += list(range(len(toks)))
        want_rows["finite"] += [ok] * len(toks)
        gathered["beta"].append(call.beta[r, toks, h])
        gathered["key_sqnorm"].append(call.k.square().sum(-1)[r, toks, h])
        for name in ("write_gain", "loss_before", "loss_after"):
            gathered[name].append(getattr(ref, name)[r, toks, h])
    for name, want in want_rows.items():
        assert res.columns[name].tolist() == want, name
        assert res.device_columns[name].tolist() == want, name
    for name, parts in gathered.items():  # bit for bit: a gather moves values as they are
        want = torch.cat(parts)
        assert torch.equal(res.columns[name].view(torch.int32), want.view(torch.int32)), name
        assert torch.equal(res.device_columns[name].view(torch.int32), want.view(torch.int32)), name
    lb, la = res.columns["loss_before"], res.columns["loss_after"]
    want_ratio = torch.where(lb == 0, 1.0, la / torch.where(lb == 0, 1.0, lb))
    assert torch.equal(res.columns["residual_ratio"], want_ratio)
    # Against an fp64 loop, stream by stream (finite streams), and the fidelity numbers.
    n_bad, worst, worst_state = 0, 0.0, 0.0
    off = 0
    for i, h, r, toks in _streams(call):
        rows = slice(off, off + len(toks))
        off += len(toks)
        if not _stream_finite(call, r, toks, h):
            n_bad += 1
            continue
        before, decayed, after = _fp64_losses(call, r, toks, h)
        scale = before.abs().max() + after.abs().max()
        assert (res.columns["loss_before"][rows].double() - before).abs().max() <= 1e-5 * scale
        assert (res.columns["loss_after"][rows].double() - after).abs().max() <= 1e-5 * scale
        if call.g is not None:
            assert (res.columns["loss_before_decayed"][rows].double() - decayed).abs().max() <= 1e-5 * scale
        o_ref, o = ref.o[r, toks, h].double(), call.o[r, toks, h].double()
        worst = max(worst, float((o_ref - o).norm() / o.norm()))
        s_ref, s = ref.final_state[i, h].double(), call.final_state[i, h].double()
        worst_state = max(worst_state, float((s_ref - s).norm() / s.norm()))
    assert res.nonfinite == n_bad == len(res.nonfinite_streams)
    assert res.fidelity == pytest.approx(worst, rel=1e-3) and res.fidelity > 0
    assert res.state_fidelity == pytest.approx(worst_state, rel=1e-3, abs=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_audit_and_comparator_inputs_are_the_plain_per_stream_values(case):
    call = _awkward(**CASES[case])
    stored = StoredCall(batch=0, prompts=list(range(10, 10 + len(call.segments()))), call=call)
    rp = Replayer({p: {"task": "t", "length": 40} for p in stored.prompts}, backend="torch", device="cpu")
    rp.add(stored)
    res = replay_call(call)
    heads = rp.audit.summary()["by_head"]
    k2 = call.k.double().square().sum(-1)
    for h in range(H):
        ok = res.grid["finite"][..., h]
        a = heads[f"001.{h:03d}"]
        assert a["n"] == int(ok.sum())
        assert a["max_unit_dev"] == float((k2[..., h][ok] - 1).abs().max())
        assert a["beta_min"] == float(call.beta[..., h][ok].double().min())
        assert a["beta_max"] == float(call.beta[..., h][ok].double().max())
        if call.d is not None:
            assert a["d_min"] == float(call.d[..., h, :][ok].double().min())
            assert a["d_max"] == float(call.d[..., h, :][ok].double().max())
    # Theorem D.7's problems: stream i·H + h reads sequence i, head h; padding reads the last token.
    problems = _Problems.of(stored, call, res, rp.prompts)
    L = max(e - s for _, s, e in call.segments())
    valid_grid = res.grid["theorem_valid"]
    ratio_grid = res.grid["residual_ratio"]
    flags = {name: [] for name in HYPOTHESES}
    for p, (i, h, r, toks) in enumerate(_streams(call)):
        n = len(toks)
        pad = torch.cat([toks, toks[-1:].expand(L - n)])
        inside = torch.arange(L) < n
        k = torch.where(inside[:, None], call.k[r, pad, h], 0.0).nan_to_num()
        beta = torch.where(inside, call.beta[r, pad, h], 0.0).nan_to_num()
        assert torch.equal(problems.k[p], k) and torch.equal(problems.beta[p], beta)
        if call.d is not None:
            assert torch.equal(problems.d[p], call.d[r, pad, h])
        assert torch.equal(problems.q[p], torch.where(inside, ratio_grid[r, pad, h].double(), 1.0))
        valid = inside & valid_grid[r, pad, h]
        assert torch.equal(problems.valid[p], valid)
        v = valid[:n]  # the stream's checks read its valid tokens only
        b = call.beta[r, toks, h][v]
        flags["unit_keys"].append(bool(((k2[r, toks, h][v] - 1).abs() <= key_norm_tol("float32")).all()))
        flags["beta_in_open_unit_interval"].append(bool(((b > 0) & (b < 1)).all()))
        dv = None if call.d is None else call.d[r, toks, h][v]
        flags["d_in_box"].append(dv is None or bool(((dv >= 0.5) & (dv <= 2.0)).all()))
        flags["no_decay"].append(call.g is None)
        flags["has_valid_token"].append(bool(v.any()))
    holds = [all(f) for f in zip(*flags.values())]
    table = rp.comparator_table()
    assert table.column("hypotheses_hold").to_pylist() == holds
    assert table.column("n_valid").to_pylist() == [int(x) for x in problems.valid.sum(1)]
    for h in range(H):  # the audit's counts per head, from its own per-stream checks
        mine = slice(h, None, H)
        assert heads[f"001.{h:03d}"]["hypotheses_failed"] == {name: f[mine].count(False) for name, f in flags.items()}
        assert heads[f"001.{h:03d}"]["hypotheses_hold"] == sum(holds[mine])
    s = rp.audit.summary()
    assert s["streams"] == len(holds) and s["hypotheses_hold"] == sum(holds)


@pytest.mark.parametrize("case", list(CASES))
def test_ratio_statistics_of_a_kept_layout_are_those_found_afresh(case):
    """The cells found once per layout (``layout=``) give the sums found afresh from the columns, bit
    for bit, on every call of that layout; and the counts are the plain ones."""
    call = _awkward(**CASES[case])
    res = replay_call(call)
    tasks = ["a", "b", "a", "c"][:len(call.segments())]
    key = ("test", case)
    kept, fresh = RatioAccumulator(), RatioAccumulator()
    for layer in (0, 1, 2):  # the first call finds the layout, the others reuse it
        kept.add(layer, res.device_columns, tasks, res.sequence_lengths, H, layout=key)
        fresh.add(layer, res.device_columns, tasks, res.sequence_lengths, H)
    assert kept.cells.keys() == fresh.cells.keys() and kept.excluded_nonfinite == fresh.excluded_nonfinite
    for cell, stats in kept.cells.items():
        other = fresh.cells[cell]
        assert (stats.n, stats.n_zero, stats.sum_log, stats.sum) == (other.n, other.n_zero, other.sum_log,
                                                                     other.sum), cell
    finite = res.columns["finite"]
    q = res.columns["residual_ratio"][finite].double()
    total = kept.summary()
    assert total["n"] == 3 * int(finite.sum()) and total["n_zero"] == 3 * int((q == 0).sum())
    assert total["excluded_nonfinite"] == 3 * int((~finite).sum())
    assert math.log(total["q_geo"]) == pytest.approx(float(q.clamp_min(Q_FLOOR).log().mean()), rel=1e-12)
    assert total["q_arith"] == pytest.approx(float(q.mean()), rel=1e-12)


def test_rows_out_of_cell_order_are_sorted_once_per_layout():
    call = _awkward()
    res = replay_call(call)
    order = torch.randperm(res.columns["pos"].numel(), generator=torch.Generator().manual_seed(1))
    cols = {name: x[order] for name, x in res.device_columns.items()}
    kept, fresh = RatioAccumulator(), RatioAccumulator()
    for _ in range(2):
        kept.add(0, cols, ["t"] * B, res.sequence_lengths, H, layout=("shuffled",))
        fresh.add(0, cols, ["t"] * B, res.sequence_lengths, H)
    assert {c: (s.n, s.n_zero, s.sum_log, s.sum) for c, s in kept.cells.items()} == \
           {c: (s.n, s.n_zero, s.sum_log, s.sum) for c, s in fresh.cells.items()}


def test_replayer_output_does_not_depend_on_the_kept_layouts():
    """Two layouts alternating (one packed, one not), with a non-finite stream in one: every call's rows
    and the summary as from a replayer whose caches are emptied before each call."""
    from osdn_diag.metrics import audit as audit_module
    from osdn_diag.metrics import ratios as ratios_module
    from osdn_diag.replay import call as call_module
    from osdn_diag.replay import replayer as replayer_module

    calls = [replace(_awkward(seed=s, **kw), layer=s) for s, kw in enumerate(
        [{}, {"varlen": True}, {"nonfinite": True}, {"varlen": True, "nonfinite": True}, {"precond": True}])]

    def run(clear: bool):
        rp = Replayer({p: {"task": f"t{p % 2}", "length": 40} for p in range(4)}, backend="torch", device="cpu")
        tables = []
        for c in calls:
            if clear:
                call_module._cached_table_index.cache_clear()
                replayer_module._problem_layout.cache_clear()
                audit_module._stream_index.cache_clear()
                ratios_module._LAYOUTS.clear()
            tables.append(rp.add(StoredCall(batch=0, prompts=list(range(len(c.segments()))), call=c)))
        return tables, rp.summary(), rp.comparator_table()

    a, b = run(False), run(True)
    assert all(x.equals(y) for x, y in zip(a[0], b[0]))
    assert repr(a[1]) == repr(b[1])  # NaN-safe, and every float to the last bit
    assert repr(a[2].to_pylist()) == repr(b[2].to_pylist())  # NaN-safe
