"""Command-line flags as data, declared beside the config whose fields they set.

A component lists its flags as `Flag`s next to its frozen config (config/ for the training job's
components, scan/record/trace_config.py, dpp/config.py, fbd/config.py, launch/flags.py,
cli/injection.py); `add_flags` turns a list into argparse arguments, every default read from
the config dataclass (never written a second time), and `read_flags` turns the parsed values
back into that config's keyword arguments. The command-line adapters (cli/ and the components'
`cli.py` modules) are the only callers; code below them receives configs, never a parsed namespace.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

# Flag.kwargs may name argparse's BooleanOptionalAction (--X / --no-X) by this string, so that
# the config modules declaring flags need not import argparse; add_flags passes the class on
BOOLEAN_OPTIONAL = "boolean_optional"
_BOOLEAN_ACTIONS = ("store_true", "store_false", BOOLEAN_OPTIONAL)


@dataclass(frozen=True)
class Flag:
    """One flag: its option string, the config field it sets, its help and argparse keywords
    (type, choices, action, metavar, nargs). `field` None: the flag sets no config field (its
    dest is the flag's name). `hidden`: left out of --help (another spelling of a flag)."""

    option: str
    field: str | None = None
    help: str = ""
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    show_default: bool = True
    aliases: tuple[str, ...] = ()  # other option strings, e.g. ("-o",)
    hidden: bool = False

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")


def field_flag(option: str, help: str = "", **kwargs) -> Flag:
    """A Flag setting the config field its option names (--micro-batch-size: micro_batch_size)."""
    return Flag(option, option.lstrip("-").replace("-", "_"), help, kwargs)


def config_default(config_cls: type | None, name: str | None):
    """The default of field `name` of dataclass `config_cls` (None without one)."""
    if config_cls is None or name is None:
        return None
    f = config_cls.__dataclass_fields__[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def add_flags(
    container, flags, config_cls: type | None = None, hidden: bool = False, default_in_help_only: bool = False
) -> None:
    """Add `flags` to `container` (a parser or an argument group), each default the field's
    default in `config_cls`; `hidden`: left out of --help (test knobs).

    `default_in_help_only`: each flag defaults to None and stores under its field's name, so
    that only the flags given are passed on and the config's own default applies otherwise;
    --help still shows that default (booleans aside, whose help says it)."""
    for flag in flags:
        config_value = config_default(config_cls, flag.field)
        default = None if default_in_help_only else _parser_default(flag, config_value)
        shown_default = config_value if default_in_help_only else default
        container.add_argument(
            *flag.aliases,
            flag.option,
            dest=flag.field if default_in_help_only else flag.dest,
            default=default,
            help=_help_text(flag, shown_default, hidden, default_in_help_only),
            **_argparse_kwargs(flag, default),
        )


def _parser_default(flag: Flag, config_value):
    """The parser's default for `flag` whose field defaults to `config_value`."""
    action = flag.kwargs.get("action")
    if action == "append":
        return None  # argparse appends to a given default list; empty is read as ()
    if action in ("store_true", "store_false"):
        return bool(config_value)
    return config_value


def _argparse_kwargs(flag: Flag, default) -> dict[str, Any]:
    """`flag.kwargs` for add_argument: the boolean-optional marker as argparse's class, and a
    type read from the default when none is given."""
    kwargs = dict(flag.kwargs)
    if kwargs.get("action") == BOOLEAN_OPTIONAL:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif "type" not in kwargs and "choices" not in kwargs and "action" not in kwargs and default is not None:
        kwargs["type"] = type(default)
    return kwargs


def _help_text(flag: Flag, default, hidden: bool, always_show_default: bool) -> str:
    """`flag`'s help with "(default: X)" appended, or argparse.SUPPRESS when hidden. A boolean
    flag's default is never appended; `always_show_default`: any other's is, None included."""
    if hidden or flag.hidden:
        return argparse.SUPPRESS
    if always_show_default:
        shown = flag.kwargs.get("action") not in _BOOLEAN_ACTIONS
    else:
        shown = not (default is None or isinstance(default, bool))
    if not (flag.show_default and shown):
        return flag.help
    return f"{flag.help} (default: {default})".strip()


def read_flags(args: argparse.Namespace, flags) -> dict[str, Any]:
    """{config field: parsed value} of the `flags` that set a field."""
    out = {}
    for flag in flags:
        if flag.field is None:
            continue
        value = getattr(args, flag.dest)
        out[flag.field] = tuple(value or ()) if flag.kwargs.get("action") == "append" else value
    return out
