"""Row encoding and checks: every received byte and every combined element is verified (nccl-tests' #wrong).

Dispatch rows are uint8 ``[n, row_bytes]``. A row's first 8 bytes hold its header, int32 source rank and int32
token index (native byte order), when ``row_bytes >= 8``; every byte is a function of (source, token, column),
so two different rows differ and a receiver regenerates exactly what it must have received (``expected_rows``)
and counts mismatched bytes.

Combine stands in for expert compute with ``expert_outputs(src, token, key, hidden)``: small integers / 64,
exact in bfloat16, computed on the expert side from the header DECODED from the received row (so a misrouted
row also breaks combine) and the row's key (destination rank in token mode, expert id in selection mode).
The token owner's reference is ``out[t] = sum_r w[r] * g(owner, t, key[r])`` over its send rows r of token t,
accumulated in float64; an element is wrong unless

    |out - ref| <= COMBINE_RTOL * sum_r |w[r] * g| + COMBINE_ATOL

(NaN is wrong). The relative term covers float32 products and accumulation order (atomics on GPU).

Receive buffers are poisoned (``poison_``: every byte ``POISON_BYTE`` = 0xFF) before each checked
iteration, so an iteration that delivers nothing leaves a sentinel no valid row can hold: the header reads
(src -1, token -1), and every bfloat16 or float32 element is a NaN. ``RowCheck`` verifies dispatch rows in
full (mismatched bytes) or by checksum (``row_checksums``: the first 8 bytes exactly plus a wrapping int64
sum of the row's 8-byte words; a row whose checksum differs counts as all its bytes); ``CombineCheck``
compares combine output element by element with the tolerance above, with reused scratch buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from commbench.traffic.plan import RankPlan

COMBINE_RTOL = 1e-4
COMBINE_ATOL = 1e-6
HEADER_BYTES = 8
# Fills receive buffers before a checked iteration: header (-1, -1), no real (src, token); NaN as bf16/fp32.
POISON_BYTE = 0xFF
_WORD_BYTES = 8

_MASK32 = 0xFFFFFFFF
# Rows of the float64 reference computed at once (bounds memory for large hidden sizes).
_REFERENCE_CHUNK_ELEMENTS = 1 << 24


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A cheap integer hash of int64 values in [0, 2^32); every intermediate stays below 2^63."""
    x = x & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


# A column's hash is two-level, so no int64 array as wide as a row is ever made (hashing 16 M int64 column
# indices was most of a 64 MiB sweep's set-up: ~1 s and 4 GiB of page faults per rank): a table of 64 K
# hashed bytes, read from a per-block rotation and xor-ed with a per-block byte. Shifting a row by a
# multiple of the block then still changes its bytes (a different rotation), as a flat hash would.
_BLOCK = 1 << 16
_TABLES: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # per device: (byte table twice, 0..255)


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = str(device)
    if key not in _TABLES:
        table = (_mix32(torch.arange(_BLOCK, dtype=torch.int64, device=device) + 0x5BD1E995) & 0xFF).to(
            torch.uint8
        )
        _TABLES[key] = (torch.cat([table, table]), torch.arange(256, dtype=torch.uint8, device=device))
    return _TABLES[key]


