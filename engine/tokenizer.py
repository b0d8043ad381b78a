"""Loading a Hugging Face tokenizer from a model directory (offline only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(path: str | Path) -> Any | None:
    """The tokenizer saved in ``path``, or None when the directory has none."""
    directory = Path(path)
    if not any((directory / name).exists() for name in _TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
