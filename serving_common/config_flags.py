"""A service's flags generated from its config dataclass: each option is declared once, as a field.

``max_queue: int = option(64, "requests waiting at most", at_least=1)`` is the field's default, the
flag ``--max-queue`` (type from the annotation), its help, its ``PREFIX_MAX_QUEUE`` environment
variable (see :class:`~serving_common.flags.EnvDefaultsParser`) and its bounds. A field holding a
nested config dataclass declared with :func:`group` is a group of flags (``--http-...``); a field
declared plainly has no flag and keeps its default.

The flag types come from the annotations: ``int``, ``float``, ``str``, ``Path`` (each also
``X | None``), ``bool`` (``--flag`` alone sets it) and ``tuple[X, ...]`` (the flag repeated; the
first one replaces the default). ``choices`` given as a mapping takes the names on the command line
and puts their values in the config (``--dtype float16`` gives ``DTYPE_FLOAT16``).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar, Union, cast, get_args, get_origin, get_type_hints

from serving_common.flags import EnvDefaultsParser, Repeated

T = TypeVar("T")
_OPTION = "serving_common.option"
_GROUP = "serving_common.group"
_SCALARS: tuple[type, ...] = (bool, int, float, str, Path)


class ServiceConfig(Protocol):
    """A service's config dataclass: its program name and the prefix of its environment variables."""

    PROG: ClassVar[str]
    ENV_PREFIX: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


C = TypeVar("C", bound=ServiceConfig)


class OptionError(ValueError):
    """A flag's value is outside what its option declares (argparse checks neither bounds nor the
    choices of a value that came from the environment)."""


@dataclass(frozen=True)
class Option:
    """What ``option()`` declares beside the default: the help, another flag name, the choices and
    the bounds (``at_least`` <= value, ``above`` < value, value <= ``at_most``)."""

    help: str
    flag: str | None = None
    choices: Sequence[object] | Mapping[str, object] | None = None
    at_least: float | None = None
    above: float | None = None
    at_most: float | None = None


@dataclass(frozen=True)
class Group:
    """What ``group()`` declares: the title of the help section and the prefix of its flags."""

    title: str
    prefix: str = ""


@dataclass(frozen=True)
class Flag:
    """One generated flag: where its value goes and how it is read."""

    name: str  # --max-queue
    field: str  # the field's name in its dataclass
    option: Option
    default: object  # the field's default, as the config holds it
    kind: type  # what one value on the command line is read as
    repeated: bool
    group: str | None  # the title of the group it is in, if any

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")

    @property
    def names(self) -> list[str]:
        """The choices as typed on the command line."""
        choices = self.option.choices
        return [] if choices is None else [str(choice) for choice in choices]

    @property
    def shown_default(self) -> object:
        """The default as the command line spells it."""
        if isinstance(self.option.choices, Mapping):
            return next(name for name, value in self.option.choices.items() if value == self.default)
        return self.default


def option(default: T, help: str, *, flag: str | None = None,
           choices: Sequence[T] | Mapping[str, T] | None = None, at_least: float | None = None,
           above: float | None = None, at_most: float | None = None) -> T:
    """A config field that is also a flag (``--field-name`` unless ``flag`` says otherwise)."""
    declared = Option(help, flag, choices, at_least, above, at_most)
    field: T = dataclasses.field(default=default, metadata={_OPTION: declared})
    return field


def group(cls: Callable[[], T], *, title: str, prefix: str = "") -> T:
    """A config field holding a nested config dataclass whose options are a group of flags, each
    named ``--<prefix><field-name>``."""
    field: T = dataclasses.field(default_factory=cls, metadata={_GROUP: Group(title, prefix)})
    return field


def flags(cls: type, prefix: str = "", title: str | None = None) -> Iterator[Flag]:
    """Every flag of a config dataclass, nested groups included, in field order."""
    for field, hint in _fields(cls):
        if _GROUP in field.metadata:
            nested: Group = field.metadata[_GROUP]
            yield from flags(hint, prefix + nested.prefix, nested.title)
        elif _OPTION in field.metadata:
            yield _flag(field, hint, prefix, title)


def _fields(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Any]]:
    """(field, resolved annotation) of each field of a dataclass."""
    hints = get_type_hints(cls)
    for field in dataclasses.fields(cast(Any, cls)):
        yield field, hints[field.name]


