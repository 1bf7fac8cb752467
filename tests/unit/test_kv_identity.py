"""The weight format is part of the KV cache's identity (common/models/quant/formats.py):
KV computed under one format is never reused, pulled or indexed as another's.

- identities of the formats, and the block hashes' extra keys that carry them (encoded by
  hand here, as tests/unit/test_hashing.py does for the float scheme);
- engines: an int4 engine's blocks never hit a float engine's, for the same prompt, salt and
  hash seed;
- the registry carries the identity (``WorkerInfo.weights``) through Redis;
- the gateway routes and hashes a request within one format;
- a decode worker refuses a ``KvHandle`` of another format (FAILED_PRECONDITION) and takes
  one of its own (real workers over gRPC, a tiny llama).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cbor2
import grpc
import pytest
from prometheus_client import CollectorRegistry

from common.contract.sampling import SamplingParams
from common.engine.config import EngineConfig
from common.index.registry import WorkerInfo, WorkerRegistry
from common.kv.hashing import extra_keys_for, hash_block, hash_prompt_blocks, root_hash
from common.models.quant.formats import WeightFormat, resolve_weight_format
from common.rpc.errors import reason_of
from services.gateway.routing import LOCAL_PREFILL_SHORT, NO_PREFILL_WORKER, Router
from tests.factories import make_tiny_checkpoint, run_to_completion, tiny_engine

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = list(range(3, 56))  # 53 tokens: 3 full blocks of 16 and a partial one
INT4 = "int4-g32/a16"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # intermediate 128: every input width a multiple of the int4 group
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("kvid") / "llama", "llama", intermediate_size=128
    )


# -- identities and hashes --------------------------------------------------------------------


def test_identity_of_each_format() -> None:
    assert WeightFormat("none").identity is None
    assert WeightFormat("int8", kernel="cpp").identity == "int8/a16"
    assert WeightFormat("int4", group_size=64, kernel="cpp").identity == "int4-g64/a16"
    assert WeightFormat("int4", group_size=32, kernel="cpp", act_bits=8).identity == "int4-g32/a8"
    # torch's kernels take bfloat16 activations, whatever act_bits says.
    assert WeightFormat("int4", group_size=32, kernel="torch", act_bits=8).identity == (
        "int4-g32/bf16"
    )
    gguf = WeightFormat("gguf", file_type="MOSTLY_Q4_1", kernel="cpp")
    assert gguf.identity == "gguf-MOSTLY_Q4_1/a16"
    assert WeightFormat("gguf", kernel="cpp").identity == "gguf-unknown/a16"


def test_resolved_formats(ckpt: Path, tmp_path: Path) -> None:
    assert resolve_weight_format("auto", 32, "cpp", ckpt).identity is None  # no GGUF: float
    assert resolve_weight_format("int4", 32, "cpp", ckpt).identity == INT4
    assert resolve_weight_format("int8", 64, "torch", ckpt).identity == "int8/bf16"
    with pytest.raises(ValueError, match=r"needs a \.gguf file"):
        resolve_weight_format("gguf", 32, "cpp", ckpt)
    # A GGUF's identity names its file type (general.file_type 3 = MOSTLY_Q4_1).
    from gguf import GGUFWriter

    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_file_type(3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert resolve_weight_format("auto", 32, "cpp", path).identity == "gguf-MOSTLY_Q4_1/a16"
    assert resolve_weight_format("none", 32, "cpp", path).identity is None


def _lower64(payload: object) -> int:
    return int.from_bytes(hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()[24:], "big")


def test_extra_keys_carry_salt_and_weights() -> None:
    assert extra_keys_for(None, None) is None  # vLLM's unsalted float scheme
    assert extra_keys_for("t", None) == ["t"]
    assert extra_keys_for(None, INT4) == ["", f"weights:{INT4}"]
    assert extra_keys_for("t", INT4) == ["t", f"weights:{INT4}"]
    parent = root_hash("")
    # [uint64 parent, [1, 2, 3, 4], ["", "weights:int8/a16"]], hand-encoded canonical CBOR.
    encoded = (
        b"\x83\x1b" + struct.pack(">Q", parent) + b"\x84\x01\x02\x03\x04"
        + b"\x82\x60" + b"\x70weights:int8/a16"
    )  # fmt: skip
    assert hash_block(parent, [1, 2, 3, 4], extra_keys_for(None, "int8/a16")) == int.from_bytes(
        hashlib.sha256(encoded).digest()[24:], "big"
    )


def test_every_format_hashes_every_block_differently() -> None:
    identities = [None, "int8/a16", INT4, "int4-g64/a16", "int4-g32/a8", "int4-g32/bf16",
                  "gguf-MOSTLY_Q4_1/a16"]  # fmt: skip
    for salt in (None, "tenant-a"):
        chains = [hash_prompt_blocks(PROMPT, 16, salt, seed="s", weights=w) for w in identities]
        assert all(len(chain) == 3 for chain in chains)
        every = [h for chain in chains for h in chain]
        assert len(set(every)) == len(every), f"salt {salt!r}: two formats share a block hash"
    # Float weights keep the scheme's hashes (indexes of float workers stay valid).
    assert hash_prompt_blocks(list(range(32)), 16, weights=None) == [
        11338012631650408282, 3427227388231036566,
    ]  # fmt: skip
    first = hash_prompt_blocks(PROMPT, 16, None, seed="s", weights=INT4)[0]
    assert first == _lower64([root_hash("s"), PROMPT[:16], ["", f"weights:{INT4}"]])


# -- engines ----------------------------------------------------------------------------------


def test_int4_engine_never_hits_the_float_engines_blocks(ckpt: Path) -> None:
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    engines = {
        "float": tiny_engine(ckpt, hash_seed="seed-1"),
        "int4": tiny_engine(ckpt, hash_seed="seed-1", quantization="int4"),
    }
    assert engines["float"].weight_identity is None
    assert engines["int4"].weight_identity == INT4
    exported = {}
    for name, engine in engines.items():
        engine.add_request("r", PROMPT, greedy, cache_salt="tenant", prefill_only=True)
        while "r" not in engine.held:
            engine.step()
        exported[name] = engine.export_kv("r").block_hashes
        assert engine.release("r")
    assert exported["float"] == hash_prompt_blocks(PROMPT, 16, "tenant", seed="seed-1")
    assert exported["int4"] == hash_prompt_blocks(PROMPT, 16, "tenant", seed="seed-1", weights=INT4)
    assert not set(exported["float"]) & set(exported["int4"])
    for name, engine in engines.items():
        other = exported["int4" if name == "float" else "float"]
        pool = engine.kv.pool
        # Its own prompt is cached (3 full blocks), the other format's hashes of it are not.
        assert len(pool.longest_cached_prefix(exported[name])) == 3
        assert pool.longest_cached_prefix(other) == []
        assert engine.num_cached_prefix_tokens(PROMPT, "tenant") == 48
        # A request of the same prompt hits only the engine's own blocks.
        before = engine.kv.prefix_hit_tokens
        run_to_completion(engine, {"again": PROMPT}, greedy, cache_salt="tenant")
        assert engine.kv.prefix_hit_tokens - before == 48


# -- the registry -----------------------------------------------------------------------------


def test_worker_info_weights_round_trip() -> None:
    info = WorkerInfo("d0", "decode", "127.0.0.1:1", "m", weights=INT4)
    raw = info.to_redis()
    assert raw["weights"] == INT4
    assert WorkerInfo.from_redis(raw) == info
    as_bytes = {k.encode(): v.encode() for k, v in raw.items()}  # what redis-py returns
    assert WorkerInfo.from_redis(as_bytes).weights == INT4
    # An entry without the field (a worker from before it existed) reads as float weights.
    del raw["weights"]
    assert WorkerInfo.from_redis(raw).weights == ""


@pytest.mark.redis
def test_registry_keeps_each_workers_weights(tmp_path: Path) -> None:
    import redis.asyncio as aioredis

    from tests.redis_server import redis_server

    async def body(url: str) -> None:
        client = aioredis.from_url(url)
        try:
            registry = WorkerRegistry(client, ttl_s=30)
            await registry.heartbeat(WorkerInfo("d-float", "decode", "a:1", "m"))
            await registry.heartbeat(WorkerInfo("d-int4", "decode", "a:2", "m", weights=INT4))
            listed = {w.worker_id: w.weights for w in await registry.list("decode")}
            assert listed == {"d-float": "", "d-int4": INT4}
        finally:
            await client.aclose()

    with redis_server(tmp_path) as url:
        asyncio.run(body(url))


# -- the gateway ------------------------------------------------------------------------------


def _worker(worker_id: str, role: str, weights: str, running: int = 0) -> WorkerInfo:
    return WorkerInfo(worker_id, role, f"{worker_id}:1", "m", 100, 100, running, weights=weights)


def test_router_picks_the_least_loaded_decode_workers_format() -> None:
    router = Router(block_size=16, local_prefill_tokens=16, overlap_weight=1.0)
    assert router.weight_format("r", []) == ""
    one = [_worker("d0", "decode", INT4), _worker("d1", "decode", INT4, running=3)]
    assert router.weight_format("r", one) == INT4
    mixed = [_worker("d-float", "decode", "", running=5), _worker("d-int4", "decode", INT4)]
    assert router.weight_format("r", mixed) == INT4
    mixed[0].num_running, mixed[1].num_running = 0, 5
    assert router.weight_format("r", mixed) == ""


class _Registry:
    def __init__(self, workers: list[WorkerInfo]) -> None:
        self.workers = workers

    async def list(self, role: str | None = None) -> list[WorkerInfo]:
        return [w for w in self.workers if role is None or w.role == role]


class _Index:
    """Says every prefill worker named in ``holders`` holds the whole prompt."""

    def __init__(self, holders: list[str]) -> None:
        self.holders = holders
        self.lookups: list[list[int]] = []

    async def lookup(self, block_hashes: list[int]) -> list[dict[str, str]]:
        self.lookups.append(list(block_hashes))
        return [{h: "cpu" for h in self.holders} for _ in block_hashes]


def _route_with(
    smollm_dir: Path, workers: list[WorkerInfo], holders: list[str], prompt: list[int]
) -> tuple[Any, list[list[int]]]:
    """The gateway servicer's own routing step (_route) over these workers."""
    from common.contract.model_spec import load_spec
    from common.text.tokenizer import Tokenizer
    from services.gateway.config import GatewayConfig
    from services.gateway.directory import WorkerDirectory
    from services.gateway.health import IndexHealth
    from services.gateway.metrics import GatewayMetrics
    from services.gateway.servicer import GatewayServicer

    async def main() -> tuple[Any, list[list[int]]]:
        config = GatewayConfig(model=str(smollm_dir), redis_url="redis://unused")
        metrics = GatewayMetrics(CollectorRegistry(), config.served_model_name)
        for w in workers:
            w.model = config.served_model_name
        index = _Index(holders)
        directory = WorkerDirectory(_Registry(workers), 0.0, IndexHealth(metrics))  # type: ignore[arg-type]
        gateway = GatewayServicer(
            config, Tokenizer(str(smollm_dir)), load_spec(str(smollm_dir)), directory,
            index, "gateway-test", "", metrics,  # type: ignore[arg-type]
        )  # fmt: skip
        try:
            route, _ = await gateway._route("req-1", prompt, None)
        finally:
            await gateway.close()
        return route, index.lookups

    return asyncio.run(main())


