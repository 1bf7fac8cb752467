"""Every Redis key pdserve uses, built here and nowhere else. All begin ``pdserve:v1:``.

| key | type | content | lifetime |
|---|---|---|---|
| ``pdserve:v1:{model}:block:{hash}`` | hash | location (worker id or ``store``) -> tier | TTL, refreshed on store |
| ``pdserve:v1:workers`` | set | worker ids ever registered (stale ones pruned on read) | permanent index |
| ``pdserve:v1:worker:{id}`` | hash | role, address, model, load figures | TTL, refreshed by heartbeat |
| ``pdserve:v1:expert_models`` | sorted set | models with expert load -> last publish (unix ms) | TTL, refreshed on publish |
| ``pdserve:v1:{model}:expert_load:workers`` | sorted set | worker id -> last publish (unix ms) | TTL, refreshed on publish; stale members pruned on read |
| ``pdserve:v1:{model}:expert_load:{worker}:meta`` | hash | layers, num_experts, window_ms, windows, updated_ms | TTL, refreshed on publish |
| ``pdserve:v1:{model}:expert_load:{worker}:{layer}:w:{bucket}`` | hash | ``p{e}`` / ``d{e}`` -> tokens routed to expert e in prefill / decode during window ``bucket`` (= unix ms // window_ms) | expires ``windows`` windows after its own ends |
| ``pdserve:v1:{model}:expert_load:{worker}:{layer}:total`` | hash | the same fields since the worker started | TTL, refreshed on publish |
| ``pdserve:v1:{model}:profile:{slug}`` | string | a measured ``WorkerProfile`` as JSON; ``slug`` = ``ProfileKey.slug()`` (model, weight format, threads, device) | TTL (30 days), renewed on put |
| ``pdserve:v1:{model}:profiles`` | set | the slugs of the model's profiles (expired ones pruned on read) | TTL (30 days), renewed on put |
| ``pdserve:v1:{model}:profile_lock:{slug}`` | string | the worker id measuring this profile now (the others wait for it) | TTL (the measurement's bound) |
| ``pdserve:v1:{model}:resume:{id}`` | hash | a streamed request's record for resuming it on any gateway: ``request`` (what it asked, as sent to the workers), ``final`` (its last message, once finished) | TTL (the gateway's ``--resume-ttl-s``), renewed on each write |
| ``pdserve:v1:{model}:resume:{id}:tokens`` | string | the tokens it has sent, uint32 little-endian, appended as they go | as its record |

Expert load is per model, worker and decoder layer; the reader (``pdserve experts``) adds
workers up. Memory is bounded: per worker and MoE layer at most ``windows + 1`` live window
hashes and one total, each at most 2 x experts fields.
"""

from __future__ import annotations

PREFIX = "pdserve:v1:"
STORE_LOCATION = "store"  # the block store's entry in a block's location hash


def _model(model: str) -> str:
    if not model or any(c in model for c in " \n:{}"):
        raise ValueError(f"model name {model!r} cannot be part of a Redis key")
    return model


def _worker(worker_id: str) -> str:
    if not worker_id or any(c in worker_id for c in " \n:{}"):
        raise ValueError(f"worker id {worker_id!r} cannot be part of an expert-load key")
    return worker_id


def _slug(slug: str) -> str:
    if not slug or any(c in slug for c in " \n:{}"):
        raise ValueError(f"profile slug {slug!r} cannot be part of a Redis key")
    return slug


def block(model: str, block_hash: int) -> str:
    return f"{PREFIX}{_model(model)}:block:{block_hash:016x}"


def workers() -> str:
    return f"{PREFIX}workers"


def worker(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}"


def expert_models() -> str:
    return f"{PREFIX}expert_models"


def expert_workers(model: str) -> str:
    return f"{PREFIX}{_model(model)}:expert_load:workers"


def expert_meta(model: str, worker_id: str) -> str:
    return f"{PREFIX}{_model(model)}:expert_load:{_worker(worker_id)}:meta"


def expert_window(model: str, worker_id: str, layer: int, bucket: int) -> str:
    return f"{PREFIX}{_model(model)}:expert_load:{_worker(worker_id)}:{layer}:w:{bucket}"


def expert_total(model: str, worker_id: str, layer: int) -> str:
    return f"{PREFIX}{_model(model)}:expert_load:{_worker(worker_id)}:{layer}:total"


def profile(model: str, slug: str) -> str:
    return f"{PREFIX}{_model(model)}:profile:{_slug(slug)}"


def profiles(model: str) -> str:
    return f"{PREFIX}{_model(model)}:profiles"


def profile_lock(model: str, slug: str) -> str:
    return f"{PREFIX}{_model(model)}:profile_lock:{_slug(slug)}"


def _resume_id(resume_id: str) -> str:
    if not resume_id or not all(c in "0123456789abcdef" for c in resume_id):
        raise ValueError(f"resume id {resume_id!r} is not one a gateway made")
    return resume_id


def resume(model: str, resume_id: str) -> str:
    return f"{PREFIX}{_model(model)}:resume:{_resume_id(resume_id)}"


def resume_tokens(model: str, resume_id: str) -> str:
    return f"{resume(model, resume_id)}:tokens"


def expert_field(phase: int, expert: int) -> str:
    """A field of the window and total hashes: ``p{e}`` prefill, ``d{e}`` decode."""
    return f"{'pd'[phase]}{expert}"


def parse_expert_field(field: str) -> tuple[int, int] | None:
    """(phase, expert) of a field ``expert_field`` built; None for anything else."""
    if len(field) < 2 or field[0] not in "pd" or not field[1:].isdigit():
        return None
    return "pd".index(field[0]), int(field[1:])
