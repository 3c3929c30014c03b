"""fla 0.6.0's Triton kernels, run on the CPU under Triton's interpreter, against our fp64 references.

Every kernel family that capture will intercept is called here the way fla's own layers call it (and
in its plain form), in fp32 at tiny shapes, and compared with :mod:`osdn_diag.math.recurrence` in fp64:
``‖out − ref‖ / ‖ref‖ ≤ 1e-5`` for the outputs and the final states, NaN never passing. The shapes keep
``K ≠ V`` (so a transposed state cannot pass) and ``T`` off the 64-token chunk grid.

What fla does inside a kernel call, which the references below redo in fp64 (capture's adapters need the
same list):

* ``use_qk_l2norm_in_kernel``: ``x / sqrt(Σx² + 1e-6)`` on q and k (eps inside the sqrt);
* ``scale=None``: ``K ** -0.5`` on q;
* GDN, ``use_gate_in_kernel``: ``g = −exp(A_log) · softplus(a + dt_bias)`` from the raw gate ``a``;
* KDA, ``use_gate_in_kernel``: the same per key channel with ``dt_bias`` of shape ``[HV·K]``, or, when
  ``lower_bound`` is given, ``g = lower_bound · sigmoid(exp(A_log) · (a + dt_bias))``;
* ``use_beta_sigmoid_in_kernel``: ``β = sigmoid(b)``, times 2 with ``allow_neg_eigval``;
* states are ``K×V`` (``[N, H, K, V]``) unless ``state_v_first=True`` (GDN/KDA) or
  ``transpose_state_layout=True`` (precond ops), which give our ``V×K``;
* precond ops: the ATK preconditioner ``A_t = exp(g_atk) A_{t−1} + β_atk k̂⊙k̂`` (updated *before* the
  write), write key ``k̂ ⊙ x^{−s}``, ``s = r / (1 + |r|)``, ``r = log(A_t + eps) − log_atk_scale``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from osdn_diag.math import delta_rule_recurrence, deltanet, gated_deltanet, kda

pytestmark = pytest.mark.usefixtures("fla_interpreter")

RTOL = 1e-5
B, H, K, V = 1, 2, 16, 32
T = 70  # not a multiple of fla's 64-token chunk
T_VARLEN, CU_SEQLENS = 100, [0, 30, 100]  # the second segment crosses a chunk boundary


# --- helpers -------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


def _rand(gen, *shape, low=0.0, high=1.0):
    return low + (high - low) * torch.rand(*shape, generator=gen)


def _assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{name}: non-finite values in fla's output"
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= rtol, f"{name}: relative error {err:.3e} > {rtol:.0e}"


def _fla_l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's ``use_qk_l2norm_in_kernel`` (``l2norm_fwd`` and the fused-recurrent kernels alike)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _kv(state: torch.Tensor | None) -> torch.Tensor | None:
    """Our ``[N, H, V, K]`` state <-> fla's default ``[N, H, K, V]``."""
    return None if state is None else state.transpose(-1, -2).contiguous()


def _segments(case: str):
    """(T, cu_seqlens, number of sequences) for a test case."""
    if case == "varlen":
        return T_VARLEN, torch.tensor(CU_SEQLENS, dtype=torch.long), len(CU_SEQLENS) - 1
    return T, None, B


