"""Every user error of the console script: one line naming the argument or file and what to do, exit
status 2, no traceback — and quickly, before fla loads where the arguments alone show the error.

The table grows with each new case: (id, argv with {placeholders} for the fixture files, exit status,
a substring of the one-line message). The CLI runs in-process (:func:`osdn_diag.cli.entry`).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from osdn_diag.cli import entry

TINY = "random:deltanet-tiny"
RUN = ["run", TINY, "--prompts", "random", "--num-prompts", "1", "--length", "8", "-q"]

CASES = [
    ("length-0", [*RUN[:-3], "--length", "0", "--out", "{tmp}/o"], 2, "argument --length: expected an integer >= 1, got 0"),
    ("length-negative", [*RUN[:-3], "--length", "-5", "--out", "{tmp}/o"], 2, "expected an integer >= 1, got -5"),
    ("length-below-mqar", ["run", TINY, "--prompts", "mqar", "--length", "2", "--out", "{tmp}/o"], 2,
     "argument --length: expected an integer >= 4, got 2"),
    ("length-not-int", [*RUN, "--length", "abc", "--out", "{tmp}/o"], 2, "argument --length: invalid int value"),
    ("seed-huge", [*RUN, "--seed", "99999999999999999999999", "--out", "{tmp}/o"], 2,
     "argument --seed: expected a whole number 0 <= N < 2**64, got 99999999999999999999999"),
    ("seed-negative", ["demo", "--seed", "-1", "--out", "{tmp}/o"], 2, "argument --seed: expected a whole number"),
    ("num-prompts-0", [*RUN, "--num-prompts", "0", "--out", "{tmp}/o"], 2, "argument --num-prompts: expected an integer >= 1"),
    ("batch-size-0", [*RUN, "--batch-size", "0", "--out", "{tmp}/o"], 2, "argument --batch-size: expected an integer >= 1"),
    ("tolerance-nan", [*RUN, "--tolerance", "nan", "--out", "{tmp}/o"], 2, "argument --tolerance: expected a number > 0, got nan"),
    ("tolerance-0", [*RUN, "--tolerance", "0", "--out", "{tmp}/o"], 2, "argument --tolerance: expected a number > 0"),
    ("device-bogus", [*RUN, "--device", "bogus", "--out", "{tmp}/o"], 2, "argument --device: expected cpu, cuda or cuda:N"),
    ("out-is-a-file", [*RUN, "--out", "{file}"], 2, "is a file, not a directory"),
    ("out-empty", [*RUN, "--out", ""], 2, "argument --out: an empty path (an unset shell variable?)"),
    ("what-if-out-empty", ["what-if", "{tmp}", "--out", ""], 2, "argument --out: an empty path"),
    ("report-run-empty", ["report", ""], 2, "RUN: an empty path"),
    ("model-blank", ["run", " ", *RUN[2:], "--out", "{tmp}/o"], 2, "MODEL: an empty path; give"),
    ("out-under-a-file", [*RUN, "--out", "{file}/sub"], 2, "is a file, so no directory can be made under it"),
    ("unknown-preset", [*RUN, "--out", "{tmp}/o"][:1] + ["random:nope"] + RUN[2:] + ["--out", "{tmp}/o"], 2,
     "MODEL 'random:nope': unknown preset"),
    ("model-missing", ["run", "{tmp}/nomodel", *RUN[2:], "--out", "{tmp}/o"], 2, "no such directory"),
    ("prompts-missing", ["run", TINY, "--prompts", "{tmp}/none.jsonl", "--out", "{tmp}/o"], 2,
     "argument --prompts: '{tmp}/none.jsonl' is neither a built-in suite"),
    ("config-invalid-json", ["run", "{badconfig}", *RUN[2:], "--out", "{tmp}/o"], 2, "config.json is not valid JSON"),
    ("safetensors-truncated", ["run", "{truncated}", *RUN[2:], "--out", "{tmp}/o"], 2, "model.safetensors is truncated"),
    ("safetensors-garbage", ["run", "{garbage}", *RUN[2:], "--out", "{tmp}/o"], 2, "is not a readable safetensors file"),
    ("prove-json-dir", ["prove", "--json", "{tmp}"], 2, "argument --json '{tmp}': is a directory"),
    ("prove-json-missing-dir", ["prove", "--json", "{tmp}/no/such/ledger.json"], 2, "does not exist"),
    ("replay-missing-dir", ["replay", "{tmp}/nowhere", "-q"], 2, "DIR '{tmp}/nowhere': no such directory"),
    ("manifest-invalid", ["replay", "{badmanifest}", "-q"], 2, "manifest.json is not valid JSON"),
    ("summary-invalid", ["report", "{badsummary}"], 2, "summary.json: not valid JSON"),
    ("prompts-not-utf8", ["run", TINY, "--prompts", "{latin1}", "--out", "{tmp}/o", "-q"], 2,
     "latin1.jsonl:2: not UTF-8 text"),
    ("shard-truncated", ["replay", "{badshard}", "-q"], 2, "the shard was changed"),
    ("shape-mismatch", ["run", "{mismatch}", *RUN[2:], "--out", "{tmp}/o"], 2, "do not match the model"),
    ("what-if-eta-nan", ["what-if", "{badsummary}", "--eta", "nan"], 2, "argument --eta: expected a finite number"),
    ("what-if-eta-negative", ["what-if", "{badsummary}", "--eta", "-1", "--out", "{tmp}/o"], 2,
     "argument --eta: expected a step size >= 0, got -1.0"),
    ("what-if-box-reversed", ["what-if", "{badsummary}", "--d-min", "3", "--d-max", "1", "--out", "{tmp}/o"], 2,
     "expected 0 < d-min <= d-max"),
    ("what-if-box-without-1", ["what-if", "{badsummary}", "--d-min", "3", "--d-max", "4", "--out", "{tmp}/o"], 2,
     "arguments --d-min, --d-max: the box [3.0, 4.0] must contain 1"),
    ("what-if-d-min-negative", ["what-if", "{badsummary}", "--d-min", "-1", "--out", "{tmp}/o"], 2,
     "expected 0 < d-min <= d-max"),
    ("what-if-retention-2", ["what-if", "{badsummary}", "--retention", "2", "--out", "{tmp}/o"], 2,
     "argument --retention: expected a value in [0, 1]"),
    ("report-d-head-foo", ["report", "{badsummary}", "--d-head", "foo"], 2,
     "argument --d-head: expected LAYER.HEAD (e.g. 3.1), got 'foo'"),
    ("report-two-runs-no-out", ["report", "{badsummary}", "{badsummary}"], 2,
     "argument --out: required when comparing 2 runs"),
    ("report-labels-count", ["report", "{badsummary}", "{badsummary}", "--labels", "a", "--out", "{tmp}/o"], 2,
     "argument --labels: one label per run: 2 run(s), 1 label(s) given"),
    ("run-out-in-a-capture", [*RUN, "--out", "{badsummary}/capture/o"], 2, "inside the files of the run"),
    # Inputs that ended in tracebacks, some after the run directory existed (issue 44, item 8).
    ("text-empty", ["run", "{tokmodel}", "--prompts", "{emptytext}", "--out", "{tmp}/o", "-q"], 2,
     "emptytext.jsonl:2: field 'text' has no tokens"),
    ("text-beyond-vocab", ["run", "{tokmodel}", "--prompts", "{text}", "--out", "{tmp}/o", "-q"], 2,
     "text.jsonl:1: field 'text' tokenizes to ids outside the model's vocabulary [0, 256)"),
    ("prompts-nested-deeply", ["run", TINY, "--prompts", "{deep}", "--out", "{tmp}/o", "-q"], 2,
     "deep.jsonl:1: JSON nested too deeply"),
    ("task-too-long", ["run", TINY, "--prompts", "{longtask}", "--out", "{tmp}/o", "-q"], 2,
     "longtask.jsonl:1: field 'task' is 1,000 characters long"),
    # A name in another encoding (byte 0xff: a lone surrogate in Python) failed after the capture, where
    # pyarrow took it as a path or stored it as the task name: refused first, naming the argument.
    ("out-not-utf8", [*RUN, "--out", "{tmp}/o\udcffx"], 2, "argument --out '{tmp}/o\\udcffx': not valid UTF-8"),
    ("prompts-name-not-utf8", ["run", TINY, "--prompts", "{tmp}/bad\udcffname.jsonl", "--out", "{tmp}/o", "-q"], 2,
     "argument --prompts '{tmp}/bad\\udcffname.jsonl': not valid UTF-8"),
    ("report-run-not-utf8", ["report", "{tmp}/r\udcff"], 2, "RUN '{tmp}/r\\udcff': not valid UTF-8"),
    ("task-lone-surrogate", ["run", TINY, "--prompts", "{surrogatetask}", "--out", "{tmp}/o", "-q"], 2,
     "surrogatetask.jsonl:1: field 'task' 'a\\udcffb' holds a lone surrogate"),
    ("config-heads-0", ["run", "{heads0}", *RUN[2:], "--out", "{tmp}/o"], 2,
     "config.json: num_heads must be a positive integer of at most 4,096, got 0"),
    ("config-hidden-negative", ["run", "{hiddenneg}", *RUN[2:], "--out", "{tmp}/o"], 2,
     "hidden_size must be a positive integer of at most 131,072, got -5"),
    ("config-hidden-str", ["run", "{hiddenstr}", *RUN[2:], "--out", "{tmp}/o"], 2,
     "hidden_size must be a positive integer, got 'abc'"),
    ("config-hidden-float", ["run", "{hiddenfloat}", *RUN[2:], "--out", "{tmp}/o"], 2,
     "hidden_size must be a positive integer, got 1000000000.0"),
    ("config-layers-million", ["run", "{layers}", *RUN[2:], "--out", "{tmp}/o"], 2,
     "num_hidden_layers must be a positive integer of at most 4,096, got 1,000,000"),
    ("config-nested-deeply", ["run", "{deepconfig}", *RUN[2:], "--out", "{tmp}/o"], 2,
     "config.json is JSON nested too deeply"),
    ("momentum-ragged-batch", ["run", "random:momentum-deltanet-tiny", "--prompts", "{ragged}", "--batch-size", "3",
                               "--out", "{tmp}/o", "-q"], 2,
     "argument --batch-size: MomentumDeltaNet takes no attention mask"),
    ("length-huge", [*RUN[:-3], "--length", "1000000000000", "--out", "{tmp}/o"], 2,
     "argument --length: 1,000,000,000,000 tokens per prompt is more than the 1,048,576"),
    ("num-prompts-huge", [*RUN, "--num-prompts", "100000000000", "--out", "{tmp}/o"], 2,
     "argument --num-prompts: 100,000,000,000 prompts is more than"),
    ("suite-tokens-huge", [*RUN, "--num-prompts", "1000000", "--length", "1000", "--out", "{tmp}/o"], 2,
     "arguments --num-prompts, --length: 1,000,000 × 1,000 = 1,000,000,000 tokens"),
]
if not torch.cuda.is_available():
    CASES.append(("device-cuda-without-gpu", [*RUN, "--device", "cuda", "--out", "{tmp}/o"], 2, "sees no CUDA GPU"))
if os.geteuid() != 0:  # root writes anywhere
    CASES.append(("out-read-only", [*RUN, "--out", "{readonly}/o"], 2, "is not writable"))
if os.path.isdir("/proc/self"):  # a file system where even root makes no directory
    CASES.append(("out-in-proc", [*RUN, "--out", "/proc/osdn-diag-x/o"], 2,
                  "argument --out '/proc/osdn-diag-x/o': no directory can be made in '/proc'"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from safetensors.torch import save_file

    from osdn_diag.capture import CaptureWriter, KernelCall
    from osdn_diag.models import load_model

    tmp = tmp_path_factory.mktemp("cli-errors")
    (tmp / "a-file").write_text("x")
    model = tmp / "model"
    load_model(TINY, seed=0).model.save_pretrained(model)
    weights = (model / "model.safetensors").read_bytes()
    config = json.loads((model / "config.json").read_text())

    def model_dir(name, config_text, weight_bytes):
        d = tmp / name
        d.mkdir()
        (d / "config.json").write_text(config_text)
        (d / "model.safetensors").write_bytes(weight_bytes)
        return d

    paths = {
        "tmp": tmp, "file": tmp / "a-file",
        "badconfig": model_dir("badconfig", '{"model_type": "delta_net",', weights),
        "truncated": model_dir("truncated", json.dumps(config), weights[: len(weights) // 2]),
        "garbage": model_dir("garbage", json.dumps(config), b"\xff" * 64),
        "mismatch": model_dir("mismatch", json.dumps({**config, "intermediate_size": 128}), weights),
    }
    for name, change in (("heads0", {"num_heads": 0}), ("hiddenneg", {"hidden_size": -5}),
                         ("hiddenstr", {"hidden_size": "abc"}), ("hiddenfloat", {"hidden_size": 1e9}),
                         ("layers", {"num_hidden_layers": 10**6})):
        paths[name] = model_dir(name, json.dumps({**config, **change}), weights)
    paths["deepconfig"] = model_dir("deepconfig", "[" * 200_000 + "]" * 200_000, weights)
    # The tiny model with the built-in language models' tokenizer (4096 tokens, the model has 256).
    from osdn_diag.catalog import builtin_path

    tokmodel = model_dir("tokmodel", json.dumps(config), weights)
    for f in builtin_path("lm-deltanet").glob("tokenizer*"):
        (tokmodel / f.name).write_bytes(f.read_bytes())
    paths["tokmodel"] = tokmodel
    for name, text in (("emptytext", '{"input_ids": [1, 2]}\n{"text": ""}\n'),
                       ("text", '{"text": "the quick brown fox jumps over the lazy dog"}\n'),
                       ("deep", "[" * 200_000 + "]" * 200_000 + "\n"),
                       ("longtask", json.dumps({"input_ids": [1, 2], "task": "x" * 1000}) + "\n"),
                       ("surrogatetask", json.dumps({"input_ids": [1, 2], "task": "a\udcffb"}) + "\n"),
                       ("ragged", "".join(json.dumps({"input_ids": list(range(1, n))}) + "\n" for n in (5, 9, 7)))):
        (tmp / f"{name}.jsonl").write_text(text)
        paths[name] = tmp / f"{name}.jsonl"
    (tmp / "bad\udcffname.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')  # a file name with byte 0xff
    latin1 = tmp / "latin1.jsonl"
    latin1.write_bytes(b'{"input_ids": [1, 2, 3]}\n{"text": "caf\xe9"}\n')
    paths["latin1"] = latin1
    # A capture directory (synthetic, one call) for replay/report errors.
    run = tmp / "run"
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 1, 4, generator=gen) for _ in range(3))
    w = CaptureWriter(run)
    w.begin({"model": {"spec": "synthetic"}, "prompts": [{"id": 0, "task": "a", "length": 6, "repeat_start": -1}]})
    w.write(0, [0], KernelCall(layer=0, layer_name="l0", family="delta_rule", kernel="x", q=q, k=k, v=v,
                               beta=torch.rand(1, 6, 1, generator=gen), o=torch.zeros(1, 6, 1, 4), scale=0.5))
    w.finish()
    for name in ("badmanifest", "badsummary", "badshard"):
        import shutil

        shutil.copytree(run, tmp / name)
        paths[name] = tmp / name
    (tmp / "badmanifest" / "manifest.json").write_text("{not json")
    from osdn_diag.pipeline import replay_run

    replay_run(tmp / "badsummary", progress=False, tolerance=float("inf"))  # replayed, then damaged
    (tmp / "badsummary" / "summary.json").write_text("{not json")
    shard = next((tmp / "badshard").rglob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    save_file  # noqa: B018 - imported to fail early if safetensors is missing
    readonly = tmp / "readonly"
    readonly.mkdir(mode=0o555)
    paths["readonly"] = readonly
    return paths


@pytest.mark.parametrize("argv, status, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_user_error_is_one_line(files, capsys, argv, status, message):
    argv = [a.format(**files) for a in argv]
    assert entry(argv) == status
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("osdn-diag: error: "), err
    assert message.format(**files) in lines[0]
    assert not (files["tmp"] / "o").exists()  # nothing half-written
    assert not (files["tmp"] / "o\udcffx").exists()


def test_debug_shows_the_traceback(files):
    from osdn_diag.cli.checks import UsageError

    with pytest.raises(UsageError, match="--length"):
        entry([*RUN, "--length", "0", "--out", str(files["tmp"] / "o"), "--debug"])


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys, files):
    from osdn_diag.cli import commands

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "_cmd_report", interrupted)
    assert entry(["report", str(files["badsummary"])]) == 130
    out, err = capsys.readouterr()
    assert err.strip() == "osdn-diag: interrupted" and "Traceback" not in out + err


def test_a_system_exit_with_a_message_is_one_line_and_status_2(monkeypatch, capsys, files):
    from osdn_diag.cli import commands

    def exits(args):
        raise SystemExit("something the user gave\ncannot be used")

    monkeypatch.setattr(commands, "_cmd_report", exits)
    assert entry(["report", str(files["badsummary"])]) == 2
    out, err = capsys.readouterr()
    assert err == "osdn-diag: error: something the user gave cannot be used\n" and not out


@pytest.mark.parametrize("settings", [{"eta": -1.0}, {"d_min": 3.0, "d_max": 1.0}, {"d_min": -1.0},
                                      {"d_min": 0.0}, {"d_max": float("inf")}, {"retention": 1.5},
                                      {"d_min": 3.0, "d_max": 4.0}, {"d_min": 1e-320, "d_max": 1e-320}])
def test_what_if_settings_are_checked_when_made(settings):
    from osdn_diag.whatif import WhatIf

    with pytest.raises(ValueError, match="argument"):
        WhatIf(**settings)


def test_version(capsys):
    """``--version``: one line naming this package's version and fla's (from the installed metadata)."""
    from importlib.metadata import version

    import osdn_diag

    assert entry(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(f"osdn-diag {osdn_diag.__version__} (")
    assert f"flash-linear-attention {version('flash-linear-attention')}" in out


def test_an_environment_fla_cannot_be_interpreted_in_is_one_line(tmp_path):
    """A run on the CPU where Triton's interpreter cannot be switched on — here triton was imported
    before ``TRITON_INTERPRET=1`` (a triton too old for the interpreter fails the same way) — is
    refused in one line naming what to do, exit status 2, no traceback."""
    import subprocess
    import sys

    code = ("import sys, triton\n"
            "from osdn_diag.cli import entry\n"
            f"sys.exit(entry(['run', 'random:deltanet-tiny', '--prompts', 'random', '--num-prompts', '1', "
            f"'--length', '8', '--device', 'cpu', '--out', {str(tmp_path / 'o')!r}, '-q']))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("osdn-diag: error:")]
    assert len(lines) == 1 and "TRITON_INTERPRET=1" in lines[0] and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("via_link", [False, True])
def test_a_fifo_or_device_given_as_an_output_file_is_one_line(tmp_path, capsys, via_link):
    """``prove --json /dev/null`` (or ``/dev/stdout``, a FIFO) replaced the device with a regular file
    after the ledger ran (as root: /dev/null itself); refused up front, naming it, exit 2 (issue 44)."""
    import stat

    from osdn_diag.cli import entry

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    target = fifo
    if via_link:
        target = tmp_path / "stdout"
        target.symlink_to(fifo)
    assert entry(["prove", "-q", "--json", str(target)]) == 2
    err = capsys.readouterr().err
    # A link is refused as a link, as view --out refuses one (never written through nor replaced).
    problem = "a symbolic link" if via_link else "not a regular file"
    assert err.startswith(f"osdn-diag: error: argument --json {str(target)!r}: {problem}"), err
    assert err.count("\n") == 1 and stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("case", ["link", "run-file", "in-capture"])
def test_prove_json_follows_view_outs_rules(tmp_path, capsys, case):
    """``prove --json`` writes its ledger as ``view --out`` writes its page: a symbolic link there is
    refused, not replaced by a regular file; one of a run's own files (or a path among them) is refused,
    not overwritten — before the ledger runs."""
    from osdn_diag.cli import entry

    run = tmp_path / "run"
    (run / "capture").mkdir(parents=True)
    (run / "manifest.json").write_text('{"run_id": "%s", "stages": {"capture": true}}' % ("a" * 32))
    (run / "summary.json").write_text("{}")
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    target = {"link": tmp_path / "ledger.json", "run-file": run / "summary.json",
              "in-capture": run / "capture" / "ledger.json"}[case]
    if case == "link":
        target.symlink_to(victim)
    assert entry(["prove", "-q", "--json", str(target)]) == 2
    err = capsys.readouterr().err
    want = {"link": "a symbolic link", "run-file": "one of the files of the run",
            "in-capture": "inside capture/ of the run"}[case]
    assert err.startswith("osdn-diag: error: argument --json ") and want in err and err.count("\n") == 1, err
    if case == "link":
        assert target.is_symlink()
    assert victim.read_text() == "mine" and (run / "summary.json").read_text() == "{}"
    assert not (run / "capture" / "ledger.json").exists()
