"""The bounded reader and YAML loader every user file goes through (commbench.inputs.userfiles)."""

from __future__ import annotations

import ast
import os
import tracemalloc
from pathlib import Path

import pytest

from commbench.errors import UsageError
from commbench.inputs.userfiles import (
    ECHO_CHARS,
    MAX_YAML_BYTES,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    load_yaml,
    load_yaml_mapping,
    read_user_text,
    shorten,
)

PACKAGE = Path(__file__).resolve().parents[2] / "commbench"


def alias_bomb(levels: int = 20, fanout: int = 10, key: str = "hidden") -> str:
    """A 'billion laughs' document: ``key`` stands for fanout^levels strings (10^20 by default)."""
    lines = [f"l0: &l0 [{', '.join(['lol'] * fanout)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fanout)}]" for i in range(1, levels)]
    return "\n".join([*lines, f"{key}: *l{levels - 1}", ""])


def refused(text: str, origin: str = "test.yaml") -> str:
    """The one-line message ``load_yaml`` refuses ``text`` with."""
    with pytest.raises(UsageError) as info:
        load_yaml(text, origin)
    message = str(info.value)
    assert message.startswith(origin) and "\n" not in message
    return message


def test_plain_documents_load():
    text = "name: x\ncount: 3\nratio: 0.5\nflag: yes\nnothing: ~\nitems: [1, two]\nnested: {a: 1}\n"
    assert load_yaml(text, "t") == {
        "name": "x",
        "count": 3,
        "ratio": 0.5,
        "flag": True,
        "nothing": None,
        "items": [1, "two"],
        "nested": {"a": 1},
    }
    assert load_yaml("# only a comment\n", "t") is None
    assert load_yaml("\ufeffa: 1\n", "t") == {"a": 1}  # a byte-order mark is fine


def test_small_aliases_stay_allowed():
    assert load_yaml("base: &bw 900\nnvlink: *bw\nlist: &l [1, 2]\ncopy: *l\n", "t") == {
        "base": 900,
        "nvlink": 900,
        "list": [1, 2],
        "copy": [1, 2],
    }


