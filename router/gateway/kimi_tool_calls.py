"""Tool calls read from a chat's free text in Kimi K2's format, as vLLM's ``kimi_k2`` tool-call
parser reads them: for ``tool_choice: "auto"``.

The model writes its calls after any content, between ``<|tool_calls_section_begin|>`` and
``<|tool_calls_section_end|>`` (or the singular ``<|tool_call_section_begin|>`` /
``<|tool_call_section_end|>``), one block per call: ``<|tool_call_begin|>``, the call's id
``functions.NAME:INDEX``, ``<|tool_call_argument_begin|>``, the arguments' JSON,
``<|tool_call_end|>``. The id is the call's ``id`` in the response, as vLLM keeps it (Kimi's
template writes earlier calls' ids back into the prompt), and its name is what stands between
the last ``.`` and the ``:`` (``get_weather`` of ``functions.get_weather:0``).

- A whole text: content is the text before the section (as written; None when there is none),
  each block one call, ``arguments`` its JSON text as written (spaces around it stripped). A
  block whose id is not ``NAME:INDEX`` or whose arguments are not a JSON object (a call cut
  short, say) makes the whole text plain content with no calls, so nothing generated is lost.
  Text between blocks and after the section is dropped.
- A stream: content deltas until the section begins (text that may be the start of the tag
  held back until the next text shows whether it is); then each call's header (index, id,
  type, name) once its id is whole, and its arguments' text as it comes (spaces before them
  dropped, spaces at their end held back until more text shows they are not the end).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from router.gateway.call_scanner import header_entry
from router.gateway.tag_scan import TagCutter

SECTION_BEGINS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN = "<|tool_call_begin|>"
ARGUMENTS_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
_CALL_ID = re.compile(r"[^<]+:\d+")  # vLLM's: functions.NAME:INDEX, or NAME:INDEX

_Part = Literal["content", "section", "id", "arguments", "after"]


def call_name(call_id: str) -> str:
    """The function a call id names: between its last ``.`` and its ``:``."""
    return call_id.split(":")[0].split(".")[-1]


@dataclass(slots=True)
class _Call:
    """A call read from a block."""

    call_id: str
    arguments: list[str] = field(default_factory=list)  # its arguments' text, piece by piece


class KimiCallStream:
    """One choice's streamed text read for Kimi K2's tool calls: ``feed`` each text delta, then
    ``end`` once the sample ended."""

    def __init__(self) -> None:
        self._part: _Part = "content"
        self._buffer = ""  # the id being read, or spaces at the arguments' end held back
        self._started = False  # the arguments' first text (spaces before it dropped) came
        self.calls: list[_Call] = []  # the calls whose header was sent, in order
        self.malformed = False  # a block's id was not NAME:INDEX, or it ended before its arguments
        self._cutter = TagCutter(self._tags)

    @property
    def num_calls(self) -> int:
        """Calls whose header was sent."""
        return len(self.calls)

    @property
    def block_open(self) -> bool:
        """Whether the text ends inside a call's block (its end tag not seen)."""
        return self._part in ("id", "arguments")

    def _tags(self) -> tuple[str, ...]:
        if self._part == "content":
            return SECTION_BEGINS
        if self._part == "section":
            return (CALL_BEGIN, *SECTION_ENDS)
        if self._part == "id":
            return (ARGUMENTS_BEGIN, CALL_END)
        if self._part == "arguments":
            return (CALL_END,)
        return ()

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool_calls entries of a delta of ``text``."""
        content: list[str] = []
        entries: list[dict[str, Any]] = []
        for piece, tag in self._cutter.feed(text):
            if self._part == "content":
                content.append(piece)
            elif self._part == "id":
                self._buffer += piece
            elif self._part == "arguments":
                self._argument(piece, entries)
            if tag is not None:
                self._tag(tag, entries)
        return "".join(content), entries

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        """The content still held back once the sample ended: a partial tag that never
        completed, before the calls (within or after them, it is dropped)."""
        held = self._cutter.end()
        return (held if self._part == "content" else ""), []

    def _tag(self, tag: str, entries: list[dict[str, Any]]) -> None:
        if tag in SECTION_BEGINS:
            self._part = "section"
        elif tag in SECTION_ENDS:
            self._part = "after"
        elif tag == CALL_BEGIN:
            self._part, self._buffer = "id", ""
        elif tag == ARGUMENTS_BEGIN:
            call_id = self._buffer.strip()
            if _CALL_ID.fullmatch(call_id) is None:
                self.malformed, self._part = True, "after"  # nothing more is read as calls
                return
            entries.append(header_entry(len(self.calls), call_name(call_id), "", call_id))
            self.calls.append(_Call(call_id))
            self._part, self._buffer, self._started = "arguments", "", False
        else:  # the block's end: spaces held back at its arguments' end are dropped
            if self._part != "arguments":
                self.malformed = True
            self._part, self._buffer = "section", ""

    def _argument(self, text: str, entries: list[dict[str, Any]]) -> None:
        """Sends the arguments' text but spaces before it, and spaces at its end until more
        text comes."""
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        text = self._buffer + text
        body = text.rstrip()
        self._buffer = text[len(body) :]
        if not body:
            return
        index = len(self.calls) - 1
        self.calls[index].arguments.append(body)
        entries.append({"index": index, "function": {"arguments": body}})


def read_kimi(text: str) -> tuple[str | None, list[tuple[str, str, str]]] | None:
    """A whole text's content and its calls, (id, name, arguments JSON) each; None without
    calls, or when a block does not parse."""
    if not any(begin in text for begin in SECTION_BEGINS):
        return None
    stream = KimiCallStream()
    content, _ = stream.feed(text)
    cut = stream.block_open
    stream.end()
    if stream.malformed or cut or not stream.calls:
        return None
    calls = []
    for call in stream.calls:
        arguments = "".join(call.arguments)
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
        if not isinstance(parsed, dict):
            return None
        calls.append((call.call_id, call_name(call.call_id), arguments))
    return content or None, calls


def parse_kimi(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole text's content and its calls, (name, arguments JSON) each; (text, []) without
    calls, or when a block does not parse."""
    read = read_kimi(text)
    if read is None:
        return text, []
    content, calls = read
    return content, [(name, arguments) for _, name, arguments in calls]


def kimi_call_ids(text: str) -> list[str]:
    """The ids a whole text gives its calls, in order (those ``parse_kimi`` returns)."""
    read = read_kimi(text)
    return [] if read is None else [call_id for call_id, _, _ in read[1]]
