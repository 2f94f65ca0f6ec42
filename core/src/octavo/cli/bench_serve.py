"""``octavo bench serve``: drive a running OpenAI-compatible server and print what it did.

The flags are ``vllm bench serve``'s. The client (``octavo.benchmarks.serve_client``) sends a
random token-id dataset at the given arrival rate, streams every response and times each
chunk; ``octavo.benchmarks.serve_metrics`` turns the timings into throughput, latency
percentiles and goodput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from octavo.cli.options import RawDescriptionHelpFormatter

if TYPE_CHECKING:
    from octavo.benchmarks.serve_client import RunResult

_DESCRIPTION = """\
Benchmark a running server (octavo serve, or any OpenAI-compatible one) over HTTP: random
token-id prompts (sent as token-id lists, so the server sees exactly --input-len tokens;
the same token ids `octavo bench throughput --async-engine` uses for the same seed and
lengths), sent at --request-rate (inf: all at once; else Poisson, or gamma with
--burstiness), at most --max-concurrency in flight, every response streamed and each chunk
timed. Prints request and token throughput, peak output tok/s, mean/median/percentiles of
TTFT, TPOT, ITL and E2E latency, goodput under --goodput SLOs, and one JSON line. A test
request goes first: an unreachable server or a wrong model name fails at once. Against a
fast server, --num-client-processes spreads the client over several processes so that the
client is not what limits the figures.

Example:
  octavo serve ./my-model --port 8000 &
  octavo bench serve --model ./my-model --num-prompts 200 --input-len 512 --output-len 128 \\
      --ignore-eos --max-concurrency 64
"""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def add_serve_parser(modes) -> None:
    """``octavo bench serve`` under the ``bench`` command's modes."""
    p = modes.add_parser("serve", help="benchmark a running OpenAI-compatible server",
                         description=_DESCRIPTION, formatter_class=RawDescriptionHelpFormatter)
    where = p.add_argument_group("server")
    where.add_argument("--backend", choices=("openai",), default="openai",
                       help="API to speak: openai (streamed /v1/completions)")
    where.add_argument("--base-url", default=None,
                       help="server URL, e.g. http://host:8000 (default: from --host and --port)")
    where.add_argument("--host", default="127.0.0.1", help="server host")
    where.add_argument("--port", type=int, default=8000, help="server port")
    where.add_argument("--endpoint", default="/v1/completions",
                       help="completions path on the server")
    where.add_argument("--model", default=None,
                       help="the request's model name (default: the first of GET /v1/models)")
    where.add_argument("--tokenizer", default=None,
                       help="local folder of the tokenizer whose ids the prompts draw from "
                            "(default: --model)")
    data = p.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=("random",), default="random",
                      help="random: random token ids")
    data.add_argument("--num-prompts", type=_positive_int, default=1000, help="number of requests")
    data.add_argument("--input-len", type=_positive_int, default=1024,
                      help="prompt tokens per request (after the shared prefix)")
    data.add_argument("--output-len", type=_positive_int, default=128,
                      help="max_tokens per request")
    data.add_argument("--range-ratio", type=float, default=0.0,
                      help="lengths uniform in [LEN * (1 - R), LEN * (1 + R)]")
    data.add_argument("--prefix-len", type=_non_negative_int, default=0,
                      help="random tokens shared by every prompt, before its own")
    data.add_argument("--seed", type=int, default=0, help="seed of the dataset and arrivals")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests per second (inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="shape of the gamma-distributed gaps between requests (1: Poisson)")
    load.add_argument("--max-concurrency", type=_positive_int, default=None,
                      help="most requests in flight at once (default: no limit)")
    load.add_argument("--ignore-eos", action="store_true",
                      help="send ignore_eos so every request makes exactly its max_tokens")
    load.add_argument("--num-client-processes", type=_positive_int, default=1,
                      help="split the client over N processes, requests dealt round robin "
                           "(one process takes in some tens of thousands of streamed chunks a "
                           "second: use more when the report's busiest client process nears "
                           "100%% CPU; --max-concurrency is divided between them)")
    out = p.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                     help="SLOs for goodput, e.g. ttft:200 tpot:50 e2el:5000 (milliseconds)")
    out.add_argument("--metric-percentiles", default="99",
                     help="comma-separated percentiles to report, e.g. 50,90,99")
    out.add_argument("--save-result", action="store_true",
                     help="also write the JSON result to a file")
    out.add_argument("--result-dir", default=None,
                     help="folder of --save-result's file (default: the current one)")
    out.add_argument("--result-filename", default=None,
                     help="file name of --save-result (default: octavo-serve-RATEqps-"
                          "MODEL-TIME.json)")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run_serve)


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or not all(0 < v <= 100 for v in values):
        raise ValueError(f"--metric-percentiles takes comma-separated numbers in (0, 100], "
                         f"got {text!r}")
    return values


