"""EP-group traffic at scale and ``simulate``: the fabric model's dispatch/combine prediction per world size.

Experts live in EP groups of ``ep_size`` contiguous ranks; a larger world replicates the groups data-parallel,
every group routes its own tokens and all groups communicate at once. The traffic is [group, src, dst] blocks,
which ``commbench.fabric.model.predict_phase`` takes without building the world x world matrix. Routing and
hit counting come from the traffic stage (``route_rank``, ``destination_hits``), and so does the expert
placement when the EP size divides the experts (``expert_rank``); only the uneven placement (256 experts on
72 ranks) is defined here.

Node mode (``--send-mode node``, ``traffic.nodes``): the nodes are the NVLink domains of the fabric's layout
as each EP group's ranks sit in them (an EP group that starts or ends inside a rack has a partial node
there); each group's two stages come from its tokens per destination rank and per destination node, and a
phase's matrix is both stages' bytes (each hop counted on the link it crosses: the scale-out stage only
crosses NICs, the NVLink stage only NVLink).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from commbench.errors import UsageError
from commbench.fabric.engines import KERNEL_SEND_MODE
from commbench.fabric.model import Fabric, PhasePrediction, make_fabric, predict_phase, uniform_host_size
from commbench.inputs.models import ModelConfig, load_model
from commbench.inputs.skew import SkewSpec, parse_skew
from commbench.inputs.specs import SystemSpec, load_spec
from commbench.traffic.nodes import STAGE_ORDER, Nodes, node_stage_rows, node_token_counts, stage_phase
from commbench.traffic.pattern import SEND_MODES, destination_hits
from commbench.traffic.routing import RoutingConfig, expert_popularity, expert_rank, route_rank

EXACT_LIMIT = 65536  # world x tokens up to which grouped_pattern routes every token by default


def expert_owner(num_experts: int, ep_size: int) -> np.ndarray:
    """EP rank (0..ep_size-1) holding each expert, int64 [num_experts]: contiguous and as even as possible.

    When ep_size divides the experts this is the run's placement (``commbench.traffic.routing.expert_rank``).
    Otherwise expert e sits on rank floor(e x ep_size / num_experts), so ranks hold floor or ceil of
    num_experts / ep_size experts (256 experts on 72 ranks: 3 or 4 each), which is how a 72-GPU rack is used
    without redundant experts.
    """
    if not 1 <= ep_size <= num_experts:
        raise UsageError(f"--ep-size {ep_size} must be between 1 and the model's {num_experts} experts")
    if num_experts % ep_size == 0:
        return expert_rank(torch.arange(num_experts), num_experts, ep_size).numpy()
    return (np.arange(num_experts, dtype=np.int64) * ep_size) // num_experts


def default_ep_size(world_size: int, num_experts: int) -> int:
    return min(world_size, num_experts)


@dataclass
class GroupedPattern:
    """Dispatch traffic of ``world_size / ep_size`` EP groups (contiguous: group g = ranks g*m .. g*m+m-1),
    each routing its own tokens over all experts. Matrices are [group, src, dst] within a group.

    Unlike ``commbench.traffic.pattern.Pattern`` (what a run moves) it may be sampled, and it carries no
    per-expert load or imbalance statistics: it only feeds the fabric model."""

    model: ModelConfig
    world_size: int
    ep_size: int
    tokens_per_rank: int
    send_mode: str
    skew_text: str
    expert_owner: np.ndarray  # int64 [num_experts]: EP rank of each expert
    dispatch_tokens: np.ndarray  # int64 [G, m, m]: tokens, once per destination rank
    dispatch_selections: np.ndarray  # int64 [G, m, m]: (token, expert) selections
    method: str  # "exact" or "sampled"
    sample_tokens: int = 0  # pooled routed tokens behind the hit probabilities (sampled method)
    hit_probability: np.ndarray = field(default_factory=lambda: np.zeros(0))  # [m] P(token reaches rank)
    # Node mode: {"scaleout", "nvlink"}: int64 [G, m, m] rows of each dispatch stage (traffic.nodes); else {}.
    stage_rows: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return self.world_size // self.ep_size

    @property
    def dispatch_rows(self) -> np.ndarray:
        if self.send_mode == "node":
            return self.stage_rows["scaleout"] + self.stage_rows["nvlink"]
        return self.dispatch_tokens if self.send_mode == "token" else self.dispatch_selections

    @property
    def dispatch_bytes(self) -> np.ndarray:
        return self.dispatch_rows * int(self.model.dispatch_bytes_per_token)

    @property
    def combine_bytes(self) -> np.ndarray:
        """Combine returns what dispatch delivered: [g, src, dst] = dispatch rows [g, dst, src] x row size."""
        return np.ascontiguousarray(self.dispatch_rows.transpose(0, 2, 1)) * int(
            self.model.combine_bytes_per_token
        )

    def describe(self) -> str:
        per_rank = np.bincount(self.expert_owner, minlength=self.ep_size)
        experts = (
            f"{per_rank[0]} expert(s) per rank"
            if per_rank.min() == per_rank.max()
            else f"{per_rank.min()}-{per_rank.max()} experts per rank (uneven)"
        )
        groups = self.num_groups
        layout = f"EP{self.ep_size} ({experts})" + (
            f" x {groups} data-parallel EP groups communicating at once" if groups > 1 else ""
        )
        how = (
            "exact routing of every token"
            if self.method == "exact"
            else (
                f"sampled: hit probabilities from {self.sample_tokens} routed tokens, per-pair counts drawn"
            )
        )
        mode = ""
        if self.send_mode == "node":
            crossing = int(self.stage_rows["scaleout"].sum())
            mode = f"; send mode node: {crossing} scale-out rows (a token once per other node)"
        return (
            f"{self.model.name}, {self.tokens_per_rank} tokens/rank, skew {self.skew_text}, {layout}; {how}"
            + mode
        )


def _model_and_skew(model: ModelConfig | str, skew: SkewSpec | str) -> tuple[ModelConfig, SkewSpec]:
    return (
        model if isinstance(model, ModelConfig) else load_model(str(model)),
        skew if isinstance(skew, SkewSpec) else parse_skew(str(skew)),
    )


def _group_routing(model: ModelConfig, skew: SkewSpec, ep_size: int, tokens: int, seed: int) -> RoutingConfig:
    """Routing of one EP group: over ``ep_size`` ranks when they divide the experts, else one stream (world 1,
    whose popularity is the same for every skew but rank-imbalance) to be split by the uneven placement."""
    if model.num_experts % ep_size == 0:
        world = ep_size
    elif skew.kind == "rank-imbalance":
        raise UsageError(
            f"--skew {skew.text} needs an --ep-size that divides {model.num_experts} experts (got {ep_size})"
        )
    else:
        world = 1
    return RoutingConfig(model=model, skew=skew, world_size=world, tokens_per_rank=tokens, seed=seed)


def _routed_hits(cfg: RoutingConfig, owner: np.ndarray, sources: int) -> np.ndarray:
    """int64 [sources, tokens, ep_size]: kept selections of each token of the first ``sources`` ranks of an
    EP group (each routing ``cfg.tokens_per_rank`` tokens) on each EP rank."""
    ep_size = int(owner[-1]) + 1
    if cfg.world_size == ep_size:  # one routing stream per rank, as the real ranks would
        topk_ids = torch.cat([route_rank(cfg, rank).topk_ids for rank in range(sources)])
    else:  # uneven placement: the sources' tokens in one stream, split by rank below
        topk_ids = route_rank(replace(cfg, tokens_per_rank=cfg.tokens_per_rank * sources), 0).topk_ids
    return destination_hits(topk_ids.numpy(), owner, ep_size).reshape(sources, cfg.tokens_per_rank, ep_size)


def _routed_rows(cfg: RoutingConfig, owner: np.ndarray, sources: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, selections), int64 [sources, ep_size]: what the first ``sources`` ranks of an EP group send
    each EP rank (a token once per destination rank)."""
    hits = _routed_hits(cfg, owner, sources)
    return (hits > 0).sum(1), hits.sum(1)


