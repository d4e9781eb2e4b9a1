"""The option rules of CUDA graph timing and the decode case: what cannot hold with --cuda-graph, and what
--decode makes of the MoE case (``RunConfig.resolved`` applies both; ``cli.launch`` asks ``graph_conflict``
before graph-timing the decode case)."""

from __future__ import annotations

import dataclasses
from typing import Any

from commbench.errors import UsageError
from commbench.run.workload import DECODE_SEND_MODE, DECODE_TOKENS, DEFAULT_TOKENS, MoeConfig


def decode_moe(moe: MoeConfig, pattern: str) -> MoeConfig:
    """--decode: the MoE case at DECODE_TOKENS tokens per rank in DECODE_SEND_MODE; UsageError beside a
    pattern, token count or send mode that says otherwise."""
    if pattern != "moe":
        raise UsageError(f"--decode is an MoE case; drop --pattern {pattern} (or --decode)")
    if moe.tokens not in (DEFAULT_TOKENS, DECODE_TOKENS):
        raise UsageError(f"--decode runs {DECODE_TOKENS} tokens per rank; drop --tokens {moe.tokens}")
    if moe.send_mode not in ("token", DECODE_SEND_MODE):
        raise UsageError(
            f"--decode sends a message per selection (--send-mode {DECODE_SEND_MODE}); drop --send-mode "
            f"{moe.send_mode}"
        )
    return dataclasses.replace(moe, tokens=DECODE_TOKENS, send_mode=DECODE_SEND_MODE)


def graph_conflict(config: Any, harness: Any, timing: Any) -> str:
    """Why CUDA graph timing cannot hold with these options ("" when it can): a graph replays device work
    only, in one window, so nothing that runs on the host per call (profiler steps, an injected sleep, a
    per-call check) would be in its replays. The decode case is graph-timed by default only where this is
    "" (``run.graphs.with_graphs``)."""
    if harness.profile:
        return "replays the calls without the host, which --profile / --trace time step by step; drop one"
    if timing.timing == "iteration":
        return "times the graph's replays in one window; drop --timing iteration or --cuda-graph"
    if harness.check == "every":
        return "rewrites one output in every captured call, so only the last is verified; drop --check every"
    if harness.inject_delay:
        return "replays no host code, so --inject-delay's sleep would not be in it; drop one of them"
    if config.moe.send_mode == "node":
        return (
            "captures one backend's calls; --send-mode node runs two stages on sub-groups: use --send-mode "
            "token or selection"
        )
    return ""
