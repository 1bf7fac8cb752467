"""Worker profiles the simulator and the planner are built from, until ``pdserve profile
--json`` measures one (``--profile PATH`` takes its JSON).

- ``cpu``: this machine (2 cores, SmolLM2-135M Q4_1 GGUF, 2 threads, float32 KV), from
  figures measured here by hand: whole prefills of 512 / 1024 / 2000 / 4000 tokens in
  495 / 1130 / 2758 / 7822 ms; decode steps of 1 row ~6 ms, 9 rows ~15 ms, 16 rows (contexts
  ~230 tokens) ~22 ms; a 512 MiB KV pool (46,080 bytes a token: 30 layers x K,V x 3 heads x
  64 x 4 bytes).
- ``gpu``: NOT measured. An 8B-class model (128 KiB of fp16 KV a token) on one H100-class
  GPU, from public orders of magnitude: prefill ~14k tokens/s with a quadratic attention
  term, a decode step of ~7 ms that reads the weights plus ~38 ns per token of context read
  (3.35 TB/s over 128 KiB), a 56 GB KV pool. It exists so the planner is exercised at
  cluster scale on numbers unlike this machine's; its absolute figures prove nothing.
"""

from __future__ import annotations

from pathlib import Path

from common.planner.profile import DecodeSample, PrefillSample, ProfileKey, WorkerProfile


def cpu_profile() -> WorkerProfile:
    return WorkerProfile.from_samples(
        ProfileKey("SmolLM2-135M-Instruct", "gguf-q4_1", 2, "cpu"),
        block_size=16,
        num_kv_blocks=512 * 1024 * 1024 // (46080 * 16),
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        max_model_len=8192,
        prefill_samples=[
            PrefillSample(512, 0, 495.0),
            PrefillSample(1024, 0, 1130.0),
            PrefillSample(2000, 0, 2758.0),
            PrefillSample(4000, 0, 7822.0),
        ],
        decode_samples=[
            DecodeSample(1, 100, 6.0),
            DecodeSample(1, 230, 6.2),
            DecodeSample(9, 230, 15.0),
            DecodeSample(16, 230, 22.0),
        ],
    )


# The gpu profile's fits (ms): its samples are drawn from these.
_GPU_PREFILL = (20.0, 0.07, 2.5e-6)  # base, per new token, per attended token pair
_GPU_DECODE = (7.0, 0.05, 3.8e-5)  # base, per row, per context token read


def gpu_profile() -> WorkerProfile:
    base, per_token, per_pair = _GPU_PREFILL
    prefill = [
        PrefillSample(n, c, base + per_token * (n - c) + per_pair * (n - c) * (c + (n - c) / 2))
        for n, c in ((512, 0), (2048, 0), (8192, 0), (32768, 0), (8192, 4096), (65536, 32768))
    ]
    base_d, per_row, per_ctx = _GPU_DECODE
    decode = [
        DecodeSample(b, ctx, base_d + per_row * b + per_ctx * b * ctx)
        for b, ctx in ((1, 512), (16, 2048), (64, 4096), (128, 8192), (256, 1024))
    ]
    return WorkerProfile.from_samples(
        ProfileKey("gpu-like-8b", "fp16", 0, "gpu-like"),
        block_size=16,
        num_kv_blocks=56 * 10**9 // (131072 * 16),
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=131072,
        prefill_samples=prefill,
        decode_samples=decode,
    )


def load_profile(name_or_path: str) -> WorkerProfile:
    if name_or_path == "cpu":
        return cpu_profile()
    if name_or_path == "gpu":
        return gpu_profile()
    return WorkerProfile.from_json(Path(name_or_path).read_text(encoding="utf-8"))
