"""``pdserve generate``: complete prompts, in-process (``--local``) or through the gateway."""

from __future__ import annotations

import argparse
import json

from common.contract.sampling import SamplingParams
from pdserve.cli.engine_args import add_engine_args, engine_config_from_args
from pdserve.client import add_client_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="complete one or more prompts")
    parser.add_argument("prompts", nargs="+", metavar="PROMPT")
    parser.add_argument("--local", action="store_true", help="run the engine in this process")
    add_client_args(parser)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument(
        "--no-speculation",
        action="store_true",
        help="never speculate on these requests (sampling.disable_speculation)",
    )
    parser.add_argument("--raw", action="store_true", help="no chat template: tokenizer(prompt)")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_args(parser)
    parser.set_defaults(func=run)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        speculative=not args.no_speculation,
    )


def run(args: argparse.Namespace) -> int:
    sampling = sampling_from_args(args)
    if not args.local:
        from pdserve.cli.commands.client import generate_remote

        return generate_remote(args, sampling)
    from common.engine.llm import LLM
    from common.models.default_model import resolve_model

    llm = LLM(engine_config_from_args(args, resolve_model(args.model)))
    completions = llm.generate(args.prompts, sampling, raw=args.raw)
    for prompt, completion in zip(args.prompts, completions, strict=True):
        if args.json:
            record = {
                "prompt": prompt,
                "prompt_token_ids": completion.prompt_token_ids,
                "token_ids": completion.token_ids,
                "text": completion.text,
                "finish_reason": completion.finish_reason,
                "usage": {
                    "prompt_tokens": len(completion.prompt_token_ids),
                    "completion_tokens": len(completion.token_ids),
                    "cached_tokens": completion.num_cached_tokens,
                },
            }
            print(json.dumps(record, ensure_ascii=False), flush=True)
        else:
            if len(args.prompts) > 1:
                print(f"=== {prompt}", flush=True)
            print(completion.text, flush=True)
    return 0
