"""The gateway's app (Starlette): its state (state.py) and the routes (routes.py) behind the checks every request
goes through (middleware.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from .middleware import http_error
from .routes import build_routes
from .settings import GatewayConfig
from .state import Gateway


def build_app(config: GatewayConfig) -> Starlette:
    gateway = Gateway(config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await gateway.close()

    middleware = []
    if config.cors_origins:
        # Preflights are answered before a route's checks (a browser sends no key with them); every answer to an
        # allowed origin carries the headers, its errors too.
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_origins),
                allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                allow_headers=["*"],
                max_age=600,
            )
        )
    app = Starlette(
        routes=build_routes(gateway),
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
        middleware=middleware,
    )
    app.state.gateway = gateway
    return app
