"""``pdserve generate`` without ``--local``: stream completions from the gateway."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import grpc

from common.contract.sampling import SamplingParams
from pdserve.client import RemoteCompletion, client_from_args, collect


def generate_remote(args: argparse.Namespace, sampling: SamplingParams) -> int:
    return asyncio.run(_generate(args, sampling))


async def _generate(args: argparse.Namespace, sampling: SamplingParams) -> int:
    client = client_from_args(args)
    stream_text = not args.json and len(args.prompts) == 1

    async def one(prompt: str) -> RemoteCompletion:
        result = RemoteCompletion()
        kwargs: dict[str, Any] = {"raw_prompt": prompt} if args.raw else {"prompt": prompt}
        # generate(): a stream whose gateway dies resumes on the next --target.
        async for message in client.generate(sampling=sampling, **kwargs):
            collect(result, message)
            if stream_text:
                print(message.text, end="", flush=True)
        return result

    try:
        results = await asyncio.gather(*(one(p) for p in args.prompts))
    except grpc.aio.AioRpcError as exc:
        print(f"\npdserve generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        await client.close()
    for prompt, result in zip(args.prompts, results, strict=True):
        if args.json:
            print(json.dumps({
                "prompt": prompt,
                "request_id": result.request_id,
                "token_ids": result.token_ids,
                "text": result.text,
                "finish_reason": result.finish_reason,
                "usage": {"prompt_tokens": result.prompt_tokens,
                          "completion_tokens": len(result.token_ids),
                          "cached_tokens": result.cached_tokens},
                "ttft_ms": result.ttft_ms,
            }, ensure_ascii=False), flush=True)  # fmt: skip
        elif stream_text:
            print(flush=True)
        else:
            print(f"=== {prompt}\n{result.text}", flush=True)
    return 0
