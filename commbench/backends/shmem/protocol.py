"""The one-sided (put-based) dispatch/combine protocol, shared by the CPU emulator and the NVSHMEM backend.

Everything here is a pure, vectorized function of the exchanged count matrix, so ``backends.shmem_emu``
(processes on one host, a shared-memory heap) and ``backends.nvshmem`` (GPU kernels) run the very same layout
and signalling, and the emulator's tests exercise the GPU algorithm.

Model
-----
Every rank (PE) holds the same symmetric heap (``heap_layout``): a send staging buffer, two receive buffers
per phase (double buffering by epoch parity, so a receiver may still read iteration k while a fast peer
already writes k+1), and one signal array per phase. Dispatch is a phase with the ``[src, dst]`` row-count
matrix ``counts``; combine is the same phase with ``counts.T`` (the expert side puts each source's rows back
at the row where that source's segment to it started, i.e. the token owner's send order).

* A source ``s`` writes its segment for ``d`` into ``d``'s receive buffer at row
  ``plan.receive_offsets(counts)[s, d]``: sources in rank order, exactly ``all_to_all_single``'s output.
* Each segment is cut into chunks of ``chunk_rows`` rows (``granularity="chunk"``), or sent whole
  (``"segment"``); every work item is one put-with-signal, so the payload is visible before its signal.
  An empty segment still sends one empty put-with-signal: every receiver hears from every source once per
  iteration, which bounds how far a fast rank can run ahead (at most one iteration, covered by the two
  receive buffers).
* Signals: ``op="add"`` (default): every item adds 1 to the receiver's word for its source; the receiver
  keeps a running total per word and waits until the word is >= that total (``CMP_GE``). Words are never
  reset, so buffers are reused across iterations with no reset kernel and no extra barrier, and chunks of a
  segment may land in any order. ``op="set"``: every item sets its own word (one per source, or per
  (source, chunk) with chunk granularity) to the iteration's epoch 1, 2, 3, ...; the receiver waits until
  each word is >= the epoch. SET needs one word per signalling item (a chunk's SET would otherwise overwrite
  another's), ADD needs one word per source.

Counts on the device (``counts="device"``, the backends' ``counts`` option)
-------------------------------------------------------------------------
By default (``counts="host"``) the count matrix is all-gathered with the job's collective and the layout
is computed on the host (a device-to-host copy inside the timed dispatch). With ``counts="device"`` the
count exchange is a third phase of the same protocol, "counts": every source puts its count row ([dst,
slots] int64, one row of ``world x slots x 8`` bytes) with a signal into row ``src`` of every PE's
double-buffered ``counts_recv`` (``count_layout``: a static all-gather), waits for every source's signal,
and computes the dispatch and combine layout from the received matrix with torch operations of fixed shape
on the device (``device_tables``): no host read of a device value, so a CUDA graph can capture it. The put
items are a fixed grid of ``world x chunks`` (chunks = the capacity's largest segment in chunks), an item
past its segment's chunks marked ``rows = -1`` (the put kernel skips it); the waits are one word per
source, their running totals kept on the device (ADD signals only).

NVSHMEM values (from ``nvshmem.h``, not the numbers in some published examples): ``SIGNAL_SET = 9``,
``SIGNAL_ADD = 10``, ``CMP_EQ = 0``, ``CMP_NE = 1``, ``CMP_GT = 2``, ``CMP_LE = 3``, ``CMP_LT = 4``,
``CMP_GE = 5``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from commbench.errors import UsageError
from commbench.traffic.plan import receive_offsets

# nvshmem.h: enum { NVSHMEM_SIGNAL_SET = 9, NVSHMEM_SIGNAL_ADD = 10 } and the NVSHMEM_CMP_* comparisons.
SIGNAL_SET = 9
SIGNAL_ADD = 10
CMP_EQ = 0
CMP_NE = 1
CMP_GT = 2
CMP_LE = 3
CMP_LT = 4
CMP_GE = 5

SIGNAL_OPS = {"add": SIGNAL_ADD, "set": SIGNAL_SET}
GRANULARITIES = ("chunk", "segment")
COUNTS = ("host", "device")  # where the count matrix is exchanged and the layout computed (module docstring)
INACTIVE = -1  # a device table's item past its segment's chunks: no put, no signal
HEAP_ALIGN = 512  # bytes; every heap region starts aligned (vector loads/stores, 8-byte signal words)
SIGNAL_WORD_BYTES = 8  # NVSHMEM signal words are uint64
PHASES = ("dispatch", "combine")


@dataclass(frozen=True)
class SignalConfig:
    """How a phase is cut into put-with-signal items and signalled."""

    granularity: str = "chunk"  # "chunk" | "segment"
    op: str = "add"  # "add" | "set"
    chunk_rows: int = 64

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise UsageError(
                f"signal granularity {self.granularity!r} is unknown; use one of: {', '.join(GRANULARITIES)}"
            )
        if self.op not in SIGNAL_OPS:
            raise UsageError(f"signal op {self.op!r} is unknown; use one of: {', '.join(SIGNAL_OPS)}")
        if self.chunk_rows < 1:
            raise UsageError(f"chunk rows must be >= 1, got {self.chunk_rows}; use e.g. chunk_rows=64")

    @property
    def nvshmem_op(self) -> int:
        return SIGNAL_OPS[self.op]

    def words_per_source(self, max_segment_rows: int) -> int:
        """Signal words a receiver keeps per source: one, or one per chunk for SET with chunk granularity."""
        if self.op == "set" and self.granularity == "chunk":
            return max(1, -(-int(max_segment_rows) // self.chunk_rows))
        return 1


def chunk_rows_for(row_bytes: int, chunk_rows: int | None = None, chunk_bytes: int | None = None) -> int:
    """Rows per chunk from either knob (``chunk_rows`` wins); at least one row."""
    if chunk_rows is not None:
        if int(chunk_rows) < 1:
            raise UsageError(f"chunk_rows must be >= 1, got {chunk_rows}")
        return int(chunk_rows)
    if chunk_bytes is None:
        raise UsageError("give chunk_rows or chunk_bytes")
    if int(chunk_bytes) < 1:
        raise UsageError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    return max(1, int(chunk_bytes) // max(1, int(row_bytes)))


def row_counts(counts: np.ndarray | torch.Tensor) -> np.ndarray:
    """The [src, dst] row matrix from an exchanged count matrix [src, dst] or [src, dst, slots]."""
    if isinstance(counts, torch.Tensor):
        counts = counts.detach().cpu().numpy()
    matrix = np.asarray(counts, dtype=np.int64)
    if matrix.ndim == 3:
        matrix = matrix.sum(axis=2)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
        raise ValueError(f"counts must be [src, dst] or [src, dst, slots], got shape {matrix.shape}")
    if (matrix < 0).any():
        raise ValueError("counts must be non-negative")
    return matrix


@dataclass(frozen=True)
class Capacity:
    """Symmetric buffer sizes in rows, identical on every rank (the worst case over ranks)."""

    send_rows: int  # most rows any rank sends in dispatch (= receives back in combine)
    recv_rows: int  # most rows any rank receives in dispatch (= sends back in combine)
    max_segment_rows: int  # largest (src, dst) segment

    def covers(self, counts: np.ndarray) -> bool:
        other = buffer_capacity(counts)
        return (
            other.send_rows <= self.send_rows
            and other.recv_rows <= self.recv_rows
            and other.max_segment_rows <= self.max_segment_rows
        )


def buffer_capacity(counts: np.ndarray) -> Capacity:
    """Worst case over ranks of the full [src, dst] row matrix (every rank derives the same numbers)."""
    matrix = row_counts(counts)
    return Capacity(
        send_rows=int(matrix.sum(axis=1).max(initial=0)),
        recv_rows=int(matrix.sum(axis=0).max(initial=0)),
        max_segment_rows=int(matrix.max(initial=0)),
    )


@dataclass(frozen=True)
class Region:
    name: str
    offset: int  # bytes from the start of a PE's heap
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class HeapLayout:
    regions: dict[str, Region]
    nbytes: int  # per PE, a multiple of HEAP_ALIGN

    def __getitem__(self, name: str) -> Region:
        return self.regions[name]


def heap_layout(
    capacity: Capacity,
    dispatch_row_bytes: int,
    combine_row_bytes: int,
    dispatch_signals: SignalConfig,
    combine_signals: SignalConfig,
    world_size: int,
    count_slots: int = 0,
) -> HeapLayout:
    """The symmetric heap of one PE; offsets are the same on every PE (symmetric addresses).

    dispatch_send [send_rows, D], dispatch_recv [2, recv_rows, D], combine_send [recv_rows, C],
    combine_recv [2, send_rows, C], and a signal array per phase (uint64 words, held as int64: values stay
    far below 2^63). With ``count_slots`` (counts on the device: the count columns per destination) also
    counts_send [1, K], counts_recv [2, world, K] (K = world x slots x 8 bytes) and counts_signal [world].
    """
    dispatch_words = world_size * dispatch_signals.words_per_source(capacity.max_segment_rows)
    combine_words = world_size * combine_signals.words_per_source(capacity.max_segment_rows)
    wanted = [
        ("dispatch_send", (capacity.send_rows, dispatch_row_bytes), torch.uint8),
        ("dispatch_recv", (2, capacity.recv_rows, dispatch_row_bytes), torch.uint8),
        ("combine_send", (capacity.recv_rows, combine_row_bytes), torch.uint8),
        ("combine_recv", (2, capacity.send_rows, combine_row_bytes), torch.uint8),
        ("dispatch_signal", (dispatch_words,), torch.int64),
        ("combine_signal", (combine_words,), torch.int64),
    ]
    if count_slots:
        count_row = count_row_bytes(world_size, count_slots)
        wanted += [
            ("counts_send", (1, count_row), torch.uint8),
            ("counts_recv", (2, world_size, count_row), torch.uint8),
            ("counts_signal", (world_size,), torch.int64),
        ]
    regions: dict[str, Region] = {}
    offset = 0
    for name, shape, dtype in wanted:
        region = Region(name, offset, tuple(int(v) for v in shape), dtype)
        regions[name] = region
        offset += -(-region.nbytes // HEAP_ALIGN) * HEAP_ALIGN
    return HeapLayout(regions=regions, nbytes=max(offset, HEAP_ALIGN))


# The signal setting with the most words (SET, one word per chunk of one row): a heap laid out with it holds
# at least as much as one of any other setting, for the launch's estimate made before options are known.
WIDEST_SIGNALS = SignalConfig(granularity="chunk", op="set", chunk_rows=1)


def widest_heap(
    counts: np.ndarray, dispatch_row_bytes: int, combine_row_bytes: int, world_size: int, slots: int = 1
) -> HeapLayout:
    """The largest heap a setup for ``counts`` lays out, whatever its options: ``heap_layout`` of the
    busiest rank's capacity with ``WIDEST_SIGNALS`` and the count regions of ``slots`` columns per
    destination (counts on the device; the launch's memory estimate)."""
    capacity = buffer_capacity(counts)
    return heap_layout(
        capacity, dispatch_row_bytes, combine_row_bytes, WIDEST_SIGNALS, WIDEST_SIGNALS, world_size, slots
    )


# The counts phase's signalling: one put-with-signal of the whole row per destination, ADD.
COUNT_SIGNALS = SignalConfig(granularity="segment", op="add", chunk_rows=1)


def count_row_bytes(world_size: int, slots: int) -> int:
    """Bytes of one source's count row: [dst, slots] int64."""
    return int(world_size) * int(slots) * SIGNAL_WORD_BYTES


def count_layout(world_size: int, rank: int) -> PhaseLayout:
    """The counts phase of ``rank`` (counts on the device): one row to every PE, landing at row ``rank`` of
    its ``counts_recv`` (an all-gather), one ADD signal per source."""
    ones = np.ones((world_size, world_size), dtype=np.int64)
    layout = phase_layout(ones, rank, COUNT_SIGNALS, Capacity(world_size, world_size, 1))
    # The one row of counts_send goes to every PE (an all-gather, not segments grouped by destination).
    return dataclasses.replace(layout, item_src_row=np.zeros_like(layout.item_src_row))


def max_chunks(signals: SignalConfig, capacity: Capacity) -> int:
    """Items per destination in a device table: the capacity's largest segment in chunks (1 per segment)."""
    if signals.granularity == "segment":
        return 1
    return max(1, -(-int(capacity.max_segment_rows) // signals.chunk_rows))


def device_tables(
    rows: torch.Tensor, rank: int, signals: SignalConfig, chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The put items and wait increments of ``rank`` for a phase whose rows go ``rows[src, dst]`` (int64,
    on any device), computed with torch operations of fixed shape and no host read (module docstring):
    (items int64 [world x chunks, 5] as ``PhaseLayout.items_table``, rows -1 past a segment's chunks;
    increments int64 [world]: the ADD signals each source sends this rank). For ADD signals (one word per
    source); ``phase_layout`` is the host's same layout."""
    if signals.op != "add":
        raise ValueError("device tables keep one word per source: ADD signals only")
    world = int(rows.shape[0])
    device = rows.device
    send = rows[rank]
    starts = torch.cumsum(send, 0) - send  # exclusive: first row of each destination's segment
    offsets = rows[:rank].sum(dim=0)  # where this rank's segment starts in each destination (rank order)
    dst = torch.arange(world, dtype=torch.int64, device=device).repeat_interleave(chunks)
    chunk = torch.arange(chunks, dtype=torch.int64, device=device).repeat(world)
    seg = send[dst]
    if signals.granularity == "segment":
        start = torch.zeros_like(chunk)
        count = seg
        active = chunk == 0
    else:
        start = chunk * signals.chunk_rows
        count = torch.clamp(seg - start, min=0, max=signals.chunk_rows)
        active = chunk < torch.clamp((seg + signals.chunk_rows - 1) // signals.chunk_rows, min=1)
    count = torch.where(active, count, torch.full_like(count, INACTIVE))
    word = torch.full_like(dst, rank)
    items = torch.stack([dst, starts[dst] + start, offsets[dst] + start, count, word], dim=1)
    received = rows[:, rank]
    if signals.granularity == "segment":
        increments = torch.ones_like(received)
    else:
        increments = torch.clamp((received + signals.chunk_rows - 1) // signals.chunk_rows, min=1)
    return items, increments


def active_items(items: np.ndarray) -> np.ndarray:
    """A device table's items that put (rows >= 0), in table order (``PhaseLayout.items_table``'s)."""
    table = np.asarray(items, dtype=np.int64)
    return table[table[:, 3] != INACTIVE]


@dataclass(frozen=True)
class PhaseLayout:
    """One rank's view of one phase (dispatch: ``counts``; combine: ``counts.T``).

    Put items are what this rank issues (as a source); waits are what it checks (as a destination).
    Rows are in units of the phase's row size; receive rows are within one of the two receive buffers.
    """

    rank: int
    world_size: int
    signals: SignalConfig
    words_per_source: int
    send_rows: int  # rows this rank sends (its staging buffer holds them grouped by destination)
    recv_rows: int  # rows this rank receives
    recv_splits: np.ndarray  # int64 [world]: rows from each source
    send_splits: np.ndarray  # int64 [world]: rows to each destination
    # Put items, int64 [items] each.
    item_dst: np.ndarray
    item_src_row: np.ndarray  # first row in this rank's staging buffer
    item_dst_row: np.ndarray  # first row in the destination's receive buffer
    item_rows: np.ndarray  # rows in the item (0 for an empty segment's signal-only put)
    item_word: np.ndarray  # signal word index in the destination's signal array
    # Waits, int64 [waits] each.
    wait_source: np.ndarray
    wait_word: np.ndarray  # signal word index in this rank's signal array
    wait_increment: np.ndarray  # signals per iteration on that word (ADD); 1 per word for SET

    @property
    def num_items(self) -> int:
        return int(self.item_dst.size)

    def items_table(self) -> np.ndarray:
        """int64 [items, 5]: dst, src_row, dst_row, rows, word (what a GPU kernel reads)."""
        return np.stack(
            [self.item_dst, self.item_src_row, self.item_dst_row, self.item_rows, self.item_word], axis=1
        ).astype(np.int64)


def _chunks(rows: np.ndarray, chunk_rows: int, granularity: str) -> np.ndarray:
    """Items per segment: at least one (an empty segment still signals)."""
    if granularity == "segment":
        return np.ones_like(rows)
    return np.maximum(1, -(-rows // chunk_rows))


def phase_layout(counts: np.ndarray, rank: int, signals: SignalConfig, capacity: Capacity) -> PhaseLayout:
    """Put items and waits of ``rank`` for a phase whose rows go ``counts[src, dst]``."""
    matrix = row_counts(counts)
    world = matrix.shape[0]
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of {world}")
    words = signals.words_per_source(capacity.max_segment_rows)
    offsets = receive_offsets(matrix)  # [src, dst]

    # As a source: segments to every destination, cut into items.
    send_splits = matrix[rank]
    send_starts = np.concatenate([[0], np.cumsum(send_splits)[:-1]]).astype(np.int64)
    per_segment = _chunks(send_splits, signals.chunk_rows, signals.granularity)
    item_dst = np.repeat(np.arange(world, dtype=np.int64), per_segment)
    first_item = np.concatenate([[0], np.cumsum(per_segment)[:-1]]).astype(np.int64)
    chunk_index = np.arange(item_dst.size, dtype=np.int64) - np.repeat(first_item, per_segment)
    seg_rows = send_splits[item_dst]
    if signals.granularity == "segment":
        start_in_segment = np.zeros_like(item_dst)
        item_rows = seg_rows.copy()
    else:
        start_in_segment = chunk_index * signals.chunk_rows
        item_rows = np.clip(seg_rows - start_in_segment, 0, signals.chunk_rows)
    item_src_row = send_starts[item_dst] + start_in_segment
    item_dst_row = offsets[rank, item_dst] + start_in_segment
    # My word in the destination's array: one per source, or per (source, chunk) for SET + chunk.
    item_word = rank * words + (chunk_index if words > 1 else np.zeros_like(chunk_index))

    # As a destination: which words to wait on and by how much they grow per iteration.
    recv_splits = matrix[:, rank]
    from_source = _chunks(recv_splits, signals.chunk_rows, signals.granularity)
    if signals.op == "add":
        wait_source = np.arange(world, dtype=np.int64)
        wait_word = wait_source * words
        wait_increment = from_source.astype(np.int64)
    else:
        wait_source = np.repeat(np.arange(world, dtype=np.int64), from_source)
        first = np.concatenate([[0], np.cumsum(from_source)[:-1]]).astype(np.int64)
        local_chunk = np.arange(wait_source.size, dtype=np.int64) - np.repeat(first, from_source)
        wait_word = wait_source * words + local_chunk
        wait_increment = np.ones_like(wait_source)
    return PhaseLayout(
        rank=rank,
        world_size=world,
        signals=signals,
        words_per_source=words,
        send_rows=int(send_splits.sum()),
        recv_rows=int(recv_splits.sum()),
        recv_splits=recv_splits.astype(np.int64),
        send_splits=send_splits.astype(np.int64),
        item_dst=item_dst,
        item_src_row=item_src_row.astype(np.int64),
        item_dst_row=item_dst_row.astype(np.int64),
        item_rows=item_rows.astype(np.int64),
        item_word=item_word.astype(np.int64),
        wait_source=wait_source,
        wait_word=wait_word.astype(np.int64),
        wait_increment=wait_increment,
    )


def signal_value(op: str, epoch: int) -> int:
    """Value each put-with-signal carries in iteration ``epoch`` (1, 2, ...): 1 for ADD, the epoch for SET."""
    if epoch < 1:
        raise ValueError(f"epochs start at 1, got {epoch}")
    return 1 if op == "add" else int(epoch)


def parity(epoch: int) -> int:
    """Which of the two receive buffers iteration ``epoch`` uses."""
    return int(epoch) % 2


class SignalTracker:
    """A receiver's expected signal values for one phase, advanced once per iteration.

    ADD: running totals per word (never reset, so never re-armed); SET: the epoch itself. Both compared
    with ``CMP_GE``. ``epoch`` counts the phase's iterations from 1 and also selects the receive buffer.
    """

    def __init__(self, op: str, num_words: int) -> None:
        self.op = op
        self.epoch = 0
        self.totals = np.zeros(num_words, dtype=np.int64)  # ADD: signals received so far, per word

    def advance(self, layout: PhaseLayout) -> tuple[int, np.ndarray]:
        """Start the next iteration: (epoch, expected value per wait of ``layout``)."""
        self.epoch += 1
        if self.op == "add":
            self.totals[layout.wait_word] += layout.wait_increment
            return self.epoch, self.totals[layout.wait_word].copy()
        return self.epoch, np.full(layout.wait_word.size, self.epoch, dtype=np.int64)


def missing_sources(layout: PhaseLayout, words: np.ndarray, expected: np.ndarray) -> list[int]:
    """Sources whose signals have not all arrived (for error messages), given the receiver's signal words."""
    short = words[layout.wait_word] < expected
    return sorted({int(s) for s in layout.wait_source[short]})


def expert_major_blocks(recv_counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each received row in source order (sources in rank order, each by local expert, as sent): the id
    ``e * world + src`` of its (expert, source) block in expert-major order, and its index inside the block.

    ``recv_counts[src, e]``: rows per (source, local expert). ``all_to_all_vdev_2d`` writes blocks
    expert-major; position = block start (from the op's output offsets) + index inside the block.
    """
    counts = np.asarray(recv_counts, dtype=np.int64)
    world, experts = counts.shape
    flat = counts.reshape(-1)  # source-major blocks (src, e)
    block_start = np.concatenate([[0], np.cumsum(flat)[:-1]]).astype(np.int64)
    source_major = np.repeat(np.arange(flat.size, dtype=np.int64), flat)
    within = np.arange(source_major.size, dtype=np.int64) - block_start[source_major]
    src, expert = source_major // experts, source_major % experts
    return expert * world + src, within


def expert_major_order(recv_counts: np.ndarray, out_offsets_rows: np.ndarray) -> np.ndarray:
    """Row in the expert-major buffer of each source-order row; block starts (rows) in
    ``out_offsets_rows[e * world + src]``."""
    block, within = expert_major_blocks(recv_counts)
    return np.asarray(out_offsets_rows, dtype=np.int64)[block] + within


def phase_signal_configs(
    granularity: str,
    op: str,
    dispatch_row_bytes: int,
    combine_row_bytes: int,
    chunk_rows: int | None = None,
    chunk_bytes: int | None = None,
) -> tuple[SignalConfig, SignalConfig]:
    """Signal configs of dispatch and combine: ``chunk_rows`` as given, else ``chunk_bytes`` / row size."""
    dispatch_rows = chunk_rows_for(dispatch_row_bytes, chunk_rows, chunk_bytes)
    combine_rows = chunk_rows_for(max(1, combine_row_bytes), chunk_rows, chunk_bytes)
    return (
        SignalConfig(granularity=granularity, op=op, chunk_rows=dispatch_rows),
        SignalConfig(granularity=granularity, op=op, chunk_rows=combine_rows),
    )
