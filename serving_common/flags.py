"""argparse for every entry point: no abbreviated flags, and environment defaults (``PREFIX_FLAG``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except None: the help says what leaving it out does."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class StrictParser(argparse.ArgumentParser):
    """An ArgumentParser that takes no abbreviations (``--step`` is not ``--steps``) and shows the
    defaults that say something. Subparsers it makes are strict too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


class EnvDefaultsParser(StrictParser):
    """An ArgumentParser whose every ``--flag`` can also come from ``PREFIX_FLAG`` in the environment.

    Command-line flags win over the environment, which wins over the built-in default; the help
    text names the variable of each flag.
    """

    def __init__(self, *args: Any, env_prefix: str, **kwargs: Any) -> None:
        self.env_prefix = env_prefix
        super().__init__(*args, **kwargs)

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        long_names = [n for n in names if n.startswith("--")]
        if long_names and kwargs.get("action") not in ("help", "version"):
            variable = self.env_prefix + long_names[0][2:].upper().replace("-", "_")
            kwargs["help"] = f"{kwargs.get('help', '')} [env {variable}]".strip()
            if variable in os.environ:
                kwargs["default"] = _from_env(os.environ[variable], kwargs)
                kwargs["required"] = False
        return super().add_argument(*names, **kwargs)


def _from_env(raw: str, kwargs: Mapping[str, Any]) -> object:
    action = kwargs.get("action")
    if action == "store_true":
        return raw.strip().lower() in {"1", "true", "yes", "on"}
    convert = kwargs.get("type")
    if not callable(convert):
        convert = str
    if action == "append":
        return [convert(part) for part in raw.split(",") if part]
    return convert(raw)
