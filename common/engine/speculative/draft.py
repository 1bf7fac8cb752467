"""``method: draft_model``: a smaller (or quantized) model on the decode worker guesses each
decoding request's next tokens, greedily, k at a time.

Where the draft's KV comes from: the decode worker builds it itself from the request's
tokens, on the request's first round (a prefill of the prompt by the draft), and keeps it
across rounds: each round first computes the tokens verified since the last one (the last
round's kept guesses and the target's own token), then decodes its k guesses. Rejected
guesses are rolled back by moving the draft's computed length back to the tokens both
agree on; their slots are rewritten later. Shipping the draft's prompt KV from the prefill
worker instead would need the draft loaded there too and a second KV transfer per request;
for a draft several times cheaper than the target its prompt prefill costs that fraction of
the target's (measured in loadtest/bench_spec.py), paid once per request, so it is built here.

A migrated or preempted request simply builds it again from its tokens. A draft that runs
out of KV blocks guesses nothing for that request this round (and frees what it held).

Self-speculation: the draft may be the target's own checkpoint in another weight format
(``"model"`` = the target's path, ``"quantization": "gguf"`` under a float32 target), so
float32 output is served at the cost of mostly quantized steps; the target verifies in its
own format, so the output is float32's exactly.
"""

from __future__ import annotations

import dataclasses
import logging

from common.contract.model_spec import load_spec
from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.engine.kv_manager import KVCacheManager
from common.engine.model_runner import ModelRunner
from common.engine.request import Request
from common.engine.scheduler import ScheduledRequest
from common.engine.speculative.config import SpeculativeConfig, SpeculativeConfigError

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class DraftModelProposer:
    def __init__(
        self, config: SpeculativeConfig, target: EngineConfig, target_vocab_size: int
    ) -> None:
        assert config.method == "draft_model" and config.model, config
        draft_config = dataclasses.replace(
            target,
            model=config.model,
            quantization=config.quantization or target.quantization,
            speculative_config=None,
            enable_prefix_caching=False,
        )
        spec = load_spec(draft_config.model)
        if spec.vocab_size != target_vocab_size:
            raise SpeculativeConfigError(
                f"the draft model's vocabulary ({spec.vocab_size} tokens) is not the target's "
                f"({target_vocab_size}): a draft must share the target's tokenizer"
            )
        self.runner = ModelRunner(draft_config, spec)
        self.vocab_size = spec.vocab_size
        self.kv = KVCacheManager(self.runner.num_blocks, draft_config.block_size, False)
        self.max_model_len = min(spec.max_position_embeddings,
                                 self.runner.num_blocks * draft_config.block_size)  # fmt: skip
        # Target request id -> the draft's own sequence: its tokens (verified ones, then the
        # last round's guesses) and how many of them its KV holds.
        self.sequences: dict[str, Request] = {}
        self.num_forward_tokens = 0
        # The last round built some sequence's KV from its prompt: its time says nothing
        # about what guesses cost (the engine leaves such a step out of its step costs).
        self.cold = False
        log.info("draft model %s (%s) guesses up to %d tokens", config.model,
                 self.runner.weight_format.describe(), config.num_speculative_tokens)  # fmt: skip

    def propose_batch(self, asks: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Greedy guesses of the draft for each (request, at most this many), batched:
        one step computes every sequence's new verified tokens and its first guess, then
        one step per further guess."""
        wanted: dict[str, int] = {}
        self.cold = False
        for req, limit in asks:
            if limit > 0 and req.num_tokens + limit < self.max_model_len:
                seq = self._sync(req)
                if seq is not None:
                    wanted[req.request_id] = limit
        guesses: dict[str, list[int]] = {rid: [] for rid in wanted}
        while wanted:
            items = []
            for rid in list(wanted):
                seq = self.sequences[rid]
                num_new = seq.num_tokens - seq.num_computed_tokens
                if not self.kv.allocate_slots(seq, num_new):
                    self.forget(rid)  # out of draft blocks: no guesses this round
                    del wanted[rid]
                    guesses.pop(rid)
                    continue
                items.append(ScheduledRequest(seq, num_new))
            if not items:
                break
            tables = {s.request.request_id: self.kv.block_ids(s.request) for s in items}
            step = self.runner.execute(items, tables)
            self.num_forward_tokens += sum(s.num_new_tokens for s in items)
            tokens = step.logits[:, : self.vocab_size].argmax(dim=-1).tolist()
            for item, token in zip(step.sampling, tokens, strict=True):
                seq = item.request
                seq.num_computed_tokens += item.num_new_tokens
                seq.token_ids.append(token)
                guesses[seq.request_id].append(token)
                if len(guesses[seq.request_id]) == wanted[seq.request_id]:
                    del wanted[seq.request_id]
        return guesses

    def _sync(self, req: Request) -> Request | None:
        """The draft's sequence of ``req``, its tokens made the verified ones: the guesses
        of the last round that were not kept are dropped, its KV kept up to where it and
        the verified tokens agree."""
        seq = self.sequences.get(req.request_id)
        if seq is None:
            seq = Request(req.request_id, list(req.token_ids), _GREEDY)
            self.sequences[req.request_id] = seq
            self.cold = True
            return seq
        verified = req.token_ids
        same = 0
        limit = min(len(seq.token_ids), len(verified))
        while same < limit and seq.token_ids[same] == verified[same]:
            same += 1
        seq.token_ids[same:] = verified[same:]
        # A token's KV is valid while every token up to it agrees; the last token is
        # always computed again (its row yields the first guess).
        seq.num_computed_tokens = min(seq.num_computed_tokens, same, len(verified) - 1)
        self.kv.trim(seq)
        return seq

    def forget(self, request_id: str) -> None:
        """The target request ended (or moved): the draft's KV for it is freed."""
        if self.sequences.pop(request_id, None) is not None:
            self.kv.free(request_id)
