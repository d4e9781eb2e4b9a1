import io
import os
import zipfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from commbench.errors import UsageError
from commbench.inputs import skew
from commbench.inputs.skew import SkewSpec, load_trace, parse_skew


@pytest.mark.parametrize(
    "text, expected",
    [
        ("uniform", SkewSpec(kind="uniform", text="uniform")),
        ("zipf:1.2", SkewSpec(kind="zipf", text="zipf:1.2", zipf_s=1.2)),
        ("hot:4:0.3", SkewSpec(kind="hot", text="hot:4:0.3", hot_experts=4, hot_fraction=0.3)),
        (
            "rank-imbalance:2.5",
            SkewSpec(kind="rank-imbalance", text="rank-imbalance:2.5", imbalance_ratio=2.5),
        ),
        (
            "trace:/data/run:1.npz",
            SkewSpec(kind="trace", text="trace:/data/run:1.npz", trace_path="/data/run:1.npz"),
        ),
        (" Zipf:2 ", SkewSpec(kind="zipf", text="Zipf:2", zipf_s=2.0)),
    ],
)
def test_parse_skew(text, expected):
    assert parse_skew(text) == expected


@pytest.mark.parametrize(
    "text, words",
    [
        ("", "not understood"),
        ("gauss", "not understood"),
        ("uniform:2", "not understood"),
        ("zipf", "not understood"),
        ("zipf:x", "must be a number"),
        ("zipf:nan", "must be finite"),
        ("zipf:0", "must be > 0"),
        ("hot:4", "not understood"),
        ("hot:0:0.2", "positive integer"),
        ("hot:a:0.2", "positive integer"),
        ("hot:4:1.5", "in (0, 1)"),
        ("hot:4:0", "in (0, 1)"),
        ("rank-imbalance:0.5", "must be >= 1"),
        ("rank-imbalance:", "not understood"),
        ("trace:", "not understood"),
    ],
)
def test_bad_skew(text, words):
    with pytest.raises(UsageError) as info:
        parse_skew(text)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_bad_skew_names_the_accepted_forms():
    with pytest.raises(UsageError, match="uniform, zipf:S, hot:N:F, rank-imbalance:R or trace:PATH"):
        parse_skew("normal")


def _distinct_ids(tokens: int, topk: int, experts: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.argsort(rng.random((tokens, experts)), axis=1)[:, :topk].astype(np.int32)


def test_npz_trace_with_weights(tmp_path):
    ids = _distinct_ids(50, 4, 16)
    weights = np.random.default_rng(1).random((50, 4)).astype(np.float16)
    path = tmp_path / "trace.npz"
    np.savez(path, topk_ids=ids, topk_weights=weights)
    trace = load_trace(str(path), num_experts=16, topk=4)
    assert trace.topk_ids.dtype == np.int64 and np.array_equal(trace.topk_ids, ids)
    assert trace.topk_weights.dtype == np.float32 and np.allclose(trace.topk_weights, weights)


def test_npz_trace_without_weights(tmp_path):
    path = tmp_path / "trace.npz"
    np.savez_compressed(path, topk_ids=_distinct_ids(10, 2, 8))
    assert load_trace(str(path), num_experts=8, topk=2).topk_weights is None


def test_parquet_list_column(tmp_path):
    ids = _distinct_ids(30, 3, 12)
    weights = np.full((30, 3), 1 / 3, dtype=np.float32)
    path = tmp_path / "trace.parquet"
    pq.write_table(pa.table({"topk_ids": list(ids.tolist()), "topk_weights": list(weights.tolist())}), path)
    trace = load_trace(str(path), num_experts=12, topk=3)
    assert np.array_equal(trace.topk_ids, ids) and np.allclose(trace.topk_weights, weights)


def test_parquet_numbered_columns(tmp_path):
    ids = _distinct_ids(30, 3, 12)
    path = tmp_path / "trace.parquet"
    pq.write_table(pa.table({f"topk_{j}": ids[:, j] for j in range(3)}), path)
    trace = load_trace(str(path), num_experts=12, topk=3)
    assert np.array_equal(trace.topk_ids, ids) and trace.topk_weights is None


@pytest.mark.parametrize(
    "ids, words",
    [
        (np.zeros((5, 3), dtype=np.int64) + np.arange(3), "shape [5, 3]"),
        (np.arange(8), "shape [8]"),
        (np.array([[0, 1], [2, 16]]), "span 0..16"),
        (np.array([[0, 1], [-2, 3]]), "span -2..3"),
        (np.array([[0, 1], [3, 3]]), "token 1 repeats"),
        (np.array([[0.0, 1.0]]), "must be integer expert ids"),
        (np.zeros((0, 2), dtype=np.int64), "no tokens"),
    ],
)
def test_malformed_npz(tmp_path, ids, words):
    path = tmp_path / "bad.npz"
    np.savez(path, topk_ids=ids)
    with pytest.raises(UsageError) as info:
        load_trace(str(path), num_experts=16, topk=2)
    assert words in str(info.value) and str(path) in str(info.value)


def test_a_trace_may_mark_dropped_selections_with_minus_one(tmp_path):
    """DeepEP's topk_idx convention (deep_ep/buffers/legacy.py, Buffer.dispatch docstring: "`-1` means no
    selections"), as --mask-ratio and --capacity-factor produce: -1 is read, even twice in one token."""
    ids = np.array([[0, 5], [-1, 3], [-1, -1]])
    path = tmp_path / "dropped.npz"
    np.savez(path, topk_ids=ids)
    trace = load_trace(str(path), num_experts=16, topk=2)
    assert trace.topk_ids.tolist() == ids.tolist()


def test_pickled_object_array_is_never_loaded(tmp_path):
    path = tmp_path / "pickled.npz"
    np.savez(path, topk_ids=np.array([[0, 1], [2, 3]], dtype=object))
    with pytest.raises(UsageError, match="pickled object arrays"):
        load_trace(str(path), num_experts=16, topk=2)


def test_npz_problems(tmp_path):
    missing_key = tmp_path / "other.npz"
    np.savez(missing_key, ids=np.array([[0, 1]]))
    with pytest.raises(UsageError, match="no 'topk_ids' array"):
        load_trace(str(missing_key), num_experts=4, topk=2)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip file at all")
    with pytest.raises(UsageError, match="unreadable .npz"):
        load_trace(str(garbage), num_experts=4, topk=2)
    bad_weights = tmp_path / "weights.npz"
    np.savez(bad_weights, topk_ids=np.array([[0, 1]]), topk_weights=np.array([[0.5, -0.5]]))
    with pytest.raises(UsageError, match="finite and >= 0"):
        load_trace(str(bad_weights), num_experts=4, topk=2)
    wrong_shape = tmp_path / "shape.npz"
    np.savez(wrong_shape, topk_ids=np.array([[0, 1]]), topk_weights=np.array([0.5, 0.5]))
    with pytest.raises(UsageError, match="topk_weights has shape"):
        load_trace(str(wrong_shape), num_experts=4, topk=2)


def test_parquet_problems(tmp_path):
    ragged = tmp_path / "ragged.parquet"
    pq.write_table(pa.table({"topk_ids": [[0, 1], [2]]}), ragged)
    with pytest.raises(UsageError, match="different lengths"):
        load_trace(str(ragged), num_experts=4, topk=2)
    no_column = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"experts": [1, 2]}), no_column)
    with pytest.raises(UsageError, match="needs a list column 'topk_ids'"):
        load_trace(str(no_column), num_experts=4, topk=2)
    nulls = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"topk_0": [0, None], "topk_1": [1, 2]}), nulls)
    with pytest.raises(UsageError, match="holds nulls"):
        load_trace(str(nulls), num_experts=4, topk=2)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1 nope")
    with pytest.raises(UsageError, match="unreadable .parquet"):
        load_trace(str(garbage), num_experts=4, topk=2)