def test_gateway_routes_and_hashes_within_one_format(smollm_dir: Path) -> None:
    prompt = list(range(1000, 1100))  # 100 tokens: prefilled remotely
    workers = [
        _worker("p-float", "prefill", ""),
        _worker("p-int4", "prefill", INT4),
        _worker("d-float", "decode", "", running=4),
        _worker("d-int4", "decode", INT4),
    ]
    # The index says the float prefill worker holds the prompt; the least loaded decode
    # worker serves int4, so the request is int4's: the int4 prefill worker, int4 hashes.
    route, lookups = _route_with(smollm_dir, workers, ["p-float"], prompt)
    assert route.decode.worker_id == "d-int4"
    assert route.prefill is not None and route.prefill.worker_id == "p-int4"
    assert route.overlap_blocks == 0  # p-float's blocks are not this format's
    assert lookups == [hash_prompt_blocks(prompt, 16, None, weights=INT4)]
    # Load reversed: the float decode worker, the float prefill worker and its prefix.
    workers[2].num_running, workers[3].num_running = 0, 4
    route, lookups = _route_with(smollm_dir, workers, ["p-float"], prompt)
    assert route.decode.worker_id == "d-float"
    assert route.prefill is not None and route.prefill.worker_id == "p-float"
    assert route.overlap_blocks == 6
    assert lookups == [hash_prompt_blocks(prompt, 16, None)]


