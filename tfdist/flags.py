"""Every option declared once: a frozen dataclass field is its flag, its default and its help.

The rule, for every command and API of the project: **a new option is one
field, in one dataclass, declared with** :func:`option`::

    @dataclass(frozen=True)
    class Recovery:
        max_restarts: int = option(0, "relaunch a failed job up to N times", metavar="N")

From that one field come: the Python API's argument (the dataclass is the
API's type: ``tfdist.Recovery(max_restarts=2)``), the command's flag
(``--max-restarts``, built by :func:`add_options`; its type, choices, metavar,
group and help), the default ``--help`` shows (once), and the command line a
typed value becomes again (:func:`to_argv`, how the API and the launcher pass
options on to ``train.py``). ``tests/test_options.py`` checks every parser
against its dataclasses (:func:`problems`): a default written a second time
anywhere (a literal in a parser, a function signature, another dataclass)
and differing fails it.

Conventions: a field whose default is ``None`` says what unset means with
``unset=`` (shown as its default); a ``bool`` field is a switch (its flag
sets it, or clears it when the default is True: name that flag ``--no-...``
with ``flag=``), a ``tuple[str, ...]`` field a repeatable flag; ``help`` and
``choices`` may be callables, evaluated when the parser is built (for lists
that live elsewhere, e.g. the registered strategies). Nothing here imports
TensorFlow or any of the project's packages.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from typing import Any, Callable, Iterable

_META = "tfdist.option"


def option(default: Any, help: str | Callable[[], str], *, metavar: str | None = None,
           choices: Iterable | Callable[[], Iterable] | None = None, unset: str | Callable[[], str] | None = None,
           flag: str | None = None, group: str | None = None, hidden: bool = False,
           required: bool = False) -> Any:
    """A dataclass field that is also a command-line option (see the module's rule).

    ``flag``: the flag's name when it is not ``--`` + the field's name with
    dashes; ``group``: the ``--help`` section (default: the one the class is
    added under); ``hidden``: parsed but not listed (internal flags);
    ``required``: the command requires the flag (the field keeps ``default``).
    """
    meta = {"help": help, "metavar": metavar, "choices": choices, "unset": unset, "flag": flag,
            "group": group, "hidden": hidden, "required": required}
    return dataclasses.field(default=default, metadata={_META: meta})


def options_of(cls) -> list[dataclasses.Field]:
    """The fields of ``cls`` (a dataclass or an instance) declared with :func:`option`."""
    return [f for f in dataclasses.fields(cls) if _META in f.metadata]


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata[_META]["flag"] or "--" + f.name.replace("_", "-")


def _resolve(value):
    return value() if callable(value) else value


def _kind(cls, f: dataclasses.Field) -> tuple[str, type | None]:
    """("switch" | "repeat" | "value", the value's type) from the field's annotation."""
    hint = typing.get_type_hints(cls)[f.name]
    if hint is bool:
        return "switch", None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        return "repeat", str
    if args:  # X | None
        hint = args[0]
    return "value", hint if hint in (int, float, str) else str


def help_text(f: dataclasses.Field) -> str:
    """The field's help, with its default said once (a switch or a repeatable flag: none)."""
    meta = f.metadata[_META]
    text = _resolve(meta["help"])
    if meta["required"] or isinstance(f.default, bool) or f.default == ():
        return text
    shown = _resolve(meta["unset"]) if f.default is None else format_default(f.default)
    return f"{text} (default: {shown})" if shown is not None else text


def format_default(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_options(parser, cls, title: str | None = None, *, exclude: Iterable[str] = (),
                only: Iterable[str] | None = None) -> None:
    """One argparse flag per :func:`option` field of ``cls`` (``only`` those, less
    ``exclude``), under ``title`` or the field's own ``group`` (a section of ``--help``,
    made once, in the order first named); the parser's default is the field's."""
    groups: dict[str | None, Any] = {}

    def group_for(name: str | None):
        if name is None:
            name = title
        if name not in groups:
            existing = {g.title: g for g in parser._action_groups}
            groups[name] = (parser if name is None else existing.get(name)
                            or parser.add_argument_group(name))
        return groups[name]

    skip = set(exclude)
    for f in options_of(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        meta = f.metadata[_META]
        kind, typ = _kind(cls, f)
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default,
                                  "help": argparse.SUPPRESS if meta["hidden"] else help_text(f)}
        if meta["required"]:
            kwargs.update(required=True)
            kwargs.pop("default")
        if kind == "switch":  # a default of True: the flag turns it off (--no-...)
            kwargs["action"] = "store_false" if f.default else "store_true"
        elif kind == "repeat":
            kwargs.update(action="append", default=None)
        else:
            kwargs["type"] = typ
        if meta["metavar"] is not None:
            kwargs["metavar"] = meta["metavar"]
        if meta["choices"] is not None:
            kwargs["choices"] = tuple(_resolve(meta["choices"]))
        group_for(meta["group"]).add_argument(flag_of(f), **kwargs)


def from_args(cls, namespace: argparse.Namespace | dict, **extra):
    """The dataclass ``cls`` from a parsed namespace: its option fields, typed (a
    repeatable flag's list as a tuple); ``extra`` for the fields the flags do not set."""
    values = vars(namespace) if isinstance(namespace, argparse.Namespace) else namespace
    out = dict(extra)
    for f in options_of(cls):
        if f.name in values and f.name not in out:
            value = values[f.name]
            out[f.name] = tuple(value or ()) if _kind(cls, f)[0] == "repeat" else value
    return cls(**out)


def to_argv(obj, *, exclude: Iterable[str] = ()) -> list[str]:
    """The flags that say ``obj`` again: one per option field that differs from its default
    (a repeatable flag once per value)."""
    argv: list[str] = []
    skip = set(exclude)
    for f in options_of(obj):
        value = getattr(obj, f.name)
        if f.name in skip or value == f.default:
            continue
        kind, _ = _kind(type(obj), f)
        flag = flag_of(f)
        if kind == "repeat":
            for item in ((value,) if isinstance(value, str) else value):
                argv += [flag, str(item)]
        elif kind == "switch":
            argv.append(flag)  # it differs from the default: the flag flips it
        elif value is not None:
            argv += [flag, str(value)]
    return argv


# --- --help ------------------------------------------------------------------

def description(doc: str) -> str:
    """A module docstring's first paragraph as plain text for ``--help`` (no reST markup)."""
    first = doc.strip().split("\n\n")[0]
    first = re.sub(r":\w+:`([^`]*)`", r"\1", first)
    return first.replace("``", "")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and epilogs as written; a flag's default said once.

    A help text that says its default already (every :func:`option`) is left as
    it is; a hand-written flag with a value default gets ``(default: X)``; a
    switch, a repeatable flag or an unset (``None``) default gets none.
    """

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("(default" in text or default is argparse.SUPPRESS or default is None
                or isinstance(default, (bool, list, tuple)) or not action.option_strings
                or getattr(action, "required", False)):
            return text
        return text + " (default: %(default)s)"


def problems(parser: argparse.ArgumentParser, *classes) -> list[str]:
    """What ``--help`` and the dataclasses disagree on (empty: nothing).

    Each flag of a ``classes`` field must default to the field's default and show
    it in its help, once; every listed flag must have help text and say its
    default at most once.
    """
    fields = {flag_of(f): (cls, f) for cls in classes for f in options_of(cls)}
    formatter = parser._get_formatter()
    found = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(
                action, argparse._HelpAction):
            continue
        flag = action.option_strings[-1]
        shown = formatter._expand_help(action) if action.help else ""
        if not shown.strip():
            found.append(f"{flag}: no help text")
        if shown.count("(default") > 1 or shown.count("default:") > 1:
            found.append(f"{flag}: its default is said more than once: {shown!r}")
        if flag not in fields:
            continue
        cls, f = fields[flag]
        kind = _kind(cls, f)[0]
        if kind == "repeat" or f.metadata[_META]["required"]:
            continue
        if action.default != f.default:
            found.append(f"{flag}: the parser's default {action.default!r} is not "
                         f"{cls.__name__}.{f.name}'s {f.default!r}")
        if (kind != "switch" and f.default is not None
                and f"(default: {format_default(f.default)})" not in shown):
            found.append(f"{flag}: --help does not show {cls.__name__}.{f.name}'s default "
                         f"{format_default(f.default)}: {shown!r}")
    for flag, (cls, f) in fields.items():
        if not f.metadata[_META]["hidden"] and not any(
                flag in a.option_strings for a in parser._actions):
            found.append(f"{flag}: {cls.__name__}.{f.name} has no flag")
    return found
