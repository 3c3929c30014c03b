"""Run flash-linear-attention's Triton kernels on a CPU under Triton's interpreter.

CI and the developers' machines have no GPU, but we still want to test "fla's kernel output equals our
reference". Triton can execute ``@triton.jit`` kernels in Python/numpy when ``TRITON_INTERPRET=1`` is
set *before* ``triton`` (and so ``fla``) is imported. fla 0.6.0 does not run there as shipped; this
module patches the four places where it breaks, each at the narrowest point we found, and one
where it is needlessly slow (e):

(a) **Autotuning.** fla wraps most kernels in ``triton.autotune`` (or its subclass
    ``fla.ops.utils.cache.CachedAutotuner``) with several configs. With more than one config left after
    pruning, ``Autotuner.run`` benchmarks each one through ``driver.active.get_benchmarker()``, and
    under the interpreter there is no active GPU driver ("0 active drivers"). We make
    ``Autotuner.prune_configs`` keep a single config, which is the path ``Autotuner.run`` already takes
    when pruning leaves one config: no benchmark, no disk cache (Triton itself already disables the
    autotune disk cache under the interpreter). Any config computes the same result; we keep the one
    with the largest block sizes, because the interpreter's cost is per program instance and per
    Python-level op, so big blocks (few programs, big numpy ops) are the fastest to interpret.

(b) **Loop variables.** Compiled Triton turns ``for i in range(n)`` / ``tl.range(n)`` into an ``scf.for``
    whose induction variable is an ``int32`` tensor; the interpreter runs the loop as a Python loop, so
    ``i`` is a Python ``int`` and fla's ``i_t.to(tl.int64)`` fails (``'int' object has no attribute
    'to'``). The interpreter already rewrites each kernel's AST (``FunctionRewriter.ast_transformer``,
    which wraps assignments in ``to_tensor``); we extend that transformer so that the loop variable of
    ``range``/``tl.range`` loops is wrapped the same way. ``tl.static_range`` loops are left alone: their
    variable is a compile-time constant in compiled Triton too.

(c) **Module-level aliases of Triton builtins.** Before running a kernel, the interpreter swaps every
    builtin of ``triton.language`` (``tl.gather``, ``tl.exp``, ...) for a version bound to its numpy
    semantics, but only on the module objects ``tl`` / ``tl.core`` found in the kernel's globals. fla
    aliases some builtins at module level (``gather = tl.gather`` in ``fla.ops.utils.op``, imported
    into kernel modules by name), and those names would call the compiled-mode builtin, which needs a
    ``_semantic`` argument and fails. We extend the interpreter's ``_patch_lang`` to also patch any
    Triton builtin bound to a name in the kernel's module globals, inside the same restorable scope.

(d) **Rounding to bf16.** The interpreter casts fp32 to bf16 by dropping the low 16 bits (rounding
    toward zero); compiled Triton on NVIDIA GPUs rounds to nearest, ties to even (``cvt.rn.bf16.f32``).
    Every bf16 store of an fla kernel (``l2norm_fwd``'s normalised keys, the preconditioned write key)
    would then differ from the GPU's by up to one bf16 ulp in half of its entries, and capture's
    record of what a bf16 kernel read could not be checked on a CPU. We make the interpreter's fp32 →
    bf16 cast round to nearest even, as the GPU and torch do (NaN stays NaN).

Nothing here is needed, or called, on a real GPU: :func:`enable_fla_interpreter` refuses to run unless
``TRITON_INTERPRET=1``, and every patch applies to interpreter-only code paths
(``triton.runtime.interpreter``) or is gated on ``knobs.runtime.interpret``.

(e) **Device-function calls.** A ``@triton.jit`` function called from a kernel (``tl.sigmoid``, fla's
    ``exp`` helpers) runs the interpreter's ``_patch_lang`` again on every call, in every program
    instance: a scan of every member of ``triton.language`` (about 2 ms each), whose result is then
    dropped. Inside a launch, a function whose module (with the same ``triton.language`` modules in
    its globals) was patched already in that launch is not patched again; the others are patched
    once per launch. Launches are recognised by wrapping ``GridExecutor.__call__``: a jit function
    called from Python outside any launch patches as upstream does.
    On the CPU this was a third of the interpreted time of fla's elementwise kernels (one device call
    per program instance).

fla's own device detection (``fla.utils.hardware``) needs no patch: with no GPU driver it warns
"Triton is not supported on current platform, roll back to CPU." once at import, sets
``device_platform = 'cpu'`` and all ``IS_*`` hardware flags to ``False``, and uses ``'cuda'`` only as the
``device_type`` of ``torch.amp.custom_fwd`` (harmless on CPU tensors). We silence that one warning.
"""

