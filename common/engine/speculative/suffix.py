"""SuffixDecoding (``"method": "suffix"``): guesses from suffix trees, no draft model.

Two trees answer for each request, both Arctic Inference's suffix tree (its C++ module,
built by scripts/setup.sh from the sdist; ``SuffixDecodingCache`` holds them):

- the request's own, over its prompt and its verified output so far;
- its tenant's global tree, over the responses of the requests this worker served (and
  serves) for the same tenant.

Each step the context's longest suffix found in either tree picks the continuation; the
guesses are the path that follows, taken while each token's observed frequency after the
match stays at or above ``suffix_decoding_min_token_prob``, and at most
``suffix_decoding_max_spec_factor`` x the match's length (a long match earns long guesses)
and the number the policy asks for. Only verified tokens enter either tree, so a rejected
guess leaves nothing to roll back.

Tenants. A tenant is a cache salt (the gateway makes each API key's tenant a salt of its
own, services/gateway/auth.py), and each has its own global tree: a guess never holds a
token that only another tenant's responses hold, so speed cannot tell one tenant what
another generated.

Bounds. The global trees together keep at most ``suffix_decoding_max_cached_requests``
responses and ``MAX_CACHED_TOKENS`` of their tokens; past either, the oldest response of the
least recently used tenant is evicted first. A tenant with no response left and no request
running here is dropped.

With prompt lookup. Given ``prompt_lookup_max`` / ``prompt_lookup_min`` as well, the n-gram
index of ``method: ngram`` (ngram.py) looks the context up beside the trees, and the guesses
after the longer match win (a tie goes to the trees, whose guesses weigh how often each
continuation followed).

Across workers. A request's own tree is built on the worker where it first asks for
guesses, from its tokens: a prompt imported from a prefill worker, or the prompt and output
of a migrated or resumed stream. The global trees are per worker and start empty.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from common.engine.request import Request
from common.engine.speculative.config import SpeculativeConfig, SpeculativeConfigError
from common.engine.speculative.ngram import NgramIndex

# Tokens of cached responses kept over all tenants' global trees (about 100 bytes a token
# in the tree's nodes at depth 24: some 400 MB at the bound).
MAX_CACHED_TOKENS = 4_000_000


@dataclass
class _Tenant:
    cache: Any  # arctic_inference's SuffixDecodingCache
    # Cached responses here, oldest first: request id -> tokens in the global tree.
    cached: OrderedDict[str, int] = field(default_factory=OrderedDict)
    active: set[str] = field(default_factory=set)


@dataclass
class _Active:
    tenant: str
    fed: int  # output tokens already in the trees


class SuffixProposer:
    cold = False  # a lookup costs the same every round

    def __init__(
        self, config: SpeculativeConfig, max_cached_tokens: int = MAX_CACHED_TOKENS
    ) -> None:
        assert config.method == "suffix", config.method
        try:
            from arctic_inference.suffix_decoding import SuffixDecodingCache
        except ImportError as exc:
            raise SpeculativeConfigError(
                "speculative method suffix needs Arctic Inference's suffix tree "
                "(arctic_inference.suffix_decoding); bash scripts/setup.sh builds it"
            ) from exc
        self._cache_class = SuffixDecodingCache
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self.max_cached_tokens = max_cached_tokens
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.ngram = (
            (config.prompt_lookup_min, config.prompt_lookup_max)
            if config.suffix_with_ngram
            else None
        )
        self._tenants: OrderedDict[str, _Tenant] = OrderedDict()  # least recently used first
        self._active: dict[str, _Active] = {}
        self.cached_requests = 0
        self.cached_tokens = 0

    # -- the proposer protocol --------------------------------------------------------------

    def propose_batch(self, asks: list[tuple[Request, int]]) -> dict[str, list[int]]:
        return {req.request_id: self.propose(req, limit) for req, limit in asks}

    def propose(self, req: Request, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` guesses for the tokens after ``req.token_ids``."""
        entry = self._active.get(req.request_id)
        if entry is None:
            entry = self._start(req)
        tenant = self._tenants[entry.tenant]
        self._tenants.move_to_end(entry.tenant)
        new = req.token_ids[req.num_prompt_tokens + entry.fed :]
        if new:
            tenant.cache.add_active_response(req.request_id, new)
            entry.fed += len(new)
            if req.request_id in tenant.cached:
                tenant.cached[req.request_id] += len(new)
                self.cached_tokens += len(new)
                self._evict()
        context = req.token_ids[-self.depth :]
        draft = tenant.cache.speculate(
            req.request_id, context, max_spec_tokens=num_tokens,
            max_spec_factor=self.spec_factor, min_token_prob=self.min_token_prob,
        )  # fmt: skip
        guesses = list(draft.token_ids)[:num_tokens]
        if self.ngram is not None:
            index = req.proposer_state
            if not isinstance(index, NgramIndex):
                index = req.proposer_state = NgramIndex(*self.ngram)
            index.extend(req.token_ids[len(index) :])
            looked_up, n = index.lookup(num_tokens)
            if n > draft.match_len or not guesses:
                guesses = looked_up
        return guesses

    def forget(self, request_id: str) -> None:
        entry = self._active.pop(request_id, None)
        if entry is None:
            return
        tenant = self._tenants[entry.tenant]
        tenant.cache.stop_request(request_id)
        tenant.active.discard(request_id)
        self._drop_if_empty(entry.tenant)

    # -- trees and bounds -------------------------------------------------------------------

    def _start(self, req: Request) -> _Active:
        name = req.cache_salt or ""
        tenant = self._tenants.get(name)
        if tenant is None:
            # Eviction is ours (_evict, over all tenants): no per-tenant limit, or none
            # cached at all (max_cached_requests 0: the request's own tree only).
            per_tenant = 0 if self.max_cached_requests == 0 else -1
            tenant = self._tenants[name] = _Tenant(self._cache_class(self.depth, per_tenant))
        if req.request_id in tenant.cached:  # an id seen before: its old response goes
            self._uncache(name, req.request_id)
        prompt = req.token_ids[: req.num_prompt_tokens]
        tenant.cache.start_request(req.request_id, prompt)
        tenant.active.add(req.request_id)
        if self.max_cached_requests:
            tenant.cached[req.request_id] = 0
            self.cached_requests += 1
        entry = self._active[req.request_id] = _Active(name, 0)
        self._evict()
        return entry

    def _uncache(self, name: str, request_id: str) -> None:
        tenant = self._tenants[name]
        self.cached_tokens -= tenant.cached.pop(request_id)
        self.cached_requests -= 1
        tenant.cache.evict_cached_response(request_id)

    def _evict(self) -> None:
        """Oldest responses of the least recently used tenants first, until both bounds
        hold."""
        while (
            self.cached_requests > self.max_cached_requests
            or self.cached_tokens > self.max_cached_tokens
        ):
            name = next(n for n, t in self._tenants.items() if t.cached)
            oldest = next(iter(self._tenants[name].cached))
            self._uncache(name, oldest)
            self._drop_if_empty(name)

    def _drop_if_empty(self, name: str) -> None:
        tenant = self._tenants[name]
        if not tenant.cached and not tenant.active:
            del self._tenants[name]

    def stats(self) -> dict[str, int]:
        return {"tenants": len(self._tenants), "active_requests": len(self._active),
                "cached_responses": self.cached_requests,
                "cached_tokens": self.cached_tokens}  # fmt: skip
