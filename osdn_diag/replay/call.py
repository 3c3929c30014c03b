"""One captured kernel call replayed: every write recomputed in fp32 (or fp64), its residual ratio measured.

For each captured call and each (sequence, head, position) the replay recomputes the state from the
captured inputs — it never trusts Lemma 4.1's identity, which the tests check *against* it — and
records

    loss_before = f_t(S_{t−1}),  loss_after = f_t(S_t),  residual_ratio = loss_after / loss_before
    (gated backbones also: loss_before_decayed = f_t(S̄_{t−1}), residual_ratio_post)

with ``residual_ratio = 1`` where ``loss_before == 0`` (the paper's convention). It also recomputes
the layer output and compares it with what the kernel returned (``fidelity``): a large error means the
adapter misread the kernel, and replay fails loudly rather than report numbers about another
recurrence. Where the kernel returned its fp32 final state (capture asks every kernel for it), the
replay's final state is compared with it too (``state_fidelity``): the output is rounded to the
model's dtype, the state is not, so on the paths that keep their state in fp32 registers the state
comparison sees a misread input at the 1e-4 level that the output comparison cannot.

Sequences whose captured inputs hold NaN/Inf are replayed on zeros, flagged ``finite = False`` per
(sequence, head) — every token of the stream, not only those after the first bad one: the kernel's
state is NaN from there on, and a stream measured in part would bias its statistics toward its
start — and left out of every statistic, with a count.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ..runtime.host import from_host
from ..capture.kernel_inputs import unit_roundoff
from ..capture.record import KernelCall
from ..math.closed_forms import residual_ratio
from ..math.recurrence import delta_rule_recurrence
from . import families

__all__ = [
    "CallReplay",
    "CHUNK16_TOLERANCE",
    "DEFAULT_TOLERANCE",
    "FidelityError",
    "ReplayOverflowError",
    "ZERO_RESIDUAL",
    "default_state_tolerance",
    "default_tolerance",
    "working_precision",
    "recurrence_inputs",
    "replay_call",
    "zero_nonfinite",
]

#: Largest accepted relative error ‖o_replay − o_kernel‖ / ‖o_kernel‖, by the kernel's input dtype.
DEFAULT_TOLERANCE = {"float32": 1e-5, "float64": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}
#: fla's chunk kernels multiply fp32 inputs with tf32 dot products on the GPU: their own outputs are
#: only that accurate (measured on an H200: 1.5e-3 for chunk_gated_delta_rule at T = 2048, against
#: 5.8e-6 for the fused-recurrent kernel on the same layer).
TF32_TOLERANCE = 1e-2


#: fla's chunk kernels on 16-bit inputs also keep their intra-chunk products and intermediates in
#: that dtype, and their output error grows beyond the output's own rounding: on an H200, trained
#: 4-layer language models (``builtin:lm-*``, 16 prompts of 512 and 1,024 tokens) gave 3.9e-3 to
#: 1.06e-2 (up to 2.7 units of bf16 rounding) while their final states stayed within 1.1 units.
#: Accepted up to the 16-bit state tolerance, 5e-2 (12.8 units).
CHUNK16_TOLERANCE = 5e-2


def default_tolerance(call: KernelCall) -> float:
    """The fidelity tolerance for a call: by input dtype, relaxed to tf32 accuracy for fp32 inputs
    to fla's chunk kernels on a GPU and to :data:`CHUNK16_TOLERANCE` where fla's chunk kernels compute
    in 16 bits (:func:`working_precision`)."""
    if (
        call.input_dtype == "float32"
        and call.kernel.startswith("chunk")
        and call.flags.get("kernels") == "fla"
        and call.flags.get("device") == "cuda"
    ):
        return TF32_TOLERANCE
    if working_precision(call) in ("bfloat16", "float16") and call.flags.get("path", "chunk") == "chunk":
        return CHUNK16_TOLERANCE
    return DEFAULT_TOLERANCE.get(call.input_dtype, 1e-2)


#: Largest accepted relative final-state error ‖S_replay − S_kernel‖_F / ‖S_kernel‖_F per (sequence,
#: head), by the precision the kernel's recurrence works in (:func:`working_precision`). A path that
#: keeps its state, keys and gates in fp32 registers agrees with the fp32 replay to ~1e-6; fla's chunk
#: paths multiply 16-bit (or tf32) operands and store intermediates in the input dtype.
STATE_TOLERANCE = {"float32": 1e-4, "tfloat32": 5e-2, "float16": 5e-2, "bfloat16": 5e-2}


def working_precision(call: KernelCall) -> str:
    """The precision the kernel's recurrence computed in: ``"float32"`` for the fused recurrent kernels
    (registers) and the reference stand-in, the input dtype for fla's chunk paths with 16-bit inputs
    (and for the naive precond path, which holds its state in that dtype),
    ``"tfloat32"`` for fla's chunk paths with fp32 inputs on a GPU (tf32 dot products)."""
    path = call.flags.get("path", "chunk")
    if call.flags.get("kernels") != "fla" or path == "fused_recurrent":
        return "float32"
    if path == "naive":  # fla's torch reference holds its state in v's dtype
        return call.input_dtype if call.input_dtype in ("bfloat16", "float16") else "float32"
    if call.input_dtype in ("bfloat16", "float16"):
        return call.input_dtype
    return "tfloat32" if call.flags.get("device") == "cuda" else "float32"


