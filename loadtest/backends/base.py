"""What one request's stream looked like from the client, and the backend interface.

Times are ``time.perf_counter()`` seconds. A *content chunk* is a streamed message that
carries generated tokens (gRPC) or text (HTTP); each gives one arrival time and a token
count. Metrics (loadtest/metrics.py) are computed from these records alone.
"""

from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass, field

from loadtest.datasets.base import SampleRequest


@dataclass
class RequestOutput:
    request_id: str
    prompt_len: int
    category: str = ""
    success: bool = False
    error: str = ""
    status_code: str = ""  # on failure: a gRPC code name ("UNAVAILABLE"), "HTTP 503", ...
    start_time: float = 0.0  # when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each content chunk
    end_time: float = 0.0  # when the stream ended
    output_tokens: int = 0  # as the server counted them, else the chunks' tokens
    cached_tokens: int = 0  # prompt tokens served from a prefix cache, when reported
    generated_text: str = ""

    def add_chunk(self, when: float, num_tokens: int, text: str = "") -> None:
        self.chunk_times.append(when)
        self.chunk_tokens.append(num_tokens)
        self.generated_text += text

    @property
    def ttft(self) -> float:
        """Send -> first content chunk; 0 when none came."""
        return self.chunk_times[0] - self.start_time if self.chunk_times else 0.0

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive content chunks (one per chunk after the first, however
        many tokens a chunk carries)."""
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def latency(self) -> float:
        """End-to-end: send -> end of stream."""
        return self.end_time - self.start_time


@dataclass(frozen=True)
class SendOptions:
    ignore_eos: bool = True
    temperature: float = 0.0
    cache_salt: str = ""  # "" = the shared cache


class Backend(abc.ABC):
    """Sends one request and records its stream. ``send`` never raises for the server's
    or the network's faults: they come back as a failed RequestOutput."""

    name: str

    async def ready(self, timeout_s: float) -> None:  # noqa: B027 - optional hook
        """Waits until the server answers; raises TimeoutError after ``timeout_s``."""

    @abc.abstractmethod
    async def send(
        self, request: SampleRequest, request_id: str, options: SendOptions
    ) -> RequestOutput: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass
