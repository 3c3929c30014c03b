"""Suite-wide test configuration: Triton's interpreter on machines without a GPU, and the hypothesis
profiles.

Triton decides when a kernel is defined (at import) whether it will be compiled or interpreted, so
``TRITON_INTERPRET=1`` must be in the environment before anything imports triton or fla. This file is
loaded before any test module, so it sets the variable here — only on a machine without CUDA, so
that a GPU run of the suite keeps compiled Triton.

``python -m pytest`` (what CI runs) uses the ``ci`` profile, which runs every property that keeps the
profile's settings twice (two test ids, ``[fixed]`` and ``[seeded]``), 100 examples each, no deadline
(the reference recurrences loop over time in Python, so example times vary with the drawn shape):

* ``[fixed]`` draws the same examples on every run (derandomised from the test's own source), so a
  failure there is reproducible by rerunning;
* ``[seeded]`` draws a fresh batch from one seed per pytest run, printed in the header and beside every
  failure; ``OSDN_HYPOTHESIS_SEED=N`` (or hypothesis' ``--hypothesis-seed=N``) reruns that batch.

A property with its own ``@settings`` (e.g. a long counterexample search) runs once, as it asks. Set
``HYPOTHESIS_PROFILE=dev`` for a quick local run (25 examples, fresh each time), ``thorough`` for a long
hunt (2000 examples, e.g. after touching a tolerance), or pass hypothesis' own ``--hypothesis-profile``
option, which takes precedence over both.

Tests that interrupt a child command with SIGINT need the child to see it: a suite started as a
background job of a non-interactive shell (``bash .ci/run &``, ``nohup``) inherits SIGINT *ignored*,
which every child would inherit too. The suite restores Python's default handler first (a handled
signal is reset to its default in a child at exec; an ignored one stays ignored).

Reports draw their figures in the command's own process (``OSDN_DIAG_REPORT_WORKERS=0``, unless the
environment already sets it): the suite's own workers already take the cores.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import signal
import sys
from pathlib import Path

import pytest
import hypothesis

# Several pytest workers share the cores: each computes on one thread (torch, and numpy's BLAS, which
# reads the variable when it loads), rather than each spinning up a thread per core and the workers'
# threads contending. Children are untouched: the variable is removed again once both have loaded, so
# a command a test starts sees the environment the suite was given.
_SHARED_CORES = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 and "OMP_NUM_THREADS" not in os.environ
if _SHARED_CORES:
    os.environ["OMP_NUM_THREADS"] = "1"
import numpy  # noqa: E402,F401  (loaded here, inside the one-thread setting)
import torch  # noqa: E402
if _SHARED_CORES:
    del os.environ["OMP_NUM_THREADS"]
    torch.set_num_threads(1)
from hypothesis import HealthCheck, settings  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# A report's figures are drawn in the command's own process unless a test asks for workers: with two
# pytest workers on two cores there is no core left for a drawing process, so each one the default
# would start (it imports matplotlib, ~2.5 s) only slowed the suite — 167 of them, ~7 minutes of CPU.
# tests/report/test_report_workers.py sets or clears the variable wherever workers are the subject.
os.environ.setdefault("OSDN_DIAG_REPORT_WORKERS", "0")

# One seed per pytest run for the "[seeded]" batches: given, or drawn afresh (and printed).
_SEED_ENV = "OSDN_HYPOTHESIS_SEED"
_seed_given = os.environ.get(_SEED_ENV, "").strip()
if _seed_given and not _seed_given.isdigit():
    raise pytest.UsageError(f"{_SEED_ENV}={_seed_given!r}: give the seed a failed run printed, a whole number")
HYPOTHESIS_SEED = int(_seed_given) if _seed_given else secrets.randbelow(2**32)
# The worker processes of pytest-xdist import this file too: they inherit the seed drawn here, so one
# run has one seed, the one its header prints.
os.environ[_SEED_ENV] = str(HYPOTHESIS_SEED)

# "ci": the fixed batch is derandomised (and keeps no example database, so it is the same on every
# machine); its seeded twin is set up per test by the `_hypothesis_batch` fixture below.
settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
for name, examples in (("dev", 25), ("thorough", 2000)):
    settings.register_profile(name, max_examples=examples, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _twin_batches(function) -> bool:
    """Whether a test runs as a fixed and a seeded batch: a hypothesis property that keeps the ``ci``
    profile's settings (``@given`` binds the profile active when the test module is imported; a test
    with its own ``@settings`` holds a different object)."""
    function = getattr(function, "__func__", function)
    return (getattr(function, "is_hypothesis_test", False)
            and settings.get_current_profile_name() == "ci"
            and getattr(function, "_hypothesis_internal_use_settings", None) is settings.get_profile("ci"))


def pytest_configure(config) -> None:
    # hypothesis' own --hypothesis-seed names the seeded batch too, so one option reproduces a run.
    forced = config.getoption("hypothesis_seed", default=None)
    if forced is not None:
        if not str(forced).isdigit():
            raise pytest.UsageError(f"--hypothesis-seed={forced!r}: the seeded batches need a whole number")
        global HYPOTHESIS_SEED
        HYPOTHESIS_SEED = int(forced)


def pytest_report_header(config) -> str:
    if settings.get_current_profile_name() != "ci":
        return f"hypothesis: profile {settings.get_current_profile_name()!r}"
    return (f"hypothesis: ci profile, a fixed batch and a seeded batch per property; seed {HYPOTHESIS_SEED} "
            f"(rerun with {_SEED_ENV}={HYPOTHESIS_SEED})")


def pytest_generate_tests(metafunc) -> None:
    if _twin_batches(metafunc.function):
        metafunc.parametrize("_hypothesis_batch", ["fixed", "seeded"], indirect=True)


@pytest.fixture(autouse=True)
def _hypothesis_batch(request):
    """Under the ``ci`` profile, gives a ``[seeded]`` property this run's seed for the duration of the
    test (hypothesis' ``@seed`` overrides ``derandomize``); ``[fixed]`` and other tests run as written."""
    if getattr(request, "param", None) != "seeded":
        yield
        return
    function = getattr(request.function, "__func__", request.function)
    before = function._hypothesis_internal_use_seed
    hypothesis.seed(HYPOTHESIS_SEED)(function)
    try:
        yield
    finally:
        function._hypothesis_internal_use_seed = before


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    callspec = getattr(item, "callspec", None)
    if report.failed and callspec is not None and callspec.params.get("_hypothesis_batch") == "seeded":
        report.sections.append((
            "seeded hypothesis batch",
            f"seed {HYPOTHESIS_SEED}: rerun with {_SEED_ENV}={HYPOTHESIS_SEED} python -m pytest '{item.nodeid}'",
        ))
    return report


def pytest_collection_modifyitems(config, items) -> None:
    """The slowest files first (``tests/_suite_order.py`` says why). Without that file beside this one
    (this conftest copied alone, as ``tests/test_hypothesis_batches.py`` does) the order is left as is."""
    listing = Path(__file__).with_name("_suite_order.py")
    if not listing.is_file():
        return
    spec = importlib.util.spec_from_file_location("_suite_order", listing)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rank = {name: i for i, name in enumerate(module.SLOWEST_FILES)}
    root = config.rootpath

    def order(item) -> int:
        try:
            return rank.get(item.path.relative_to(root).as_posix(), len(rank))
        except ValueError:  # a test outside the repository
            return len(rank)

    items.sort(key=order)  # stable: the other files, and the tests within a file, keep their order


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _require_fla(what: str) -> None:
    """Skip (fail under CI=true, where a lost install step must not pass unnoticed) without fla."""
    missing = [name for name in ("triton", "fla") if importlib.util.find_spec(name) is None]
    if missing:
        msg = (f"{what}: {' and '.join(missing)} not installed; they need triton>=3.8, "
               "flash-linear-attention==0.6.0 and fla-core==0.6.0")
        if _in_ci():
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def fla_interpreter() -> None:
    """fla 0.6.0 patched to run under Triton's interpreter (CPU tensors). On a CUDA machine the tests
    that use it skip unless ``TRITON_INTERPRET=1`` was exported before pytest started."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "fla interpreter tests: TRITON_INTERPRET is "
            f"{os.environ.get('TRITON_INTERPRET')!r} on this CUDA machine; export TRITON_INTERPRET=1 "
            "(before pytest starts) to run them"
        )
    _require_fla("fla interpreter tests")
    from osdn_diag.runtime.interpret import enable_fla_interpreter

    # Raises RuntimeError naming what it found when the versions are wrong or fla was imported
    # before TRITON_INTERPRET was set: a broken environment, so an error rather than a skip.
    enable_fla_interpreter()


@pytest.fixture(scope="session")
def fla_kernels() -> None:
    """fla 0.6.0 ready to run on the test device: compiled on CUDA, interpreted on a CPU."""
    _require_fla("fla kernel tests")
    if os.environ.get("TRITON_INTERPRET") == "1":
        from osdn_diag.runtime.interpret import enable_fla_interpreter

        enable_fla_interpreter()


@pytest.fixture
def fp32_chunk_delta_rule(monkeypatch):
    """fla's DeltaNet layer with fp32 chunk kernels: fla's public ``chunk_delta_rule`` refuses fp32
    (whatever the device); its autograd Function is the same computation."""
    import fla.layers.delta_net as dn
    from fla.ops.delta_rule.chunk import ChunkDeltaRuleFunction

    def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
        scale = k.shape[-1] ** -0.5 if scale is None else scale
        return ChunkDeltaRuleFunction.apply(
            q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            cu_seqlens, None, 64,
        )

    monkeypatch.setattr(dn, "chunk_delta_rule", chunk_delta_rule)


@pytest.fixture(scope="session")
def benchmark_script():
    """``benchmark_script(name)``: ``benchmarks/<name>.py`` as a module (the scripts are not a package;
    they import their sibling ``_common``, so the folder is on the path while one loads)."""
    folder = Path(__file__).resolve().parents[1] / "benchmarks"

    def load(name: str):
        sys.path.insert(0, str(folder))
        try:
            spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
        finally:
            sys.path.remove(str(folder))

    return load