def default_state_tolerance(call: KernelCall) -> float:
    """The final-state fidelity tolerance for a call, by :func:`working_precision`."""
    return STATE_TOLERANCE[working_precision(call)]


#: How tokens with a zero residual (``f_t(S_{t−1}) = 0``, where the ratio is 0/0) are measured:
#: ``"drop"`` — the paper's ``q_t = 1`` in the table and the summary, and left out of Theorem D.7's
#: product, ε_T and R_T (ledger ``thm-d7-zero-residual-drop``); ``"continuous"`` — ``q_t := (1 − a_t)²``,
#: the ratio's continuous extension, and kept in the theorem with the original T (ledger
#: ``thm-d7-zero-residual-continuous``). docs/metrics.md says where each applies.
ZERO_RESIDUAL = ("drop", "continuous")


def continuous_extension(res, *, delta_rule: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where the ratio is 0/0, its continuous extension ``(1 − a_t)²`` (``a_t = β_t⟨k̃_t, k_t⟩``).

    For a delta-rule write whose loss reads the key the residual reads, ``f_t(S_t) = (1 − a_t)² f_t(S̄_{t−1})``
    for every ``u_t ≠ 0`` (any key norm), so ``(1 − a_t)²`` is the limit as ``u_t → 0``. That is the ratio
    against the state the residual was taken from: ``residual_ratio`` of an ungated layer,
    ``residual_ratio_post`` of a gated one. A gated layer's pre-decay ratio has no such extension (its
    limit depends on the direction in which ``S_{t−1} k_t → v_t``) and keeps ``q_t = 1``; so does every
    family whose loss is not the delta rule's (``delta_rule=False``).

    Returns ``(residual_ratio, residual_ratio_post or None)`` ``[B, T, H]``.
    """
    ratio = residual_ratio(res.loss_after, res.loss_before)
    post = None if res.loss_before_decayed is None else residual_ratio(res.loss_after, res.loss_before_decayed)
    if not delta_rule:
        return ratio, post
    cont = (1.0 - res.write_gain).square()
    if post is None:
        return torch.where(res.loss_before == 0, cont, ratio), None
    return ratio, torch.where(res.loss_before_decayed == 0, cont, post)


class FidelityError(RuntimeError):
    """The replayed outputs do not match the kernel's: the capture does not describe the kernel."""


class ReplayOverflowError(ValueError):
    """Finite inputs whose token losses overflow the replay's dtype (a diverging model's values in
    fp32): their ratios cannot be measured in it."""


