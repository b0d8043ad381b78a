"""Tool calls read from a chat's free text in the ``mistral`` format, as vLLM's ``mistral``
tool-call parser reads it with a Hugging Face tokenizer whose vocabulary has no ``[ARGS]``
(tokenizers before Mistral's v11: Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo ...): for
``tool_choice: "auto"``. (With ``[ARGS]`` in the vocabulary vLLM reads v11's
``[TOOL_CALLS]name[ARGS]{...}`` instead: not served here, refused at start.)

The model writes some content, then ``[TOOL_CALLS]`` and a JSON array of
``{"name": ..., "arguments": {...}}``.

- A whole text, as vLLM's: without ``[TOOL_CALLS]`` it is content. Else the content is the
  text before it (null when empty), and the text after it, stripped, is read as JSON up to the
  end of its first value (text after that is dropped), or failing that, its first
  ``[{ ... }]`` span; each item is a call, ``arguments`` being ``json.dumps`` of its
  ``arguments`` (``{}`` without them), with a 9-character alphanumeric id, as Mistral's
  templates check ids. When neither parses, the content is the text after ``[TOOL_CALLS]``,
  stripped (vLLM's), with no calls. A second ``[TOOL_CALLS]``, or an array that is not of
  objects with a string ``name``, vLLM fails the request on; here the whole text is content.
- A stream: content until ``[TOOL_CALLS]`` starts (text that may be the start of the tag is
  held back until the next text shows whether it is, released at the end if it never is),
  then the array is scanned as it arrives (``call_scanner``): a call's header (index, id,
  type, name) once its name's string closed, then its ``arguments`` value's text as written,
  in argument deltas (the whole response's ``json.dumps`` when the model spaces JSON as
  ``json.dumps`` does; a call without ``arguments`` streams none). Text after the array is
  dropped.
"""

from __future__ import annotations

import json
import random
import re
import string
from typing import Any

from router.gateway.call_scanner import CallScanner
from router.gateway.tag_scan import TagCutter

TOOL_CALLS = "[TOOL_CALLS]"
V11_ARGS = "[ARGS]"  # in the vocabulary of v11+ tokenizers, whose format this is not
_ARRAY_SPAN = re.compile(r"\[{.*}\]", re.DOTALL)
_DECODER = json.JSONDecoder()
_ID_CHARACTERS = string.ascii_letters + string.digits


def new_mistral_tool_call_id() -> str:
    """A tool call's id as vLLM makes Mistral's: 9 alphanumeric characters."""
    return "".join(random.choices(_ID_CHARACTERS, k=9))


def parse_mistral(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole text's content and its calls, (name, arguments JSON) each; content alone when
    the calls do not parse."""
    if TOOL_CALLS not in text:
        return text, []
    content, *raw_calls = text.split(TOOL_CALLS)
    if len(raw_calls) != 1:
        return text, []
    stringified = raw_calls[0].strip()
    try:
        items, _ = _DECODER.raw_decode(stringified)
    except (ValueError, RecursionError):
        span = _ARRAY_SPAN.search(stringified)
        try:
            items = json.loads(span.group(0)) if span is not None else None
        except (ValueError, RecursionError):
            items = None
        if items is None:
            return stringified, []
    calls = _calls(items)
    if calls is None:
        return text, []
    return content or None, calls


def _calls(items: Any) -> list[tuple[str, str]] | None:
    if not isinstance(items, list):
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = json.dumps(item.get("arguments", {}), ensure_ascii=False)
        calls.append((item["name"], arguments))
    return calls


class MistralCallStream:
    """One choice's streamed text read for mistral tool calls: ``feed`` each text delta, then
    ``end`` once the sample ended."""

    def __init__(self) -> None:
        self.num_calls = 0  # calls whose header was sent
        self._scanner: CallScanner | None = None  # once [TOOL_CALLS] came
        self._cutter = TagCutter(lambda: (TOOL_CALLS,) if self._scanner is None else ())

    @property
    def block_open(self) -> bool:
        """Whether the text ends inside the array of calls."""
        return self._scanner is not None and self._scanner.depth > 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool_calls entries of a delta of ``text``."""
        content: list[str] = []
        entries: list[dict[str, Any]] = []
        for piece, tag in self._cutter.feed(text):
            if self._scanner is None:
                content.append(piece)
            else:
                entries += self._scan(piece)
            if tag == TOOL_CALLS:
                self._scanner = CallScanner(
                    arguments_keys=("arguments",), new_call_id=new_mistral_tool_call_id
                )
        return "".join(content), entries

    def end(self) -> str:
        """The content still held back once the sample ended: a partial tag that never
        completed."""
        return self._cutter.end()

    def _scan(self, text: str) -> list[dict[str, Any]]:
        assert self._scanner is not None
        entries = self._scanner.feed(text)
        self.num_calls = self._scanner.num_headers
        return entries
