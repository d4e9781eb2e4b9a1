"""Top-k routing of one rank's tokens, deterministic from a seed and vectorized.

The routing model
-----------------
Each expert ``e`` has a popularity weight ``w_e`` (mean 1; the skew decides them, globally: every rank sees
the same hot experts). A token's affinity to expert ``e`` is ``exp(-X_e / w_e)`` with ``X_e ~ Exp(1)``
independent, and the token takes its ``k`` highest-affinity experts. Without a group limit this is exactly
weighted sampling of ``k`` distinct experts (the exponential race / Gumbel top-k), so ``w`` acts as sampling
weights. With a group limit (DeepSeek-V3: ``n_group``, ``topk_group``) each group is scored by the sum of its
top ``k // topk_group`` affinities, the best ``topk_group`` groups are kept and the top ``k`` are taken inside
them. Routing weights are the kept affinities normalized to sum 1 per token.

Generating that model does not need the full [tokens, experts] affinity matrix: the arrival times
``X_e / w_e`` inside a group, in increasing order, are a race whose next winner is drawn with probability
proportional to the weight of the experts not yet arrived and whose next gap is ``Exp(1) / remaining weight``.
``_Race`` draws only the few arrivals that matter (the top ``k // topk_group`` of every group, then the top
``k`` of the kept groups), which costs far less than sorting every expert of every token.

``hot:N:F`` and ``rank-imbalance:R`` are two-class weights (hot vs cold experts). Because a token's experts
are distinct, an expert is picked at most once per token and the share of hot selections is not proportional
to the weights; the single log-weight offset between the classes is found by a bracketing root search on a
fixed Monte-Carlo sample drawn from the seed (common random numbers make the share monotone in the offset),
through the same group-limited selection.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from commbench.errors import UsageError
from commbench.inputs.models import ModelConfig
from commbench.inputs.skew import SkewSpec, load_trace

# Tokens routed per vectorized step. Fixed, because it is part of how the random stream is consumed:
# changing it changes the routing drawn for a seed.
CHUNK_TOKENS = 1 << 18
# Monte-Carlo sample that calibrates hot:N:F and rank-imbalance:R: enough tokens for about this many hot
# selections (relative noise ~0.5 %), between CALIBRATION_BLOCK and CALIBRATION_MAX_TOKENS tokens.
CALIBRATION_HOT_SELECTIONS = 65536
CALIBRATION_BLOCK = 16384
CALIBRATION_MAX_TOKENS = 131072
# Bracket and stopping rules of the calibrated log-weight offset between hot and cold experts: the share
# tolerance is relative and well below the Monte-Carlo noise of the sample (about 0.3 %).
_OFFSET_LIMIT = 30.0
_OFFSET_TOLERANCE = 1e-6
_SHARE_TOLERANCE = 1e-3
_MAX_CALIBRATION_STEPS = 60
# Rejected draws (an expert already taken) are redrawn this often before sampling exactly without replacement.
_MAX_REDRAWS = 4
# Largest log(max weight / min weight) of a zipf popularity: the race sampler needs every weight (and the
# weight left after the hot ones are taken) well above float64's smallest normal number.
_ZIPF_MAX_LOG_RANGE = math.log(1e200)
# Independent random streams derived from the seed.
_STREAM_POPULARITY, _STREAM_CALIBRATION, _STREAM_TOKENS, _STREAM_MASK = 1, 2, 3, 4


@dataclass(frozen=True)
class RoutingConfig:
    """Everything that decides routing. Expert popularity is global (same hot experts for every rank)."""

    model: ModelConfig
    skew: SkewSpec
    world_size: int
    tokens_per_rank: int
    seed: int = 0
    mask_ratio: float = 0.0  # fraction of selections dropped (-1), as DeepEP's masked ratio
    capacity_factor: float | None = None  # per (source rank, expert) capacity; None = no dropping

    def __post_init__(self) -> None:
        for name, what, least in (
            ("world_size", "world size", 1),
            ("tokens_per_rank", "tokens per rank", 1),
            ("seed", "seed", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise UsageError(f"{what} must be an integer >= {least}, got {value!r}")
            object.__setattr__(self, name, int(value))  # numpy integers become plain ints (hashing, JSON)
        experts_per_rank(self.model.num_experts, self.world_size)
        if not 0.0 <= self.mask_ratio < 1.0:
            raise UsageError(f"mask ratio must be in [0, 1), got {self.mask_ratio!r}")
        if self.capacity_factor is not None and not (
            math.isfinite(self.capacity_factor) and self.capacity_factor > 0
        ):
            raise UsageError(f"capacity factor must be > 0, got {self.capacity_factor!r}")

    @property
    def capacity(self) -> int | None:
        """Selections one source rank may send to one expert: ceil(tokens * topk / experts * factor)."""
        if self.capacity_factor is None:
            return None
        exact = self.tokens_per_rank * self.model.topk / self.model.num_experts * self.capacity_factor
        return max(1, math.ceil(round(exact, 9)))  # round: 40.000000000000004 must stay 40


@dataclass
class Routing:
    rank: int
    topk_ids: torch.Tensor  # int64 [tokens, topk]; -1 = dropped; the k ids of a token are distinct
    topk_weights: torch.Tensor  # float32 [tokens, topk]; 0 where dropped


def experts_per_rank(num_experts: int, world_size: int) -> int:
    """Experts per rank under contiguous placement; UsageError when world_size does not divide them."""
    if world_size < 1 or num_experts % world_size:
        divisors = [d for d in range(2, num_experts + 1) if num_experts % d == 0][:4]
        hint = ", ".join(str(d) for d in divisors)
        raise UsageError(
            f"world size {world_size} does not divide {num_experts} experts; use a divisor such as {hint} ..."
        )
    return num_experts // world_size


def expert_rank(expert_ids: torch.Tensor, num_experts: int, world_size: int) -> torch.Tensor:
    """Rank holding each expert (contiguous placement); -1 stays -1."""
    per_rank = experts_per_rank(num_experts, world_size)
    ranks = torch.div(expert_ids, per_rank, rounding_mode="floor")
    return torch.where(expert_ids < 0, torch.full_like(ranks, -1), ranks)


# --------------------------------------------------------------------------------------------------------
# Expert popularity (global, from the seed)


@dataclass(frozen=True, eq=False)
class Popularity:
    """The skew resolved against a model and world size; identical on every rank."""

    weights: np.ndarray | None  # float64 [num_experts], mean 1, read-only; None for trace replay
    hot_experts: tuple[int, ...] = ()  # hot set (hot, rank-imbalance) or the most popular experts (zipf)
    hot_rank: int | None = None  # rank-imbalance: the rank that receives R x
    target_hot_share: float | None = None  # share of selections the hot set is calibrated to receive
    log_weight_offset: float | None = None  # calibrated log(w_hot / w_cold)

    def __post_init__(self) -> None:
        if self.weights is not None:
            self.weights.setflags(write=False)  # cached and shared by every caller


def expert_popularity(cfg: RoutingConfig) -> Popularity:
    """Expert weights and hot set for ``cfg``, cached per (model, skew, world size, seed)."""
    return _popularity(cfg.model, cfg.skew, cfg.world_size, cfg.seed)


@functools.lru_cache(maxsize=32)
def _popularity(model: ModelConfig, skew: SkewSpec, world_size: int, seed: int) -> Popularity:
    num_experts, topk = model.num_experts, model.topk
    rng = np.random.default_rng([seed, _STREAM_POPULARITY])
    if skew.kind == "uniform":
        return Popularity(weights=np.ones(num_experts))
    if skew.kind == "trace":
        return Popularity(weights=None)
    if skew.kind == "zipf":
        steepest = _ZIPF_MAX_LOG_RANGE / math.log(num_experts) if num_experts > 1 else math.inf
        if skew.zipf_s > steepest:
            # Weights that underflow make the sampler repeat experts within a token (and NaN alias tables).
            raise UsageError(
                f"--skew {skew.text}: with {num_experts} experts the coldest weight {num_experts}^-S "
                f"underflows; S can be at most {math.floor(steepest)}"
            )
        order = rng.permutation(num_experts)  # order[i] = expert with popularity rank i + 1
        weights = np.empty(num_experts)
        weights[order] = np.arange(1, num_experts + 1, dtype=np.float64) ** -skew.zipf_s
        weights *= num_experts / weights.sum()
        return Popularity(weights=weights, hot_experts=tuple(int(e) for e in order[:topk]))
    hot_mask = np.zeros(num_experts, dtype=bool)
    hot_rank = None
    if skew.kind == "hot":
        if skew.hot_experts > num_experts:
            raise UsageError(f"--skew {skew.text}: {model.name} has only {num_experts} experts")
        hot_mask[rng.choice(num_experts, size=skew.hot_experts, replace=False)] = True
        target = skew.hot_fraction
    elif skew.kind == "rank-imbalance":
        if world_size < 2:
            raise UsageError(f"--skew {skew.text} needs a world size of at least 2")
        per_rank = experts_per_rank(num_experts, world_size)
        hot_rank = int(rng.integers(world_size))
        hot_mask[hot_rank * per_rank : (hot_rank + 1) * per_rank] = True
        ratio = skew.imbalance_ratio
        target = ratio / (ratio + world_size - 1)
    else:
        raise UsageError(f"unknown skew kind {skew.kind!r}")
    hot_experts = tuple(int(e) for e in np.flatnonzero(hot_mask))
    offset = _extreme_offset(model, skew, hot_mask, target, world_size)
    if offset is not None:
        pass  # the target is a limit: hot experts always (or never) win against cold ones
    elif skew.kind == "rank-imbalance" and skew.imbalance_ratio == 1.0:
        offset = 0.0  # R = 1 is uniform routing
    else:
        calib_rng = np.random.default_rng([seed, _STREAM_CALIBRATION])
        offset = _calibrate_offset(model, skew, hot_mask, target, world_size, calib_rng)
    hot_weight, cold_weight = _two_class_weights(hot_mask, offset)
    return Popularity(
        weights=np.where(hot_mask, hot_weight, cold_weight),
        hot_experts=hot_experts,
        hot_rank=hot_rank,
        target_hot_share=target,
        log_weight_offset=offset,
    )


@functools.lru_cache(maxsize=8)
def _race(model: ModelConfig, skew: SkewSpec, world_size: int, seed: int) -> _Race:
    """The race sampler (alias tables) for a popularity, built once per process."""
    weights = _popularity(model, skew, world_size, seed).weights
    return _Race(weights, model.n_group if model.group_limited else 1)


def _two_class_weights(hot_mask: np.ndarray, offset: float) -> tuple[float, float]:
    """(w_hot, w_cold) with w_hot / w_cold = exp(offset) and mean weight 1 over all experts."""
    hot_count = int(hot_mask.sum())
    cold = hot_mask.size / (hot_count * math.exp(offset) + (hot_mask.size - hot_count))
    return cold * math.exp(offset), cold


def _group_layout(model: ModelConfig) -> tuple[int, int]:
    """(groups, experts per group) the routing works on: one group of every expert without a group limit."""
    if model.group_limited:
        return model.n_group, model.experts_per_group
    return 1, model.num_experts


def _share_to_ratio(share: float, world_size: int) -> float:
    return math.inf if share >= 1 else share * (world_size - 1) / (1 - share)


def _extreme_offset(
    model: ModelConfig, skew: SkewSpec, hot_mask: np.ndarray, target: float, world_size: int
) -> float | None:
    """UsageError when the target share cannot be met with k distinct experts (and the group limit); the
    extreme offset when the target is exactly the highest or lowest reachable share; else None."""
    groups, group_size = _group_layout(model)
    kept_groups = model.topk_group if model.group_limited else 1
    topk = model.topk
    hot_per_group = hot_mask.reshape(groups, group_size).sum(1)
    cold_per_group = group_size - hot_per_group
    most_hot = min(topk, int(np.sort(np.minimum(hot_per_group, topk))[::-1][:kept_groups].sum()))
    most_cold = min(topk, int(np.sort(np.minimum(cold_per_group, topk))[::-1][:kept_groups].sum()))
    highest, lowest = most_hot / topk, (topk - most_cold) / topk
    limit_note = f" within {model.topk_group} of {model.n_group} groups" if model.group_limited else ""
    if math.isclose(target, highest, rel_tol=1e-9):
        return _OFFSET_LIMIT
    if math.isclose(target, lowest, rel_tol=1e-9):
        return -_OFFSET_LIMIT
    if skew.kind == "hot":
        if target > highest:
            raise UsageError(
                f"--skew {skew.text}: {model.name} tokens pick {topk} distinct experts{limit_note}, at most "
                f"{most_hot} of them hot, so F can be at most {highest:.4g}"
            )
        if target < lowest:
            raise UsageError(
                f"--skew {skew.text}: every token must pick at least {topk - most_cold} hot experts, "
                f"so F must be at least {lowest:.4g}"
            )
    elif target > highest:
        per_rank = model.num_experts // world_size
        raise UsageError(
            f"--skew {skew.text}: on {world_size} ranks one rank holds {per_rank} of {model.name}'s experts "
            f"and a token picks at most {most_hot} of them{limit_note}; R can be at most "
            f"{_share_to_ratio(highest, world_size):.4g}"
        )
    return None


def _calibrate_offset(
    model: ModelConfig,
    skew: SkewSpec,
    hot_mask: np.ndarray,
    target: float,
    world_size: int,
    rng: np.random.Generator,
) -> float:
    """Log-weight offset at which the hot experts get ``target`` of all selections.

    Within a class all weights are equal, so only each group's earliest hot and cold arrivals matter and
    their sorted times are drawn directly (Renyi: the j-th gap of n i.i.d. Exp(1) is Exp(1) / (n - j)).
    The sample is fixed (common random numbers) and scaled by the class weights per trial offset."""
    groups, group_size = _group_layout(model)
    depth = min(model.topk, group_size)  # arrivals of one group that can be selected
    hot_per_group = hot_mask.reshape(groups, group_size).sum(1)
    tokens = min(
        max(CALIBRATION_BLOCK, math.ceil(CALIBRATION_HOT_SELECTIONS / (model.topk * target))),
        CALIBRATION_MAX_TOKENS,
    )
    hot_exps = _sorted_exponentials(rng, tokens, hot_per_group, depth)
    cold_exps = _sorted_exponentials(rng, tokens, group_size - hot_per_group, depth)
    # Per group, candidate times are [hot earliest | cold earliest], depth each.
    candidates = torch.empty((tokens, groups, 2 * depth), dtype=hot_exps.dtype)
    hot_times, cold_times = candidates[:, :, :depth], candidates[:, :, depth:]

    def share_error(offset: float) -> float:
        hot_weight, cold_weight = _two_class_weights(hot_mask, offset)
        torch.div(hot_exps, hot_weight, out=hot_times)
        torch.div(cold_exps, cold_weight, out=cold_times)
        if not model.group_limited:
            # a, b ascending: the k smallest of both hold j of a exactly while a[j-1] < b[k-j].
            picked = (hot_times[:, 0] < cold_times[:, 0].flip(1)).sum()
            return int(picked) / (tokens * model.topk) - target
        per_score = max(1, model.topk // model.topk_group)
        # The top-p affinities of a group are a prefix of each class's: take the best split.
        hot_prefix = _prefix_affinity(hot_times[:, :, :per_score])
        cold_prefix = _prefix_affinity(cold_times[:, :, :per_score])
        scores = (hot_prefix + cold_prefix.flip(2)).amax(2)
        kept = scores.topk(model.topk_group, dim=1).indices.unsqueeze(2).expand(-1, -1, 2 * depth)
        kept_times = candidates.gather(1, kept).view(tokens, -1)
        position = kept_times.topk(model.topk, dim=1, largest=False).indices
        picked = (position.remainder_(2 * depth) < depth).sum()
        return int(picked) / (tokens * model.topk) - target

    # Illinois (modified regula falsi) on the bracket: a handful of evaluations instead of ~20 bisections.
    low, high = -_OFFSET_LIMIT, _OFFSET_LIMIT
    error_low, error_high = share_error(low), share_error(high)
    if not error_low < 0 < error_high:
        what = "F" if skew.kind == "hot" else "R"
        raise UsageError(
            f"--skew {skew.text}: {what} is too close to its limit for {model.name}; move it inward"
        )
    middle, side = 0.0, 0
    for _ in range(_MAX_CALIBRATION_STEPS):
        error = share_error(middle)
        if abs(error) <= _SHARE_TOLERANCE * target or high - low <= _OFFSET_TOLERANCE:
            break
        if error < 0:
            low, error_low = middle, error
            if side == -1:
                error_high /= 2
            side = -1
        else:
            high, error_high = middle, error
            if side == 1:
                error_low /= 2
            side = 1
        middle = (low * error_high - high * error_low) / (error_high - error_low)
    return round(middle, 6)


def _sorted_exponentials(
    rng: np.random.Generator, tokens: int, counts: np.ndarray, depth: int
) -> torch.Tensor:
    """Per (token, group): the ``depth`` smallest of ``counts[group]`` i.i.d. Exp(1), ascending, inf past the
    count. float32 [tokens, groups, depth]."""
    remaining = torch.from_numpy(counts).unsqueeze(1) - torch.arange(depth)  # [groups, depth]: n - j
    gaps = torch.from_numpy(rng.standard_exponential((tokens, counts.size, depth), dtype=np.float32))
    gaps = torch.where(remaining > 0, gaps / remaining.clamp(min=1), math.inf)
    return gaps.cumsum_(2)


def _prefix_affinity(times: torch.Tensor) -> torch.Tensor:
    """[..., p] ascending times -> [..., p + 1] sums of the first 0..p affinities exp(-t)."""
    prefix = torch.zeros((*times.shape[:-1], times.shape[-1] + 1), dtype=times.dtype)
    torch.cumsum(torch.exp(-times), dim=-1, out=prefix[..., 1:])
    return prefix


def _group_scores(earliest_times: torch.Tensor) -> torch.Tensor:
    """Group score from the arrival times of its top k // topk_group experts: the sum of their affinities."""
    return torch.exp(-earliest_times).sum(-1)


