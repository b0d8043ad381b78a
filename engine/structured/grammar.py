"""Compiled structured-output constraints: per state, the tokens that keep the output
completable, and the state after each token.

Lifecycle of a constraint: a request's ``StructuredOutputSpec`` -> ``GrammarCache.get`` (one
compile per distinct spec, shared by every sequence that asks for it) -> ``CompiledGrammar``.
Each constrained sequence then holds a state id: it starts at ``initial_state()``; before each
sampling step ``allowed_tokens(state)`` gives the mask; after it ``advance(state, token)`` the
next state. Eos is allowed exactly where ``is_accepting(state)``; sampling it leads to a
terminal state where only eos is allowed again. ``is_finished(state)``: only eos may follow.

Compiling: ``json_object`` is a hand-written automaton (``json_object``); the others become a
regex syntax tree (``syntax``: ``regex_parser``, ``json_schema``, or an alternation of
choices), then a byte-level NFA (``nfa``). Both are explored lazily through one
``StateTable``; masks are computed by ``masks.TokenWalker`` and cached per state (LRU, bounded
in bytes).

Masks never leave a sampler without a choice: an automaton only keeps states from which the
output can be completed over bytes the vocabulary spells with one token each, so a live state
that is not accepting always allows at least one such token, and an accepting one allows eos.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from engine.structured.automaton import (
    DEAD_STATE,
    TERMINAL_STATE,
    ByteAutomaton,
    StateTable,
)
from engine.structured.json_object import JsonObjectAutomaton
from engine.structured.nfa import RegexAutomaton, build_nfa
from engine.structured.spec import StructuredOutputSpec
from engine.structured.syntax import syntax_tree
from engine.structured.vocabulary import TokenVocabulary

MASK_CACHE_BYTES = 16 << 20  # cached masks per grammar, in bytes (one byte per token)
MIN_CACHED_MASKS = 16


class CompiledGrammar:
    """One constraint over one vocabulary. Safe to share between threads."""

    def __init__(self, automaton: ByteAutomaton, vocabulary: TokenVocabulary) -> None:
        self.vocab_size = vocabulary.vocab_size
        self._vocabulary = vocabulary
        self._walker = vocabulary.walker
        self._eos_token_ids = torch.tensor(sorted(vocabulary.eos_token_ids), dtype=torch.int64)
        self._lock = threading.Lock()
        self._table = StateTable(automaton)
        self._initial = self._table.intern(automaton.start())
        self._max_cached_masks = max(MIN_CACHED_MASKS, MASK_CACHE_BYTES // max(self.vocab_size, 1))
        self._masks: OrderedDict[int, torch.Tensor] = OrderedDict()  # state -> [vocab] bool
        self._finished: dict[int, bool] = {}

    def initial_state(self) -> int:
        """The state before any output token."""
        return self._initial

    def allowed_tokens(self, state: int) -> torch.Tensor:
        """[vocab_size] bool on CPU: the tokens after which the output can still be completed,
        and eos iff ``state`` is accepting. Cached: callers must not modify it."""
        with self._lock:
            self._check(state)
            mask = self._masks.get(state)
            if mask is not None:
                self._masks.move_to_end(state)
                return mask
            if state == TERMINAL_STATE:
                mask = torch.zeros(self.vocab_size, dtype=torch.bool)
            else:
                mask = self._walker.allowed(self._table, state, self.vocab_size)
            if self._table.is_accepting(state):
                mask[self._eos_token_ids] = True
            self._masks[state] = mask
            if len(self._masks) > self._max_cached_masks:
                self._masks.popitem(last=False)
            return mask

    def advance(self, state: int, token_id: int) -> int:
        """The state after ``token_id``; ValueError if ``state`` does not allow it."""
        with self._lock:
            self._check(state)
            if token_id in self._vocabulary.eos_token_ids:
                if not self._table.is_accepting(state):
                    raise ValueError(f"eos token {token_id} is not allowed in state {state}")
                return TERMINAL_STATE
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary of {self.vocab_size}"
                )
            data = self._vocabulary.token_bytes[token_id]
            following = DEAD_STATE if not data or state == TERMINAL_STATE else state
            for byte in data or b"":
                if following == DEAD_STATE:
                    break
                following = self._table.step(following, byte)
            if following == DEAD_STATE:
                raise ValueError(f"token {token_id} is not allowed in state {state}")
            return following

    def is_accepting(self, state: int) -> bool:
        """Whether the output that led to ``state`` is a complete match."""
        self._check(state)
        return self._table.is_accepting(state)

    def is_finished(self, state: int) -> bool:
        """Whether only eos may follow (the output is complete and can't go on)."""
        if not self.is_accepting(state):
            return False
        finished = self._finished.get(state)
        if finished is None:
            mask = self.allowed_tokens(state)
            finished = int(mask.sum()) == int(mask[self._eos_token_ids].sum())
            self._finished[state] = finished
        return finished

    def _check(self, state: int) -> None:
        if not self._table.is_state(state):
            raise ValueError(f"{state!r} is not a state of this grammar")


def compile_grammar(spec: StructuredOutputSpec, vocabulary: TokenVocabulary) -> CompiledGrammar:
    """The grammar of ``spec`` over ``vocabulary``; ValueError naming the field for what is
    unsupported or invalid, or when nothing the vocabulary can spell matches."""
    if not vocabulary.eos_token_ids:
        raise ValueError("structured outputs need a vocabulary with an eos token")
    automaton: ByteAutomaton
    tree = syntax_tree(spec)
    if tree is None:
        automaton = JsonObjectAutomaton(vocabulary.spellable_bytes, compact=spec.compact)
    else:
        node, label = tree
        automaton = RegexAutomaton(build_nfa(node, label), vocabulary.spellable_bytes)
        if automaton.start() is None:
            raise ValueError(f"{label}: nothing the model's vocabulary can spell matches it")
    return CompiledGrammar(automaton, vocabulary)


class GrammarCache:
    """One engine's compiled grammars by spec, the least recently used dropped past
    ``max_entries``. Thread-safe; two threads compiling one spec at once may both compile."""

    def __init__(self, vocabulary: TokenVocabulary, max_entries: int = 64) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._vocabulary = vocabulary
        self._max_entries = max_entries
        self._lock = threading.Lock()
        # by StructuredOutputSpec.grammar_key
        self._grammars: OrderedDict[tuple[object, ...], CompiledGrammar] = OrderedDict()

    def get(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        """The compiled grammar of ``spec`` (compiled now on a miss; errors are not cached)."""
        key = spec.grammar_key
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return grammar
        grammar = compile_grammar(spec, self._vocabulary)
        with self._lock:
            grammar = self._grammars.setdefault(key, grammar)
            self._grammars.move_to_end(key)
            while len(self._grammars) > self._max_entries:
                self._grammars.popitem(last=False)
        return grammar

    def __len__(self) -> int:
        return len(self._grammars)
