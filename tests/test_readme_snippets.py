"""Every ```python block of README.md and docs/*.md runs as written.

A block may use names a reader brings (``model``, ``input_ids``: any fla model and a batch of token
ids); the test supplies them from the tiny random DeltaNet preset on the CPU, with gradients on, as
a notebook would have them. Each block runs alone, in a namespace of its own.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# docs/python-guide.md is one session whose blocks build on each other: tests/test_python_guide.py
# runs it in order. docs/monitor.md's blocks are training loops and Trainer set-ups around the
# monitor: tests/test_monitor.py runs the monitor in both, and the guide's section 9 runs a probe.
SESSIONS = {"python-guide.md", "monitor.md"}
FILES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in SESSIONS)]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks():
    for path in FILES:
        for i, match in enumerate(BLOCK.finditer(path.read_text())):
            line = path.read_text()[: match.start()].count("\n") + 1
            yield pytest.param(path, match.group(1), id=f"{path.relative_to(ROOT)}:{line}")


def test_there_are_snippets():
    assert len(list(_blocks())) >= 3


@pytest.mark.parametrize("path,code", list(_blocks()))
def test_snippet_runs(path, code, fla_interpreter):
    from osdn_diag.models import load_model

    torch.manual_seed(0)
    loaded = load_model("random:deltanet-tiny", device="cpu", dtype=torch.float32)
    model = getattr(loaded, "model", loaded)
    namespace = {"model": model, "input_ids": torch.randint(0, 100, (2, 24))}
    assert torch.is_grad_enabled()  # as in a notebook: no no_grad around the user's forward
    exec(compile(code, f"{path.name} snippet", "exec"), namespace)
    res = namespace.get("res")
    if res is not None:  # the Python API snippet: its figures are real numbers from a real replay
        assert math.isfinite(res.summary["q_geo"]) and 0 < res.summary["q_geo"] < 1
        assert res.table.num_rows == 2 * 24 * model.config.num_hidden_layers * model.config.num_heads
    if "fig" in namespace:
        assert namespace["fig"].axes and namespace["fig"].axes[0].get_lines()