from __future__ import annotations

import ast
import os
import warnings

__all__ = ["check_launchable", "enable_fla_interpreter", "REQUIRED_FLA", "MIN_TRITON"]

REQUIRED_FLA = "0.6.0"
MIN_TRITON = (3, 8)

_ENABLED = False


class InterpreterUnavailable(RuntimeError):
    """fla cannot run under Triton's interpreter in this environment (a triton too old for it, fla
    imported before ``TRITON_INTERPRET=1``, another fla version): the machine's setup, not a fault of
    the package, so the command line reports it in one line."""


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def _check_environment():
    """Import triton and fla, checking every precondition; return ``(triton, fla)``."""
    flag = os.environ.get("TRITON_INTERPRET")
    if flag != "1":
        raise InterpreterUnavailable(
            "enable_fla_interpreter(): TRITON_INTERPRET must be '1' (set before triton or fla is "
            f"imported), found {flag!r}"
        )
    try:
        import triton
    except ImportError as e:  # pragma: no cover - depends on the install
        raise InterpreterUnavailable(f"enable_fla_interpreter(): triton is not importable ({e})") from e
    if _version_tuple(triton.__version__)[:2] < MIN_TRITON:
        raise InterpreterUnavailable(
            "enable_fla_interpreter(): needs triton >= "
            f"{'.'.join(map(str, MIN_TRITON))} (its interpreter runs fla 0.6.0), found triton "
            f"{triton.__version__}"
        )
    if not triton.knobs.runtime.interpret:
        raise InterpreterUnavailable(
            "enable_fla_interpreter(): triton does not see TRITON_INTERPRET=1 "
            f"(triton.knobs.runtime.interpret is {triton.knobs.runtime.interpret!r})"
        )
    with warnings.catch_warnings():
        # fla.utils.hardware: "Triton is not supported on current platform, roll back to CPU."
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
        try:
            import fla
            import fla.ops.utils.op as fla_op
        except ImportError as e:
            raise InterpreterUnavailable(f"enable_fla_interpreter(): fla is not importable ({e})") from e
    version = getattr(fla, "__version__", None)
    if version != REQUIRED_FLA:
        raise InterpreterUnavailable(
            f"enable_fla_interpreter(): written for flash-linear-attention {REQUIRED_FLA}, found "
            f"fla {version} at {os.path.dirname(fla.__file__)}"
        )
    from triton.runtime.interpreter import InterpretedFunction

    # @triton.jit decides at decoration time whether it makes a compiled or an interpreted kernel, so
    # TRITON_INTERPRET=1 set after fla was imported leaves fla's kernels compiled (and unusable here).
    if not isinstance(fla_op.exp, InterpretedFunction):
        raise InterpreterUnavailable(
            "enable_fla_interpreter(): fla was imported before TRITON_INTERPRET=1 was set, so its "
            f"kernels were built for compilation ({type(fla_op.exp).__name__}); set the variable "
            "before importing triton or fla"
        )
    return triton, fla


# --- (a) autotuning -----------------------------------------------------------------------------


def _config_size(config) -> int:
    """Product of a config's integer meta-parameters (its block sizes): bigger is faster to interpret."""
    size = 1
    for value in config.kwargs.values():
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            size *= value
    return size


