"""The run's layout: every rank's place gathered, overrides winning, how it was found (text and meta)."""

from commbench.hardware.probes import RankPlace
from commbench.inputs.layout import build_layout
from commbench.run.config import RunOptions
from commbench.run.placement import gather_layout
from commbench.run.threads import run_threads


def test_gathered_layout_on_one_host_and_with_overrides():
    found = run_threads(4, gather_layout, (RunOptions("mock"),))
    assert found.method == "host" and found.num_domains == 1 and len(found.places) == 4
    assert found.describe() == (
        "4 ranks in emulated NVLink domains of 1 x 4 ranks, 1 host(s); "  # CPU ranks: no NVLink
        "found by host (no NVLink fabric clique reported: one domain per host)"
    )
    overridden = run_threads(4, gather_layout, (RunOptions("mock", ranks_per_domain=2),))
    assert overridden.method == "override" and overridden.domain_of_rank.tolist() == [0, 0, 1, 1]
    meta = overridden.to_meta()
    assert meta["description"].endswith("found by override (--ranks-per-domain / --ranks-per-host)")
    assert (meta["num_domains"], meta["ranks_per_domain"], meta["num_hosts"]) == (2, [2], 2)
    assert meta["domain_of_rank"] == [0, 0, 1, 1] and len(meta["places"]) == 4


def test_nvml_clique_and_what_if_layouts():
    cluster = "11111111-2222-3333-4444-555555555555"
    places = [RankPlace(host=h, fabric_cluster_uuid=cluster, fabric_clique_id=1) for h in "aabb"]
    layout = build_layout(4, discovered=places)
    assert layout.method == "nvml-clique" and layout.describe().endswith("found by NVML GPU fabric clique")
    # Built without running ranks (a what-if): the description names the source instead.
    assert build_layout(8, ranks_per_domain=4).describe().endswith("2 host(s) (override)")