def _atk_write_key(k_hat, g_atk, beta_atk, *, x=1.5, eps=1e-6, center=-0.2, A0=None, cu_seqlens=None):
    """fla's ATK preconditioner (``naive_recurrent_precond_*``), fp64: the write key ``k̂ ⊙ M_t`` for every
    token and the final diagonal state ``[N, H, K]``. ``g_atk`` is ``[B, T, H]`` or ``[B, T, H, K]``."""
    Bn, Tn, Hn, Kn = k_hat.shape
    bounds = [0, Tn] if cu_seqlens is None else cu_seqlens.tolist()
    if isinstance(center, torch.Tensor):  # per-head log_atk_scale [H]
        center = center.to(k_hat.dtype)[:, None]
    log_x = math.log(x)
    wk = torch.empty_like(k_hat)
    finals = []
    n_seq = Bn if cu_seqlens is None else len(bounds) - 1
    for n in range(n_seq):
        b, lo, hi = (n, 0, Tn) if cu_seqlens is None else (0, bounds[n], bounds[n + 1])
        A = k_hat.new_zeros(Hn, Kn) if A0 is None else A0[n].to(k_hat.dtype).clone()
        for t in range(lo, hi):
            decay = g_atk[b, t].exp()
            decay = decay[:, None] if decay.dim() == 1 else decay  # scalar (GDN) or channel (KDA) gate
            A = decay * A + beta_atk[b, t, :, None] * k_hat[b, t] ** 2
            r = torch.log(A + eps) - center
            s = r / (1.0 + r.abs())
            wk[b, t] = k_hat[b, t] * torch.exp(-log_x * s)
        finals.append(A)
    return wk, torch.stack(finals)


# --- DeltaNet -------------------------------------------------------------------------------------


def _deltanet_inputs(seed, case):
    gen = _gen(seed)
    Tn, cu, N = _segments(case)
    q, k = _randn(gen, B, Tn, H, K), _randn(gen, B, Tn, H, K)
    v = _randn(gen, B, Tn, H, V)
    beta = _rand(gen, B, Tn, H)
    h0 = _randn(gen, N, H, V, K, scale=0.5) if case in ("state", "varlen") else None
    return q, k, v, beta, h0, cu


def _deltanet_reference(q, k, v, beta, h0, cu, l2norm):
    if l2norm:
        q, k = _fla_l2norm(q.double()), _fla_l2norm(k.double())
    return deltanet(q.double(), k.double(), v.double(), beta.double(), initial_state=h0, cu_seqlens=cu,
                    dtype=torch.float64)


@pytest.mark.parametrize("case", ["plain", "state", "varlen"])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "no_l2norm"])
@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
def test_delta_rule(kernel, l2norm, case):
    from fla.ops.delta_rule import fused_recurrent_delta_rule
    from fla.ops.delta_rule.chunk import ChunkDeltaRuleFunction

    q, k, v, beta, h0, cu = _deltanet_inputs(seed=11, case=case)
    if not l2norm:
        k = F.normalize(k, dim=-1)  # without the in-kernel norm, delta rules expect unit keys
    h0_fla = _kv(h0)
    if kernel == "chunk":
        # The public chunk_delta_rule asserts bf16 inputs (fp32 uses tf32 dots on a GPU); its autograd
        # Function is the same computation minus that check. Positional: q, k, v, beta, scale,
        # initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu,
        # chunk_size.
        o, ht = ChunkDeltaRuleFunction.apply(q, k, v, beta, K**-0.5, h0_fla, True, l2norm, cu, None, 64)
    else:
        o, ht = fused_recurrent_delta_rule(
            q=q, k=k, v=v, beta=beta, initial_state=h0_fla, output_final_state=True,
            use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu,
        )
    ref = _deltanet_reference(q, k, v, beta, h0, cu, l2norm)
    _assert_close("o", o, ref.o)
    _assert_close("final_state", _kv(ht), ref.final_state)


