"""Rules for caller strings that become paths, names or log lines: the same on the worker and the runner.

A NUL cannot be in a path (the OS refuses it, Python raises ValueError), and a control character
in a name or a log line forges lines or corrupts what shows it; so such a string is refused with
INVALID_ARGUMENT naming its field, before anything uses it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from serving_common.errors import invalid_argument

MAX_PATH_CHARS = 4096
# LoRA adapter names. peft keeps an adapter's layers in a torch ModuleDict under its name, where
# "." is refused (a KeyError at load, "module name can't contain '.'"); "-" and "_" load and run.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
ADAPTER_NAME_RULE = "must be 1 to 64 letters, digits, '-' or '_'"

# C0 controls (NUL, newline, escape...), DEL, C1 controls and the Unicode line and paragraph separators.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def text_problem(value: str, max_chars: int = MAX_PATH_CHARS) -> str | None:
    """Why ``value`` cannot be a path, name or log line (too long, or a control character in it);
    None when it can."""
    if len(value) > max_chars:
        return f"must be at most {max_chars} characters, got {len(value)}"
    found = _CONTROL.search(value)
    if found is not None:
        return f"must not contain control characters ({found.group()!r} at {found.start()})"
    return None


def text_violations(fields: Iterable[tuple[str, str]], max_chars: int = MAX_PATH_CHARS) -> list[tuple[str, str]]:
    """One (field, why) per ``(field, value)`` that ``text_problem`` refuses."""
    return [(field, why) for field, value in fields if (why := text_problem(value, max_chars)) is not None]


def adapter_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name an adapter; None when it can."""
    return None if ADAPTER_NAME.fullmatch(name) else ADAPTER_NAME_RULE


def check_text(fields: Iterable[tuple[str, str]], max_chars: int = MAX_PATH_CHARS) -> None:
    """INVALID_ARGUMENT naming each field whose value ``text_problem`` refuses."""
    violations = text_violations(fields, max_chars)
    if violations:
        raise invalid_argument(violations)
