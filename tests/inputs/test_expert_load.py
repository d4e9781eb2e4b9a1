"""Expert-load tables (layer, expert, tokens) and the --skew load:PATH[:LAYER] form built on them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from commbench.errors import UsageError
from commbench.inputs.expert_load import (
    ZERO_LOAD_WEIGHT,
    expert_weights,
    layer_loads,
    read_expert_load,
)
from commbench.inputs.models import ModelConfig
from commbench.inputs.skew import parse_skew
from commbench.traffic.pattern import build_pattern
from commbench.traffic.routing import RoutingConfig, expert_popularity

TABLE = Path(__file__).resolve().parents[1] / "data" / "expert_load.csv"
LAYER0 = [612, 498, 455, 1020, 530, 470, 505, 488, 520, 462, 515, 490, 476, 503, 480, 468]
LAYER1 = [350, 402, 380, 410, 395, 366, 371, 420, 388, 359, 401, 2300, 377, 392, 368, 322]
SIXTEEN = ModelConfig(name="sixteen", hidden=64, num_experts=16, topk=2, dispatch_dtype="bf16")


def write(tmp_path: Path, text: str, name: str = "load.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_shipped_table_reads_per_layer_and_summed() -> None:
    table = read_expert_load(TABLE)
    assert table.layers == [0, 1] and len(table.expert) == 32
    assert layer_loads(table, 16, 0).tolist() == LAYER0
    assert layer_loads(table, 16, 1).tolist() == LAYER1
    assert layer_loads(table, 16).tolist() == [a + b for a, b in zip(LAYER0, LAYER1, strict=True)]
    assert layer_loads(table, 32, 1)[16:].sum() == 0  # a larger model: the other experts had no tokens


def test_weights_follow_the_tokens_with_mean_one() -> None:
    weights = expert_weights(str(TABLE), 16, 1)
    assert weights.mean() == pytest.approx(1.0)
    np.testing.assert_allclose(weights, np.array(LAYER1) / np.mean(LAYER1))
    assert int(np.argmax(weights)) == 11 and int(np.argmax(expert_weights(str(TABLE), 16, 0))) == 3


def test_parquet_reads_like_csv_and_rows_of_one_expert_add_up(tmp_path: Path) -> None:
    path = tmp_path / "load.parquet"
    layer = [0] * 16 + [1] * 16 + [1]
    expert = list(range(16)) * 2 + [11]
    tokens = [float(v) for v in LAYER0 + LAYER1] + [100.0]  # a second step's row for layer 1, expert 11
    pq.write_table(pa.table({"tokens": tokens, "expert": expert, "layer": layer, "step": [0] * 33}), path)
    loads = layer_loads(read_expert_load(path), 16, 1)
    assert loads[11] == 2400 and loads.sum() == sum(LAYER1) + 100


def test_an_expert_without_tokens_keeps_a_tiny_weight(tmp_path: Path) -> None:
    path = write(tmp_path, "layer,expert,tokens\n" + "".join(f"0,{e},{100 if e else 0}\n" for e in range(8)))
    weights = expert_weights(str(path), 8, 0)
    assert weights[0] == pytest.approx(ZERO_LOAD_WEIGHT, rel=1e-3) and weights.mean() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("layer,expert\n0,1\n", "no column tokens"),
        ("layer,expert,tokens\n", "has no rows"),
        ("layer,expert,tokens\n0,1,5\n0,2,-3\n", "row 2: tokens -3 must be a number >= 0"),
        ("layer,expert,tokens\n0,1,five\n", "row 1: tokens 'five' is not a number"),
        ("layer,expert,tokens\n0,1.5,5\n", "row 1: expert 1.5 must be a whole number >= 0"),
        ("layer,expert,tokens\n-1,1,5\n", "row 1: layer -1 must be a whole number >= 0"),
        ("layer,expert,tokens\n0,1,nan\n", "row 1: tokens 'nan' is not a number"),
    ],
)
def test_malformed_tables_are_one_line_errors(tmp_path: Path, text: str, fragment: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(UsageError) as caught:
        read_expert_load(path)
    assert fragment in str(caught.value) and "load.csv" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_unknown_layer_expert_out_of_range_and_files(tmp_path: Path) -> None:
    table = read_expert_load(TABLE)
    with pytest.raises(UsageError, match=r"no layer 7 \(layers: 0, 1\)"):
        layer_loads(table, 16, 7)
    with pytest.raises(UsageError, match="expert 15 is out of range for small's 8 experts"):
        layer_loads(table, 8, 0, "small")
    with pytest.raises(UsageError, match="layer 0 has no tokens"):
        layer_loads(read_expert_load(write(tmp_path, "layer,expert,tokens\n0,1,0\n")), 8, 0)
    with pytest.raises(UsageError, match="unsupported file type .json"):
        read_expert_load(write(tmp_path, "{}", "load.json"))
    with pytest.raises(UsageError, match="not found"):
        read_expert_load(tmp_path / "missing.csv")
    with pytest.raises(UsageError, match="not a readable Parquet table"):
        read_expert_load(write(tmp_path, "PAR1 not parquet", "load.parquet"))


def test_skew_grammar() -> None:
    skew = parse_skew(f"load:{TABLE}:1")
    assert (skew.kind, skew.load_path, skew.load_layer) == ("load", str(TABLE), 1)
    skew = parse_skew(f"load:{TABLE}")
    assert (skew.load_path, skew.load_layer) == (str(TABLE), None)
    assert parse_skew("load:/runs/a:b/load.csv").load_path == "/runs/a:b/load.csv"  # a colon inside the path
    assert parse_skew("load:~/load.csv:0").load_path.endswith("/load.csv")  # ~ expanded
    with pytest.raises(UsageError, match="below 10"):
        parse_skew("load:x.csv:12345678901")
    with pytest.raises(UsageError, match=r"load:PATH\[:LAYER\]"):
        parse_skew("load:")
    assert parse_skew("zipf:1.2").zipf_s == 1.2  # the other forms are unchanged


def test_routing_draws_the_layers_busiest_expert_most() -> None:
    for layer, busiest in ((0, 3), (1, 11)):
        cfg = RoutingConfig(SIXTEEN, parse_skew(f"load:{TABLE}:{layer}"), 4, 2048)
        popularity = expert_popularity(cfg)
        np.testing.assert_allclose(popularity.weights, expert_weights(str(TABLE), 16, layer))
        assert popularity.hot_experts[0] == busiest
        load = build_pattern(cfg).expert_load
        assert int(np.argmax(load)) == busiest
    with pytest.raises(UsageError, match="expert 15 is out of range for eight's 8 experts"):
        eight = ModelConfig(name="eight", hidden=64, num_experts=8, topk=2, dispatch_dtype="bf16")
        expert_popularity(RoutingConfig(eight, parse_skew(f"load:{TABLE}:0"), 4, 64))


@pytest.mark.parametrize("scale", [1e-320, 1e-300, 1.0, 1e12])
def test_loads_keep_their_ratios_at_any_scale(tmp_path, scale):
    """Subnormal or huge token counts must not become a uniform routing (0/0, inf/inf)."""
    import numpy as np

    from commbench.inputs.expert_load import expert_weights

    path = tmp_path / "load.csv"
    path.write_text("layer,expert,tokens\n" + "".join(f"0,{e},{(e + 1) * scale!r}\n" for e in range(4)))
    weights = expert_weights(str(path), 4)
    assert np.isfinite(weights).all()
    assert weights == pytest.approx(np.array([1, 2, 3, 4]) / 2.5)


def test_a_token_count_that_would_overflow_the_sum_is_refused(tmp_path):
    from commbench.inputs.expert_load import read_expert_load

    path = tmp_path / "load.csv"
    path.write_text("layer,expert,tokens\n0,0,1.7e308\n0,1,1.7e308\n")
    with pytest.raises(UsageError, match="row 1: tokens 1.7e\\+308 must be a number >= 0 and <= 1e\\+15"):
        read_expert_load(str(path))
