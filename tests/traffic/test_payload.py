import math

import pytest
import torch

from commbench.inputs.models import ModelConfig
from commbench.traffic.payload import (
    COMBINE_ATOL,
    COMBINE_RTOL,
    HEADER_BYTES,
    CombineCheck,
    RowCheck,
    count_wrong_combine,
    count_wrong_rows,
    decode_header,
    encode_rows,
    expected_combine,
    expected_rows,
    expert_outputs,
    poison_,
    received_keys,
    row_checksums,
)
from commbench.traffic.plan import plan_balanced, plan_rank, receive_offsets, row_matrix
from commbench.traffic.routing import Routing


def test_header_round_trip_and_every_row_distinct():
    src = torch.arange(64).repeat_interleave(100)
    token = torch.arange(100).repeat(64)
    rows = encode_rows(src, token, 40)
    assert rows.dtype == torch.uint8 and rows.shape == (6400, 40)
    decoded_src, decoded_token = decode_header(rows)
    assert torch.equal(decoded_src, src) and torch.equal(decoded_token, token)
    assert torch.unique(rows, dim=0).shape[0] == rows.shape[0]
    # The body alone (no header) also differs between rows of different (src, token) in most bytes.
    body = rows[:, 8:].to(torch.int16)
    assert (body[1:] != body[:-1]).float().mean() > 0.9
    assert torch.equal(encode_rows(5, torch.tensor([3, 9]), 40), rows[[5 * 100 + 3, 5 * 100 + 9]])


def test_rows_do_not_depend_on_the_widths_encoded_before():
    # A row's bytes are the same whatever was encoded before it, and a narrower row is a wider one's prefix
    # (a block of the column hash begins every 64 Ki columns: 70,000 columns span two).
    first = encode_rows(3, torch.arange(5), 24)
    wide = encode_rows(3, torch.arange(5), 5000)
    assert torch.equal(encode_rows(3, torch.arange(5), 24), first)
    assert torch.equal(wide[:, 8:24], first[:, 8:]) and torch.equal(wide[:, :8], first[:, :8])
    assert torch.equal(encode_rows(3, torch.arange(5), 6000)[:, :5000], wide)
    widest = encode_rows(3, torch.arange(2), 70_000)
    assert torch.equal(encode_rows(3, torch.arange(2), 150_000)[:, :70_000], widest)


@pytest.mark.parametrize("shift", [256, 1 << 16, 3 << 16])
def test_a_row_read_at_a_shifted_offset_mismatches_in_nearly_every_byte(shift):
    # The column hash is two-level (64 Ki-byte blocks): a shift by whole blocks or by the 256-byte period of
    # the arithmetic term must still change ~255/256 of the bytes, as a flat hash of the column would.
    row = encode_rows(1, torch.tensor([4]), 6 << 16)[0]
    moved = (row[HEADER_BYTES + shift :] != row[HEADER_BYTES : row.numel() - shift]).double().mean()
    assert moved > 0.98


def test_any_single_corrupted_byte_is_detected():
    expected = encode_rows(2, torch.arange(7), 24)
    for position in range(expected.numel()):
        received = expected.clone()
        received.view(-1)[position] ^= 1 << (position % 8)
        assert count_wrong_rows(received, expected) == 1
    assert count_wrong_rows(expected.clone(), expected) == 0


def test_misplaced_rows_are_detected():
    expected = encode_rows(1, torch.arange(6), 16)
    swapped = expected[[1, 0, 2, 3, 4, 5]]
    assert count_wrong_rows(swapped, expected) > 0
    shifted = expected.view(-1).roll(1).view(6, 16)
    assert count_wrong_rows(shifted, expected) > 0.5 * expected.numel()  # header zeros may still match
    # Missing or extra rows count all their bytes.
    assert count_wrong_rows(expected[:4], expected) == 2 * 16
    assert count_wrong_rows(torch.cat([expected, expected[:1]]), expected) == 16


def test_short_rows_have_no_header():
    rows = encode_rows(3, torch.arange(4), 2)
    assert rows.shape == (4, 2)
    with pytest.raises(ValueError):
        decode_header(rows)


MODEL = ModelConfig(name="small", hidden=24, num_experts=8, topk=3)


def _routings(world, tokens=30, seed=0):
    generator = torch.Generator().manual_seed(seed)
    routings = []
    for rank in range(world):
        ids = torch.stack([torch.randperm(8, generator=generator)[:3] for _ in range(tokens)])
        ids[torch.rand(ids.shape, generator=generator) < 0.15] = -1
        weights = torch.rand(ids.shape, generator=generator) * (ids >= 0)
        routings.append(Routing(rank=rank, topk_ids=ids, topk_weights=weights))
    return routings


def test_expected_rows_are_each_sources_segment_in_rank_order():
    world = 4
    plans = [plan_rank(r, MODEL, world, "token") for r in _routings(world)]
    for dst in range(world):
        rows = expected_rows(plans, dst)
        counts = row_matrix(plans)
        assert rows.shape == (counts[:, dst].sum(), MODEL.dispatch_bytes_per_token)
        offsets = receive_offsets(counts)
        src, token = decode_header(rows)
        for source, plan in enumerate(plans):
            segment = slice(offsets[source, dst], offsets[source, dst] + counts[source, dst])
            assert (src[segment] == source).all()
            assert torch.equal(token[segment], plan.send_token_index[plan.segment(dst)])


def test_expected_rows_balanced():
    plans = [plan_balanced(src, 3, 300) for src in range(3)]
    rows = expected_rows(plans, 1)
    src, token = decode_header(rows)
    assert src.tolist() == [0, 1, 2] and token.tolist() == [1, 1, 1] and rows.shape == (3, 100)


def test_received_keys():
    counts = torch.tensor([[2, 0], [1, 3]])  # [source, local expert] on rank 2 of 2 experts per rank
    assert received_keys(counts, 2, "selection").tolist() == [4, 4, 4, 5, 5, 5]
    assert received_keys(counts.sum(1, keepdim=True), 2, "token").tolist() == [2] * 6


def test_expert_outputs_are_exact_in_bfloat16():
    values = expert_outputs(
        torch.tensor([0, 5, 63]), torch.tensor([0, 17, 4095]), torch.tensor([1, 2, 255]), 7168
    )
    assert values.dtype == torch.bfloat16 and values.shape == (3, 7168)
    scaled = values.double() * 64
    assert torch.equal(scaled, scaled.round()) and scaled.abs().max() <= 127
    assert not torch.equal(values[0], values[1])
    assert torch.equal(expert_outputs(5, torch.tensor([17]), 2, 7168), values[1:2])


def _simulate_round_trip(plans, send_mode, hidden):
    """Dispatch and combine of every rank in one process (no communication), like a correct backend."""
    world = len(plans)
    counts = [torch.stack([p.send_counts[dst] for p in plans]) for dst in range(world)]
    expert_out = []
    for dst in range(world):
        src, token = decode_header(expected_rows(plans, dst))
        expert_out.append(expert_outputs(src, token, received_keys(counts[dst], dst, send_mode), hidden))
    offsets = receive_offsets(row_matrix(plans))
    combined = []
    for owner, plan in enumerate(plans):
        returned = torch.cat(
            [
                expert_out[dst][offsets[owner, dst] : offsets[owner, dst] + plan.send_splits[dst]]
                for dst in range(world)
            ]
        )
        out = torch.zeros(plan.num_tokens, hidden)
        out.index_add_(0, plan.send_token_index, returned.float() * plan.combine_weight.unsqueeze(1))
        combined.append(out)
    return combined


@pytest.mark.parametrize("send_mode", ["token", "selection"])
def test_combine_reference_accepts_a_correct_round_trip_and_catches_errors(send_mode):
    world = 4
    plans = [plan_rank(r, MODEL, world, send_mode) for r in _routings(world, seed=3)]
    combined = _simulate_round_trip(plans, send_mode, MODEL.hidden)
    for plan, out in zip(plans, combined, strict=True):
        reference, tolerance = expected_combine(plan, MODEL.hidden)
        assert reference.dtype == torch.float64 and tolerance.shape == out.shape
        assert count_wrong_combine(out, reference, tolerance) == 0
    plan, out = plans[0], combined[0].clone()
    reference, tolerance = expected_combine(plan, MODEL.hidden)
    token = int(plan.send_token_index[0])
    out[token, 3] += 0.01
    out[token, 5] = math.nan
    assert count_wrong_combine(out, reference, tolerance) == 2
    assert count_wrong_combine(out[:-1], reference, tolerance) == reference.numel()
    assert torch.all(tolerance >= COMBINE_ATOL) and COMBINE_RTOL == 1e-4