def _patch_autotuner():
    from triton import knobs
    from triton.runtime.autotuner import Autotuner

    original = Autotuner.prune_configs
    if getattr(original, "_osdn_interpret", False):
        return

    def prune_configs(self, kwargs):
        configs = original(self, kwargs)
        if not knobs.runtime.interpret or len(configs) <= 1:
            return configs
        # One config left makes Autotuner.run skip the benchmark (there is no GPU driver to time it
        # on) and the disk cache; it is still cached per tuning key like a benchmarked choice.
        return [max(configs, key=_config_size)]

    prune_configs._osdn_interpret = True
    prune_configs.__wrapped__ = original
    Autotuner.prune_configs = prune_configs


# --- (b) loop variables as tensors ----------------------------------------------------------------

# Names of iterators whose loop variable is a runtime value (an int32 tensor) in compiled Triton.
_RUNTIME_RANGES = {"range"}


def _is_runtime_range(call: ast.expr) -> bool:
    if not isinstance(call, ast.Call):
        return False
    func = call.func
    if isinstance(func, ast.Name):  # `range(...)`: Python's range, which Triton compiles as tl.range
        return func.id in _RUNTIME_RANGES
    if isinstance(func, ast.Attribute):  # `tl.range(...)`, `triton.language.range(...)`
        return func.attr in _RUNTIME_RANGES
    return False


def _make_transformer_class(base):
    class LoopVarTensorTransformer(base):
        """The interpreter's AST transformer, plus: the variable of a ``range``/``tl.range`` loop is
        re-bound to ``interpreter_semantic.to_tensor(var, False)`` at the top of the loop body, as the
        interpreter already does for every assignment."""

        _osdn_interpret = True

        def visit_For(self, node):
            node = self.generic_visit(node)
            if _is_runtime_range(node.iter) and isinstance(node.target, ast.Name):
                name = node.target.id
                wrap = ast.Assign(
                    targets=[ast.Name(id=name, ctx=ast.Store())],
                    value=ast.Call(
                        func=ast.Attribute(
                            value=ast.Name(id="interpreter_semantic", ctx=ast.Load()),
                            attr="to_tensor",
                            ctx=ast.Load(),
                        ),
                        args=[ast.Name(id=name, ctx=ast.Load()), ast.Constant(value=False)],
                        keywords=[],
                    ),
                )
                ast.copy_location(wrap, node)
                node.body.insert(0, wrap)
            return node

    return LoopVarTensorTransformer


def _patch_loop_variables():
    from triton.runtime import interpreter

    current = interpreter.FunctionRewriter.ast_transformer
    if getattr(current, "_osdn_interpret", False):
        return
    interpreter.FunctionRewriter.ast_transformer = _make_transformer_class(type(current))()
    # Kernels already run were rewritten (and cached) without the fix: rewrite them again.
    interpreter.InterpretedFunction.rewritten_fn.clear()


# --- (c) module-level aliases of builtins ---------------------------------------------------------


def _patch_builtin_aliases():
    import sys

    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    if getattr(original, "_osdn_interpret", False):
        return

    def _patch_lang(fn):
        scope = original(fn)
        module = sys.modules.get(fn.__module__)
        if module is not None and getattr(module, "__dict__", None) is fn.__globals__:
            for name, member in list(fn.__globals__.items()):
                # `gather = tl.gather` at module level (fla.ops.utils.op), and the names imported
                # from there into kernel modules: rebind them, like tl.gather itself, to the
                # interpreter's semantics, in the same scope as the interpreter's own patches (a
                # kernel launch restores it afterwards; a device-function call, upstream, does not,
                # which leaves the name bound to a wrapper that still works).
                if tl.core.is_builtin(member):
                    interpreter._patch_attr(
                        module, name, member, interpreter.interpreter_builder, scope
                    )
        return scope

    _patch_lang._osdn_interpret = True
    _patch_lang.__wrapped__ = original
    interpreter._patch_lang = _patch_lang


# --- (d) fp32 -> bf16 rounds to nearest even ----------------------------------------------------


