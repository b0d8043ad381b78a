"""The byte automata constraints compile to, and the lazily filled transition table over them.

Two kinds of automaton implement ``ByteAutomaton``: ``nfa.RegexAutomaton`` (regexes, JSON
schemas, choices) and ``json_object.JsonObjectAutomaton`` (any JSON object). Their states are
hashable keys; a successor is ``None`` when the byte leads where the output can no longer be
completed, so every key an automaton returns is live.

``StateTable`` gives keys small int ids the first time they are reached and keeps a transition
table ``[num_states, 256]`` of ids, filled one row at a time: a state's row is expanded (its
256 successors computed and interned) when a walk first needs it, so an automaton with a huge
state space costs only what the outputs visit. Reserved ids: ``DEAD_STATE`` (every row's dead
entries point there, and its own row to itself), ``UNKNOWN_STATE`` (what the rows of states not
yet expanded hold, so a vectorised walk sees them and stops to expand) and ``TERMINAL_STATE``
(after eos). Not thread-safe: ``CompiledGrammar`` serialises access.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import torch

DEAD_STATE = 0  # the output can no longer be completed
UNKNOWN_STATE = 1  # a transition not computed yet (never a state a sequence is in)
TERMINAL_STATE = 2  # eos was sampled from an accepting state
_NUM_RESERVED = 3
_INITIAL_CAPACITY = 64


class ByteAutomaton(Protocol):
    def start(self) -> Any:
        """The start key; None when nothing the vocabulary can spell matches."""

    def successors(self, key: Any) -> Sequence[Hashable | None]:
        """The key after each of the 256 bytes; None where the output can't be completed."""

    def is_accepting(self, key: Any) -> bool:
        """Whether the output that led to ``key`` is a complete match."""


class StateTable:
    """Int ids for an automaton's keys and the lazily filled transitions between them."""

    def __init__(self, automaton: ByteAutomaton) -> None:
        self._automaton = automaton
        self._ids: dict[Hashable, int] = {}
        self._keys: list[Hashable] = [None] * _NUM_RESERVED
        self._accepting = [False, False, True]
        # [capacity, 256] next state id per (state, byte); rows past num_states are unused
        self.transitions = torch.full((_INITIAL_CAPACITY, 256), UNKNOWN_STATE, dtype=torch.int32)
        self.transitions[DEAD_STATE] = DEAD_STATE
        self.transitions[TERMINAL_STATE] = DEAD_STATE
        # the same rows as Python lists, for ``step`` (a sequence's token, byte by byte: a list
        # index, where a tensor's costs microseconds); None: not expanded yet
        self._rows: list[list[int] | None] = [
            [UNKNOWN_STATE if state == UNKNOWN_STATE else DEAD_STATE] * 256
            for state in range(_NUM_RESERVED)
        ]

    @property
    def num_states(self) -> int:
        return len(self._keys)

    def intern(self, key: Hashable) -> int:
        """The id of ``key`` (a new one, with an unexpanded row, the first time)."""
        state = self._ids.get(key)
        if state is not None:
            return state
        state = len(self._keys)
        if state == self.transitions.shape[0]:
            with torch.inference_mode():  # (see _fill)
                grown = torch.full((2 * state, 256), UNKNOWN_STATE, dtype=torch.int32)
                grown[:state] = self.transitions
            self.transitions = grown
        self._ids[key] = state
        self._keys.append(key)
        self._accepting.append(self._automaton.is_accepting(key))
        self._rows.append(None)
        return state

    def expand(self, state: int) -> None:
        """Fill ``state``'s row of transitions, if it is not filled yet."""
        if self._rows[state] is not None:
            return
        row = [
            DEAD_STATE if key is None else self.intern(key)
            for key in self._automaton.successors(self._keys[state])
        ]
        self._fill(state, row)
        self._rows[state] = row

    def _fill(self, state: int, row: list[int]) -> None:
        """Write a row of the table, in inference mode: the table grows (and is filled) from
        the model runner, under ``torch.inference_mode``, and from callers that are not
        (the scheduler's draft filter, a compile); torch refuses to write outside inference
        mode to a tensor made in it, so the table is always made and written in it."""
        with torch.inference_mode():
            self.transitions[state] = torch.tensor(row, dtype=torch.int32)

    def step(self, state: int, byte: int) -> int:
        """The state after ``byte``, expanding ``state`` first if needed."""
        self.expand(state)
        row = self._rows[state]
        assert row is not None
        return row[byte]

    def is_accepting(self, state: int) -> bool:
        return self._accepting[state]

    def is_state(self, state: int) -> bool:
        """Whether ``state`` is an id a sequence can be in (live, or terminal)."""
        return (
            isinstance(state, int)
            and DEAD_STATE < state < self.num_states
            and (state != UNKNOWN_STATE)
        )