def group_nodes(domain_of_rank: np.ndarray, ep_size: int) -> list[Nodes]:
    """The nodes of each EP group (contiguous ranks): the NVLink domains its ranks sit in."""
    domains = np.asarray(domain_of_rank, dtype=np.int64).reshape(-1, ep_size)
    return [Nodes.of(group) for group in domains]


def _node_stages(
    tokens: np.ndarray, node_tokens: list[np.ndarray], nodes: list[Nodes]
) -> dict[str, np.ndarray]:
    """{"scaleout", "nvlink"}: [G, m, m] rows of each group's dispatch stages."""
    parts = [node_stage_rows(tokens[g], node_tokens[g], nodes[g]) for g in range(tokens.shape[0])]
    return {"scaleout": np.stack([p[0] for p in parts]), "nvlink": np.stack([p[1] for p in parts])}


def _sampled_node_tokens(
    cfg: RoutingConfig, owner: np.ndarray, tokens: np.ndarray, nodes: list[Nodes], tokens_per_rank: int
) -> list[np.ndarray]:
    """Per group, int64 [m, nodes]: tokens of each source reaching each node, drawn like the per-rank counts
    (Binomial(tokens per rank, the sample's share of tokens reaching the node), its own random stream so the
    per-rank draws stay those of token mode), kept between the busiest rank of the node's count and the
    sum of its ranks' counts (what a token reaching it implies)."""
    sample = _routed_hits(cfg, owner, 1)  # [1, sample tokens, m]
    rng = np.random.default_rng([cfg.seed, 0xFAB, 0x40DE])
    out = []
    for g, group in enumerate(nodes):
        share = node_token_counts(sample, group.node_of_rank, group.num_nodes)[0] / cfg.tokens_per_rank
        drawn = rng.binomial(tokens_per_rank, np.broadcast_to(share, (tokens.shape[1], group.num_nodes)))
        per_node = np.zeros((tokens.shape[1], group.num_nodes), dtype=np.int64)
        busiest = np.zeros_like(per_node)
        np.add.at(per_node, (slice(None), group.node_of_rank), tokens[g])
        np.maximum.at(busiest, (slice(None), group.node_of_rank), tokens[g])
        out.append(np.clip(drawn, busiest, np.minimum(per_node, tokens_per_rank)).astype(np.int64))
    return out


def _exchangeable_classes(owner: np.ndarray, weights: np.ndarray | None, model: ModelConfig) -> np.ndarray:
    """Class id per EP rank: ranks whose experts are interchangeable under the routing (same popularity
    weights, in groups of the same weight profile) share a class, so their hit rates can be pooled."""
    ep_size = int(owner.max()) + 1
    if weights is None:  # trace replay: nothing is known to be interchangeable
        return np.arange(ep_size)
    groups = model.n_group if model.group_limited else 1
    group_of = np.arange(owner.size) // (owner.size // groups)
    rounded = np.round(np.asarray(weights, dtype=np.float64), 9)
    profile = {g: tuple(np.sort(rounded[group_of == g])) for g in range(groups)}
    keys = []
    for rank in range(ep_size):
        experts = np.flatnonzero(owner == rank)
        parts = sorted(
            (profile[g], tuple(np.sort(rounded[experts[group_of[experts] == g]])))
            for g in np.unique(group_of[experts])
        )
        keys.append(repr(parts))
    return np.unique(np.array(keys), return_inverse=True)[1]


def _sampled_blocks(
    cfg: RoutingConfig, owner: np.ndarray, groups: int, tokens_per_rank: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens [G, m, m], selections [G, m, m], hit probability [m]) drawn from ``cfg``'s routed tokens."""
    tokens_row, selections_row = _routed_rows(cfg, owner, 1)
    reached = tokens_row[0] / cfg.tokens_per_rank  # share of tokens reaching each EP rank
    selected = selections_row[0] / cfg.tokens_per_rank  # selections per token on each EP rank
    weights = None if cfg.skew.kind == "trace" else expert_popularity(cfg).weights
    classes = _exchangeable_classes(owner, weights, cfg.model)
    members = np.bincount(classes).astype(np.float64)
    p_hit = (np.bincount(classes, weights=reached) / members)[classes]
    per_token = (np.bincount(classes, weights=selected) / members)[classes]
    extra_per_hit = np.where(p_hit > 0, per_token / np.maximum(p_hit, 1e-300) - 1.0, 0.0)
    ep = int(owner[-1]) + 1
    rng = np.random.default_rng([cfg.seed, 0xFAB])
    tokens = rng.binomial(tokens_per_rank, np.broadcast_to(p_hit, (groups, ep, ep))).astype(np.int64)
    selections = tokens + rng.poisson(tokens * np.maximum(extra_per_hit, 0.0)[None, None, :])
    return tokens, selections, p_hit


