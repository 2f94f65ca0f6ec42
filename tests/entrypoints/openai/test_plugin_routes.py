"""Routes that plugins add to the server (``octavo_register_routes``).

In process: the server's app built with a plugin registered on the process's plugin manager
(served by a test client, no engine started): the routes answer, behind the API key, listed in
the OpenAPI schema; a route that would shadow the server's, a mount's or another plugin's, and a
registration that is not a router, each stop the build with an error naming it. End to end:
``octavo serve`` with the plugin installed through an entry point, its handler reaching the
engine of the API process.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import APIRouter
from fastapi.testclient import TestClient
from octavo.entrypoints.openai.api_server import ServerArgs, build_app
from octavo.hookspecs import hookimpl
from octavo.plugins import get_plugin_manager

from tests.entrypoints.openai.conftest import SERVED_NAME, ServerProcess
from tests.helpers import routes_plugin

REPO = Path(__file__).resolve().parents[3]


class _Routes:
    """A plugin registering the given routers."""

    def __init__(self, *routers: object) -> None:
        self.routers = routers

    @hookimpl
    def octavo_register_routes(self, register: Callable[[APIRouter], None]) -> None:
        for router in self.routers:
            register(router)


@pytest.fixture
def registered() -> Iterator[Callable[[object], None]]:
    """Register plugins on the process's plugin manager for one test, then take them off."""
    pm = get_plugin_manager()
    plugins: list[object] = []

    def register(plugin: object) -> None:
        pm.register(plugin)
        plugins.append(plugin)

    try:
        yield register
    finally:
        for plugin in plugins:
            pm.unregister(plugin)


def _router(method: str, path: str) -> APIRouter:
    router = APIRouter()
    router.add_api_route(path, lambda: {"ok": True}, methods=[method])
    return router


def test_a_plugins_routes_answer_behind_the_api_key(registered) -> None:
    registered(routes_plugin)
    client = TestClient(build_app(ServerArgs(api_key="k")))  # no lifespan: no engine started
    assert client.get("/v1/plugin/hello").status_code == 401
    resp = client.get("/v1/plugin/hello", headers={"Authorization": "Bearer k"})
    assert resp.status_code == 200 and resp.json() == {"hello": "from a plugin"}
    paths = client.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()["paths"]
    assert "/v1/plugin/hello" in paths and "/v1/plugin/engine" in paths
    assert "/v1/completions" in paths  # the server's own routes are all still there


def test_without_plugins_the_server_has_only_its_own_routes() -> None:
    paths = {route.path for route in build_app(ServerArgs()).routes}
    assert not any(path.startswith("/v1/plugin") for path in paths)


@pytest.mark.parametrize(("method", "path", "shadowed"), [
    ("GET", "/health", "a route the server has"),
    ("POST", "/v1/chat/completions", "a route the server has"),
    ("GET", "/docs/assets/logo.png", "the mount /docs/assets"),
])
def test_a_route_that_would_shadow_the_servers_stops_the_start(registered, method, path,
                                                                shadowed) -> None:
    registered(_Routes(_router(method, path)))
    with pytest.raises(ValueError, match=f"route {method} {path} would shadow {shadowed}"):
        build_app(ServerArgs())


def test_two_plugins_may_not_take_the_same_route(registered) -> None:
    registered(_Routes(_router("GET", "/v1/extra")))
    registered(_Routes(_router("GET", "/v1/extra")))
    with pytest.raises(ValueError, match="route GET /v1/extra would shadow"):
        build_app(ServerArgs())


def test_the_same_path_with_another_method_is_a_new_route(registered) -> None:
    registered(_Routes(_router("DELETE", "/v1/models")))
    client = TestClient(build_app(ServerArgs()))
    assert client.delete("/v1/models").json() == {"ok": True}


def test_registering_something_else_than_a_router_is_a_type_error(registered) -> None:
    registered(_Routes(lambda: None))
    with pytest.raises(TypeError, match="takes a fastapi.APIRouter"):
        build_app(ServerArgs())


@pytest.fixture(scope="module")
def plugin_server(tiny_model: Path, tmp_path_factory) -> Iterator[ServerProcess]:
    folder = routes_plugin.write_entry_point(tmp_path_factory.mktemp("routes-plugin"))
    path = os.pathsep.join([str(folder), str(REPO), os.environ.get("PYTHONPATH", "")])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", path)
        srv = ServerProcess(tiny_model)
    try:
        yield srv
    finally:
        assert srv.stop(signal.SIGTERM) == 0


def test_an_installed_plugins_route_reaches_the_engine(plugin_server: ServerProcess,
                                                       tiny_model: Path) -> None:
    with httpx.Client(base_url=plugin_server.url, timeout=60) as http:
        assert http.get("/v1/plugin/engine").status_code == 401
        resp = http.get("/v1/plugin/engine", headers=plugin_server.headers())
        assert resp.status_code == 200, resp.text
        assert resp.json() == {"model": str(tiny_model), "max_model_len": 512,
                               "unfinished_requests": 0}
        completion = http.post("/v1/completions", headers=plugin_server.headers(), json={
            "model": SERVED_NAME, "prompt": "Hello", "max_tokens": 3})
        assert completion.status_code == 200, completion.text
    assert "routes from plugins: GET /v1/plugin/hello, GET /v1/plugin/engine" in (
        plugin_server.read_log())