# --- Gated DeltaNet -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["state", "varlen"])
@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
def test_gated_delta_rule_log_gate(kernel, case):
    """The plain form: ``g`` is the log decay, β post-sigmoid, q/k used as given, K×V state."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    gen = _gen(21)
    Tn, cu, N = _segments(case)
    q, k = _randn(gen, B, Tn, H, K), F.normalize(_randn(gen, B, Tn, H, K), dim=-1)
    v, beta = _randn(gen, B, Tn, H, V), _rand(gen, B, Tn, H)
    g = F.logsigmoid(_randn(gen, B, Tn, H) + 2.0)
    h0 = _randn(gen, N, H, V, K, scale=0.5)
    fn = chunk_gated_delta_rule if kernel == "chunk" else fused_recurrent_gated_delta_rule
    o, ht = fn(q=q, k=k, v=v, g=g, beta=beta, initial_state=_kv(h0), output_final_state=True,
               cu_seqlens=cu)
    ref = gated_deltanet(q.double(), k.double(), v.double(), beta.double(), g.double(),
                         initial_state=h0, cu_seqlens=cu)
    _assert_close("o", o, ref.o)
    _assert_close("final_state", _kv(ht), ref.final_state)


# The chunk kernel exponentiates cumulative-gate differences for the masked (future) half of each
# chunk too and then discards them; with strong decays numpy reports the overflow there. Harmless
# (the outputs are checked finite), as on a GPU.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")
@pytest.mark.parametrize("allow_neg_eigval", [False, True], ids=["beta01", "beta02"])
@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
def test_gated_delta_rule_layer_call(kernel, allow_neg_eigval):
    """Exactly how ``fla.layers.GatedDeltaNet`` calls the kernels: raw gate and β logits, activations,
    l2norm and the V×K state inside the kernel; with grouped value heads (HV = 2 H)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    gen = _gen(31)
    Hq, HV = 1, 2
    q, k = _randn(gen, B, T, Hq, K), _randn(gen, B, T, Hq, K)
    v = _randn(gen, B, T, HV, V)
    a, b = _randn(gen, B, T, HV), _randn(gen, B, T, HV)
    A_log = torch.log(_rand(gen, HV, low=0.5, high=2.0))
    dt_bias = _randn(gen, HV, scale=0.5)
    h0 = _randn(gen, B, HV, V, K, scale=0.5)
    fn = chunk_gated_delta_rule if kernel == "chunk" else fused_recurrent_gated_delta_rule
    o, ht = fn(
        q=q, k=k, v=v, g=a, beta=b, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=allow_neg_eigval,
        state_v_first=True, cu_seqlens=None, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
    )
    g = -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    beta = torch.sigmoid(b.double()) * (2.0 if allow_neg_eigval else 1.0)
    rep = HV // Hq  # value head i reads key head i // rep
    qh, kh = (_fla_l2norm(x.double()).repeat_interleave(rep, dim=2) for x in (q, k))
    ref = gated_deltanet(qh, kh, v.double(), beta, g, initial_state=h0.double())
    _assert_close("o", o, ref.o)
    _assert_close("final_state", ht, ref.final_state)  # state_v_first: already V×K


