"""A plugin that adds HTTP routes to ``octavo serve`` (``octavo_register_routes``), for the
server tests: ``GET /v1/plugin/hello`` (static) and ``GET /v1/plugin/engine`` (what the
process's engine says: its model and health, through ``request.app.state.engine``).
``write_entry_point(folder)`` installs it for subprocesses with ``folder`` on ``PYTHONPATH``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, Request
from octavo.hookspecs import hookimpl

from tests.helpers.entry_points import write_dist_info

router = APIRouter(prefix="/v1/plugin", tags=["plugin"])


@router.get("/hello")
async def hello() -> dict[str, str]:
    return {"hello": "from a plugin"}


@router.get("/engine")
async def engine_state(request: Request) -> dict[str, object]:
    engine = request.app.state.engine
    await engine.check_health()
    return {"model": str(engine.model_config.model),
            "max_model_len": engine.model_config.max_model_len,
            "unfinished_requests": engine.num_unfinished_requests}


@hookimpl
def octavo_register_routes(register: Callable[[APIRouter], None]) -> None:
    register(router)


def write_entry_point(folder: Path) -> Path:
    """Make this module an installed ``octavo`` plugin for processes with ``folder`` (and the
    repository root) on ``PYTHONPATH``; returns ``folder``."""
    return write_dist_info(folder, "octavo-test-routes", {"test-routes": __name__})
