"""osdn_diag.monitor on the CPU: a tiny OSDN language model trained 20 steps, probed every 5.

* Each probe's rows equal an independent measurement of the checkpoint saved at that step: the
  checkpoint loaded from disk into a fresh model, captured and replayed on the same batch (per layer
  q_geo, q_arith and n from the replay summary, d statistics recomputed here with numpy from the
  captured d), and for one step ``osdn-diag run`` of the checkpoint itself.
* The monitor does not disturb training: the trained weights and the optimizer state are bitwise
  equal with and without it. The loop draws its batches from torch's, Python's and numpy's global
  generators and the model drops out 10 % of its embeddings in train mode, so a monitor that consumed
  a random number or left a module in eval mode would change the weights; the planted variants below
  show that the comparison sees each.
* ``monitor.parquet``: its schema, the atomic rewrite, the replacement of a probed step on resume.
* The transformers ``Trainer`` callback: the scalars reach the Trainer's loggers (``on_log`` of every
  callback and ``state.log_history``) and the file.
* DDP (gloo, two processes on the CPU): rank 0 probes and writes, rank 1 does neither, training goes on.
"""

from __future__ import annotations

import json
import time
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 64
STEPS, EVERY = 20, 5
PROBE = torch.arange(2 * 24).reshape(2, 24) * 7 % VOCAB  # fixed held-out batch [2, 24]

pytestmark = pytest.mark.usefixtures("fla_interpreter")


def _tiny(seed: int = 0):
    import osdn_diag.models  # noqa: F401  (registers OSDN with transformers)
    from transformers import AutoModelForCausalLM

    from osdn_diag.models import OSDNConfig

    torch.manual_seed(seed)
    cfg = OSDNConfig(hidden_size=32, num_hidden_layers=2, num_heads=2, vocab_size=VOCAB, intermediate_size=64,
                     fuse_cross_entropy=False, eta=0.03, tie_word_embeddings=True,
                     # torch norms and no convolution: fewer interpreted Triton kernels, a faster test
                     use_short_conv=False, fuse_norm=False, fuse_swiglu=False)
    return AutoModelForCausalLM.from_config(cfg)


def _dropout(module, inputs, output):
    # Train-mode-dependent and random: a monitor that leaves eval mode or moves a generator shows.
    return torch.nn.functional.dropout(output, 0.1, module.training)


def _kernels(model):
    """The differentiable reference recurrence for the training forward on the CPU (records dropped)."""
    import osdn_diag

    return osdn_diag.capture(model, kernels="reference", sink=lambda call: None)


def _train(tmp: Path | None, *, monitor: bool, steps: int = STEPS, every: int = EVERY, save: Path | None = None):
    """Train the tiny model; returns (model, optimizer, monitor or None, per-step checks)."""
    from osdn_diag.monitor import Monitor

    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    model = _tiny()
    model.get_input_embeddings().register_forward_hook(_dropout)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = Monitor(model, PROBE, every=every, out=tmp, name="tiny-osdn") if monitor else None
    modes = []
    for step in range(1, steps + 1):
        shift = torch.tensor([random.randrange(VOCAB) for _ in range(16)]) + torch.from_numpy(np.random.randint(VOCAB, size=16))
        ids = (torch.randint(0, VOCAB, (2, 16)) + shift) % VOCAB
        with _kernels(model):
            loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if mon is not None:
            mon.step(step)
            modes.append((all(m.training for m in model.modules()), torch.is_grad_enabled()))
        if save is not None and step % EVERY == 0:
            model.save_pretrained(save / f"step{step}")
    return model, opt, mon, modes


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("monitor")
    model, opt, mon, modes = _train(tmp / "run", monitor=True, save=tmp / "ckpt")
    bare, bare_opt, _, _ = _train(None, monitor=False)
    return tmp, model, opt, mon, modes, bare, bare_opt


def _measure(checkpoint: Path):
    """An independent measurement of a saved checkpoint on the probe batch: loaded from disk into a
    fresh model, captured and replayed; d statistics computed here from the captured d."""
    from transformers import AutoModelForCausalLM

    import osdn_diag

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad(), osdn_diag.capture(model) as cap:
        model(input_ids=PROBE)
    res = osdn_diag.replay(cap)
    d = {}
    for c in cap.calls:
        d.setdefault(c.layer, []).append(c.d.double().numpy().ravel())
    return res.summary, {k: np.concatenate(v) for k, v in d.items()}


def _close(a, b, rel=1e-5):
    assert a == a and b == b, (a, b)  # NaN never passes
    assert abs(a - b) <= rel * max(abs(a), abs(b)), (a, b)


def test_each_probe_equals_a_separate_measurement_of_the_checkpoint_saved_at_that_step(trained):
    tmp, _, _, mon, _, _, _ = trained
    assert sorted({r["step"] for r in mon.rows}) == [5, 10, 15, 20]
    for step in (5, 10, 15, 20):
        summary, d = _measure(tmp / "ckpt" / f"step{step}")
        rows = {r["layer"]: r for r in mon.rows if r["step"] == step}
        assert sorted(rows) == [-1, 0, 1]
        for layer in (0, 1):
            want = summary["by_layer"][f"{layer:03d}"]
            for key in ("q_geo", "q_arith"):
                _close(rows[layer][key], want[key])
            assert rows[layer]["n"] == want["n"] > 0
            x = d[layer]
            _close(rows[layer]["d_mean"], float(x.mean()))
            _close(rows[layer]["d_std"], float(x.std(ddof=1)))
            _close(rows[layer]["d_min"], float(x.min()))
            _close(rows[layer]["d_max"], float(x.max()))
            assert rows[layer]["d_moved"] == pytest.approx(float((np.abs(x - 1) > 1e-3).mean()), abs=0)
        all_d = np.concatenate([d[0], d[1]])
        _close(rows[-1]["q_geo"], summary["q_geo"])
        _close(rows[-1]["q_arith"], summary["q_arith"])
        _close(rows[-1]["d_mean"], float(all_d.mean()))
        assert rows[-1]["n"] == summary["n"]
    # Training moved the contraction: the probes are not one value repeated.
    assert len({round(r["q_geo"], 9) for r in mon.rows if r["layer"] == -1}) == 4


def test_a_probe_equals_osdn_diag_run_of_that_checkpoint(trained, tmp_path):
    from osdn_diag import cli

    tmp, _, _, mon, _, _, _ = trained
    prompts = tmp_path / "probe.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": row.tolist()}) + "\n" for row in PROBE))
    out = tmp_path / "run"
    code = cli.main(["run", str(tmp / "ckpt" / "step10"), "--prompts", str(prompts), "--out", str(out),
                     "--batch-size", "2", "--dtype", "fp32", "--device", "cpu"])
    assert code in (0, None)
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["layer"]: r for r in mon.rows if r["step"] == 10}
    for layer in (0, 1):
        _close(rows[layer]["q_geo"], summary["by_layer"][f"{layer:03d}"]["q_geo"])
        _close(rows[layer]["q_arith"], summary["by_layer"][f"{layer:03d}"]["q_arith"])
    _close(rows[-1]["q_geo"], summary["q_geo"])


def test_training_is_bitwise_the_same_with_and_without_the_monitor(trained):
    _, model, opt, mon, modes, bare, bare_opt = trained
    assert mon.probes == 4
    assert modes == [(True, True)] * STEPS  # every module back in train mode, autograd on
    a, b = model.state_dict(), bare.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for sa, sb in zip(opt.state_dict()["state"].values(), bare_opt.state_dict()["state"].values()):
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), k


def _weights(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.fixture(scope="module")
def two_steps():
    """The weights after two steps without a monitor (the planted variants probe after each)."""
    return _weights(_train(None, monitor=False, steps=2)[0])


DRAW = {"torch": lambda: torch.rand(1), "python": random.random, "numpy": np.random.rand}


def _drawing_replay(monkeypatch, draws):
    """Make the probe's replay draw from the global generators (inside the monitor's save/restore)."""
    import osdn_diag

    real = osdn_diag.replay

    def replay(*args, **kwargs):
        for name in draws:
            DRAW[name]()
        return real(*args, **kwargs)

    monkeypatch.setattr(osdn_diag, "replay", replay)


@pytest.mark.parametrize("bug", ["torch", "python", "numpy", "eval-mode"])
def test_the_comparison_sees_a_monitor_that_disturbs_training(two_steps, bug, monkeypatch):
    """A planted bug — a probe that draws from a generator and does not restore it, or leaves the model
    in eval mode — changes the weights: the bitwise comparison above would fail."""
    import osdn_diag.monitor as monitor

    if bug == "eval-mode":
        original = monitor.Monitor._capture_replay

        def planted(self, model, device):
            out = original(self, model, device)
            model.eval()
            return out

        monkeypatch.setattr(monitor.Monitor, "_capture_replay", planted)
    else:
        _drawing_replay(monkeypatch, [bug])
        monkeypatch.setattr(monitor, "_restore_rng", lambda states: None)
    model, _, mon, _ = _train(None, monitor=True, steps=2, every=1)
    assert mon.probes == 2
    assert not torch.equal(_weights(model), two_steps)


def test_the_restored_generators_make_a_probe_that_draws_harmless(two_steps, monkeypatch):
    """The same draws with the monitor's own restore in place leave training bitwise unchanged."""
    _drawing_replay(monkeypatch, list(DRAW))
    model, _, mon, _ = _train(None, monitor=True, steps=2, every=1)
    assert mon.probes == 2
    assert torch.equal(_weights(model), two_steps)


def test_monitor_parquet_holds_the_rows_and_a_resumed_step_replaces_its_rows(trained):
    import pyarrow.parquet as pq

    import osdn_diag.monitor as monitor

    tmp, model, _, mon, _, _, _ = trained
    path = tmp / "run" / "monitor.parquet"
    table = pq.read_table(path)
    assert tuple(table.column_names) == monitor.SCHEMA_FIELDS
    assert table.to_pylist() == mon.table().to_pylist()
    assert [p.name for p in path.parent.iterdir()] == ["monitor.parquet"]  # no temporary left
    # A second monitor on the same file (a resumed run) probing step 20 again replaces its rows.
    again = monitor.Monitor(model, PROBE, every=EVERY, out=path, name="tiny-osdn")
    again.probe(20)
    table = monitor.read(tmp / "run")
    assert table.num_rows == mon.table().num_rows
    assert sorted(table.column("step").to_pylist()) == sorted(r["step"] for r in mon.rows)
    fresh = [r for r in table.to_pylist() if r["step"] == 20]
    old = [r for r in mon.rows if r["step"] == 20]
    for a, b in zip(sorted(fresh, key=lambda r: r["layer"]), sorted(old, key=lambda r: r["layer"])):
        assert a["q_geo"] == b["q_geo"]  # the same weights, the same batch: the same value


def test_a_deleted_monitor_parquet_is_written_again_from_the_monitors_rows(tmp_path):
    """A resumed training's monitor holds every probe's rows (restored from its state): where
    ``monitor.parquet`` was deleted, or lacks some of them, its next probe writes them all again, beside
    other models' rows."""
    import pyarrow.parquet as pq

    import osdn_diag.monitor as monitor

    def rows(name, step, q=0.5):
        return [{"model": name, "step": step, "layer": layer, "q_geo": q, "q_arith": q, "n": 1} for layer in (0, -1)]

    path = tmp_path / "monitor.parquet"
    mon = monitor.Monitor.__new__(monitor.Monitor)  # the file's writer alone: no model to probe
    mon.name, mon.path, mon.rows = "A", path, []
    other = monitor.Monitor.__new__(monitor.Monitor)
    other.name, other.path, other.rows = "B", path, []
    for step in (0, 5):
        for m in (mon, other):
            m.rows += rows(m.name, step)
            m._append(rows(m.name, step))
    path.unlink()
    mon.rows += rows("A", 10)
    mon._append(rows("A", 10))
    got = pq.read_table(path).to_pylist()
    assert sorted((r["model"], r["step"], r["layer"]) for r in got) == sorted(
        ("A", s, layer) for s in (0, 5, 10) for layer in (0, -1))
    # the other model's next probe brings its own back; a step probed again is replaced, not doubled
    other.rows = [r for r in other.rows if r["step"] != 5] + rows("B", 5, q=0.25)
    other._append(rows("B", 5, q=0.25))
    got = pq.read_table(path).to_pylist()
    assert sorted((r["model"], r["step"]) for r in got if r["layer"] == -1) == [
        ("A", 0), ("A", 5), ("A", 10), ("B", 0), ("B", 5)]
    assert [r["q_geo"] for r in got if r["model"] == "B" and r["step"] == 5] == [0.25, 0.25]


_APPEND = """
import sys
from pathlib import Path
from osdn_diag.monitor import Monitor
mon = Monitor.__new__(Monitor)  # the file's writer alone: no model to probe
mon.name, mon.path, mon.rows = sys.argv[1], Path(sys.argv[2]), []
sys.stdin.read()  # started together
for step in range(1, int(sys.argv[3]) + 1):
    mon._append([{"model": mon.name, "step": step, "layer": layer, "q_geo": 0.5, "q_arith": 0.5, "n": 1}
                 for layer in (0, 1, -1)])
"""


def test_monitors_of_two_processes_sharing_monitor_parquet_keep_every_row(tmp_path):
    """Two trainings' monitors writing one ``monitor.parquet`` each read it, add their rows and rename
    the result over it: without a lock around that, one's rewrite dropped the rows the other had
    just added (or read a file being replaced). Now every row of both is there, no lock or temporary
    is left, and a link at the lock's name is refused, not followed."""
    import pyarrow.parquet as pq

    import osdn_diag.monitor as monitor
    from osdn_diag.rundir import RunDirectoryError

    path, steps = tmp_path / "monitor.parquet", 40
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _APPEND, name, str(path), str(steps)], env=env,
                              stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in ("A", "B")]
    for proc in procs:
        proc.stdin.close()
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    rows = pq.read_table(path).to_pylist()
    for name in ("A", "B"):
        assert sorted((r["step"], r["layer"]) for r in rows if r["model"] == name) == sorted(
            (step, layer) for step in range(1, steps + 1) for layer in (0, 1, -1))
    assert [p.name for p in tmp_path.iterdir()] == ["monitor.parquet"]
    outside = tmp_path / "outside.txt"
    outside.write_text("theirs")
    (tmp_path / ".monitor.parquet.lock").symlink_to(outside)
    mon = monitor.Monitor.__new__(monitor.Monitor)
    mon.name, mon.path, mon.rows = "C", path, []
    with pytest.raises(RunDirectoryError, match="not a lock file"):
        mon._append([{"model": "C", "step": 1, "layer": -1, "q_geo": 0.5, "q_arith": 0.5, "n": 1}])
    assert outside.read_text() == "theirs" and pq.read_table(path).num_rows == len(rows)


def test_scalars_name_each_layer_and_the_whole_model(trained):
    _, _, _, mon, _, _, _ = trained
    rows = [r for r in mon.rows if r["step"] == 5]
    s = mon.scalars(rows)
    whole = next(r for r in rows if r["layer"] == -1)
    assert s["contraction/tiny-osdn/q_geo"] == whole["q_geo"]
    assert s["contraction/tiny-osdn/q_arith/layer_001"] == next(r for r in rows if r["layer"] == 1)["q_arith"]
    assert "contraction/tiny-osdn/d_mean/layer_000" in s
    assert all(isinstance(v, float) and math.isfinite(v) for v in s.values())


def test_overhead_is_measured_and_printed(trained, capsys):
    _, _, _, mon, _, _, _ = trained
    o = mon.close(total_seconds=1000.0)
    assert o["probes"] == 4 and 0 < o["probe_seconds"] < 1000 and o["fraction"] == o["probe_seconds"] / 1000
    # the first probe apart (it compiles): its seconds are the first row's, the rest over the time left
    by_step = {r["step"]: r["probe_seconds"] for r in mon.rows}
    first = by_step[min(by_step)]
    assert 0 < o["first_probe_seconds"] <= o["probe_seconds"]
    # a row's clock stops before the rows are written and logged, the monitor's after: each probe's
    # seconds are its row's and some, and the first's "some" is part of all probes' together
    assert first <= o["first_probe_seconds"]
    assert o["first_probe_seconds"] - first <= o["probe_seconds"] - sum(by_step.values()) + 1e-9
    assert o["fraction_after_first"] == (o["probe_seconds"] - o["first_probe_seconds"]) / (1000 - o["first_probe_seconds"])
    err = capsys.readouterr().err
    assert f"4 probes took {o['probe_seconds']:.2f} s, {100 * o['fraction']:.2f} % of 1000.0 s of training" in err
    assert (f"the first {o['first_probe_seconds']:.2f} s (it compiles the probe's kernels), the 3 others "
            f"{100 * o['fraction_after_first']:.2f} % of the rest") in err


def test_overhead_before_a_second_probe_has_no_recurring_share(capsys):
    from osdn_diag.monitor import Monitor

    mon = Monitor.__new__(Monitor)
    mon.probes, mon.seconds, mon.first_seconds, mon.started = 1, 2.0, 2.0, 0.0
    o = mon.overhead(10.0)
    assert o["fraction"] == 0.2 and o["first_probe_seconds"] == 2.0 and o["fraction_after_first"] is None
    json.dumps(o, allow_nan=False)  # it goes into results files as it is (scale_study.py)
    mon.name = "m"
    mon.close(10.0)  # one probe: nothing printed about the others
    mon.probes, mon.seconds = 2, 2.5
    assert mon.overhead(10.0)["fraction_after_first"] == 0.5 / 8.0
    mon.close(10.0)
    first, second = capsys.readouterr().err.splitlines()
    assert first == "[monitor] m: 1 probe took 2.00 s, 20.00 % of 10.0 s of training"
    assert second.endswith("; the first 2.00 s (it compiles the probe's kernels), the other 6.25 % of the rest")


def test_a_restored_monitor_sets_every_process_probes_against_every_process_time():
    """overhead() without a total, after restore(): the saved probes' seconds against the saved clock
    plus this process's, not against this process's seconds alone (it gave a share of 249.6)."""
    from osdn_diag.monitor import Monitor

    saved = Monitor.__new__(Monitor)
    saved.rows, saved.probes, saved.seconds, saved.first_seconds = [], 5, 50.0, 40.0
    saved.started = time.perf_counter() - 1000.0  # a process that ran for 1,000 s
    state = saved.state()
    assert state["elapsed"] == pytest.approx(1000.0, abs=1.0)
    mon = Monitor.__new__(Monitor)
    mon.started = time.perf_counter()  # made just now, in another process
    mon.restore(state)
    o = mon.overhead()
    assert o["total_seconds"] == pytest.approx(1000.0, abs=1.0) and o["fraction"] == pytest.approx(0.05, rel=1e-2)
    assert o["fraction_after_first"] == pytest.approx(10.0 / 960.0, rel=1e-2)
    with pytest.raises(ValueError, match=r"not a Monitor.state\(\) \(it lacks seconds, first_seconds\)"):
        mon.restore({"rows": [], "probes": 5})


def test_plot_training_draws_a_line_per_model_and_layer(trained):
    import osdn_diag.plot as odp

    tmp, _, _, mon, _, _, _ = trained
    fig = odp.training(tmp / "run")
    lines = fig.axes[0].get_lines()
    assert len(lines) == 3  # the whole model and its two layers
    whole = next(line for line in lines if line.get_label() == "tiny-osdn")
    assert list(whole.get_xdata()) == [5, 10, 15, 20]
    assert list(whole.get_ydata()) == [r["q_geo"] for r in sorted(mon.rows, key=lambda r: r["step"])
                                       if r["layer"] == -1]
    assert len(odp.training(mon, layers=False).axes[0].get_lines()) == 1


def test_arguments_are_checked():
    from osdn_diag.monitor import Monitor

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="argument 'every'"):
        Monitor(model, PROBE, every=0)
    with pytest.raises(ValueError, match="argument 'probe_batch'"):
        Monitor(model, PROBE.float())
    with pytest.raises(ValueError, match="argument 'autocast'"):
        Monitor(model, PROBE, autocast="bf16")


def test_the_package_and_the_monitor_import_without_transformers():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "transformers" or name.startswith("transformers."):
                    raise ImportError("blocked")
        sys.meta_path.insert(0, Block())
        import osdn_diag, osdn_diag.monitor
        assert "transformers" not in sys.modules
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr


def test_the_trainer_callback_logs_through_the_trainers_loggers(tmp_path):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import osdn_diag.monitor as monitor

    class KernelsTrainer(Trainer):  # the training forward on the CPU's reference recurrence
        def compute_loss(self, model, inputs, *args, **kwargs):
            with _kernels(model):
                return super().compute_loss(model, inputs, *args, **kwargs)

    class Seen(TrainerCallback):  # stands for TensorBoard, W&B, CSV: what on_log hands every logger
        logs: list = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    data = [{"input_ids": row, "labels": row} for row in (torch.arange(16 * 8).reshape(8, 16) * 5 % VOCAB)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
                             logging_steps=2, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0)
    model = _tiny()
    seen = Seen()
    trainer = KernelsTrainer(model=model, args=args, train_dataset=data, callbacks=[seen])
    cb = monitor.MonitorCallback(trainer, PROBE, every=2, out=tmp_path)
    trainer.train()
    rows = cb.monitor.rows
    assert sorted({r["step"] for r in rows}) == [2, 4]
    logged = [x for x in seen.logs if "contraction/osdn/q_geo" in x]
    assert [x["contraction/osdn/q_geo"] for x in logged] == [r["q_geo"] for r in rows if r["layer"] == -1]
    history = [x for x in trainer.state.log_history if "contraction/osdn/q_geo" in x]
    assert [x["step"] for x in history] == [2, 4]
    # the Trainer's own logs at the steps the monitor probes are still written (its loggers get both)
    assert [x["step"] for x in trainer.state.log_history if "loss" in x] == [2, 4]
    assert sum("loss" in x and "learning_rate" in x for x in seen.logs) == 2
    assert monitor.read(tmp_path).num_rows == len(rows) == 6
    assert all(m.training for m in model.modules())


DDP_SCRIPT = """
import faulthandler, os, sys, json
import torch, torch.distributed as dist
import osdn_diag.models
sys.path.insert(0, {tests!r})
import test_monitor as t
from osdn_diag.monitor import Monitor

def main(rank):
    # a rank still alive after {stacks_after} s prints every thread's stack and exits: the test then fails
    # with where it hung (a hung rank once outlived the test's kill of its parent by 47 minutes)
    faulthandler.dump_traceback_later({stacks_after}, exit=True)
    # a file store, not a TCP port: a port picked free can be taken by another process before
    # rank 0 binds it, and the ranks then wait for each other forever
    dist.init_process_group("gloo", init_method="file://" + {store!r}, rank=rank, world_size=2)
    model = t._tiny()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    mon = Monitor(ddp, t.PROBE, every=2, out={out!r})
    got = []
    for step in range(1, 3):
        ids = torch.arange(32).reshape(2, 16) * (step + rank) % t.VOCAB
        with t._kernels(ddp):
            loss = ddp(input_ids=ids, labels=ids).loss
        opt.zero_grad(); loss.backward(); opt.step()
        got.append(mon.step(step) is not None)
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ws = [torch.zeros_like(w) for _ in range(2)]
    dist.all_gather(ws, w)
    print(json.dumps({{"rank": rank, "probed": got, "same": bool(torch.equal(ws[0], ws[1]))}}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # Out without running the destructors: a rank once hung for good after this function's last line,
    # its stack showing no Python frame below spawn's call of it (the DDP reducer's and gloo's C++
    # teardown as its locals were freed), with its result already printed. What this test checks is
    # done by here; the teardown is torch's.
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)

if __name__ == "__main__":
    torch.multiprocessing.spawn(main, nprocs=2)
"""


DDP_STACKS_AFTER = 240


def test_under_ddp_rank_0_probes_and_writes_and_rank_1_skips(tmp_path):
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT.format(tests=str(Path(__file__).parent), store=str(tmp_path / "store"),
                                         out=str(tmp_path / "out"), stacks_after=DDP_STACKS_AFTER))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    # Its own session, so that a timeout ends the ranks too, not only their parent. Alone it takes
    # about 25 s on the 2-core machine, about 60 s inside the suite; a rank that has not ended after
    # DDP_STACKS_AFTER s has hung (both ranks' results printed, one never exited: twice a 900 s wait in
    # fresh-clone runs), and ends itself printing its stacks, which the failure shows.
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=DDP_STACKS_AFTER + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the DDP script ran past {DDP_STACKS_AFTER + 60} s\nstdout:\n{stdout[-2000:]}\n"
                    f"stderr:\n{stderr[-6000:]}")
    finally:
        try:  # a rank left behind by a failure above
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert out.returncode == 0, out.stderr[-6000:]
    # both ranks print to one pipe, so their lines may interleave: read every object where it starts
    decoder, found = json.JSONDecoder(), []
    for start in [i for i in range(len(out.stdout)) if out.stdout.startswith('{"rank"', i)]:
        found.append(decoder.raw_decode(out.stdout, start)[0])
    res = {r["rank"]: r for r in found}
    assert res[0]["probed"] == [False, True]
    assert res[1]["probed"] == [False, False]
    assert res[0]["same"] and res[1]["same"]  # the replicas stayed in step
    import osdn_diag.monitor as monitor

    assert sorted(set(monitor.read(tmp_path / "out").column("step").to_pylist())) == [2]


def test_a_second_model_under_a_name_a_live_monitor_writes_to_the_same_file_is_refused(tmp_path, monkeypatch):
    import osdn_diag.monitor as monitor

    first = monitor.Monitor(_tiny(), PROBE, every=2, out=tmp_path)
    other = _tiny()
    with pytest.raises(ValueError, match="argument 'name'.*the default: the config's model_type.*own name="):
        monitor.Monitor(other, PROBE, every=2, out=tmp_path)
    monitor.Monitor(other, PROBE, every=2, out=tmp_path, name="second")  # its own name
    monitor.Monitor(other, PROBE, every=2, out=tmp_path / "elsewhere")  # its own file
    monitor.Monitor(other, PROBE, every=2)  # no file
    again = monitor.Monitor(first.model, PROBE, every=2, out=tmp_path)  # the same model again: takes over
    with pytest.raises(ValueError, match="under the name 'osdn'; each"):
        monitor.Monitor(other, PROBE, every=2, out=tmp_path / "monitor.parquet", name="osdn")
    again.close()  # a closed monitor gives its file and name up, though it lives on
    taken = monitor.Monitor(other, PROBE, every=2, out=tmp_path)
    with pytest.raises(ValueError, match="under the name 'osdn'"):
        monitor.Monitor(first.model, PROBE, every=2, out=tmp_path)
    del first, again, taken
    import gc

    gc.collect()
    # Released by the key it was claimed under, though the working directory changed in between.
    monkeypatch.chdir(tmp_path)
    relative = monitor.Monitor(other, PROBE, every=2, out="monitor.parquet", name="rel")
    monkeypatch.chdir(tmp_path.parent)
    relative.close()
    monitor.Monitor(_tiny(), PROBE, every=2, out=tmp_path / "monitor.parquet", name="rel")
    del relative

    gc.collect()
    monitor.Monitor(other, PROBE, every=2, out=tmp_path)  # the holders are gone
