"""The race sampler: a token's top-k experts drawn lazily from exponential races inside expert groups.

A token's affinity to expert ``e`` is ``exp(-X_e / w_e)`` with ``X_e ~ Exp(1)`` (``traffic.routing`` explains
the model). Inside a group, the arrival times ``X_e / w_e`` in increasing order form a race whose next winner
is drawn with probability proportional to the weight of the experts not yet arrived and whose next gap is
``Exp(1) / remaining weight``; only the arrivals the selection needs are drawn (``route_chunk``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from commbench.inputs.models import ModelConfig

# Rejected draws (an expert already taken) are redrawn this often before sampling exactly without replacement.
_MAX_REDRAWS = 4


def group_scores(earliest_times: torch.Tensor) -> torch.Tensor:
    """Group score from the arrival times of its top k // topk_group experts: the sum of their affinities."""
    return torch.exp(-earliest_times).sum(-1)


class Race:
    """Exponential races inside expert groups, drawn lazily: only the arrivals the selection needs.

    Within a group, arrival number n is a new expert drawn with probability proportional to its weight
    among the experts not yet arrived (alias draw, redrawn when already taken), and its time follows the
    previous arrival after an Exp(1) / (remaining weight) gap. "Taken" sets are bitmasks, 64 experts a word.
    """

    def __init__(self, weights: np.ndarray, groups: int) -> None:
        self.weights = torch.tensor(weights, dtype=torch.float64)
        self.groups = groups
        self.group_size = self.weights.numel() // groups
        self.words = -(-self.group_size // 64)
        self.group_weights = self.weights.view(groups, self.group_size).sum(1)
        self.accept, self.alias = _alias_tables(weights.reshape(groups, self.group_size))

    def exp_gaps(self, remaining: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        return torch.from_numpy(rng.standard_exponential(remaining.numel())).div_(remaining)

    def draw_new(
        self, offset: torch.Tensor, taken: torch.Tensor, rng: np.random.Generator, check: bool
    ) -> torch.Tensor:
        """One expert per row among its group's experts not in ``taken`` [rows, words], proportional to weight
        (``check=False``: nothing taken yet)."""
        pick = self._draw(offset, rng)
        if not check:
            return pick
        repeated = self._is_taken(taken, pick - offset)
        if not bool(repeated.any()):
            return pick
        retry = repeated.nonzero().squeeze(1)
        for _ in range(_MAX_REDRAWS):
            retry_offset = offset.index_select(0, retry)
            redraw = self._draw(retry_offset, rng)
            pick.index_copy_(0, retry, redraw)
            retry = retry[self._is_taken(taken.index_select(0, retry), redraw - retry_offset)]
            if not retry.numel():
                return pick
        pick.index_copy_(0, retry, self._draw_excluding(offset.index_select(0, retry), taken[retry], rng))
        return pick

    @staticmethod
    def mark(taken: torch.Tensor, local: torch.Tensor) -> None:
        """Set bit ``local`` of each row of ``taken`` [rows, words] in place."""
        words = taken.shape[1]
        if words == 1:
            taken.view(-1).bitwise_or_(torch.bitwise_left_shift(1, local))
            return
        flat = taken.view(-1)
        index = torch.arange(local.numel()).mul_(words).add_(local >> 6)
        flat.index_copy_(
            0, index, flat.index_select(0, index).bitwise_or_(torch.bitwise_left_shift(1, local & 63))
        )

    @staticmethod
    def _is_taken(taken: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        word = taken if taken.shape[1] == 1 else taken.gather(1, (local >> 6).unsqueeze(1))
        return torch.bitwise_right_shift(word.view(-1), local & 63).bitwise_and_(1).bool()

    def _draw(self, offset: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        """One expert per row with probability proportional to its weight within the row's group (alias)."""
        scaled = torch.from_numpy(rng.random(offset.numel())).mul_(self.group_size)
        column = scaled.long()
        if self.group_size & (self.group_size - 1):  # u * size may round up to size unless size is 2^n
            column.clamp_(max=self.group_size - 1)
        fraction = scaled.sub_(column)
        expert = column.add_(offset)
        accepted = fraction < self.accept.index_select(0, expert)
        return torch.where(accepted, expert, self.alias.index_select(0, expert))

    def _draw_excluding(
        self, offset: torch.Tensor, taken: torch.Tensor, rng: np.random.Generator
    ) -> torch.Tensor:
        """Exact draw among the experts not yet taken, for the few rows the redraws did not settle."""
        local = torch.arange(self.group_size)
        free = ~self._is_taken(taken.repeat_interleave(self.group_size, 0), local.repeat(offset.numel()))
        weights = self.weights.index_select(0, (offset.unsqueeze(1) + local).view(-1)).mul_(free)
        cumulative = weights.view(offset.numel(), self.group_size).cumsum(1)
        target = torch.from_numpy(rng.random(offset.numel())).mul_(cumulative[:, -1]).unsqueeze(1)
        column = torch.searchsorted(cumulative, target, right=True).squeeze(1).clamp_(max=self.group_size - 1)
        return column + offset


def _alias_tables(group_weights: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Walker/Vose alias tables per group: (accept probability, alias expert id), indexed by expert id."""
    groups, size = group_weights.shape
    accept = np.ones(groups * size)
    alias = np.arange(groups * size, dtype=np.int64)
    for g in range(groups):
        base = g * size
        scaled = group_weights[g] * size / group_weights[g].sum()
        small = [i for i in range(size) if scaled[i] < 1.0]
        large = [i for i in range(size) if scaled[i] >= 1.0]
        while small and large:
            low, high = small.pop(), large.pop()
            accept[base + low] = scaled[low]
            alias[base + low] = base + high
            scaled[high] -= 1.0 - scaled[low]
            (small if scaled[high] < 1.0 else large).append(high)
        # Leftovers are 1 up to rounding: they always accept.
    return torch.from_numpy(accept), torch.from_numpy(alias)


def route_chunk(
    race: Race, model: ModelConfig, tokens: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids int64 [tokens, k], arrival times float64 [tokens, k] ascending) for one chunk of tokens."""
    if model.group_limited:
        return _route_group_limited(race, model, tokens, rng)
    topk = model.topk
    offset = torch.zeros(tokens, dtype=torch.int64)
    remaining = race.group_weights.expand(tokens).clone()
    taken = torch.zeros((tokens, race.words), dtype=torch.int64)
    experts = torch.empty((topk, tokens), dtype=torch.int64)  # position-major: contiguous writes
    times = torch.empty((topk, tokens), dtype=torch.float64)
    times[0] = race.exp_gaps(remaining, rng)
    for n in range(topk):  # identity of arrival n, then the time of arrival n + 1
        expert = race.draw_new(offset, taken, rng, check=n > 0)
        experts[n] = expert
        if n + 1 < topk:
            race.mark(taken, expert)
            remaining.sub_(race.weights.index_select(0, expert)).clamp_(min=1e-300)
            torch.add(times[n], race.exp_gaps(remaining, rng), out=times[n + 1])
    return experts.t(), times.t()


def _route_group_limited(
    race: Race, model: ModelConfig, tokens: int, rng: np.random.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 draws the first k // topk_group arrivals of every group and keeps the best topk_group groups.
    Stage 2 merges the kept groups' races: k times, select the earliest pending arrival and, when its group
    has no later arrival drawn yet, draw its identity and the time of the group's next arrival."""
    topk, size = model.topk, race.group_size
    groups, kept_groups = model.n_group, model.topk_group
    per_score = max(1, topk // kept_groups)
    depth = min(topk, size)  # arrivals one group can contribute
    # Stage 1, rows = token * groups + group, arrays position-major.
    offset = torch.arange(0, groups * size, size).repeat(tokens)
    remaining = race.group_weights.repeat(tokens)
    taken = torch.zeros((offset.numel(), race.words), dtype=torch.int64)
    first_times = torch.empty((per_score, offset.numel()), dtype=torch.float64)
    first_experts = torch.empty((per_score - 1, offset.numel()), dtype=torch.int64)
    first_times[0] = race.exp_gaps(remaining, rng)
    for n in range(per_score - 1):  # identity of arrival n, then the time of arrival n + 1
        expert = race.draw_new(offset, taken, rng, check=n > 0)
        first_experts[n] = expert
        race.mark(taken, expert - offset)
        remaining.sub_(race.weights.index_select(0, expert)).clamp_(min=1e-300)
        torch.add(first_times[n], race.exp_gaps(remaining, rng), out=first_times[n + 1])
    scores = group_scores(first_times.t()).view(tokens, groups)
    kept = scores.topk(kept_groups, dim=1).indices
    keep_rows = (torch.arange(tokens).unsqueeze(1) * groups + kept).view(-1)
    # Stage 2, rows = token * kept_groups + j; flat index of (arrival a, row r) = a * rows + r.
    rows = keep_rows.numel()
    offset, remaining, taken = (t.index_select(0, keep_rows) for t in (offset, remaining, taken))
    times = torch.empty((depth + 1, rows), dtype=torch.float64)
    experts = torch.empty((depth, rows), dtype=torch.int64)
    times[:per_score] = first_times.index_select(1, keep_rows)
    experts[: per_score - 1] = first_experts.index_select(1, keep_rows)
    del first_times, first_experts
    flat_times, flat_experts = times.view(-1), experts.view(-1)
    identified = torch.full((rows,), per_score - 1, dtype=torch.int64)  # arrivals with a known identity
    popped = torch.zeros(rows, dtype=torch.int64)  # arrivals already selected
    pending = times[0].view(tokens, kept_groups).clone()  # time of each group's next unselected arrival
    token_rows = torch.arange(0, rows, kept_groups)
    out_times = torch.empty((topk, tokens), dtype=torch.float64)
    out_experts = torch.empty((topk, tokens), dtype=torch.int64)
    for slot in range(topk):
        torch.min(pending, dim=1, out=(out_times[slot], choice := torch.empty(tokens, dtype=torch.int64)))
        row = token_rows + choice
        arrival = popped.index_select(0, row)
        fresh = (arrival == identified.index_select(0, row)).nonzero().squeeze(1)
        if fresh.numel():
            new_row, new_arrival = row.index_select(0, fresh), arrival.index_select(0, fresh)
            new_offset = offset.index_select(0, new_row)
            new_taken = taken.index_select(0, new_row)
            expert = race.draw_new(new_offset, new_taken, rng, check=True)
            race.mark(new_taken, expert - new_offset)
            taken.index_copy_(0, new_row, new_taken)
            flat_experts.index_copy_(0, new_arrival * rows + new_row, expert)
            identified.index_add_(0, new_row, torch.ones_like(new_row))
            left = (
                remaining.index_select(0, new_row)
                .sub_(race.weights.index_select(0, expert))
                .clamp_(min=1e-300)
            )
            remaining.index_copy_(0, new_row, left)
            time_index = new_arrival * rows + new_row
            next_arrival = race.exp_gaps(left, rng).add_(flat_times.index_select(0, time_index))
            flat_times.index_copy_(0, time_index + rows, next_arrival)
        out_experts[slot] = flat_experts.index_select(0, arrival * rows + row)
        popped.index_add_(0, row, torch.ones_like(row))
        next_time = flat_times.index_select(0, (arrival + 1) * rows + row)
        # A group whose every expert is selected has no next arrival. Its drawn "next time" comes from the
        # rounding residue of the remaining weight and can beat real arrivals of very cold experts.
        next_time.masked_fill_(arrival + 1 >= size, math.inf)
        pending.scatter_(1, choice.unsqueeze(1), next_time.unsqueeze(1))
    return out_experts.t(), out_times.t()
