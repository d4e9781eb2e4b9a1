"""traffic.links: a [src][dst] byte matrix split by link class (self, NVLink, scale-out), worked by hand."""

import numpy as np
import pytest

from commbench.errors import UsageError
from commbench.traffic.links import (
    class_bottlenecks,
    link_class_byte_columns,
    link_class_bytes,
    link_class_matrix,
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
    assert per_rank["total_send_bytes"].tolist() == [6, 22, 38, 54]
    assert per_rank["total_recv_bytes"].tolist() == [24, 28, 32, 36]


def test_bottlenecks_by_hand():
    necks = class_bottlenecks(M, DOM)
    # nvlink: rank 2 receives 14 and rank 3 sends 14: the tie goes to the lower rank.
    assert necks["nvlink"] == {"rank": 2, "direction": "recv", "bytes": 14}
    assert necks["scaleout"] == {"rank": 3, "direction": "send", "bytes": 25}
    quiet = class_bottlenecks(M, np.zeros(4, dtype=np.int64))["scaleout"]  # one domain: no scale-out
    assert quiet == {"rank": -1, "direction": "send", "bytes": 0}


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


def test_byte_columns_of_a_result_row():
    cols = link_class_byte_columns(M, DOM)
    assert (cols["self_bytes"], cols["nvlink_bytes"], cols["scaleout_bytes"], cols["link_bytes"]) == (
        30,
        30,
        60,
        90,
    )
    assert (
        cols["nvlink_bottleneck_rank"],
        cols["nvlink_bottleneck_dir"],
        cols["nvlink_bottleneck_bytes"],
    ) == (
        2,
        "recv",
        14,
    )
    assert (cols["scaleout_bottleneck_rank"], cols["scaleout_bottleneck_dir"]) == (3, "send")
    assert cols["scaleout_bottleneck_bytes"] == 25 and not any(key.endswith("GBps") for key in cols)
    single = link_class_byte_columns(M, np.zeros(4, dtype=np.int64))
    assert (
        single["scaleout_bytes"],
        single["scaleout_bottleneck_rank"],
        single["scaleout_bottleneck_dir"],
    ) == (
        0,
        -1,
        "",
    )
