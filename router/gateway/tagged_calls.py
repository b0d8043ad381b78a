"""What the tool-call formats read tag by tag share (Qwen3-Coder's, GLM-4.5's, MiniMax-M2's):
a format's reader (``CallReader``) takes the text cut at the tags it looks for now, naming each
call and typing each argument; ``TaggedCallStream`` cuts the text for it (holding back what may
be a partial tag), sends the content until the calls start, and puts the calls together, whole
or streamed alike; ``ReadCall`` is a call being read, its arguments sent one by one."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.gateway.call_scanner import header_entry
from router.gateway.tag_scan import TagCutter


@dataclass(slots=True)
class ReadCall:
    """A call being read: its tool_calls index and name, its typed arguments as written."""

    index: int
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    num_sent: int = 0  # arguments whose fragment was sent

    def header(self) -> dict[str, Any]:
        """Its first stream entry: index, id, type and name, with ``{``."""
        return header_entry(self.index, self.name, "{")

    def argument(self, key: str, value: Any) -> dict[str, Any]:
        """Records an argument and gives its entry, ``"KEY": value`` (``, `` before it after
        the first): the pieces join to ``json.dumps`` of the arguments."""
        self.arguments[key] = value
        separator = ", " if self.num_sent else ""
        self.num_sent += 1
        text = f"{separator}{json.dumps(key, ensure_ascii=False)}: " + json.dumps(
            value, ensure_ascii=False
        )
        return {"index": self.index, "function": {"arguments": text}}

    def closing(self) -> dict[str, Any]:
        """Its last entry, ``}``."""
        return {"index": self.index, "function": {"arguments": "}"}}


class CallReader(Protocol):
    """A format's reader of the text after the content, piece by piece as the tags cut it."""

    @property
    def part(self) -> str:
        """What is being read: "content" until the calls start."""
        ...

    @property
    def calls(self) -> Sequence[ReadCall]:
        """The calls named so far."""
        ...

    @property
    def unnamed(self) -> bool:
        """(Once ``finish`` ran) the calls began but the first was never named."""
        ...

    def tags(self) -> tuple[str, ...]:
        """The tags that end the part being read."""
        ...

    def read(self, piece: str, tag: str | None) -> list[dict[str, Any]]:
        """The stream entries of ``piece`` (the text before ``tag``, or all there is when
        None), then of ``tag``."""
        ...

    def finish(self) -> None:
        """The text ended: what is open ends there (sets ``unnamed``)."""
        ...

    @property
    def in_call(self) -> bool:
        """Whether the text so far ends inside a call."""
        ...


class TaggedCallStream:
    """One choice's streamed text read for calls by ``reader``: ``feed`` each text delta, then
    ``end`` once the sample ended. ``blank_is_none``: content of only whitespace is no content
    (held back until other text comes; a whole response's is None), as vLLM's glm45 parser
    has it."""

    def __init__(self, reader: CallReader, blank_is_none: bool = False) -> None:
        self._reader = reader
        self._cutter = TagCutter(reader.tags)
        self._blank_is_none = blank_is_none
        self._text = ""  # the text so far, until a call's header is sent
        self._content_sent = 0  # the length of the content sent
        self._blank = ""  # the content so far while it is only whitespace (blank_is_none)

    @property
    def num_calls(self) -> int:
        """Calls whose header was sent."""
        return len(self._reader.calls)

    @property
    def block_open(self) -> bool:
        """Whether the text ends inside a call."""
        return self._reader.in_call

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool_calls entries of a delta of ``text``."""
        content: list[str] = []
        entries: list[dict[str, Any]] = []
        for piece, tag in self._cutter.feed(text):
            if self._reader.part == "content":
                content.append(piece)
            entries += self._reader.read(piece, tag)
        sent = "".join(content)
        if self._blank_is_none and not self._content_sent:
            sent, self._blank = self._blank + sent, ""
            if not sent.strip():
                sent, self._blank = "", sent
        self._content_sent += len(sent)
        self._text = self._text + text if not self._reader.calls else ""
        return sent, entries

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        """The content still held back once the sample ended: a partial tag that never
        completed, before any call; or, when the calls began but none was named, the text
        from where they began (all content, as the whole response has it). After a call, it
        is dropped."""
        self._reader.read(self._cutter.end(), None)
        if self._reader.calls:
            return "", []
        return self._text[self._content_sent :], []

    def whole_calls(self) -> list[tuple[str, str]] | None:
        """Once ``end`` ran, the calls as a whole response has them, (name, arguments JSON)
        each. None when the first call's name was cut short."""
        self._reader.finish()
        if self._reader.unnamed:
            return None
        calls = self._reader.calls
        return [(c.name, json.dumps(c.arguments, ensure_ascii=False)) for c in calls]

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """A whole ``text`` read by a new stream: its content and calls, (name, arguments JSON)
        each; (text, []) without calls, or when the first call's name is cut short."""
        content, _ = self.feed(text)
        held, _ = self.end()
        calls = self.whole_calls()
        if not calls:
            return text, []
        content += held
        if self._blank_is_none and not content.strip():
            return None, calls
        return content or None, calls
