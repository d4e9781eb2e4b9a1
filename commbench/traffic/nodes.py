"""Per-node (hierarchical) dispatch, ``--send-mode node``: the ranks' nodes and each stage's [src][dst] rows.

A node is an NVLink domain of the layout (an HGX server; an NVL72 rack), so the two stages are the two link
classes (``traffic.links``), as in DeepEP's internode normal kernels, its V2 hybrid mode, Hybrid-EP and
UCCL-EP:

1. scale-out: a token goes once to each OTHER node holding at least one of its experts, to the rank of that
   node with the sender's local index (its position among its node's ranks; with nodes of unequal size, the
   index modulo the destination node's size): the forwarder. The sender's own node is not reached here.
2. NVLink: every rank then sends each token it holds (its own, and those it received in stage 1) once to
   each rank of its node holding at least one of the token's experts, itself included (self traffic).

So a token whose experts sit on ranks of one remote node crosses the NIC once, however many of that node's
ranks hold them. Combine mirrors it: each rank returns its rows to the rank that sent them in stage 2, which
reduces them per token and returns one row per (token, node) over the scale-out link.

Everything here is counts, from two per-source counts: tokens to each destination rank (token mode's
``RankCounts.tokens``) and tokens to each destination node (``node_token_counts``). Vectorized over ranks
and nodes; no token loops.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from commbench.errors import UsageError

STAGES = ("scaleout", "nvlink")  # named after the link class each one crosses
# The stages of a node-mode phase in the order each runs: dispatch scale-out first, combine NVLink first.
STAGE_ORDER = {"dispatch": STAGES, "combine": STAGES[::-1]}


def stage_phase(phase: str, stage: str) -> str:
    """The result rows' phase of one stage, e.g. "dispatch:scaleout"."""
    return f"{phase}:{stage}"


def node_phases() -> tuple[str, ...]:
    """Every row phase of a node-mode job, in the order they run: each phase together, then its stages."""
    return tuple(
        name
        for phase, stages in STAGE_ORDER.items()
        for name in (phase, *(stage_phase(phase, s) for s in stages))
    )


