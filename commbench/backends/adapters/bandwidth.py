"""How each dispatcher library defines the bandwidth it prints, in terms of commbench's result-row columns.

Every library divides some bytes by some time, and each picks differently: DeepEP's normal kernels count the
token rows a rank received, its own included ("logical" bytes), over the dispatch call; its low-latency test
counts one row per (token, expert) selection over the kernel alone; pplx-kernels counts tokens x experts
per token; NCCL EP's benchmark counts per-rank totals by direction. commbench's own columns (algbw, busbw)
count the bottleneck rank's bytes without self traffic over the slowest rank's time. Each ``LibraryBandwidth``
says which row columns reproduce one library figure; each adapter class carries its library's figures as
``bandwidth_vocabulary``, so ``report.interop.vocabulary`` can print them beside busbw "as the library prints
it". The libraries print one figure per rank; the row holds the rank with the most bytes (``max_send_bytes``
/ ``max_recv_bytes``, self traffic included) and the iteration's slowest rank, so the figure is the one the
library shows on its busiest rank when ranks finish together.
"""

from __future__ import annotations

from dataclasses import replace

from commbench.run.describe import LibraryBandwidth

# DeepEP 2.1.0 tests/legacy/test_intranode.py: recv_x bytes / the dispatch call (and the same bytes sent
# back / the combine call), CUDA-event bench, per rank; tests/legacy/test_low_latency.py: selections x token
# bytes / kernel time from the profiler.
DEEP_EP = (
    LibraryBandwidth(
        library="DeepEP",
        phase="dispatch",
        label="GB/s (NVL)",
        bytes_column="max_recv_bytes",
        time_column="time_us_mean",
        bytes_meaning="token rows the rank received, its own tokens included (FP8 scales included)",
        time_meaning="the Buffer.dispatch call (CUDA events), mean over iterations",
        modes=("normal", "hybrid"),
    ),
    LibraryBandwidth(
        library="DeepEP",
        phase="combine",
        label="GB/s (NVL)",
        bytes_column="max_send_bytes",
        time_column="time_us_mean",
        bytes_meaning="the rows the rank sent back: one per row it received in dispatch, local included",
        time_meaning="the Buffer.combine call (CUDA events), mean over iterations",
        modes=("normal", "hybrid"),
    ),
    LibraryBandwidth(
        library="DeepEP",
        phase="dispatch",
        label="Dispatch bandwidth",
        bytes_column="max_send_bytes",
        time_column="time_us_mean",
        bytes_meaning="one token row per (token, expert) selection of the rank, local experts included",
        time_meaning="the dispatch kernel alone (profiler), mean over iterations",
        modes=("low_latency",),
    ),
    LibraryBandwidth(
        library="DeepEP",
        phase="combine",
        label="Combine bandwidth",
        bytes_column="max_recv_bytes",
        time_column="time_us_mean",
        bytes_meaning="one BF16 row per selection of the rank's tokens, local experts included",
        time_meaning="the combine kernel alone (profiler), mean over iterations",
        modes=("low_latency",),
    ),
)

# UCCL-EP's benchmarks are DeepEP's tests (uccl ep/bench/test_intranode.py, test_low_latency.py).
UCCL_EP = tuple(
    replace(item, library="UCCL-EP", modes=tuple(mode for mode in item.modes if mode != "hybrid"))
    for item in DEEP_EP
)

# pplx-kernels tests/bench_all_to_all.py: tokens x experts_per_token x token bytes / CUDA events around the
# call, mean over samples, per rank.
PPLX = (
    LibraryBandwidth(
        library="pplx-kernels",
        phase="dispatch",
        label="Dispatch_bw",
        bytes_column="max_send_bytes",
        time_column="time_us_mean",
        bytes_meaning="tokens x experts_per_token x token bytes the rank sends, its own experts included",
        time_meaning="CUDA events around AllToAll.dispatch, mean over samples",
    ),
    LibraryBandwidth(
        library="pplx-kernels",
        phase="combine",
        label="Combine_bw",
        bytes_column="max_recv_bytes",
        time_column="time_us_mean",
        bytes_meaning="tokens x experts_per_token x hidden x output bytes back at the rank, own experts in",
        time_meaning="CUDA events around AllToAll.combine, mean over samples",
    ),
)

# NCCL contrib/nccl_ep/ep_bench.cu: bytes / the average time of the call. HT prints six figures; total_recv
# (the (source, token) pairs a rank received) is the one commbench's rows reproduce: its send side counts a
# token once per destination node, which rank-to-rank rows cannot split. LL: valid selections x bytes.
NCCL_EP = (
    LibraryBandwidth(
        library="NCCL EP",
        phase="dispatch",
        label="total_recv",
        bytes_column="max_recv_bytes",
        time_column="time_us_mean",
        bytes_meaning="token rows the rank received, from every source including itself",
        time_meaning="ncclEpDispatch (CUDA events), mean over iterations",
        modes=("ht",),
    ),
    LibraryBandwidth(
        library="NCCL EP",
        phase="combine",
        label="total_send",
        bytes_column="max_send_bytes",
        time_column="time_us_mean",
        bytes_meaning="the rows the rank sent back, one per row it received",
        time_meaning="ncclEpCombine (CUDA events), mean over iterations",
        modes=("ht",),
    ),
    LibraryBandwidth(
        library="NCCL EP",
        phase="dispatch",
        label="dispatch throughput",
        bytes_column="max_send_bytes",
        time_column="time_us_mean",
        bytes_meaning="valid selections of the rank x token bytes, local experts included",
        time_meaning="ncclEpDispatch (CUDA events), mean over iterations",
        modes=("ll",),
    ),
    LibraryBandwidth(
        library="NCCL EP",
        phase="combine",
        label="combine throughput",
        bytes_column="max_recv_bytes",
        time_column="time_us_mean",
        bytes_meaning="valid selections of the rank x BF16 hidden bytes, local experts included",
        time_meaning="ncclEpCombine (CUDA events), mean over iterations",
        modes=("ll",),
    ),
)
