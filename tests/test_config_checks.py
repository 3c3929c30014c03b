"""The size fields of a model's config.json (:mod:`osdn_diag.runtime.config_checks`): absent or null, or a
positive integer within its bound; a multimodal config's ``text_config`` checked alike."""

from __future__ import annotations

import pytest

from osdn_diag.runtime.config_checks import SIZE_FIELDS, check_config


@pytest.mark.parametrize("value", [None, 1, SIZE_FIELDS["num_heads"]])
def test_absent_null_and_positive_sizes_within_the_bound_pass(value):
    check_config("m", {"num_heads": value, "hidden_size": 64}, "m/config.json")
    check_config("m", {}, "m/config.json")


@pytest.mark.parametrize("value,says", [
    (0, "of at most 4,096, got 0"),
    (-3, "of at most 4,096, got -3"),
    (SIZE_FIELDS["num_heads"] + 1, "of at most 4,096, got 4,097"),
    (True, "got True"),
    (2.0, "got 2.0"),
    ("8", "got '8'"),
])
def test_a_size_that_is_not_a_positive_integer_within_its_bound_is_refused(value, says):
    with pytest.raises(ValueError) as err:
        check_config("m", {"num_heads": value}, "m/config.json")
    assert str(err.value).startswith("MODEL 'm': m/config.json: num_heads must be a positive integer")
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_text_config_of_a_multimodal_config_is_checked():
    with pytest.raises(ValueError, match=r"text_config\.hidden_size must be a positive integer .* got 0"):
        check_config("m", {"hidden_size": 64, "text_config": {"hidden_size": 0}}, "m/config.json")


@pytest.mark.parametrize("config", [{"model_type": ["x"]}, {"model_type": {"a": 1}}, {"model_type": 3},
                                    {"model_type": "delta_net", "text_config": {"model_type": ["x"]}}])
def test_a_model_type_that_is_not_a_string_is_refused(config):
    # transformers looks it up in a dict: a list or dict ended in "unhashable type" deep in the loader
    with pytest.raises(ValueError, match=r"^MODEL 'm': m/config.json: (text_config\.)?model_type must be a string, got ") as err:
        check_config("m", config, "m/config.json")
    assert "\n" not in str(err.value)
    check_config("m", {"model_type": "delta_net"}, "m/config.json")
    check_config("m", {"model_type": None}, "m/config.json")


def test_a_config_that_is_not_an_object_is_refused():
    with pytest.raises(ValueError, match=r"m/config.json is not a JSON object"):
        check_config("m", [1, 2], "m/config.json")


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_weights_that_are_not_a_regular_file_are_refused_before_reading(tmp_path, kind):
    import os

    from osdn_diag.runtime.config_checks import check_model_files

    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    if kind == "fifo":
        os.mkfifo(weights)  # a loader would wait on it forever
    else:
        weights.symlink_to("/dev/zero")  # read without end
    with pytest.raises(ValueError, match=r"model\.safetensors is not a regular file"):
        check_model_files("m", tmp_path)


@pytest.mark.parametrize("kind", ["fifo", "directory", "dangling"])
def test_a_config_json_that_is_not_a_regular_file_is_named(tmp_path, kind):
    import os

    from osdn_diag.runtime.config_checks import check_model_files

    config = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(config)
    elif kind == "directory":
        config.mkdir()
    else:
        config.symlink_to(tmp_path / "nothing.json")
    with pytest.raises(ValueError, match=rf"{config} is not a regular file.*replace it with the model's config\.json"):
        check_model_files("m", tmp_path)


def test_an_index_whose_shards_are_elsewhere_is_named(tmp_path):
    from osdn_diag.runtime.config_checks import check_model_files

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"w": "../outside.safetensors"}}')
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights in .*model\.safetensors\.index\.json "
                                                r"lists shards that are not files in it"):
        check_model_files("m", tmp_path)
