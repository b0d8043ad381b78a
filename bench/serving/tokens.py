"""Token codec: the benchmark's view of a Hugging Face tokenizer (encode, decode, count)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class TokenCodec:
    """Encodes and decodes text without special tokens, as prompts and outputs are counted."""

    tokenizer: Any  # a transformers tokenizer (encode, decode, all_special_ids, len())
    sampleable_token_ids: tuple[int, ...]  # ids prompts draw from: no specials, whole characters

    @classmethod
    def load(cls, tokenizer_dir: str | Path) -> TokenCodec:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        return cls.from_tokenizer(tokenizer)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenCodec:
        special = set(tokenizer.all_special_ids)
        candidates = [i for i in range(len(tokenizer)) if i not in special]
        texts = tokenizer.batch_decode([[i] for i in candidates])
        # Byte-fallback pieces of a character decode to U+FFFD alone; leaving them out keeps
        # prompts free of replacement characters, whose re-encoding would break their length.
        ids = tuple(i for i, text in zip(candidates, texts) if text and "\ufffd" not in text)
        if not ids:
            raise ValueError("the tokenizer has no ordinary tokens to build prompts from")
        return cls(tokenizer, ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def count(self, text: str) -> int:
        return len(self.encode(text)) if text else 0
