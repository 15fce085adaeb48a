"""Dialect translators: one module per wire format, to and from the one internal `Conversation`.

Each module declares its routes and renders its errors (the contract: gateway/serving.py); nothing
outside a dialect module knows its wire format. Here: the bounds and checks every dialect shares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, TypeVar

from pydantic import BaseModel, Field, ValidationError

from openforgerl.gateway.errors import GatewayError
from openforgerl.sampling import SEED_RANGE

# Bounds every dialect checks while it validates, before any work is done on a request: rendering
# and tokenising 327,680 tiny messages took 26 s; a real agent's longest sessions hold a few
# thousand messages and a few hundred tools.
MAX_MESSAGES = 16384
MAX_TOOLS = 2048
# A sampling seed: what the engines take (a 64-bit integer); beyond it a 400, not the engine's 500.
Seed = Annotated[int, Field(ge=SEED_RANGE[0], lt=SEED_RANGE[1])]

_M = TypeVar("_M", bound=BaseModel)


def validated(model: type[_M], body: bytes, invalid: Callable[[ValidationError], GatewayError]) -> _M:
    """The body as the dialect's request model; `invalid` words the 400 for a body that is not one."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise invalid(exc) from exc
