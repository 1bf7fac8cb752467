"""Which path each row of a step takes over quantized weights (common/engine/model_runner.py,
common/models/quant/linear.py): dense (dequantize + float GEMM) for prompt tokens of long
prompts, the packed C++ kernel for everything else, decided by the token, never by the
step's size. The packed kernel computes every row alone, so in a llama a generated token's
logits are the same bits whether it decodes alone, beside a long prefill, or beside other
decodes. An MoE's router is a float GEMM, whose rounding depends on the row count (MKL takes
a GEMV for one row: 1.2e-7 apart on a tiny router); the int16 activation codes after it can
round that 1 ulp to a code apart, so there the logits stay close (measured 3.5e-4 of about
3) and the tokens equal.

Those rules are for weights in the rows layout, which these tests pin. A CPU with the x16
kernels (AVX-512) gives its weights one path for every row count; the last test checks it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.contract.sampling import SamplingParams
from common.engine.engine import Engine
from common.models.quant import linear
from common.models.quant.linear import DENSE_MIN_ROWS
from kernels.cpu import available
from tests.factories import make_tiny_checkpoint, random_prompts, tiny_engine

pytestmark = [
    pytest.mark.skipif(not available(), reason="the C++ CPU kernels do not build here"),
    pytest.mark.usefixtures("one_thread"),
]

@pytest.fixture(autouse=True)
def rows_layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test but the x16 one runs with the rows layout, where the two paths exist."""
    if "x16" not in request.node.name:
        monkeypatch.setattr(linear, "_x16_ok", False)


LONG = DENSE_MIN_ROWS + 12  # a prompt whose tokens take the dense path
SHORT = 10
STEPS = 12
GREEDY = SamplingParams(max_tokens=STEPS, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    extra: dict[str, Any] = dict(intermediate_size=128)
    if request.param == "qwen3_moe":
        extra.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("rows") / request.param, request.param,
                                **extra)  # fmt: skip


def _engine(ckpt: Path, **overrides: Any) -> Engine:
    params: dict[str, Any] = dict(quantization="int4", quant_kernel="cpp", fused_decode=False)
    params.update(overrides)
    return tiny_engine(ckpt, **params)


class _Spy:
    """Counts the rows each path computes, per call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dense: list[int] = []
        self.packed: list[int] = []
        dense, packed = linear._dense_in_chunks, linear.PackedMatmul._packed

        def counting_dense(x: torch.Tensor, w: Any) -> torch.Tensor:
            self.dense.append(x.shape[0])
            return dense(x, w)

        def counting_packed(matmul: Any, x: torch.Tensor, w: Any) -> torch.Tensor:
            self.packed.append(x.shape[0])
            return packed(matmul, x, w)

        monkeypatch.setattr(linear, "_dense_in_chunks", counting_dense)
        monkeypatch.setattr(linear.PackedMatmul, "_packed", counting_packed)

    def reset(self) -> None:
        self.dense.clear()
        self.packed.clear()


def _run(engine: Engine, watched: str, joins: dict[int, tuple[str, list[int]]]) -> tuple[
    list[int], list[torch.Tensor]
]:
    """Steps until ``watched`` finishes, adding ``joins[step]`` before that step; returns the
    watched request's tokens and the logits it sampled from, step by step."""
    logits: list[torch.Tensor] = []
    sampler = engine.sampler

    def recording(batch: torch.Tensor, requests: list) -> Any:
        for row, req in zip(batch, requests, strict=True):
            if req.request_id == watched:
                logits.append(row.clone())
        return sampler(batch, requests)

    engine.sampler = recording  # type: ignore[assignment]
    tokens: list[int] = []
    step, done = 0, False
    while not done:
        if step in joins:
            rid, prompt = joins[step]
            engine.add_request(rid, prompt, GREEDY)
        for out in engine.step():
            if out.request_id == watched:
                tokens += out.new_token_ids
                done = out.finished
        step += 1
    engine.sampler = sampler
    while engine.has_unfinished():
        engine.step()
    return tokens, logits


