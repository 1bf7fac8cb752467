"""The checkpoint's tokenizer and chat template, behind the few calls pdserve makes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.errors import FailedPreconditionError, InvalidRequestError

CHAT_ROLES = ("system", "user", "assistant", "tool")


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        self.has_chat_template = bool(getattr(self.hf, "chat_template", None))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode_raw(self, text: str) -> list[int]:
        """As ``tokenizer(text)``: special tokens (e.g. BOS) added as the checkpoint says."""
        return list(self.hf(text).input_ids)

    def encode_chat(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """As ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``."""
        for i, message in enumerate(messages):
            if message.get("role") not in CHAT_ROLES:
                raise InvalidRequestError(
                    f"messages[{i}].role",
                    f"unknown role {message.get('role')!r}; use one of {', '.join(CHAT_ROLES)}",
                )
        if not self.has_chat_template:
            raise FailedPreconditionError(
                "this model has no chat template; send raw_prompt or token_ids"
            )
        result: Any = self.hf.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if not isinstance(result, list):  # transformers >= 5 returns a BatchEncoding
            result = result["input_ids"]
        return [int(t) for t in result]

    def encode_prompt(self, prompt: str, raw: bool) -> list[int]:
        if raw or not self.has_chat_template:
            return self.encode_raw(prompt)
        return self.encode_chat([{"role": "user", "content": prompt}])

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return [str(t) for t in self.hf.convert_ids_to_tokens(list(token_ids))]
