"""The viewer's Starlette app: a read-only JSON API under /api and the static front end."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from openforgerl.ui.api import STATIC, Api
from openforgerl.ui.guard import Guard, is_loopback
from openforgerl.ui.viewer import ApiError, Viewer, ViewerConfig


def build_app(cfg: ViewerConfig) -> Starlette:
    viewer = Viewer(cfg)
    api = Api(viewer)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        viewer.close()

    app = Starlette(
        routes=[
            Route("/", api.index),
            Route("/api/info", api.info),
            Route("/api/runs", api.runs),
            Route("/api/run", api.run),
            Route("/api/compare", api.compare),
            Route("/api/metrics", api.metrics),
            Route("/api/rollouts", api.rollouts),
            Route("/api/rollout", api.rollout),
            Route("/api/tokens", api.tokens),
            Route("/api/images/{digest}", api.image),
            Route("/api/{rest:path}", api.api_404),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        middleware=[Middleware(Guard, token=cfg.token)],
        exception_handlers={ApiError: api.on_api_error, HTTPException: api.on_http_error},
        lifespan=lifespan,
    )
    app.state.viewer = viewer
    return app


def serve(app: Starlette, host: str, port: int) -> None:
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


__all__ = ["ApiError", "ViewerConfig", "build_app", "is_loopback", "serve"]
