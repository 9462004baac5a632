"""Settings helpers every layer may use: the error a bad setting raises, and sizes with units.

Sizes accept integers (bytes) or strings with a unit: ``"64KiB"``, ``"4GiB"``, ``"100GB"``
(``K/M/G/T`` are powers of 1000, ``Ki/Mi/Gi/Ti`` powers of 1024).
"""

from __future__ import annotations

import re

__all__ = ["ConfigError", "GiB", "parse_size"]

GiB = 1 << 30
_UNITS = {
    "": 1,
    "B": 1,
    "K": 10**3,
    "KB": 10**3,
    "M": 10**6,
    "MB": 10**6,
    "G": 10**9,
    "GB": 10**9,
    "T": 10**12,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


class ConfigError(ValueError):
    """A configuration value or file is invalid."""


def parse_size(value: int | str, name: str = "size") -> int:
    """Bytes from an int or a string like ``"64KiB"``/``"100GB"``.

    >>> parse_size("1.5KiB"), parse_size(4096)
    (1536, 4096)
    """
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).upper() if m else None
        if m and unit in _UNITS:
            n = float(m.group(1)) * _UNITS[unit]
            if n != int(n):
                raise ConfigError(f"{name}: {value!r} is not a whole number of bytes")
            return int(n)
        raise ConfigError(f"{name}: cannot parse size {value!r} (examples: 4096, '64KiB', '100GB')")
    raise ConfigError(f"{name}: expected an int or a size string, got {type(value).__name__}")
