"""Dialect translators: one module per wire format, to and from the one internal `Conversation`.

A dialect contributes its routes and renders errors in its own shape; nothing outside a dialect
module knows its wire format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Protocol

from pydantic import Field
from starlette.responses import Response
from starlette.routing import BaseRoute

from openforgerl.gateway.errors import GatewayError
from openforgerl.sampling import SEED_RANGE

# Bounds every dialect checks while it validates, before any work is done on a request: rendering
# and tokenising 327,680 tiny messages took 26 s; a real agent's longest sessions hold a few
# thousand messages and a few hundred tools.
MAX_MESSAGES = 16384
MAX_TOOLS = 2048
# A sampling seed: what the engines take (a 64-bit integer); beyond it a 400, not the engine's 500.
Seed = Annotated[int, Field(ge=SEED_RANGE[0], lt=SEED_RANGE[1])]

if TYPE_CHECKING:
    from openforgerl.gateway.app import Gateway


class Dialect(Protocol):
    name: str

    def routes(self, gateway: Gateway, prefix: str) -> list[BaseRoute]:
        """The dialect's routes under `prefix` ('' or '/r/{rollout_id}')."""
        ...

    def owns_path(self, path: str) -> bool:
        """Whether errors on this path (e.g. an unknown sub-route) belong to this dialect."""
        ...

    def error_response(self, err: GatewayError) -> Response:
        """The error in this dialect's own shape, with its status and retry headers."""
        ...


def default_dialects() -> list[Dialect]:
    from openforgerl.gateway.dialects.anthropic import AnthropicMessages
    from openforgerl.gateway.dialects.gemini import Gemini
    from openforgerl.gateway.dialects.openai_chat import OpenAIChat
    from openforgerl.gateway.dialects.responses import OpenAIResponses

    return [OpenAIChat(), OpenAIResponses(), Gemini(), AnthropicMessages()]
