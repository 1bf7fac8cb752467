"""Engine values <-> protobuf messages, for the worker servicers."""

from __future__ import annotations

from common.engine.request import FinishReason, TokenLogprob
from pdserve.common.v1 import common_pb2

FINISH_PB = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


def finish_reason_pb(reason: FinishReason | None) -> common_pb2.FinishReason:
    if reason is None or reason is FinishReason.PREFILLED:
        return common_pb2.FINISH_REASON_UNSPECIFIED
    return FINISH_PB[reason]


def logprob_pb(entry: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=entry.token_id,
        logprob=entry.logprob,
        top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in entry.top],
    )
