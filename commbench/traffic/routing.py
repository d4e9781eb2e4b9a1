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
The race sampler (``traffic.race``) draws only the few arrivals that matter (the top ``k // topk_group`` of
every group, then the top ``k`` of the kept groups), which costs far less than sorting every expert of every
token.

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
from dataclasses import dataclass, replace

import numpy as np
import torch

from commbench.errors import UsageError
from commbench.inputs.expert_load import expert_weights
from commbench.inputs.models import ModelConfig
from commbench.inputs.skew import SkewSpec, load_trace
from commbench.traffic.race import Race, route_chunk
from commbench.traffic.replicas import Placement, check_replicas, place_replicas

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
    replicas: int = 0  # EPLB redundant experts (traffic.replicas, replica_placement); 0 = none

    def __post_init__(self) -> None:
        for name, what, least in (
            ("world_size", "world size", 1),
            ("tokens_per_rank", "tokens per rank", 1),
            ("seed", "seed", 0),
            ("replicas", "--replicas", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise UsageError(f"{what} must be an integer >= {least}, got {value!r}")
            object.__setattr__(self, name, int(value))  # numpy integers become plain ints (hashing, JSON)
        experts_per_rank(self.model.num_experts, self.world_size)
        if self.replicas:
            check_replicas(self.model.num_experts, self.world_size, self.replicas)
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
    slot_ids: torch.Tensor | None = None  # int64 [tokens, topk]: each selection's replica slot (--replicas)
    num_slots: int = 0  # replica slots on all ranks, contiguous per rank (with slot_ids)

    def destination_slots(self, num_experts: int) -> tuple[torch.Tensor, int]:
        """(the slot of every selection, -1 where dropped; slots in all): slot s lives on rank s // (slots /
        world). Without replicas every expert is its own slot (contiguous placement)."""
        if self.slot_ids is None:
            return self.topk_ids, num_experts
        return self.slot_ids, self.num_slots


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
    if skew.kind == "load":  # a router's logged tokens per expert, as weights (mean 1)
        weights = expert_weights(skew.load_path, num_experts, skew.load_layer, model.name)
        busiest = np.argsort(-weights, kind="stable")[:topk]
        return Popularity(weights=weights, hot_experts=tuple(int(e) for e in busiest))
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
def _race(model: ModelConfig, skew: SkewSpec, world_size: int, seed: int) -> Race:
    """The race sampler (alias tables) for a popularity, built once per process."""
    weights = _popularity(model, skew, world_size, seed).weights
    return Race(weights, model.n_group if model.group_limited else 1)


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
            ids, times = route_chunk(race, model, stop - start, rng)
            affinity = torch.exp(-times).float()
        keep = ids >= 0  # a trace's dropped selections (-1) stay dropped
        if cfg.mask_ratio > 0:
            keep &= torch.from_numpy(mask_rng.random(ids.shape) >= cfg.mask_ratio)
        if cfg.capacity is not None:
            keep &= _within_capacity(torch.where(keep, ids, -1), expert_fill, cfg.capacity)
        topk_ids[start:stop] = ids.masked_fill_(~keep, -1)
        topk_weights[start:stop] = _normalize(affinity, keep)
    routing = Routing(rank=rank, topk_ids=topk_ids, topk_weights=topk_weights)
    if cfg.replicas:  # every selection goes to one replica of its expert
        placement = replica_placement(cfg)
        routing.slot_ids = placement.slots_of(topk_ids, rank * tokens)
        routing.num_slots = placement.num_slots
    return routing


@functools.lru_cache(maxsize=8)
def replica_placement(cfg: RoutingConfig) -> Placement:
    """EPLB placement of ``cfg.replicas`` from the measured expert load of this same routing (every rank
    routed without replicas: what an operator would have recorded), identical on every rank."""
    plain = replace(cfg, replicas=0)
    load = np.zeros(cfg.model.num_experts, dtype=np.int64)
    for rank in range(cfg.world_size):
        ids = route_rank(plain, rank).topk_ids
        load += np.bincount(ids[ids >= 0].numpy(), minlength=load.size)
    return place_replicas(load, cfg.replicas, cfg.world_size)


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
