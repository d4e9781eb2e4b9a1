from pathlib import Path

import pytest

from commbench.errors import UsageError
from commbench.inputs.models import LIMITS, ModelConfig, list_models, load_model

PRESETS = {
    # name: (hidden, routed experts, topk, shared, n_group, topk_group, dispatch dtype)
    "deepseek-v3": (7168, 256, 8, 1, 8, 4, "fp8"),
    "kimi-k2": (7168, 384, 8, 1, 1, 1, "bf16"),
    "qwen3-235b-a22b": (4096, 128, 8, 0, 1, 1, "bf16"),
    "qwen3-30b-a3b": (2048, 128, 8, 0, 1, 1, "bf16"),
    "mixtral-8x22b": (6144, 8, 2, 0, 1, 1, "bf16"),
    "llama4-maverick": (5120, 128, 1, 1, 1, 1, "bf16"),
    "gpt-oss-120b": (2880, 128, 4, 0, 1, 1, "bf16"),
}

VALID = "hidden: 1024\nnum_experts: 16\ntopk: 2\n"


def test_list_models_has_every_preset():
    assert set(PRESETS) <= set(list_models())
    assert list_models() == sorted(list_models())


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_numbers(name):
    model = load_model(name)
    hidden, experts, topk, shared, n_group, topk_group, dtype = PRESETS[name]
    assert (model.name, model.hidden, model.num_experts, model.topk) == (name, hidden, experts, topk)
    assert (model.num_shared_experts, model.n_group, model.topk_group) == (shared, n_group, topk_group)
    assert model.dispatch_dtype == dtype and model.combine_dtype == "bf16"
    assert model.source


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_file_cites_its_source(name):
    text = (
        Path(__file__).resolve().parents[2] / "commbench" / "inputs" / "presets" / f"{name}.yaml"
    ).read_text()
    assert text.startswith("#") and "config" in text.splitlines()[0] + text.splitlines()[1]


def test_byte_accounting():
    deepseek = load_model("deepseek-v3")
    assert deepseek.dispatch_bytes_per_token == 7168 + 56 * 4 == 7392
    assert deepseek.combine_bytes_per_token == 2 * 7168
    qwen = load_model("qwen3-30b-a3b")
    assert qwen.dispatch_bytes_per_token == qwen.combine_bytes_per_token == 4096
    odd = ModelConfig("odd", hidden=200, num_experts=4, topk=1, dispatch_dtype="fp8", scale_block=128)
    assert odd.dispatch_bytes_per_token == 200 + 2 * 4  # the partial block carries a scale too


def test_group_properties():
    deepseek = load_model("deepseek-v3")
    assert deepseek.group_limited and deepseek.experts_per_group == 32
    assert not load_model("kimi-k2").group_limited


def test_unknown_preset_lists_presets():
    with pytest.raises(UsageError) as info:
        load_model("deepseek-v9")
    message = str(info.value)
    assert "deepseek-v9" in message and "deepseek-v3" in message and "\n" not in message


def test_user_yaml_file(tmp_path):
    path = tmp_path / "tiny-moe.yaml"
    path.write_text("# my model\n" + VALID + "num_shared_experts: 2\nn_group: 4\ntopk_group: 2\n")
    model = load_model(str(path))
    assert model.name == "tiny-moe"
    assert (model.hidden, model.num_experts, model.topk, model.n_group, model.topk_group) == (
        1024,
        16,
        2,
        4,
        2,
    )
    assert model.num_shared_experts == 2 and model.group_limited


@pytest.mark.parametrize(
    "text, words",
    [
        (VALID + "experts: 4\n", "unknown key(s) experts"),
        ("hidden: 1024\ntopk: 2\n", "missing key(s) num_experts"),
        ("hidden: 0\nnum_experts: 16\ntopk: 2\n", "hidden must be a positive integer"),
        ("hidden: -5\nnum_experts: 16\ntopk: 2\n", "hidden must be a positive integer"),
        ("hidden: 1.5\nnum_experts: 16\ntopk: 2\n", "hidden must be a positive integer"),
        ("hidden: true\nnum_experts: 16\ntopk: 2\n", "hidden must be a positive integer"),
        ("hidden: 1024\nnum_experts: 16\ntopk: 17\n", "topk 17 exceeds num_experts 16"),
        (VALID + "n_group: 4\ntopk_group: 5\n", "topk_group 5 exceeds n_group 4"),
        (VALID + "n_group: 3\ntopk_group: 1\n", "n_group 3 does not divide num_experts 16"),
        (VALID + "n_group: 4\n", "topk_group is missing"),
        ("hidden: 8\nnum_experts: 16\ntopk: 8\nn_group: 8\ntopk_group: 2\n", "raise topk_group"),
        (VALID + "num_shared_experts: -1\n", "num_shared_experts must be an integer >= 0"),
        (VALID + "dispatch_dtype: fp4\n", "dispatch_dtype must be one of"),
        (VALID + "combine_dtype: fp8\n", "combine_dtype must be bf16"),
        (VALID + "name: 7\n", "name must be a string"),
        ("hidden: [1024\n", "bad YAML"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("", "is empty"),
    ],
)
def test_bad_yaml_is_a_one_line_usage_error(tmp_path, text, words):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UsageError) as info:
        load_model(str(path))
    message = str(info.value)
    assert words in message and str(path) in message and "\n" not in message


