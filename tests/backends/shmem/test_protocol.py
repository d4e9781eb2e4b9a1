"""The one-sided protocol: offsets, chunking, signal values and epochs, checked by simulating every rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from commbench.backends.shmem import protocol as proto
from commbench.errors import UsageError
from commbench.traffic.plan import receive_offsets

SKEWED = np.array(
    [
        [5, 0, 17, 2],
        [0, 0, 0, 9],
        [33, 1, 0, 4],
        [7, 7, 7, 0],
    ],
    dtype=np.int64,
)


def run_phase(
    counts: np.ndarray, signals: proto.SignalConfig, payload: list[np.ndarray], words: list, epoch: int
):
    """Apply every rank's put items to per-rank receive buffers and signal words, as the emulator does."""
    world = counts.shape[0]
    capacity = proto.buffer_capacity(counts)
    layouts = [proto.phase_layout(counts, rank, signals, capacity) for rank in range(world)]
    buffers = [np.full(max(1, capacity.recv_rows), -1, dtype=np.int64) for _ in range(world)]
    value = proto.signal_value(signals.op, epoch)
    for src, layout in enumerate(layouts):
        for dst, src_row, dst_row, rows, word in layout.items_table().tolist():
            buffers[dst][dst_row : dst_row + rows] = payload[src][src_row : src_row + rows]
            words[dst][word] = words[dst][word] + value if signals.op == "add" else value
    return layouts, buffers


def send_payload(counts: np.ndarray) -> list[np.ndarray]:
    """Row r of rank s carries s * 1000 + r (rows grouped by destination, as a plan's send order)."""
    return [src * 1000 + np.arange(counts[src].sum(), dtype=np.int64) for src in range(counts.shape[0])]


def all_to_all_reference(counts: np.ndarray, payload: list[np.ndarray], dst: int) -> np.ndarray:
    """What all_to_all_single delivers to ``dst``: each source's segment for it, sources in rank order."""
    parts = []
    for src in range(counts.shape[0]):
        start = counts[src, :dst].sum()
        parts.append(payload[src][start : start + counts[src, dst]])
    return np.concatenate(parts)


def test_header_constants() -> None:
    assert (proto.SIGNAL_SET, proto.SIGNAL_ADD) == (9, 10)
    assert (proto.CMP_EQ, proto.CMP_NE, proto.CMP_GT, proto.CMP_LE, proto.CMP_LT, proto.CMP_GE) == (
        0,
        1,
        2,
        3,
        4,
        5,
    )
    assert proto.SignalConfig(op="add").nvshmem_op == 10
    assert proto.SignalConfig(op="set").nvshmem_op == 9


