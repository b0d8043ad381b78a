"""Token ids to text, one token at a time, for streaming: never a broken multi-byte character.

Byte-level BPE tokens can end in the middle of a UTF-8 character (an emoji is often 2-4
tokens). Each step decodes a short window of the latest tokens twice, with and without the new
ones, and emits only the difference once it no longer ends in U+FFFD (the replacement
character a partial byte sequence decodes to). The window keeps the cost per token constant.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
_WINDOW = 6  # tokens of left context decoded with each new token (merges, spaces)


class Tokenizer(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # tokens up to here are in ``text``

    def push(self, token_id: int) -> str:
        """Add one token; returns the text that became final (possibly "")."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix):
            return ""  # an unfinished character (or nothing visible yet): wait for more
        delta = full[len(prefix) :]
        self._prefix_offset = max(self._read_offset, len(self.token_ids) - _WINDOW)
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sample: whatever is still held back, as decoded."""
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        delta = full[len(prefix) :]
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


class StopStringMatcher:
    """Ends a sample at the first stop string: trimmed from the output as OpenAI does, or kept at
    its end with ``include_in_output`` (vLLM's ``include_stop_str_in_output``). Text after the
    stop string, in the token that completed it, is dropped either way, as vLLM does.

    While streaming, trimmed stop strings hold back text that might be the start of one until
    the next tokens show it is not. A kept stop string needs no holding back (vLLM holds none
    then): the text goes out at once, and its tail is only remembered, so that a stop string
    that began in text already sent is still found.
    """

    def __init__(self, stop: Sequence[str], include_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_in_output = include_in_output
        # the text's tail that may begin a stop string: held back (trimmed) or already sent
        # (kept)
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the sample, once one did

    def feed(self, delta: str) -> str:
        """New text in; the part that is safe to emit out. Sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        text = self._pending + delta
        sent = len(self._pending) if self.include_in_output else 0  # already out
        # the stop string that starts first (the shorter of two that start together)
        match = min(((i, len(s), s) for s in self.stop if (i := text.find(s)) >= 0), default=None)
        if match is not None:
            self.stopped = True
            self._pending = ""
            start, length, self.matched = match
            return text[sent : start + length if self.include_in_output else start]
        hold = self._longest_stop_prefix_suffix(text)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[sent:] if self.include_in_output else text[: len(text) - hold]

    def flush(self) -> str:
        """The sample ended without a stop string: release what was held back."""
        pending, self._pending = self._pending, ""
        return "" if self.stopped or self.include_in_output else pending

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        best = 0
        for stop in self.stop:
            for length in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:length]):
                    best = length
                    break
        return best
