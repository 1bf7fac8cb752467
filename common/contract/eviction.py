"""StreamingLLM eviction as a request asks for it (``SamplingParams.kv_eviction``, common.v1
field 19) or a worker applies it to every request (``--kv-eviction streaming``), and SnapKV
prompt compression likewise (``SamplingParams.kv_compression``, field 20, or
``--kv-compression snapkv``); the engine sides are common/engine/eviction.py and
common/engine/compression.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.errors import InvalidRequestError

if TYPE_CHECKING:  # the contract speaks of messages it never builds itself
    from pdserve.common.v1.common_pb2 import KvCompression as KvCompressionPb
    from pdserve.common.v1.common_pb2 import KvEviction as KvEvictionPb

STREAMING = "streaming"
KV_EVICTIONS = ("none", STREAMING)
SNAPKV = "snapkv"
KV_COMPRESSIONS = ("none", SNAPKV)
DEFAULT_SNAPKV_WINDOW = 32


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


@dataclass(frozen=True)
class KvCompression:
    """SnapKV at block granularity: keep at most ``budget_tokens`` of a prompt's KV (whole
    blocks: the first, the window's, and the best scored), scored by the attention of the
    prompt's last ``window_tokens``."""

    budget_tokens: int = 1024
    window_tokens: int = DEFAULT_SNAPKV_WINDOW

    def check(self, block_size: int) -> None:
        if self.window_tokens < 1:
            raise InvalidRequestError(
                "sampling.kv_compression.window_tokens", f"{self.window_tokens} < 1"
            )
        if self.budget_blocks(block_size) <= 1 + self.window_blocks(block_size):
            raise InvalidRequestError(
                "sampling.kv_compression.budget_tokens",
                f"{self.budget_tokens} tokens keep {self.budget_blocks(block_size)} blocks of "
                f"{block_size}: no room past the first block and the window's "
                f"{self.window_blocks(block_size)} (raise the budget or shrink the window)",
            )

    def budget_blocks(self, block_size: int) -> int:
        return -(-self.budget_tokens // block_size)

    def window_blocks(self, block_size: int) -> int:
        """Blocks the window can touch at the end of a prompt: its tokens, plus one when the
        window does not start on a block boundary."""
        return -(-self.window_tokens // block_size) + 1

    def describe(self) -> str:
        return f"snapkv(budget={self.budget_tokens}, window={self.window_tokens})"

    @classmethod
    def from_pb(cls, pb: KvCompressionPb) -> KvCompression:
        if pb.budget_tokens == 0:
            raise InvalidRequestError("sampling.kv_compression.budget_tokens", "must be set (> 0)")
        return cls(pb.budget_tokens, pb.window_tokens or DEFAULT_SNAPKV_WINDOW)

    def to_pb(self, pb: KvCompressionPb) -> None:
        pb.budget_tokens = self.budget_tokens
        pb.window_tokens = self.window_tokens
