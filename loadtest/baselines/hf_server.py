"""transformers ``generate`` as an OpenAI-compatible streaming server: the baseline.

It serves what a plain transformers deployment serves: static batches. Requests that
arrive while a batch runs wait for it to finish; a batch (up to ``--max-batch-size``
requests, left-padded) runs until its last row is done. Each row's tokens are streamed
as they are sampled, so the load tester measures it exactly as it measures pdserve.

    .venv/bin/python -m loadtest.baselines.hf_server --model DIR --port 8100

POST /v1/completions (``prompt``: token ids or text; ``max_tokens``, ``ignore_eos``,
``stream``), GET /v1/models, GET /health. Greedy decoding only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

log = logging.getLogger("hf_server")


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    num_generated: int = 0
    done: bool = False
    error: str = ""  # set when generate failed; the stream then ends with an error event

    def push(self, token: int | None) -> None:
        self.loop.call_soon_threadsafe(self.tokens.put_nowait, token)


class StreamRows:
    """A stopping criterion that streams each row's new token and stops rows that are done
    (their max_tokens, or eos unless ignore_eos); generate stops when every row is."""

    def __init__(self, jobs: list[Job], eos_ids: set[int]) -> None:
        self.jobs = jobs
        self.eos_ids = eos_ids

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        last = input_ids[:, -1].tolist()
        for job, token in zip(self.jobs, last, strict=True):
            if job.done:
                continue
            job.num_generated += 1
            job.push(int(token))
            if job.num_generated >= job.max_tokens or (
                not job.ignore_eos and token in self.eos_ids
            ):
                job.done = True
                job.push(None)
        return torch.tensor([job.done for job in self.jobs], dtype=torch.bool)


class BatchRunner(threading.Thread):
    def __init__(self, model_dir: str, dtype: str, max_batch_size: int) -> None:
        super().__init__(daemon=True, name="generate")
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)
        ).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad_id = next(iter(self.eos_ids), 0)
        self.max_batch_size = max_batch_size
        self.jobs: queue.Queue[Job] = queue.Queue()

    def run(self) -> None:
        while True:
            batch = [self.jobs.get()]
            while len(batch) < self.max_batch_size:
                try:
                    batch.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            error = ""
            try:
                self.generate(batch)
            except Exception as exc:  # a bad batch fails its requests, not the server
                log.exception("generate failed")
                error = f"generate failed: {exc}"
            for job in batch:
                if not job.done:
                    job.error = error or "generate ended early"
                    job.done = True
                    job.push(None)

    def generate(self, batch: list[Job]) -> None:
        width = max(len(j.prompt_ids) for j in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, job in enumerate(batch):
            ids[row, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
            mask[row, width - len(job.prompt_ids) :] = 1
        with torch.inference_mode():
            self.model.generate(
                ids, attention_mask=mask, max_new_tokens=max(j.max_tokens for j in batch),
                do_sample=False, eos_token_id=None, pad_token_id=self.pad_id,
                stopping_criteria=[StreamRows(batch, self.eos_ids)],
            )  # fmt: skip


def make_app(runner: BatchRunner, tokenizer: Any, model_name: str) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt_ids = tokenizer.encode(prompt).ids
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = prompt
        else:
            return web.json_response(
                {"error": {"message": "prompt: text or token ids"}}, status=400
            )
        max_tokens = int(body.get("max_tokens") or 16)
        job = Job(prompt_ids, max_tokens, bool(body.get("ignore_eos")), asyncio.get_running_loop())
        runner.jobs.put(job)
        created = int(time.time())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def event(payload: dict[str, Any]) -> None:
            await response.write(f"data: {json.dumps(payload)}\n\n".encode())

        num_generated = 0
        while (token := await job.tokens.get()) is not None:
            num_generated += 1
            await event({"id": "cmpl", "object": "text_completion", "created": created,
                         "model": model_name,
                         "choices": [{"index": 0, "text": tokenizer.decode([token]), "finish_reason": None}]})  # fmt: skip
        if job.error:
            await event({"error": {"message": job.error}})
            await response.write_eof()
            return response
        finish = "length" if num_generated >= max_tokens else "stop"
        await event({"id": "cmpl", "object": "text_completion", "created": created,
                     "model": model_name, "choices": [{"index": 0, "text": "", "finish_reason": finish}]})  # fmt: skip
        await event({"id": "cmpl", "object": "text_completion", "created": created,
                     "model": model_name, "choices": [],
                     "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": num_generated,
                               "total_tokens": len(prompt_ids) + num_generated}})  # fmt: skip
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": model_name, "object": "model"}]}
        )

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default=None, help="checkpoint directory (default model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from tokenizers import Tokenizer

    from common.models.default_model import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    runner = BatchRunner(model_dir, args.dtype, args.max_batch_size)
    runner.start()
    tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
    name = model_dir.rstrip("/").rsplit("/", 1)[-1]
    log.info("transformers baseline serving %s on %s:%d", name, args.host, args.port)
    web.run_app(make_app(runner, tokenizer, name), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
