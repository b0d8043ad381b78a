"""Tags in streamed chat text (``<think>``, ``</think>``, ``<tool_call>``, ``[TOOL_CALLS]`` ...):
text cut where the tags are, delta by delta, holding back an end that may be the start of one
until the next text shows whether it is. The reasoning split (``reasoning``) and the hermes and
mistral tool-call streams (``hermes_tool_calls``, ``mistral_tool_calls``) read their tags with
``TagCutter``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence


class TagCutter:
    """One choice's streamed text cut at tags: ``feed`` each text delta, then ``end`` once the
    sample ended. Which tags are looked for is the owner's state (``tags``), asked again after
    each tag, so it changes as the owner handles them: hermes looks for ``</tool_call>`` once
    ``<tool_call>`` came; no tags, and the text passes whole."""

    def __init__(self, tags: Callable[[], Sequence[str]]) -> None:
        self._tags = tags  # the tags looked for now, the first written ending a piece
        self._held = ""  # the text's end that may be the start of a tag

    def feed(self, text: str) -> Iterator[tuple[str, str | None]]:
        """The held text and ``text`` cut at the tags: (the text before a tag, the tag) each,
        then (the text after the last, None) short of what is held back. Read it to its end,
        handling each tag before the next is looked for."""
        rest, self._held = self._held + text, ""
        while (tags := self._tags()) and (found := _first_tag(rest, tags)) is not None:
            at, tag = found
            yield rest[:at], tag
            rest = rest[at + len(tag) :]
        upto = len(rest) - _partial_tag_len(rest, tags) if tags else len(rest)
        self._held = rest[upto:]
        yield rest[:upto], None

    def end(self) -> str:
        """The text still held back once the sample ended: a partial tag that never
        completed."""
        held, self._held = self._held, ""
        return held


def _first_tag(text: str, tags: Sequence[str]) -> tuple[int, str] | None:
    """Where the first of ``tags`` in ``text`` starts, and which it is (at one place, the first
    of ``tags`` listed); None when none is in it."""
    found: tuple[int, str] | None = None
    for tag in tags:
        at = text.find(tag)
        if at >= 0 and (found is None or at < found[0]):
            found = (at, tag)
    return found


def _partial_tag_len(text: str, tags: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that one of ``tags`` starts with (short of the
    whole tag): what may be a tag's start, to hold back until more text comes."""
    for length in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        end = text[-length:]
        if any(len(tag) > length and tag.startswith(end) for tag in tags):
            return length
    return 0
