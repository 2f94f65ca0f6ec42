"""HTTP routes that plugins add to the OpenAI server (``octavo_register_routes``).

A plugin registers a FastAPI ``APIRouter``; the server includes it after its own routes, so
the routes answer beside ``/v1/...`` on the same port, behind the same middleware (the API
key, CORS, the body size limit). A route may not take a method and path the server already
answers (a plugin adds routes; it does not replace Octavo's), nor a path under one of its
mounts: that is an error at start-up, naming the route. Handlers reach the engine as
``request.app.state.engine`` (the ``AsyncLLM`` of that API process).
"""

from __future__ import annotations

import logging

import pluggy
from fastapi import APIRouter, FastAPI
from starlette.routing import BaseRoute, Mount, Route, WebSocketRoute

logger = logging.getLogger(__name__)


def plugin_routers(pm: pluggy.PluginManager | None = None) -> list[APIRouter]:
    """The routers registered through ``octavo_register_routes``, in registration order;
    anything that is not an ``APIRouter`` is a ``TypeError``."""
    from octavo.plugins import get_plugin_manager

    pm = get_plugin_manager() if pm is None else pm
    routers: list[APIRouter] = []

    def register(router: APIRouter) -> None:
        if not isinstance(router, APIRouter):
            raise TypeError(f"octavo_register_routes: register() takes a fastapi.APIRouter, "
                            f"got {router!r}")
        routers.append(router)

    pm.hook.octavo_register_routes(register=register)
    return routers


def add_plugin_routes(app: FastAPI, pm: pluggy.PluginManager | None = None) -> list[str]:
    """Include every plugin router in ``app`` (after the server's own routes); the routes
    added, as ``"METHOD /path"``. ``ValueError`` when one would shadow a route the app already
    has, or another plugin's."""
    added: list[str] = []
    taken = {key for route in app.router.routes for key in _keys(route)}
    mounts = [route.path for route in app.router.routes if isinstance(route, Mount)]
    for router in plugin_routers(pm):
        for route in router.routes:
            for key in _keys(route):
                method, path = key
                under = next((m for m in mounts if path == m or path.startswith(m + "/")), None)
                if key in taken or under is not None:
                    raise ValueError(
                        f"a plugin's route {method} {path} would shadow "
                        f"{'the mount ' + under if under else 'a route the server has'}; "
                        f"give it another path (octavo_register_routes)")
                taken.add(key)
                added.append(f"{method} {path}")
        app.include_router(router)
    if added:
        logger.info("routes from plugins: %s", ", ".join(added))
    return added


def _keys(route: BaseRoute) -> list[tuple[str, str]]:
    """(method, path) pairs a route answers; a websocket route as ``("WEBSOCKET", path)``."""
    if isinstance(route, Route):  # APIRoute included
        return [(method, route.path) for method in sorted(route.methods or ())]
    if isinstance(route, WebSocketRoute):
        return [("WEBSOCKET", route.path)]
    if isinstance(route, Mount):
        return [("MOUNT", route.path)]
    return []
