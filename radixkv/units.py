"""Byte counts as people write them (``4GB``, ``512MiB``), shared by every layer that reads them
from a flag or a URL (engine config, storage URLs)."""

from __future__ import annotations

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})


def parse_bytes(text: str) -> int:
    """A byte count from the command line: ``4000000000``, ``4GB`` (10**9), ``4GiB`` (2**30),
    ``512MiB``, ``1.5GB``; raises ValueError (argparse reports it as a bad flag value)."""
    t = text.strip().upper().replace("_", "")
    num = t.rstrip("KMGTIB")
    unit = t[len(num) :].strip()
    try:
        if unit not in _UNITS:
            raise ValueError(unit)
        value = float(num) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"not a byte count: {text!r} (e.g. 4000000000, 4GB, 512MiB)") from None
    if value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


parse_bytes.__name__ = "byte count"  # argparse names the type in its error message