def test_row_counts_and_capacity() -> None:
    per_expert = np.stack([SKEWED, SKEWED * 2], axis=2)  # [src, dst, slots]
    np.testing.assert_array_equal(proto.row_counts(per_expert), SKEWED * 3)
    np.testing.assert_array_equal(proto.row_counts(torch.from_numpy(SKEWED)), SKEWED)
    capacity = proto.buffer_capacity(SKEWED)
    assert capacity == proto.Capacity(send_rows=38, recv_rows=45, max_segment_rows=33)
    assert capacity.covers(SKEWED // 2)
    assert not capacity.covers(SKEWED + np.eye(4, dtype=np.int64) * 40)
    with pytest.raises(ValueError):
        proto.row_counts(np.ones((2, 3), dtype=np.int64))
    with pytest.raises(ValueError):
        proto.row_counts(-np.ones((2, 2), dtype=np.int64))


def test_chunk_rows_and_config_validation() -> None:
    assert proto.chunk_rows_for(7392, chunk_bytes=128 * 1024) == 17
    assert proto.chunk_rows_for(7392, chunk_rows=4, chunk_bytes=1 << 20) == 4
    assert proto.chunk_rows_for(1 << 20, chunk_bytes=1024) == 1
    with pytest.raises(UsageError):
        proto.chunk_rows_for(64, chunk_rows=0)
    with pytest.raises(UsageError, match="granularity"):
        proto.SignalConfig(granularity="row")
    with pytest.raises(UsageError, match="signal op"):
        proto.SignalConfig(op="xor")
    dispatch, combine = proto.phase_signal_configs("chunk", "add", 7392, 14336, chunk_bytes=1 << 16)
    assert (dispatch.chunk_rows, combine.chunk_rows) == (8, 4)


@pytest.mark.parametrize(
    "signals",
    [
        proto.SignalConfig("chunk", "add", 4),
        proto.SignalConfig("chunk", "set", 4),
        proto.SignalConfig("segment", "add", 4),
        proto.SignalConfig("segment", "set", 4),
        proto.SignalConfig("chunk", "add", 1),
    ],
)
def test_puts_deliver_all_to_all_order_and_signals_match_waits(signals: proto.SignalConfig) -> None:
    world = SKEWED.shape[0]
    capacity = proto.buffer_capacity(SKEWED)
    payload = send_payload(SKEWED)
    num_words = world * signals.words_per_source(capacity.max_segment_rows)
    words = [np.zeros(num_words, dtype=np.int64) for _ in range(world)]
    trackers = [proto.SignalTracker(signals.op, num_words) for _ in range(world)]
    for epoch in (1, 2, 3):  # the same words serve every iteration, never reset
        layouts, buffers = run_phase(SKEWED, signals, payload, words, epoch)
        for dst in range(world):
            layout = layouts[dst]
            got_epoch, expected = trackers[dst].advance(layout)
            assert got_epoch == epoch
            expect = all_to_all_reference(SKEWED, payload, dst)
            np.testing.assert_array_equal(buffers[dst][: layout.recv_rows], expect)
            np.testing.assert_array_equal(layout.recv_splits, SKEWED[:, dst])
            # Every expected signal has arrived, and not one more (ADD) / exactly this epoch (SET).
            np.testing.assert_array_equal(words[dst][layout.wait_word], expected)
            assert proto.missing_sources(layout, words[dst], expected) == []
            # One iteration less would be detected, naming the sources whose signals are short.
            if signals.op == "add":
                short = words[dst].copy()
                short[layout.wait_word[2]] -= 1
                assert proto.missing_sources(layout, short, expected) == [int(layout.wait_source[2])]


def test_items_cover_every_segment_once_in_chunks() -> None:
    signals = proto.SignalConfig("chunk", "add", 5)
    capacity = proto.buffer_capacity(SKEWED)
    offsets = receive_offsets(SKEWED)
    for rank in range(4):
        layout = proto.phase_layout(SKEWED, rank, signals, capacity)
        assert layout.num_items == sum(max(1, -(-n // 5)) for n in SKEWED[rank])
        assert (layout.item_rows <= 5).all() and (layout.item_rows >= 0).all()
        for dst in range(4):
            mine = layout.item_dst == dst
            rows = layout.item_rows[mine]
            assert rows.sum() == SKEWED[rank, dst]
            assert (rows == 0).sum() == (1 if SKEWED[rank, dst] == 0 else 0)  # an empty segment still signals
            # Contiguous chunks from the segment's start, same shift on both sides.
            starts = layout.item_dst_row[mine]
            assert starts[0] == offsets[rank, dst]
            np.testing.assert_array_equal(np.diff(starts), rows[:-1])
            np.testing.assert_array_equal(
                layout.item_src_row[mine] - starts, SKEWED[rank, :dst].sum() - starts[0]
            )
        # ADD: one word per source; each word has a single writer (its source).
        assert (layout.item_word == rank).all()
        np.testing.assert_array_equal(layout.wait_increment, [max(1, -(-n // 5)) for n in SKEWED[:, rank]])


def test_set_with_chunks_uses_a_word_per_chunk() -> None:
    signals = proto.SignalConfig("chunk", "set", 10)
    capacity = proto.buffer_capacity(SKEWED)
    words = signals.words_per_source(capacity.max_segment_rows)
    assert words == 4  # ceil(33 / 10)
    layout = proto.phase_layout(SKEWED, 2, signals, capacity)
    np.testing.assert_array_equal(layout.item_word[layout.item_dst == 0], [8, 9, 10, 11])  # 33 rows to rank 0
    receiver = proto.phase_layout(SKEWED, 0, signals, capacity)
    np.testing.assert_array_equal(receiver.wait_word[receiver.wait_source == 2], [8, 9, 10, 11])
    tracker = proto.SignalTracker("set", 4 * words)
    tracker.advance(receiver)
    assert (tracker.advance(receiver)[1] == 2).all()


def test_combine_is_dispatch_with_the_transpose_back_into_send_order() -> None:
    """Expert side puts each source's rows back where that source's segment to it began (its send order)."""
    signals = proto.SignalConfig("chunk", "add", 3)
    world = SKEWED.shape[0]
    payload = send_payload(SKEWED)
    words = [np.zeros(world, dtype=np.int64) for _ in range(world)]
    _, received = run_phase(SKEWED, signals, payload, words, 1)
    expert_rows = [received[r][: SKEWED[:, r].sum()] for r in range(world)]
    combine_words = [np.zeros(world, dtype=np.int64) for _ in range(world)]
    layouts, returned = run_phase(SKEWED.T.copy(), signals, expert_rows, combine_words, 1)
    for rank in range(world):
        assert layouts[rank].recv_rows == SKEWED[rank].sum()
        np.testing.assert_array_equal(returned[rank][: layouts[rank].recv_rows], payload[rank])


def test_heap_layout_regions_are_aligned_and_disjoint() -> None:
    capacity = proto.buffer_capacity(SKEWED)
    dispatch, combine = proto.SignalConfig("chunk", "set", 10), proto.SignalConfig("chunk", "add", 10)
    heap = proto.heap_layout(capacity, 7392, 14336, dispatch, combine, 4)
    regions = sorted(heap.regions.values(), key=lambda r: r.offset)
    for region, following in zip(regions, regions[1:], strict=False):
        assert region.offset % proto.HEAP_ALIGN == 0
        assert region.offset + region.nbytes <= following.offset
    assert regions[-1].offset + regions[-1].nbytes <= heap.nbytes
    assert heap["dispatch_recv"].shape == (2, 45, 7392)
    assert heap["combine_recv"].shape == (2, 38, 14336)
    assert heap["dispatch_signal"].shape == (16,) and heap["combine_signal"].shape == (4,)


def test_empty_world_one_layout_still_signals() -> None:
    zero = np.zeros((1, 1), dtype=np.int64)
    layout = proto.phase_layout(zero, 0, proto.SignalConfig(), proto.buffer_capacity(zero))
    assert layout.num_items == 1 and layout.item_rows.tolist() == [0]
    assert layout.wait_increment.tolist() == [1]


def test_parity_and_signal_values() -> None:
    assert [proto.parity(e) for e in (1, 2, 3)] == [1, 0, 1]
    assert proto.signal_value("add", 7) == 1
    assert proto.signal_value("set", 7) == 7
    with pytest.raises(ValueError):
        proto.signal_value("set", 0)


def test_expert_major_order_recovers_source_order() -> None:
    """all_to_all_vdev_2d lays blocks expert-major (e, src); mapping back must give source order."""
    recv = np.array([[2, 0, 1], [1, 3, 0]], dtype=np.int64)  # [src, expert]
    world, experts = recv.shape
    source_order = np.arange(recv.sum())  # rows as sent: src 0 (e0, e0, e2), src 1 (e0, e1, e1, e1)
    block_rows = {}
    position = 0
    for s in range(world):
        for e in range(experts):
            block_rows[(e, s)] = source_order[position : position + recv[s, e]]
            position += recv[s, e]
    expert_major, starts = [], np.zeros(world * experts, dtype=np.int64)
    for e in range(experts):
        for s in range(world):
            starts[e * world + s] = len(expert_major)
            expert_major.extend(block_rows[(e, s)])
        expert_major.append(-1)  # padding between experts, as major_align adds
    order = proto.expert_major_order(recv, starts)
    np.testing.assert_array_equal(np.asarray(expert_major)[order], source_order)
