"""StreamingLLM eviction as a request asks for it (``SamplingParams.kv_eviction``, common.v1
field 19) or a worker applies it to every request (``--kv-eviction streaming``); the engine
side is common/engine/eviction.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.errors import InvalidRequestError

if TYPE_CHECKING:  # the contract speaks of messages it never builds itself
    from pdserve.common.v1.common_pb2 import KvEviction as KvEvictionPb

STREAMING = "streaming"
KV_EVICTIONS = ("none", STREAMING)


@dataclass(frozen=True)
class KvEviction:
    sink_tokens: int = 16
    window_tokens: int = 1024

    def check(self, block_size: int, max_positions: int) -> None:
        """The sinks, two windows and a block must fit the rotary table: a step's chunk is
        at most a window, on top of what is kept."""
        if self.sink_tokens < 0:
            raise InvalidRequestError("sampling.kv_eviction.sink_tokens", f"{self.sink_tokens} < 0")
        if self.window_tokens < block_size:
            raise InvalidRequestError(
                "sampling.kv_eviction.window_tokens",
                f"{self.window_tokens} is less than a KV block ({block_size} tokens)",
            )
        span = self.sink_blocks(block_size) * block_size + 2 * self.window_tokens + 2 * block_size
        if span > max_positions:
            raise InvalidRequestError(
                "sampling.kv_eviction.window_tokens",
                f"sinks ({self.sink_tokens}) and two windows of {self.window_tokens} tokens "
                f"need {span} positions; this model has {max_positions}",
            )

    def sink_blocks(self, block_size: int) -> int:
        return -(-self.sink_tokens // block_size)

    def describe(self) -> str:
        return f"streaming(sinks={self.sink_tokens}, window={self.window_tokens})"

    @classmethod
    def from_pb(cls, pb: KvEvictionPb) -> KvEviction:
        if pb.window_tokens == 0:
            raise InvalidRequestError("sampling.kv_eviction.window_tokens", "must be set (> 0)")
        return cls(pb.sink_tokens, pb.window_tokens)

    def to_pb(self, pb: KvEvictionPb) -> None:
        pb.sink_tokens = self.sink_tokens
        pb.window_tokens = self.window_tokens