def grouped_pattern(
    model: ModelConfig | str,
    world_size: int,
    tokens_per_rank: int = 4096,
    skew: SkewSpec | str = "uniform",
    ep_size: int | None = None,
    send_mode: str = "token",
    seed: int = 0,
    sample_tokens: int = 4096,
    exact: bool | None = None,
    domain_of_rank: np.ndarray | None = None,
) -> GroupedPattern:
    """Dispatch traffic of ``world_size`` ranks in EP groups of ``ep_size`` (default min(world, experts));
    node mode on the NVLink domains ``domain_of_rank`` ([world], a fabric's ``layout.domain_of_rank``).

    ``exact=True`` routes every token (cost grows with world x tokens). The sampled fast path (default when
    world x tokens exceeds 65,536) exploits that expert popularity is global: it routes ``sample_tokens``
    tokens once, estimates for each EP rank the probability that a token reaches it (pooled over ranks whose
    experts are interchangeable) and the selections per reaching token, then draws every (src, dst) count:
    tokens ~ Binomial(tokens_per_rank, p[dst]), extra selections ~ Poisson. Column sums (what a rank
    receives) then have the exact build's distribution given p; docs/fabric-model.md gives the error. Node
    mode's tokens per node are counted from every token (exact) or drawn (``_sampled_node_tokens``).
    """
    cfg_model, skew_spec = _model_and_skew(model, skew)
    if send_mode not in SEND_MODES:
        raise UsageError(f"unknown send mode {send_mode!r}; choose {', '.join(SEND_MODES)}")
    if send_mode == "node" and (domain_of_rank is None or np.size(domain_of_rank) != world_size):
        raise UsageError(f"send mode node needs the NVLink domain of each of the {world_size} ranks")
    if tokens_per_rank < 1:
        raise UsageError(f"--tokens must be positive, got {tokens_per_rank}")
    experts = cfg_model.num_experts
    ep = ep_size or default_ep_size(world_size, experts)
    owner = expert_owner(experts, ep)
    if world_size % ep:
        raise UsageError(
            f"{world_size} ranks do not split into EP groups of {ep}; pass --ep-size dividing {world_size} "
            f"(at most {experts}, the model's experts)"
        )
    groups = world_size // ep
    use_exact = exact if exact is not None else world_size * tokens_per_rank <= EXACT_LIMIT
    sampled: dict[str, Any] = {}
    nodes = group_nodes(domain_of_rank, ep) if send_mode == "node" else []  # type: ignore[arg-type]
    node_tokens: list[np.ndarray] = []
    if use_exact:
        tokens = np.zeros((groups, ep, ep), dtype=np.int64)
        selections = np.zeros_like(tokens)
        for g in range(groups):
            cfg = _group_routing(cfg_model, skew_spec, ep, tokens_per_rank, seed + g)
            hits = _routed_hits(cfg, owner, ep)
            tokens[g], selections[g] = (hits > 0).sum(1), hits.sum(1)
            if nodes:
                node_tokens.append(node_token_counts(hits, nodes[g].node_of_rank, nodes[g].num_nodes))
    else:
        if sample_tokens < 1:
            raise UsageError(f"--sample-tokens must be positive, got {sample_tokens}")
        cfg = _group_routing(cfg_model, skew_spec, ep, int(sample_tokens), seed)
        tokens, selections, p_hit = _sampled_blocks(cfg, owner, groups, tokens_per_rank)
        sampled = {"sample_tokens": int(sample_tokens), "hit_probability": p_hit}
        if nodes:
            node_tokens = _sampled_node_tokens(cfg, owner, tokens, nodes, tokens_per_rank)
    if nodes:
        sampled["stage_rows"] = _node_stages(tokens, node_tokens, nodes)
    return GroupedPattern(
        model=cfg_model,
        world_size=world_size,
        ep_size=ep,
        tokens_per_rank=tokens_per_rank,
        send_mode=send_mode,
        skew_text=skew_spec.text,
        expert_owner=owner,
        dispatch_tokens=tokens,
        dispatch_selections=selections,
        method="exact" if use_exact else "sampled",
        **sampled,
    )


def scaled_pattern(model: ModelConfig | str, world_size: int, **kwargs: Any) -> GroupedPattern:
    """The fast path of ``grouped_pattern`` (sampled hit probabilities), whatever the size."""
    return grouped_pattern(model, world_size, exact=False, **kwargs)


@dataclass
class Simulation:
    """``simulate``'s answer: one row per (world size, phase) and one note per world size."""

    rows: list[dict[str, Any]]
    notes: list[str]
    # World size -> the most (token, expert) selections any rank's experts receive (the max column sum of its
    # dispatch selections): the comm/compute budget reads it instead of routing the same pattern again.
    busiest_selections: dict[int, int] = field(default_factory=dict)


def simulate(
    model: ModelConfig | str,
    ranks: Sequence[int],
    spec: SystemSpec | str | None = None,
    tokens_per_rank: int = 4096,
    skew: SkewSpec | str = "uniform",
    ranks_per_domain: int | None = None,
    ranks_per_host: int | None = None,
    ep_size: int | None = None,
    send_mode: str | None = None,
    seed: int = 0,
    sample_tokens: int = 4096,
    exact: bool | None = None,
    **fabric_overrides: Any,
) -> Simulation:
    """Predicted dispatch and combine per world size, with per-GPU throughput and scaling efficiency.

    Scaling efficiency = per-GPU token throughput (tokens per rank / phase time) at a size over that at the
    smallest size: every GPU does the same work at every size, so it is the ratio of phase times.
    """
    sizes = sorted({int(r) for r in ranks})
    if not sizes or sizes[0] < 1:
        raise UsageError(f"--ranks needs positive world sizes, got {list(ranks)!r}")
    # Every input is checked before the first (slow) routing.
    system = load_spec(spec)
    model, skew = _model_and_skew(model, skew)
    fabrics = [make_fabric(system, w, ranks_per_domain, ranks_per_host, **fabric_overrides) for w in sizes]
    # Each engine moves its own pattern unless the caller chose one (nccl: flat, normal: per node, ...).
    send_mode = send_mode or KERNEL_SEND_MODE[fabrics[0].params.kernel]
    gpu_initiated = fabrics[0].params.kernel != "nccl"
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    base: dict[str, float] = {}
    busiest: dict[int, int] = {}
    for world, fabric in zip(sizes, fabrics, strict=True):
        pattern = grouped_pattern(
            model, world, tokens_per_rank, skew, ep_size, send_mode, seed, sample_tokens, exact,
            fabric.layout.domain_of_rank,
        )  # fmt: skip
        note = f"{world} ranks: {pattern.describe()}; {fabric.describe()}" + _span_note(pattern, fabric)
        per_host = uniform_host_size(fabric.layout)
        if fabric.params.rail_optimized and fabric.params.pxn and per_host and pattern.ep_size % per_host:
            note += (
                f"; PXN not modelled: EP groups of {pattern.ep_size} do not align with {per_host}-rank hosts"
            )
        if send_mode == "node":
            note += (
                "; node mode: each phase is both stages' bytes at once (the stages pipelined, as DeepEP's "
                "internode kernels run them)"
                if gpu_initiated
                else "; node mode: each phase is its two stages in sequence, two all-to-all(v)s each with "
                "its own fixed time (as commbench run executes them: the second forwards what the first "
                "delivered)"
            ) + ", nodes = the NVLink domains each EP group's ranks sit in"
        notes.append(note)
        # GPU-initiated engines post one message per row (a token, or a selection), nccl one per peer.
        rows_in = (model.dispatch_bytes_per_token, model.combine_bytes_per_token) if gpu_initiated else (0, 0)
        staged: dict[str, list[tuple[str, PhasePrediction]]] = {}
        if send_mode == "node" and not gpu_initiated:
            # nccl: each stage its own phase, run one after the other.
            parts = {
                phase: [
                    (
                        stage,
                        predict_phase(
                            _stage_bytes(pattern, phase, stage), fabric, combine=phase == "combine"
                        ),
                    )
                    for stage in order
                ]
                for phase, order in STAGE_ORDER.items()
            }
            dispatch, combine = (_in_sequence(parts[p]) for p in ("dispatch", "combine"))
            # A stage whose rows never leave their GPU (the scale-out stage of a group inside one node) is
            # not run, and gets no row.
            staged = {phase: [(s, part) for s, part in got if _moves(part)] for phase, got in parts.items()}
        else:
            dispatch = predict_phase(pattern.dispatch_bytes, fabric, rows_in[0] or None)
            combine = predict_phase(pattern.combine_bytes, fabric, rows_in[1] or None, combine=True)
        for phase, pred in (("dispatch", dispatch), ("combine", combine)):
            rows.append(_sim_row(world, pattern, fabric, phase, pred.time_s, pred, base))
            for stage, part in staged.get(phase, []):
                rows.append(
                    _sim_row(world, pattern, fabric, stage_phase(phase, stage), part.time_s, part, base)
                )
        rows.append(_sim_row(world, pattern, fabric, "total", dispatch.time_s + combine.time_s, None, base))
        busiest[world] = int(np.asarray(pattern.dispatch_selections, dtype=np.int64).sum(axis=-2).max())
    return Simulation(rows, notes, busiest)


