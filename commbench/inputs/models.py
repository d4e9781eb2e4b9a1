"""Model presets: the MoE layer shapes that decide dispatch/combine traffic.

Presets are YAML files in ``commbench/inputs/presets/`` (package data); a user can
pass the path of their own YAML file with the same keys.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from commbench.errors import UsageError

DTYPES = ("fp8", "bf16")
COMBINE_DTYPES = ("bf16",)
_REQUIRED_KEYS = ("hidden", "num_experts", "topk")
_POSITIVE_KEYS = ("hidden", "num_experts", "topk", "n_group", "topk_group", "scale_block")


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

    def __post_init__(self) -> None:
        where = f"model {self.name!r}"
        for key in (*_POSITIVE_KEYS, "num_shared_experts"):
            value = getattr(self, key)
            least = 0 if key == "num_shared_experts" else 1
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                kind = "an integer >= 0" if least == 0 else "a positive integer"
                raise UsageError(f"{where}: {key} must be {kind}, got {value!r}")
            object.__setattr__(self, key, int(value))  # numpy integers become plain ints
        if self.topk > self.num_experts:
            raise UsageError(f"{where}: topk {self.topk} exceeds num_experts {self.num_experts}")
        if self.topk_group > self.n_group:
            raise UsageError(f"{where}: topk_group {self.topk_group} exceeds n_group {self.n_group}")
        if self.num_experts % self.n_group:
            raise UsageError(
                f"{where}: n_group {self.n_group} does not divide num_experts {self.num_experts}"
            )
        if self.topk > self.topk_group * self.experts_per_group:
            raise UsageError(
                f"{where}: topk {self.topk} exceeds the {self.topk_group * self.experts_per_group} experts "
                f"in {self.topk_group} kept groups; raise topk_group"
            )
        if self.dispatch_dtype not in DTYPES:
            raise UsageError(
                f"{where}: dispatch_dtype must be one of {', '.join(DTYPES)}, got {self.dispatch_dtype!r}"
            )
        if self.combine_dtype not in COMBINE_DTYPES:
            raise UsageError(f"{where}: combine_dtype must be bf16, got {self.combine_dtype!r}")

    @property
    def experts_per_group(self) -> int:
        return self.num_experts // self.n_group

    @property
    def group_limited(self) -> bool:
        """True when routing keeps only some expert groups per token (DeepSeek-V3 node-limited routing)."""
        return self.n_group > 1 and self.topk_group < self.n_group

    @property
    def dispatch_bytes_per_token(self) -> int:
        """Payload bytes of one dispatched row: FP8 carries one fp32 scale per ``scale_block`` channels."""
        if self.dispatch_dtype == "fp8":
            return self.hidden + math.ceil(self.hidden / self.scale_block) * 4
        return 2 * self.hidden

    @property
    def combine_bytes_per_token(self) -> int:
        return 2 * self.hidden


def _preset_files() -> dict[str, Any]:
    """Preset name -> readable resource (package data ``commbench/inputs/presets/*.yaml``)."""
    folder = importlib.resources.files("commbench.inputs").joinpath("presets")
    return {entry.name[: -len(".yaml")]: entry for entry in folder.iterdir() if entry.name.endswith(".yaml")}


def list_models() -> list[str]:
    return sorted(_preset_files())


def _looks_like_path(text: str) -> bool:
    return text.endswith((".yaml", ".yml")) or "/" in text or "\\" in text or Path(text).is_file()


def load_model(name_or_path: str) -> ModelConfig:
    """Preset name (e.g. ``deepseek-v3``) or path to a YAML file; raises UsageError on bad input."""
    if _looks_like_path(name_or_path):
        path = Path(name_or_path)
        if not path.is_file():
            raise UsageError(
                f"model file {name_or_path} not found; pass a preset name or an existing YAML file"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
            raise UsageError(
                f"model file {name_or_path} unreadable ({reason}); pass a YAML text file"
            ) from None
        return _parse_model(text, origin=str(path), default_name=path.stem)
    presets = _preset_files()
    entry = presets.get(name_or_path)
    if entry is None:
        raise UsageError(
            f"unknown model {name_or_path!r}; presets: {', '.join(sorted(presets))} (or a YAML file path)"
        )
    return _parse_model(entry.read_text(), origin=f"preset {name_or_path}", default_name=name_or_path)


def _parse_model(text: str, origin: str, default_name: str) -> ModelConfig:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        mark = getattr(exc, "problem_mark", None)
        line = f" at line {mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{origin}: invalid YAML{line}: {problem}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{origin}: expected a mapping of model keys (hidden, num_experts, topk, ...)")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(str(key) for key in data if key not in known)
    if unknown:
        raise UsageError(
            f"{origin}: unknown key(s) {', '.join(unknown)}; accepted: {', '.join(sorted(known))}"
        )
    missing = [key for key in _REQUIRED_KEYS if key not in data]
    if missing:
        raise UsageError(f"{origin}: missing key(s) {', '.join(missing)}")
    if "n_group" in data and data["n_group"] != 1 and "topk_group" not in data:
        # The default topk_group = 1 would silently route every token to a single group.
        raise UsageError(f"{origin}: n_group is set but topk_group is missing; add topk_group (groups kept)")
    data.setdefault("name", default_name)
    for key in ("name", "source", "dispatch_dtype", "combine_dtype"):
        if key in data and not isinstance(data[key], str):
            raise UsageError(f"{origin}: {key} must be a string, got {data[key]!r}")
    try:
        return ModelConfig(**data)
    except UsageError as exc:
        # Name the file rather than the model: drop the "model 'x': " prefix of the validation message.
        raise UsageError(f"{origin}: {str(exc).split(': ', 1)[-1]}") from None
