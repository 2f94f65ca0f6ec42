"""The OpenAI-compatible HTTP server: FastAPI app, routes, lifespan, uvicorn run loop.

``build_app(ServerArgs)`` makes the app; its lifespan starts an ``AsyncLLM`` (engine core in
a background process) and stops it. ``run_server`` runs it under uvicorn with the shutdown
rules of ``octavo serve``:

- SIGTERM/SIGINT: stop accepting, let requests in flight finish (up to ``shutdown_timeout``
  seconds, then cancel them), stop the engine core, exit 0.
- The engine core dies: requests in flight get 503 errors, ``/health`` answers 503, the
  server shuts down and ``run_server`` returns 1.

With ``--api-server-count N`` (N > 1) ``multi_api_server`` runs this same server in N
processes on one listening socket, each one's ``AsyncLLM`` attached to one shared engine core
(``attach``); such a process also exits (1) when its supervisor is gone.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from octavo.engine.arg_utils import EngineArgs
from octavo.engine.async_llm import AsyncLLM
from octavo.engine.core_client import CoreAddresses, EngineShuttingDownError
from octavo.engine.processor import check_text
from octavo.engine_core.gc_heap import freeze_startup_objects
from octavo.entrypoints.openai.errors import OpenAIError, install_error_handlers
from octavo.entrypoints.openai.metrics import PrometheusStatLogger
from octavo.entrypoints.openai.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware
from octavo.entrypoints.openai.plugin_routes import add_plugin_routes
from octavo.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from octavo.entrypoints.openai.serving_chat import OpenAIServingChat
from octavo.entrypoints.openai.serving_completion import OpenAIServingCompletion
from octavo.entrypoints.openai.serving_engine import invalid_request
from octavo.entrypoints.openai.serving_models import LoRAModulePath, ServingModels
from octavo.entrypoints.openai.tool_calling import check_tools
from octavo.errors import InvalidRequestError
from octavo.version import __version__

logger = logging.getLogger(__name__)

# Paths that answer without an API key.
OPEN_PATHS = ("/health", "/metrics")
# After the engine dies, the server keeps answering (503s, /health included) this long before
# it exits, so that the error responses go out and health checkers can see the state.
DEAD_ENGINE_EXIT_DELAY_S = 1.0


@dataclass(slots=True)
class ServerArgs:
    """Options of ``octavo serve`` besides the engine's."""

    # The engine (same options as ``octavo.LLM``).
    engine_args: EngineArgs = field(default_factory=EngineArgs)
    # Address to listen on (127.0.0.1: this machine only).
    host: str = "127.0.0.1"
    # TCP port (0: any free one; the startup log says which).
    port: int = 8000
    # Names clients may use in "model"; the first is the one responses carry. Empty: the model path.
    served_model_names: list[str] = field(default_factory=list)
    # Required as "Authorization: Bearer <key>" on every path but /health and /metrics.
    api_key: str | None = None
    # Chat template file or jinja text (default: the tokenizer's).
    chat_template: str | None = None
    # CORS origins allowed to call the API from a browser (empty: CORS off).
    allowed_origins: list[str] = field(default_factory=list)
    # Largest request body in bytes (413 above).
    max_request_body_bytes: int = 16 * 2**20
    # Most requests waiting to run before new ones get 503 (None: no limit).
    max_waiting_requests: int | None = None
    # Seconds requests in flight may take to finish after SIGTERM/SIGINT.
    shutdown_timeout: float = 30.0
    # Log one line per HTTP request (uvicorn's access log).
    access_log: bool = False
    # Also export every metric as vllm:<name>, for dashboards built for vLLM.
    vllm_metric_names: bool = False
    # Parse the tool calls the model writes when a request's tool_choice is "auto" (needs
    # tool_call_parser).
    enable_auto_tool_choice: bool = False
    # Name of the tool-call parser (octavo.entrypoints.openai.tool_parsers), e.g. "hermes".
    tool_call_parser: str | None = None
    # LoRA adapters served by name (--lora-modules; needs --enable-lora).
    lora_modules: list[LoRAModulePath] = field(default_factory=list)
    # Add POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    # (OCTAVO_ALLOW_RUNTIME_LORA_UPDATING=1).
    allow_runtime_lora_updating: bool = False
    # API server processes sharing the socket and one engine core (vLLM's --api-server-count).
    api_server_count: int = 1


