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

# DeepEP dd758ca tests/legacy/test_intranode.py:188-216: recv_x.numel() x 2 bytes (the BF16 rows the rank
# received, its own included; x (1 + 4/128) / 2 for FP8) over bench() of Buffer.dispatch (CUDA events, the
# mean), the same bytes sent back over bench() of Buffer.combine; its tuning loop times a cached-handle
# dispatch (no layout, no count exchange), commbench's row the layout call and a non-cached dispatch.
# tests/legacy/test_low_latency.py:218-224: one message per selection (topk_idx != -1) of the rank, its
# own experts included, over bench_kineto's kernel time ('dispatch', 'combine'); a dispatch message is
# the kernel's num_bytes_per_msg, the row and a 16-byte int4 header (internode_ll.cu:180; the test's FP8
# "hidden + hidden / 128 x 4 + 16"), a combine one hidden x 2 bytes. commbench runs BF16 dispatch, so the
# figure counts the BF16 message (2 x hidden + 16): DeepEP's FP8 printout counts about half the bytes.
# tests/elastic/test_ep.py:253-262, 287-346 (V2): count_bytes(recv_x, recv_topk_idx, recv_topk_weights) per
# received token over the dispatch kernel (bench_kineto 'dispatch_impl'), "GB/s (SU)": every token the
# rank received, its own included (without --ignore-local-traffic); combine: the BF16 rows sent back.
DEEP_EP = (
    LibraryBandwidth(
        library="DeepEP",
        phase="dispatch",
        label="GB/s (NVL)",
        bytes_column="max_recv_bytes",
        time_column="time_us_mean",
        bytes_meaning="token rows the rank received, its own tokens included (FP8 scales included)",
        time_meaning="the Buffer.dispatch call (CUDA events), mean over iterations; DeepEP's tuning loop "
        "times a cached-handle dispatch, commbench get_dispatch_layout + a non-cached one",
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
        bytes_meaning="one message per (token, expert) selection of the rank, local experts included: the "
        "BF16 row and its 16-byte header (DeepEP's test prints FP8 messages, hidden + hidden/128 x 4 + 16 B)",
        time_meaning="the dispatch kernel alone (profiler), mean over iterations",
        modes=("low_latency",),
        extra_bytes_per_row=16,
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
    LibraryBandwidth(
        library="DeepEP",
        phase="dispatch",
        label="GB/s (SU)",
        bytes_column="max_recv_bytes",
        time_column="time_us_mean",
        bytes_meaning="token rows the rank received through scale-up, its own included, each with its top-k "
        "ids and weights (count_bytes(recv_x, recv_topk_idx, recv_topk_weights))",
        time_meaning="the dispatch_impl kernel (profiler), mean over iterations",
        modes=("elastic",),
        extra_bytes_column="token_meta_bytes",
    ),
    LibraryBandwidth(
        library="DeepEP",
        phase="combine",
        label="GB/s (SU)",
        bytes_column="max_send_bytes",
        time_column="time_us_mean",
        bytes_meaning="the BF16 rows the rank sent back, one per token it received (DeepEP's test also "
        "counts top-k weights, which its combine carries only when given them: commbench's forward combine "
        "gives none)",
        time_meaning="the combine_impl kernel (profiler), mean over iterations",
        modes=("elastic",),
    ),
)

# UCCL-EP's benchmarks are DeepEP's tests (uccl ep/bench/test_intranode.py, test_low_latency.py), but its
# low-latency one counts a BF16 dispatch as hidden x 2 bytes per selection, no header (test_low_latency.py:
# 424-430), though its kernel sends one (ep/src/internode_ll.cu:105-106).
_UCCL_LL_DISPATCH = (
    "one message per (token, expert) selection of the rank, local experts included: hidden x 2 bytes (its "
    "test counts no header for a BF16 dispatch)"
)
UCCL_EP = tuple(
    replace(
        item,
        library="UCCL-EP",
        modes=tuple(mode for mode in item.modes if mode != "hybrid"),
        **(
            {"bytes_meaning": _UCCL_LL_DISPATCH, "extra_bytes_per_row": 0} if item.extra_bytes_per_row else {}
        ),
    )
    for item in DEEP_EP
    if "elastic" not in item.modes
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
