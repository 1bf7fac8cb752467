"""``pdserve bench serve``: one benchmark run against one server, flags as in
``vllm bench serve``.

    pdserve bench serve --backend pdserve --base-url 127.0.0.1:50051 \\
        --dataset-name random --random-input-len 256 --random-output-len 64 \\
        --num-prompts 50 --request-rate 2 --goodput ttft:2000 tpot:200 \\
        --save-result --save-detailed --plot --result-dir results/
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.backends import BACKEND_NAMES, Backend, SendOptions
from loadtest.datasets import add_dataset_args, build_requests
from loadtest.metrics import METRIC_NAMES, parse_goodput, parse_percentiles
from loadtest.report import build_result, format_summary, save_result
from loadtest.runner import LoadConfig, run_load

DEFAULT_PORTS = {"pdserve": 50051, "openai": 8000, "openai-chat": 8000, "kserve": 8001}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=BACKEND_NAMES, default="pdserve",
                        help="pdserve = the gRPC gateway; openai / openai-chat = an "
                        "OpenAI-compatible HTTP server (completions / chat completions); "
                        "kserve = a KServe v2 / Triton gRPC server (vLLM backend's tensors)")  # fmt: skip
    parser.add_argument(
        "--base-url",
        default=None,
        help="server address: host:port for pdserve and kserve, http://host:port for openai",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port", type=int, default=None,
        help="default 50051 (pdserve), 8000 (openai), 8001 (kserve)",
    )
    parser.add_argument("--prompt-as-text", action="store_true",
                        help="pdserve backend: send each prompt as its text (raw_prompt, "
                        "tokenized by the gateway) instead of token ids, as the KServe "
                        "backend does")  # fmt: skip
    parser.add_argument("--endpoint", default=None, help="HTTP path (default /v1/completions or "
                        "/v1/chat/completions)")  # fmt: skip
    parser.add_argument(
        "--model",
        default=None,
        help="model directory (tokenizer, vocabulary); default: pdserve's default model",
    )
    parser.add_argument("--served-model-name", default=None, help="model name sent over HTTP")
    parser.add_argument("--tokenizer", default=None, help="directory holding tokenizer.json")
    parser.add_argument("--label", default=None, help="names the run (default: the backend)")
    auth = parser.add_argument_group("authentication")
    auth.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="sent as 'authorization: Bearer KEY' (env PDSERVE_API_KEY, else OPENAI_API_KEY)",
    )
    auth.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more header (HTTP) or metadata entry (gRPC) on every request; repeatable",
    )
    auth.add_argument(
        "--tls-ca",
        default=os.environ.get("PDSERVE_GATEWAY_CA"),
        help="pdserve backend: PEM CA of a gateway whose public port serves TLS",
    )
    add_dataset_args(parser)
    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second (inf = all at once)",
    )
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 = Poisson, <1 burstier, >1 steadier",
    )
    load.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    load.add_argument("--num-warmups", type=int, default=0, help="warm-up requests, not measured")
    load.add_argument(
        "--fixed-schedule",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="trace datasets: send at the trace's own times (else --request-rate)",
    )
    load.add_argument("--request-id-prefix", default="bench-")
    load.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the expected output lengths",
    )
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--cache-salt", default="", help="prefix-cache salt sent with every request")
    load.add_argument(
        "--unique-cache-salt",
        action="store_true",
        help="a salt per request: no prefix reuse (prefix caching off, as seen by clients)",
    )
    load.add_argument("--ready-check-timeout-sec", type=float, default=60.0)
    load.add_argument("--disable-tqdm", action="store_true")
    out = parser.add_argument_group("results")
    out.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS",
    )
    out.add_argument("--percentile-metrics", default=",".join(METRIC_NAMES))
    out.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99")
    out.add_argument("--save-result", action="store_true")
    out.add_argument("--save-detailed", action="store_true", help="per-request data in the JSON")
    out.add_argument("--result-dir", default=None)
    out.add_argument("--result-filename", default=None)
    out.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE")
    out.add_argument("--plot", action="store_true", help="a PNG of latency CDFs beside the JSON")


def base_url(args: argparse.Namespace) -> str:
    if args.base_url:
        return str(args.base_url)
    port = args.port or DEFAULT_PORTS[args.backend]
    grpc = args.backend in ("pdserve", "kserve")
    return f"{args.host}:{port}" if grpc else f"http://{args.host}:{port}"


def tokenizer_dir(args: argparse.Namespace) -> str:
    from common.models.default_model import resolve_model

    return str(args.tokenizer) if args.tokenizer else resolve_model(args.model)


def headers_of(args: argparse.Namespace) -> dict[str, str]:
    """``--header KEY=VALUE`` flags as a dict."""
    headers: dict[str, str] = {}
    for item in args.header:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--header wants KEY=VALUE, got {item!r}")
        headers[key.strip()] = value.strip()
    return headers


async def make_backend(args: argparse.Namespace) -> tuple[Backend, int]:
    """The backend and the vocabulary size prompts are drawn from."""
    from tokenizers import Tokenizer

    url = base_url(args)
    if args.backend == "pdserve":
        from loadtest.backends.grpc_gateway import GrpcGatewayBackend

        detokenize = None
        if args.prompt_as_text:
            text_tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir(args)) / "tokenizer.json"))
            detokenize = lambda ids: text_tokenizer.decode(list(ids))  # noqa: E731
        grpc_backend = GrpcGatewayBackend(
            url, api_key=args.api_key, tls_ca=args.tls_ca, metadata=headers_of(args),
            detokenize=detokenize,
        )  # fmt: skip
        await grpc_backend.ready(args.ready_check_timeout_sec)
        if args.tokenizer:
            vocab = Tokenizer.from_file(
                str(Path(args.tokenizer) / "tokenizer.json")
            ).get_vocab_size()
        else:
            vocab = (await grpc_backend.model_info()).vocab_size
        return grpc_backend, vocab
    from loadtest.backends.openai_http import OpenAIHttpBackend

    directory = tokenizer_dir(args)
    tokenizer = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    name = args.served_model_name or args.model or Path(directory).name
    headers = headers_of(args)
    if args.backend == "kserve":
        from loadtest.backends.kserve_grpc import KServeBackend

        if args.api_key:
            headers["authorization"] = f"Bearer {args.api_key}"
        kserve = KServeBackend(url, name, lambda ids: tokenizer.decode(list(ids)),
                               metadata=headers)  # fmt: skip
        await kserve.ready(args.ready_check_timeout_sec)
        return kserve, tokenizer.get_vocab_size()
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    http_backend = OpenAIHttpBackend(url, name, chat=args.backend == "openai-chat",
                                     endpoint=args.endpoint, headers=headers,
                                     detokenize=lambda ids: tokenizer.decode(list(ids)))  # fmt: skip
    await http_backend.ready(args.ready_check_timeout_sec)
    return http_backend, tokenizer.get_vocab_size()


def load_config(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(request_rate=args.request_rate, burstiness=args.burstiness,
                      max_concurrency=args.max_concurrency, num_warmups=args.num_warmups,
                      seed=args.seed, fixed_schedule=args.fixed_schedule,
                      request_id_prefix=args.request_id_prefix,
                      unique_cache_salt=args.unique_cache_salt, disable_tqdm=args.disable_tqdm)  # fmt: skip


def setup_of(args: argparse.Namespace, url: str) -> dict[str, Any]:
    setup: dict[str, Any] = {
        "backend": args.backend, "label": args.label or args.backend, "base_url": url,
        "model_id": args.model or "default", "tokenizer_id": args.tokenizer or args.model or "default",
        "dataset_name": args.dataset_name, "num_prompts": args.num_prompts,
        "request_rate": args.request_rate, "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "seed": args.seed, "ignore_eos": args.ignore_eos,
        "cache_salt": args.cache_salt, "unique_cache_salt": args.unique_cache_salt,
    }  # fmt: skip
    for item in args.metadata or ():
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata {item!r} is not KEY=VALUE")
        setup[key.strip()] = value.strip()
    return setup


async def run_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark; prints the summary; saves JSON (and PNG) if asked."""
    percentiles = parse_percentiles(args.metric_percentiles)
    slos = parse_goodput(args.goodput)
    metrics: Sequence[str] = [m for m in args.percentile_metrics.split(",") if m]
    if unknown := set(metrics) - set(METRIC_NAMES):
        raise ValueError(f"--percentile-metrics: unknown {sorted(unknown)}; use {METRIC_NAMES}")
    backend, vocab = await make_backend(args)
    try:
        requests = build_requests(args, vocab)
        options = SendOptions(args.ignore_eos, args.temperature, args.cache_salt)
        outcome = await run_load(backend, requests, options, load_config(args))
    finally:
        await backend.close()
    result = build_result(outcome, setup_of(args, base_url(args)), percentiles=percentiles,
                          goodput_slos_ms=slos, detailed=args.save_detailed or args.plot)  # fmt: skip
    print(format_summary(result, percentiles, metrics), flush=True)
    if args.save_result or args.plot:
        saved = result if args.save_detailed else {
            k: v for k, v in result.items()
            if k not in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts",
                         "errors", "requests")
        }  # fmt: skip
        if args.save_result:
            path = save_result(saved, args.result_dir, args.result_filename)
            print(f"result: {path}")
        if args.plot:
            from loadtest.plots import plot_cdfs

            stem = Path(args.result_filename or f"{result['label']}-{result['date']}").stem
            png = plot_cdfs({result["label"]: result}, Path(args.result_dir or ".") / f"{stem}.png")
            print(f"figure: {png}")
    return result


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(run_serve(args))
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    standalone = argparse.ArgumentParser(description=__doc__,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_serve_args(standalone)
    raise SystemExit(main(standalone.parse_args()))
