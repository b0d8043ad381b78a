"""An engine's compiled structured-output grammars, built with its model's tokenizer.

The tokenizer is loaded, and its vocabulary turned into bytes, on the first request that asks
for structured outputs: an engine that never sees one pays nothing. Compiled grammars are
cached by spec (``GrammarCache``), so a worker compiles each schema once.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from pathlib import Path

from engine.structured.grammar import CompiledGrammar, GrammarCache
from engine.structured.spec import StructuredOutputSpec
from engine.structured.vocabulary import TokenVocabulary
from engine.tokenizer import load_tokenizer


class ModelGrammars:
    def __init__(
        self,
        tokenizer_dir: str | Path,
        vocab_size: int,
        eos_token_ids: Collection[int],
        trust_remote_code: bool = False,
    ) -> None:
        self._tokenizer_dir = tokenizer_dir  # the model's, or LLM(tokenizer=...)
        self._trust_remote_code = trust_remote_code  # (LoadConfig.trust_remote_code)
        self._vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._eos_token_ids = frozenset(eos_token_ids)
        self._cache: GrammarCache | None = None
        self._lock = threading.Lock()  # one tokenizer load

    def __call__(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """The grammar of ``spec``; ValueError if it cannot be compiled (or there is no
        tokenizer to compile it against)."""
        return self._grammar_cache().get(spec)  # (one grammar whatever after_token_ids)

    def _grammar_cache(self) -> GrammarCache:
        with self._lock:
            if self._cache is None:
                tokenizer = load_tokenizer(self._tokenizer_dir, self._trust_remote_code)
                if tokenizer is None:
                    raise ValueError(
                        f"structured_outputs needs the model's tokenizer; {self._tokenizer_dir} "
                        "has none"
                    )
                vocabulary = TokenVocabulary.from_tokenizer(
                    tokenizer, self._vocab_size, self._eos_token_ids
                )
                self._cache = GrammarCache(vocabulary)
            return self._cache
