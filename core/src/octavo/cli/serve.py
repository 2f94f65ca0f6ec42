"""``octavo serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse

from octavo import envs
from octavo.cli.options import add_engine_options
from octavo.engine.arg_utils import EngineArgs


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /metrics, ...). With no MODEL, serves the embedded "
        "SmolLM2-135M-Instruct. Example: octavo serve Qwen/Qwen2.5-0.5B-Instruct --port 8000",
    )
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="local Hugging Face folder or .gguf file, or a Hugging Face hub name "
                        "(org/name, org/name:Q4_K_M) (same as --model)")
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    group.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port)")
    group.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model name(s) clients use in 'model' (default: the model path); "
                       "responses carry the first")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (except on /health and /metrics); "
                       "default: $OCTAVO_API_KEY, which unlike a flag does not show in `ps`")
    group.add_argument("--chat-template", default=None,
                       help="chat template file or jinja text (default: the tokenizer's)")
    group.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                       help="CORS origins allowed to call the API from browsers ('*' for any)")
    group.add_argument("--max-request-body-bytes", type=int, default=16 * 2**20,
                       help="largest request body accepted (413 above; default 16 MiB)")
    group.add_argument("--max-waiting-requests", type=int, default=None,
                       help="answer 503 to new requests while this many wait to run (default: no limit)")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds requests in flight may take to finish on SIGTERM/SIGINT")
    group.add_argument("--access-log", action="store_true", help="log every HTTP request")
    group.add_argument("--api-server-count", type=int, default=1, metavar="N",
                       help="API server processes (HTTP, tokenization, detokenization) sharing "
                       "the port and one engine core; more than 1 when one process cannot keep "
                       "up with the engine's output (default 1)")
    group.add_argument("--vllm-metric-names", action="store_true",
                       help="also export every /metrics series under its vLLM name (vllm:...), "
                       "so dashboards built for vLLM work unchanged")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let the model decide to call tools (tool_choice 'auto', the default "
                       "when a request gives tools), read with --tool-call-parser")
    group.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="format of the model's tool calls: hermes (Qwen2.5, Qwen3, Hermes), "
                       "llama3_json (Llama 3.1+), mistral, or one a plugin registers")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT folders) served under their own model names "
                       "(needs --enable-lora): name=path, or JSON "
                       '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
    add_engine_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from octavo.entrypoints.openai.api_server import ServerArgs, bind_socket, run_server

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    for name in ("port", "max_request_body_bytes"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    from octavo.entrypoints.openai.multi_api_server import check_api_server_count

    check_api_server_count(args.api_server_count, envs.allow_runtime_lora_updating())
    # The port first: a busy one is reported now, not after the model has loaded.
    from octavo.entrypoints.openai.multi_api_server import deals_by_reuse_port

    sock = bind_socket(args.host, args.port,
                       reuse_port=args.api_server_count > 1 and deals_by_reuse_port())
    front_end_threads()
    engine_args = EngineArgs.from_cli_args(args)
    # Fail here, with one clear line, on a missing model or backend or a bad option or template
    # (cheap: reads config.json; the weights load in the engine-core process).
    config = engine_args.create_engine_config()
    if args.chat_template is not None:
        from octavo.entrypoints.openai.chat_template import ChatTemplate, load_chat_template

        ChatTemplate(load_chat_template(args.chat_template, None), None)
    if args.tool_call_parser is not None:
        from octavo.entrypoints.openai.tool_parsers import get_tool_parser

        get_tool_parser(args.tool_call_parser)
    elif args.enable_auto_tool_choice:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (the format of "
                         "the model's tool calls, e.g. hermes)")
    from octavo.entrypoints.openai.serving_models import parse_lora_modules

    lora_modules = parse_lora_modules(args.lora_modules or [])
    if lora_modules and config.lora_config is None:
        raise ValueError("--lora-modules needs --enable-lora")
    if lora_modules:
        from octavo.lora.peft import inspect_adapter

        for module in lora_modules:  # a bad adapter is reported now, before the model loads
            inspect_adapter(module.name, module.path, config.lora_config.max_lora_rank,
                            config.model_config.hf_config)
    server_args = ServerArgs(
        engine_args=engine_args,
        host=args.host,
        port=args.port,
        served_model_names=args.served_model_name or [],
        api_key=args.api_key if args.api_key is not None else envs.api_key(),
        chat_template=args.chat_template,
        allowed_origins=args.allowed_origins or [],
        max_request_body_bytes=args.max_request_body_bytes,
        max_waiting_requests=args.max_waiting_requests,
        shutdown_timeout=args.shutdown_timeout,
        access_log=args.access_log,
        vllm_metric_names=args.vllm_metric_names,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        lora_modules=lora_modules,
        allow_runtime_lora_updating=envs.allow_runtime_lora_updating(),
        api_server_count=args.api_server_count,
    )
    if args.api_server_count > 1:
        from octavo.entrypoints.openai.multi_api_server import run_multi_api_server

        return run_multi_api_server(server_args, sock, config)
    return run_server(server_args, sock)


def front_end_threads() -> int:
    """This process only serves HTTP, tokenizes and detokenizes; the model runs in the engine
    core's process. One torch thread here, so the two do not compete for the same cores (the
    engine core's process is spawned fresh and plans its own threads). Returns the previous
    count."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    return previous