# --- KDA ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["state", "varlen"])
@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
def test_kda_log_gate(kernel, case):
    """The plain form: channel log decay ``g: [B, T, H, K]``, β post-sigmoid, K×V state."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    gen = _gen(41)
    Tn, cu, N = _segments(case)
    q, k = _randn(gen, B, Tn, H, K), F.normalize(_randn(gen, B, Tn, H, K), dim=-1)
    v, beta = _randn(gen, B, Tn, H, V), _rand(gen, B, Tn, H)
    g = F.logsigmoid(_randn(gen, B, Tn, H, K) + 2.0)
    h0 = _randn(gen, N, H, K, V, scale=0.5)  # KDA's native K×V
    fn = chunk_kda if kernel == "chunk" else fused_recurrent_kda
    o, ht = fn(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    ref = kda(q.double(), k.double(), v.double(), beta.double(), g.double(), initial_state=h0.double(),
              cu_seqlens=cu)
    _assert_close("o", o, ref.o)
    _assert_close("final_state", ht, ref.final_state)


@pytest.mark.parametrize("gate", ["softplus", "lower_bound"])
@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
def test_kda_layer_call(kernel, gate):
    """How ``fla.layers.KimiDeltaAttention`` calls the kernels: raw gate and β logits, in-kernel gate
    (softplus form, or the ``lower_bound`` form with ``safe_gate`` as the layer passes it), l2norm and
    the V×K state. ``safe_gate`` takes the chunk kernel through ``tl.gather``, aliased at module level
    by fla (fix (c) of ``osdn_diag.runtime.interpret``)."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    gen = _gen(51)
    q, k = _randn(gen, B, T, H, K), _randn(gen, B, T, H, K)
    v = _randn(gen, B, T, H, V)
    a, b = _randn(gen, B, T, H, K), _randn(gen, B, T, H)
    dt_bias = _randn(gen, H * K, scale=0.5)
    h0 = _randn(gen, B, H, V, K, scale=0.5)
    lower_bound = -5.0 if gate == "lower_bound" else None
    A_log = torch.zeros(H) if gate == "lower_bound" else torch.log(_rand(gen, H, low=0.5, high=2.0))
    kw = dict(
        q=q, k=k, v=v, g=a, beta=b, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=False, lower_bound=lower_bound, state_v_first=True, cu_seqlens=None,
    )
    if kernel == "chunk":
        o, ht = chunk_kda(safe_gate=gate == "lower_bound", **kw)
    else:
        o, ht = fused_recurrent_kda(**kw)
    x = a.double() + dt_bias.double().view(H, K)
    A = A_log.double().exp()[:, None]
    g = lower_bound * torch.sigmoid(A * x) if lower_bound is not None else -A * F.softplus(x)
    ref = delta_rule_recurrence(  # V×K convention directly: the channel gate acts on the key side
        _fla_l2norm(q.double()), _fla_l2norm(k.double()), v.double(), torch.sigmoid(b.double()),
        g=g, initial_state=h0.double(),
    )
    _assert_close("o", o, ref.o)
    _assert_close("final_state", ht, ref.final_state)


# --- preconditioned delta rules (fla's ATK preconditioner) ------------------------------------------


@pytest.mark.parametrize("case", ["state", "varlen"])
@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
def test_precond_gated_delta_rule(kernel, case):
    """``(o, final_state [N,HV,K,V], final_A_state [N,H,K]) = *_precond_gated_delta_rule(q, k, v, g_atk,
    g, beta_atk, beta, ...)``: an asymmetric gated delta rule whose write key is the l2-normalised key
    times fla's ATK preconditioner, read key unchanged."""
    from fla.ops.precond_gated_delta_rule import (
        chunk_precond_gated_delta_rule,
        fused_recurrent_precond_gated_delta_rule,
    )

    gen = _gen(61)
    Tn, cu, N = _segments(case)
    q, k, v = _randn(gen, B, Tn, H, K), _randn(gen, B, Tn, H, K), _randn(gen, B, Tn, H, V)
    g, g_atk = F.logsigmoid(_randn(gen, B, Tn, H) + 2.0), F.logsigmoid(_randn(gen, B, Tn, H) + 1.0)
    beta, beta_atk = _rand(gen, B, Tn, H), _rand(gen, B, Tn, H)
    log_atk_scale = torch.tensor([-0.2, 0.3])
    h0, A0 = _randn(gen, N, H, V, K, scale=0.5), _rand(gen, N, H, K, high=0.5)
    kw = dict(
        q=q, k=k, v=v, g_atk=g_atk, g=g, beta_atk=beta_atk, beta=beta, initial_state=_kv(h0),
        initial_A_state=A0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
        x=1.5, eps=1e-6, log_atk_scale=log_atk_scale,
    )
    fn = chunk_precond_gated_delta_rule if kernel == "chunk" else fused_recurrent_precond_gated_delta_rule
    o, ht, at = fn(**kw)
    qh, kh = _fla_l2norm(q.double()), _fla_l2norm(k.double())
    wk, A_final = _atk_write_key(kh, g_atk.double(), beta_atk.double(), center=log_atk_scale.double(),
                                 A0=A0, cu_seqlens=cu)
    ref = delta_rule_recurrence(qh, kh, v.double(), beta.double(), write_key=wk, g=g.double(),
                                initial_state=h0.double(), cu_seqlens=cu)
    _assert_close("o", o, ref.o)
    _assert_close("final_state", _kv(ht), ref.final_state)
    _assert_close("final_A_state", at, A_final)


