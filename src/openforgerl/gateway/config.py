"""The gateway's settings (GatewayConfig, UpstreamSpec): a light module, so the CLI reads their
defaults without the server's imports (gateway/server.py and gateway/upstream.py re-export them)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlparse

from openforgerl.engines.base import PREFIX_CACHE_MB, engine_setting
from openforgerl.settings import setting

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
    """The gateway's settings, each its own option of `openforge gateway` (but `upstreams`, made from
    --upstream...)."""

    model: str = setting(help="HF model directory (tokenizer and chat template).")
    engine: str = engine_setting()
    host: str = setting("127.0.0.1", "The address to listen on.")
    port: int = setting(8000, "The port to listen on.", low=0, high=65535)
    store: str = setting("openforge.db", "SQLite file of the records.")
    admin_token: str = setting("", "Token for /admin (random if unset; or OPENFORGE_ADMIN_TOKEN).")
    public_url: str = setting("", "Base URL harnesses reach the gateway at (default http://HOST:PORT).")
    temperature: float | None = setting(1.0, "Overrides the harness's (none: the harness's own).", low=0)
    top_p: float | None = setting(1.0, "Overrides the harness's (none: the harness's own).", low=0, high=1)
    max_tokens: int = setting(1024, "Cap and default per call.", low=1)
    max_context: int | None = setting(
        None, "Prompt + completion limit (none: the model's context length).", low=1
    )
    max_inflight: int = setting(1024, "Calls in flight; beyond this: 429.", low=1)
    max_body: int = setting(32 << 20, "A request body's largest size in bytes; beyond it: 413.", low=1)
    # From the connection's opening, or the request's first byte on a reused one; the body from when
    # the gateway starts reading it (32 MB in 60 s is 0.5 MB/s).
    header_timeout_s: float | None = setting(
        30.0,
        "Seconds a request's headers may take to arrive (slow clients: slowloris).",
        low=0,
        low_open=True,
    )
    body_timeout_s: float | None = setting(
        60.0, "Seconds a request's body may take to arrive.", low=0, low_open=True
    )
    # Every rollout's harness reaches a local gateway from 127.0.0.1 (directly or through its
    # sandbox's relay), so this must hold a whole run: each of max_inflight calls in flight plus about
    # as many idle keep-alive connections between calls. It bounds a flood well below the usual
    # open-file limits; raise it with max_inflight.
    max_connections_per_peer: int | None = setting(
        2048, "Open connections one client address may hold (all local rollouts share 127.0.0.1).", low=1
    )
    durability: str = setting(
        "full",
        "SQLite's synchronous mode for the records (full: fsync each commit).",
        choices=("full", "normal"),
    )
    # gateway/workers.py
    work_threads: int = setting(
        2,
        "Threads that parse, render and tokenise requests off the event loop (0: on it, for comparison).",
        low=0,
    )
    # External models a rollout can be answered by instead of the policy (`"upstream": NAME`).
    upstreams: list[UpstreamSpec] = field(default_factory=list)
    engine_threads: int | None = setting(
        None, "The builtin engine's CPU threads (none: torch's default).", low=1
    )
    prefix_cache_mb: float = setting(
        PREFIX_CACHE_MB,
        "The builtin engine's prefix cache (KV of earlier turns and shared system prompts); 0: off.",
        low=0,
    )
