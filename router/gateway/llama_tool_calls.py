"""Tool calls read from a chat's free text in the ``llama3_json`` format (Llama 3.1 to 3.3 and
Llama 4 with JSON tool calling), as vLLM's ``llama3_json`` / ``llama4_json`` parser reads them:
for ``tool_choice: "auto"``.

The model writes ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), possibly several
separated by ``;``, possibly after ``<|python_tag|>``.

- A whole text, as vLLM's: without ``<|python_tag|>`` and without ``{`` it is content. Else
  each ``{`` past the end of the last object read starts an object, read as JSON to its end
  (vLLM skips a ``{`` right at that end too: only objects apart are read); each is a call,
  ``arguments`` being ``json.dumps`` of its ``arguments`` (its ``parameters`` without them).
  One that does not parse, or lacks a string ``name`` or both keys, makes the whole text
  content with no calls. With calls the content is null: text around the objects is dropped.
- A stream, as vLLM's: the text is read for calls only when it starts with ``{`` or
  ``<|python_tag|>`` (text that may be the start of the tag is held back until the next text
  shows whether it is); any other text is content as it comes. Each object is scanned as JSON
  as it arrives (``call_scanner``): a call's header (index, id, type, name) once its name's
  string closed, then its arguments value's text as written, in argument deltas (the whole
  response's ``json.dumps`` when the model spaces JSON as ``json.dumps`` does; vLLM
  re-serialises a partial parse). Text between objects is dropped. After ``<|python_tag|>``
  the text is held until a ``{`` comes, and released as content if none does, as the whole
  response has it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from router.gateway.call_scanner import CallScanner

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def parse_llama3_json(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole text's content and its calls, (name, arguments JSON) each; (text, []) without
    calls, or when an object does not parse."""
    if PYTHON_TAG not in text and "{" not in text:
        return text, []
    calls = []
    end = -1  # where the last object read ends
    start = text.find("{")
    while start >= 0:
        if start > end:
            try:
                call, end = _DECODER.raw_decode(text, start)
            except (ValueError, RecursionError):
                return text, []
            name = call.get("name")
            key = "arguments" if "arguments" in call else "parameters"
            if not isinstance(name, str) or key not in call:
                return text, []
            calls.append((name, json.dumps(call[key], ensure_ascii=False)))
        start = text.find("{", start + 1)
    return (None, calls) if calls else (text, [])


class Llama3JsonCallStream:
    """One choice's streamed text read for llama3_json tool calls: ``feed`` each text delta,
    then ``end`` once the sample ended."""

    def __init__(self) -> None:
        self.num_calls = 0  # calls whose header was sent
        # "undecided": the text so far may be the start of <|python_tag|>; "content": it is
        # not calls; "calls": it starts with "{" or the tag
        self._mode: Literal["undecided", "content", "calls"] = "undecided"
        self._held = ""  # undecided text, or the calls' text before their first "{"
        self._before_object = True  # no "{" came yet
        self._scanner = CallScanner(
            arguments_keys=("arguments", "parameters"), separated_by_text=True
        )
        self._scanner.feed("[")  # the objects scan as an array's calls

    @property
    def block_open(self) -> bool:
        """Whether the text ends inside a call object."""
        return self._scanner.depth > 1

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool_calls entries of a delta of ``text``."""
        if self._mode == "content":
            return text, []
        rest = self._held + text
        if self._mode == "undecided":
            if not rest.startswith(("{", PYTHON_TAG)):
                if PYTHON_TAG.startswith(rest):
                    self._held = rest
                    return "", []
                self._mode, self._held = "content", ""
                return rest, []
            self._mode = "calls"
        if self._before_object:
            at = rest.find("{")
            if at < 0:
                self._held = rest
                return "", []
            rest, self._held, self._before_object = rest[at:], "", False
        entries = self._scanner.feed(rest)
        self.num_calls = self._scanner.num_headers
        return "", entries

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        """The content still held back once the sample ended: the start of the tag that never
        completed, or the text after the tag when no object came."""
        held, self._held = self._held, ""
        return held, []
