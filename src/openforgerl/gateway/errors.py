"""Errors the gateway answers with. Each dialect renders them in its own wire format."""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from typing import Literal

from openforgerl.images import Image, ImageError

ErrorKind = Literal[
    "invalid_request",
    "authentication",
    "permission",
    "not_found",
    "too_large",
    "context_length",
    "rate_limit",
    "unavailable",
    "internal",
]

# How a call's record begins its error when the engine was unavailable (not the agent's doing: the
# runner retries such a rollout as infrastructure).
ENGINE_UNAVAILABLE = "engine unavailable"


class GatewayError(Exception):
    """An error answered to the caller with `status`, in the caller's dialect."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: ErrorKind = "invalid_request",
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
        details: dict[str, int] | None = None,
    ) -> None:
        super().__init__(message)
        # Numbers a dialect may word its own way (e.g. prompt_tokens and max_context).
        self.details = details or {}
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"retry-after": str(max(1, round(self.retry_after)))}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> GatewayError:
    return GatewayError(400, message, kind="invalid_request", param=param, code=code)


def invalid_image(exc: ImageError, param: str) -> GatewayError:
    """An image the gateway refuses, named by where it is in the request (the caller's own path)."""
    return GatewayError(400, f"Invalid image at '{param}': {exc}", param=param, code="invalid_image")


# Set while a request is parsed for a rollout whose model reads no images: its first image part is
# refused before it is decoded (eight 8000x8000 PNGs took 14 s to decode, only to be refused after).
images_refused: ContextVar[GatewayError | None] = ContextVar("images_refused", default=None)


def load_image(load: Callable[[], Image], param: str) -> Image:
    """`load()` (a decode of one image part), its ImageError answered as a 400 naming `param`; the
    `images_refused` error, naming `param`, without decoding anything when that is set."""
    refused = images_refused.get()
    if refused is not None:
        raise GatewayError(refused.status, refused.message, kind=refused.kind, code=refused.code, param=param)
    try:
        return load()
    except ImageError as exc:
        raise invalid_image(exc, param) from None


def unauthorized(message: str = "Incorrect or missing API key for this gateway.") -> GatewayError:
    return GatewayError(401, message, kind="authentication", code="invalid_api_key")


def context_length_exceeded(prompt_tokens: int, max_context: int) -> GatewayError:
    # OpenAI's wording: harnesses match on it to trigger their context compaction.
    return GatewayError(
        400,
        f"This model's maximum context length is {max_context} tokens. However, your messages resulted "
        f"in {prompt_tokens} tokens. Please reduce the length of the messages.",
        kind="context_length",
        code="context_length_exceeded",
        param="messages",
        details={"prompt_tokens": prompt_tokens, "max_context": max_context},
    )
