"""Tool calls read from a chat's free text in GLM-4.5's XML format, as vLLM's ``glm45`` (and
``glm47``) tool-call parsers read them: for ``tool_choice: "auto"``.

The model writes each call as ``<tool_call>``, the function's name, then per argument
``<arg_key>KEY</arg_key>`` and ``<arg_value>VALUE</arg_value>``, and ``</tool_call>``; GLM-4.5
puts a newline after the name and after each tag pair, GLM-4.7 none. The name ends at its
newline (newlines before it skipped), at the first ``<arg_key>`` or at ``</tool_call>``
(stripped); a key is stripped. A value is typed as vLLM's parser types it (``glm_value``): a
parameter whose schema in the request's tools says ``"type": "string"`` keeps its text as
written; any other is read as JSON, else as a Python literal, else kept as its stripped text.

- A whole text: content is the text before the first ``<tool_call>`` (None when it is empty or
  only whitespace, as vLLM normalises it); each call's ``arguments`` are ``json.dumps`` of its
  arguments (a key written twice keeps the later value). A value ends at ``</arg_value>``; one
  cut by ``</tool_call>`` or by the end of the text is dropped with its key, as vLLM's pattern
  does not match it. A first call whose name never ended (the text cut inside it) makes the
  whole text plain content with no calls, so nothing generated is lost (a later one is
  dropped); a call cut after its name is kept with the arguments that ended. Text between and
  after the calls is dropped.
- A stream (``tagged_calls.TaggedCallStream``): content deltas until the first ``<tool_call>``
  (text that may be the start of the tag held back until the next text shows whether it is,
  and content that is only whitespace until other text comes); then each call's header (index,
  id, type, name) with ``{`` once its name ended, each argument as ``"KEY": value`` (after the
  first, with ``, `` before it) once its value ended, and ``}`` at ``</tool_call>``: together
  the whole response's ``arguments``. A call cut by the end of the sample sends no ``}``; the
  finish_reason says ``length``. Calls that began but never had a name are sent as content at
  the end, as the whole response has them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from router.gateway.qwen3_coder_tool_calls import ToolParameters, literal_value
from router.gateway.tagged_calls import ReadCall, TaggedCallStream

START = "<tool_call>"
END = "</tool_call>"
KEY = "<arg_key>"
KEY_END = "</arg_key>"
VALUE = "<arg_value>"
VALUE_END = "</arg_value>"
_NAME_END = "\n"

_Part = Literal["content", "between", "name", "arguments", "key", "after_key", "value"]


def glm_value(text: str, schema: Any) -> Any:
    """An argument's written value as vLLM's glm45 parser reads it (``schema``: the parameter's
    schema in the request's tools, None when they do not name it): a ``"string"`` type keeps
    the text; otherwise the stripped text read as JSON (no NaN or infinities), else as a
    Python literal JSON can write, else the stripped text."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    stripped = text.strip()
    try:
        return json.loads(stripped, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        return literal_value(stripped)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


@dataclass(slots=True)
class _Reader:
    """The text after the content read call by call: ``feed`` pieces of it, cut at its tags."""

    parameters: ToolParameters  # the request's tools' parameter schemas
    calls: list[ReadCall] = field(default_factory=list)
    part: _Part = "content"
    buffer: str = ""  # the name, key or value being read
    key: str = ""  # the argument whose value is being read
    unnamed: bool = False  # a call's name never ended (whole: no calls)

    def tags(self) -> tuple[str, ...]:
        """The tags that end the part being read."""
        if self.part in ("content", "between"):
            return (START,)
        if self.part == "name":
            return (_NAME_END, KEY, END)
        if self.part == "arguments":
            return (KEY, END)
        if self.part == "key":
            return (KEY_END, END)
        if self.part == "after_key":
            return (VALUE, KEY, END)
        return (VALUE_END, END)

    def read(self, piece: str, tag: str | None) -> list[dict[str, Any]]:
        """The stream entries of ``piece`` (the text before ``tag``, or all there is when
        None), then of ``tag``; content is the caller's (``part == "content"``)."""
        if self.part in ("name", "key", "value"):
            self.buffer += piece
        if tag is None:
            return []
        if self.part in ("content", "between"):
            self.part, self.buffer = "name", ""
            return []
        if self.part == "name":
            return self._named(tag)
        if tag == END:  # the call ends, an argument open in it dropped
            return self._close()
        if self.part == "key":
            self.key, self.part = self.buffer.strip(), "after_key"
        elif self.part == "value":
            self.part = "arguments"
            return self._end_value()
        elif tag == VALUE:  # after a key
            self.part, self.buffer = "value", ""
        else:  # <arg_key>: a new key (one without a value dropped)
            self.part, self.buffer = "key", ""
        return []

    def _named(self, tag: str) -> list[dict[str, Any]]:
        if tag == _NAME_END and not self.buffer.strip():
            return []  # the newlines before the name
        call = ReadCall(len(self.calls), self.buffer.strip())
        self.calls.append(call)
        entries = [call.header()]
        if tag == END:
            return entries + self._close()
        self.part, self.buffer = ("key" if tag == KEY else "arguments"), ""
        return entries

    def finish(self) -> None:
        """The text ended: a first call's name being read never ended (a later call's is
        dropped, as the stream never sent it)."""
        if self.part == "name" and not self.calls:
            self.unnamed = True

    @property
    def in_call(self) -> bool:
        return self.part not in ("content", "between")

    def _end_value(self) -> list[dict[str, Any]]:
        call = self.calls[-1]
        typed = glm_value(self.buffer, self.parameters.get(call.name, {}).get(self.key))
        self.buffer = ""
        return [call.argument(self.key, typed)]

    def _close(self) -> list[dict[str, Any]]:
        self.part, self.buffer = "between", ""
        return [self.calls[-1].closing()]


def glm_stream(parameters: ToolParameters) -> TaggedCallStream:
    """A reader of one choice's streamed text for GLM-4.5's calls."""
    return TaggedCallStream(_Reader(parameters), blank_is_none=True)


def parse_glm(parameters: ToolParameters, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """A whole text's content and its calls, (name, arguments JSON) each; (text, []) without
    calls, or when the first call's name is cut short."""
    return glm_stream(parameters).parse(text)
