"""Tool calls read from a chat's free text in the ``hermes`` format (Hermes, Qwen2.5, Qwen3 ...),
as vLLM's ``hermes`` tool-call parser reads them: for ``tool_choice: "auto"``.

The model writes ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks,
possibly several, possibly after some plain content.

- A whole text: content is the text before the first ``<tool_call>`` (as written, not
  stripped; None when there is none), and each block one call, ``arguments`` being
  ``json.dumps`` of its parsed ``arguments``. A block runs to the first ``</tool_call>``, or to
  the end of the text. A block that is not a JSON object with a string ``name`` and an
  ``arguments`` key makes the whole text plain content with no calls. Text after the first
  block, between or after calls, is dropped, as vLLM drops it.
- A stream: content deltas until ``<tool_call>`` starts; text that may be the start of the
  tag is held back until the next text shows whether it is, and released as content at the
  end of the sample if it never is. Then each block is scanned as JSON as it arrives
  (``call_scanner``): a call's header (index, id, type, name) once its name's string closed,
  then its ``arguments`` value's text, as written, in argument deltas (vLLM streams the text;
  it equals the whole response's ``json.dumps`` when the model writes JSON spaced as
  ``json.dumps`` does, as hermes chat templates render earlier calls). A block whose name
  never comes sends nothing. Text after the first block is not content, as in a whole text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from router.gateway.call_scanner import CallScanner
from router.gateway.tag_scan import TagCutter

START = "<tool_call>"
END = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole text's content and its calls, (name, arguments JSON) each; (text, []) without
    calls, or when a block does not parse."""
    if START not in text:
        return text, []
    calls = []
    for match in _BLOCK.finditer(text):
        block = match.group(1) if match.group(1) is not None else match.group(2)
        try:
            call = json.loads(block)
        except (ValueError, RecursionError):
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        if "arguments" not in call:
            return text, []
        calls.append((call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
    content = text[: text.index(START)]
    return content or None, calls


class HermesCallStream:
    """One choice's streamed text read for hermes tool calls: ``feed`` each text delta, then
    ``end`` once the sample ended."""

    def __init__(self) -> None:
        self.num_calls = 0  # calls whose header was sent
        self._after_first_block = False  # a <tool_call> came: later text is not content
        self._block: CallScanner | None = None  # the open block's scanner; None: outside one
        # the text cut at the tag that opens a block, or within one at the tag that closes it
        self._cutter = TagCutter(lambda: (START,) if self._block is None else (END,))

    @property
    def block_open(self) -> bool:
        """Whether the text ends inside a block (its ``</tool_call>`` not seen)."""
        return self._block is not None

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool_calls entries of a delta of ``text``."""
        content: list[str] = []
        entries: list[dict[str, Any]] = []
        for piece, tag in self._cutter.feed(text):
            if self._block is not None:
                entries += self._scan(piece)
            elif not self._after_first_block:
                content.append(piece)
            if tag == START:
                self._open_block()
            elif tag == END:
                self._block = None
        return "".join(content), entries

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        """The content still held back once the sample ended: a partial tag that never
        completed, before any block (within or after one, it is dropped)."""
        held = self._cutter.end()
        return ("" if self._after_first_block else held), []

    def _open_block(self) -> None:
        self._after_first_block = True
        # its calls are numbered on from the earlier blocks' (one block, one scan: a block cut
        # short leaves no state in the next)
        self._block = CallScanner(arguments_keys=("arguments",), num_headers=self.num_calls)
        self._block.feed("[")  # the block's object scans as an array's call

    def _scan(self, text: str) -> list[dict[str, Any]]:
        assert self._block is not None
        entries = self._block.feed(text)
        self.num_calls = self._block.num_headers
        return entries
