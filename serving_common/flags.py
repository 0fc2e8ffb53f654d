"""argparse for every entry point: no abbreviated flags, and environment defaults (``PREFIX_FLAG``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from typing import Any


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except None or nothing: the help says what leaving it out does.
    A repeated flag's default is shown as its values, comma-separated."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == [] or action.default == ():
            return action.help
        if isinstance(action.default, (list, tuple)):
            shown = ", ".join(str(value) for value in action.default).replace("%", "%%")
            return f"{action.help} (default: {shown})"
        return super()._get_help_string(action)


class Repeated(argparse.Action):
    """A flag given once per value (``--runner a --runner b``). The first one on the command line
    replaces the default, built in or from the environment, rather than adding to it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        current = getattr(namespace, self.dest)
        earlier = [] if current is self.default else list(current)
        setattr(namespace, self.dest, [*earlier, values])


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
        return super().add_argument(*names, **self.with_environment(names, kwargs))

    def add_argument_group(self, *args: Any, **kwargs: Any) -> argparse._ArgumentGroup:
        group = _EnvGroup(self, *args, **kwargs)
        self._action_groups.append(group)
        return group

    def with_environment(self, names: Sequence[str], kwargs: dict[str, Any]) -> dict[str, Any]:
        """``add_argument``'s keywords with the flag's variable named in its help, and its value, if
        set, as the default."""
        long_names = [n for n in names if n.startswith("--")]
        if long_names and kwargs.get("action") not in ("help", "version"):
            variable = env_variable(self.env_prefix, long_names[0])
            kwargs["help"] = f"{kwargs.get('help', '')} [env {variable}]".strip()
            if variable in os.environ:
                try:
                    kwargs["default"] = _from_env(os.environ[variable], kwargs)
                except ValueError as error:
                    self.error(f"{variable}: {error}")
                kwargs["required"] = False
        return kwargs


class _EnvGroup(argparse._ArgumentGroup):
    """An argument group of an EnvDefaultsParser: its flags come from the environment too."""

    def __init__(self, parser: EnvDefaultsParser, *args: Any, **kwargs: Any) -> None:
        super().__init__(parser, *args, **kwargs)
        self.parser = parser

    def add_argument(self, *names: str, **kwargs: Any) -> argparse.Action:
        return super().add_argument(*names, **self.parser.with_environment(names, kwargs))


def env_variable(prefix: str, flag: str) -> str:
    """The environment variable of ``--flag-name``: ``PREFIX_FLAG_NAME``."""
    return prefix + flag.removeprefix("--").upper().replace("-", "_")


def _from_env(raw: str, kwargs: Mapping[str, Any]) -> object:
    action = kwargs.get("action")
    if action == "store_true":
        return raw.strip().lower() in {"1", "true", "yes", "on"}
    convert = kwargs.get("type")
    if not callable(convert):
        convert = str
    if action == "append" or action is Repeated:
        return [convert(part) for part in raw.split(",") if part]
    return convert(raw)
