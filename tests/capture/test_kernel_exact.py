"""The capture record is what fla's recurrence consumed, bit for bit, and its replay is the recurrence.

Ground truth here never comes from the package: ``_consumed.spy_consumed`` watches fla's own
functions while a layer runs under ``capture`` and keeps what the recurrence read (the stored
``l2norm_fwd`` / ``fused_beta_sigmoid`` / ``chunk_atk_fwd`` outputs, and the raw kernel arguments), and
``_consumed.fp64_delta_rule`` replays it in fp64 with the tests' own arithmetic. For every family fla
0.6.0's layers call (DeltaNet, Gated DeltaNet, KDA, PrecondGatedDeltaNet, PrecondKDA) and both paths:

* bf16: the record's q, k (and the preconditioned chunk paths' write key, the GDN/KDA chunk paths'
  β, the final state) equal what the kernel consumed bitwise, and ``flags["qk_read_as"]`` names the dtype
  the recurrence read q and k in (bf16 where fla stores the normalised tensors, fp32 where the fused
  recurrent kernels normalise in registers). A record rebuilt in fp32 (as before the capture stored
  what the kernel consumed) fails this on every stored path.
* fp32: the fp64 oracle reproduces the kernel's outputs and final state (so it is the recurrence
  the kernel ran), and the package's replay agrees with it per token (residual ratios within 1e-5
  at p99, relative to max(ratio, 1e-3): ``_consumed.compare_ratios`` says why the floor).
* hooked and unhooked layers give bitwise equal outputs (bf16 without a cache, where capture must
  hide the final state it asked for; fp32 with fla's cache, where the caller's own request for the
  final state must still be served, bitwise).
* the final-state check sees a key misread far below what the bf16 output check can.

Under Triton's interpreter on a CPU; tiny layers (hidden 64, 2 heads of 32). The bf16 chunk kernels'
outputs are wrong under the interpreter (its bf16 ``tl.dot``), so bf16 chunk records are compared,
never replayed. Each layer is run once per (family, path, dtype) with and once without capture, and
the tests share those runs.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from _consumed import (
    assert_record_is_consumed,
    compare_ratios,
    kernel_final_state,
    oracle,
    per_head_state_error,
    relative_error,
    spy_consumed,
)
from osdn_diag.capture.context import capture
from osdn_diag.replay import FidelityError, replay_call

pytestmark = pytest.mark.usefixtures("fla_interpreter")

HIDDEN = 64
FAMILIES = ("delta_net", "gated_deltanet", "kda", "precond_gated_deltanet", "precond_kda")
# Lengths and batch sizes that select each path without grad: every layer takes the fused recurrent
# kernel at T ≤ 64 in eval mode and its chunk kernel above 64 (docs/fla-0.6.0-callsites.md). One
# sequence each: the interpreter's cost grows with the number of (sequence, head) programs.
SHAPES = {"fused_recurrent": (1, 32), "chunk": (1, 70)}
PATHS = tuple(SHAPES)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _layer(family: str) -> torch.nn.Module:
    from fla.layers import DeltaNet, GatedDeltaNet, KimiDeltaAttention, PrecondGatedDeltaNet, PrecondKDA

    common = dict(hidden_size=HIDDEN, num_heads=2, layer_idx=0)
    return {
        "delta_net": lambda: DeltaNet(**common),
        "gated_deltanet": lambda: GatedDeltaNet(head_dim=32, expand_v=1, **common),
        "kda": lambda: KimiDeltaAttention(head_dim=32, **common),
        "precond_gated_deltanet": lambda: PrecondGatedDeltaNet(head_dim=32, expand_v=1, **common),
        "precond_kda": lambda: PrecondKDA(head_dim=32, **common),
    }[family]()


def _cache_tensors(cache) -> list[torch.Tensor]:
    """Every tensor fla's cache holds for layer 0, in a fixed order."""
    out = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for key in sorted(x):
                walk(x[key])
        elif isinstance(x, (list, tuple)):
            for item in x:
                walk(item)

    walk(cache[0])
    return out


def _recurrent_state(cache) -> torch.Tensor:
    """The delta-rule state in fla's cache for layer 0 (the precond layers keep ``(S, A)``)."""
    state = cache[0]["recurrent_state"]
    return state[0] if isinstance(state, tuple) else state


@dataclasses.dataclass
class LayerRun:
    """One layer on one input, without and with capture (spied)."""

    y_plain: torch.Tensor
    y_hooked: torch.Tensor
    cache_plain: list | None
    cache_hooked: list | None
    state_hooked: torch.Tensor | None  # the delta-rule state in the hooked run's cache
    run: object   # the _consumed.KernelRun of the single kernel call
    call: object  # the KernelCall capture recorded for it