def _assert_alike(
    ckpt: Path, alone_tokens: list[int], alone: list[torch.Tensor], mixed_tokens: list[int],
    mixed: list[torch.Tensor],
) -> None:  # fmt: skip
    """The same tokens; a llama's logits the same bits, an MoE's close (module docstring)."""
    assert mixed_tokens == alone_tokens
    for step, (a, b) in enumerate(zip(alone, mixed, strict=True)):
        if ckpt.name == "llama":
            assert torch.equal(a, b), (step, (a - b).abs().max().item())
        else:
            assert (a - b).abs().max() <= 1e-2 * a.abs().max(), step


def test_a_decode_row_computes_alike_alone_and_beside_a_long_prefill(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    short, long = random_prompts(384, [SHORT, LONG], seed=3)
    spy = _Spy(monkeypatch)
    alone_tokens, alone = _run(_engine(ckpt), "r", {0: ("r", short)})
    assert not spy.dense  # a short prompt and its decode steps: packed throughout
    spy.reset()
    # The long prompt joins at step 3: that step holds r's decode row and LONG prompt rows.
    mixed_tokens, mixed = _run(_engine(ckpt), "r", {0: ("r", short), 3: ("long", long)})
    assert LONG in spy.dense  # the long prompt's rows went dense ...
    assert 1 in spy.packed  # ... and r's row beside them packed, in the same step
    _assert_alike(ckpt, alone_tokens, alone, mixed_tokens, mixed)


def test_generated_tokens_recomputed_after_a_migration_take_the_packed_path(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (long,) = random_prompts(384, [LONG], seed=4)
    undisturbed, _ = _run(_engine(ckpt), "r", {0: ("r", long)})
    # A request resumed elsewhere after 7 tokens, with no KV: the prompt and the 7 tokens
    # are recomputed in one chunk; the rest must continue as the undisturbed run did.
    spy = _Spy(monkeypatch)
    engine = _engine(ckpt)
    engine.add_request("r", long, GREEDY, output_token_ids=undisturbed[:7])
    resumed: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            resumed += out.new_token_ids
    assert LONG in spy.dense and LONG + 7 not in spy.dense  # the prompt dense, not the 7
    assert undisturbed[:7] + resumed == undisturbed


def test_chunks_too_small_for_the_dense_path_keep_every_row_packed(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (long,) = random_prompts(384, [LONG], seed=5)
    spy = _Spy(monkeypatch)
    _run(_engine(ckpt, max_num_batched_tokens=32), "r", {0: ("r", long)})
    assert not spy.dense and max(spy.packed) <= 32


def test_outside_a_step_the_row_count_decides() -> None:
    from common.models.quant.linear import PackedMatmul, QuantCompute
    from common.models.quant.weights import Q4Weight

    w = Q4Weight.quantize(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)), 32)
    matmul = PackedMatmul(w, QuantCompute("cpp"))
    x = torch.randn(DENSE_MIN_ROWS, 64, generator=torch.Generator().manual_seed(1))
    big = matmul(x)
    small = matmul(x[:5])
    assert torch.allclose(big[:5], small, rtol=0, atol=1e-3 * big.abs().max().item())
    assert not torch.equal(big[:5], small)  # two paths, two roundings
    with linear.dense_rows(torch.zeros(DENSE_MIN_ROWS, dtype=torch.bool)):
        assert torch.equal(matmul(x)[:5], small)  # marked packed: the 5-row bits


@pytest.mark.skipif(not available() or not linear.x16_available(),
                    reason="no x16 kernels (AVX-512 BW / VL / VNNI) here")  # fmt: skip
def test_x16_weights_take_the_packed_kernel_for_every_row(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    short, long = random_prompts(384, [SHORT, LONG], seed=3)
    spy = _Spy(monkeypatch)
    alone_tokens, alone = _run(_engine(ckpt), "r", {0: ("r", short)})
    mixed_tokens, mixed = _run(_engine(ckpt), "r", {0: ("r", short), 3: ("long", long)})
    assert not spy.dense and LONG + 1 in spy.packed  # r's row and the long prompt's, packed
    _assert_alike(ckpt, alone_tokens, alone, mixed_tokens, mixed)