def f32_to_bf16_bits(x):
    """fp32 values (numpy) to bf16 bit patterns (``uint16``), rounded to nearest, ties to even."""
    import numpy as np

    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)  # no wrap-around while adding the rounding bias
    out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # a quiet NaN of the same sign (the bias could carry a NaN's payload into inf)
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def _patch_bf16_rounding():
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.cast_impl
    if getattr(original, "_osdn_interpret", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(f32_to_bf16_bits(src.data), dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl._osdn_interpret = True
    cast_impl.__wrapped__ = original
    interpreter.InterpreterBuilder.cast_impl = cast_impl


# --- (e) device-function calls reuse the launch's patches ------------------------------------------


def _patch_device_calls():
    import triton.language as tl
    from triton.runtime import interpreter

    inner = interpreter._patch_lang
    if getattr(inner, "_osdn_device_calls", False):
        return
    # One set per launch running (a kernel's grid being interpreted): what its _patch_lang calls have
    # patched, each as (its globals dict, the triton.language modules visible there). A launch is
    # told apart by GridExecutor.__call__ itself, not by the stack's being empty: a jit function
    # called straight from Python (outside any launch) patches as upstream does and is never undone.
    running: list[set] = []

    def _patch_lang(fn):
        if not running:  # outside a launch
            return inner(fn)
        g = fn.__globals__
        # The language modules visible there are part of the key: upstream adds `tl` to a module's
        # globals when it first rewrites one of its functions, after that function's first patch.
        key = (id(g), tuple(name for name, value in g.items() if value is tl or value is tl.core))
        if key in running[-1]:
            return interpreter._LangPatchScope()  # already patched in this launch
        running[-1].add(key)
        return inner(fn)

    launch = interpreter.GridExecutor.__call__

    def launch_once_patched(self, *args, **kwargs):
        running.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            running.pop()

    _patch_lang._osdn_device_calls = True
    _patch_lang._osdn_interpret = True  # (c) stays applied beneath it
    _patch_lang.__wrapped__ = inner
    interpreter._patch_lang = _patch_lang
    launch_once_patched.__wrapped__ = launch
    interpreter.GridExecutor.__call__ = launch_once_patched


def enable_fla_interpreter() -> None:
    """Make fla 0.6.0's Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``).

    Idempotent. Raises ``RuntimeError`` naming what it found when ``TRITON_INTERPRET`` is not ``"1"``,
    triton is older than 3.8, fla is not 0.6.0, or fla was imported before the variable was set.
    Only ever call it under the interpreter (tests, CPU-only machines); on a GPU it refuses to run.
    """
    global _ENABLED
    _check_environment()
    if _ENABLED:
        return
    _patch_autotuner()
    _patch_loop_variables()
    _patch_builtin_aliases()
    _patch_device_calls()
    _patch_bf16_rounding()
    _ENABLED = True


def check_launchable(op: str, device, kernel=None) -> None:
    """Refuse to launch ``op`` on CPU tensors unless Triton's interpreter will run it.

    ``kernel``: one of the op's own ``@triton.jit`` kernels, which ``@triton.jit`` built for the
    interpreter if and only if ``TRITON_INTERPRET=1`` was set when its module was imported; ``None``
    for an op made of fla's kernels, which also need the fixes above (:func:`enable_fla_interpreter`,
    which :func:`osdn_diag.runtime.prepare` calls). Without this, Triton fails deep inside the launch
    ("0 active drivers", or "cpu tensor?" on a machine with a GPU). GPU tensors pass unchecked.
    """
    if getattr(device, "type", device) != "cpu":
        return
    if kernel is None:
        ready = _ENABLED
    else:
        from triton.runtime.interpreter import InterpretedFunction

        ready = isinstance(kernel, InterpretedFunction)
    if not ready and kernel is None and os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError(
            f"{op}: fla's kernels need its interpreter fixes to run on CPU tensors; call "
            "osdn_diag.runtime.prepare('cpu') (TRITON_INTERPRET=1 is set) before the op, or use the "
            "reference in osdn_diag.math"
        )
    if not ready:
        raise RuntimeError(
            f"{op}: CPU tensors run only under Triton's interpreter, which is off in this process; "
            "set TRITON_INTERPRET=1 in the environment, or call osdn_diag.runtime.prepare('cpu'), "
            "before triton, fla or osdn_diag.ops is imported (or move the tensors to a GPU, or use "
            "the reference in osdn_diag.math)"
        )