def _column_terms(row_bytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(column & 0xFF, hash(column) & 0xFF) as uint8 [row_bytes] on ``device``: the hash of column c in
    block k = c // 64 Ki is table[(c + rotation[k]) mod 64 Ki] xor salt[k] (rotation, salt: hashes of k)."""
    doubled, low = _tables(device)
    blocks = max(1, -(-row_bytes // _BLOCK))
    block = _mix32(torch.arange(blocks, dtype=torch.int64, device=device) * 0x9E3779B1 + 0x27D4EB2F)
    rotation, salt = block & (_BLOCK - 1), ((block >> 16) & 0xFF).to(torch.uint8)
    # unfold: row j of the view is doubled[j : j + 64 Ki], so indexing it by rotation gathers each block.
    hashed = doubled.unfold(0, _BLOCK, 1)[rotation].bitwise_xor_(salt.unsqueeze(1)).reshape(-1)[:row_bytes]
    column_low = low.repeat(-(-row_bytes // 256))[:row_bytes]
    return column_low, hashed


def encode_rows(src_rank: int | torch.Tensor, token_index: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """Rows of ``(src_rank, token)``: uint8 [n, row_bytes] on ``token_index``'s device.

    body[c] = (a + b * c) xor p[c] mod 256 with a, b (b odd) from a hash of (src, token) and p a hash of the
    column, so shifted, swapped or stale rows all mismatch; the header then makes every row unique. Rows
    shorter than 8 bytes have no header (tiny balanced sizes) and may repeat.
    """
    token = token_index.to(torch.int64).reshape(-1)
    device = token.device
    src = torch.as_tensor(src_rank, dtype=torch.int64, device=device).expand_as(token)
    row_hash = _mix32(src * 0x9E3779B1 + token)
    offset = (row_hash & 0xFF).to(torch.uint8).unsqueeze(1)
    stride = (((row_hash >> 8) & 0xFF) | 1).to(torch.uint8).unsqueeze(1)
    column_low, column_hash = _column_terms(row_bytes, device)
    rows = stride * column_low  # uint8 arithmetic wraps mod 256
    rows.add_(offset).bitwise_xor_(column_hash)
    if row_bytes >= HEADER_BYTES:
        header = torch.stack([src, token], dim=1).to(torch.int32)
        rows[:, :HEADER_BYTES] = header.view(torch.uint8)
    return rows


def decode_header(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(src rank, token index) int64 [n] from rows written by ``encode_rows`` (row_bytes >= 8)."""
    if rows.shape[1] < HEADER_BYTES:
        raise ValueError(f"rows of {rows.shape[1]} bytes carry no header (need >= {HEADER_BYTES})")
    header = rows[:, :HEADER_BYTES].contiguous().view(torch.int32).to(torch.int64)
    return header[:, 0], header[:, 1]


def expected_rows(
    plans: Sequence[RankPlan], rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """What ``rank`` must receive in dispatch: every source's rows to it, sources in rank order."""
    segments = [plan.send_token_index[plan.segment(rank)] for plan in plans]
    tokens = torch.cat(segments).to(device) if device is not None else torch.cat(segments)
    sources = torch.tensor([plan.rank for plan in plans], dtype=torch.int64, device=tokens.device)
    lengths = torch.tensor([len(segment) for segment in segments], dtype=torch.int64, device=tokens.device)
    src = torch.repeat_interleave(sources, lengths, output_size=tokens.numel())
    return encode_rows(src, tokens, plans[0].dispatch_row_bytes)


def count_wrong_rows(received: torch.Tensor, expected: torch.Tensor) -> int:
    """Mismatched bytes; missing or extra rows count all their bytes."""
    common = min(received.shape[0], expected.shape[0])
    if received.shape[1:] != expected.shape[1:]:
        return int(max(received.numel(), expected.numel()))
    # count_nonzero: summing a bool tensor is ~10x slower on CPU.
    wrong = int(torch.count_nonzero(received[:common] != expected[:common]))
    return wrong + abs(received.shape[0] - expected.shape[0]) * int(expected.shape[1])


def poison_(buffer: torch.Tensor) -> torch.Tensor:
    """Fill ``buffer`` (any dtype, contiguous) with ``POISON_BYTE`` in every byte, in place; returns it."""
    if buffer.numel():
        buffer.view(torch.uint8).fill_(POISON_BYTE)
    return buffer


def _words(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (uint8 [n, row_bytes]) as int64 words [n, ceil(row_bytes / 8)], zero-padded at the end of
    each row; a view when the rows are contiguous 8-byte multiples, else a padded copy."""
    n, row_bytes = int(rows.shape[0]), int(rows.shape[1])
    if row_bytes % _WORD_BYTES == 0 and rows.is_contiguous():
        try:
            return rows.view(torch.int64)
        except RuntimeError:  # a view at an offset that is not 8-byte aligned: copy below
            pass
    width = -(-row_bytes // _WORD_BYTES) * _WORD_BYTES
    padded = torch.zeros((n, width), dtype=torch.uint8, device=rows.device)
    padded[:, :row_bytes] = rows
    return padded.view(torch.int64)


def row_checksums(rows: torch.Tensor) -> torch.Tensor:
    """int64 [n, 2] per row: its first 8 bytes as one int64 (the header) and the wrapping sum of its 8-byte
    words. Any single changed byte changes the sum; a poisoned or shifted row changes the header."""
    words = _words(rows)
    if not words.shape[1]:
        return torch.zeros((words.shape[0], 2), dtype=torch.int64, device=rows.device)
    return torch.stack([words[:, 0], words.sum(dim=1)], dim=1)


class RowCheck:
    """What one rank must receive (``expected``, uint8 [n, row_bytes]), checked in full or by checksum."""

    def __init__(self, expected: torch.Tensor) -> None:
        self.expected = expected
        self._checksums: torch.Tensor | None = None  # computed on the first checksum check

    def full(self, received: torch.Tensor) -> int:
        """Mismatched bytes (``count_wrong_rows``)."""
        return count_wrong_rows(received, self.expected)

    def checksum(self, received: torch.Tensor) -> int:
        """Bytes of the rows whose checksum differs (all of a row's bytes: a checksum cannot say which),
        plus all the bytes of missing or extra rows."""
        expected = self.expected
        if received.shape[1:] != expected.shape[1:]:
            return int(max(received.numel(), expected.numel()))
        if self._checksums is None:
            self._checksums = row_checksums(expected)
        common = min(received.shape[0], expected.shape[0])
        differ = row_checksums(received[:common]) != self._checksums[:common]
        rows = int(torch.count_nonzero(differ.any(dim=1))) + abs(received.shape[0] - expected.shape[0])
        return rows * int(expected.shape[1])


class CombineCheck:
    """One rank's combine reference and tolerance (``expected_combine``); ``full`` counts the elements
    outside the tolerance. It runs after every timed iteration, so it first compares in float32 against a
    tolerance shrunk by more than float32 rounding can add (accepting an element there implies accepting it
    in float64), then rechecks in float64 only the elements that failed that; scratch buffers are reused."""

    def __init__(self, reference: torch.Tensor, tolerance: torch.Tensor) -> None:
        self.reference = reference
        self.tolerance = tolerance
        self._reference32: torch.Tensor | None = None
        self._tolerance32: torch.Tensor | None = None
        self._difference: torch.Tensor | None = None
        self._within: torch.Tensor | None = None

    def _prepare(self) -> None:
        reference, tolerance = self.reference, self.tolerance
        # |ref32 - ref| <= 2^-24 |ref| and each float32 operation adds at most 2^-24 relative: taking
        # 2^-22 |ref| off the tolerance (>= 1e-4 |ref|) and a factor 1 - 2^-20 covers them all.
        shrunk = (tolerance - reference.abs() * 2.0**-22).mul_(1.0 - 2.0**-20).clamp_(min=0.0)
        self._reference32 = reference.to(torch.float32)
        self._tolerance32 = shrunk.to(torch.float32)
        self._difference = torch.empty_like(self._reference32)
        self._within = torch.empty(reference.shape, dtype=torch.bool, device=reference.device)

    def full(self, out: torch.Tensor) -> int:
        """Elements outside the tolerance (NaN and shape mismatches count as wrong)."""
        reference = self.reference
        if out.shape != reference.shape:
            return int(max(out.numel(), reference.numel()))
        if self._difference is None:
            self._prepare()
        assert self._reference32 is not None and self._tolerance32 is not None and self._within is not None
        torch.sub(out.to(torch.float32), self._reference32, out=self._difference).abs_()
        torch.le(self._difference, self._tolerance32, out=self._within)  # NaN compares False
        if bool(self._within.all()):
            return 0
        suspects = torch.nonzero(~self._within.view(-1)).squeeze(1)
        values = out.reshape(-1)[suspects].to(torch.float64)
        exact = (values - reference.view(-1)[suspects]).abs_() <= self.tolerance.view(-1)[suspects]
        return int(suspects.numel() - torch.count_nonzero(exact))

    def checksum(self, out: torch.Tensor) -> int:
        """The per-iteration check of combine: its output is small (one row per token), so in full."""
        return self.full(out)


def received_keys(recv_counts: torch.Tensor, rank: int, send_mode: str) -> torch.Tensor:
    """Key of every received dispatch row, int64 [sum(recv_counts)] on recv_counts' device.

    Token mode: this rank. Selection mode: the expert id, from the per-expert segments of each source
    (recv_counts [world, experts_per_rank], rows of one source ordered by expert).
    """
    counts = recv_counts.to(torch.int64)
    total = int(counts.sum())
    if send_mode != "selection":
        return torch.full((total,), rank, dtype=torch.int64, device=counts.device)
    world_size, per_rank = counts.shape
    local_experts = rank * per_rank + torch.arange(per_rank, dtype=torch.int64, device=counts.device)
    return torch.repeat_interleave(local_experts.repeat(world_size), counts.reshape(-1), output_size=total)


def expert_outputs(
    src: int | torch.Tensor, token: torch.Tensor, key: int | torch.Tensor, hidden: int
) -> torch.Tensor:
    """Stand-in expert output g(src, token, key): bfloat16 [n, hidden] of integers in [-127, 127] / 64."""
    token = token.to(torch.int64).reshape(-1)
    device = token.device
    src_t = torch.as_tensor(src, dtype=torch.int64, device=device)
    key_t = torch.as_tensor(key, dtype=torch.int64, device=device)
    # A mixing hash of (src, token, key), not a linear form: with a linear one, tokens 255 apart got identical
    # rows, so a combine that delivered token t + 255's output to token t would verify clean.
    mixed = (src_t * 0x9E3779B1 + token * 0x85EBCA77 + key_t * 0xC2B2AE3D) & 0xFFFFFFFF
    mixed = ((mixed ^ (mixed >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    mixed = mixed ^ (mixed >> 13)
    row_part = (mixed % 255).to(torch.int16)
    column_part = ((torch.arange(hidden, dtype=torch.int64, device=device) * 29) % 255).to(torch.int16)
    values = row_part.expand_as(token).unsqueeze(1) + column_part  # int16 in [0, 508]
    values.remainder_(255).sub_(127)
    return values.to(torch.bfloat16).mul_(1.0 / 64)  # power-of-two scaling keeps values exact


def expected_combine(
    plan: RankPlan, hidden: int, rtol: float = COMBINE_RTOL
) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, tolerance): float64 [num_tokens, hidden] each, for ``plan.rank``'s combine output;
    ``rtol``: the backend's (a library that reduces in bf16 declares 2^-7)."""
    index = plan.send_token_index
    src = torch.full_like(index, plan.rank)
    return combine_reference(
        index, plan.num_tokens, src, index, plan.send_key, plan.combine_weight, hidden, rtol
    )


def combine_reference(
    out_index: torch.Tensor,
    num_out: int,
    src: torch.Tensor,
    token: torch.Tensor,
    key: torch.Tensor,
    weight: torch.Tensor,
    hidden: int,
    rtol: float = COMBINE_RTOL,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, tolerance), float64 [num_out, hidden] each, of a reduction of rows: row r adds
    ``weight[r] * expert_outputs(src[r], token[r], key[r])`` into output row ``out_index[r]``; tolerance
    ``rtol * sum |w g| + COMBINE_ATOL`` (module docstring)."""
    device = out_index.device
    reference = torch.zeros(num_out, hidden, dtype=torch.float64, device=device)
    magnitude = torch.zeros_like(reference)
    chunk = max(1, _REFERENCE_CHUNK_ELEMENTS // max(hidden, 1))
    for start in range(0, int(out_index.numel()), chunk):
        rows = slice(start, start + chunk)
        weighted = expert_outputs(src[rows], token[rows], key[rows], hidden).to(torch.float64)
        weighted.mul_(weight[rows].to(torch.float64).unsqueeze(1))
        reference.index_add_(0, out_index[rows], weighted)
        magnitude.index_add_(0, out_index[rows], weighted.abs_())
    return reference, magnitude.mul_(rtol).add_(COMBINE_ATOL)


def count_wrong_combine(out: torch.Tensor, reference: torch.Tensor, tolerance: torch.Tensor) -> int:
    """Elements outside the tolerance (NaN and shape mismatches count as wrong)."""
    return CombineCheck(reference, tolerance).full(out)
