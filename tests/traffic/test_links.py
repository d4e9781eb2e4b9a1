import math

import numpy as np
import pytest

from commbench.errors import UsageError
from commbench.inputs.specs import load_spec
from commbench.traffic.links import (
    class_bottlenecks,
    link_class_bytes,
    link_class_columns,
    link_class_matrix,
    link_frame,
    per_rank_link_bytes,
)

# 4 ranks, domains {0, 1} and {2, 3}; M[src][dst] = 4 * src + dst.
M = np.arange(16, dtype=np.int64).reshape(4, 4)
DOM = np.array([0, 0, 1, 1])


def test_class_matrix():
    assert link_class_matrix(DOM).tolist() == [[0, 1, 2, 2], [1, 0, 2, 2], [2, 2, 0, 1], [2, 2, 1, 0]]


def test_totals_by_hand():
    # self = 0 + 5 + 10 + 15; nvlink = 1 + 4 + 11 + 14; scale-out = the other 8 entries.
    assert link_class_bytes(M, DOM) == {"self": 30, "nvlink": 30, "scaleout": 60, "link": 90, "total": 120}


def test_per_rank_by_hand():
    per_rank = per_rank_link_bytes(M, DOM)
    assert per_rank["self_bytes"].tolist() == [0, 5, 10, 15]
    assert per_rank["nvlink_send_bytes"].tolist() == [1, 4, 11, 14]
    assert per_rank["nvlink_recv_bytes"].tolist() == [4, 1, 14, 11]
    assert per_rank["scaleout_send_bytes"].tolist() == [2 + 3, 6 + 7, 8 + 9, 12 + 13]
    assert per_rank["scaleout_recv_bytes"].tolist() == [8 + 12, 9 + 13, 2 + 6, 3 + 7]
    assert per_rank["nvlink_send_peers"].tolist() == [1, 1, 1, 1]
    assert per_rank["scaleout_recv_peers"].tolist() == [2, 2, 2, 2]
    assert per_rank["total_send_bytes"].tolist() == [6, 22, 38, 54]
    frame = link_frame(M, DOM)
    assert len(frame) == 4 and frame.loc[3, "scaleout_send_bytes"] == 25


def test_bottlenecks_by_hand():
    necks = class_bottlenecks(M, DOM)
    # nvlink: rank 2 receives 14 and rank 3 sends 14: the tie goes to the lower rank.
    assert necks["nvlink"] == {"rank": 2, "direction": "recv", "bytes": 14}
    assert necks["scaleout"] == {"rank": 3, "direction": "send", "bytes": 25}
    assert necks["link"] == {"rank": 3, "direction": "send", "bytes": 39}
    assert necks["total"] == {"rank": 3, "direction": "send", "bytes": 54}


def test_columns_against_the_spec():
    spec = load_spec("gb300-nvl72")
    cols = link_class_columns(M * 1_000_000, DOM, 1e-3, spec)  # bytes x 1e6 in 1 ms: GB/s = bytes / 1e6
    assert cols["nvlink_bytes"] == 30_000_000 and cols["self_bytes"] == 30_000_000
    assert cols["nvlink_GBps"] == pytest.approx(14.0)
    assert cols["nvlink_spec_GBps"] == 900  # per direction, never the 1.8 TB/s bidirectional figure
    assert cols["nvlink_pct_spec"] == pytest.approx(100 * 14 / 900)
    assert cols["scaleout_GBps"] == pytest.approx(25.0)
    assert cols["scaleout_spec_GBps"] == 100  # 800 Gb/s one way
    assert cols["scaleout_pct_spec"] == pytest.approx(25.0)
    assert cols["scaleout_bottleneck_rank"] == 3 and cols["scaleout_bottleneck_dir"] == "send"
    assert cols["nvlink_agg_GBps"] == pytest.approx(30.0)
    assert cols["nvlink_agg_spec_GBps"] == pytest.approx(130000 / 2 * 4 / 72)
    assert cols["scaleout_agg_spec_GBps"] == pytest.approx(400.0)
    assert cols["alg_GBps"] == pytest.approx(54.0)  # self included
    assert cols["link_GBps"] == pytest.approx(39.0)  # self excluded


def test_columns_single_domain_have_no_scaleout():
    cols = link_class_columns(M, np.zeros(4, dtype=np.int64), 1.0, "hgx-h100")
    assert cols["scaleout_bytes"] == 0 and cols["scaleout_bottleneck_rank"] == -1
    assert math.isnan(cols["scaleout_pct_spec"]) and cols["nvlink_spec_GBps"] == 450


def test_matches_a_loop_on_random_traffic():
    rng = np.random.default_rng(3)
    n = 7
    matrix = rng.integers(0, 1000, size=(n, n))
    dom = rng.integers(0, 3, size=n)
    per_rank = per_rank_link_bytes(matrix, dom)
    for r in range(n):
        nv_send = sum(matrix[r, d] for d in range(n) if d != r and dom[d] == dom[r])
        so_recv = sum(matrix[s, r] for s in range(n) if dom[s] != dom[r])
        assert per_rank["nvlink_send_bytes"][r] == nv_send
        assert per_rank["scaleout_recv_bytes"][r] == so_recv
    totals = link_class_bytes(matrix, dom)
    assert totals["self"] + totals["nvlink"] + totals["scaleout"] == matrix.sum()


def test_bad_input():
    with pytest.raises(UsageError, match="square"):
        link_class_bytes(np.zeros((2, 3)), np.zeros(2))
    with pytest.raises(UsageError, match="domain_of_rank has 3"):
        link_class_bytes(np.zeros((2, 2)), np.zeros(3))
    with pytest.raises(UsageError, match="positive"):
        link_class_columns(M, DOM, 0.0, "gb300-nvl72")


def test_byte_columns_and_vectorized_bandwidths():
    from commbench.traffic.links import class_bandwidth_columns, link_class_byte_columns

    cols = link_class_byte_columns(M, DOM)
    assert (cols["nvlink_bytes"], cols["scaleout_bytes"], cols["link_bytes"]) == (30, 60, 90)
    assert (cols["scaleout_bottleneck_rank"], cols["scaleout_bottleneck_dir"]) == (3, "send")
    assert cols["scaleout_bottleneck_bytes"] == 25 and "nvlink_GBps" not in cols
    # Two rows at once, the second with no bytes in the class and a zero time: NaN, never a claim.
    out = class_bandwidth_columns(
        "scaleout", np.array([60e9, 0.0]), np.array([25e9, 0.0]), np.array([1.0, 0.0]), 100.0, 400.0
    )
    assert out["scaleout_GBps"][0] == pytest.approx(25.0) and out["scaleout_pct_spec"][0] == pytest.approx(
        25.0
    )
    assert out["scaleout_agg_pct_spec"][0] == pytest.approx(15.0)
    assert math.isnan(out["scaleout_GBps"][1]) and math.isnan(out["scaleout_pct_spec"][1])
