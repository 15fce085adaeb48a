"""Settings declared once. A recipe's config is a dataclass; each field carries its default and what
its command-line option says (`setting`), so the options (config_options.py), their defaults,
the run's saved settings (run.json: `dataclasses.asdict`) and `--set PATH=VALUE` all derive from
that one declaration. A field whose default is a nested config (TrainOptions.trainer) is walked
into: its settings are named by dotted paths (`trainer.loss.clip_ratio_low`), as in run.json.

A leaf module (no imports of the package): the configs that use it stay light for the CLI.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Iterator
from dataclasses import MISSING, Field, dataclass
from typing import Any


def setting(
    default: Any = MISSING,
    help: str = "",
    *,
    factory: Any = MISSING,
    option: str | None = None,
    choices: tuple[str, ...] = (),
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    path: bool = False,
    shown_default: str | None = None,
) -> Any:
    """A config field with its option: `help`; `option` where its name is not the field's
    (`--algo` for `estimator`; a bool's "--on/--off"); `choices` for a string; `low`/`high` bounds
    for a number (`low_open`: above low); `path`: a file that must exist, saved absolute;
    `shown_default`: the default the option's help shows where the command computes its own."""
    meta = {
        "help": help,
        "option": option,
        "choices": choices,
        "range": (low, high, low_open),
        "path": path,
        "shown_default": shown_default,
    }
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True)
class Setting:
    """One setting of a config: its dotted path in the saved settings and its field."""

    key: str
    field: Field[Any]

    @property
    def kind(self) -> str:
        """The field's annotation as written (`int | None`, `tuple[float, float]`)."""
        return str(self.field.type)

    @property
    def optional(self) -> bool:
        return "None" in self.kind

    @property
    def default(self) -> Any:
        f = self.field
        if f.default is not MISSING:
            return f.default
        return f.default_factory() if f.default_factory is not MISSING else MISSING

    def meta(self, name: str, default: Any = None) -> Any:
        return self.field.metadata.get(name, default)

    @property
    def option(self) -> str:
        """Its command-line option: `--field-name` unless the field names another."""
        return self.meta("option") or "--" + self.field.name.replace("_", "-")

    @property
    def param(self) -> str:
        """The option's value's name in the command's keywords (the dotted path's dots as '__')."""
        return self.key.replace(".", "__")


def nested(f: Field[Any]) -> type | None:
    """The config a field holds, when its default is one (walked into), else None."""
    made = f.default_factory
    return made if isinstance(made, type) and dataclasses.is_dataclass(made) else None


def settings_of(cls: type, skip: Collection[str] = (), prefix: str = "") -> Iterator[Setting]:
    """Every setting of config `cls` (nested configs walked into), in declaration order, less the
    dotted paths in `skip` (and what lies under them)."""
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        if key in skip:
            continue
        inner = nested(f)
        if inner is not None:
            yield from settings_of(inner, skip, key + ".")
        else:
            yield Setting(key, f)


def read(kind: str, text: str, key: str) -> Any:
    """`text` as a value of a field annotated `kind`: a number, true/false, none where the field
    may be None, a JSON list for a tuple; a string as it is."""
    low = text.strip().lower()
    if "None" in kind and low in ("none", "null"):
        return None
    try:
        if kind.startswith("bool"):
            if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError("true or false")
            return low in ("true", "1", "yes", "on")
        if kind.startswith("tuple"):
            items = json.loads(text)
            if not isinstance(items, list) or not all(isinstance(x, int | float) for x in items):
                raise ValueError("a JSON list of numbers")
            return [float(x) for x in items]
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
    except ValueError as exc:
        raise ValueError(f"{key}={text}: not {kind} ({exc})") from exc
    return text


def put(d: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted `key` of the saved settings `d` (nested mappings made where missing)."""
    *path, name = key.split(".")
    for part in path:
        d = d.setdefault(part, {})
    d[name] = value