@dataclass
class CallReplay:
    """Per-token results of one captured call, flattened in (sequence, head, position) order.

    ``columns`` maps column names to 1-D CPU tensors of equal length, ``device_columns`` the same
    columns where the replay ran (for statistics taken on the GPU); ``fidelity`` is the largest
    relative output error over the call's (sequence, head) pairs; ``nonfinite`` counts the
    (sequence, head) pairs whose inputs held NaN/Inf, and ``nonfinite_streams`` lists them as
    ``(sequence, head)``; ``grid`` keeps ``loss_before``, ``loss_after`` and the ``finite`` mask (False
    on every token of a flagged stream) in the call's own ``[B, T, H]`` layout.
    ``state_fidelity`` is the largest relative final-state error over the finite (sequence, head)
    pairs against the kernel's own final state (``None`` when the record has none), and
    ``state_rounding_units`` the same error in units of the unit roundoff of the kernel's working
    precision (:func:`working_precision`): a few units or less is what rounding explains.
    ``kernel`` names what replayed the call: ``"chunk"`` or ``"fused"`` (the Triton replays),
    ``"torch"`` (the reference recurrence) or ``"family"`` (a family's own replay). ``segments`` are
    the call's ``(row, start, end)`` (:meth:`KernelCall.segments`), for the statistics that need them.
    """

    columns: dict[str, torch.Tensor]
    fidelity: float
    nonfinite: int
    sequence_lengths: list[int] = field(default_factory=list)
    tolerance: float = 0.0
    grid: dict[str, torch.Tensor] = field(default_factory=dict)
    device_columns: dict[str, torch.Tensor] = field(default_factory=dict)
    state_fidelity: float | None = None
    state_tolerance: float = 0.0
    state_rounding_units: float | None = None
    nonfinite_streams: list[tuple[int, int]] = field(default_factory=list)
    kernel: str = "torch"
    segments: list[tuple[int, int, int]] = field(default_factory=list)


def _finite_mask(call: KernelCall) -> torch.Tensor:
    """``[B, T, H]``: True where every captured input of that token and head is finite.

    ``x · 0`` is 0 for a finite ``x`` and NaN for ±Inf and NaN, and a sum holding a NaN is NaN: a token
    is finite where the sum of ``x · 0`` over its inputs is 0. Three operations per input, where
    ``isfinite(x).all(-1)`` (``isfinite`` itself is four) takes six on every call."""
    # A family's per-sequence extras (its further states, named initial_* / final_*) are not per token.
    per_token = [x for n, x in call.extra.items() if not n.startswith(("initial_", "final_"))]
    poisoned = call.beta * 0
    for x in (call.q, call.k, call.v, call.g, call.d, call.write_key, *per_token):
        if x is not None:
            zero = x * 0
            poisoned = poisoned + (zero.sum(-1) if x.dim() == 4 else zero)
    return poisoned == 0


def zero_nonfinite(x: torch.Tensor | None, bad: torch.Tensor) -> torch.Tensor | None:
    """``x`` (``[B, T, H]`` or ``[B, T, H, ·]``) with the tokens marked ``bad`` (``[B, T, H]``) set to 0."""
    if x is None:
        return None
    mask = bad if x.dim() == 3 else bad[..., None]
    return torch.where(mask, torch.zeros((), dtype=x.dtype, device=x.device), x)


def recurrence_inputs(call: KernelCall, dtype: torch.dtype, bad: torch.Tensor | None) -> dict:
    """The call as arguments of the recurrence (both backends take the same ones); tokens marked
    ``bad`` (``[B, T, H]``, non-finite inputs) are replayed on zeros."""
    q, k, v, beta, g, d, wk = call.q, call.k, call.v, call.beta, call.g, call.d, call.write_key
    init = call.initial_state
    if bad is not None:
        q, k, v, beta, g, d, wk = (zero_nonfinite(x, bad) for x in (q, k, v, beta, g, d, wk))
        if init is not None:
            init = torch.nan_to_num(init, nan=0.0, posinf=0.0, neginf=0.0)
    if wk is None and d is not None:
        wk = d.to(dtype) * k.to(dtype)
    return dict(
        q=q, k=k, v=v, beta=beta,
        write_key=wk,
        g=g,
        scale=call.scale,
        initial_state=init,
        cu_seqlens=call.cu_seqlens,
        dtype=dtype,
    )


