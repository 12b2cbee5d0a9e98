"""Command-line flags as data, declared beside the config whose fields they set.

A component lists its flags as `Flag`s next to its frozen config (scan/record/trace_config.py,
dpp/config.py, fbd/config.py, launch/flags.py, cli/injection.py); `add_flags` turns a list into
argparse arguments, every default read from the config dataclass (never written a second time),
and `read_flags` turns the parsed values back into that config's keyword arguments. The
command-line adapters (cli/ and the components' `cli.py` modules) are the only callers; code
below them receives configs, never a parsed namespace.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flag:
    """One flag: its option string, the config field it sets, its help and argparse keywords
    (type, choices, action, metavar, nargs). `field` None: the flag sets no config field (its
    dest is the flag's name)."""

    option: str
    field: str | None = None
    help: str = ""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    show_default: bool = True
    aliases: tuple[str, ...] = ()  # other option strings, e.g. ("-o",)

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")


def config_default(config_cls: type | None, name: str | None):
    """The default of field `name` of dataclass `config_cls` (None without one)."""
    if config_cls is None or name is None:
        return None
    f = config_cls.__dataclass_fields__[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def add_flags(container, flags, config_cls: type | None = None, hidden: bool = False) -> None:
    """Add `flags` to `container` (a parser or an argument group), each default the field's
    default in `config_cls`; `hidden`: left out of --help (test knobs)."""
    for flag in flags:
        kwargs = dict(flag.kwargs)
        default = config_default(config_cls, flag.field)
        if kwargs.get("action") == "append":
            default = None  # argparse appends to a given default list; empty is read as ()
        elif kwargs.get("action") in ("store_true", "store_false"):
            default = bool(default)
        elif "type" not in kwargs and "choices" not in kwargs and "action" not in kwargs and default is not None:
            kwargs["type"] = type(default)
        text = flag.help
        if flag.show_default and not (default is None or isinstance(default, bool) or hidden):
            text = f"{text} (default: {default})".strip()
        container.add_argument(
            *flag.aliases,
            flag.option,
            dest=flag.dest,
            default=default,
            help=argparse.SUPPRESS if hidden else text,
            **kwargs,
        )


def read_flags(args: argparse.Namespace, flags) -> dict[str, Any]:
    """{config field: parsed value} of the `flags` that set a field."""
    out = {}
    for flag in flags:
        if flag.field is None:
            continue
        value = getattr(args, flag.dest)
        out[flag.field] = tuple(value or ()) if flag.kwargs.get("action") == "append" else value
    return out
