"""Fixtures for the layer tests: flash-linear-attention (and our kernels) under Triton's interpreter on the CPU (same logic as tests/capture/conftest.py).

The root ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` on machines without a CUDA GPU (CI and the
developers' machines) before anything imports triton or fla. On a GPU machine, export
``TRITON_INTERPRET=1`` yourself to run these tests.

The tests skip (with the reason) when triton or fla is not installed, which only happens in partial dev
setups: CI installs both (see ``osdn_diag/_interpret.py`` for the versions), and under ``CI=true`` a
missing package fails the tests instead of skipping them, so a lost install step cannot pass unnoticed.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def fla_interpreter() -> None:
    """fla 0.6.0 patched to run under Triton's interpreter (see :func:`enable_fla_interpreter`)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "fla interpreter tests: TRITON_INTERPRET is "
            f"{os.environ.get('TRITON_INTERPRET')!r} on this CUDA machine; export TRITON_INTERPRET=1 "
            "(before pytest starts) to run them"
        )
    missing = [name for name in ("triton", "fla") if importlib.util.find_spec(name) is None]
    if missing:
        msg = (
            f"fla interpreter tests: {' and '.join(missing)} not installed; they need triton>=3.8, "
            "flash-linear-attention==0.6.0 and fla-core==0.6.0"
        )
        if _in_ci():
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)

    from osdn_diag._interpret import enable_fla_interpreter

    # Raises RuntimeError naming what it found when the versions are wrong or fla was imported
    # before TRITON_INTERPRET was set: a broken environment, so an error rather than a skip.
    enable_fla_interpreter()
