"""Model presets: the MoE layer shapes that decide dispatch/combine traffic.

Presets are YAML files in ``commbench/inputs/presets/`` (package data); a user can
pass the path of their own YAML file with the same keys.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commbench.errors import UsageError
from commbench.inputs.userfiles import kind_of, load_yaml_mapping, read_user_text, shorten, show_path

DTYPES = ("fp8", "bf16")
COMBINE_DTYPES = ("bf16",)
_REQUIRED_KEYS = ("hidden", "num_experts", "topk")
_POSITIVE_KEYS = ("hidden", "num_experts", "topk", "n_group", "topk_group", "scale_block")
# Upper bounds of every count. Real MoE layers sit far below them (hidden <= ~25K, routed experts <= 512,
# top-k <= 32 today), so each leaves room for models to come, while a value above is a typo (hidden 1e20,
# 10^12 experts) that would otherwise fail only inside the ranks, or fill the host's memory first: one row of
# hidden 2^20 is 2 MiB, and routing keeps tables of num_experts + 1 entries per rank.
_EXAMPLES = {"hidden": 7168, "num_experts": 256, "topk": 8, "num_shared_experts": 1, "n_group": 8}
_EXAMPLES.update(topk_group=4, scale_block=128, moe_intermediate=2048)
LIMITS = {
    "hidden": 1 << 20,
    "moe_intermediate": 1 << 20,  # one routed expert's FFN width; real ones are 768-16384
    "num_experts": 1 << 16,
    "topk": 1 << 10,  # rows per token in selection mode: 1024 x the tokens at most
    "num_shared_experts": 1 << 10,  # computed locally: only a sanity bound
    "n_group": 1 << 16,  # <= num_experts anyway (it must divide it)
    "topk_group": 1 << 16,  # <= n_group anyway
    "scale_block": 1 << 20,  # one fp32 scale per block: a block above hidden means one scale per row
}
_MAX_NAME_CHARS = 100  # a name labels tables and report rows: one short line
_MARKUP = "<>&\"'`|\\{}$"  # characters a model name never needs: HTML, Markdown table cells, shells


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
    # One routed expert's FFN width (Hugging Face moe_intermediate_size; intermediate_size for Mixtral,
    # Llama 4 and gpt-oss): the expert FLOPs of the comm/compute budget. None: unknown, budget not computed.
    moe_intermediate: int | None = None

    def __post_init__(self) -> None:
        where = f"model {shorten(self.name)}"
        optional = ("moe_intermediate",) if self.moe_intermediate is not None else ()
        for key in (*_POSITIVE_KEYS, "num_shared_experts", *optional):
            value = getattr(self, key)
            least = 0 if key == "num_shared_experts" else 1
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                kind = "an integer >= 0" if least == 0 else "a positive integer"
                got = (
                    f"{kind_of(value)} {shorten(value)}" if isinstance(value, bool | str) else shorten(value)
                )
                raise UsageError(
                    f"{where}: {key} must be {kind}, got {got}; write e.g. {key}: {_EXAMPLES[key]}"
                )
            if value > LIMITS[key]:
                raise UsageError(
                    f"{where}: {key} {shorten(value)} is above the limit {LIMITS[key]} (far beyond any real "
                    "model); check the value"
                )
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
                f"{where}: dispatch_dtype must be one of {', '.join(DTYPES)}, "
                f"got {shorten(self.dispatch_dtype)}"
            )
        if self.combine_dtype not in COMBINE_DTYPES:
            raise UsageError(f"{where}: combine_dtype must be bf16, got {shorten(self.combine_dtype)}")

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
    # os.path.isfile, unlike Path.is_file, says False for a name too long to be a path.
    return text.endswith((".yaml", ".yml")) or "/" in text or "\\" in text or os.path.isfile(text)


def load_model(name_or_path: str) -> ModelConfig:
    """Preset name (e.g. ``deepseek-v3``) or path to a YAML file; raises UsageError on bad input."""
    if _looks_like_path(name_or_path):
        path = Path(os.path.expanduser(name_or_path))
        if not os.path.lexists(path):
            raise UsageError(
                f"model file {show_path(name_or_path)} not found; pass a preset name "
                f"({', '.join(list_models())}) or an existing YAML file"
            )
        text = read_user_text(path, "model file")  # bounded, UTF-8, a regular file
        return _parse_model(text, origin=f"model file {show_path(name_or_path)}", default_name=path.stem)
    presets = _preset_files()
    entry = presets.get(name_or_path)
    if entry is None:
        raise UsageError(
            f"unknown model {shorten(name_or_path)}; presets: {', '.join(sorted(presets))} "
            "(or a YAML file path)"
        )
    text = entry.read_text(encoding="utf-8")
    return _parse_model(text, origin=f"preset {name_or_path}", default_name=name_or_path)


def _parse_model(text: str, origin: str, default_name: str) -> ModelConfig:
    known = [f.name for f in dataclasses.fields(ModelConfig)]
    data = load_yaml_mapping(text, origin, known)  # bounded YAML, flat mapping of known keys to scalars
    missing = [key for key in _REQUIRED_KEYS if key not in data]
    if missing:
        raise UsageError(
            f"{origin}: missing key(s) {', '.join(missing)}; e.g. hidden: 7168, num_experts: 256, topk: 8"
        )
    if "n_group" in data and data["n_group"] != 1 and "topk_group" not in data:
        # The default topk_group = 1 would silently route every token to a single group.
        raise UsageError(f"{origin}: n_group is set but topk_group is missing; add topk_group (groups kept)")
    data.setdefault("name", default_name)
    for key in ("name", "source", "dispatch_dtype", "combine_dtype"):
        if key in data and not isinstance(data[key], str):
            raise UsageError(
                f"{origin}: {key} must be a string, got {kind_of(data[key])} {shorten(data[key])}; quote it"
            )
    name = data["name"]
    if not name.strip() or len(name) > _MAX_NAME_CHARS or not name.isprintable():
        raise UsageError(
            f"{origin}: name {shorten(name)} must be 1 to {_MAX_NAME_CHARS} printable characters on one line"
        )
    markup = sorted(set(name) & set(_MARKUP))
    if markup:  # a name labels tables, pages and file cells: markup there is someone's mistake or attack
        raise UsageError(
            f"{origin}: name {shorten(name)} holds {' '.join(markup)}; use letters, digits, spaces and "
            ". _ - + / :"
        )
    try:
        return ModelConfig(**data)
    except UsageError as exc:
        # Name the file rather than the model: drop the "model 'x': " prefix of the validation message.
        raise UsageError(f"{origin}: {str(exc).split(': ', 1)[-1]}") from None