def _make_run(family: str, path: str, dtype: torch.dtype) -> LayerRun:
    from fla.models.utils import Cache

    torch.manual_seed(FAMILIES.index(family))
    layer = _layer(family).eval().to(dtype)
    B, T = SHAPES[path]
    x = torch.randn(B, T, HIDDEN).to(dtype)
    # fp32 runs ask for the final state through fla's cache (capture must still hand it over, bit
    # for bit); bf16 runs do not (capture asks the kernel for it and must hide it again).
    use_cache = dtype == torch.float32
    with torch.no_grad():
        cache_plain = Cache() if use_cache else None
        y_plain = layer(x, past_key_values=cache_plain, use_cache=use_cache)[0]
        cache_hooked = Cache() if use_cache else None
        # The spies go in first, so that capture wraps them and they see what the kernel receives.
        with spy_consumed() as runs, capture(layer, kernels="fla") as cap:
            y_hooked = layer(x, past_key_values=cache_hooked, use_cache=use_cache)[0]
    assert len(runs) == 1 and len(cap.calls) == 1, (len(runs), len(cap.calls))
    run, call = runs[0], cap.calls[0]
    assert run.path == path and call.kernel == run.kernel, (path, run.kernel, call.kernel)
    return LayerRun(
        y_plain=y_plain, y_hooked=y_hooked,
        cache_plain=_cache_tensors(cache_plain) if use_cache else None,
        cache_hooked=_cache_tensors(cache_hooked) if use_cache else None,
        state_hooked=_recurrent_state(cache_hooked) if use_cache else None,
        run=run, call=call,
    )


@pytest.fixture(scope="module")
def layer_run():
    """``layer_run(family, path, dtype)``: the shared :class:`LayerRun`, made on first use."""
    memo: dict = {}

    def get(family: str, path: str, dtype: torch.dtype) -> LayerRun:
        key = (family, path, dtype)
        if key not in memo:
            memo[key] = _make_run(family, path, dtype)
        return memo[key]

    return get


# -- (a) the record is what the recurrence consumed -------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_record_is_what_the_recurrence_consumed(family, path, layer_run):
    """q, k (write key, β, final state) in the record are the tensors the bf16 kernel read, bitwise."""
    r = layer_run(family, path, torch.bfloat16)
    assert r.call.input_dtype == "bfloat16"
    assert_record_is_consumed(r.run, r.call)


# -- (b) the fp64 oracle ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_replay_matches_fp64_oracle_of_consumed_tensors(family, path, layer_run, request):
    """The package's replay of the record agrees per token with an fp64 replay of what the kernel
    consumed (gates and β rebuilt from the raw arguments, d from the accumulator where the kernel
    keeps it in registers)."""
    if family == "delta_net" and path == "chunk":
        request.getfixturevalue("fp32_chunk_delta_rule")  # fla's public chunk_delta_rule refuses fp32
    r = layer_run(family, path, torch.float32)
    run, call = r.run, r.call
    ref = oracle(run)

    # The oracle is the recurrence the kernel ran: it reproduces the kernel's outputs and final state.
    assert relative_error(ref["o"], run.out[0]) <= 1e-5
    assert per_head_state_error(ref["final_state"], kernel_final_state(run)) <= 1e-4

    res = replay_call(call)
    cmp = compare_ratios(res.columns, ref)
    assert cmp["n"] >= 0.9 * ref["ratio"].numel(), cmp
    assert cmp["p99"] <= 1e-5, cmp
    assert abs(cmp["q_geo"] - cmp["q_geo_ref"]) <= 1e-6 * cmp["q_geo_ref"], cmp


# -- (c) transparency -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_capture_is_transparent(family, path, dtype, layer_run, request):
    """The layer's output (and, when it asks, its cache) are bitwise what they are without capture."""
    if family == "delta_net" and path == "chunk" and dtype == "fp32":
        request.getfixturevalue("fp32_chunk_delta_rule")
    r = layer_run(family, path, DTYPES[dtype])
    assert torch.equal(r.y_hooked, r.y_plain), "capture changed the layer's output"
    if r.cache_plain is None:
        return  # the layer did not ask for the final state (capture did: see the record test)
    # The layer asked (use_cache): its cache holds the kernel's final state, as without capture.
    assert len(r.cache_hooked) == len(r.cache_plain) >= 2
    for got, want in zip(r.cache_hooked, r.cache_plain):
        assert torch.equal(got, want), "capture changed what the layer's cache holds"
    assert torch.equal(r.state_hooked, r.run.out[1])


# -- (d) the state check ------------------------------------------------------------------------------


def test_state_check_catches_a_key_misread_the_output_check_cannot(layer_run):
    """bf16 Gated DeltaNet, fused recurrent (fp32 registers): a 1e-3 relative error in the keys moves
    the final state far beyond its 1e-4 tolerance, while the bf16 output check (1e-2) passes it."""
    call = layer_run("gated_deltanet", "fused_recurrent", torch.bfloat16).call
    res = replay_call(call)
    assert res.state_fidelity is not None and res.state_fidelity <= 1e-4

    K = call.k.shape[-1]
    sign = torch.where(torch.arange(K) % 2 == 0, 1.0, -1.0)  # alternating over the key channels
    misread = dataclasses.replace(call, k=call.k * (1 + 1e-3 * sign))
    with pytest.raises(FidelityError, match="final state"):
        replay_call(misread)
    loose = replay_call(misread, state_tolerance=math.inf)
    assert loose.fidelity <= 1e-2
    assert loose.state_fidelity > 1e-4
