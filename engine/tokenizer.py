"""Loading a Hugging Face tokenizer from a model directory (offline only); vLLM's encoding of
``bad_words`` with it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any | None:
    """The tokenizer saved in ``path``, or None when the directory has none.

    ``trust_remote_code`` (vLLM's): a tokenizer whose class ships as code in the directory
    (Kimi K2's) may run it; without it such a tokenizer is refused with a ValueError naming the
    flag, never an interactive question (transformers asks one when not told either way)."""
    directory = Path(path)
    if not any((directory / name).exists() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except ValueError as error:
        if trust_remote_code or "trust_remote_code" not in str(error):
            raise
        raise ValueError(
            f"the tokenizer in {directory} is code that ships with the model (its "
            "tokenizer_config.json auto_map); run it with --trust-remote-code "
            "(LLM(trust_remote_code=True)) if you trust that code"
        ) from error


def bad_words_token_ids(tokenizer: Any, bad_words: Sequence[str]) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words`` (``SamplingParams.update_from_tokenizer``).

    Each word is encoded without special tokens twice: as it is after ``lstrip()``, and with one
    leading space. The spaced form is kept only when it starts with a different token than the
    plain form and has as many tokens (it is then the same word in mid-text, not a split of it).
    ValueError names a word that encodes to no token at all.
    """
    sequences: list[list[int]] = []
    for i, word in enumerate(bad_words):
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words[{i}] ({word!r}) must encode to at least one token")
        sequences.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences
