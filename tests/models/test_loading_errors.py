"""A model directory loads exactly what it holds, or not at all.

* Weights: a ``model.safetensors`` with tensors missing, unexpected or of the wrong shape is refused
  (``from_pretrained`` would otherwise leave those parameters at their random initialisation, and a
  run on that model would look like a run on the checkpoint). Tied weights and non-persistent
  buffers, which a checkpoint does not hold, are not missing.
* Code: a directory that asks for its own code (``auto_map`` in ``config.json``), or names a
  ``model_type`` no installed library provides, is refused before anything from it is imported.

Models are the ``random:deltanet-tiny`` preset saved to a temporary directory (tens of kB) and the
built-ins.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from osdn_diag.models import load_model

PRESET = "random:deltanet-tiny"
Q_PROJ = "model.layers.0.attn.q_proj.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory, fla_kernels):
    """``random:deltanet-tiny`` saved by ``save_pretrained``: config.json and model.safetensors."""
    directory = tmp_path_factory.mktemp("deltanet-tiny")
    load_model(PRESET).model.save_pretrained(directory, safe_serialization=True)
    return directory


def _tensors(directory):
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


def _variant(saved, tmp_path, edit):
    """A copy of ``saved`` whose weights ``edit(tensors)`` has changed."""
    from safetensors.torch import save_file

    shutil.copy(saved / "config.json", tmp_path / "config.json")
    tensors = _tensors(saved)
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return str(tmp_path)


def test_a_saved_preset_loads_with_its_own_weights(saved):
    loaded = load_model(str(saved))
    want = _tensors(saved)
    got = loaded.model.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[name], want[name]) for name in want)


@pytest.mark.parametrize("name", ["mqar-deltanet", "mqar-osdn", "mqar-osdn-apf"])
def test_the_builtins_still_load(name, fla_kernels):
    assert load_model(f"builtin:{name}").source == "builtin"


def test_missing_tensors_are_named_and_counted(saved, tmp_path):
    def drop(tensors):
        for name in [n for n in tensors if n.startswith("model.layers.1.")]:
            del tensors[name]

    spec = _variant(saved, tmp_path, drop)
    dropped = sorted(n for n in _tensors(saved) if n.startswith("model.layers.1."))
    with pytest.raises(ValueError) as err:
        load_model(spec)
    msg = str(err.value)
    assert msg.startswith(f"MODEL {spec!r}: ") and "\n" not in msg
    assert f"{len(dropped)} tensors missing from the file ({dropped[0]}, " in msg
    assert f"and {len(dropped) - 3} more)" in msg  # a few names, then the count
    assert "safetensors" in msg and "random" in msg


def test_unexpected_tensors_are_named(saved, tmp_path):
    spec = _variant(saved, tmp_path, lambda t: t.update({"model.extra.weight": torch.zeros(3)}))
    unexpected = r"^MODEL .*: 1 tensor in the file but not in the model \(model\.extra\.weight\)"
    with pytest.raises(ValueError, match=unexpected):
        load_model(spec)


def test_mismatched_shapes_are_named(saved, tmp_path):
    spec = _variant(saved, tmp_path, lambda t: t.update({Q_PROJ: torch.zeros(3, 3)}))
    with pytest.raises(ValueError) as err:
        load_model(spec)
    msg = str(err.value)
    assert msg.startswith(f"MODEL {spec!r}: ") and "1 tensor of the wrong shape" in msg
    assert f"{Q_PROJ} [3, 3] in the file, [64, 64] in the model" in msg


def test_a_wrong_shape_with_more_values_is_named_by_the_loading_report(saved, tmp_path):
    """A tensor larger than the model's (the file holds enough values: nothing is refused before the
    load) is named by from_pretrained's loading report."""
    spec = _variant(saved, tmp_path, lambda t: t.update({Q_PROJ: torch.zeros(128, 64)}))
    with pytest.raises(ValueError, match=rf"1 tensor of the wrong shape \({Q_PROJ} \[128, 64\] in the file, "
                                         r"\[64, 64\] in the model\)"):
        load_model(spec)


def test_a_tensor_missing_beside_an_unexpected_one_of_its_size_is_named(saved, tmp_path):
    """As many values as the model has, one tensor under another name: from_pretrained's loading
    report names both."""
    def rename(tensors):
        tensors["model.extra.weight"] = tensors.pop(Q_PROJ)

    spec = _variant(saved, tmp_path, rename)
    with pytest.raises(ValueError) as err:
        load_model(spec)
    msg = str(err.value)
    assert f"1 tensor missing from the file ({Q_PROJ})" in msg
    assert "1 tensor in the file but not in the model (model.extra.weight)" in msg


def test_tied_weights_are_not_missing(saved, tmp_path, fla_kernels):
    """With tied embeddings save_pretrained writes the shared matrix once (no lm_head.weight)."""
    from fla.models import DeltaNetConfig
    from transformers import AutoModelForCausalLM

    config = json.loads((saved / "config.json").read_text())
    config.pop("model_type", None)
    model = AutoModelForCausalLM.from_config(DeltaNetConfig(**{**config, "tie_word_embeddings": True}))
    assert model.lm_head.weight is model.model.embeddings.weight
    model.save_pretrained(tmp_path, safe_serialization=True)
    assert "lm_head.weight" not in _tensors(tmp_path)
    loaded = load_model(str(tmp_path)).model
    assert loaded.lm_head.weight is loaded.model.embeddings.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("persistent", [False, True])
def test_buffers_count_only_when_the_checkpoint_should_hold_them(saved, monkeypatch, persistent):
    """A non-persistent buffer is not in a state dict, so not missing; a persistent one is."""
    from fla.models import DeltaNetForCausalLM

    init = DeltaNetForCausalLM.__init__

    def with_buffer(self, config, *args, **kwargs):
        init(self, config, *args, **kwargs)
        self.register_buffer("scratch", torch.zeros(3), persistent=persistent)

    monkeypatch.setattr(DeltaNetForCausalLM, "__init__", with_buffer)
    if persistent:
        with pytest.raises(ValueError, match=r"1 tensor missing from the file \(scratch\)"):
            load_model(str(saved))
    else:
        assert hasattr(load_model(str(saved)).model, "scratch")


# --- no code from the model directory -------------------------------------------------------------

EVIL = """
from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import PretrainedConfig
class EvilConfig(PretrainedConfig):
    model_type = "evil"
"""


def _remote_code_dir(saved, tmp_path, **config_changes):
    """``saved`` plus a ``modeling_evil.py`` that writes a marker file when imported."""
    directory = tmp_path / "model"
    shutil.copytree(saved, directory)
    marker = tmp_path / "marker"
    (directory / "modeling_evil.py").write_text(EVIL.format(marker=str(marker)))
    config = json.loads((directory / "config.json").read_text())
    config.update(config_changes)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory), marker


AUTO_MAP = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}


@pytest.mark.parametrize("model_type", ["evil", "delta_net"])
def test_a_directory_asking_for_its_own_code_is_refused(saved, tmp_path, model_type):
    spec, marker = _remote_code_dir(saved, tmp_path, model_type=model_type, auto_map=AUTO_MAP)
    with pytest.raises(ValueError) as err:
        load_model(spec)
    msg = str(err.value)
    assert msg.startswith(f"MODEL {spec!r}: ") and "\n" not in msg
    assert "auto_map" in msg and "never" in msg
    assert not marker.exists()


def test_a_tokenizer_asking_for_its_own_code_is_refused(saved, tmp_path):
    spec, marker = _remote_code_dir(saved, tmp_path)
    (tmp_path / "model" / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["modeling_evil.EvilTokenizer", None]}}))
    with pytest.raises(ValueError, match=r"^MODEL .*tokenizer_config\.json.*auto_map"):
        load_model(spec)
    assert not marker.exists()


def test_an_unknown_model_type_is_refused(saved, tmp_path):
    spec, marker = _remote_code_dir(saved, tmp_path, model_type="evil")
    with pytest.raises(ValueError, match=r"^MODEL .*model_type 'evil'.*never"):
        load_model(spec)
    assert not marker.exists()


def test_from_pretrained_is_never_asked_to_trust_remote_code(saved, monkeypatch):
    """Every load in the package passes trust_remote_code=False explicitly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seen = []
    for cls in (AutoModelForCausalLM, AutoTokenizer):
        original = cls.from_pretrained

        def spy(*args, _original=original, **kwargs):
            seen.append(kwargs.get("trust_remote_code", "unset"))
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", spy)
    load_model(str(saved))
    from osdn_diag.pipeline.inputs import _tokenizer

    assert _tokenizer(_with_tokenizer(saved))("a b a") == [0, 1, 0]
    assert seen == [False, False]


def _with_tokenizer(saved):
    """``saved`` plus a two-word tokenizer of its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory = saved.parent / "with-tokenizer"
    if not directory.exists():
        shutil.copytree(saved, directory)
        tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)
    return directory


def _spy_from_pretrained(monkeypatch) -> list:
    """Calls of transformers' ``from_pretrained`` from now on (each its path)."""
    from transformers import AutoModelForCausalLM

    calls, original = [], AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        calls.append(args[0] if args else None)
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    return calls


@pytest.mark.parametrize("change", [
    {"attn_implementation": "evilorg/evil"},  # a Hub kernel: imported from the cache offline
    {"attn_implementation": "evilorg/evil@main:fn"},
    {"attn_implementation": {"": "sdpa", "text_config": "evilorg/evil"}},
    {"text_config": {"attn_implementation": "evilorg/evil"}},
    {"experts_implementation": "sonicmoe"},  # torch's own grouped_mm aside, a Hub kernel
    {"attn_implementation": 7},
])
def test_an_implementation_chosen_by_the_config_is_refused(saved, tmp_path, monkeypatch, change):
    """transformers 5 reads ``attn_implementation`` / ``experts_implementation`` from config.json and
    loads a named Hub kernel's code (from the user's cache, offline): refused before transformers
    sees the directory."""
    spec, _ = _remote_code_dir(saved, tmp_path, **change)
    calls = _spy_from_pretrained(monkeypatch)
    with pytest.raises(ValueError) as err:
        load_model(spec)
    msg = str(err.value)
    assert msg.startswith(f"MODEL {spec!r}: ") and "config.json sets" in msg and "never runs code" in msg
    assert "\n" not in msg
    assert calls == []


@pytest.mark.parametrize("change", [{"attn_implementation": "eager"},
                                    {"attn_implementation": {"": "eager"}},
                                    {"attn_implementation": None}])
def test_built_in_implementations_load(saved, tmp_path, change):
    spec, _ = _remote_code_dir(saved, tmp_path, **change)
    assert load_model(spec).model is not None


@pytest.mark.parametrize("kind", [torch.int8, torch.bool, torch.int64])
def test_integer_or_boolean_weights_are_refused(saved, tmp_path, kind):
    """A float parameter stored as integers or booleans would be cast silently (a bool checkpoint
    measured as 0/1 weights): refused, naming the tensor."""
    def edit(tensors):
        tensors[Q_PROJ] = tensors[Q_PROJ].to(kind)

    spec = _variant(saved, tmp_path, edit)
    with pytest.raises(ValueError, match=rf"^MODEL .*1 tensor .*{Q_PROJ} \(\w+ in model\.safetensors\).*floating"):
        load_model(spec)


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_a_quantization_config_is_refused_before_transformers_sees_it(saved, tmp_path, monkeypatch, where):
    """transformers quantizes or dequantizes by the config's method, some of them with Hub kernels."""
    qc = {"quant_method": "mxfp4"}
    spec, _ = _remote_code_dir(saved, tmp_path, **({"quantization_config": qc} if where == "top"
                                                   else {"text_config": {"quantization_config": qc}}))
    calls = _spy_from_pretrained(monkeypatch)
    with pytest.raises(ValueError, match=r"^MODEL .*config\.json has a quantization_config"):
        load_model(spec)
    assert calls == []


def test_a_null_quantization_config_and_builtin_implementations_pass_the_check():
    """Only a quantization that would run is refused: ``"quantization_config": null`` (no quantization),
    and implementations of transformers and torch, at any depth, pass."""
    from osdn_diag.models.loading import _check_implementations

    _check_implementations("m", "m/config.json", {
        "quantization_config": None, "attn_implementation": "sdpa",
        "text_config": {"quantization_config": None, "experts_implementation": {"moe": "grouped_mm"}}})
    with pytest.raises(ValueError, match=r"^MODEL 'm': m/config.json has a quantization_config"):
        _check_implementations("m", "m/config.json", {"text_config": {"quantization_config": {}}})


def test_weights_of_a_quantized_float_format_are_refused_before_loading(saved, tmp_path, monkeypatch):
    def edit(tensors):
        tensors[Q_PROJ] = tensors[Q_PROJ].to(torch.float8_e4m3fn)

    spec = _variant(saved, tmp_path, edit)
    calls = _spy_from_pretrained(monkeypatch)
    with pytest.raises(ValueError, match=rf"^MODEL .*1 tensor .*of a quantized format \({Q_PROJ} \(F8_E4M3"):
        load_model(spec)
    assert calls == []


def test_flash_attention_where_transformers_would_fetch_a_hub_kernel_is_refused(saved, tmp_path):
    """Without a flash-attn package transformers serves (none on this CPU), ``flash_attention_2``
    would load ``kernels-community/flash-attn2`` from the Hub."""
    from transformers.modeling_flash_attention_utils import FLASH_ATTENTION_COMPATIBILITY_MATRIX

    if FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]["general_availability_check"]():
        pytest.skip("flash-attn 2 is installed and usable here: transformers would run it, not a Hub kernel")
    spec, _ = _remote_code_dir(saved, tmp_path, attn_implementation="flash_attention_2")
    with pytest.raises(ValueError, match="flash_attention_2"):
        load_model(spec)


@pytest.mark.parametrize("change", [{"num_heads": 3}, {"expand_v": -1}, {"attn_mode": "evil"},
                                    {"qk_norm": "evil"}, {"model_type": "llama"}])
def test_a_config_the_model_cannot_be_built_from_is_refused_naming_it(saved, tmp_path, change):
    # The model classes assert, or fail deep in torch, on values the size checks let through.
    shutil.copy(saved / "model.safetensors", tmp_path / "model.safetensors")
    config = json.loads((saved / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=r"config\.json describes could not be built .*repair config\.json"):
        load_model(str(tmp_path))


def _refuse_from_pretrained(monkeypatch):
    """``from_pretrained`` fails the test if reached: the refusal must come before any allocation."""
    from transformers import AutoModelForCausalLM

    def reached(*args, **kwargs):
        raise AssertionError("from_pretrained was reached: the model was about to be allocated")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", reached)


def test_weights_too_few_for_the_config_are_refused_before_the_model_is_allocated(saved, tmp_path, monkeypatch):
    """A config.json of 64 layers beside two layers' weights (a config that names only its model_type
    builds a default size as large: Llama's 6.7 B parameters): refused from the meta-device model,
    naming the parameters the file lacks, before from_pretrained allocates and initialises it."""
    shutil.copy(saved / "model.safetensors", tmp_path / "model.safetensors")
    config = json.loads((saved / "config.json").read_text())
    layers = config["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 64}))
    _refuse_from_pretrained(monkeypatch)
    with pytest.raises(ValueError) as err:
        load_model(str(tmp_path))
    msg = str(err.value)
    assert msg.startswith(f"MODEL {str(tmp_path)!r}: the *.safetensors weights in ") and "\n" not in msg
    per_layer = sum(1 for n in _tensors(saved) if n.startswith("model.layers.0."))
    absent = (64 - layers) * per_layer
    first = min(f"model.layers.{i}." for i in range(layers, 64))  # names sort as strings
    assert f"{absent} tensors missing from the file ({first}" in msg
    assert f"and {absent - 3} more)" in msg and "random initialisation" in msg


def test_a_model_larger_than_the_free_memory_is_refused_naming_both_sizes(saved, monkeypatch):
    """Weights that fill the model but a device without the memory for it: refused before
    from_pretrained with the parameter count, the bytes in the dtype asked for and the bytes free."""
    import osdn_diag.runtime.memory as memory

    count = sum(t.numel() for name, t in _tensors(saved).items())
    monkeypatch.setattr(memory, "available_bytes", lambda device: 4 * count - 1)
    _refuse_from_pretrained(monkeypatch)
    with pytest.raises(ValueError) as err:
        load_model(str(saved))
    msg = str(err.value)
    assert msg.startswith(f"MODEL {str(saved)!r}: the model {saved / 'config.json'} describes has {count:,} "
                          "parameters, ") and "\n" not in msg
    assert f"{memory.gib(4 * count)} in float32, more than the {memory.gib(4 * count - 1)} free on cpu" in msg
    assert "load it in bfloat16 (--dtype bfloat16) or on a device with more free memory" in msg
    assert "--device-map" not in msg  # one CPU: nothing to spread over
    # in bf16 the same parameters take half: short of that, refused without advising bf16 again ...
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2 * count - 1)
    with pytest.raises(ValueError, match=r"in bfloat16, more than .* free on cpu; not built, .*: load it on a "
                                         r"device with more free memory$"):
        load_model(str(saved), dtype=torch.bfloat16)
    # ... and with that, they fit, and the model loads as from_pretrained loads it
    monkeypatch.undo()
    monkeypatch.setattr(memory, "available_bytes", lambda device: 2 * count)
    assert load_model(str(saved), dtype=torch.bfloat16).model.dtype == torch.bfloat16


def test_buffers_count_toward_the_memory_a_model_needs(tmp_path, monkeypatch):
    """GPT-Neo keeps a causal mask of its context length in each layer: at 2,048 positions, 4 MiB a
    layer beside a few thousand parameters. Memory for the parameters but not the masks is refused,
    naming the buffers."""
    import osdn_diag.runtime.memory as memory
    from transformers import AutoModelForCausalLM, GPTNeoConfig

    config = GPTNeoConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, max_position_embeddings=2048,
                          attention_types=[[["global"], 2]], intermediate_size=32)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, safe_serialization=True)
    count = sum(t.numel() for t in _tensors(tmp_path).values())
    masks = 2 * 2048 * 2048  # bool, one a layer
    monkeypatch.setattr(memory, "available_bytes", lambda device: 4 * count + masks - 1)
    with pytest.raises(ValueError, match=rf"{count:,} parameters, .* in float32 and {memory.gib(masks)} of buffers"):
        load_model(str(tmp_path))
    monkeypatch.setattr(memory, "available_bytes", lambda device: 4 * count + masks)
    assert load_model(str(tmp_path)).source == "directory"


def test_free_host_memory_is_meminfo_within_the_cgroup_limit(tmp_path):
    from osdn_diag.runtime.memory import _host_available, available_bytes

    G = 2**30
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   10000000 kB\nSwapFree:        1000000 kB\n")
    host = 11_000_000 * 1024
    cgroup, own = tmp_path / "cgroup", tmp_path / "self_cgroup"
    cgroup.mkdir()
    own.write_text("0::/\n")

    def files(folder, **values):
        folder.mkdir(parents=True, exist_ok=True)
        for name, value in values.items():
            (folder / name.replace("_", ".", 1)).write_text(f"{value}\n")

    assert _host_available(meminfo, cgroup, own) == host  # no cgroup files: the host's
    files(cgroup, memory_max="max", memory_current=123)
    assert _host_available(meminfo, cgroup, own) == host  # no limit
    files(cgroup, memory_max=4 * G, memory_current=G)
    assert _host_available(meminfo, cgroup, own) == 3 * G  # a container's limit, its cgroup the root
    # the page cache the kernel can drop is not used memory (a checkpoint just copied in fills it)
    (cgroup / "memory.stat").write_text(f"anon 1\ninactive_file {G // 2}\nactive_file 7\n")
    assert _host_available(meminfo, cgroup, own) == 3 * G + G // 2
    # Slurm / a systemd slice: the limit is on the process's own cgroup and those above it, not the root
    own.write_text("0::/job.slice/step_0\n")
    files(cgroup / "job.slice" / "step_0", memory_max=8 * G, memory_current=5 * G)
    files(cgroup / "job.slice", memory_max="max", memory_current=5 * G)
    assert _host_available(meminfo, cgroup, own) == 3 * G  # the root's 3.5 GiB and the step's 3 GiB
    files(cgroup / "job.slice", memory_max=6 * G)
    assert _host_available(meminfo, cgroup, own) == G  # the slice above it leaves 1 GiB
    own.write_text("0::/elsewhere\n")  # a cgroup the mount does not show (a namespace): the root's
    assert _host_available(meminfo, cgroup, own) == 3 * G + G // 2
    # cgroup v1: the memory controller's own tree, its limit and usage files
    v1, own1 = tmp_path / "v1", tmp_path / "self_cgroup_v1"
    own1.write_text("12:cpu,cpuacct:/x\n4:memory:/process_api/abc\n")
    files(v1 / "memory", memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=G)
    files(v1 / "memory" / "process_api" / "abc", memory_limit_in_bytes=2 * G, memory_usage_in_bytes=G)
    (v1 / "memory" / "process_api" / "abc" / "memory.stat").write_text(f"cache 9\ntotal_inactive_file {G // 4}\n")
    assert _host_available(meminfo, v1, own1) == G + G // 4
    assert _host_available(tmp_path / "absent", cgroup, own) is None
    free = available_bytes(torch.device("cpu"))
    assert free is None or free > 0