def test_combine_detects_a_misrouted_row():
    """A header decoded from the wrong row changes the expert output, so combine fails too."""
    world = 2
    plans = [plan_rank(r, MODEL, world, "token") for r in _routings(world, seed=5)]
    rows = expected_rows(plans, 1)
    src, token = decode_header(rows)
    good = expert_outputs(src, token, 1, MODEL.hidden)
    bad = expert_outputs(src, token.roll(1), 1, MODEL.hidden)
    assert (good != bad).any(dim=1).float().mean() > 0.9


def test_expert_outputs_differ_for_tokens_a_period_apart():
    # A linear row term repeated every 255 tokens: swapped outputs of tokens t and t + 255 went unnoticed.
    tokens = torch.arange(0, 255 * 8, dtype=torch.int64)
    rows = expert_outputs(1, tokens, 2, 64)
    first_columns = rows[:, 0]
    assert not torch.equal(rows[:255], rows[255:510])
    assert first_columns.unique().numel() > 200  # spread over the 255 row offsets


def test_poisoned_buffers_hold_no_valid_row_and_nan_floats():
    rows = poison_(encode_rows(3, torch.arange(5), 40))
    src, token = decode_header(rows)
    assert (src == -1).all() and (token == -1).all()  # no real (source, token) is negative
    assert torch.isnan(poison_(torch.zeros(4, 3, dtype=torch.bfloat16))).all()
    assert torch.isnan(poison_(torch.zeros(2, 5))).all()


@pytest.mark.parametrize("row_bytes", [3, 8, 13, 40, 7392])
def test_row_checksum_changes_with_any_byte_and_counts_whole_rows(row_bytes):
    expected = encode_rows(2, torch.arange(6), row_bytes)
    check = RowCheck(expected)
    assert check.checksum(expected.clone()) == 0
    for position in range(0, expected.numel(), max(1, expected.numel() // 97)):
        received = expected.clone()
        received.view(-1)[position] ^= 1 << (position % 8)
        assert check.checksum(received) == row_bytes  # the row whose checksum differs, all its bytes
        assert check.full(received) == 1
    stale = poison_(expected.clone())
    assert check.checksum(stale) == expected.numel()
    assert check.checksum(expected[:4].clone()) == 2 * row_bytes  # missing rows count all their bytes
    # A view at an unaligned offset (a receive buffer's second half) gives the same checksums.
    buffer = torch.cat([torch.zeros(1, row_bytes, dtype=torch.uint8), expected]).view(-1)[row_bytes:]
    assert torch.equal(row_checksums(buffer.view(6, row_bytes)), row_checksums(expected))


def test_combine_check_is_the_float64_criterion():
    generator = torch.Generator().manual_seed(1)
    reference = torch.randn(64, 96, dtype=torch.float64, generator=generator)
    tolerance = reference.abs() * 3 * COMBINE_RTOL + COMBINE_ATOL
    check = CombineCheck(reference, tolerance)
    for spread in (0.1, 0.9, 1.0, 1.1, 3.0):  # errors around the tolerance, rounded to float32
        noise = torch.randn(reference.shape, dtype=torch.float64, generator=generator)
        out = (reference + noise * tolerance * spread).to(torch.float32)
        exact = int(((out.to(torch.float64) - reference).abs() > tolerance).sum())
        assert (
            check.full(out) == check.checksum(out) == exact == count_wrong_combine(out, reference, tolerance)
        )
    at_edge = (reference + tolerance).to(torch.float32)
    assert check.full(at_edge) == int(((at_edge.to(torch.float64) - reference).abs() > tolerance).sum())
    assert check.full(poison_(reference.to(torch.float32))) == reference.numel()  # NaN is wrong