def _stage_bytes(pattern: GroupedPattern, phase: str, stage: str) -> np.ndarray:
    """[G, m, m] bytes of one node-mode stage: dispatch rows of the stage, or their transpose in combine."""
    rows = pattern.stage_rows[stage]
    if phase == "dispatch":
        return rows * int(pattern.model.dispatch_bytes_per_token)
    return np.ascontiguousarray(rows.transpose(0, 2, 1)) * int(pattern.model.combine_bytes_per_token)


def _moves(part: PhasePrediction) -> bool:
    return part.nvlink_bytes + part.scaleout_bytes > 0


def _in_sequence(stages: list[tuple[str, PhasePrediction]]) -> PhasePrediction:
    """The phase of stages run one after another: the times of the stages that move bytes over a link add
    up (one that moves none is not run), its bytes are all stages' together, its bottleneck the slowest
    stage's."""
    parts = [part for _, part in stages]
    ran = [part for part in parts if _moves(part)] or parts[-1:]
    slowest = max(ran, key=lambda part: part.time_s)
    keys = {key for part in ran for key in part.resource_time_s}
    return replace(
        slowest,
        time_s=sum(part.time_s for part in ran),
        resource_time_s={key: sum(part.resource_time_s.get(key, 0.0) for part in ran) for key in keys},
        rank_time_s=sum((part.rank_time_s for part in ran[1:]), ran[0].rank_time_s),
        **{
            name: sum(getattr(part, name) for part in parts)
            for name in ("total_bytes", "self_bytes", "nvlink_bytes", "scaleout_bytes", "forwarded_bytes")
        },
    )


def _span_note(pattern: GroupedPattern, fabric: Fabric) -> str:
    domains = fabric.layout.domain_of_rank.reshape(pattern.num_groups, pattern.ep_size)
    spans = [len(np.unique(d)) for d in domains]
    if max(spans) == 1:
        return "; each EP group sits inside one NVLink domain (no scale-out traffic)"
    low, high = min(spans), max(spans)
    text = f"{low}" if low == high else f"{low}-{high}"
    return f"; each EP group spans {text} NVLink domains (contiguous ranks) and shares the scale-out fabric"


def _sim_row(
    world: int,
    pattern: GroupedPattern,
    fabric: Fabric,
    phase: str,
    time_s: float,
    pred: PhasePrediction | None,
    base: dict[str, float],
) -> dict[str, Any]:
    tokens_per_s = pattern.tokens_per_rank / time_s
    base.setdefault(phase, tokens_per_s)
    row: dict[str, Any] = {
        "ranks": world,
        "ep_size": pattern.ep_size,
        "ep_groups": pattern.num_groups,
        "domains": fabric.layout.num_domains,
        "phase": phase,
        "time_us": time_s * 1e6,
        "tokens_per_s_per_gpu": tokens_per_s,
        "scaling_efficiency": tokens_per_s / base[phase],
        "method": pattern.method,
    }
    if pred is not None:
        row.update(
            {
                "per_gpu_GBps": pred.per_gpu_GBps,
                "bottleneck": pred.bottleneck,
                "nvlink_bytes_per_gpu": pred.nvlink_bytes / world,
                "scaleout_bytes_per_gpu": pred.scaleout_bytes / world,
            }
        )
    return row