@pytest.mark.parametrize("kernel", ["chunk", "fused_recurrent"])
def test_precond_kda(kernel):
    """``(o, final_state, final_A_state) = *_precond_kda(q, k, v, g, g_atk, beta_atk, beta, ...)`` with a
    channel log decay ``g`` (``fla.layers.PrecondKDA`` computes it with ``fused_kda_gate`` first); the
    chunk form always l2-normalises q and k."""
    from fla.ops.precond_kda import chunk_precond_kda, fused_recurrent_precond_kda

    gen = _gen(71)
    q, k, v = _randn(gen, B, T, H, K), _randn(gen, B, T, H, K), _randn(gen, B, T, H, V)
    g = F.logsigmoid(_randn(gen, B, T, H, K) + 2.0)
    g_atk = F.logsigmoid(_randn(gen, B, T, H) + 1.0)
    beta, beta_atk = _rand(gen, B, T, H), _rand(gen, B, T, H)
    h0, A0 = _randn(gen, B, H, V, K, scale=0.5), _rand(gen, B, H, K, high=0.5)
    kw = dict(initial_state=_kv(h0), initial_A_state=A0, output_final_state=True, x=1.5, eps=1e-6)
    if kernel == "chunk":
        o, ht, at = chunk_precond_kda(q, k, v, g, g_atk, beta_atk, beta, **kw)
    else:
        o, ht, at = fused_recurrent_precond_kda(q, k, v, g, g_atk, beta_atk, beta,
                                                use_qk_l2norm_in_kernel=True, **kw)
    qh, kh = _fla_l2norm(q.double()), _fla_l2norm(k.double())
    wk, A_final = _atk_write_key(kh, g_atk.double(), beta_atk.double(), A0=A0)
    ref = delta_rule_recurrence(qh, kh, v.double(), beta.double(), write_key=wk, g=g.double(),
                                initial_state=h0.double())
    _assert_close("o", o, ref.o)
    _assert_close("final_state", _kv(ht), ref.final_state)
    _assert_close("final_A_state", at, A_final)


# --- whole layers (short conv, norms and the kernels together) --------------------------------------


def test_gated_deltanet_layer_chunk_matches_recurrent():
    """A tiny fla ``GatedDeltaNet`` layer in fp32: its chunk path (taken when grad is enabled) and its
    fused-recurrent path (taken for ``q_len ≤ 64`` without grad) agree, so both kernels, the short
    convolutions and the gated RMSNorm all run under the interpreter."""
    from fla.layers import GatedDeltaNet

    torch.manual_seed(81)
    layer = GatedDeltaNet(hidden_size=64, head_dim=16, num_heads=2, expand_v=2, layer_idx=0).eval()
    x = torch.randn(1, 40, 64)
    with torch.no_grad():
        recurrent = layer(x)[0]
    with torch.enable_grad():
        chunk = layer(x)[0].detach()
    _assert_close("layer output", chunk, recurrent)


@triton.jit
def _twice(x):
    return x * 2.0


@triton.jit
def _sigmoid_twice_kernel(x, y, n, B: tl.constexpr):
    offs = tl.program_id(0) * B + tl.arange(0, B)
    mask = offs < n
    # two device-function calls per program: tl.sigmoid (triton.language.standard) and _twice (here)
    tl.store(y + offs, _twice(tl.sigmoid(tl.load(x + offs, mask=mask))), mask=mask)


# --- the patch module itself ----------------------------------------------------------------------