def test_gateway_never_prefills_on_another_format(smollm_dir: Path) -> None:
    """int4's decode worker and only a float prefill worker: the decode worker prefills
    itself rather than import float KV."""
    workers = [_worker("p-float", "prefill", ""), _worker("d-int4", "decode", INT4)]
    route, _ = _route_with(smollm_dir, workers, [], list(range(1000, 1100)))
    assert route.decode.worker_id == "d-int4" and route.prefill is None
    assert route.reason == NO_PREFILL_WORKER
    short, _ = _route_with(smollm_dir, workers, [], [5, 6, 7])
    assert short.prefill is None and short.reason in (NO_PREFILL_WORKER, LOCAL_PREFILL_SHORT)


# -- the decode worker ------------------------------------------------------------------------


def _worker_config(ckpt: Path, role: str, quantization: str) -> Any:
    from services.worker.config import WorkerConfig

    engine = EngineConfig(
        model=str(ckpt), num_kv_blocks=64, block_size=16, device="cpu", dtype="float32",
        quantization=quantization, num_threads=1,
    )  # fmt: skip
    return WorkerConfig(role=role, engine=engine, port=0)


def test_decode_worker_refuses_a_handle_of_another_format(ckpt: Path) -> None:
    """A float prefill worker's handle sent to an int4 decode worker: FAILED_PRECONDITION,
    naming both formats; an int4 prefill worker's handle: pulled and decoded."""
    from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
    from pdserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc
    from services.worker.serve import start_worker
    from services.worker.server import add_servicers

    def sampled(message: Any) -> Any:
        message.sampling.max_tokens = 5
        message.sampling.temperature = 0.0
        message.sampling.ignore_eos = True
        return message

    async def body() -> None:
        cleanup: list[Callable[[], Any]] = []
        try:
            started = {}
            for name, role, quantization in [
                ("prefill-float", "prefill", "none"),
                ("prefill-int4", "prefill", "int4"),
                ("decode-int4", "decode", "int4"),
            ]:
                config = _worker_config(ckpt, role, quantization)
                server, runtime = await start_worker(config, add_servicers)
                cleanup += [runtime.stop, functools.partial(server.stop, 0)]
                started[name] = runtime
            decoder = started["decode-int4"]
            assert decoder.engine.weight_identity == INT4
            channel = grpc.aio.insecure_channel(decoder.address)
            cleanup.append(channel.close)
            decode = decode_pb2_grpc.DecodeServiceStub(channel)

            async def prefill(name: str) -> Any:
                async with grpc.aio.insecure_channel(started[name].address) as ch:
                    request = sampled(prefill_pb2.PrefillRequest(
                        request_id=f"r-{name}", prompt_token_ids=PROMPT, lease_id=f"l-{name}"
                    ))  # fmt: skip
                    return await prefill_pb2_grpc.PrefillServiceStub(ch).Prefill(
                        request, timeout=30
                    )

            imported: list[int] = []

            async def decode_with(handle: Any, first: int, request_id: str) -> list[int]:
                request = sampled(decode_pb2.DecodeRequest(
                    request_id=request_id, prompt_token_ids=PROMPT, kv_handle=handle,
                    generated_token_ids=[first],
                ))  # fmt: skip
                tokens: list[int] = []
                async for message in decode.Decode(request, timeout=30):
                    tokens += list(message.token_ids)
                    if message.finish_reason:
                        imported.append(message.imported_tokens)
                return tokens

            from_float = await prefill("prefill-float")
            assert from_float.kv_handle.weight_format == ""
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await decode_with(from_float.kv_handle, from_float.first_token_id, "r-1")
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert reason_of(caught.value) == "FAILED_PRECONDITION"
            details = caught.value.details() or ""
            assert "'float'" in details and f"'{INT4}'" in details

            from_int4 = await prefill("prefill-int4")
            handle = from_int4.kv_handle
            assert handle.weight_format == INT4
            assert list(handle.block_hashes) == hash_prompt_blocks(PROMPT, 16, None, weights=INT4)
            tokens = await decode_with(handle, from_int4.first_token_id, "r-2")
            assert len(tokens) == 4  # the first token came from the prefill
            assert imported == [len(PROMPT)]  # the prompt's KV was pulled, not recomputed
            # What the int4 decode worker generates alone, prompt prefilled locally.
            local = sampled(decode_pb2.DecodeRequest(
                request_id="r-3", prompt_token_ids=PROMPT, local_prefill=True,
                cache_salt="elsewhere",  # not its cached blocks: computed afresh
            ))  # fmt: skip
            alone = [t async for m in decode.Decode(local, timeout=30) for t in m.token_ids]
            assert [from_int4.first_token_id, *tokens] == alone
        finally:
            for close in reversed(cleanup):
                await close()

    asyncio.run(asyncio.wait_for(body(), timeout=120))
