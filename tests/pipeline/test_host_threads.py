"""One torch CPU thread while a GPU captures and replays (``pipeline.host_threads``).

With torch's default of a thread per core, the pool's threads spin after every small host operation
and take the cores the run's own threads need (docs/performance.md). The setting must hold only
while the GPU run captures and replays, come back afterwards (also after an error), leave a CPU run
and an explicit ``OMP_NUM_THREADS`` alone, and be in force around every capture and replay.
"""

from __future__ import annotations

import pytest
import torch

from osdn_diag import pipeline
from osdn_diag.pipeline import host_threads


@pytest.fixture
def many_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_one_thread_on_a_gpu_and_back_after(many_threads):
    with host_threads("cuda"):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="inside"):
        with host_threads(torch.device("cuda", 0)):
            raise RuntimeError("inside")
    assert torch.get_num_threads() == 2


def test_the_cpu_and_an_explicit_setting_are_left_alone(many_threads, monkeypatch):
    with host_threads("cpu"):
        assert torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with host_threads("cuda"):
        assert torch.get_num_threads() == 2


def test_every_capture_and_replay_runs_inside_it(tmp_path, monkeypatch):
    entered = []
    real = pipeline.host_threads

    def spy(device):
        entered.append(torch.device(device).type)
        return real(device)

    monkeypatch.setattr(pipeline, "host_threads", spy)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(num_prompts=2, length=24, progress=False, device=device)
    pipeline.stream_run("random:deltanet-tiny", "random", tmp_path / "stream", **kw)
    assert entered == [device]
    pipeline.capture_run("random:deltanet-tiny", "random", tmp_path / "stored", **kw)
    assert entered == [device] * 2
    pipeline.replay_run(tmp_path / "stored", progress=False, device=device)
    assert entered == [device] * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_stream_run_replays_on_one_thread(tmp_path, many_threads, monkeypatch):
    from osdn_diag.replay import replayer

    seen = []
    real_add = replayer.Replayer.add

    def add(self, stored, **kwargs):
        seen.append(torch.get_num_threads())
        return real_add(self, stored, **kwargs)

    monkeypatch.setattr(replayer.Replayer, "add", add)
    pipeline.stream_run("random:deltanet-tiny", "random", tmp_path / "run", num_prompts=2, length=24,
                        progress=False, device="cuda")
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2