def build_app(args: ServerArgs, attach: CoreAddresses | None = None) -> FastAPI:
    """The FastAPI app; the engine starts with the app's lifespan.

    :param attach: the engine core to use, started by the ``--api-server-count`` supervisor
        (None: the lifespan spawns one).
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = await AsyncLLM.from_engine_args(args.engine_args, attach=attach)
        watcher = None
        try:
            _attach_engine(app, engine, args, attach)
            on_supervisor_gone = getattr(app.state, "on_supervisor_gone", None)
            if on_supervisor_gone is not None:
                watcher = asyncio.create_task(_watch_supervisor(app.state.supervisor_pid,
                                                                on_supervisor_gone))
            # What start-up made (modules, the tokenizer, the app: ~400k objects) lives as long
            # as the server: out of the collector's sight, so that a full collection, which
            # would stop every stream for 0.1-0.2 s, only scans what requests allocate; and
            # the collector's thresholds raised (octavo.engine_core.gc_heap).
            freeze_startup_objects()
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
            await engine.shutdown()

    app = FastAPI(
        title="Octavo",
        version=__version__,
        description="OpenAI-compatible API of the Octavo inference engine.",
        lifespan=lifespan,
        responses={400: {"model": ErrorResponse}},
        docs_url=None,  # served by _add_docs, from local files
        redoc_url=None,
    )
    install_error_handlers(app)
    _add_routes(app)
    if args.allow_runtime_lora_updating:
        _add_lora_routes(app)
    _add_docs(app)
    add_plugin_routes(app)  # after every route of the server's: a plugin may not shadow one
    # Added last = outermost: CORS, then the API key, then the body limit.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=args.max_request_body_bytes)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, open_paths=OPEN_PATHS)
    if args.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                           allow_methods=["*"], allow_headers=["*"])
    return app


async def _watch_supervisor(supervisor_pid: int, on_gone: Any) -> None:
    """Call ``on_gone()`` once the ``--api-server-count`` supervisor is no longer our parent."""
    from octavo.entrypoints.openai.multi_api_server import SUPERVISOR_CHECK_INTERVAL_S

    while os.getppid() == supervisor_pid:
        await asyncio.sleep(SUPERVISOR_CHECK_INTERVAL_S)
    on_gone()


def _attach_engine(app: FastAPI, engine: AsyncLLM, args: ServerArgs,
                   attach: CoreAddresses | None = None) -> None:
    model_config = engine.model_config
    names = args.served_model_names or [model_config.model]
    common: dict[str, Any] = dict(max_waiting_requests=args.max_waiting_requests)
    state = app.state
    state.engine = engine
    state.served_model_names = names
    lora_check = engine.processor.check_lora if engine.config.lora_config is not None else None
    state.models = ServingModels(names, lora_check)
    for module in args.lora_modules:
        state.models.add_lora(module.name, module.path, module.base_model_name)
    common["models"] = state.models
    state.completion = OpenAIServingCompletion(engine, names, **common)
    state.chat = OpenAIServingChat(engine, names, chat_template=args.chat_template,
                                   tool_parser=args.tool_call_parser,
                                   enable_auto_tool_choice=args.enable_auto_tool_choice, **common)
    # Several API servers: one set of metrics over all of them (see multi_api_server), the
    # engine core's own counters counted by the first one only.
    state.metrics = PrometheusStatLogger(
        names[0], vllm_names=args.vllm_metric_names, multiprocess=attach is not None,
        engine_counters=attach is None or attach.client_index == 0)
    engine.stat_loggers.append(state.metrics)
    if args.engine_args.speculative_config is not None:
        from octavo.engine.stats import SpecDecodeLogger

        engine.stat_loggers.append(SpecDecodeLogger())
    on_dead = getattr(state, "on_engine_dead", None)
    if on_dead is not None:
        engine.on_dead(on_dead)
    info = engine.core_info
    assert info is not None, "the engine started without reporting its KV cache"
    kv_tokens = info.num_blocks * info.block_size
    max_concurrency = min(kv_tokens / info.max_model_len, args.engine_args.max_num_seqs)
    logger.info(
        "backend %s, model %s (served as %s), %d KV blocks of %d tokens (%d tokens), max "
        "concurrency %.1f requests of max_model_len %d (max_num_seqs %d)",
        info.backend, model_config.model, ", ".join(names), info.num_blocks, info.block_size,
        kv_tokens, max_concurrency, info.max_model_len, args.engine_args.max_num_seqs,
    )


def _add_routes(app: FastAPI) -> None:
    @app.get("/health", tags=["server"], summary="200 while the engine runs, else 503")
    async def health(request: Request) -> Response:
        engine: AsyncLLM = request.app.state.engine
        await engine.check_health()  # EngineDeadError -> 503
        return Response(status_code=200)

    @app.get("/version", tags=["server"])
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", tags=["server"], summary="Prometheus metrics (octavo:*)")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.expose(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, tags=["openai"])
    async def list_models(request: Request) -> ModelList:
        state = request.app.state
        engine: AsyncLLM = state.engine
        max_model_len = engine.model_config.max_model_len
        models: ServingModels = state.models
        return ModelList(data=[
            ModelCard(id=name, root=str(engine.model_config.model), max_model_len=max_model_len)
            for name in state.served_model_names
        ] + [
            ModelCard(id=name, root=lora.lora_path, parent=lora.base_model_name,
                      max_model_len=max_model_len)
            for name, lora in models.lora_requests.items()
        ])

    @app.post("/v1/completions", response_model=CompletionResponse, tags=["openai"],
              summary="Text completions (stream=true: server-sent events)")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await request.app.state.completion.create_completion(body, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, tags=["openai"],
              summary="Chat completions (stream=true: server-sent events)")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await request.app.state.chat.create_chat_completion(body, request)

    @app.post("/tokenize", response_model=TokenizeResponse, tags=["tokenizer"])
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        chat: OpenAIServingChat = request.app.state.chat
        chat.check_fields(body)
        chat.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", 400, param="prompt",
                              code="invalid_value")
        if body.messages is not None:
            tools = check_tools(body.tools) if body.tools is not None else None
            _, token_ids = chat.render(body.messages, body.add_generation_prompt, tools,
                                       body.chat_template_kwargs)
        else:
            try:
                text = check_text(body.prompt, "prompt")
            except InvalidRequestError as exc:
                raise invalid_request(exc) from None
            encoded = chat.tokenizer(text, add_special_tokens=body.add_special_tokens)
            token_ids = list(encoded.input_ids)
        return TokenizeResponse(count=len(token_ids), max_model_len=chat.max_model_len, tokens=token_ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, tags=["tokenizer"])
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        chat: OpenAIServingChat = request.app.state.chat
        chat.check_fields(body)
        chat.check_model(body.model)
        try:
            token_ids = chat.engine.processor.check_token_ids(body.tokens, param="tokens")
        except InvalidRequestError as exc:
            raise invalid_request(exc) from None
        return DetokenizeResponse(prompt=chat.tokenizer.decode(token_ids))


def _add_lora_routes(app: FastAPI) -> None:
    """vLLM's runtime adapter endpoints (only with OCTAVO_ALLOW_RUNTIME_LORA_UPDATING=1)."""

    @app.post("/v1/load_lora_adapter", tags=["lora"],
              summary="Serve a LoRA adapter under a new model name")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
        request.app.state.models.add_lora(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", tags=["lora"],
              summary="Stop serving a LoRA adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
        request.app.state.models.remove_lora(body.lora_name)
        return PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _add_docs(app: FastAPI) -> None:
    """``/docs``: Swagger UI from the files of the ``swagger-ui-bundle`` package, so it works
    with no internet (FastAPI's default page loads it from a CDN)."""
    from swagger_ui_bundle import swagger_ui_path

    assets = "/docs/assets"
    app.mount(assets, StaticFiles(directory=swagger_ui_path), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} API",
            swagger_js_url=f"{assets}/swagger-ui-bundle.js",
            swagger_css_url=f"{assets}/swagger-ui.css",
            swagger_favicon_url=f"{assets}/favicon-32x32.png",
        )


