"""``--speculative-config``: the JSON object vLLM takes, validated once.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
     "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "/path/to/draft", "num_speculative_tokens": 4}
    {"method": "suffix", "num_speculative_tokens": 16, "suffix_decoding_max_tree_depth": 24,
     "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
     "suffix_decoding_min_token_prob": 0.1}

pdserve adds ``"adaptive"`` (default true): each step verifies only the guesses worth their
rows, from the request's kept rate and the measured step cost (policy.py); false verifies
up to num_speculative_tokens every step, as vLLM does.

Unknown keys are refused by name (a misspelt key silently ignored would turn speculation
off without a word).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "suffix")
MAX_SPECULATIVE_TOKENS = 16
_SUFFIX_KEYS = {
    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
}  # fmt: skip
_KEYS = {
    "method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
    "quantization", "adaptive", *_SUFFIX_KEYS,
}  # fmt: skip


class SpeculativeConfigError(ValueError):
    """A --speculative-config the engine cannot run; the message says which field."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # ngram: the longest and shortest suffix of the context looked up earlier in it.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # draft_model: the draft's checkpoint and weight format (None: as the target's).
    model: str | None = None
    quantization: str | None = None
    # pdserve's own key: verify only the guesses worth their rows (policy.py); false =
    # always up to num_speculative_tokens, as vLLM does.
    adaptive: bool = True
    # suffix (vLLM's names and defaults; suffix.py): the trees' depth (the longest context
    # suffix matched and continuation guessed), how many past responses the worker keeps
    # (over all tenants), guesses at most factor x the match's length, and only
    # continuations seen at least this often.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # suffix with prompt_lookup_max / _min given: prompt lookup runs beside the trees and the
    # guess after the longer match wins (set by from_dict; not a key of its own).
    suffix_with_ngram: bool = False

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens}"
            )
        if self.method == "ngram" or self.suffix_with_ngram:
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise SpeculativeConfigError(
                    "ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                    f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
                )
            if self.model is not None:
                raise SpeculativeConfigError("ngram takes no draft model; drop 'model'")
        if self.method == "draft_model" and not self.model:
            raise SpeculativeConfigError("draft_model needs 'model': the draft's checkpoint")
        if self.method == "suffix":
            if self.model is not None:
                raise SpeculativeConfigError("suffix takes no draft model; drop 'model'")
            if self.suffix_decoding_max_tree_depth < 1:
                raise SpeculativeConfigError(
                    "suffix_decoding_max_tree_depth must be >= 1, got "
                    f"{self.suffix_decoding_max_tree_depth}"
                )
            if self.suffix_decoding_max_cached_requests < 0:
                raise SpeculativeConfigError(
                    "suffix_decoding_max_cached_requests must be >= 0 (0: no global tree), got "
                    f"{self.suffix_decoding_max_cached_requests}"
                )
            if self.suffix_decoding_max_spec_factor <= 0:
                raise SpeculativeConfigError(
                    "suffix_decoding_max_spec_factor must be > 0, got "
                    f"{self.suffix_decoding_max_spec_factor}"
                )
            if not 0 <= self.suffix_decoding_min_token_prob <= 1:
                raise SpeculativeConfigError(
                    "suffix_decoding_min_token_prob must be in [0, 1], got "
                    f"{self.suffix_decoding_min_token_prob}"
                )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpeculativeConfigError(f"--speculative-config is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise SpeculativeConfigError(
                f"--speculative-config: unknown key(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(_KEYS))}"
            )
        if raw.get("method") == "suffix" and "num_speculative_tokens" not in raw:
            # As vLLM: the tree's depth (here at most MAX_SPECULATIVE_TOKENS).
            depth = raw.get("suffix_decoding_max_tree_depth", 24)
            if isinstance(depth, int) and not isinstance(depth, bool):
                raw = {**raw, "num_speculative_tokens": min(depth, MAX_SPECULATIVE_TOKENS)}
        if "method" not in raw or "num_speculative_tokens" not in raw:
            raise SpeculativeConfigError(
                "--speculative-config needs 'method' and 'num_speculative_tokens'"
            )
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests"):  # fmt: skip
            if key in raw and (not isinstance(raw[key], int) or isinstance(raw[key], bool)):
                raise SpeculativeConfigError(f"{key} must be an integer, got {raw[key]!r}")
        for key in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
            if key in raw and (not isinstance(raw[key], int | float) or isinstance(raw[key], bool)):
                raise SpeculativeConfigError(f"{key} must be a number, got {raw[key]!r}")
            if key in raw:
                raw = {**raw, key: float(raw[key])}
        if raw.get("method") == "suffix" and {"prompt_lookup_max", "prompt_lookup_min"} & set(raw):
            raw = {**raw, "suffix_with_ngram": True}
        if raw.get("method") != "suffix" and _SUFFIX_KEYS & set(raw):
            raise SpeculativeConfigError(
                f"{', '.join(sorted(_SUFFIX_KEYS & set(raw)))} apply to method suffix only"
            )
        if "adaptive" in raw and not isinstance(raw["adaptive"], bool):
            raise SpeculativeConfigError(f"adaptive must be true or false, got {raw['adaptive']!r}")
        return cls(**raw)

    def to_json(self) -> str:
        """The JSON that ``from_json`` reads back to an equal config (for forwarding)."""
        fields: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        if not self.adaptive:
            fields["adaptive"] = False
        if self.method == "ngram":
            fields["prompt_lookup_max"] = self.prompt_lookup_max
            fields["prompt_lookup_min"] = self.prompt_lookup_min
        elif self.method == "suffix":
            for key in sorted(_SUFFIX_KEYS):
                fields[key] = getattr(self, key)
            if self.suffix_with_ngram:
                fields["prompt_lookup_max"] = self.prompt_lookup_max
                fields["prompt_lookup_min"] = self.prompt_lookup_min
        else:
            fields["model"] = self.model
            if self.quantization is not None:
                fields["quantization"] = self.quantization
        return json.dumps(fields, sort_keys=True)