#: The host dtype of a replay's values (fp32 or fp64), for reading them from the one transfer.
_NUMPY = {torch.float32: np.float32, torch.float64: np.float64}


#: Replay engines: the reference recurrence in torch (any device); the Triton replays, chunked where
#: :func:`chunk_applies` and token by token elsewhere; the token-by-token Triton replay only.
BACKENDS = ("torch", "triton", "fused")


def chunk_applies(args: dict) -> bool:
    """Whether the pipeline replays these recurrence inputs with the chunked replay
    (:func:`osdn_diag.ops.chunk_replay`): fp32, keys of at most
    :data:`~osdn_diag.ops.replay_chunk.MAX_KEY_DIM` channels, and no gate.

    The op itself also takes a per-head gate, but there its ratios miss the fp32 bound against an fp64
    oracle on real captures (ratio p99 1.3e-5 on a PrecondGatedDeltaNet layer on an H100, where the
    fused replay meets 1e-5: benchmarks/CHANGELOG.md, series 24), so gated calls take the fused replay."""
    from ..ops.replay_chunk import MAX_KEY_DIM

    return (args["dtype"] == torch.float32 and 0 < args["k"].shape[-1] <= MAX_KEY_DIM
            and args["v"].shape[-1] > 0 and args.get("g") is None)


def triton_replay(args: dict, *, chunked: bool = True):
    """One call's recurrence by a Triton replay: the chunked one where it applies (tensor cores: on an
    H200, 1.5–1.7× the fused replay's speed at K = 64 and 128, ungated, ``benchmarks/RESULTS.md``), the
    token-by-token one elsewhere (fp64, wider keys, any gate). Both meet the same contract and the same
    fidelity check. The result's ``kernel`` attribute names the one that ran."""
    if chunked and chunk_applies(args):
        from ..ops.replay_chunk import chunk_replay

        res = chunk_replay(**{name: value for name, value in args.items() if name != "dtype"})
        res.kernel = "chunk"
        return res
    from ..ops.replay import fused_replay

    res = fused_replay(**args)
    res.kernel = "fused"
    return res


def _table_index(segments, H: int, device) -> tuple[torch.Tensor, ...]:
    """The per-token table's row order — sequence by sequence, head by head, position by position —
    as index tensors ``[N]`` on ``device``: ``(sequence, head, pos, batch row, token)``
    (:func:`_table_layout`'s first five)."""
    return _table_layout(segments, H, device)[:5]


def _table_layout(segments, H: int, device) -> tuple[torch.Tensor, ...]:
    """:func:`_table_index`'s five index tensors; sixth, ``[S·H]``: the rows of each (sequence, head)
    stream, in the table's order; seventh, ``[N]``: each row's stream ``sequence · H + head``; eighth,
    ``[3, N]`` int32: sequence, head and pos stacked, as the table's integer columns travel to the host.

    Every layer of a forward batch has the same segments: the layout is built once and kept (an LRU of
    eight), which saves some twenty small device operations per replayed call. The tensors returned
    are shared between calls and must not be modified in place."""
    return _cached_table_index(tuple(tuple(int(x) for x in s) for s in segments), int(H), torch.device(device))


