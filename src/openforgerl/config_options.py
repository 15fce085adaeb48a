"""A config's command-line options, derived from its fields (openforgerl/settings.py): one option
per setting, with the field's help and default, typed from its annotation. A recipe applies only
the options the command line gives: over the config's defaults for a fresh run, over run.json's
settings for a resumed one."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import MISSING
from pathlib import Path
from typing import Any

import click

from openforgerl.settings import Setting, put, settings_of


class NoneOr(click.ParamType):
    """A value of `inner`, or `none` (a setting that may be None: --max-context none)."""

    def __init__(self, inner: click.ParamType) -> None:
        self.inner = inner
        self.name = f"{inner.name}|none"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value.strip().lower() == "none":
            return None
        return self.inner.convert(value, param, ctx)


def _type(s: Setting) -> click.ParamType:
    base = s.kind.split("|")[0].strip()
    low, high, low_open = s.meta("range", (None, None, False))
    kind: click.ParamType
    if s.meta("choices"):
        kind = click.Choice([*s.meta("choices"), *(["none"] if s.optional else [])])
        return kind  # "none" is a choice of its own
    if s.meta("path"):
        kind = click.Path(exists=True)
    elif base == "int":
        kind = click.IntRange(min=low, max=high) if low is not None or high is not None else click.INT
    elif base == "float":
        kind = (
            click.FloatRange(min=low, max=high, min_open=low_open)
            if (low, high) != (None, None)
            else click.FLOAT
        )
    else:
        kind = click.STRING
    return NoneOr(kind) if s.optional else kind


def _help(s: Setting, more: str = "") -> str:
    default, said = s.meta("shown_default") or s.default, s.meta("help", "")
    shown = (
        ""
        if default is None or default is MISSING or default == ""
        else f"  [default: {'/'.join(map(str, default)) if isinstance(default, tuple) else default}]"
    )
    return f"{said}{more}{shown}".strip()


def option_of(s: Setting, **more: Any) -> Callable[[Any], Any]:
    """The click option of setting `s`; `more`: click's keywords the command adds (a callback),
    `help_more` text after the field's help."""
    extra = dict(more)
    help_text = _help(s, extra.pop("help_more", ""))
    if not extra.get("required"):  # click takes an explicit default of None as given
        extra["default"] = None
    if s.kind.startswith("bool"):
        flag = s.meta("option") or f"{s.option}/--no-{s.option.removeprefix('--')}"
        return click.option(flag, s.param, help=help_text, **extra)
    if s.kind.startswith("tuple"):
        return click.option(s.option, s.param, type=float, nargs=2, help=help_text, **extra)
    return click.option(s.option, s.param, type=_type(s), help=help_text, **extra)


def config_options(
    cls: type, skip: Collection[str] = (), more: Mapping[str, Mapping[str, Any]] | None = None
) -> Callable[[Any], Any]:
    """Decorate a command with one option per setting of config `cls` (less `skip`); `more[key]`
    adds click keywords to that setting's option. Two settings with one option name are refused."""
    found = list(settings_of(cls, skip))
    names = [s.option.split("/")[0] for s in found]
    twice = {n for n in names if names.count(n) > 1}
    if twice:
        raise TypeError(f"{cls.__name__}: settings share the options {sorted(twice)}")

    def decorate(fn: Any) -> Any:
        for s in reversed(found):
            fn = option_of(s, **(more or {}).get(s.key, {}))(fn)
        return fn

    return decorate


def given_settings(cls: type, kw: dict[str, Any], skip: Collection[str] = ()) -> dict[str, Any]:
    """The settings the command line gave, by dotted path, as saved (all popped from `kw`): a pair
    as a list, `none` as None, a path made absolute."""
    ctx = click.get_current_context()
    given: dict[str, Any] = {}
    for s in settings_of(cls, skip):
        value = kw.pop(s.param)
        if ctx.get_parameter_source(s.param) in (None, click.core.ParameterSource.DEFAULT):
            continue
        if value == "none" and s.meta("choices") and s.optional:
            value = None
        elif isinstance(value, tuple):
            value = list(value)
        elif s.meta("path"):
            value = str(Path(value).resolve())
        given[s.key] = value
    return given


def apply_settings(d: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """Put the given settings into the saved settings `d` (run.json's mapping); returns `d`."""
    for key, value in given.items():
        put(d, key, value)
    return d
