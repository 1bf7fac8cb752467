"""``pdserve generate``: complete prompts, in-process (``--local``) or through the gateway."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common.contract.sampling import SamplingParams
from common.contract.structured import ConstraintKind, StructuredOutput
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
    constraint = parser.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="SCHEMA",
                            help="structured output: the output is JSON valid against this "
                            "JSON Schema (its JSON text, or @FILE)")  # fmt: skip
    constraint.add_argument("--json-object", action="store_true",
                            help="structured output: any JSON object")  # fmt: skip
    constraint.add_argument("--regex", help="structured output: the output matches this regex")
    constraint.add_argument("--grammar", metavar="GRAMMAR",
                            help="structured output: a context-free grammar in llguidance's "
                            "Lark syntax or GBNF (its text, or @FILE)")  # fmt: skip
    parser.add_argument("--raw", action="store_true", help="no chat template: tokenizer(prompt)")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_args(parser)
    parser.set_defaults(func=run)


def _text_or_file(value: str) -> str:
    return Path(value[1:]).read_text() if value.startswith("@") else value


def constraint_from_args(args: argparse.Namespace) -> StructuredOutput | None:
    if getattr(args, "json_schema", None):
        return StructuredOutput(ConstraintKind.JSON_SCHEMA, _text_or_file(args.json_schema))
    if getattr(args, "json_object", False):
        return StructuredOutput(ConstraintKind.JSON_OBJECT)
    if getattr(args, "regex", None):
        return StructuredOutput(ConstraintKind.REGEX, args.regex)
    if getattr(args, "grammar", None):
        return StructuredOutput(ConstraintKind.GRAMMAR, _text_or_file(args.grammar))
    return None


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        structured_output=constraint_from_args(args),
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