def test_binary_model_file_is_a_usage_error(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00hidden: 3\n")
    with pytest.raises(UsageError, match="not UTF-8 text"):
        load_model(str(path))


def test_missing_file():
    with pytest.raises(UsageError, match="not found"):
        load_model("/nonexistent/model.yaml")


# topk_group <= n_group <= its limit: a topk_group past the limit is refused by the n_group bound first.
@pytest.mark.parametrize("key", sorted(set(LIMITS) - {"topk_group"}))
def test_every_count_has_an_upper_bound(key):
    values = {"hidden": 1024, "num_experts": 1 << 16, "topk": 1}
    values[key] = LIMITS[key] + 1
    with pytest.raises(UsageError, match=f"{key} {LIMITS[key] + 1} is above the limit {LIMITS[key]}"):
        ModelConfig("big", **values)
    values[key] = LIMITS[key]
    if key == "n_group":
        values.update(topk_group=1, topk=1)
    ModelConfig("at-the-limit", **values)  # the bound itself is accepted


@pytest.mark.parametrize(
    "line, words",
    [
        ("hidden: .nan", "hidden must be a positive integer, got nan"),
        ("hidden: -.inf", "hidden must be a positive integer"),
        ("hidden: 1.0e+400", "hidden must be a positive integer, got inf"),
        ("hidden: 1e400", "got text '1e400'"),  # YAML 1.1 reads an exponent without a dot as text
        ("hidden: 1" + "0" * 400, "key 'hidden': integer"),
        ("hidden: 1048577", "hidden 1048577 is above the limit 1048576"),
        ("hidden: yes", "got a boolean True"),
        ("hidden: '1024'", "got text '1024'"),
        ("hidden:", "got None"),
    ],
)
def test_bad_numbers_name_the_file_key_and_fix(tmp_path, line, words):
    path = tmp_path / "model.yaml"
    path.write_text(line + "\nnum_experts: 16\ntopk: 2\n")
    with pytest.raises(UsageError) as info:
        load_model(str(path))
    message = str(info.value)
    assert words in message and str(path) in message and "hidden" in message and "\n" not in message


def test_name_must_be_one_short_line(tmp_path):
    path = tmp_path / "model.yaml"
    for name in ('"a\\nb"', "x" * 101, "''", '"\\x00"'):
        path.write_text(VALID + f"name: {name}\n")
        with pytest.raises(UsageError, match="printable characters on one line"):
            load_model(str(path))


def test_model_path_with_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "mine.yaml").write_text(VALID)
    assert load_model("~/mine.yaml").name == "mine"


def test_long_unknown_model_name_is_shortened():
    with pytest.raises(UsageError) as info:
        load_model("m" * 100_000)
    assert len(str(info.value)) < 400


# One routed expert's FFN width, for the comm/compute budget (Hugging Face config.json of each model).
EXPERT_WIDTH = {
    "deepseek-v3": 2048,
    "kimi-k2": 2048,
    "qwen3-235b-a22b": 1536,
    "qwen3-30b-a3b": 768,
    "mixtral-8x22b": 16384,
    "llama4-maverick": 8192,
    "gpt-oss-120b": 2880,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_has_moe_intermediate_with_a_source_comment(name):
    assert load_model(name).moe_intermediate == EXPERT_WIDTH[name]
    text = (
        Path(__file__).resolve().parents[2] / "commbench" / "inputs" / "presets" / f"{name}.yaml"
    ).read_text()
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("moe_intermediate:"))
    comment = " ".join(line for line in lines[max(0, at - 3) : at] if line.startswith("#"))
    assert "intermediate_size" in comment and "config" in comment and str(EXPERT_WIDTH[name]) in comment


def test_moe_intermediate_is_optional_in_a_user_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(VALID)
    assert load_model(str(path)).moe_intermediate is None
    path.write_text(VALID + "moe_intermediate: 1408\n")
    assert load_model(str(path)).moe_intermediate == 1408


@pytest.mark.parametrize("value", ["0", "-1", "2.5", "wide", "true"])
def test_bad_moe_intermediate_is_one_line(tmp_path, value):
    path = tmp_path / "mine.yaml"
    path.write_text(VALID + f"moe_intermediate: {value}\n")
    with pytest.raises(UsageError, match="moe_intermediate must be a positive integer") as info:
        load_model(str(path))
    assert "\n" not in str(info.value) and "mine.yaml" in str(info.value)


@pytest.mark.parametrize("name", ["<script>alert(1)</script>", 'a"b', "a&b", "a|b", "a`b`", "${HOME}"])
def test_a_model_name_with_markup_is_refused(tmp_path, name):
    """A name labels tables, pages and CSV cells: markup there is a mistake or an attack (the pages escape it
    anyway)."""
    path = tmp_path / "m.yaml"
    path.write_text(f"name: {name!r}\nhidden: 64\nnum_experts: 8\ntopk: 2\n")
    with pytest.raises(UsageError, match="use letters, digits, spaces and"):
        load_model(str(path))
