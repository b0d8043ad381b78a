"""Tool calls read from a chat's free text written as a Python list of calls, as vLLM's
``pythonic`` and ``llama4_pythonic`` tool-call parsers read them (Llama 3.2 and Llama 4 with
their pythonic templates, ToolACE): for ``tool_choice: "auto"``.

The model answers with calls alone: ``[get_weather(city="Paris", days=3), get_time()]``.

- A whole text is calls when all of it (trailing whitespace aside) is one Python list
  expression whose items are calls of a plain name with keyword arguments only, each a literal
  JSON can hold (strings, numbers, booleans, None, lists, tuples, dicts): each call's
  ``arguments`` is ``json.dumps`` of its keywords. It must open with ``[``, then the first
  call's name and ``(`` (spaces between them allowed). Anything else (prose, an empty list, a
  positional argument, an expression) is plain content, whole, so nothing generated is lost.
  ``llama4_pythonic``: a leading ``<|python_start|>`` and any ``<|python_end|>`` are dropped
  first, as Llama 4 writes them around its calls.
- A stream: text that cannot open a call list is content as it comes; text that opens one is
  held back until the sample ends, then sent as its calls (each call's header and whole
  arguments in one entry) or, when it is not a call list after all, as content. A list cut by
  ``max_tokens`` is content.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Literal

from router.gateway.call_scanner import header_entry

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
# how a call list opens: "[", then the first call's name and "("
_OPENING = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")
# what may still grow into that opening
_MAY_OPEN = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*)?")
_Dialect = Literal["pythonic", "llama4_pythonic"]


def parse_pythonic(dialect: _Dialect, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole text's content and its calls, (name, arguments JSON) each; (text, []) unless
    the text is a call list."""
    calls = _call_list(_unwrapped(dialect, text))
    return (None, calls) if calls else (text, [])


def _unwrapped(dialect: _Dialect, text: str) -> str:
    if dialect == "llama4_pythonic" and text.startswith(PYTHON_START):
        return text[len(PYTHON_START) :].replace(PYTHON_END, "")
    return text


def _call_list(text: str) -> list[tuple[str, str]] | None:
    """The calls of a text that is a call list; None when it is not one."""
    if not _OPENING.match(text):
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List):
        return None
    calls = []
    for item in tree.body.elts:
        call = _call(item)
        if call is None:
            return None
        calls.append(call)
    return calls


def _call(node: ast.expr) -> tuple[str, str] | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments: dict[str, Any] = {}
    try:
        for keyword in node.keywords:
            if keyword.arg is None:  # **mapping
                return None
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        return node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None  # not a literal, or not one JSON holds


class PythonicCallStream:
    """One choice's streamed text read for a call list: ``feed`` each text delta, then ``end``
    once the sample ended."""

    def __init__(self, dialect: _Dialect) -> None:
        self._dialect = dialect
        self.num_calls = 0  # calls whose header was sent
        self._held = ""  # the text while it may be, or opens, a call list
        # what the text is: not known yet, content (it cannot open a call list), or a call list
        # opened (held until the end shows whether it is one)
        self._reading: Literal["unknown", "content", "calls"] = "unknown"

    @property
    def block_open(self) -> bool:
        """Whether the text ends inside a call: never once the sample ended (a list cut short
        is content)."""
        return False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content and the tool_calls entries of a delta of ``text``."""
        if self._reading == "content":
            return text, []
        self._held += text
        if self._reading == "unknown":  # (once it opened, not looked at again until the end)
            self._reading = self._what_it_is(_unwrapped(self._dialect, self._held))
        if self._reading != "content":
            return "", []
        held, self._held = self._held, ""
        return held, []

    def end(self) -> tuple[str, list[dict[str, Any]]]:
        """The content still held back once the sample ended, or its calls."""
        held, self._held = self._held, ""
        calls = _call_list(_unwrapped(self._dialect, held)) if held else None
        if not calls:
            return held, []
        self.num_calls = len(calls)
        return "", [header_entry(i, name, arguments) for i, (name, arguments) in enumerate(calls)]

    def _what_it_is(self, text: str) -> Literal["unknown", "content", "calls"]:
        """What ``text`` (all there is so far) is: a call list's opening, what may still
        become one, or content."""
        if _OPENING.match(text):
            return "calls"
        if not text or _MAY_OPEN.fullmatch(text):
            return "unknown"
        if self._dialect == "llama4_pythonic" and PYTHON_START.startswith(text):
            return "unknown"  # (the wrapper's start, or all of it so far)
        return "content"
