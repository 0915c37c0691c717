"""``--what-if nodes=2,ranks_per_node=8,link_gbit=30[,latency_us=50]``: a cluster to predict for."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

_REQUIRED = ("nodes", "ranks_per_node", "link_gbit")
_FIELDS = _REQUIRED + ("latency_us",)


class WhatIfError(ValueError):
    """A malformed --what-if; the message names the field."""


@dataclass(frozen=True)
class WhatIf:
    nodes: int
    ranks_per_node: int
    link_gbit: float
    latency_us: Optional[float] = None

    @property
    def link_bytes_per_s(self) -> float:
        return self.link_gbit * 1e9 / 8


def _int_field(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise WhatIfError(f"field '{name}': expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise WhatIfError(f"field '{name}': expected a whole number >= 1, got {value}")
    return value


def _float_field(name: str, text: str, allow_zero: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise WhatIfError(f"field '{name}': expected a number {bound}, got {text!r}")
    return value


def parse_what_if(text: str) -> WhatIf:
    """Parse ``key=value`` pairs separated by commas; raise :class:`WhatIfError` naming the
    field that is unknown, repeated, missing or out of range."""
    values: Dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise WhatIfError(f"field '{key}': expected {key}=VALUE")
        if key not in _FIELDS:
            raise WhatIfError(f"unknown field '{key}' (fields: {', '.join(_FIELDS)})")
        if key in values:
            raise WhatIfError(f"field '{key}' is given twice")
        values[key] = value.strip()
    for key in _REQUIRED:
        if key not in values:
            raise WhatIfError(f"field '{key}' is missing (required: {', '.join(_REQUIRED)})")
    latency = values.get("latency_us")
    return WhatIf(nodes=_int_field("nodes", values["nodes"]),
                  ranks_per_node=_int_field("ranks_per_node", values["ranks_per_node"]),
                  link_gbit=_float_field("link_gbit", values["link_gbit"], allow_zero=False),
                  latency_us=None if latency is None else _float_field("latency_us", latency,
                                                                       allow_zero=True))
