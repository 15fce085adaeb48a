"""JSON that never fails on valid data and never recurses without bound on data from outside.

orjson is fast but refuses integers beyond 64 bits, which a client may send (a tool schema's
`maximum`) or a model may write (tool-call arguments): those rare objects fall back to the
standard library instead of crashing a request.

Every structure that arrives from outside (a request body, an admin call, tool-call arguments a
client or a model wrote) is read with `loads` or checked with `check_depth`: nesting deeper than
MAX_DEPTH is refused as a ValueError, so the recursive walks after it (the standard library's
encoder, chat templates, pydantic) stay far from Python's recursion limit.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

MAX_DEPTH = 128  # deeper than any tool schema or argument an agent writes; far below recursion limits


class TooDeep(ValueError):
    """A JSON value nested deeper than the gateway reads."""


def dumps(obj: Any, *, sort_keys: bool = False) -> bytes:
    try:
        return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS if sort_keys else 0)
    except TypeError:
        return json.dumps(obj, sort_keys=sort_keys, ensure_ascii=False, separators=(",", ":")).encode()


def loads(data: bytes | str, max_depth: int = MAX_DEPTH) -> Any:
    """orjson.loads, refusing nesting deeper than `max_depth` (TooDeep; a JSONDecodeError for
    invalid JSON, both ValueErrors)."""
    value = orjson.loads(data)
    # Nesting needs an opening bracket per level: most bodies have too few to be deep, and counting
    # them (in C) is much cheaper than walking the value.
    raw = data.encode() if isinstance(data, str) else data
    if raw.count(b"[") + raw.count(b"{") > max_depth:
        check_depth(value, max_depth)
    return value


def check_depth(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """Raise TooDeep if lists and objects in `value` nest deeper than `max_depth` (no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > max_depth:
            raise TooDeep(f"the JSON value is nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
