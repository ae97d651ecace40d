"""How a number of bytes is written for people: decimal (SI) units, as every table and message of
the command line, the run reports and the benchmarks write them (1 GB = 10^9 bytes)."""

from __future__ import annotations

BYTE_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def human_bytes(value: float) -> str:
    """``value`` bytes in the largest unit of ``BYTE_UNITS`` under which it stays below 1000:
    ``"512 B"``, ``"1.50 MB"``, ``"2.36 GB"`` (whole bytes, otherwise two decimals)."""
    for unit in BYTE_UNITS:
        if abs(value) < 1000 or unit == BYTE_UNITS[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1000
    raise AssertionError("unreachable: the last unit returns")
