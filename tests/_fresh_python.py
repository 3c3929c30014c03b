"""A snippet of Python run in a fresh interpreter, its last line of output read as JSON: for checks
of process-wide patches (Triton's ``Autotuner``) that must not leak into the test process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_json(code: str, *, unset: tuple[str, ...] = (), timeout: float = 120, **env: str) -> dict:
    """Run ``code`` with ``python -c`` in the repository root, without the environment variables
    ``unset`` and with ``env`` added; fail with its standard error unless it exits 0, and return
    the JSON its last line of output holds."""
    full = {k: v for k, v in os.environ.items() if k not in unset}
    full.update(env)
    done = subprocess.run([sys.executable, "-c", code], env=full, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