def _select_from_groups(
    times: torch.Tensor, payload: torch.Tensor, model: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference group-limited top-k on full candidate arrival times [rows, groups, c] (used by tests: each
    group's candidates must hold its k earliest arrivals). Returns (times [rows, k] ascending, payload)."""
    rows, groups, width = times.shape
    if model.group_limited:
        per_score = max(1, model.topk // model.topk_group)
        scores = _group_scores(times.topk(per_score, dim=2, largest=False).values)
        kept = scores.topk(model.topk_group, dim=1).indices.unsqueeze(2).expand(-1, -1, width)
        times, payload = times.gather(1, kept), payload.gather(1, kept)
    best_times, position = times.reshape(rows, -1).topk(model.topk, dim=1, largest=False)
    return best_times, payload.reshape(rows, -1).gather(1, position)


# --------------------------------------------------------------------------------------------------------
# The race sampler


class _Race:
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


def _route_chunk(
    race: _Race, model: ModelConfig, tokens: int, rng: np.random.Generator
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
    race: _Race, model: ModelConfig, tokens: int, rng: np.random.Generator
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
    scores = _group_scores(first_times.t()).view(tokens, groups)
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


# --------------------------------------------------------------------------------------------------------
# route_rank


def route_rank(cfg: RoutingConfig, rank: int) -> Routing:
    """Routing of ``rank``'s tokens without materializing any other rank's.

    Tokens are routed in chunks of CHUNK_TOKENS; masking draws from its own stream (so it drops selections
    without changing the others) and capacity counts carry over from chunk to chunk (first come, first
    served in token order)."""
    if not 0 <= rank < cfg.world_size:
        raise UsageError(f"rank {rank} outside world size {cfg.world_size}")
    model, tokens = cfg.model, cfg.tokens_per_rank
    rng = np.random.default_rng([cfg.seed, _STREAM_TOKENS, rank])
    mask_rng = np.random.default_rng([cfg.seed, _STREAM_MASK, rank])
    if cfg.skew.kind == "trace":
        trace = load_trace(cfg.skew.trace_path, model.num_experts, model.topk)
        race = None
    else:
        race = _race(model, cfg.skew, cfg.world_size, cfg.seed)
    topk_ids = torch.empty((tokens, model.topk), dtype=torch.int64)
    topk_weights = torch.empty((tokens, model.topk), dtype=torch.float32)
    expert_fill = torch.zeros(model.num_experts + 1, dtype=torch.int64)  # selections kept per expert so far
    for start in range(0, tokens, CHUNK_TOKENS):
        stop = min(start + CHUNK_TOKENS, tokens)
        if race is None:
            rows = np.arange(rank * tokens + start, rank * tokens + stop) % trace.topk_ids.shape[0]
            ids = torch.from_numpy(
                trace.topk_ids[rows]
            )  # fancy indexing copies: the cached trace stays intact
            if trace.topk_weights is None:
                affinity = torch.ones(ids.shape, dtype=torch.float32)
            else:
                affinity = torch.from_numpy(trace.topk_weights[rows])
        else:
            ids, times = _route_chunk(race, model, stop - start, rng)
            affinity = torch.exp(-times).float()
        keep = torch.ones(ids.shape, dtype=torch.bool)
        if cfg.mask_ratio > 0:
            keep &= torch.from_numpy(mask_rng.random(ids.shape) >= cfg.mask_ratio)
        if cfg.capacity is not None:
            keep &= _within_capacity(torch.where(keep, ids, -1), expert_fill, cfg.capacity)
        topk_ids[start:stop] = ids.masked_fill_(~keep, -1)
        topk_weights[start:stop] = _normalize(affinity, keep)
    return Routing(rank=rank, topk_ids=topk_ids, topk_weights=topk_weights)


def _within_capacity(topk_ids: torch.Tensor, expert_fill: torch.Tensor, capacity: int) -> torch.Tensor:
    """True for selections that fit the per-expert capacity, first come first served in token order.

    ``expert_fill`` [experts + 1] holds the selections already accepted (earlier chunks); updated in place."""
    num_experts = expert_fill.numel() - 1
    flat = topk_ids.reshape(-1)
    key = torch.where(flat < 0, num_experts, flat)  # dropped ones go to the spare last slot, never limited
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)
    segment_start = torch.cumsum(counts, 0) - counts
    arrival = torch.empty_like(flat)
    sorted_key = key.index_select(0, order)
    arrival[order] = torch.arange(flat.numel()) - segment_start.index_select(0, sorted_key)
    fits = ((arrival + expert_fill.index_select(0, key)) < capacity) | (flat < 0)
    expert_fill += torch.bincount(key[fits], minlength=num_experts + 1)
    return fits.view(topk_ids.shape)


def _normalize(affinity: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Kept affinities scaled to sum 1 per token (equal shares where they sum to 0); 0 where dropped."""
    weights = torch.where(keep, affinity, 0.0).float()
    total = weights.sum(1, keepdim=True)
    equal = keep.float() / keep.sum(1, keepdim=True).clamp(min=1)
    return torch.where(total > 0, weights / total.clamp(min=torch.finfo(torch.float32).tiny), equal)