def _flag(field: dataclasses.Field[Any], hint: object, prefix: str, title: str | None) -> Flag:
    declared: Option = field.metadata[_OPTION]
    kind, repeated = _flag_type(hint)
    if isinstance(declared.choices, Mapping):
        kind = str
    name = declared.flag or "--" + prefix + field.name.replace("_", "-")
    return Flag(name, field.name, declared, field.default, kind, repeated, title)


def _flag_type(annotation: object) -> tuple[type, bool]:
    """(the type of one value, whether the flag repeats) for a field's annotation."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _flag_type(args[0])[0], True
    if origin in (Union, types.UnionType):
        [inner] = [arg for arg in args if arg is not type(None)]
        return _flag_type(inner)
    if isinstance(annotation, type) and annotation in _SCALARS:
        return annotation, False
    raise TypeError(f"no flag type for a field annotated {annotation!r}")


def add_options(parser: EnvDefaultsParser, cls: type) -> None:
    """Adds a flag for every option of ``cls``; a nested group's flags go in an argument group."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in flags(cls):
        container: argparse._ActionsContainer = parser
        if flag.group is not None:
            if flag.group not in groups:
                groups[flag.group] = parser.add_argument_group(flag.group)
            container = groups[flag.group]
        kwargs: dict[str, Any] = {"dest": flag.dest, "help": flag.option.help}
        if flag.kind is bool:
            if flag.default is not False:
                raise TypeError(f"{flag.name}: a bool option must default to False")
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type=flag.kind, default=flag.shown_default)
            if flag.option.choices is not None:
                kwargs["choices"] = list(flag.option.choices)
            if flag.repeated:
                kwargs["action"] = Repeated
        container.add_argument(flag.name, **kwargs)


def config_from_args(cls: type[T], namespace: argparse.Namespace, prefix: str = "") -> T:
    """The config dataclass of the parsed flags; OptionError when a value is outside its bounds or
    (coming from the environment) not one of its choices."""
    values: dict[str, object] = {}
    problems: list[str] = []
    for field, hint in _fields(cls):
        if _GROUP in field.metadata:
            nested: Group = field.metadata[_GROUP]
            try:
                values[field.name] = config_from_args(hint, namespace, prefix + nested.prefix)
            except OptionError as error:
                problems.append(str(error))
        elif _OPTION in field.metadata:
            flag = _flag(field, hint, prefix, None)
            value = getattr(namespace, flag.dest)
            problem = _problem(flag, value)
            if problem:
                problems.append(problem)
            elif isinstance(flag.option.choices, Mapping):
                values[field.name] = flag.option.choices[value]
            else:
                values[field.name] = tuple(value) if flag.repeated else value
    if problems:
        raise OptionError("; ".join(problems))
    return cls(**values)


def _problem(flag: Flag, value: object) -> str | None:
    """What is wrong with ``value`` for ``flag``, or None."""
    declared = flag.option
    if declared.choices is not None and value is not None and value not in declared.choices:
        return f"{flag.name} must be one of {', '.join(flag.names)}, not {value!r}"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    low, high = declared.at_least, declared.at_most
    if low is not None and high is not None and not low <= value <= high:
        return f"{flag.name} must be {_number(low)} to {_number(high)}"
    if low is not None and not value >= low:
        return f"{flag.name} must be >= {_number(low)}"
    if declared.above is not None and not value > declared.above:
        return f"{flag.name} must be > {_number(declared.above)}"
    if high is not None and not value <= high:
        return f"{flag.name} must be <= {_number(high)}"
    return None


def _number(bound: float) -> str:
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


def parse_config(cls: type[C], argv: Sequence[str] | None, *, description: str,
                 check: Callable[[C], None] | None = None) -> C:
    """``cls`` from the command line and ``cls.ENV_PREFIX`` environment variables; a bad value, or
    one ``check`` refuses (ValueError or OSError), exits with argparse's usage error (status 2)."""
    parser = EnvDefaultsParser(prog=cls.PROG, description=description, env_prefix=cls.ENV_PREFIX)
    add_options(parser, cls)
    namespace = parser.parse_args(argv)
    try:
        config = config_from_args(cls, namespace)
        if check is not None:
            check(config)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    return config
