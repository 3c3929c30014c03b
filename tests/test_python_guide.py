"""docs/python-guide.md runs as written: its ```python blocks in order, in one namespace, as a
notebook runs its cells (CPU: Triton's interpreter, the package's reference recurrence in capture).
The numbers it prints are checked against the per-token table it built."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "python-guide.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_the_guide_runs_top_to_bottom(tmp_path, monkeypatch, fla_interpreter):
    monkeypatch.chdir(tmp_path)  # the guide writes contraction.png and runs/guide where it runs
    blocks = BLOCK.findall(GUIDE.read_text())
    assert len(blocks) >= 7
    ns: dict = {}
    for i, code in enumerate(blocks):
        exec(compile(code, f"python-guide.md block {i + 1}", "exec"), ns)
    res, run, table = ns["res"], ns["run"], ns["table"]
    # the summary's q_geo is the geometric mean of the table's finite ratios (floored as documented)
    q = table["residual_ratio"].to_numpy().astype(np.float64)
    q = q[np.isfinite(q)]
    assert math.isclose(res.summary["q_geo"], float(np.exp(np.log(np.maximum(q, 1e-30)).mean())), rel_tol=1e-6)
    # per-token rows: every position of every prompt, the text the tokenizer gives
    tokens = ns["tokens"].to_pydict()
    assert len(tokens["pos"]) == sum(len(p) for p in ns["prompts"])
    first = sorted((pos, text) for prompt, pos, text in zip(tokens["prompt"], tokens["pos"], tokens["text"])
                   if prompt == 0)
    assert "".join(text for _, text in first) == ns["tok"].decode(ns["prompts"][0].input_ids)
    # the weakest tokens printed are the largest per-token q_geo, from the table's own ratios
    weakest = ns["weakest"].to_pydict()
    qs = sorted((q for q in tokens["q_geo"] if q is not None), reverse=True)[:5]
    assert np.allclose(weakest["q_geo"], qs)
    assert (tmp_path / "contraction.png").stat().st_size > 0
    assert ns["new"].shape == (1, 8) and "decode" in ns["gen"].summary["by_phase"]
    assert 0 < run.summary["q_geo"] < 1 and run.per_token().num_rows == 2 * 64
    # the monitor's probe: the whole model's q_geo is that of a replay of the same batch, captured apart
    import osdn_diag

    with osdn_diag.capture(ns["model"]) as cap, __import__("torch").no_grad():
        ns["model"](input_ids=ns["probe"])
    again = osdn_diag.replay(cap).summary["q_geo"]
    assert math.isclose(ns["whole"]["q_geo"], again, rel_tol=1e-5)
    assert (tmp_path / "runs" / "train" / "monitor.parquet").stat().st_size > 0