@functools.lru_cache(maxsize=8)
def _cached_table_index(segments: tuple, H: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    S = len(segments)
    if S == 0:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return (empty,) * 7 + (torch.zeros(3, 0, dtype=torch.int32, device=device),)
    rows, starts, lengths = from_host(list(zip(*segments)), torch.long, device)
    lengths = lengths - starts
    block = lengths * H
    # With its size given, repeat_interleave does not read the repeats back from the device.
    total = sum(e - s for _, s, e in segments) * H
    seq = torch.repeat_interleave(torch.arange(S, device=device), block, output_size=total)
    j = torch.arange(seq.numel(), device=device) - (torch.cumsum(block, 0) - block)[seq]
    L = lengths[seq]
    head, pos = j // L, j % L
    stream_lengths = lengths[:, None].expand(S, H).reshape(-1)
    ints = torch.stack([seq, head, pos]).to(torch.int32)
    return seq, head, pos, rows[seq], starts[seq] + pos, stream_lengths, seq * H + head, ints


def _refuse_overflow(call: KernelCall, columns: dict, overflow: np.ndarray, dtype: torch.dtype, where: str) -> None:
    """Raise :class:`ReplayOverflowError` naming the first row (``overflow``: the rows' flags) whose
    token loss overflowed."""
    count, i = int(overflow.sum()), int(np.flatnonzero(overflow)[0])
    seq, head, pos = (int(columns[name][i]) for name in ("sequence", "head", "pos"))
    vmax = float(call.v.abs().amax())
    way = ("replay in fp64 (--fp64; dtype=torch.float64 in Python)" if dtype == torch.float32 else
           "the model's values are beyond what any replay can measure: look for where training diverged")
    raise ReplayOverflowError(
        f"{where}: the token losses ½‖S k − v‖² of {count:,} token-heads overflow {str(dtype).removeprefix('torch.')} "
        f"(the first at sequence {seq}, head {head}, position {pos}; the largest |v| is {vmax:.3g}), "
        f"though every input is finite, so their residual ratios cannot be measured; {way}")


def replay_call(
    call: KernelCall,
    *,
    backend: str = "torch",
    dtype: torch.dtype = torch.float32,
    tolerance: float | None = None,
    state_tolerance: float | None = None,
    zero_residual: str = "drop",
) -> CallReplay:
    """Replay one captured call on the device its tensors are on.

    Args:
        call: the captured call (canonical form, see :mod:`osdn_diag.capture.record`).
        backend: one of :data:`BACKENDS`: ``"torch"`` (the reference recurrence, any device),
            ``"triton"`` (the chunked Triton replay where :func:`chunk_applies`, the fused one elsewhere)
            or ``"fused"`` (the token-by-token Triton replay only).
        dtype: replay precision, fp32 (default) or fp64.
        tolerance: largest accepted output error; default :func:`default_tolerance`.
            ``math.inf`` disables the check (and the state check, unless ``state_tolerance`` is given).
        state_tolerance: largest accepted final-state error; default :func:`default_state_tolerance`.
        zero_residual: ``"drop"`` or ``"continuous"`` (:data:`ZERO_RESIDUAL`): the ratio at tokens
            with a zero residual, and whether Theorem D.7 keeps them (``grid["theorem_valid"]``).

    Raises:
        FidelityError: the replayed outputs (or final states) differ from the kernel's by more than
            the tolerance; the message names the layer, the kernel and its path.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"argument 'dtype': expected torch.float32 or torch.float64, got {dtype}")
    finite = _finite_mask(call)
    bad = None if bool(finite.all()) else ~finite
    if backend not in BACKENDS:
        raise ValueError(f"argument 'backend': expected one of {BACKENDS}, got {backend!r}")
    if zero_residual not in ZERO_RESIDUAL:
        raise ValueError(f"argument 'zero_residual': expected one of {ZERO_RESIDUAL}, got {zero_residual!r}")
    family_replay = families.replays().get(call.family)
    if family_replay is not None:  # a recurrence other than the delta rule's (replay/families)
        # a family's replay knows "torch" and "triton" (its own Triton replay, where it has one)
        res = family_replay(call, dtype=dtype, bad=bad, backend="torch" if backend == "torch" else "triton")
        kernel = "family"
    elif backend == "torch":
        res = delta_rule_recurrence(**recurrence_inputs(call, dtype, bad))
        kernel = "torch"
    else:
        res = triton_replay(recurrence_inputs(call, dtype, bad), chunked=backend == "triton")
        kernel = res.kernel

    segments = call.segments()  # with cu_seqlens on a GPU this waits for it: read once, passed on
    H = call.num_heads
    k2 = call.k.to(dtype).square().sum(-1)
    continuous = zero_residual == "continuous" and family_replay is None
    ratio, post = continuous_extension(res, delta_rule=continuous)
    per_token = {
        "beta": call.beta.to(dtype),
        "key_sqnorm": k2,
        "write_gain": res.write_gain,
        "loss_before": res.loss_before,
        "loss_after": res.loss_after,
        "residual_ratio": ratio,
    }
    if res.loss_before_decayed is not None:
        per_token["loss_before_decayed"] = res.loss_before_decayed
        per_token["residual_ratio_post"] = post
    per_token.update(res.columns)
    seq, head, pos, row, t, stream_lengths, stream, ints_dev = _table_layout(segments, H, finite.device)
    # A family that makes several writes per token (GatedDeltaProduct) records them as a sequence
    # ``micro_steps`` times longer: its rows keep the token's position in ``pos``.
    micro = int(call.flags.get("micro_steps", 1))
    if micro > 1:
        pos = pos // micro
        ints_dev = torch.stack([seq, head, pos]).to(torch.int32)
    # Fidelity per (sequence, head): ‖o − o_kernel‖ / ‖o_kernel‖ over the stream's tokens.
    kernel_o = call.o.to(dtype)
    sq = torch.stack([(res.o.to(dtype) - kernel_o).square().sum(-1), kernel_o.square().sum(-1),
                      (~finite).to(dtype)], -1)[row, t, head]
    # Rows come stream by stream: one segmented sum per stream, in the same order on every run (a
    # scattered add on a GPU adds with atomics, in another order each time, and the fidelity's last
    # bits would differ between two identical runs).
    o_err, o_norm, n_bad = torch.segment_reduce(sq, "sum", lengths=stream_lengths, axis=0, unsafe=True).unbind(1)
    ok_stream = n_bad == 0  # heads whose inputs are all finite in this sequence
    rel = o_err.sqrt() / o_norm.sqrt().clamp_min(torch.finfo(dtype).tiny)
    worst_t = torch.where(ok_stream, rel, 0.0).amax() if rel.numel() else rel.new_zeros(())
    # Final state per (sequence, head) against the kernel's fp32 one, over the finite streams.
    state_t = None
    if call.final_state is not None and res.final_state is not None and rel.numel():
        kernel_s = call.final_state.to(dtype)
        diff = (res.final_state.to(dtype) - kernel_s).square().sum((-2, -1)).sqrt().reshape(-1)
        norm = kernel_s.square().sum((-2, -1)).sqrt().reshape(-1)
        state_rel = diff / norm.clamp_min(torch.finfo(dtype).tiny)
        state_t = torch.where(ok_stream, state_rel, 0.0).amax()
    # Everything the host needs in one transfer (each would wait for the GPU): the columns and the
    # fidelity numbers as the bits of integers of their width, beside the indices in that width (an
    # integer copy moves bits as they are), split again on the host (with numpy: slicing there costs
    # no torch operations). The columns are stacked first and gathered in table order at once
    # ([columns, B, T, H] → [columns, N]: one gather, not one per column).
    values_dev = torch.stack(list(per_token.values()))[:, row, t, head]  # [columns, N]
    finite_dev = ok_stream[stream]  # [N]: the row's stream has finite inputs throughout
    vtype = values_dev.dtype  # the replay's dtype, fp32 or fp64
    wide = torch.int64 if vtype.itemsize == 8 else torch.int32
    worst_state = torch.stack([worst_t, worst_t if state_t is None else state_t, (~ok_stream).sum().to(dtype)])
    host = torch.cat([values_dev.reshape(-1).view(wide), ints_dev.to(wide).reshape(-1), finite_dev.to(wide),
                      worst_state.to(vtype).view(wide)]).cpu().numpy()
    n_values, n_rows = values_dev.numel(), values_dev.shape[1]
    values = torch.from_numpy(host[:n_values].view(_NUMPY[vtype]).reshape(values_dev.shape))
    ints = host[n_values:n_values + 4 * n_rows].reshape(4, n_rows)
    worst, state_err, nonfinite = host[-3:].view(_NUMPY[vtype]).tolist()
    state_err, nonfinite = (None if state_t is None else state_err), int(nonfinite)

    streams_bad: list[tuple[int, int]] = []
    grid_finite = finite
    if nonfinite:  # rare: only then is the per-stream flag read back and spread over the grid
        grid_finite = torch.ones_like(finite)
        grid_finite[row, t, head] = finite_dev
        streams_bad = [divmod(int(i), H) for i in torch.nonzero(~ok_stream).flatten().cpu()]

    def as_columns(values, sequence, head, pos, finite):
        columns = dict(zip(per_token, values.unbind(0)))
        columns.update(sequence=sequence, head=head, pos=pos, finite=finite)
        return columns

    columns = as_columns(values, *(torch.from_numpy(x) for x in ints[:3].astype(np.int32, copy=False)),
                         torch.from_numpy(ints[3] != 0))
    tol = default_tolerance(call) if tolerance is None else tolerance
    where = (f"layer {call.layer} ({call.layer_name}, kernel {call.kernel}, "
             f"{call.flags.get('path', 'chunk')} path, {call.input_dtype} inputs)")
    # Finite inputs whose token losses the replay's dtype cannot hold (‖v‖ near 1e19 in fp32, as in a
    # diverging model): their ratios would be NaN on rows marked finite. Checked on the host's copy
    # (numpy: no torch operation on the GPU's path).
    names = list(per_token)
    losses = values.numpy()[names.index("loss_before"):names.index("loss_after") + 1]
    if not np.isfinite(losses).all():
        overflow = ~np.isfinite(losses).all(0) & (ints[3] != 0)
        if overflow.any():
            _refuse_overflow(call, columns, overflow, dtype, where)
    if not math.isfinite(worst) or worst > tol:
        hint = families.hints().get(call.family)  # a family's known kernel limit, and what to do
        hint = None if hint is None else hint(call)
        # In units of the working precision's rounding, as the state check reports (a kernel's own
        # rounding is a few units; a record that misdescribes the kernel is usually far more).
        units = worst / unit_roundoff(working_precision(call))
        raise FidelityError(
            f"{where}: replayed outputs differ from the kernel's by {worst:.3g} (relative; {units:.3g} units "
            f"of {working_precision(call)} rounding), above the tolerance {tol:.1g} — "
            + (hint or "the capture adapter does not describe this kernel (if the error is the kernel's own "
                       "rounding, --tolerance accepts it)")
        )
    if state_tolerance is None:
        state_tol = math.inf if tolerance is not None and math.isinf(tolerance) else default_state_tolerance(call)
    else:
        state_tol = state_tolerance
    precision = working_precision(call)
    units = None
    if state_err is not None:
        units = state_err / unit_roundoff(precision)
        if not math.isfinite(state_err) or state_err > state_tol:
            hint = families.hints().get(call.family)
            hint = None if hint is None else hint(call)
            raise FidelityError(
                f"{where}: the replayed final state differs from the kernel's fp32 final state by "
                f"{state_err:.3g} (relative; {units:.3g} units of {precision} rounding), above the "
                f"tolerance {state_tol:.1g} — " + (hint or "the record is not what the kernel read")
            )
    return CallReplay(
        columns=columns,
        fidelity=worst,
        nonfinite=nonfinite,
        sequence_lengths=[(e - s) // micro for _, s, e in segments],  # in tokens
        tolerance=tol,
        grid={
            "loss_before": res.loss_before, "loss_after": res.loss_after, "finite": grid_finite,
            # Theorem D.7's ratios and tokens: a zero-residual token is kept where its ratio was
            # extended continuously (an ungated delta-rule layer under "continuous"), else left out.
            "residual_ratio": ratio,
            "theorem_valid": grid_finite if continuous and post is None else grid_finite & (res.loss_before > 0),
        },
        device_columns=as_columns(values_dev, *ints_dev.unbind(0), finite_dev),
        state_fidelity=state_err,
        state_tolerance=state_tol,
        state_rounding_units=units,
        nonfinite_streams=streams_bad,
        kernel=kernel,
        segments=segments,
    )

