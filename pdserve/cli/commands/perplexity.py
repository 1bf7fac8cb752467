"""``pdserve perplexity FILE``: a weight format's quality on a text, as llama.cpp's
``llama-perplexity`` (with ``--kl-divergence`` when given ``--reference FORMAT``).

FILE is tokenized whole with the model's tokenizer (no chat template, no special tokens)
and cut into consecutive windows of ``--context`` tokens (the last one may be shorter).
Every token of a window after its first is scored from the tokens before it in the same
window; perplexity = exp(mean NLL) over all scored tokens. With ``--reference FORMAT`` a
second engine in that format scores the same windows, and the mean KL(reference || tested)
over the scored positions and the top-1 agreement (both argmaxes equal) are printed too;
``--reference-model PATH`` loads the reference from another checkpoint (a quantized file
against the float model it was made from). ``--windows llama.cpp`` scores as
``llama-perplexity -c CONTEXT`` does (whole windows, BOS first when the tokenizer adds one,
the second half of each window scored), so the two figures compare on the same file.

In process by default: each window is one request of the engine's own prefill
(``LLM.score``: full log-softmax rows), one window at a time, so memory stays at two
windows' distributions. ``--target HOST:PORT`` scores through a running gateway instead
(prompt logprobs of ``GenerateRequest``; perplexity only: KL needs the full distributions,
so ``--reference`` runs in process).

The engine flags apply to both engines. Quantized weights are multiplied two ways: prefill
chunks of 48 rows or more dequantize them for a float GEMM, smaller batches (every decode
step) take the packed C++ kernels and their activation codes (``--quant-act-bits``). A
window is one chunk by default; ``--max-num-batched-tokens 32`` scores it in chunks the
packed kernels compute, which is what generation runs on.

Shapes: T = tokens in a window, V = vocab.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.engine.eviction import STREAMING
from common.models.quant.formats import QUANTIZATIONS
from pdserve.cli.engine_args import add_engine_args, engine_config_from_args

if TYPE_CHECKING:
    import torch

    from common.engine.llm import LLM
    from common.text.tokenizer import Tokenizer

# Default window: the model's context, capped so that a window's prefill and its [T, V]
# float32 distributions stay small on a laptop (2 cores: about a second per window).
DEFAULT_CONTEXT_CAP = 512


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "perplexity",
        help="perplexity of a text (and KL divergence against a reference weight format)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", type=Path, metavar="FILE", help="UTF-8 text to score")
    parser.add_argument(
        "--reference",
        default=None,
        choices=list(QUANTIZATIONS),
        help="also score with this weight format (e.g. none) and report KL(reference || "
        "tested) and top-1 agreement; in process only",
    )
    parser.add_argument(
        "--reference-model",
        default=None,
        help="the reference engine loads this checkpoint (e.g. the float model a quantized "
        "file was made from) in --reference's format (default auto); its tokenizer must "
        "tokenize FILE as the tested model's does",
    )
    parser.add_argument(
        "--windows",
        choices=WINDOW_MODES,
        default="all",
        help="all: every window (the last may be shorter), every token after its first "
        "scored; llama.cpp: as llama-perplexity scores, full windows only, each starting "
        "with BOS when the tokenizer adds one, only the second half of each scored",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=None,
        help=f"tokens per window (default: the model's context, at most {DEFAULT_CONTEXT_CAP})",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="use only the first N tokens of FILE"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--bucket-tokens",
        type=int,
        default=1000,
        help="also report perplexity per this many tokens of FILE, by position (1000)",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="score through the gateway at HOST:PORT (prompt logprobs; perplexity only)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="with --target: sent as 'authorization: Bearer KEY' (env PDSERVE_API_KEY)",
    )
    parser.add_argument(
        "--tls-ca",
        default=os.environ.get("PDSERVE_GATEWAY_CA"),
        help="with --target: PEM CA of a gateway serving TLS (env PDSERVE_GATEWAY_CA)",
    )
    add_engine_args(parser)
    parser.set_defaults(func=run)


WINDOW_MODES = ("all", "llama.cpp")


def windows(token_ids: list[int], context: int) -> list[list[int]]:
    """Consecutive windows of ``context`` tokens; a last one shorter than 2 is dropped (it
    scores nothing)."""
    cut = [token_ids[i : i + context] for i in range(0, len(token_ids), context)]
    return [w for w in cut if len(w) >= 2]


@dataclass(frozen=True)
class Windows:
    """What is scored: ``parts[i]`` is fed to the model and its tokens from ``skip + 1`` on
    are scored; ``starts[i]`` is where it begins in the text's tokens."""

    parts: list[list[int]]
    starts: list[int]
    skip: int  # scored rows start here: row r of a window scores its token r + 1


