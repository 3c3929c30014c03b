"""The view's size is bounded whatever the run's: every aggregate is exact and of a fixed size (bins,
layers × heads, streams), and only the token strips grow with the prompts' length, for the number of
prompts chosen (4 by default), not the run's — and the d trajectory, one head over the first prompt. Synthetic per-token tables, in memory."""

from __future__ import annotations

import pytest

from _synthetic import synthetic_results
from osdn_diag.view import view_data
from osdn_diag.view.page import render


def _data_bytes(results, **kw) -> int:
    from plotly.offline import get_plotlyjs

    return len(render(view_data(results, **kw)).encode()) - len(get_plotlyjs().encode())


def test_more_prompts_add_nothing_but_their_count():
    small = _data_bytes(synthetic_results(prompts=4, length=64, layers=3, heads=2))
    large = _data_bytes(synthetic_results(prompts=64, length=64, layers=3, heads=2))
    assert abs(large - small) < 2_000, (small, large)  # the same 4 strips; exact aggregates of fixed size


@pytest.mark.parametrize("strips", [1, 4])
def test_longer_prompts_grow_the_strips_only(strips):
    a = _data_bytes(synthetic_results(prompts=8, length=64, layers=3, heads=2), strips=strips)
    b = _data_bytes(synthetic_results(prompts=8, length=512, layers=3, heads=2), strips=strips)
    # per strip token: 5 float32 per layer and the pooled row, in base64 (4/3), its text and id (≤ 16
    # bytes); and the d trajectory of one head over the first prompt: position and d in JSON (≤ 48 bytes)
    per_token = 5 * 4 * (3 + 1) * 4 / 3 + 16
    assert b - a <= (strips * per_token + 48) * (512 - 64), (a, b)
