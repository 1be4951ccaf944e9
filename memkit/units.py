"""Byte units shared by tables, figures and the command line (binary: 1 MiB = 2**20 bytes)."""

from __future__ import annotations

from typing import Literal

Unit = Literal["B", "KiB", "MiB", "GiB"]
UNITS: dict[str, int] = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def unit_scale(unit: str) -> int:
    """Bytes in one ``unit``; a ValueError names the allowed units.

    Example:
        >>> unit_scale("MiB")
        1048576
    """
    try:
        return UNITS[unit]
    except KeyError:
        raise ValueError(f"unit must be one of {list(UNITS)}, got {unit!r}") from None


def best_unit(nbytes: float) -> str:
    """The largest unit in which ``nbytes`` is at least 1 (B for less than a KiB).

    Example:
        >>> best_unit(3 * 2**30)
        'GiB'
    """
    return next(u for u in ("GiB", "MiB", "KiB", "B") if abs(nbytes) >= UNITS[u] or u == "B")


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in its best unit, e.g. ``"1.50 GiB"`` or ``"512 B"``.

    Example:
        >>> format_bytes(1536 * 2**20)
        '1.50 GiB'
    """
    unit = best_unit(nbytes)
    value = nbytes / UNITS[unit]
    return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"


def parse_bytes(text: str) -> int:
    """A size a person types, in bytes: ``"40GiB"``, ``"512 MiB"``, ``"1.5GiB"``, ``"123"`` (bytes).

    Example:
        >>> parse_bytes("40GiB")
        42949672960
    """
    if not isinstance(text, str):
        raise TypeError(f"a size must be a string such as '40GiB', got {type(text).__name__}")
    s = text.strip()
    unit = next((u for u in ("GiB", "MiB", "KiB", "B") if s.endswith(u)), None)
    number = s[: -len(unit)].strip() if unit else s
    try:
        value = float(number)
    except ValueError:
        raise ValueError(
            f"a size must be a number with an optional unit {list(UNITS)}, e.g. '40GiB', got {text!r}"
        ) from None
    if value <= 0 or value != value or value == float("inf"):
        raise ValueError(f"a size must be positive, got {text!r}")
    return int(value * UNITS[unit or "B"])


def format_seconds(seconds: float) -> str:
    """A duration with three significant digits in s, ms or µs.

    Example:
        >>> format_seconds(3.6061), format_seconds(0.01234), format_seconds(2.5e-6)
        ('3.61 s', '12.3 ms', '2.5 µs')
    """
    if seconds >= 1:
        return f"{seconds:.3g} s" if seconds < 1000 else f"{seconds:.0f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"
