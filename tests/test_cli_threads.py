"""The model commands run torch on one CPU thread unless ``OMP_NUM_THREADS`` is set
(:func:`osdn_diag.cli.dispatch._cpu_threads`, docs/performance.md). The demo stands in for the model commands,
with ``run_demo`` replaced by a stub: the thread count is set before the command runs."""

from __future__ import annotations

import pytest
import torch

import osdn_diag.demo
from osdn_diag import cli
from osdn_diag.cli import dispatch


@pytest.fixture
def threads(monkeypatch, tmp_path):
    """torch at 2 threads for the test (restored after); ``osdn-diag demo`` runs nothing."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen = []

    def stub(out_dir, **kw):
        seen.append(torch.get_num_threads())  # what the command itself runs with
        return tmp_path / "report.md", []

    monkeypatch.setattr(osdn_diag.demo, "run_demo", stub)
    monkeypatch.chdir(tmp_path)
    yield seen
    torch.set_num_threads(before)


def test_a_model_command_on_the_cpu_uses_one_thread(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cli.main(["demo", "--device", "cpu", "-q"]) == 0
    assert threads == [1] and torch.get_num_threads() == 1


def test_omp_num_threads_leaves_torch_alone(threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cli.main(["demo", "--device", "cpu", "-q"]) == 0
    assert threads == [2] and torch.get_num_threads() == 2


def test_the_default_device_counts_as_the_cpu_without_cuda(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["demo", "-q"]) == 0
    assert threads == [1]


def test_a_gpu_device_or_a_file_command_leaves_torch_alone(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    dispatch._cpu_threads("cuda:0")
    assert torch.get_num_threads() == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    dispatch._cpu_threads(None)  # no --device: the GPU there is
    assert torch.get_num_threads() == 2
    assert set(dispatch._MODEL_COMMANDS) == {"capture", "replay", "run", "what-if", "demo", "warmup"}
