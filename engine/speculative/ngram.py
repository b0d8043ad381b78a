"""Prompt lookup: the draft tokens for a sequence are those that followed the latest earlier
occurrence of its last n tokens in its own context (prompt and output), for the longest n in
[prompt_lookup_min, prompt_lookup_max] that occurs. Pure Python; the search is ``bytes.rfind``
over the token ids packed four bytes each, so it runs in C. A sequence's packed context is kept
between steps and extended by its new tokens (packing it whole took half the time at 1k
tokens), for the ``max_contexts`` sequences asked about most recently.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

from engine.speculative.config import SpeculativeConfig

_WIDTH = 4  # bytes a token id takes in the packed context ("I": unsigned 32-bit)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_contexts: int = 256) -> None:
        """``max_contexts``: packed contexts kept (the engine's max_num_seqs: every running
        sequence asks each step, so a finished one's is the first to go)."""
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.num_speculative_tokens = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size  # None: propose at any size
        self.max_contexts = max_contexts
        self.num_lookahead_slots = 0  # looks up, computes nothing
        self._packed: OrderedDict[int, bytearray] = OrderedDict()  # seq id -> its context

    def proposes_for(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` sequences running takes drafts at all."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size

    def propose(
        self, token_ids: Sequence[int], max_num_drafts: int, seq_id: int | None = None
    ) -> tuple[int, ...]:
        """Up to ``min(max_num_drafts, num_speculative_tokens)`` draft tokens to follow
        ``token_ids``; () when no n-gram of the allowed sizes recurs. ``seq_id``: whose tokens
        they are (they only grow), to keep its packed context for the next call."""
        limit = min(max_num_drafts, self.num_speculative_tokens)
        num_tokens = len(token_ids)
        if limit < 1 or num_tokens <= self.min_n:
            return ()
        packed = self._packed_context(token_ids, seq_id)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            start = _latest_earlier_occurrence(packed, n)
            if start is not None:
                return tuple(token_ids[start + n : start + n + limit])
        return ()

    def _packed_context(self, token_ids: Sequence[int], seq_id: int | None) -> bytes | bytearray:
        if seq_id is None:
            return array("I", token_ids).tobytes()
        packed = self._packed.pop(seq_id, None)
        num_packed = 0 if packed is None else len(packed) // _WIDTH
        if packed is None or num_packed > len(token_ids):
            packed = bytearray(array("I", token_ids).tobytes())
        elif num_packed < len(token_ids):
            packed += array("I", token_ids[num_packed:]).tobytes()
        self._packed[seq_id] = packed  # the most recent last
        while len(self._packed) > self.max_contexts:
            self._packed.popitem(last=False)
        return packed


def _latest_earlier_occurrence(packed: bytes | bytearray, n: int) -> int | None:
    """Token index where the last ``n`` tokens of ``packed`` last occurred before, with at
    least one token after that occurrence inside the context; None if they did not."""
    pattern = packed[-n * _WIDTH :]
    end = len(packed) - _WIDTH  # an occurrence must end before the last token
    while True:
        found = packed.rfind(pattern, 0, end)
        if found < 0:
            return None
        if found % _WIDTH == 0:
            return found // _WIDTH
        end = found + len(pattern) - 1  # misaligned: look again just left of it