# ---- running -----------------------------------------------------------------------------------


class PortInUseError(RuntimeError):
    """The server's address cannot be bound (port taken, or not an address of this machine)."""


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket on ``host:port``, bound before anything slow happens, so a busy
    port is reported at once and not after the model has loaded.

    :param reuse_port: with ``SO_REUSEPORT``, so that other sockets of this user with it too
        can listen on the same address and the kernel deals connections among them (Linux;
        ``--api-server-count``, see ``multi_api_server``).
    :raises PortInUseError: with what to change.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise PortInUseError(f"cannot listen on {host}:{port}: {exc}; check --host") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUseError(
                f"port {port} on {host} is already in use: pick another with --port (0 picks "
                "any free one), or stop what holds it") from None
        raise PortInUseError(f"cannot listen on {host}:{port}: {exc.strerror}; check --host "
                             "and --port") from None
    sock.set_inheritable(True)
    return sock


# After the shutdown grace period the requests still running get their 503s; uvicorn waits
# this much longer for those responses to go out before it cancels what is left.
_ERROR_DELIVERY_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn's server, plus the URL in the log once listening, a way to exit non-zero, and
    the shutdown grace period: on SIGTERM/SIGINT requests in flight may finish for
    ``grace_period_s``, then every one still running is cut with an OpenAI error object (503,
    ``server_shutting_down``) rather than left to uvicorn's plain-text 500."""

    exit_code = 0

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_period_s: float) -> None:
        super().__init__(config)
        self._app = app
        self.grace_period_s = grace_period_s

    def request_exit(self, exit_code: int) -> None:
        self.exit_code = exit_code
        self.should_exit = True

    async def shutdown(self, sockets: Any = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.grace_period_s, self._cut_requests)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _cut_requests(self) -> None:
        engine: AsyncLLM | None = getattr(self._app.state, "engine", None)
        if engine is None:
            return
        count = engine.abort_all(EngineShuttingDownError(
            f"requests still running after the {self.grace_period_s:.0f} s shutdown timeout "
            "were cut"))
        if count:
            logger.warning("shutdown timeout: %d request(s) still running were cut (503)", count)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        logger.info("serving the OpenAI API on http://%s:%d/v1 (docs: http://%s:%d/docs)",
                    shown, port, shown, port)


