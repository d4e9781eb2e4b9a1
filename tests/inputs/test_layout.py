import numpy as np
import pytest

from commbench.errors import UsageError
from commbench.hardware.probes import RankPlace
from commbench.inputs.layout import build_layout


def test_ranks_per_domain_override_stands_four_ranks_for_two_domains():
    layout = build_layout(4, ranks_per_domain=2)
    assert layout.domain_of_rank.tolist() == [0, 0, 1, 1]
    assert layout.host_of_rank.tolist() == [0, 0, 1, 1]  # a domain is one host unless told otherwise
    assert layout.source == "override" and layout.num_domains == 2
    assert build_layout(4, ranks_per_domain=2).domain_of_rank.tolist() == [0, 0, 1, 1]


def test_hosts_nest_inside_domains():
    layout = build_layout(8, ranks_per_domain=4, ranks_per_host=2)
    assert layout.domain_of_rank.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layout.host_of_rank.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert build_layout(4, ranks_per_host=2).host_of_rank.tolist() == [0, 0, 1, 1]
    with pytest.raises(UsageError, match="not a multiple of --ranks-per-host"):
        build_layout(8, ranks_per_domain=4, ranks_per_host=3)


def test_unequal_override_groups_are_refused_and_a_part_of_one_domain_is_not():
    with pytest.raises(UsageError, match="does not divide the 4 ranks; use one of 1, 2, 4"):
        build_layout(4, ranks_per_domain=3)
    with pytest.raises(UsageError, match="--ranks-per-host 3 does not divide"):
        build_layout(4, ranks_per_host=3)
    assert build_layout(2, ranks_per_domain=8).domain_of_rank.tolist() == [0, 0]  # 2 GPUs of an 8-GPU box
    with pytest.raises(UsageError, match="positive"):
        build_layout(4, ranks_per_domain=0)
    with pytest.raises(UsageError, match="world size"):
        build_layout(0)


def test_default_is_one_host_one_domain():
    layout = build_layout(3)
    assert layout.domain_of_rank.tolist() == [0, 0, 0] and layout.source == "default"


def test_discovered_fabric_clique_spans_hosts():
    cluster = "11111111-2222-3333-4444-555555555555"
    places = [
        RankPlace(host=h, fabric_cluster_uuid=cluster, fabric_clique_id=7) for h in ("a", "a", "b", "b")
    ]
    layout = build_layout(4, discovered=places)
    assert layout.domain_of_rank.tolist() == [0, 0, 0, 0]  # one NVL72-style domain over two hosts
    assert layout.host_of_rank.tolist() == [0, 0, 1, 1]
    other = [*places[:2], *(RankPlace(host="b", fabric_cluster_uuid=cluster, fabric_clique_id=8),) * 2]
    assert build_layout(4, discovered=other).domain_of_rank.tolist() == [
        0,
        0,
        1,
        1,
    ]  # another clique: another domain


def test_discovered_without_fabric_uses_hosts_and_accepts_dicts():
    places = [{"host": h} for h in ("n1", "n2", "n1", "n2")]
    assert build_layout(4, discovered=places).domain_of_rank.tolist() == [0, 1, 0, 1]
    with pytest.raises(UsageError, match="got 3 rank places"):
        build_layout(4, discovered=places[:3])
    # An override wins over what was discovered.
    assert build_layout(4, ranks_per_domain=4, discovered=places).domain_of_rank.tolist() == [0, 0, 0, 0]


def test_layout_describe():
    assert "2 x 2 ranks" in build_layout(4, ranks_per_domain=2).describe()
    places = [RankPlace(host=host) for host in ("a", "a", "a", "b")]
    assert "1 x 1 + 1 x 3" in build_layout(4, discovered=places).describe()


def test_layout_arrays_are_int64():
    layout = build_layout(6, ranks_per_domain=2)
    assert layout.domain_of_rank.dtype == np.int64 and layout.host_of_rank.dtype == np.int64


def test_a_what_if_on_a_specs_racks_may_end_in_a_partial_one_but_a_given_size_must_divide():
    layout = build_layout(300, 72, 4, partial_last=True)  # 4 NVL72 racks and 12 GPUs of a fifth
    assert layout.domain_sizes.tolist() == [72, 72, 72, 72, 12]
    with pytest.raises(UsageError, match="--ranks-per-domain 72 does not divide the 300 ranks"):
        build_layout(300, 72, 4)


def test_ranks_per_host_alone_moves_the_domains_only_where_no_fabric_clique_is_reported():
    # Without a clique a rank's NVLink domain is its host, so overridden hosts are overridden domains.
    assert build_layout(4, ranks_per_host=2).domain_of_rank.tolist() == [0, 0, 1, 1]
    one_box = [RankPlace(host="box") for _ in range(4)]
    layout = build_layout(4, ranks_per_host=2, discovered=one_box)
    assert layout.domain_of_rank.tolist() == [0, 0, 1, 1] and layout.num_hosts == 2
    # An NVL72-style clique spans hosts: overriding the hosts keeps it.
    cluster = "11111111-2222-3333-4444-555555555555"
    rack = [RankPlace(host="a", fabric_cluster_uuid=cluster, fabric_clique_id=7) for _ in range(4)]
    layout = build_layout(4, ranks_per_host=2, discovered=rack)
    assert layout.domain_of_rank.tolist() == [0, 0, 0, 0] and layout.host_of_rank.tolist() == [0, 0, 1, 1]
