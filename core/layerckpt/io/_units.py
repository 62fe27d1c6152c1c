"""Byte units, the O_DIRECT alignment and the parser of sizes such as "16MiB": a leaf that imports nothing
of layerckpt but its errors, so that both the Config and the on-disk layout can use it."""
from __future__ import annotations

import re
from typing import Union

from ..errors import ConfigError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and lengths

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": KiB, "kb": 1000, "kib": KiB, "m": MiB, "mb": 1000**2, "mib": MiB,
          "g": GiB, "gb": 1000**3, "gib": GiB, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40}


def parse_size(value: Union[int, str], name: str) -> int:
    """Accept 16777216, "16MiB", "1.5GiB", "512kb"."""
    if isinstance(value, bool):
        raise ConfigError(f"Config.{name} must be a byte count, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and (m.group(2) or "").lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    raise ConfigError(f"Config.{name} must be a byte count such as 16777216 or '16MiB', got {value!r}")