def run_server(args: ServerArgs, sock: socket.socket | None = None,
               attach: CoreAddresses | None = None, supervisor_pid: int | None = None) -> int:
    """Serve until SIGTERM/SIGINT (returns 0) or the engine dies / fails to start (returns 1).

    :param sock: the listening socket (``bind_socket``); bound here when not given.
    :param attach: see ``build_app`` (one API server of several).
    :param supervisor_pid: exit (1) once this process is no longer our parent.
    """
    if sock is None:
        sock = bind_socket(args.host, args.port)
    app = build_app(args, attach)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, lifespan="on", access_log=args.access_log,
        timeout_graceful_shutdown=int(args.shutdown_timeout + _ERROR_DELIVERY_S) + 1,
        log_level="info", timeout_keep_alive=5,
    )
    server = _Server(config, app, grace_period_s=args.shutdown_timeout)

    def on_engine_dead(reason: str) -> None:
        logger.error("shutting down in %.0f s: %s", DEAD_ENGINE_EXIT_DELAY_S, reason)
        asyncio.get_running_loop().call_later(DEAD_ENGINE_EXIT_DELAY_S, server.request_exit, 1)

    app.state.on_engine_dead = on_engine_dead
    if supervisor_pid is not None:
        def on_supervisor_gone() -> None:
            logger.error("the octavo serve supervisor (pid %d) is gone; shutting down",
                         supervisor_pid)
            server.request_exit(1)

        app.state.supervisor_pid = supervisor_pid
        app.state.on_supervisor_gone = on_supervisor_gone
    # uvicorn re-raises a captured SIGTERM/SIGINT after its graceful shutdown; with these
    # handlers in place that re-raise is a no-op and the exit code stays ours (0).
    previous = {sig: signal.signal(sig, _ignore_reraised_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        logger.error("the server did not start")
        return 1
    return server.exit_code


def _ignore_reraised_signal(signum: int, frame: Any) -> None:
    logger.debug("signal %d after shutdown ignored", signum)


if __name__ == "__main__":
    # `python -m octavo.entrypoints.openai.api_server [MODEL] [options]` is `octavo serve`: the
    # same parser, the same exit codes.
    import sys

    from octavo.cli.main import main

    sys.exit(main(["serve", *sys.argv[1:]]))
