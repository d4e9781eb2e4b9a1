"""Model presets: the MoE layer shapes that decide dispatch/combine traffic.

Presets are YAML files in the top-level ``patterns/`` folder (shipped as ``commbench.presets``); a user can pass
the path of their own YAML file with the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int
    num_experts: int  # routed experts
    topk: int
    num_shared_experts: int = 0  # computed on the token's own rank: no all-to-all traffic
    n_group: int = 1  # expert groups for group-limited routing (1 = no group limit)
    topk_group: int = 1  # groups kept per token when n_group > 1
    dispatch_dtype: str = "bf16"  # "fp8" (1 byte/elem + fp32 scale per scale_block) or "bf16"
    scale_block: int = 128
    combine_dtype: str = "bf16"
    source: str = ""  # where the numbers come from

    @property
    def dispatch_bytes_per_token(self) -> int:
        raise NotImplementedError

    @property
    def combine_bytes_per_token(self) -> int:
        raise NotImplementedError


def list_models() -> list[str]:
    raise NotImplementedError


def load_model(name_or_path: str) -> ModelConfig:
    """Preset name (e.g. ``deepseek-v3``) or path to a YAML file; raises UsageError on bad input."""
    raise NotImplementedError