def test_trace_file_problems(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        load_trace(str(tmp_path / "absent.npz"), num_experts=4, topk=2)
    other = tmp_path / "trace.csv"
    other.write_text("0,1\n")
    with pytest.raises(UsageError, match="use .npz or .parquet"):
        load_trace(str(other), num_experts=4, topk=2)


def test_edited_trace_is_reread(tmp_path):
    path = tmp_path / "trace.npz"
    np.savez(path, topk_ids=np.array([[0, 1]]))
    assert load_trace(str(path), num_experts=4, topk=2).topk_ids.tolist() == [[0, 1]]
    np.savez(path, topk_ids=np.array([[2, 3], [1, 0]]))
    assert load_trace(str(path), num_experts=4, topk=2).topk_ids.tolist() == [[2, 3], [1, 0]]


def test_npz_member_that_is_not_an_array(tmp_path):
    # np.load returns a member without the .npy magic as raw bytes.
    path = tmp_path / "raw.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("topk_ids.npy", b"these bytes are not a numpy array")
    with pytest.raises(UsageError, match="member topk_ids is not a numpy array"):
        load_trace(str(path), num_experts=8, topk=2)


def test_corrupted_compressed_npz(tmp_path):
    path = tmp_path / "corrupt.npz"
    np.savez_compressed(path, topk_ids=np.random.default_rng(0).integers(0, 8, (5000, 2)))
    data = bytearray(path.read_bytes())
    for index in range(100, 200):  # inside the deflate stream of the only member
        data[index] ^= 0x55
    path.write_bytes(bytes(data))
    with pytest.raises(UsageError, match="unreadable .npz"):
        load_trace(str(path), num_experts=8, topk=2)


def test_trace_path_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert parse_skew("trace:~/routing.npz").trace_path == str(tmp_path / "routing.npz")


def _refused(path, num_experts: int = 8, topk: int = 2) -> str:
    with pytest.raises(UsageError) as info:
        load_trace(str(path), num_experts=num_experts, topk=topk)
    message = str(info.value)
    assert "\n" not in message and len(message) < 400
    return message


def test_npz_header_declaring_a_huge_array_is_refused_before_allocation(tmp_path):
    # A member whose .npy header declares 2^40 elements and holds none: numpy would allocate 8 TiB first.
    path = tmp_path / "huge.npz"
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<i8", "fortran_order": False, "shape": (1 << 39, 2)}
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("topk_ids.npy", header.getvalue())
    assert f"above the limit {skew.MAX_TRACE_SELECTIONS}" in _refused(path)


def test_npz_weights_header_is_bounded_too(tmp_path):
    path = tmp_path / "huge.npz"
    header = io.BytesIO()
    np.lib.format.write_array_header_2_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (1 << 40,)}
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("topk_ids.npy", _npy_bytes(np.array([[0, 1]])))
        archive.writestr("topk_weights.npy", header.getvalue())
    assert "topk_weights holds" in _refused(path)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_npz_with_many_members_is_refused_before_listing_them(tmp_path):
    path = tmp_path / "many.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("topk_ids.npy", _npy_bytes(np.array([[0, 1]])))
        for index in range(100):
            archive.writestr(f"junk{index}", b"")
    assert "a .npz of 101 members" in _refused(path)


