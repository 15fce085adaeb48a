"""The dialect's routes: `POST /v1/messages`, its token count, and the probes Claude Code sends."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request

from openforgerl.gateway import serving
from openforgerl.gateway.dialects.anthropic.answers import MessagesExchange
from openforgerl.gateway.dialects.anthropic.parsing import parse_request
from openforgerl.gateway.dialects.anthropic.protocol import NAME, error_body
from openforgerl.images import Image


class AnthropicMessages(serving.JSONErrors):
    """`POST /v1/messages`, `POST /v1/messages/count_tokens`, and the probes Claude Code sends."""

    name = NAME
    owned = re.compile(r"^(/r/[^/]+)?(/v1/messages(/.*)?|/api/hello)$")
    error_body = staticmethod(error_body)

    def routes(self, host: serving.Host) -> list[serving.RouteSpec]:
        def parse(body: bytes, files: Mapping[str, Image], _: serving.Incoming) -> MessagesExchange:
            return MessagesExchange(*parse_request(body, files))

        async def probe(request: Request) -> dict[str, Any]:
            # Claude Code checks that the endpoint is up (HEAD /api/hello, the base URL) before it starts.
            return {"status": "ok"}

        return [
            serving.CallRoute("/v1/messages", parse),
            serving.CountRoute(
                "/v1/messages/count_tokens",
                lambda body, files, _: parse_request(body, files)[0],
                lambda tokens: {"input_tokens": tokens},
            ),
            serving.InfoRoute("/api/hello", probe, ("GET", "HEAD")),
            serving.InfoRoute("", probe, ("GET", "HEAD")),
        ]