def _load_tokenizer(name: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"cannot load a tokenizer from {name!r} ({first}); pass --tokenizer "
                         "with the model's local folder") from None


def _prompt_vocab_size(folder: str, tokenizer_size: int) -> int:
    """How many token ids prompts may draw from: the tokenizer's, or the model's vocabulary
    when the folder's config.json gives a smaller one (a tokenizer may hold more ids than the
    model's embedding: those are refused with a 400). The same bound as ``bench throughput``
    (the model's ``vocab_size``), so one seed gives both the same prompts."""
    config_path = Path(folder) / "config.json"
    if not config_path.is_file():
        return tokenizer_size
    config = json.loads(config_path.read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return min(tokenizer_size, vocab) if isinstance(vocab, int) and vocab > 0 else tokenizer_size


def run_serve(args: argparse.Namespace) -> int:
    from octavo.benchmarks.serve_client import BenchServeError
    from octavo.benchmarks.serve_metrics import calculate_metrics, parse_goodput

    slos = parse_goodput(args.goodput)
    percentiles = _percentiles(args.metric_percentiles)
    if not args.endpoint.startswith("/"):
        raise ValueError(f"--endpoint must start with /, got {args.endpoint!r}")
    if args.max_concurrency is not None and args.max_concurrency < args.num_client_processes:
        raise ValueError(f"--max-concurrency {args.max_concurrency} is less than "
                         f"--num-client-processes {args.num_client_processes}: each client "
                         "process needs at least one request in flight")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    try:
        model, run = asyncio.run(_run(args, base_url))
    except BenchServeError as exc:
        raise RuntimeError(str(exc)) from None
    metrics = calculate_metrics(run.results, run.duration_s, slos, percentiles)
    busiest = client_busiest_fraction(run)
    result = _result_dict(args, base_url, model, metrics, run.max_in_flight)
    result["client_processes"] = args.num_client_processes
    result["client_cpu_s"] = round(sum(run.client_cpu_s), 3)
    result["client_busiest_cpu_fraction"] = round(busiest, 3)
    _print_summary(metrics, percentiles, run.max_in_flight, slos, busiest)
    print(json.dumps(result), flush=True)
    if busiest >= CLIENT_SATURATED:
        print(f"bench serve: warning: the busiest client process was on the CPU for "
              f"{busiest:.0%} of the run, so the figures may be the client's limit rather than "
              f"the server's; run again with more --num-client-processes (now "
              f"{args.num_client_processes})", file=sys.stderr)
    if args.save_result:
        path = _result_path(args, model)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"result written to {path}", file=sys.stderr)
    if metrics.failed:
        first = next(r.error for r in run.results if not r.success)
        print(f"octavo bench: error: {metrics.failed} of {len(run.results)} requests failed; "
              f"first: {first}", file=sys.stderr)
        return 1
    return 0


async def _run(args: argparse.Namespace, base_url: str):
    """The served model's name and the run's records."""
    from tqdm.auto import tqdm

    from octavo.benchmarks import serve_client as sc

    api_key = os.environ.get("OPENAI_API_KEY") or None
    async with sc.make_client() as client:
        model = args.model or await sc.served_model(client, base_url, api_key)
        folder = args.tokenizer or model
        tokenizer = _load_tokenizer(folder)
        requests = sc.random_dataset(args.num_prompts, args.input_len, args.output_len,
                                     args.range_ratio, args.prefix_len,
                                     _prompt_vocab_size(folder, len(tokenizer)), args.seed)
        send_times = sc.arrival_times(len(requests), args.request_rate, args.burstiness,
                                      args.seed)
        target = sc.Target(url=base_url + args.endpoint, model=model, api_key=api_key,
                           ignore_eos=args.ignore_eos)
        await sc.check_server(client, target, requests[0])
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        print(f"bench serve: {len(requests)} requests to {target.url} (model {model!r}), "
              f"request rate {rate}/s, burstiness {args.burstiness:g}, max concurrency "
              f"{args.max_concurrency or 'unlimited'}", file=sys.stderr, flush=True)
        bar = tqdm(total=len(requests), desc="bench serve", unit="req", dynamic_ncols=True,
                   disable=args.disable_tqdm)
        try:
            if args.num_client_processes == 1:
                run = await sc.run_requests(client, target, requests, send_times,
                                            args.max_concurrency, lambda _: bar.update(1))
            else:
                from octavo.benchmarks.serve_workers import run_in_processes

                print(f"bench serve: {args.num_client_processes} client processes",
                      file=sys.stderr, flush=True)
                run = await asyncio.to_thread(
                    run_in_processes, target, requests, send_times, args.max_concurrency,
                    args.num_client_processes, lambda done: bar.update(done - bar.n))
        finally:
            bar.close()
    return model, run


#: A client process on the CPU for this share of the run or more may be what set its pace.
CLIENT_SATURATED = 0.85


def client_busiest_fraction(run: RunResult) -> float:
    """The largest share of the run's wall time that one client process spent on the CPU."""
    if not run.client_cpu_s or run.duration_s <= 0:
        return 0.0
    return max(run.client_cpu_s) / run.duration_s


def _result_dict(args: argparse.Namespace, base_url: str, model: str, m, max_in_flight: int) -> dict:
    result = {
        "bench": "serve",
        "backend": args.backend,
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model": model,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "prefix_len": args.prefix_len,
        "seed": args.seed,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": args.ignore_eos,
        "completed": m.completed,
        "failed": m.failed,
        "duration": round(m.duration_s, 4),
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": round(m.request_throughput, 4),
        "request_goodput": None if m.request_goodput is None else round(m.request_goodput, 4),
        "output_throughput": round(m.output_throughput, 2),
        "total_token_throughput": round(m.total_token_throughput, 2),
        "max_output_tokens_per_s": round(m.peak_output_throughput, 2),
        "max_concurrent_requests": max_in_flight,
        "total_chunks": m.total_chunks,
    }
    for name in ("ttft", "tpot", "itl", "e2el"):
        dist = getattr(m, name)
        result[f"mean_{name}_ms"] = round(dist.mean, 3)
        result[f"median_{name}_ms"] = round(dist.median, 3)
        result[f"std_{name}_ms"] = round(dist.std, 3)
        for p, value in dist.percentiles.items():
            result[f"p{p:g}_{name}_ms"] = round(value, 3)
    return result


def _print_summary(m, percentiles: tuple[float, ...], max_in_flight: int,
                   slos: dict[str, float], client_busiest: float) -> None:
    rows = [
        ("Successful requests", f"{m.completed}"),
        ("Failed requests", f"{m.failed}"),
        ("Benchmark duration (s)", f"{m.duration_s:.2f}"),
        ("Total input tokens", f"{m.total_input}"),
        ("Total generated tokens", f"{m.total_output}"),
        ("Request throughput (req/s)", f"{m.request_throughput:.2f}"),
    ]
    if slos:
        rows.append(("Request goodput (req/s)", f"{m.request_goodput:.2f}"))
    rows += [
        ("Output token throughput (tok/s)", f"{m.output_throughput:.2f}"),
        ("Peak output token throughput (tok/s)", f"{m.peak_output_throughput:.2f}"),
        ("Peak concurrent requests", f"{max_in_flight}"),
        ("Total token throughput (tok/s)", f"{m.total_token_throughput:.2f}"),
        ("Client CPU, busiest process (%)", f"{100 * client_busiest:.1f}"),
    ]
    print("{s:{c}^56}".format(s=" Serving Benchmark Result ", c="="))
    for label, value in rows:
        print(f"{label + ':':<42}{value:>14}")
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name, title in titles.items():
        dist = getattr(m, name)
        print("{s:{c}^56}".format(s=f" {title} ", c="-"))
        print(f"{f'Mean {name.upper()} (ms):':<42}{dist.mean:>14.2f}")
        print(f"{f'Median {name.upper()} (ms):':<42}{dist.median:>14.2f}")
        for p in percentiles:
            print(f"{f'P{p:g} {name.upper()} (ms):':<42}{dist.percentiles[p]:>14.2f}")
    print("=" * 56)


def _result_path(args: argparse.Namespace, model: str) -> str:
    name = args.result_filename
    if name is None:
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"octavo-serve-{rate}qps-{os.path.basename(model.rstrip('/')) or 'model'}-{stamp}.json"
    folder = args.result_dir or "."
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, name)

