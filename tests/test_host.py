"""``from_host``: small tensors of host values on a device, the copy queued rather than waited for.

On the CPU it is ``torch.tensor``; on a GPU the same values arrive without a synchronisation (torch's
sync debug mode turns one into an error), also while a long kernel is still running before it, and
the replay's per-token index built from it equals the one ``torch.tensor`` gives.
"""

from __future__ import annotations

import pytest
import torch

from osdn_diag.runtime.host import from_host
from osdn_diag.replay.call import _table_index, _table_layout


@pytest.mark.parametrize("dtype", [torch.long, torch.float64, torch.int32])
def test_equals_torch_tensor_on_the_cpu(dtype):
    values = [[3, 0, 7], [1, 2, 5]]
    out = from_host(values, dtype, "cpu")
    assert out.dtype == dtype and torch.equal(out, torch.tensor(values, dtype=dtype))
    assert from_host([], dtype, torch.device("cpu")).shape == (0,)


def test_table_index_of_segments():
    segs = [(0, 0, 5), (1, 2, 4), (3, 1, 1)]  # (batch row, start, end); the last is empty
    seq, head, pos, row, t = _table_index(segs, 2, torch.device("cpu"))
    expect = [(s, h, p) for s, (r, a, e) in enumerate(segs) for h in range(2) for p in range(e - a)]
    assert list(zip(seq.tolist(), head.tolist(), pos.tolist())) == expect
    assert row.tolist() == [segs[s][0] for s, _, _ in expect]
    assert t.tolist() == [segs[s][1] + p for s, _, p in expect]
    # the rows of each (sequence, head) stream, in the table's order
    assert _table_layout(segs, 2, torch.device("cpu"))[5].tolist() == [5, 5, 2, 2, 0, 0]


def test_table_index_is_built_once_per_layout():
    """Kept per layout (every layer of a batch shares one); another layout, head count or segment list
    given in another form gets its own index or the same one, never a neighbour's."""
    a = [(0, 0, 5), (1, 2, 4)]
    first = _table_index(a, 2, torch.device("cpu"))
    assert all(x is y for x, y in zip(first, _table_index([list(s) for s in a], 2, "cpu")))
    other = _table_index([(0, 0, 4), (1, 2, 4)], 2, torch.device("cpu"))
    three = _table_index(a, 3, torch.device("cpu"))
    assert other[0].numel() == 12 and three[0].numel() == 21 and first[0].numel() == 14
    assert torch.equal(_table_index(a, 2, torch.device("cpu"))[4], first[4])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_no_synchronisation_on_a_gpu():
    dev = torch.device("cuda")
    x = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            x = x @ x  # queued work ahead of the copies
            x = x / x.norm()
        out = from_host([[3, 0, 7], [1, 2, 5]], torch.long, dev)
        lengths = from_host([2048.0, 17.0], torch.float64, dev)
        idx = _table_index([(0, 0, 5), (1, 2, 4)], 2, dev)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.tolist() == [[3, 0, 7], [1, 2, 5]] and lengths.tolist() == [2048.0, 17.0]
    cpu = _table_index([(0, 0, 5), (1, 2, 4)], 2, torch.device("cpu"))
    assert all(torch.equal(a.cpu(), b) for a, b in zip(idx, cpu))
