"""Waiting in tests for something that happens on its own time (a heartbeat, a restart, a
drained pool): one helper for every poll, sync and async.

``until(check)`` / ``until_async(check)`` wait for ``check()`` to be truthy and fail with
``what`` at the timeout; ``settle(fetch, done)`` / ``settle_async`` return the last value
fetched once ``done(value)`` holds or the time is up, for tests that assert on the value
itself (and so say what was wrong with it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def until(
    what: str, check: Callable[[], object], timeout_s: float = 30.0, every_s: float = 0.25
) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(every_s)


async def until_async(
    what: str,
    check: Callable[[], Awaitable[object]],
    timeout_s: float = 10.0,
    every_s: float = 0.05,
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(every_s)


def settle(
    fetch: Callable[[], T],
    done: Callable[[T], bool],
    timeout_s: float = 20.0,
    every_s: float = 0.25,
) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = fetch()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(every_s)


async def settle_async(
    fetch: Callable[[], Awaitable[T]], done: Callable[[T], bool], timeout_s: float = 10.0,
    every_s: float = 0.05,
) -> T:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        value = await fetch()
        if done(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(every_s)
