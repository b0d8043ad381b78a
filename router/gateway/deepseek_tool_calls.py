"""Tool calls read from a chat's free text in DeepSeek's formats, as vLLM's ``deepseek_v3`` and
``deepseek_v31`` tool-call parsers read them: for ``tool_choice: "auto"``.

The model writes its calls after any content, between ``<｜tool▁calls▁begin｜>`` and
``<｜tool▁calls▁end｜>``, one block per call:

- ``deepseek_v3`` (DeepSeek-V3, R1-0528): ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME``, a
  newline, then the arguments fenced as JSON (````json`` and a newline before, a newline and
  ```` after), then ``<｜tool▁call▁end｜>``;
- ``deepseek_v31`` (DeepSeek-V3.1 and later): ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>``, the
  arguments, ``<｜tool▁call▁end｜>``.

- A whole text: content is the text before ``<｜tool▁calls▁begin｜>`` (as written; None when
  there is none), each block one call, ``arguments`` its JSON text as written. A block that
  does not hold a name and a JSON object (a call cut short, say) makes the whole text plain
  content with no calls, so nothing generated is lost. Text between blocks and after the
  calls is dropped, as vLLM drops it.
- A stream: content deltas until ``<｜tool▁calls▁begin｜>`` (text that may be the start of the
  tag held back until the next text shows whether it is); then each call's header (index, id,
  type, name) once its name is whole, and its arguments' text as it comes (``deepseek_v3``: a
  newline or backticks that may be the closing fence held back until the block's end shows).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from router.gateway.call_scanner import header_entry
from router.gateway.tag_scan import TagCutter

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
_OPEN_FENCE = "```json\n"
FENCED_END = "\n```" + CALL_END  # V3's closing fence and the block's end, cut as one tag

Dialect = Literal["deepseek_v3", "deepseek_v31"]
_Part = Literal["content", "calls", "kind", "name", "fence", "arguments", "after"]


@dataclass(slots=True)
class _Call:
    """A call read from a block."""

    name: str
    arguments: list[str] = field(default_factory=list)  # its arguments' text, piece by piece


class DeepSeekCallStream:
    """One choice's streamed text read for DeepSeek tool calls: ``feed`` each text delta, then
    ``end`` once the sample ended."""

    def __init__(self, dialect: Dialect) -> None:
        self._fenced = dialect == "deepseek_v3"  # V3's name ends at a newline, its arguments fenced
        self._part: _Part = "content"
        self._buffer = ""  # the block's header not yet read: its name, or what may be the fence
        self.calls: list[_Call] = []  # the calls whose header was sent, in order
        self.num_calls = 0  # calls whose header was sent
        self.malformed = False  # a block held no name, or ended before its arguments
        self._cutter = TagCutter(self._tags)

    @property
    def block_open(self) -> bool:
        """Whether the text ends inside a call's block (its end tag not seen)."""
        return self._part in ("kind", "name", "fence", "arguments")

    def _tags(self) -> tuple[str, ...]:
        if self._part == "content":
            return (CALLS_BEGIN,)
        if self._part == "calls":
            return (CALL_BEGIN, CALLS_END)
        if self._part == "after":
            return ()
        if self._part == "kind" or (self._part == "name" and not self._fenced):
            return (SEP, CALL_END)
        return (FENCED_END, CALL_END) if self._fenced else (CALL_END,)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool_calls entries of a delta of ``text``."""
        content: list[str] = []
        entries: list[dict[str, Any]] = []
        for piece, tag in self._cutter.feed(text):
            if self._part == "content":
                content.append(piece)
            elif self._part == "arguments":
                self._argument(piece, entries)
            elif self._part in ("name", "fence"):
                self._buffer += piece
                self._read_header(entries)
            if tag is not None:
                self._tag(tag, entries)
        return "".join(content), entries

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        """The content still held back once the sample ended: a partial tag that never
        completed, before the calls (within or after them, it is dropped)."""
        held = self._cutter.end()
        return (held if self._part == "content" else ""), []

    def _tag(self, tag: str, entries: list[dict[str, Any]]) -> None:
        if tag == CALLS_BEGIN:
            self._part = "calls"
        elif tag == CALLS_END:
            self._part = "after"
        elif tag == CALL_BEGIN:
            self._part, self._buffer = "kind" if self._fenced else "name", ""
        elif tag == SEP:
            if self._part == "kind":  # V3: the call's type ("function") read; its name next
                self._part = "name"
            elif self._announce(self._buffer.strip(), entries):  # V3.1: the name is whole
                self._part, self._buffer = "arguments", ""
        elif tag in (CALL_END, FENCED_END):
            if self._part != "arguments":  # the block ended before its arguments started
                self.malformed = True
            self._part, self._buffer = "calls", ""

    def _read_header(self, entries: list[dict[str, Any]]) -> None:
        """Reads what the buffer holds of a V3 block's header: its name up to its newline, then
        the opening fence; what follows is the arguments'."""
        if self._part == "name" and self._fenced and "\n" in self._buffer:
            name, self._buffer = self._buffer.split("\n", 1)
            if not self._announce(name.strip(), entries):
                return
            self._part = "fence"
        if self._part == "fence":
            if _OPEN_FENCE.startswith(self._buffer):  # may still be the fence: wait for more
                return
            arguments = self._buffer.removeprefix(_OPEN_FENCE)
            self._part, self._buffer = "arguments", ""
            self._argument(arguments, entries)

    def _announce(self, name: str, entries: list[dict[str, Any]]) -> bool:
        """Sends a call's header; False for a nameless block, after which nothing more is read
        as calls."""
        if not name:
            self.malformed, self._part, self._buffer = True, "after", ""
            return False
        entries.append(header_entry(len(self.calls), name, ""))
        self.calls.append(_Call(name))
        self.num_calls = len(self.calls)
        return True

    def _argument(self, text: str, entries: list[dict[str, Any]]) -> None:
        if not text:
            return
        index = len(self.calls) - 1
        self.calls[index].arguments.append(text)
        entries.append({"index": index, "function": {"arguments": text}})


def parse_deepseek(dialect: Dialect, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole text's content and its calls, (name, arguments JSON) each; (text, []) without
    calls, or when a block does not parse."""
    if CALLS_BEGIN not in text:
        return text, []
    stream = DeepSeekCallStream(dialect)
    content, _ = stream.feed(text)
    cut = stream.block_open
    stream.end()
    if stream.malformed or cut or not stream.calls:
        return text, []
    calls = []
    for call in stream.calls:
        arguments = "".join(call.arguments)
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):
            return text, []
        if not isinstance(parsed, dict):
            return text, []
        calls.append((call.name, arguments))
    return content or None, calls