def make_windows(token_ids: list[int], context: int, mode: str, bos: int | None) -> Windows:
    """``all``: ``windows``. ``llama.cpp``: llama-perplexity's chunks: the text tokenized
    with BOS in front when the tokenizer adds one (``bos``), cut into whole windows of
    ``context`` (a shorter rest is dropped), each window's first token replaced by BOS (when
    there is one), and only rows from ``context // 2`` on scored: ``context - 1 -
    context // 2`` tokens a window, each with at least half a window before it."""
    if mode == "all":
        parts = windows(token_ids, context)
        return Windows(parts, [i * context for i in range(len(parts))], 0)
    ids = ([bos] if bos is not None else []) + token_ids
    count = len(ids) // context
    parts = []
    for i in range(count):
        window = ids[i * context : (i + 1) * context]
        if bos is not None:
            window = [bos, *window[1:]]
        parts.append(window)
    return Windows(parts, [i * context for i in range(count)], context // 2)


@dataclass
class Scores:
    """Sums over every scored position of every window so far."""

    num_scored: int = 0
    nll: float = 0.0
    token_nll: list[float] = field(default_factory=list)  # per scored token, in order
    reference_nll: float = 0.0
    kl: float = 0.0
    kl_max: float = 0.0
    num_top1_same: int = 0

    def add(
        self,
        rows: torch.Tensor,
        window: list[int],
        reference: torch.Tensor | None,
        skip: int = 0,
    ) -> None:
        """rows, reference: [T-1, V] log-softmax, row i scoring window[i + 1]; the rows
        before ``skip`` are not scored."""
        import torch

        rows = rows[skip:]
        reference = reference[skip:] if reference is not None else None
        targets = torch.tensor(window[skip + 1 :], dtype=torch.long).unsqueeze(1)  # [S, 1]
        own = rows.gather(1, targets).squeeze(1)  # [S]
        self.num_scored += len(window) - 1 - skip
        self.nll -= float(own.sum(dtype=torch.float64))
        self.token_nll.extend((-own).tolist())
        if reference is None:
            return
        self.reference_nll -= float(reference.gather(1, targets).sum(dtype=torch.float64))
        # KL(P_ref || P_test) per position: sum_v p_ref (log p_ref - log p_test).
        kl = (reference.exp() * (reference - rows)).sum(dim=-1, dtype=torch.float64)  # [T-1]
        self.kl += float(kl.sum())
        self.kl_max = max(self.kl_max, float(kl.max()))
        self.num_top1_same += int((reference.argmax(-1) == rows.argmax(-1)).sum())

    def add_nll(self, logprobs: list[float]) -> None:
        """Prompt logprobs of the window's scored tokens (the --target path)."""
        self.num_scored += len(logprobs)
        self.nll -= math.fsum(logprobs)
        self.token_nll.extend(-lp for lp in logprobs)

    def buckets(self, positions: list[int], size: int) -> list[dict[str, Any]]:
        """Perplexity per ``size`` tokens of the text: ``positions[i]`` is where the i-th
        scored token lies in it."""
        sums: dict[int, list[float]] = {}
        for position, nll in zip(positions, self.token_nll, strict=True):
            sums.setdefault(position // size, []).append(nll)
        return [
            {"start": b * size, "num_tokens": len(v), "perplexity": math.exp(math.fsum(v) / len(v))}
            for b, v in sorted(sums.items())
        ]

    def report(self, has_reference: bool) -> dict[str, Any]:
        n = max(self.num_scored, 1)
        out: dict[str, Any] = {
            "num_scored_tokens": self.num_scored,
            "mean_nll": self.nll / n,
            "perplexity": math.exp(self.nll / n),
        }
        if has_reference:
            out.update(
                reference_mean_nll=self.reference_nll / n,
                reference_perplexity=math.exp(self.reference_nll / n),
                kl_divergence=self.kl / n,
                kl_divergence_max=self.kl_max,
                top1_agreement=self.num_top1_same / n,
            )
        return out


def run(args: argparse.Namespace) -> int:
    if args.context is not None and args.context < 2:
        raise ValueError(f"--context must be >= 2, got {args.context}")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    if args.target and args.windows != "all":
        raise ValueError("--windows llama.cpp scores in process only (without --target)")
    if args.target and (args.reference or args.reference_model):
        raise ValueError(
            "--reference needs both formats' full distributions: run it in process "
            "(without --target); through a gateway only the perplexity is measured"
        )
    from common.models.default_model import resolve_model

    model_dir = resolve_model(args.model)
    text = args.file.read_text(encoding="utf-8")
    start = time.monotonic()
    if args.target:
        import grpc

        try:
            report = _score_remote(args, model_dir, text)
        except grpc.aio.AioRpcError as exc:
            print(f"pdserve perplexity: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    else:
        report = _score_local(args, model_dir, text)
    report["seconds"] = round(time.monotonic() - start, 3)
    report["file"] = str(args.file)
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        _print_report(report)
    return 0


def _tokenize(tokenizer: Tokenizer, text: str, max_tokens: int | None) -> list[int]:
    # verbose=False: no warning that the text is longer than the model's context.
    encoded = tokenizer.hf(text, add_special_tokens=False, verbose=False)
    ids = [int(t) for t in encoded.input_ids]
    return ids[:max_tokens] if max_tokens is not None else ids


def _context(requested: int | None, max_model_len: int) -> int:
    """Tokens per window: a window and its one sampled token must fit the context."""
    limit = max_model_len - 1
    if requested is None:
        return min(DEFAULT_CONTEXT_CAP, limit)
    if requested > limit:
        raise ValueError(f"--context {requested} exceeds the model's context ({limit} tokens)")
    return requested


def _llm(
    args: argparse.Namespace,
    model_dir: str,
    tokenizer: Tokenizer,
    quantization: str | None,
    context: int,
) -> LLM:
    from common.engine.llm import LLM

    config = engine_config_from_args(args, model_dir)
    overrides: dict[str, Any] = {}
    if quantization is not None:
        overrides["quantization"] = quantization
    if args.num_kv_blocks is None and args.kv_cache_memory is None:
        # One window at a time: a pool just big enough for it and its sampled token.
        overrides["num_kv_blocks"] = -(-(context + 1) // config.block_size)
    llm = LLM(dataclasses.replace(config, **overrides), tokenizer)
    if context >= llm.engine.max_model_len:
        raise ValueError(
            f"a window of {context} tokens does not fit this engine's context "
            f"({llm.engine.max_model_len} tokens, KV pool included); lower --context"
        )
    return llm


def _score_local(args: argparse.Namespace, model_dir: str, text: str) -> dict[str, Any]:
    from common.contract.model_spec import load_spec
    from common.models.default_model import resolve_model
    from common.text.tokenizer import Tokenizer

    spec = load_spec(model_dir)
    tokenizer = Tokenizer(model_dir)
    if args.kv_eviction == STREAMING:
        return _score_stream(args, model_dir, tokenizer, text)
    max_len = min(args.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
    context = _context(args.context, max_len)
    tested = _llm(args, model_dir, tokenizer, None, context)
    token_ids = _tokenize(tokenizer, text, args.max_tokens)
    reference = None
    reference_dir = model_dir
    if args.reference_model:
        reference_dir = resolve_model(args.reference_model)
        reference_tokenizer = Tokenizer(reference_dir)
        if _tokenize(reference_tokenizer, text, args.max_tokens) != token_ids:
            raise ValueError(
                f"the tokenizer of {args.reference_model} tokenizes {args.file} differently "
                f"from that of {args.model}: their distributions cannot be compared"
            )
        reference = _llm(args, reference_dir, reference_tokenizer, args.reference or "auto", context)
    elif args.reference:
        reference = _llm(args, model_dir, tokenizer, args.reference, context)
    bos = tokenizer.hf.bos_token_id if _adds_bos(tokenizer) else None
    cut = make_windows(token_ids, context, args.windows, bos)
    parts = cut.parts
    if not parts:
        needed = context if args.windows == "llama.cpp" else 2
        raise ValueError(f"{args.file} has {len(token_ids)} tokens; at least {needed} are needed")
    scores = Scores()
    positions: list[int] = []
    for start, window in zip(cut.starts, parts, strict=True):
        positions.extend(range(start + cut.skip + 1, start + len(window)))
        rows = tested.score(window)
        ref_rows = reference.score(window) if reference is not None else None
        scores.add(rows, window, ref_rows, cut.skip)
        del rows, ref_rows
    report: dict[str, Any] = {
        "model": model_dir,
        "weights": tested.engine.runner.weight_format.describe(),
        "context": context,
        "windows": args.windows,
        "num_windows": len(parts),
        "num_tokens": len(token_ids),
    }
    if reference is not None:
        report["reference_weights"] = reference.engine.runner.weight_format.describe()
        report["reference_model"] = reference_dir
    report.update(scores.report(reference is not None))
    report["buckets"] = scores.buckets(positions, args.bucket_tokens)
    return report


def _adds_bos(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer puts BOS in front of a text (llama.cpp's ``add_bos``)."""
    hf = tokenizer.hf
    if hf.bos_token_id is None:
        return False
    return bool(hf("a").input_ids[:1] == [hf.bos_token_id])


def _score_stream(
    args: argparse.Namespace, model_dir: str, tokenizer: Tokenizer, text: str
) -> dict[str, Any]:
    """The whole text as one stream under StreamingLLM eviction: every token scored from
    the sinks and the window before it, however long the text."""
    from common.engine.llm import LLM

    if args.reference or args.reference_model or args.context or args.windows != "all":
        raise ValueError(
            "--kv-eviction streaming scores one stream: no --context, --reference, --windows"
        )
    config = engine_config_from_args(args, model_dir)
    eviction = config.eviction
    assert eviction is not None
    if args.num_kv_blocks is None and args.kv_cache_memory is None:
        # The sinks, a window, a chunk of a window and a block being filled.
        blocks = eviction.sink_blocks(config.block_size) + 2 * -(
            -eviction.window_tokens // config.block_size
        ) + 2  # fmt: skip
        config = dataclasses.replace(config, num_kv_blocks=blocks)
    llm = LLM(config, tokenizer)
    token_ids = _tokenize(tokenizer, text, args.max_tokens)
    scores = Scores()
    scores.add_nll(llm.score_stream(token_ids, eviction))
    report: dict[str, Any] = {
        "model": model_dir,
        "weights": llm.engine.runner.weight_format.describe(),
        "kv_eviction": eviction.describe(),
        "context": len(token_ids),
        "num_windows": 1,
        "num_tokens": len(token_ids),
        "num_kv_blocks": llm.engine.kv.pool.num_blocks,
    }
    report.update(scores.report(False))
    report["buckets"] = scores.buckets(list(range(1, len(token_ids))), args.bucket_tokens)
    return report


def _score_remote(args: argparse.Namespace, model_dir: str, text: str) -> dict[str, Any]:
    import asyncio

    return asyncio.run(_score_remote_async(args, model_dir, text))


async def _score_remote_async(
    args: argparse.Namespace, model_dir: str, text: str
) -> dict[str, Any]:
    from common.contract.sampling import SamplingParams
    from common.text.tokenizer import Tokenizer
    from pdserve.client import GatewayClient
    from pdserve.gateway.v1 import gateway_pb2

    client = GatewayClient(args.target, args.api_key, args.tls_ca)
    try:
        info = await client.stub.GetModelInfo(
            gateway_pb2.GetModelInfoRequest(), timeout=30, metadata=client.metadata
        )
        token_ids = _tokenize(Tokenizer(model_dir), text, args.max_tokens)
        if any(t >= info.vocab_size for t in token_ids):
            raise ValueError(
                f"the tokenizer of {model_dir} is not that of {info.model} served at "
                f"{args.target} (token ids beyond its vocabulary of {info.vocab_size})"
            )
        context = _context(args.context, info.max_context_tokens)
        parts = windows(token_ids, context)
        if not parts:
            raise ValueError(f"{args.file} has {len(token_ids)} tokens; at least 2 are needed")
        sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, ignore_eos=True)
        scores = Scores()
        for window in parts:
            logprobs: list[float] = []
            async for message in client.stream(token_ids=window, sampling=sampling):
                logprobs += [entry.logprob for entry in message.prompt_logprobs]
            if len(logprobs) != len(window) - 1:
                raise RuntimeError(
                    f"the gateway returned {len(logprobs)} prompt logprobs for a window of "
                    f"{len(window)} tokens (expected {len(window) - 1})"
                )
            scores.add_nll(logprobs)
    finally:
        await client.close()
    report: dict[str, Any] = {
        "model": info.model,
        "target": args.target,
        "context": context,
        "num_windows": len(parts),
        "num_tokens": len(token_ids),
    }
    report.update(scores.report(False))
    return report


def _print_report(report: dict[str, Any]) -> None:
    where = report.get("target") or report.get("weights")
    print(
        f"{report['model']} ({where}): {report['num_tokens']} tokens in "
        f"{report['num_windows']} windows of {report['context']}, "
        f"{report['num_scored_tokens']} scored"
    )
    print(f"perplexity {report['perplexity']:.4f} (mean NLL {report['mean_nll']:.6f})")
    if "kv_eviction" in report:
        print(f"one stream, KV eviction {report['kv_eviction']}, {report['num_kv_blocks']} blocks")
    if len(report.get("buckets", ())) > 1:
        print("by position: " + ", ".join(
            f"{b['start']}: {b['perplexity']:.2f}" for b in report["buckets"]))  # fmt: skip
    if "reference_perplexity" in report:
        ratio = report["perplexity"] / report["reference_perplexity"]
        print(
            f"reference ({report['reference_weights']}): perplexity "
            f"{report['reference_perplexity']:.4f}; tested / reference {ratio:.4f}"
        )
        print(
            f"KL(reference || tested): mean {report['kl_divergence']:.6f}, max "
            f"{report['kl_divergence_max']:.4f}; top-1 agreement {report['top1_agreement']:.4f}"
        )
    print(f"{report['seconds']:.1f} s")
