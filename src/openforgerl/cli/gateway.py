"""`openforge gateway`: serve the recording gateway. Its options are GatewayConfig's settings
(gateway/config.py: each declared there once, with its default and help)."""

from __future__ import annotations

from typing import Any

import click

from openforgerl.cli.options import upstream_options, upstream_specs
from openforgerl.config_options import config_options, given_settings
from openforgerl.gateway.config import GatewayConfig

_NOT_OPTIONS = ("upstreams",)  # --upstream, --upstream-key-env, --upstream-timeout
_MORE: dict[str, dict[str, Any]] = {
    "model": {"required": True},
    "admin_token": {"envvar": "OPENFORGE_ADMIN_TOKEN"},
}


@click.command()
@config_options(GatewayConfig, skip=_NOT_OPTIONS, more=_MORE)
@upstream_options
def gateway(
    upstreams: tuple[str, ...], upstream_key_envs: tuple[str, ...], upstream_timeout: float, **kw: Any
) -> None:
    """Serve the recording gateway: an OpenAI-compatible endpoint per rollout."""
    from openforgerl.gateway.server import serve

    specs = upstream_specs(upstreams, upstream_key_envs, upstream_timeout)
    serve(GatewayConfig(**given_settings(GatewayConfig, kw, skip=_NOT_OPTIONS), upstreams=specs))
