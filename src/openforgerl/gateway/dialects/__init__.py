"""Dialect translators: one module per wire format, to and from the one internal `Conversation`.

A dialect contributes its routes and renders errors in its own shape; nothing outside a dialect
module knows its wire format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from starlette.responses import Response
from starlette.routing import BaseRoute

from openforgerl.gateway.errors import GatewayError

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
