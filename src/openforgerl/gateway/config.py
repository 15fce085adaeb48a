"""The gateway's settings (GatewayConfig, UpstreamSpec): a light module, so the CLI reads their
defaults without the server's imports (gateway/server.py and gateway/upstream.py re-export them)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlparse

from openforgerl.engines.base import PREFIX_CACHE_MB

UpstreamKind = Literal["openai", "anthropic"]
KINDS: tuple[UpstreamKind, ...] = ("openai", "anthropic")
DEFAULT_URLS: dict[UpstreamKind, str] = {
    "openai": "https://api.openai.com/v1",
    "anthropic": "https://api.anthropic.com",
}
DEFAULT_KEY_ENVS: dict[UpstreamKind, str] = {"openai": "OPENAI_API_KEY", "anthropic": "ANTHROPIC_API_KEY"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True, slots=True)
class UpstreamSpec:
    """One upstream: a name rollouts refer to, the API kind, the model, where, and the key's variable."""

    name: str
    kind: UpstreamKind
    model: str
    base_url: str = ""  # '' = the kind's public API
    key_env: str = ""  # '' = OPENAI_API_KEY / ANTHROPIC_API_KEY
    timeout: float = 600.0  # seconds for one call (the upstream is asked without streaming)
    max_tokens: int = 4096  # sent to Anthropic when the harness set no max_tokens (it is required)

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"upstream name {self.name!r}: use letters, digits, '_', '-' and '.'")
        if self.kind not in KINDS:
            raise ValueError(f"upstream {self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not self.model:
            raise ValueError(f"upstream {self.name}: a model name is required")
        if self.base_url and urlparse(self.base_url).scheme not in ("http", "https"):
            raise ValueError(f"upstream {self.name}: base URL {self.base_url!r} is not http(s)")
        if self.timeout <= 0:
            raise ValueError(f"upstream {self.name}: timeout must be positive")

    @property
    def url(self) -> str:
        return (self.base_url or DEFAULT_URLS[self.kind]).rstrip("/")

    @property
    def env(self) -> str:
        return self.key_env or DEFAULT_KEY_ENVS[self.kind]

    def describe(self) -> str:
        return f"{self.name}: {self.kind} model {self.model} at {self.url}, key from ${self.env}"


@dataclass
class GatewayConfig:
    model: str
    engine: str = "builtin"
    host: str = "127.0.0.1"
    port: int = 8000
    store: str = "openforge.db"
    admin_token: str = ""
    public_url: str = ""
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    max_tokens: int = 1024
    max_context: int | None = None  # prompt + completion; None: the model's own context length
    max_inflight: int = 1024
    max_body: int = 32 << 20
    # Slow or stalled clients (slowloris): a request's headers must arrive within header_timeout_s
    # (from the connection's opening, or the request's first byte on a reused one) and its body
    # within body_timeout_s (from when the gateway starts reading it; 32 MB in 60 s is 0.5 MB/s).
    header_timeout_s: float | None = 30.0
    body_timeout_s: float | None = 60.0
    # Open connections one peer address may hold. Every rollout's harness reaches a local gateway
    # from 127.0.0.1 (directly or through its sandbox's relay), so this must hold a whole run: each
    # of max_inflight calls in flight plus about as many idle keep-alive connections between calls.
    # It bounds a flood well below the usual open-file limits; raise it with max_inflight.
    max_connections_per_peer: int | None = 2048
    durability: str = "full"
    # Threads that parse, render and tokenise calls off the event loop (gateway/workers.py).
    work_threads: int = 2
    # External models a rollout can be answered by instead of the policy (`"upstream": NAME`).
    upstreams: list[UpstreamSpec] = field(default_factory=list)
    engine_threads: int | None = None  # the built-in engine's CPU threads (None: torch's default)
    prefix_cache_mb: float = PREFIX_CACHE_MB  # the built-in engine's prefix cache (0: off)
