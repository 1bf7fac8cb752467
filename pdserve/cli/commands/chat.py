"""``pdserve chat``: an interactive conversation streamed from the gateway."""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from common.contract.sampling import SamplingParams
from pdserve.client import add_client_args, client_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("chat", help="chat with the served model (Ctrl-D ends)")
    add_client_args(parser)
    parser.add_argument("--system", default=None, help="system message")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=None)
    parser.set_defaults(func=run)


async def _chat(args: argparse.Namespace) -> int:
    client = client_from_args(args)
    sampling = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    messages = [{"role": "system", "content": args.system}] if args.system else []
    try:
        while True:
            try:
                line = await asyncio.to_thread(input, "you> ")
            except EOFError:
                print()
                return 0
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            print("assistant> ", end="", flush=True)
            reply = ""
            try:
                async for message in client.stream(messages=messages, sampling=sampling):
                    reply += message.text
                    print(message.text, end="", flush=True)
            except grpc.aio.AioRpcError as exc:
                print(f"\n[{exc.code().name}: {exc.details()}]", file=sys.stderr)
                messages.pop()
                continue
            print(flush=True)
            messages.append({"role": "assistant", "content": reply})
    finally:
        await client.close()


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_chat(args))