@dataclass(frozen=True, eq=False)
class Nodes:
    """Which node each rank is on (dense ids from 0, in order of first appearance), and what follows."""

    node_of_rank: np.ndarray  # int64 [world]

    @classmethod
    def of(cls, domain_of_rank: np.ndarray) -> Nodes:
        """The nodes of a layout's NVLink domains (``Layout.domain_of_rank``)."""
        domains = np.asarray(domain_of_rank, dtype=np.int64).ravel()
        if not domains.size:
            raise UsageError("a layout of 0 ranks has no nodes")
        _, first, inverse = np.unique(domains, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")  # ids in order of first appearance
        dense = np.empty_like(order)
        dense[order] = np.arange(order.size)
        node = dense[inverse.ravel()].astype(np.int64)
        node.setflags(write=False)
        return cls(node)

    @classmethod
    def contiguous(cls, world_size: int, ranks_per_node: int) -> Nodes:
        """``world_size`` ranks in nodes of ``ranks_per_node`` contiguous ranks (the last may be partial)."""
        if ranks_per_node < 1:
            raise UsageError(f"ranks per node must be positive, got {ranks_per_node}")
        return cls.of(np.arange(world_size, dtype=np.int64) // ranks_per_node)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Nodes) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    @functools.cached_property
    def key(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self.node_of_rank)

    @property
    def world_size(self) -> int:
        return int(self.node_of_rank.size)

    @property
    def num_nodes(self) -> int:
        return int(self.node_of_rank.max()) + 1

    @functools.cached_property
    def sizes(self) -> np.ndarray:
        """Ranks on each node, int64 [nodes]."""
        return np.bincount(self.node_of_rank, minlength=self.num_nodes).astype(np.int64)

    @property
    def uniform(self) -> bool:
        """Whether every node has the same number of ranks (a rank of each local index on every node)."""
        return bool((self.sizes == self.sizes[0]).all())

    @functools.cached_property
    def _by_node(self) -> tuple[np.ndarray, np.ndarray]:
        """(ranks ordered by node then rank, where each node's ranks start in that order)."""
        order = np.argsort(self.node_of_rank, kind="stable").astype(np.int64)
        starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        return order, starts

    @functools.cached_property
    def local_index(self) -> np.ndarray:
        """Each rank's position among its node's ranks (rank order), int64 [world]."""
        order, starts = self._by_node
        local = np.empty(self.world_size, dtype=np.int64)
        local[order] = np.arange(self.world_size) - starts[self.node_of_rank[order]]
        return local

    def members(self, node: int) -> np.ndarray:
        """The ranks of ``node``, ascending."""
        order, starts = self._by_node
        return order[starts[node] : starts[node] + self.sizes[node]]

    @functools.cached_property
    def forwarders(self) -> np.ndarray:
        """int64 [world, nodes]: the rank of node b that receives rank s's stage-1 rows (module docstring);
        [s, own node] is the rank itself (its own tokens need no forwarder)."""
        order, starts = self._by_node
        local = self.local_index[:, None] % self.sizes[None, :]
        forwarder = order[starts[None, :] + local]
        own = np.arange(self.world_size)
        forwarder[own, self.node_of_rank] = own
        return forwarder

    def describe(self) -> str:
        sizes = sorted({int(s) for s in self.sizes})
        per_node = " or ".join(str(s) for s in sizes)
        return f"{self.num_nodes} node(s) of {per_node} rank(s)"


def node_token_counts(hits: np.ndarray, node_of_rank: np.ndarray, num_nodes: int) -> np.ndarray:
    """int64 [..., nodes]: tokens reaching each node (at least one kept selection on one of its ranks), from
    ``hits`` [..., tokens, ranks] (``traffic.pattern.destination_hits``; anything > 0 counts as a hit)."""
    reached = np.asarray(hits) > 0
    *lead, tokens, ranks = reached.shape
    node = np.asarray(node_of_rank, dtype=np.int64).ravel()
    if node.size != ranks:
        raise ValueError(f"node_of_rank has {node.size} entries for hits over {ranks} ranks")
    flat = reached.reshape(-1, ranks)
    row, rank = np.nonzero(flat)
    per_node = np.zeros(flat.shape[0] * num_nodes, dtype=bool)
    per_node[row * num_nodes + node[rank]] = True
    counts = per_node.reshape(-1, tokens, num_nodes).sum(axis=1, dtype=np.int64)
    return counts.reshape(*lead, num_nodes)


def node_stage_rows(
    tokens: np.ndarray, node_tokens: np.ndarray, nodes: Nodes
) -> tuple[np.ndarray, np.ndarray]:
    """(scale-out rows, NVLink rows), int64 [src, dst] each, of node-mode dispatch.

    ``tokens[s, r]``: tokens of source s with at least one kept expert on rank r (token mode's rows);
    ``node_tokens[s, b]``: tokens of s with at least one on node b. Stage 1 sends node_tokens[s, b] rows from
    s to its forwarder on every other node b; stage 2 sends tokens[s, r] rows to r from s itself when r is on
    s's node, else from s's forwarder on r's node. Combine's rows are the transposes.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    node_tokens = np.asarray(node_tokens, dtype=np.int64)
    n, num_nodes = nodes.world_size, nodes.num_nodes
    if tokens.shape != (n, n) or node_tokens.shape != (n, num_nodes):
        raise ValueError(
            f"need tokens [{n}, {n}] and node_tokens [{n}, {num_nodes}], got {tokens.shape} and "
            f"{node_tokens.shape}"
        )
    node = nodes.node_of_rank
    forwarder = nodes.forwarders
    source = np.arange(n)[:, None]
    remote = node[:, None] != np.arange(num_nodes)[None, :]
    scaleout = np.zeros(n * n, dtype=np.int64)
    np.add.at(scaleout, (np.broadcast_to(source, remote.shape) * n + forwarder)[remote], node_tokens[remote])
    # Who hands s's tokens to r in stage 2: s itself on its own node, else its forwarder on r's node.
    sender = np.where(node[:, None] == node[None, :], source, forwarder[:, node])
    nvlink = np.zeros(n * n, dtype=np.int64)
    np.add.at(nvlink, (sender * n + np.arange(n)[None, :]).ravel(), tokens.ravel())
    return scaleout.reshape(n, n), nvlink.reshape(n, n)