def test_alias_bomb_is_refused_unexpanded_with_bounded_memory():
    text = alias_bomb()  # 10^20 nodes once expanded; about 1 KiB of text
    tracemalloc.start()
    try:
        message = refused(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert f"more than {MAX_YAML_NODES} values" in message and "line" in message
    assert peak < 20 << 20, f"peak {peak} bytes: the aliases were expanded"
    assert len(message) < 300  # the expanded value is never printed


def test_node_count_counts_aliases_at_their_expanded_size():
    # Exactly at the limit loads; one more expanded node is refused (aliases are not free).
    per_list = 100
    copies = (MAX_YAML_NODES - 1 - 2 - (per_list + 1)) // (per_list + 1)
    head = f"base: &b [{', '.join(['1'] * per_list)}]\n"
    body = "copies: [" + ", ".join(["*b"] * copies) + "]\n"
    load_yaml(head + body, "t")  # within the limit
    refused(head + "copies: [" + ", ".join(["*b"] * (copies + 2)) + "]\n")


def test_flood_of_nodes_is_refused_early():
    text = "k: [" + ", ".join(["1"] * 200_000) + "]\n"  # ~600 KB, under the size limit
    assert f"more than {MAX_YAML_NODES} values" in refused(text)


def test_recursive_alias_is_refused():
    assert "refers to itself" in refused("a: &a [1, *a]\n")


def test_deep_nesting_is_refused_not_a_recursion_error():
    text = "[" * 100_000 + "]" * 100_000
    assert f"nested more than {MAX_YAML_DEPTH} levels" in refused(text)


def test_size_limit():
    assert "larger than 1 MiB" in refused("a: 1\n" + "#" * MAX_YAML_BYTES)


@pytest.mark.parametrize(
    "text, tag",
    [
        ("a: !!python/object/apply:os.system ['touch /tmp/never']\n", "!!python/object/apply:os.system"),
        ("a: !!python/object:collections.OrderedDict {}\n", "!!python/object:collections.OrderedDict"),
        ("a: !!python/name:os.system ''\n", "!!python/name:os.system"),
        ("a: !!binary aGVsbG8=\n", "!!binary"),
        ("a: !!set {x}\n", "!!set"),
        ("a: !!timestamp 2024-01-01\n", "!!timestamp"),
        ("a: !custom 3\n", "!custom"),
        ("a: !<tag:example.com,2024:thing> 3\n", "tag:example.com,2024:thing"),
    ],
)
def test_tags_are_refused(text, tag):
    message = refused(text)
    assert tag in message and "not accepted" in message and "remove the tag" in message


def test_implicit_dates_and_merge_keys_are_plain_text():
    assert load_yaml("when: 2024-01-01\n<<: x\neq: =\n", "t") == {"when": "2024-01-01", "<<": "x", "eq": "="}


@pytest.mark.parametrize("digits", [25, 400, 5000])
def test_integers_beyond_int64_are_refused(digits):
    message = refused(f"hidden: 1{'0' * digits}\n")
    assert "key 'hidden'" in message and "out of range" in message and len(message) < 250


def test_int64_edges_load():
    assert load_yaml(f"a: {(1 << 63) - 1}\nb: -{(1 << 63) - 1}\n", "t") == {
        "a": (1 << 63) - 1,
        "b": -((1 << 63) - 1),
    }


def test_duplicate_keys_are_refused():
    message = refused("hidden: 1024\nnum_experts: 16\nhidden: 7168\n")
    assert "key 'hidden' appears twice" in message and "line 3" in message


def test_long_values_are_refused():
    assert "longer than" in refused("a: " + "x" * 5000 + "\n")


def test_syntax_errors_name_the_line():
    message = refused("a: 1\nb: [1, 2\n")
    assert "bad YAML at line" in message and "fix the file's syntax" in message


def test_control_characters_are_refused():
    assert "U+0000" in refused("a: \x00\n")


def test_more_than_one_document_is_refused():
    assert "bad YAML" in refused("a: 1\n---\nb: 2\n")


def test_complex_keys_are_refused():
    assert "used as a key" in refused("? [a, b]\n: 1\n")


@pytest.mark.parametrize(
    "value",
    ["x" * 10_000, list(range(10_000)), {"k" * 500: "v" * 500}, 10**5000, b"\x00" * 1000],
    ids=["text", "list", "mapping", "5001-digit int", "bytes"],
)
def test_shorten_is_bounded(value):
    assert len(shorten(value)) <= ECHO_CHARS


def test_shorten_survives_a_self_referencing_value():
    value: list = [1]
    value.append(value)
    assert len(shorten(value)) <= ECHO_CHARS


KEYS = ("hidden", "num_experts", "topk")


@pytest.mark.parametrize(
    "text, words",
    [
        ("", "is empty"),
        ("# nothing\n", "is empty"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("just text\n", "expected a mapping"),
        ("hidden: [1, 2]\n", "hidden must be a single value, got a list"),
        ("hidden: {a: 1}\n", "hidden must be a single value, got a mapping"),
        ("hiden: 3\n", "unknown key(s) hiden; accepted: hidden, num_experts, topk"),
    ],
)
def test_flat_mapping_shape(text, words):
    with pytest.raises(UsageError) as info:
        load_yaml_mapping(text, "model file m.yaml", KEYS)
    assert words in str(info.value) and str(info.value).startswith("model file m.yaml")


def test_many_long_unknown_keys_give_a_short_message():
    text = "".join(f"{'k' * 500}{index}: 1\n" for index in range(1000))
    with pytest.raises(UsageError) as info:
        load_yaml_mapping(text, "m.yaml", KEYS)
    message = str(info.value)
    assert "unknown key(s)" in message and "(992 more)" in message and len(message) < 1000


# --- files --------------------------------------------------------------------------------------------


def read_refused(path: Path | str) -> str:
    with pytest.raises(UsageError) as info:
        read_user_text(path, "model file")
    message = str(info.value)
    assert message.startswith(f"model file {path}") and "\n" not in message
    return message


def test_reads_utf8_files(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("name: modèle\n", encoding="utf-8")
    assert read_user_text(path, "model file") == "name: modèle\n"


def test_not_utf8_names_the_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: modèle\n".encode("latin-1"))
    assert "not UTF-8 text (byte 0xe8 at offset 9)" in read_refused(path)


def test_missing_file_and_folder(tmp_path):
    assert "not found" in read_refused(tmp_path / "absent.yaml")
    assert "is a folder" in read_refused(tmp_path)


def test_device_and_pipe_are_refused_without_blocking(tmp_path):
    assert "not a regular file" in read_refused(os.devnull)
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer, forever
    assert "not a regular file" in read_refused(fifo)


def test_oversized_file_is_refused_after_reading_the_limit(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (MAX_YAML_BYTES + 1))
    assert "larger than 1 MiB" in read_refused(path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path):
    path = tmp_path / "secret.yaml"
    path.write_text("a: 1\n")
    path.chmod(0)
    assert "permission denied" in read_refused(path)


def test_no_module_parses_yaml_but_the_bounded_loader():
    """Every YAML read goes through commbench.inputs.userfiles: no other yaml.load/safe_load/full_load."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "userfiles.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "yaml"
            ):
                offenders.append(f"{path.relative_to(PACKAGE)}: yaml.{node.attr}")
    assert not offenders, offenders
