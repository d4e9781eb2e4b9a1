"""The ``--skew`` grammar: uniform | zipf:S | hot:N:F | rank-imbalance:R | trace:PATH."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SkewSpec:
    kind: str  # "uniform", "zipf", "hot", "rank-imbalance", "trace"
    text: str  # the user's spelling, for reports
    zipf_s: float = 0.0
    hot_experts: int = 0
    hot_fraction: float = 0.0
    imbalance_ratio: float = 1.0
    trace_path: str = ""


def parse_skew(text: str) -> SkewSpec:
    """Parse a --skew value; raises UsageError naming the accepted forms."""
    raise NotImplementedError
