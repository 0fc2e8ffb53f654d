"""How the HTTP API reads a caller's JSON values and quotes them in its errors."""

from __future__ import annotations

import math

# Characters of a caller's value that an error message quotes.
SHOWN_CHARS = 40


def json_number(value: object) -> float | None:
    """``value`` as a finite float; None when it is not a number or beyond a float's range (JSON
    numbers are unbounded: ``1`` and 400 zeros is an int, ``1e400`` infinity)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def shown_name(name: str) -> str:
    """A caller's field name as an error may show it: short, and escaped unless printable (a
    control character or a lone surrogate is not)."""
    return name[:SHOWN_CHARS] if name.isprintable() else ascii(name[:SHOWN_CHARS])


def shown(value: object) -> str:
    """``value`` as an error message quotes it: a scalar's repr cut short, else its JSON type
    (a deeply nested array's repr would recurse as deep, and a long one would be long)."""
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."
