"""JSON encoding that never fails on valid JSON data.

orjson is fast but refuses integers beyond 64 bits, which a client may send (a tool schema's
`maximum`) or a model may write (tool-call arguments): those rare objects fall back to the
standard library instead of crashing a request.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(obj: Any, *, sort_keys: bool = False) -> bytes:
    try:
        return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS if sort_keys else 0)
    except TypeError:
        return json.dumps(obj, sort_keys=sort_keys, ensure_ascii=False, separators=(",", ":")).encode()