def test_enable_is_idempotent():
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner

    from osdn_diag.runtime.interpret import enable_fla_interpreter

    enable_fla_interpreter()
    enable_fla_interpreter()
    assert getattr(Autotuner.prune_configs, "_osdn_interpret", False)
    assert not getattr(Autotuner.prune_configs.__wrapped__, "_osdn_interpret", False)
    # (e) wraps (c), which wraps the interpreter's own _patch_lang
    assert getattr(interpreter._patch_lang, "_osdn_device_calls", False)
    assert getattr(interpreter._patch_lang.__wrapped__, "_osdn_interpret", False)
    assert not getattr(interpreter._patch_lang.__wrapped__.__wrapped__, "_osdn_interpret", False)
    transformer = interpreter.FunctionRewriter.ast_transformer
    assert getattr(transformer, "_osdn_interpret", False)
    assert not getattr(type(transformer).__mro__[1], "_osdn_interpret", False)


def test_device_function_calls_patch_once_per_launch(monkeypatch):
    """A device function called in every program instance is patched once per launch, not once per
    call (_interpret (e)); results are unchanged and the launch's patches are undone after it."""
    from triton.runtime import interpreter

    from osdn_diag.runtime.interpret import enable_fla_interpreter

    enable_fla_interpreter()
    scans = []
    core = interpreter._patch_lang_core
    monkeypatch.setattr(interpreter, "_patch_lang_core", lambda lang, scope: (scans.append(lang), core(lang, scope)))

    def launch(n):
        x = torch.linspace(-3.0, 3.0, n * 16)
        y = torch.empty_like(x)
        _sigmoid_twice_kernel[(n,)](x, y, x.numel(), B=16)
        torch.testing.assert_close(y, 2.0 * torch.sigmoid(x), rtol=1e-6, atol=1e-7)
        return len(scans)

    launch(1)  # the first launch of a kernel differs (its rewrite); the count is per launch after it
    scans.clear()
    few = launch(2)
    scans.clear()
    many = launch(16)
    # Upstream rescans at both device calls of every program (3 scans a program): 42 more for 16 than 2.
    assert many == few <= 4
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.store)  # the launch's own patches undone


def test_a_jit_function_called_outside_a_launch_leaves_later_launches_patched(monkeypatch):
    """A @triton.jit function called straight from Python (not inside a launch) patches as upstream
    does, and every launch after it patches triton.language for itself again (an earlier version took
    that call for a launch that never ended, and the second launch after it ran unpatched)."""
    import numpy as np
    from triton.runtime import interpreter

    from osdn_diag.runtime.interpret import enable_fla_interpreter

    enable_fla_interpreter()
    scans = []
    core = interpreter._patch_lang_core
    monkeypatch.setattr(interpreter, "_patch_lang_core", lambda lang, scope: (scans.append(lang), core(lang, scope)))
    value = tl.tensor(interpreter.TensorHandle(np.zeros(1, np.float32), tl.float32), tl.float32)
    try:  # it raises or not, depending on what earlier launches left patched (upstream's way)
        tl.sigmoid(value)
    except Exception:
        pass
    x = torch.linspace(-3.0, 3.0, 32)
    for _ in range(3):
        scans.clear()
        y = torch.empty_like(x)
        _sigmoid_twice_kernel[(2,)](x, y, x.numel(), B=16)
        torch.testing.assert_close(y, 2.0 * torch.sigmoid(x), rtol=1e-6, atol=1e-7)
        assert scans  # the launch patched the language for itself


@pytest.mark.parametrize(
    "target, value, match",
    [
        ("env", "0", r"TRITON_INTERPRET must be '1'.*found '0'"),
        ("triton", "3.6.0", r"triton >= 3\.8.*found triton 3\.6\.0"),
        ("fla", "0.5.0", r"flash-linear-attention 0\.6\.0, found fla 0\.5\.0"),
    ],
)
def test_enable_refuses_wrong_environment(monkeypatch, target, value, match):
    import fla
    import triton

    from osdn_diag.runtime.interpret import enable_fla_interpreter

    if target == "env":
        monkeypatch.setenv("TRITON_INTERPRET", value)
    else:
        monkeypatch.setattr(triton if target == "triton" else fla, "__version__", value)
    with pytest.raises(RuntimeError, match=match):
        enable_fla_interpreter()