def test_trace_file_size_is_bounded(tmp_path, monkeypatch):
    path = tmp_path / "trace.npz"
    np.savez(path, topk_ids=_distinct_ids(1000, 2, 8))
    monkeypatch.setattr(skew, "MAX_TRACE_FILE_BYTES", 1000)
    assert "limit for a trace" in _refused(path)


def test_trace_token_count_is_bounded(tmp_path, monkeypatch):
    path = tmp_path / "trace.npz"
    np.savez(path, topk_ids=_distinct_ids(100, 2, 8))
    monkeypatch.setattr(skew, "MAX_TRACE_TOKENS", 50)
    assert "holds 100 tokens, above the limit 50" in _refused(path)


def test_parquet_rows_and_values_are_bounded_from_the_footer(tmp_path, monkeypatch):
    ids = _distinct_ids(100, 2, 8)
    path = tmp_path / "trace.parquet"
    pq.write_table(pa.table({"topk_ids": list(ids.tolist())}), path)
    monkeypatch.setattr(skew, "MAX_TRACE_TOKENS", 50)
    assert "holds 100 rows (tokens), above the limit 50" in _refused(path)
    monkeypatch.setattr(skew, "MAX_TRACE_TOKENS", 1000)
    monkeypatch.setattr(skew, "MAX_TRACE_SELECTIONS", 150)
    assert "column topk_ids holds 200 values, above the limit 150" in _refused(path)


def test_empty_and_folder_traces(tmp_path):
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    assert "is empty" in _refused(empty)
    folder = tmp_path / "folder.npz"
    folder.mkdir()
    assert "is not a file" in _refused(folder)


@pytest.mark.parametrize(
    "ids, words",
    [
        (np.array([[0, 1], [2, 2**63 + 5]], dtype=np.uint64), "span 0..9223372036854775813"),
        (np.array([[0.0, np.nan]]), "must be integer expert ids, got dtype float64"),
        (np.array([[True, False]]), "must be integer expert ids, got dtype bool"),
        (np.array([["0", "1"]]), "must be integer expert ids"),
        (np.array(3), "shape []"),
        (np.zeros((2, 2, 2), dtype=np.int64), "shape [2, 2, 2]"),
    ],
    ids=["uint64-above-int64", "nan", "bool", "text", "scalar", "3-d"],
)
def test_more_malformed_ids(tmp_path, ids, words):
    path = tmp_path / "bad.npz"
    np.savez(path, topk_ids=ids)
    assert words in _refused(path)


@pytest.mark.parametrize(
    "weights, words",
    [
        (np.array([[0.5, np.nan]]), "finite and >= 0"),
        (np.array([[0.5, np.inf]]), "finite and >= 0"),
        (np.array([[0.5, 1e300]]), "finite and >= 0"),  # inf once cast to float32
        (np.array([[0.5 + 1j, 0.5]]), "must be real numbers"),
    ],
    ids=["nan", "inf", "float32-overflow", "complex"],
)
def test_bad_weights(tmp_path, weights, words):
    path = tmp_path / "weights.npz"
    np.savez(path, topk_ids=np.array([[0, 1]]), topk_weights=weights)
    assert words in _refused(path)


def test_parquet_float_ids_with_nan(tmp_path):
    path = tmp_path / "trace.parquet"
    pq.write_table(pa.table({"topk_0": [0.0, float("nan")], "topk_1": [1.0, 2.0]}), path)
    assert "must be integer expert ids" in _refused(path)


class _RunsOnUnpickle:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("member", ["topk_ids", "topk_weights"])
def test_pickles_are_never_executed(tmp_path, member):
    """np.load stays allow_pickle=False: a pickle that would create a folder when loaded is refused."""
    marker = tmp_path / "pwned"
    payload = np.empty((1, 2), dtype=object)
    payload[:] = _RunsOnUnpickle(str(marker))
    arrays = {"topk_ids": np.array([[0, 1]]), member: payload}
    path = tmp_path / "pickled.npz"
    np.savez(path, **arrays)
    assert "pickled object arrays" in _refused(path)
    assert not marker.exists()
