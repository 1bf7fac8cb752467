"""EngineLoop: drives an Engine on its own thread for asyncio servers.

Threading contract: only the loop thread touches the Engine. Async callers either run a
function on that thread between steps (``call``) or stream a request's outputs
(``generate``). Outputs cross back into the event loop in one ``call_soon_threadsafe`` per
step. A request whose consumer goes away (cancellation, deadline, error) is aborted on the
engine thread, which frees its blocks before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from common.contract.sampling import SamplingParams
from common.engine.engine import Engine, RequestOutput
from common.errors import PdserveError

log = logging.getLogger(__name__)

T = TypeVar("T")
_IDLE_WAIT_S = 0.05


class EngineFailure(PdserveError):
    reason = "ENGINE_FAILURE"


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class EngineLoop:
    def __init__(self, engine: Engine, name: str = "engine") -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # where each request's outputs go
        # Which consumer owns each request id, until it has taken the final output. Outlives
        # _streams: a final output already dispatched but not yet consumed (a prefill-only
        # request's KV, held) must still be aborted if its consumer goes away.
        self._owners: dict[str, _Stream] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.num_steps = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)

    # -- async side ---------------------------------------------------------------------------

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread between steps; returns or raises its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # handed to the awaiting caller
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._commands.put(run)
        self._wake.set()
        return await future

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, **kwargs: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        """Adds a request and yields its outputs until it finishes.

        Errors from ``add_request`` (bad input, full queue, a request_id in flight, ...) raise
        before the first output and leave the engine as it was. Leaving at any point before
        the final output (cancelled while the add waits, or mid-stream) aborts this request,
        and never another one with the same id: the stream is registered on the engine thread
        only once the add succeeded, and the abort checks it is still this stream's.
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        left = threading.Event()

        def add(engine: Engine) -> None:
            if left.is_set():
                return  # the caller is gone already: never admit it
            engine.add_request(request_id, prompt_token_ids, sampling, **kwargs)
            self._streams[request_id] = stream
            self._owners[request_id] = stream

        def abort_own() -> None:
            if self._owners.get(request_id) is stream:
                del self._owners[request_id]
                self._streams.pop(request_id, None)
                self.engine.abort(request_id)

        def disown() -> None:
            if self._owners.get(request_id) is stream:
                del self._owners[request_id]

        constraint = sampling.structured_output
        if constraint is not None and "grammar" not in kwargs:
            # Compiled here, off the engine thread (llguidance drops the GIL meanwhile).
            kwargs["grammar"] = await asyncio.to_thread(self.engine.grammars.compile, constraint)
        finished = False
        try:
            await self.call(add)
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                left.set()
            self._commands.put(disown if finished else abort_own)
            self._wake.set()

    def submit(self, fn: Callable[[Engine], object]) -> None:
        """Runs ``fn(engine)`` on the engine thread soon; fire and forget (safe from
        cleanup code that may itself be cancelled)."""
        self._commands.put(lambda: fn(self.engine))
        self._wake.set()

    async def abort(self, request_id: str) -> bool:
        return await self.call(lambda engine: self._abort(request_id))

    def fail_all(self, exc: BaseException) -> None:
        """Soon, on the engine thread: aborts every streaming request (freeing its blocks)
        and raises ``exc`` in its consumer (a drain whose grace period ended)."""
        self._commands.put(lambda: self._fail_all(exc))
        self._wake.set()

    def fail(self, request_ids: list[str], exc: BaseException) -> None:
        """Soon, on the engine thread: aborts those of ``request_ids`` still streaming
        (freeing their blocks) and raises ``exc`` in their consumers (a worker whose role
        changed ends the streams it decoded, so that they continue elsewhere)."""
        self._commands.put(lambda: self._fail(request_ids, exc))
        self._wake.set()

    # -- engine thread ------------------------------------------------------------------------

    def _fail(self, request_ids: list[str], exc: BaseException) -> None:
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                continue
            self._owners.pop(request_id, None)
            self.engine.abort(request_id)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)

    def _abort(self, request_id: str) -> bool:
        self._streams.pop(request_id, None)
        self._owners.pop(request_id, None)
        return self.engine.abort(request_id)

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stopping:
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                log.exception("engine step failed; failing every running request")
                self._fail_all(EngineFailure(f"engine step failed: {exc}"))
                continue
            self.num_steps += 1
            self._dispatch(outputs)
        self._fail_all(EngineFailure("the engine is shutting down"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self.engine.abort(request_id)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
        self._streams.clear()
        self._owners.clear()


def _deliver(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
